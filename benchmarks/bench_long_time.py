"""Time of the long evaluation's 2P prefill (16k tokens of SmolLM2-135M-Instruct, P = 8192) for each remap, as a
ratio to the unpatched model timed in the same run (issue 53: at most 1.5x).

    python benchmarks/bench_long_time.py                      # every remap, 2 rounds, 2 threads
    python benchmarks/bench_long_time.py --threads 1 --rounds 3 "rope:remap=dca"

The pass timed is the one that dominates an entry of ``hf-posenc study --from smollm2 --long-eval``: the chunked
prefill of the 2P band window with a ``DynamicCache`` and the per-token loss (`hf_posenc.study.long._pass`, chunks
of P/8 = 1024), on the study's own data (`long_eval_entries._data`). Every entry is loaded once and kept; each round
times the unpatched model, then each entry, in that order (A B C ... A B C ...), so that drift of a shared machine
touches every entry alike; the ratio is the median over rounds of (entry's time / the same round's unpatched time).
Run it alone: the point is the time with the same threads and nothing else running. Prints a table and writes JSON
(``benchmarks/results/long_time_<device>.json``).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, device_name, slug, versions  # noqa: E402

#: the entries timed against the unpatched model: every remap at its defaults.
ENTRIES = ("rope:remap=rerope", "rope:remap=leaky_rerope", "rope:remap=self_extend", "rope:remap=dca")
#: the issue's bound on an entry's time over the unpatched model's.
TARGET = 1.5


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("entries", nargs="*", default=list(ENTRIES))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from long_eval_entries import _data
    from transformers import AutoModelForCausalLM

    import hf_posenc
    from hf_posenc.study.long import _pass
    from hf_posenc.study.recipes import parse_study_entry

    path, context, data, _ = _data(2)
    base = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
    models = {"unpatched": base}
    for spec in args.entries:
        model = copy.deepcopy(base)
        hf_posenc.patch_model(model, copy.deepcopy(parse_study_entry(spec).encoding))
        models[spec] = model
    cpu = torch.device("cpu")
    seconds: dict[str, list[float]] = {name: [] for name in models}
    for r in range(args.rounds):
        for name, model in models.items():
            nll = torch.zeros(data.window.numel() - 1, dtype=torch.float64)
            start = time.perf_counter()
            _pass(model, data.window, data.chunk, cpu, lambda n: None, nll=nll)
            seconds[name].append(round(time.perf_counter() - start, 2))
            print(f"round {r + 1}: {name}: {seconds[name][-1]} s", flush=True)
    rows = []
    for name in models:
        ratios = [s / u for s, u in zip(seconds[name], seconds["unpatched"])]
        ratio = statistics.median(ratios)
        rows.append({"entry": name, "seconds": seconds[name], "ratio": round(ratio, 3),
                     "ratios": [round(x, 3) for x in ratios], "meets_target": ratio <= TARGET})
    dev = device_name(cpu)
    result = {"benchmark": "long_time", "device_name": dev, "versions": versions(), "threads": args.threads,
              "rounds": args.rounds, "checkpoint": "SmolLM2-135M-Instruct", "context": context,
              "tokens": int(data.window.numel()), "chunk": data.chunk, "target": TARGET, "rows": rows}
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"long_time_{slug(dev)}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\n{dev}, {args.threads} thread(s), {data.window.numel()} tokens, median of {args.rounds} rounds")
    print(f"{'entry':32} {'seconds':>20} {'ratio':>7}  target <= {TARGET}")
    for row in rows:
        print(f"{row['entry']:32} {' / '.join(map(str, row['seconds'])):>20} {row['ratio']:7.3f}  "
              f"{'met' if row['meets_target'] else 'MISSED'}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
