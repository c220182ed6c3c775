"""Time the fused stick-breaking (sba) and CoPE kernels against SDPA and their eager references.

    python benchmarks/bench_sba_cope.py                            # CUDA: B = 1, L = 1k..16k, sba and cope
    python benchmarks/bench_sba_cope.py --kinds cope --batches 1 4 --lengths 4096 --npos 32
    python benchmarks/bench_sba_cope.py --fwd-blocks 64,64,8 --bwd-blocks 64,32,4   # try other tiles
    python benchmarks/bench_sba_cope.py --smoke                    # CPU: tiny shapes, kernels under TRITON_INTERPRET=1

What is timed, in bfloat16, H = 32 query heads, D = 128, causal (``--heads``, ``--kv-heads``, ``--head-dim``,
``--dtype``):

* ``triton``: ``hf_posenc.kernels.sba.stick_breaking`` / ``hf_posenc.kernels.cope.cope``, the entry points
  the encodings' ``attend`` calls, which dispatch to the Triton kernels on CUDA;
* ``sdpa``: ``scaled_dot_product_attention`` on the flash backend, causal, no bias, at the same shape: the
  baseline of the design targets (../shared/DESIGN.md: sba <= 1.5x, cope <= 2.5x, forward+backward);
* ``eager``: the PyTorch references (``sba_reference``, ``cope_reference``: float32, several (B, H, L, L)
  tensors); where they run out of memory the row says so (``eager_oom``) instead of a time;

each in ``fwd`` (no gradients) and ``fwd+bwd`` (gradients of q, k, v, and of CoPE's position table).
Times are medians of CUDA-event timings after warmup; ``*_mb`` is the allocator's peak above what was
allocated before the call (for CoPE the design allows extra memory O(L·H·npos_max), never O(L²)). Each
configuration also checks the kernel's forward against the float32 reference where that fits in memory.
Prints a markdown table (ratios triton / sdpa and eager / triton) and writes JSON (default
``benchmarks/results/sba_cope_<device-name>.json``, same conventions as bench_attention.py: device, SM
count, versions of torch, CUDA, triton, transformers, git commit) and the table beside it (``.md``).

Without CUDA it exits with a message: speed is not measured on the CPU. ``--smoke`` runs tiny shapes
through the Triton interpreter instead (a correctness smoke run, nothing written).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

METHODS = ("triton", "sdpa", "eager")
KINDS = ("sba", "cope")


from _common import append_row, device_name, slug, versions  # noqa: E402  (benchmarks/ is on sys.path)


class Timer:
    """Median time (ms) of a callable (CUDA events on a GPU, wall clock on the CPU) and its peak memory (MB)."""

    def __init__(self, device: torch.device, budget_ms: float, warmup: int, max_reps: int):
        self.device, self.budget_ms, self.warmup, self.max_reps = device, budget_ms, warmup, max_reps

    def __call__(self, fn) -> tuple[float, float | None]:
        cuda = self.device.type == "cuda"
        for _ in range(self.warmup):
            fn()
        self._sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
        t0 = time.perf_counter()
        fn()
        self._sync()
        peak_mb = (torch.cuda.max_memory_allocated(self.device) - base) / 2**20 if cuda else None
        estimate_ms = max((time.perf_counter() - t0) * 1e3, 1e-3)
        reps = int(min(self.max_reps, max(3, self.budget_ms / estimate_ms)))
        times = []
        for _ in range(reps):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times), peak_mb

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class OutOfMemory:
    """The marker ``guarded`` returns when the call ran out of memory."""


def guarded(fn):
    """fn(), or an OutOfMemory marker when it runs out of memory (the eager references at large L do)."""
    try:
        return fn()
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return OutOfMemory()


def step(fn, tensors, params, gout, backward: bool):
    """A closure running fn(*tensors, *params) forward (and backward into all of them)."""
    if not backward:
        def run():
            with torch.no_grad():
                fn(*tensors, *params)

        return run
    leaves = [t.detach().requires_grad_() for t in tensors] + [p.detach().requires_grad_() for p in params]

    def run():
        for t in leaves:
            t.grad = None
        fn(*leaves).backward(gout)

    return run


def sdpa_step(q, k, v, gout, backward: bool):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    gqa = q.shape[1] != k.shape[1]

    def attention(q, k, v):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return sdpa(q, k, v, is_causal=True, enable_gqa=gqa)

    return step(attention, (q, k, v), (), gout, backward)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _blocks(text: str) -> tuple[int, int, int]:
    parts = tuple(int(x) for x in text.split(","))
    if len(parts) != 3:
        raise argparse.ArgumentTypeError("expected BLOCK_M,BLOCK_N,num_warps, e.g. 64,64,8")
    return parts


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    p.add_argument("--batches", nargs="+", type=int, default=[1])
    p.add_argument("--lengths", nargs="+", type=int, default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads (no GQA)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--npos", type=int, default=64, help="CoPE npos_max")
    p.add_argument("--remainder", default="discard", choices=["discard", "current", "bias"], help="sba remainder")
    p.add_argument("--attend-current", action="store_true", help="sba: the diagonal is a breakpoint")
    p.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--eager-max-length", type=int, default=16384, help="skip the eager references above this L")
    p.add_argument("--check-max-length", type=int, default=4096, help="check the kernel against fp32 up to this L")
    p.add_argument("--budget-ms", type=float, default=200.0, help="timed milliseconds per measurement (about)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--max-reps", type=int, default=50)
    p.add_argument("--fwd-blocks", type=_blocks, default=None,
                   help="override GPU_FWD of both kernel modules (bf16/fp16; float32 uses GPU_FP32)")
    p.add_argument("--bwd-q-blocks", type=_blocks, default=None, help="override GPU_BWD_Q (BLOCK_N shared with kv)")
    p.add_argument("--bwd-kv-blocks", type=_blocks, default=None, help="override GPU_BWD_KV")
    p.add_argument("--carry-slots", type=int, default=None, help="override CARRY_SLOTS (checkpoints per row)")
    p.add_argument("--rows-jsonl", default=None, help="also append each row to this JSON-lines file as measured")
    p.add_argument("--smoke", action="store_true", help="CPU: tiny shapes, interpreted kernels, nothing written")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/sba_cope_<device>.json)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    if args.smoke:
        if not cuda:
            os.environ["TRITON_INTERPRET"] = "1"  # the kernels are jitted lazily, in the mode in force then
        args.batches, args.lengths, args.heads, args.kv_heads, args.head_dim = [1], [77], 4, 1, 40
        args.budget_ms, args.warmup, args.max_reps = 1.0, 0, 1
        if not cuda:
            args.methods = [m for m in args.methods if m in ("triton", "eager")]
    elif not cuda:
        print(
            "bench_sba_cope.py times CUDA kernels and needs a CUDA GPU (torch.cuda.is_available() is False): "
            "speed is not measured here.\nOn the CPU, run `python benchmarks/bench_sba_cope.py --smoke` for a "
            "tiny interpreted correctness run.",
            file=sys.stderr,
        )
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    dtype = getattr(torch, args.dtype)
    kv_heads = args.kv_heads or args.heads
    if args.heads % kv_heads:
        print(f"--heads ({args.heads}) must be a multiple of --kv-heads ({kv_heads})", file=sys.stderr)
        return 2
    try:
        from hf_posenc.kernels.cope import cope, cope_backend, cope_reference
        from hf_posenc.kernels.cope import triton_cope
        from hf_posenc.kernels.sba import sba_backend, sba_reference, stick_breaking
        from hf_posenc.kernels.sba import triton_sba
    except ImportError as exc:
        print(f"the Triton kernels do not import ({exc}); install triton (pip install hf_posenc[triton])",
              file=sys.stderr)
        return 2
    for module in (triton_sba, triton_cope):
        for flag, attr in (("fwd_blocks", "GPU_FWD"), ("bwd_q_blocks", "GPU_BWD_Q"), ("bwd_kv_blocks", "GPU_BWD_KV"),
                           ("carry_slots", "CARRY_SLOTS")):
            if getattr(args, flag) is not None:
                setattr(module, attr, getattr(args, flag))
    os.environ["HF_POSENC_BACKEND"] = "triton"  # never time a silent fallback: the kernels or an error

    scale = args.head_dim**-0.5
    timer = Timer(device, args.budget_ms, args.warmup, args.max_reps)
    rows = []
    sdpa_cache: dict = {}
    for b in args.batches:
        for length in args.lengths:
            g = torch.Generator().manual_seed(length)
            q = torch.randn(b, length, args.heads, args.head_dim, generator=g).to(device, dtype).transpose(1, 2)
            k = torch.randn(b, kv_heads, length, args.head_dim, generator=g).to(device, dtype)
            v = torch.randn(b, kv_heads, length, args.head_dim, generator=g).to(device, dtype)
            gout = torch.randn(b, args.heads, length, args.head_dim, generator=g).to(device, dtype)
            table = (torch.randn(args.head_dim, args.npos, generator=g) * 0.1).to(device)
            bias = torch.randn(args.heads, args.head_dim, generator=g).to(device) if args.remainder == "bias" else None
            for mode in args.modes:
                backward = mode == "fwd+bwd"
                key = (b, length, mode)
                if "sdpa" in args.methods and key not in sdpa_cache:
                    try:
                        sdpa_cache[key] = guarded(lambda: timer(sdpa_step(q, k, v, gout, backward)))
                    except RuntimeError as exc:  # e.g. no flash kernel for this dtype / GPU
                        print(f"sdpa (flash) failed at B={b} L={length} {mode}: {exc}", file=sys.stderr)
                        sdpa_cache[key] = None
                for kind in args.kinds:
                    if kind == "sba":
                        assert sba_backend(q, k, v) == "triton"
                        params = (bias,) if bias is not None else ()

                        def fused(q, k, v, *p, _ref=False):
                            fn = sba_reference if _ref else stick_breaking
                            return fn(q, k, v, None, scale, 0, args.attend_current, args.remainder, p[0] if p else None)
                    else:
                        assert cope_backend(q, k, v) == "triton"
                        params = (table,)

                        def fused(q, k, v, table, _ref=False):
                            fn = cope_reference if _ref else cope
                            return fn(q, k, v, table, None, scale, 0)

                    def eager(*a):
                        return fused(*a, _ref=True)

                    row = {"kind": kind, "batch": b, "length": length, "heads": args.heads, "kv_heads": kv_heads,
                           "head_dim": args.head_dim, "dtype": args.dtype, "mode": mode,
                           "npos": args.npos if kind == "cope" else None,
                           "remainder": args.remainder if kind == "sba" else None}
                    cached = sdpa_cache.get(key)
                    if cached is not None and not isinstance(cached, OutOfMemory):
                        row["sdpa_ms"], row["sdpa_mb"] = cached
                    res = guarded(lambda: timer(step(fused, (q, k, v), params, gout, backward)))
                    if isinstance(res, OutOfMemory):
                        row["triton_oom"] = True
                    elif res is not None:
                        row["triton_ms"], row["triton_mb"] = res
                    if "eager" in args.methods and length <= args.eager_max_length:
                        res = guarded(lambda: timer(step(eager, (q, k, v), params, gout, backward)))
                        if isinstance(res, OutOfMemory):
                            row["eager_oom"] = True
                        else:
                            row["eager_ms"], row["eager_mb"] = res
                    if not backward and length <= args.check_max_length:
                        def check():
                            with torch.no_grad():
                                got = fused(q, k, v, *params)
                                want = eager(q.float(), k.float(), v.float(), *params)
                            return rel_err(got, want)

                        err = guarded(check)
                        row["rel_err"] = None if isinstance(err, OutOfMemory) else err
                    rows.append(row)
                    append_row(args.rows_jsonl, row)
                    print(_line(row), flush=True)
                    if cuda:
                        torch.cuda.empty_cache()
            q = k = v = gout = table = bias = None  # free before the next shape
            if cuda:
                torch.cuda.empty_cache()

    print()
    print(markdown(rows))
    oom = sorted({(r["kind"], r["length"], r["batch"]) for r in rows if r.get("eager_oom")})
    if oom:
        print("\nthe eager reference ran out of memory at: "
              + ", ".join(f"{k} L={n} B={bb}" for k, n, bb in oom))
    if args.smoke:
        return 0
    result = {
        "benchmark": "bench_sba_cope",
        "device": device_name(device),
        "sm_count": torch.cuda.get_device_properties(device).multi_processor_count if cuda else None,
        "versions": versions(),
        "args": {k: v for k, v in vars(args).items()},
        "kernel_params": {
            mod.__name__.rsplit(".", 1)[-1]: {a: getattr(mod, a) for a in
                                              ("GPU_FWD", "GPU_BWD_Q", "GPU_BWD_KV", "CARRY_SLOTS")}
            for mod in (triton_sba, triton_cope)
        },
        "results": rows,
    }
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"sba_cope_{slug(device_name(device))}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    md = out.with_suffix(".md")
    md.write_text(f"# bench_sba_cope on {result['device']}\n\n{json.dumps(result['versions'])}\n\n{markdown(rows)}\n")
    print(f"\nwrote {out} and {md}")
    return 0


def _fmt(v, digits=3) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    return str(v)


def _ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def _line(row: dict) -> str:
    keys = ("triton_ms", "sdpa_ms", "eager_ms", "triton_mb", "sdpa_mb", "eager_mb", "rel_err")
    extra = " eager=OOM" if row.get("eager_oom") else ""
    return (f"{row['kind']:5s} L={row['length']:6d} B={row['batch']:3d} {row['mode']:8s} "
            + " ".join(f"{k}={_fmt(row.get(k))}" for k in keys) + extra)


def markdown(rows: list[dict]) -> str:
    head = ("| kind | L | B | mode | triton ms | sdpa ms | eager ms | triton/sdpa | eager/triton | "
            "triton MB | sdpa MB | eager MB | rel err |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        t = r.get("triton_ms")
        eager = "OOM" if r.get("eager_oom") else _fmt(r.get("eager_ms"))
        out.append("| " + " | ".join([
            r["kind"], str(r["length"]), str(r["batch"]), r["mode"],
            "OOM" if r.get("triton_oom") else _fmt(t), _fmt(r.get("sdpa_ms")), eager,
            _fmt(_ratio(t, r.get("sdpa_ms"))), _fmt(_ratio(r.get("eager_ms"), t)),
            _fmt(r.get("triton_mb")), _fmt(r.get("sdpa_mb")), "OOM" if r.get("eager_oom") else _fmt(r.get("eager_mb")),
            _fmt(r.get("rel_err"), 2),
        ]) + " |")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
