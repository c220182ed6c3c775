"""Training step (forward + backward) of cape and comrope against the unpatched sdpa model, on the CPU.

The setting of issue 14: a 4-layer Llama (hidden 256, 8 heads, intermediate 688), batch 1, L = 2048,
2 threads. Each round times one training step of every model in turn (A B A B ...), and the ratio is the
median of a model's steps over the median of the unpatched model's steps in the same run. Peak memory is
measured in a fresh subprocess per model: the rise of the peak resident set (VmHWM, reset through
/proc/self/clear_refs) over one training step after a warm-up step.

    PYTHONPATH=. python benchmarks/bench_cape_comrope_cpu.py [--length 2048] [--rounds 5] [--threads 2]

Writes benchmarks/results/train_cape_comrope_<device>_L<length>_t<threads>.json and prints a table. On a
shared machine the absolute times move with the load; the ratios, timed interleaved, move less. What was
measured with it, and why with one thread: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_posenc  # noqa: E402
from _common import ROOT, device_name, slug, versions  # noqa: E402

BASELINE = "unpatched (sdpa)"


def build(encodings: list[str], length: int, seed: int) -> dict[str, torch.nn.Module]:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=8, max_position_embeddings=length, attn_implementation="sdpa",
    )
    unpatched = LlamaForCausalLM(config).float().train()
    models = {BASELINE: unpatched}
    for name in encodings:
        models[name] = hf_posenc.patch_model(copy.deepcopy(unpatched), name).train()
    return models


def step(model: torch.nn.Module, ids: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def measure_memory(name: str, length: int, seed: int, threads: int) -> dict:
    """Run in a subprocess: peak RSS rise (MiB) over one training step of ``name``, after a warm-up step."""
    torch.set_num_threads(threads)
    models = build([] if name == BASELINE else [name], length, seed)
    model = models[name]
    ids = torch.randint(0, 256, (1, length))
    step(model, ids)
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    before = _status_kib("VmRSS")
    step(model, ids)
    return {"peak_rise_mib": (_status_kib("VmHWM") - before) / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--encodings", nargs="+", default=["cape", "comrope"])
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    parser.add_argument("--_memory_of", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._memory_of is not None:
        print(json.dumps(measure_memory(args._memory_of, args.length, args.seed, args.threads)))
        return
    if args.length < 1 or args.rounds < 1 or args.warmup < 0 or args.threads < 1:
        parser.error("length, rounds, threads must be >= 1 and warmup >= 0")
    unknown = sorted(set(args.encodings) - set(hf_posenc.list_encodings()))
    if unknown:
        parser.error(f"unknown encoding(s) {unknown}; known: {hf_posenc.list_encodings()}")

    torch.set_num_threads(args.threads)
    models = build(args.encodings, args.length, args.seed)
    ids = torch.randint(0, 256, (1, args.length))
    load_before = os.getloadavg()
    for model in models.values():
        for _ in range(args.warmup):
            step(model, ids)
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(args.rounds):
        for name, model in models.items():  # interleaved: A B A B
            t0 = time.perf_counter()
            step(model, ids)
            times[name].append(time.perf_counter() - t0)
    load_after = os.getloadavg()
    base = statistics.median(times[BASELINE])
    rows = {
        name: {"median_s": statistics.median(t), "ratio": statistics.median(t) / base, "samples_s": t}
        for name, t in times.items()
    }
    if not args.no_memory:
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        for name in models:
            out = subprocess.run(
                [sys.executable, __file__, "--_memory_of", name, "--length", str(args.length), "--threads",
                 str(args.threads), "--seed", str(args.seed)],
                capture_output=True, text=True, env=env, check=True,
            )
            rows[name].update(json.loads(out.stdout.strip().splitlines()[-1]))
        base_mem = rows[BASELINE]["peak_rise_mib"]
        for name in models:
            rows[name]["memory_ratio"] = rows[name]["peak_rise_mib"] / base_mem

    device = device_name(torch.device("cpu"))
    result = {
        "benchmark": "training step (forward + backward), CPU",
        "model": "LlamaForCausalLM 4 layers, hidden 256, 8 heads, intermediate 688, batch 1",
        "baseline": "LlamaForCausalLM, attn_implementation='sdpa'",
        "length": args.length,
        "threads": args.threads,
        "rounds": args.rounds,
        "device": device,
        "loadavg_before": load_before,
        "loadavg_after": load_after,
        "note": "shared machine, loaded by other processes; ratios timed interleaved in the same run",
        "versions": versions(),
        "results": rows,
    }
    out_dir = ROOT / "benchmarks" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"train_cape_comrope_{slug(device)}_L{args.length}_t{args.threads}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"{device}, L={args.length}, {args.threads} threads, {args.rounds} rounds, load {load_before[0]:.1f}")
    print(f"{'model':<20} {'step (s)':>9} {'ratio':>7} {'peak MiB':>9} {'mem ratio':>9}")
    for name, row in rows.items():
        mem = f"{row['peak_rise_mib']:9.0f} {row['memory_ratio']:9.2f}" if "peak_rise_mib" in row else ""
        print(f"{name:<20} {row['median_s']:9.3f} {row['ratio']:6.2f}x {mem}")
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
