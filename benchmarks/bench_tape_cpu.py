"""TAPE's training step on the CPU, as a ratio to the same Llama unpatched (sdpa), time and peak memory.

    python benchmarks/bench_tape_cpu.py                      # the issue's setting: L = 2048, 2 threads
    python benchmarks/bench_tape_cpu.py --length 1024 --rounds 3

Setting (issue 14's CPU target for ``tape``: time <= 2x, peak memory <= 1.5x): a 4-layer Llama, hidden 256,
8 heads (head_dim 32), intermediate 1024, vocabulary 512, batch 1, fp32, train mode, ``--threads`` threads.
One training step = forward with labels + backward (no optimizer). Both models have the same weights (the
patched one is a deep copy of the unpatched one, patched with ``tape`` at its defaults).

Time: the two models alternate (A B A B ...) after one warm-up step each; the median over ``--rounds`` rounds
is reported, so slow drift of the machine hits both alike. On a machine shared with other jobs the absolute
times are noisy; the ratio is what to read.

Peak memory: each model runs one step in a fresh child process; the peak resident set size reached during
that step (VmHWM, reset through /proc/self/clear_refs just before it) minus the resident size before it.

Prints a markdown table and writes JSON (default ``benchmarks/results/tape_cpu_<device-name>.json``).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, device_name, slug, versions  # noqa: E402

import hf_posenc  # noqa: E402

BASELINE = "unpatched (sdpa)"


def build(length: int, patched: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=8, max_position_embeddings=max(2048, length), attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(cfg)
    if patched:
        model = hf_posenc.patch_model(copy.deepcopy(model), "tape")
    return model.train()


def step(model: torch.nn.Module, ids: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    model(ids, labels=ids, use_cache=False).loss.backward()


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def child_peak(length: int, patched: bool, threads: int) -> None:
    """Run in a child process: print the peak extra resident bytes of one training step."""
    torch.set_num_threads(threads)
    model = build(length, patched)
    ids = torch.randint(0, 512, (1, length), generator=torch.Generator().manual_seed(0))
    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    step(model, ids)
    print(json.dumps({"peak_bytes": _status("VmHWM") - before}))


def peak(length: int, patched: bool, threads: int) -> int:
    cmd = [sys.executable, __file__, "--child-peak", "tape" if patched else "none", "--length", str(length),
           "--threads", str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_bytes"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--child-peak", choices=("none", "tape"), default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_peak is not None:
        child_peak(args.length, args.child_peak == "tape", args.threads)
        return

    torch.set_num_threads(args.threads)
    models = {BASELINE: build(args.length, False), "tape": build(args.length, True)}
    ids = torch.randint(0, 512, (1, args.length), generator=torch.Generator().manual_seed(0))
    for model in models.values():  # warm-up
        step(model, ids)
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(args.rounds):
        for name, model in models.items():
            start = time.perf_counter()
            step(model, ids)
            times[name].append(time.perf_counter() - start)
    peaks = {BASELINE: peak(args.length, False, args.threads), "tape": peak(args.length, True, args.threads)}

    med = {name: statistics.median(t) for name, t in times.items()}
    rows = []
    for name in models:
        rows.append({
            "model": name,
            "step_s_median": med[name],
            "step_s_all": times[name],
            "time_ratio": med[name] / med[BASELINE],
            "peak_extra_bytes": peaks[name],
            "memory_ratio": peaks[name] / peaks[BASELINE],
        })
    device = device_name(torch.device("cpu"))
    result = {
        "benchmark": "tape training step vs unpatched sdpa (CPU)",
        "setting": {"layers": 4, "hidden": 256, "heads": 8, "intermediate": 1024, "vocab": 512, "batch": 1,
                    "length": args.length, "threads": args.threads, "rounds": args.rounds, "dtype": "float32"},
        "targets": {"time_ratio": 2.0, "memory_ratio": 1.5},
        "device": device,
        "versions": versions(),
        "rows": rows,
    }
    out = args.out or ROOT / "benchmarks" / "results" / f"tape_cpu_{slug(device)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{device}, {args.threads} threads, L = {args.length}, median of {args.rounds} interleaved rounds")
    print("| model | step (s) | time ratio | peak extra (MB) | memory ratio |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['step_s_median']:.3f} | {r['time_ratio']:.2f}x | "
              f"{r['peak_extra_bytes'] / 2**20:.0f} | {r['memory_ratio']:.2f}x |")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
