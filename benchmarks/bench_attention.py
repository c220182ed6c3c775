"""Time the fused attention kernels (one per position term) against SDPA, FlexAttention and the reference.

    python benchmarks/bench_attention.py                          # CUDA: L = 1k..16k at 16k tokens per batch
    python benchmarks/bench_attention.py --terms alibi fire --lengths 4096 --tokens 8192
    python benchmarks/bench_attention.py --smoke                  # CPU: tiny shapes, kernels under TRITON_INTERPRET=1

What is timed, per position term (``--terms``: none, alibi, kerple_log, kerple_pow, sandwich, t5, fire, shaw,
fox), in bfloat16, H = 32 query heads, D = 128, causal, at a fixed number of tokens per batch (B = tokens / L):

* ``triton``: ``hf_posenc.kernels.attention.fused_attention`` (the kernels ``posenc_attention`` runs on CUDA);
* ``flex``: ``torch.compile(flex_attention)`` with the same term as a score_mod (the kinds it can express;
  shaw's value term has no score_mod form);
* ``sdpa``: ``scaled_dot_product_attention`` on the flash backend, causal, no bias: the baseline of the
  design targets (docs: ../shared/DESIGN.md, "Performance targets");
* ``eager``: ``attention_reference`` (float32, O(L²) memory), skipped where it runs out of memory;

each in ``fwd`` (no gradients) and ``fwd+bwd`` (gradients of q, k, v and of the term's learned tensors: kerple's
r1, r2, t5's table, fire's table, c and normaliser, shaw's a^K and a^V, fox's cumulative gates). Times are
medians of CUDA-event timings after warmup; peak memory is the allocator's peak above the inputs. Each
configuration checks the kernel's output against the float32 reference where that fits in memory.
Prints a markdown table (with the ratios triton / sdpa, triton / flex and eager / triton) and writes JSON
(default ``benchmarks/results/attention_<device-name>.json``) with the device, its SM count and the versions
of torch, CUDA, triton and transformers. On a machine without CUDA it exits with a message (``--smoke`` runs
tiny shapes through the Triton interpreter instead: a correctness smoke test, not a measurement).
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
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

METHODS = ("triton", "flex", "sdpa", "eager")
TERMS = ("none", "alibi", "kerple_log", "kerple_pow", "sandwich", "t5", "fire", "shaw", "fox")


from _common import append_row, device_name, slug, versions  # noqa: E402  (benchmarks/ is on sys.path)


class Timer:
    """Median time (ms) of a callable: CUDA events on a GPU, wall clock on the CPU; and its peak memory."""

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


def guarded(fn, errors: dict | None = None, name: str = ""):
    """fn() or None when it runs out of memory (the eager reference at large L does). With ``errors``, any other
    exception is recorded there under ``name`` (type and the first line of its message) and None returned, so
    that one method that fails to compile (FlexAttention's templates on some GPU and torch) leaves the other
    methods' rows measured; without it, the exception propagates."""
    try:
        return fn()
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None
    except Exception as exc:  # noqa: BLE001 - recorded in the row, printed, never dropped
        if errors is None:
            raise
        first = (str(exc).strip().splitlines() or [""])[0]
        errors[name] = f"{type(exc).__name__}: {first}"[:300]
        print(f"{name} failed: {errors[name]}", file=sys.stderr, flush=True)
        return None


# -- workloads ------------------------------------------------------------------------------------------


def make_term(kind: str, b: int, h: int, length: int, d: int, device: torch.device, learn: bool):
    """A term with the encodings' default sizes (t5: 32 buckets up to 128; fire: 256 points; shaw: k = 16),
    and its learned leaf tensors."""
    from hf_posenc.encodings.alibi import alibi_slopes
    from hf_posenc.encodings.fire import Fire
    from hf_posenc.encodings.t5 import t5_relative_position_bucket
    from hf_posenc.kernels.attention import KernelTerm

    g = torch.Generator().manual_seed(0)

    def leaf(t):
        return t.to(device).requires_grad_(learn)

    if kind == "none":
        return KernelTerm.none(), []
    if kind == "alibi":
        return KernelTerm.alibi(alibi_slopes(h).to(device)), []
    if kind in ("kerple_log", "kerple_pow"):
        r1, r2 = leaf(torch.rand(h, generator=g) * 2 + 0.01), leaf(torch.rand(h, generator=g) + 0.01)
        return KernelTerm.build(kind, r1=r1, r2=r2), [r1, r2]
    if kind == "sandwich":
        k = torch.arange(1, d // 2 + 1, dtype=torch.float64)
        inv = (10000.0 ** (-2.0 * k / d)).float()
        table = torch.cos(torch.arange(length, dtype=torch.float32)[:, None] * inv).sum(-1) - d / 2
        scale = torch.arange(1, h + 1, dtype=torch.float32) * 8.0 / h
        return KernelTerm.sandwich((table[None] / scale[:, None]).to(device)), []
    if kind == "t5":
        table = leaf(torch.randn(32, h, generator=g) * 0.1)
        buckets = t5_relative_position_bucket(torch.arange(-128, 129), False, 32, 128).to(device)
        return KernelTerm.t5(table, buckets), [table]
    if kind == "fire":
        table = leaf(torch.randn(h, Fire.KERNEL_GRID, generator=g) * 0.1)
        c = leaf(torch.tensor(0.1))
        positions = torch.arange(length, dtype=torch.float32)
        inv_norm = leaf((1.0 / (torch.log1p(0.1 * positions.clamp_min(512.0)) + 1e-6))[None])
        return KernelTerm.fire(table, c, inv_norm, torch.tensor(1.0, device=device)), [table, c, inv_norm]
    if kind == "shaw":
        a_k, a_v = leaf(torch.randn(33, d, generator=g) * 0.02), leaf(torch.randn(33, d, generator=g) * 0.02)
        return KernelTerm.shaw(a_k, a_v), [a_k, a_v]
    if kind == "fox":
        c = leaf(F.logsigmoid(torch.randn(b, h, length, generator=g) + 3.0).cumsum(-1))
        return KernelTerm.fox(c), [c]
    raise ValueError(kind)


def step(fn, q, k, v, term, leaves, gout, backward: bool, **kw):
    if not backward:

        def run():
            with torch.no_grad():
                fn(q, k, v, term, **kw)

        return run
    inputs = [q, k, v, *leaves]

    def run():
        out = fn(q, k, v, term, **kw)
        torch.autograd.grad(out, inputs, gout, allow_unused=True)

    return run


def sdpa_step(q, k, v, gout, backward: bool):
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel

    gqa = q.shape[1] != k.shape[1]

    def run():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION) if q.is_cuda else contextlib.nullcontext():
            if backward:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
                torch.autograd.grad(out, (q, k, v), gout)
            else:
                with torch.no_grad():
                    F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

    return run


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--terms", nargs="+", default=list(TERMS), choices=list(TERMS))
    p.add_argument("--lengths", nargs="+", type=int, default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--tokens", type=int, default=16384, help="tokens per batch: B = tokens / L (at least 1)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads (no GQA)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--eager-max-length", type=int, default=8192, help="skip the eager reference above this L")
    p.add_argument("--budget-ms", type=float, default=200.0, help="timed milliseconds per measurement (about)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--max-reps", type=int, default=50)
    p.add_argument("--rows-jsonl", default=None, help="also append each row to this JSON-lines file as measured")
    p.add_argument("--smoke", action="store_true", help="CPU smoke run: tiny shapes, interpreted kernels, no JSON")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/attention_<device>.json)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    if args.smoke:
        if not cuda:
            # before anything imports triton: its library functions are built for the mode in force then
            os.environ["TRITON_INTERPRET"] = "1"
        args.lengths, args.tokens, args.heads, args.kv_heads, args.head_dim = [77], 77, 4, 1, 40
        args.budget_ms, args.warmup, args.max_reps = 1.0, 0, 1
        if not cuda:  # no compiled flex and no flash SDPA on the CPU; flex has no CPU backward
            args.methods = [m for m in args.methods if m in ("triton", "eager")]
    elif not cuda:
        print(
            "bench_attention.py times CUDA kernels and needs a CUDA GPU (torch.cuda.is_available() is False): "
            "speed is unmeasured here.\nOn the CPU, run `python benchmarks/bench_attention.py --smoke` for a tiny "
            "interpreted correctness run.",
            file=sys.stderr,
        )
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    dtype = getattr(torch, args.dtype)
    kv_heads = args.kv_heads or args.heads
    try:
        from hf_posenc.kernels.attention import (
            FLEX_KINDS,
            attention_reference,
            flex_attention_term,
            fused_attention,
            kernel_unsupported,
        )
    except ImportError as exc:
        print(f"hf_posenc's attention kernels do not import ({exc})", file=sys.stderr)
        return 2

    timer = Timer(device, args.budget_ms, args.warmup, args.max_reps)
    if cuda:  # compiled FlexAttention compiles once per term kind, mode and length: past dynamo's default
        # recompile limit it would run uncompiled, and be timed so
        dynamo = torch._dynamo.config
        limit_name = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"
        setattr(dynamo, limit_name, max(getattr(dynamo, limit_name), 16 * len(args.terms) * len(args.lengths)))
    rows = []
    sdpa_cache: dict = {}
    for length in args.lengths:
        b = max(1, args.tokens // length)
        g = torch.Generator().manual_seed(length)
        q = torch.randn(b, length, args.heads, args.head_dim, generator=g).transpose(1, 2).to(device, dtype)
        k = torch.randn(b, kv_heads, length, args.head_dim, generator=g).to(device, dtype)
        v = torch.randn(b, kv_heads, length, args.head_dim, generator=g).to(device, dtype)
        gout = torch.randn(b, args.heads, length, args.head_dim, generator=g).to(device, dtype)
        for mode in args.modes:
            backward = mode == "fwd+bwd"
            q.requires_grad_(backward)
            k.requires_grad_(backward)
            v.requires_grad_(backward)
            key = (length, mode)
            if "sdpa" in args.methods and key not in sdpa_cache:
                sdpa_cache[key] = guarded(lambda: timer(sdpa_step(q, k, v, gout, backward)))
            for kind in args.terms:
                term, leaves = make_term(kind, b, args.heads, length, args.head_dim, device, learn=backward)
                reason = kernel_unsupported(q, k, v, term)
                if reason is not None:
                    print(f"skipping {kind} at L={length}: {reason}", file=sys.stderr)
                    continue
                kw = dict(scale=args.head_dim**-0.5, causal=True)
                row = {"term": kind, "batch": b, "length": length, "heads": args.heads, "kv_heads": kv_heads,
                       "head_dim": args.head_dim, "dtype": args.dtype, "mode": mode}
                if "sdpa" in args.methods and sdpa_cache.get(key) is not None:
                    row["sdpa_ms"], row["sdpa_mb"] = sdpa_cache[key]
                errors: dict = {}
                res = guarded(lambda: timer(step(fused_attention, q, k, v, term, leaves, gout, backward, **kw)),
                              errors, "triton")
                if res is not None:
                    row["triton_ms"], row["triton_mb"] = res
                if "flex" in args.methods and kind in FLEX_KINDS:
                    res = guarded(lambda: timer(step(flex_attention_term, q, k, v, term, leaves, gout, backward, **kw)),
                                  errors, "flex")
                    if res is not None:
                        row["flex_ms"], row["flex_mb"] = res
                if "eager" in args.methods and length <= args.eager_max_length:
                    res = guarded(lambda: timer(step(attention_reference, q, k, v, term, leaves, gout, backward, **kw)),
                                  errors, "eager")
                    if res is not None:
                        row["eager_ms"], row["eager_mb"] = res
                if not backward and length <= args.eager_max_length:
                    def check():
                        with torch.no_grad():
                            got = fused_attention(q, k, v, term, **kw)
                            want = attention_reference(q.float(), k.float(), v.float(), term, **kw)
                        return rel_err(got, want)

                    row["rel_err"] = guarded(check, errors, "check")
                if errors:
                    row["errors"] = errors
                rows.append(row)
                append_row(args.rows_jsonl, row)
                print(_line(row), flush=True)
                term = leaves = None  # free before the next shape
                if cuda:
                    torch.cuda.empty_cache()

    print()
    print(markdown(rows))
    if args.smoke:
        return 0
    result = {
        "benchmark": "bench_attention",
        "device": device_name(device),
        "sm_count": torch.cuda.get_device_properties(device).multi_processor_count if cuda else None,
        "versions": versions(),
        "args": vars(args),
        "results": rows,
    }
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"attention_{slug(device_name(device))}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    md = out.with_suffix(".md")
    md.write_text(f"# bench_attention on {result['device']}\n\n{json.dumps(result['versions'])}\n\n{markdown(rows)}\n")
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
    keys = ("triton_ms", "flex_ms", "sdpa_ms", "eager_ms", "rel_err")
    return f"{row['term']:10s} L={row['length']:6d} B={row['batch']:3d} {row['mode']:8s} " + " ".join(
        f"{k}={_fmt(row.get(k))}" for k in keys)


def markdown(rows: list[dict]) -> str:
    head = ("| term | L | B | mode | triton ms | flex ms | sdpa ms | eager ms | triton/sdpa | triton/flex | "
            "eager/triton | triton MB | flex MB | sdpa MB | eager MB | rel err |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        t = r.get("triton_ms")
        out.append("| " + " | ".join([
            r["term"], str(r["length"]), str(r["batch"]), r["mode"],
            _fmt(t), _fmt(r.get("flex_ms")), _fmt(r.get("sdpa_ms")), _fmt(r.get("eager_ms")),
            _fmt(_ratio(t, r.get("sdpa_ms"))), _fmt(_ratio(t, r.get("flex_ms"))), _fmt(_ratio(r.get("eager_ms"), t)),
            _fmt(r.get("triton_mb")), _fmt(r.get("flex_mb")), _fmt(r.get("sdpa_mb")), _fmt(r.get("eager_mb")),
            _fmt(r.get("rel_err"), 2),
        ]) + " |")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
