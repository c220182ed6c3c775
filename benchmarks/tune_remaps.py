"""Choose the remaps' w, g and s on text the long evaluation never reads (issue 53).

    python benchmarks/tune_remaps.py                                   # the candidates below, 1 thread
    python benchmarks/tune_remaps.py --candidates "rope:remap=dca" "rope:remap=dca,remap_chunk=4096"

The long-context table (``hf-posenc study --from smollm2 --long-eval``) scores the last 2P tokens of the study's
text (Python's documentation in SmolLM2's tokenizer; P = 8192). This script scores the 2P tokens just before them
(the tuning window: never part of the table's evaluation, and unused by the zero-shot entries, which do not
fine-tune): perplexity on [P, 2P) and on [P/2, P), each target predicted from every token before it in the window,
by one chunked prefill with a ``DynamicCache`` (chunks of 1024). Candidates are study-style entries
(``rope:remap=...``). Prints a table and writes JSON (``benchmarks/results/tune_remaps_<device>.json``), appending
each candidate as it finishes (``--resume`` skips those already there).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, device_name, slug, versions  # noqa: E402
from bench_long_memory import parse_recipe  # noqa: E402

#: the authors' defaults (P/8 ... ) and one step to each side of the parameter each remap is most sensitive to.
CANDIDATES = (
    "rope:remap=rerope", "rope:remap=rerope,remap_window=2048",
    "rope:remap=leaky_rerope", "rope:remap=leaky_rerope,remap_group=8",
    "rope:remap=self_extend", "rope:remap=self_extend,remap_group=4",
    "rope:remap=dca", "rope:remap=dca,remap_chunk=4096,remap_window=512",
)


@torch.no_grad()
def window_nll(model, ids: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """The next-token NLL (L − 1,) float64 of ``ids`` (L,), by a chunked prefill through a DynamicCache."""
    from transformers import DynamicCache

    import inspect

    cache = DynamicCache()
    # transformers 5.24 renamed the cache argument (the old name is deprecated); 5.17 knows only the old one
    keyword = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    out = torch.empty(ids.numel() - 1, dtype=torch.float64)
    for start in range(0, ids.numel(), chunk):
        piece = ids[start : start + chunk]
        logits = model(piece[None], **{keyword: cache}, use_cache=True).logits[0].float()
        targets = ids[start + 1 : start + 1 + piece.numel()]
        nll = torch.nn.functional.cross_entropy(logits[: targets.numel()], targets, reduction="none")
        out[start : start + targets.numel()] = nll.double()
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--candidates", nargs="+", default=list(CANDIDATES))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    import hf_posenc
    from hf_posenc.study.long import context_length
    from hf_posenc.study.pretrained import _english_text
    from hf_posenc.testing import smollm2

    path = smollm2()
    context = context_length(AutoConfig.from_pretrained(path))
    text, source = _english_text()
    ids = torch.tensor(AutoTokenizer.from_pretrained(path)(text, add_special_tokens=False)["input_ids"])
    window = ids[-4 * context : -2 * context]  # the 2P tokens before the table's evaluation window
    base = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
    dev = device_name(torch.device("cpu"))
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"tune_remaps_{slug(dev)}.json"
    data = json.loads(out.read_text()) if args.resume and out.exists() else {
        "benchmark": "tune_remaps", "device_name": dev, "versions": versions(), "threads": args.threads,
        "checkpoint": "SmolLM2-135M-Instruct", "context": context, "source": source,
        "window": f"tokens [{ids.numel() - 4 * context}, {ids.numel() - 2 * context}) of {ids.numel()} (the table "
                  "scores the last 2P)", "rows": []}
    done = {row["candidate"] for row in data["rows"]}
    for candidate in args.candidates:
        if candidate in done:
            continue
        name, params = parse_recipe(candidate)
        model = base if name is None else hf_posenc.patch_model(copy.deepcopy(base), name, **params)
        t0 = time.perf_counter()
        nll = window_nll(model, window)
        row = {"candidate": candidate, "seconds": round(time.perf_counter() - t0, 1),
               "position_encoding": None if name is None else model.config.position_encoding}
        for lo, hi in ((context // 2, context), (context, 2 * context)):
            row[f"ppl_{lo}_{hi}"] = round(math.exp(float(nll[lo - 1 : hi - 1].mean())), 3)
        data["rows"].append(row)
        out.write_text(json.dumps(data, indent=1) + "\n")
        print(json.dumps(row), flush=True)
    lo, mid, hi = context // 2, context, 2 * context
    print(f"\n| candidate | [{lo}, {mid}) | [{mid}, {hi}) | seconds |\n|---|---:|---:|---:|")
    for row in data["rows"]:
        print(f"| `{row['candidate']}` | {row[f'ppl_{lo}_{mid}']} | {row[f'ppl_{mid}_{hi}']} | {row['seconds']} |")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
