"""Training step of a small Llama with ``cope`` and ``sba`` (the tile-wise PyTorch engines) on the CPU, against
the unpatched model with sdpa, and against x-transformers' CoPE.

    python benchmarks/bench_cope_sba_cpu.py                       # L = 2048, 2 threads, sba + cope + x-transformers
    PYTHONPATH=/tmp/xt python benchmarks/bench_cope_sba_cpu.py    # x-transformers importable from /tmp/xt
    python benchmarks/bench_cope_sba_cpu.py --lengths 1024 --no-xt --blocks 128x256 256x256

The model: a 4-layer Llama, hidden 256, 8 heads (8 key/value heads), intermediate 688, vocab 256, batch 1,
float32 (the setting of issue 14). One training step = forward with labels + backward (gradients zeroed
before each step, no optimizer). Every hf_posenc model is a deep copy of one unpatched model
(``attn_implementation="sdpa"``), patched with the encoding's defaults (cope: npos_max = 64; sba: the
paper's default, diagonal excluded, remainder discarded).

x-transformers (``pip install --no-deps --target /tmp/xt x-transformers einops einx loguru
torch-einops-utils frozendict``, put on PYTHONPATH only for this script): ``TransformerWrapper`` with a
``Decoder(dim=256, depth=4, heads=8, attn_use_cope=True, attn_cope_max_pos=64)`` and no absolute position
embedding -- the same width, depth, heads and CoPE table size (its feed-forward is its default GELU MLP,
4x256, against Llama's SwiGLU 688: a similar parameter count; the attention dominates at this length).

Time: median over interleaved rounds (A B A B ...: every model once per round, in turn) after a warmup
step, as a ratio to the unpatched model in the same run. Other processes on the machine skew the absolute
times; the interleaving keeps the ratios comparable (the load average is recorded). Peak memory: each model
runs one training step in a fresh subprocess; peak = the peak resident size during the step (VmHWM, reset
just before it) minus the resident size before it (model, inputs and one earlier step already in memory).

``--blocks BMxBN ...`` times the hf_posenc engines at several (query block, key tile) sizes (module
attributes ``BLOCK_M``/``BLOCK_N`` of ``hf_posenc.kernels.{sba,cope}.tiled``). Prints a markdown table and
writes JSON (default ``benchmarks/results/cope_sba_cpu_<device-name>.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import device_name, slug, versions  # noqa: E402

BASELINE = "unpatched (sdpa)"
XT = "x-transformers cope"
ENGINES = {"sba": "hf_posenc.kernels.sba.tiled", "cope": "hf_posenc.kernels.cope.tiled"}


def llama_config(length: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=8, max_position_embeddings=length, attn_implementation="sdpa",
    )


def build(name: str, length: int, seed: int = 0) -> torch.nn.Module:
    """The unpatched Llama, a patched copy (``sba``, ``cope``) or the x-transformers CoPE model."""
    torch.manual_seed(seed)
    if name == XT:
        from x_transformers import Decoder, TransformerWrapper

        return TransformerWrapper(
            num_tokens=256, max_seq_len=length, use_abs_pos_emb=False,
            attn_layers=Decoder(dim=256, depth=4, heads=8, attn_use_cope=True, attn_cope_max_pos=64),
        )
    from transformers import LlamaForCausalLM

    import hf_posenc

    model = LlamaForCausalLM(llama_config(length))
    if name != BASELINE:
        model = hf_posenc.patch_model(model, name.split("@")[0])
    return model


def set_blocks(name: str) -> None:
    """``cope@128x256``: set the engine's BLOCK_M, BLOCK_N."""
    if "@" not in name:
        return
    import importlib

    enc, blocks = name.split("@")
    bm, bn = (int(x) for x in blocks.split("x"))
    mod = importlib.import_module(ENGINES[enc])
    mod.BLOCK_M, mod.BLOCK_N = bm, bn


def step(model: torch.nn.Module, name: str, ids: torch.Tensor) -> None:
    """One training step: forward with a next-token loss, backward."""
    for p in model.parameters():
        p.grad = None
    if name == XT:
        logits = model(ids)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    else:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    """This process's peak resident size (VmHWM): per address space, so not inherited from the parent as
    ``ru_maxrss`` is (Linux keeps ru_maxrss across fork and exec), and reset by `reset_peak`."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmHWM in /proc/self/status")


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size


def child_memory(name: str, length: int, threads: int) -> None:
    """(subprocess) peak extra bytes of one training step, printed as JSON."""
    torch.set_num_threads(threads)
    set_blocks(name)
    model = build(name, length).train()
    ids = torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(1))
    step(model, name, ids)  # gradients allocated, lazy inits done
    reset_peak()
    before = rss()
    step(model, name, ids)
    print(json.dumps({"peak_extra_bytes": peak_rss() - before}))


def measure_memory(name: str, length: int, threads: int) -> int | None:
    cmd = [sys.executable, __file__, "--child-memory", name, "--lengths", str(length), "--threads", str(threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    if proc.returncode != 0:
        print(f"memory of {name} at L={length} failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])["peak_extra_bytes"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--encodings", nargs="+", default=["sba", "cope"], choices=sorted(ENGINES))
    parser.add_argument("--lengths", nargs="+", type=int, default=[2048])
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds; the median is reported")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--blocks", nargs="*", default=[], help="extra BMxBN tile sizes to time (e.g. 128x256)")
    parser.add_argument("--no-xt", action="store_true", help="skip x-transformers even if importable")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    parser.add_argument("--no-time", action="store_true", help="peak memory only (no timing rounds)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--child-memory", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_memory is not None:
        child_memory(args.child_memory, args.lengths[0], args.threads)
        return
    torch.set_num_threads(args.threads)

    names = [BASELINE] + list(args.encodings)
    names += [f"{enc}@{b}" for enc in args.encodings for b in args.blocks]
    xt_error = None
    if not args.no_xt:
        try:
            import x_transformers  # noqa: F401

            names.append(XT)
        except ImportError as exc:
            xt_error = f"{type(exc).__name__}: {exc}"
            print(f"x-transformers not importable ({xt_error}); skipped", file=sys.stderr)

    dev = device_name(torch.device("cpu"))
    load_before = os.getloadavg()
    t_start = time.perf_counter()
    results = []
    for length in args.lengths:
        ids = torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(1))
        models = {}
        for name in ([] if args.no_time else names):
            set_blocks(name)
            models[name] = build(name, length).train()
            step(models[name], name, ids)  # warmup
        times: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(0 if args.no_time else args.repeats):
            for name in names:
                set_blocks(name)
                t0 = time.perf_counter()
                step(models[name], name, ids)
                times[name].append(time.perf_counter() - t0)
            print(f"L={length}: " + ", ".join(f"{n} {times[n][-1]:.2f}s" for n in names), file=sys.stderr, flush=True)
        del models
        memory = {name: (None if args.no_memory else measure_memory(name, length, args.threads)) for name in names}
        base_t = statistics.median(times[BASELINE]) if times[BASELINE] else None
        for name in names:
            med = statistics.median(times[name]) if times[name] else None
            results.append({
                "model": name, "length": length, "step_s": med, "ratio": med / base_t if med else None,
                "samples_s": times[name],
                "peak_extra_bytes": memory[name],
                "memory_ratio": (memory[name] / memory[BASELINE]) if memory[name] and memory[BASELINE] else None,
            })
    load_after = os.getloadavg()

    print()
    print(f"Training step (forward + backward), fp32, batch 1, Llama 4 layers / hidden 256 / 8 heads on {dev} "
          f"({args.threads} threads); median of {args.repeats} interleaved rounds; ratios to {BASELINE}. "
          f"Load average {load_before[0]:.1f} -> {load_after[0]:.1f} (a shared machine).")
    print()
    print("| model | L | step (s) | ratio | peak extra memory (MB) | memory ratio |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in results:
        mem = "-" if r["peak_extra_bytes"] is None else f"{r['peak_extra_bytes'] / 1e6:.0f}"
        mratio = "-" if r["memory_ratio"] is None else f"{r['memory_ratio']:.2f}x"
        t = "-" if r["step_s"] is None else f"{r['step_s']:.3f}"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        print(f"| {r['model']} | {r['length']} | {t} | {ratio} | {mem} | {mratio} |")
    by = {(r["model"], r["length"]): r for r in results}
    comparisons = []
    for length in args.lengths:
        ours, theirs = by.get(("cope", length)), by.get((XT, length))
        if ours and theirs:
            comp = {"length": length, "speedup": theirs["step_s"] / ours["step_s"] if ours["step_s"] else None}
            if ours["peak_extra_bytes"] and theirs["peak_extra_bytes"]:
                comp["memory_fraction"] = ours["peak_extra_bytes"] / theirs["peak_extra_bytes"]
            comparisons.append(comp)
            mem = f", memory {comp['memory_fraction']:.3f} of theirs" if "memory_fraction" in comp else ""
            speed = f"{comp['speedup']:.1f}x faster" if comp["speedup"] else "not timed"
            print(f"\ncope vs x-transformers CoPE at L={length}: {speed}{mem}")

    out = Path(args.out) if args.out else Path(__file__).parent / "results" / f"cope_sba_cpu_{slug(dev)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "cope_sba_cpu_training_step",
        "device_name": dev,
        "threads": args.threads,
        "versions": versions(),
        "x_transformers": None if xt_error or args.no_xt else __import__("x_transformers").__name__,
        "x_transformers_error": xt_error,
        "loadavg_before": load_before,
        "loadavg_after": load_after,
        "note": "shared 2-core machine loaded by other processes; ratios are within one interleaved run",
        "wall_s": time.perf_counter() - t_start,
        "results": results,
        "cope_vs_x_transformers": comparisons,
    }, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
