"""Speed of every encoding on a real model's shape, SmolLM2-135M, on the CPU (issue 34).

    python benchmarks/bench_real_shape.py                                  # every encoding, 3 rounds, 2 threads
    python benchmarks/bench_real_shape.py --encodings fire cope --rounds 5 --threads 1

The other CPU benchmarks (bench_train_cpu.py, bench_forward.py) use a 4-layer Llama of hidden 256 with 8 heads
of dimension 32 and as many key/value heads. SmolLM2-135M is another shape: 30 layers, hidden 576, 9 query
heads and 3 key/value heads (grouped-query attention, 3:1) of dimension 64, a 49,152-token vocabulary. The
model is the real checkpoint (hf_posenc.testing.smollm2()) when it can be had, otherwise a random model of its
config (``--random`` forces that); the weights do not change the time of any encoding.

Per encoding, two measurements against the unpatched model (LlamaForCausalLM, attn_implementation="sdpa",
the same weights: deep copies of one model), batch 1, float32:

- the forward at ``--forward-length`` tokens (1,024; eval, inference_mode, use_cache=False);
- a training step at ``--train-length`` tokens (512; zero_grad, forward with labels, loss.backward()).

Each is timed in interleaved rounds, A (unpatched) then B (patched), ``--rounds`` times, and the ratio of the
medians is reported (each round's own B / A is kept too: its spread is how far one round can be off). Before
the rounds, each model runs one untimed forward and step at ``--warmup-length`` tokens (64): the one-time costs
of a first call (lazy tables, allocator growth) without the cost of a full-length call.

With ``--bench-shape`` (the default), the same measurements are taken, in the same run and at the same lengths,
on bench_train_cpu.py's 4-layer model, so that the two shapes are compared on the same machine at the same
load. Each real-shape ratio is also compared with the committed benchmark-shape ratios
(benchmarks/results/forward_cpu_L1024.json for the forward, train_cpu.json for the step -- the latter at its own
length, 2,048), and an encoding whose ratio is more than ``--flag`` (1.5) times its benchmark-shape ratio is
flagged.

Writes JSON (default ``benchmarks/results/real_shape_<cpu>.json``) with the CPU model, threads, rounds, date,
load average and every sample, and prints a table. Rows are also appended to ``<out>.partial.jsonl`` as they are
measured, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_posenc  # noqa: E402
from _common import append_row, device_name, slug, versions  # noqa: E402
from hf_posenc.testing import CheckpointUnavailable, check_smollm2_config, smollm2  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def smollm2_model(random: bool) -> tuple[LlamaForCausalLM, str]:
    """SmolLM2-135M (the real checkpoint, or a random model of its config) with sdpa attention, and its source."""
    source = "random weights, SmolLM2-135M's config"
    path = None
    if not random:
        try:
            path = smollm2()
        except CheckpointUnavailable as e:
            print(f"the real checkpoint is unavailable ({e}); using a random model of its config", file=sys.stderr)
    if path is not None:
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
        source = f"SmolLM2-135M-Instruct ({path})"
    else:
        config = AutoConfig.for_model(
            "llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
            num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
            rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, tie_word_embeddings=True,
            rms_norm_eps=1e-5, attn_implementation="sdpa",
        )
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    check_smollm2_config(model.config)
    return model, source


def bench_shape_model(length: int) -> LlamaForCausalLM:
    """bench_train_cpu.py's model: 4 layers, hidden 256, 8 heads (and 8 key/value heads) of dimension 32."""
    config = LlamaConfig(
        vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=8, max_position_embeddings=max(length, 2048), attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def forward_ms(model: torch.nn.Module, x: torch.Tensor) -> float:
    """One forward, eval mode, inference_mode, no cache (ms)."""
    model.eval()
    with torch.inference_mode():
        t0 = time.perf_counter()
        model(input_ids=x, use_cache=False)
        return (time.perf_counter() - t0) * 1e3


def step_ms(model: torch.nn.Module, x: torch.Tensor) -> float:
    """One training step: zero_grad, forward with labels, loss.backward() (ms)."""
    model.train()
    t0 = time.perf_counter()
    model.zero_grad(set_to_none=True)
    model(input_ids=x, labels=x, use_cache=False).loss.backward()
    ms = (time.perf_counter() - t0) * 1e3
    model.zero_grad(set_to_none=True)
    return ms


def ab(base: torch.nn.Module, model: torch.nn.Module, fn, x: torch.Tensor, rounds: int) -> dict:
    """``rounds`` interleaved rounds A (base) then B (model) of ``fn``: the ratio of the medians and every sample."""
    a, b = [], []
    for _ in range(rounds):
        a.append(fn(base, x))
        b.append(fn(model, x))
    return {"ratio": statistics.median(b) / statistics.median(a), "ms": statistics.median(b),
            "baseline_ms": statistics.median(a), "round_ratios": [q / p for p, q in zip(a, b)],
            "samples_ms": b, "baseline_samples_ms": a}


def committed_ratios() -> dict[str, dict[str, float]]:
    """The benchmark shape's committed ratios: {"forward": {encoding: ratio}, "train": {...}} (and their files)."""
    out: dict[str, dict[str, float]] = {"forward": {}, "train": {}}
    fwd = RESULTS / "forward_cpu_L1024.json"
    if fwd.is_file():
        for r in json.loads(fwd.read_text())["results"]:
            if r.get("length") == 1024 and r.get("model") != "unpatched (sdpa)" and "ratio" in r:
                out["forward"][r["model"]] = r["ratio"]
    train = RESULTS / "train_cpu.json"
    if train.is_file():
        for r in json.loads(train.read_text())["results"]:
            if "ratio" in r:
                out["train"][r["encoding"]] = r["ratio"]
    return out


def measure(base: torch.nn.Module, name: str, args, xs: dict[str, torch.Tensor], warm: dict[str, torch.Tensor]
            ) -> dict:
    model = hf_posenc.patch_model(copy.deepcopy(base), name)
    for m in (base, model):  # first-call costs, at a short length
        forward_ms(m, warm["forward"])
        step_ms(m, warm["train"])
    row = {"forward": ab(base, model, forward_ms, xs["forward"], args.rounds),
           "train": ab(base, model, step_ms, xs["train"], args.rounds)}
    del model
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--encodings", nargs="+", default=None, help="default: every registered encoding")
    parser.add_argument("--forward-length", type=int, default=1024)
    parser.add_argument("--train-length", type=int, default=512)
    parser.add_argument("--warmup-length", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved A B rounds per measurement (median)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--random", action="store_true", help="a random model of SmolLM2's config, not the checkpoint")
    parser.add_argument("--bench-shape", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure bench_train_cpu.py's 4-layer shape in the same run (default: yes)")
    parser.add_argument("--flag", type=float, default=1.5,
                        help="flag an encoding whose real-shape ratio exceeds this many times its benchmark-shape one")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/real_shape_<cpu>.json)")
    args = parser.parse_args()
    encodings = args.encodings or hf_posenc.list_encodings()
    unknown = sorted(set(encodings) - set(hf_posenc.list_encodings()))
    if unknown:
        parser.error(f"unknown encoding(s) {unknown}; known: {hf_posenc.list_encodings()}")
    if min(args.forward_length, args.train_length, args.warmup_length) < 2 or args.rounds < 1 or args.threads < 1:
        parser.error("lengths must be >= 2, rounds and threads >= 1")
    torch.set_num_threads(args.threads)
    dev = device_name(torch.device("cpu"))
    out = Path(args.out) if args.out else RESULTS / f"real_shape_{slug(dev)}.json"
    partial = str(out) + ".partial.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(partial).unlink(missing_ok=True)

    real, source = smollm2_model(args.random)
    shapes = {"smollm2": real}
    if args.bench_shape:
        shapes["bench"] = bench_shape_model(max(args.forward_length, args.train_length))
    committed = committed_ratios()
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    load_before = os.getloadavg()
    t_start = time.perf_counter()
    rows = []
    for name in encodings:
        row: dict = {"encoding": name}
        for shape, base in shapes.items():
            g = torch.Generator().manual_seed(0)
            vocab = base.config.vocab_size
            xs = {"forward": torch.randint(0, vocab, (1, args.forward_length), generator=g),
                  "train": torch.randint(0, vocab, (1, args.train_length), generator=g)}
            warm = {k: v[:, : args.warmup_length] for k, v in xs.items()}
            try:
                row[shape] = measure(base, name, args, xs, warm)
            except (ValueError, TypeError) as exc:
                row[shape] = {"error": str(exc)}
        real_row = row["smollm2"]
        if "error" not in real_row:
            for kind in ("forward", "train"):
                ref = committed[kind].get(name)
                real_row[kind]["committed_bench_ratio"] = ref
                real_row[kind]["vs_committed"] = None if ref is None else real_row[kind]["ratio"] / ref
                same = row.get("bench", {}).get(kind, {}).get("ratio")
                real_row[kind]["vs_same_run_bench"] = None if same is None else real_row[kind]["ratio"] / same
            real_row["flagged"] = any((real_row[k][c] or 0) > args.flag for k in ("forward", "train")
                                      for c in ("vs_committed", "vs_same_run_bench"))
        rows.append(row)
        append_row(partial, row)
        if "error" in real_row:
            print(f"{name}: {real_row['error']}", file=sys.stderr, flush=True)
        else:
            f, t = real_row["forward"], real_row["train"]
            print(f"{name}: forward {f['ratio']:.2f}x ({f['ms']:.0f} vs {f['baseline_ms']:.0f} ms), train "
                  f"{t['ratio']:.2f}x ({t['ms']:.0f} vs {t['baseline_ms']:.0f} ms)"
                  + (" FLAGGED" if real_row["flagged"] else "")
                  + f" [{time.perf_counter() - t_start:.0f} s]", file=sys.stderr, flush=True)

    def fmt(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.2f}x"

    print()
    print(f"SmolLM2-135M shape (30 layers, hidden 576, 9:3 heads of 64, vocab 49,152; {source}), B=1, float32, "
          f"{args.threads} thread(s), {dev}; forward at L={args.forward_length}, training step at "
          f"L={args.train_length}; ratio to the unpatched model (sdpa), median of {args.rounds} interleaved A B "
          f"rounds; load average {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after")
    print()
    print("| encoding | forward ratio | bench shape, same run | committed | training-step ratio "
          "| bench shape, same run | committed (L=2048) | flag |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        real_row = r["smollm2"]
        if "error" in real_row:
            print(f"| `{r['encoding']}` | error | | | | | | {real_row['error']} |")
            continue
        bench = r.get("bench", {})
        cells = []
        for kind in ("forward", "train"):
            cells += [fmt(real_row[kind]["ratio"]), fmt(bench.get(kind, {}).get("ratio")),
                      fmt(real_row[kind]["committed_bench_ratio"])]
        flag = f"> {args.flag}x" if real_row["flagged"] else ""
        print(f"| `{r['encoding']}` | " + " | ".join(cells) + f" | {flag} |")
    result = {
        "benchmark": "real_shape",
        "date_utc": started,
        "device_name": dev,
        "threads": args.threads,
        "rounds": args.rounds,
        "versions": versions(),
        "backend_env": os.environ.get("HF_POSENC_BACKEND"),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "wall_s": time.perf_counter() - t_start,
        "settings": {
            "model": source,
            "shape": {k: getattr(real.config, k) for k in (
                "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size")},
            "bench_shape": None if "bench" not in shapes else {k: getattr(shapes["bench"].config, k) for k in (
                "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "vocab_size")},
            "dtype": "float32", "batch": 1, "forward_length": args.forward_length,
            "train_length": args.train_length, "warmup_length": args.warmup_length,
            "forward": "eval, inference_mode, use_cache=False",
            "train": "zero_grad, forward with labels, loss.backward()",
            "baseline": "LlamaForCausalLM, attn_implementation='sdpa', same weights",
            "statistic": "ratio of medians over interleaved A B rounds (round_ratios: each round's B / its A)",
            "committed": "forward_cpu_L1024.json (L=1024), train_cpu.json (L=2048)",
            "flag": args.flag,
        },
        "results": rows,
    }
    out.write_text(json.dumps(result, indent=2) + "\n")
    Path(partial).unlink(missing_ok=True)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
