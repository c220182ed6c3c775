"""The study's long evaluation (``hf-posenc study --from smollm2 --long-eval``) of chosen zero-shot entries, each in a
process of its own, without the study's fine-tunes and without re-evaluating the unpatched model.

    python benchmarks/long_eval_entries.py --factor 4 --jobs 2 \
        "rope:remap=self_extend" "rope:eval_scaling=yarn,eval_factor=4"

The data is the study's own for seed 0 (Python's documentation in SmolLM2-135M-Instruct's tokenizer, the last FP
tokens held out, the passkey haystack and its key from the study's seed), built by the same functions
(`hf_posenc.study.long.make_long_eval`, `evaluate_long`), so its rows sit beside the study's. Entries use the
study's syntax (`hf_posenc.study.recipes.parse_study_entry`; ``eval_scaling`` entries are re-patched by
`apply_eval_scaling` as the study does), or ``unpatched``: the checkpoint as transformers runs it. At 4P = 32k
tokens one entry is two prefills of 32k: about an hour on one thread of the 2-core VM. Writes JSON (``benchmarks/results/long_eval_<F>p_<device>.json``), each entry as it
finishes (``--resume`` keeps those already there).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, device_name, slug, versions  # noqa: E402


def _data(factor: int):
    from transformers import AutoConfig, AutoTokenizer

    from hf_posenc.study.long import context_length, make_long_eval
    from hf_posenc.study.pretrained import TRAIN_FRACTION, _english_text
    from hf_posenc.study.sources import subseed
    from hf_posenc.testing import smollm2

    path = smollm2()
    tokenizer = AutoTokenizer.from_pretrained(path)
    text, source = _english_text()
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    context = context_length(AutoConfig.from_pretrained(path))
    cut = min(int(ids.numel() * TRAIN_FRACTION), ids.numel() - factor * context)
    return path, context, make_long_eval(tokenizer, ids[cut:], context, subseed(0, "passkey"), None,
                                         positions=(0.25,), factor=factor), source


#: the entry that evaluates the checkpoint without patching it
UNPATCHED = "unpatched"


def evaluate(spec: str, factor: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    from transformers import AutoModelForCausalLM

    import hf_posenc
    from hf_posenc.study.recipes import apply_eval_scaling, parse_study_entry

    path, context, data, _ = _data(factor)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
    if spec == UNPATCHED:  # the checkpoint as transformers runs it
        label, encoding = UNPATCHED, None
    else:
        entry = parse_study_entry(spec)
        hf_posenc.patch_model(model, copy.deepcopy(entry.encoding))
        label, encoding = entry.label, model.config.position_encoding
        if entry.eval_scaling is not None:
            encoding = apply_eval_scaling(model, entry, context, factor * context)
    from hf_posenc.study.long import evaluate_long

    result = evaluate_long(model, data, torch.device("cpu"), progress=False, label=label)
    return {"entry": spec, "label": label, "position_encoding": encoding, **result}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("entries", nargs="+")
    parser.add_argument("--factor", type=int, default=4)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args(argv)
    dev = device_name(torch.device("cpu"))
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"long_eval_{args.factor}p_{slug(dev)}.json"
    data = json.loads(out.read_text()) if args.resume and out.exists() else {
        "benchmark": "long_eval_entries", "device_name": dev, "versions": versions(), "threads": args.threads,
        "checkpoint": "SmolLM2-135M-Instruct", "factor": args.factor,
        "data": "the study's (seed 0): the last FP tokens of Python's documentation, passkey key at P/4 of filler",
        "rows": []}
    todo = [e for e in args.entries if e not in {row["entry"] for row in data["rows"]}]
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futures = {pool.submit(evaluate, e, args.factor, args.threads): e for e in todo}
        for future in futures:
            row = future.result()
            data["rows"].append(row)
            out.write_text(json.dumps(data, indent=1) + "\n")
            bands = " ".join(f"[{b['band'][0]}, {b['band'][1]}): {b['perplexity']:.2f}" for b in row["bands"])
            keys = "".join("✓" if p["retrieved"] else "✗" for p in row["passkey"])
            print(f"{row['label']}: {bands}; passkey {keys}; {row['seconds']} s", flush=True)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
