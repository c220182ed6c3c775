"""Forward time of a small Llama patched with each encoding, against the unpatched model with sdpa.

    python benchmarks/bench_forward.py                          # CPU, every encoding, L = 512, 1024, 2048
    python benchmarks/bench_forward.py --device cuda --encodings alibi rope --lengths 1024 4096

Eval mode, no grad, fp32, batch 1. Every model gets identical weights: one unpatched model (built with
``attn_implementation="sdpa"``) and a deep copy of it patched per encoding. Timing rounds are interleaved
(every model once per round, in turn), so slow drift of the machine hits all models alike; the reported
time is the median over the rounds, after warmup. Prints a markdown table (ms, and the ratio to the
unpatched model) and writes JSON (default ``benchmarks/results/forward_<device-name>.json``).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

import hf_posenc
from _common import device_name, slug

BASELINE = "unpatched (sdpa)"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--encodings", nargs="+", default=None, help="default: every registered encoding")
    parser.add_argument("--lengths", nargs="+", type=int, default=[512, 1024, 2048])
    parser.add_argument("--warmup", type=int, default=1, help="untimed forwards per model and length")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds; the median is reported")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/forward_<device>.json)")
    args = parser.parse_args()

    device = torch.device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    encodings = args.encodings or hf_posenc.list_encodings()
    unknown = sorted(set(encodings) - set(hf_posenc.list_encodings()))
    if unknown:
        parser.error(f"unknown encoding(s) {unknown}; known: {hf_posenc.list_encodings()}")
    if any(n < 1 for n in args.lengths) or args.repeats < 1 or args.warmup < 0:
        parser.error("lengths and repeats must be >= 1, warmup >= 0")

    torch.manual_seed(args.seed)
    config = LlamaConfig(
        vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=8, max_position_embeddings=max(args.lengths), attn_implementation="sdpa",
    )
    unpatched = LlamaForCausalLM(config).to(device=device, dtype=torch.float32).eval()
    models = {BASELINE: unpatched}
    for name in encodings:
        models[name] = hf_posenc.patch_model(copy.deepcopy(unpatched), name).eval()

    load_before = os.getloadavg() if hasattr(os, "getloadavg") else None
    t_start = time.perf_counter()
    ms: dict[str, dict[int, float]] = {name: {} for name in models}
    samples: dict[str, dict[int, list[float]]] = {name: {} for name in models}
    with torch.inference_mode():
        for length in args.lengths:
            x = torch.randint(0, config.vocab_size, (1, length), device=device)
            for model in models.values():
                for _ in range(args.warmup):
                    model(input_ids=x, use_cache=False)
            times: dict[str, list[float]] = {name: [] for name in models}
            for _ in range(args.repeats):
                for name, model in models.items():
                    sync(device)
                    t0 = time.perf_counter()
                    model(input_ids=x, use_cache=False)
                    sync(device)
                    times[name].append((time.perf_counter() - t0) * 1e3)
            for name in models:
                samples[name][length] = times[name]
                ms[name][length] = statistics.median(times[name])
            row = ", ".join(f"{name} {ms[name][length]:.1f}" for name in models)
            print(f"L={length} (ms): {row}", file=sys.stderr, flush=True)

    dev_name = device_name(device)
    threads = torch.get_num_threads()
    print()
    print(f"Forward, eval, fp32, batch 1, Llama 4 layers / hidden 256 / 8 heads / vocab 256 on {dev_name} "
          f"({threads} thread(s)); median of {args.repeats} interleaved rounds after {args.warmup} warmup, ms "
          f"(ratio to {BASELINE})")
    print()
    print("| model | " + " | ".join(f"L={n}" for n in args.lengths) + " |")
    print("|---|" + "---:|" * len(args.lengths))
    for name in models:
        cells = [f"{ms[name][n]:.1f} ({ms[name][n] / ms[BASELINE][n]:.2f}x)" for n in args.lengths]
        print(f"| {'`' + name + '`' if name != BASELINE else name} | " + " | ".join(cells) + " |")

    out = Path(args.out) if args.out else Path(__file__).parent / "results" / f"forward_{slug(dev_name)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "benchmark": "forward",
        "device": str(device),
        "device_name": dev_name,
        "threads": threads,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "hf_posenc": hf_posenc.__version__,
        "python": platform.python_version(),
        "backend_env": os.environ.get("HF_POSENC_BACKEND"),
        # Other work on the machine skews the times (the rounds are interleaved, so the ratios less so).
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "wall_s": time.perf_counter() - t_start,
        "settings": {
            "model": {k: getattr(config, k) for k in (
                "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "vocab_size")},
            "dtype": "float32", "batch": 1, "mode": "eval, inference_mode, use_cache=False",
            "baseline": "LlamaForCausalLM, attn_implementation='sdpa'",
            "lengths": args.lengths, "warmup": args.warmup, "repeats": args.repeats, "seed": args.seed,
            "statistic": "median over interleaved rounds",
        },
        "results": [
            {"model": name, "length": n, "ms": ms[name][n], "ratio": ms[name][n] / ms[BASELINE][n],
             "samples_ms": samples[name][n]}
            for name in models for n in args.lengths
        ],
    }
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
