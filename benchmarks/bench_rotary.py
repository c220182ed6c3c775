"""Time the fused rotary kernel (q and k in one pass) against the PyTorch reference and torch.compile of it.

    python benchmarks/bench_rotary.py                       # CUDA: B = 1 2 4, L = 1k..16k, s = 2 and 8
    python benchmarks/bench_rotary.py --batches 1 --lengths 4096 --block-sizes 8
    python benchmarks/bench_rotary.py --sweep               # also: tile size / warps sweep of the kernel
    python benchmarks/bench_rotary.py --smoke               # CPU: tiny shapes, kernel under TRITON_INTERPRET=1

What is timed, in bfloat16, H = 32 query heads, D = 128 (``--heads``, ``--kv-heads``, ``--head-dim``):

* ``reference``: ``apply_qk_rotation_reference`` (float32 einsum, eager);
* ``compile``: ``torch.compile`` of that reference (``--compile static``: one compile per shape, the best
  case for compile, after ``torch._dynamo.reset()``; ``dynamic``: ``dynamic=True`` once; ``off``);
* ``triton``: ``apply_qk_rotation``, the public entry point, which dispatches to the Triton kernel on CUDA;
* ``sdpa``: ``scaled_dot_product_attention`` (flash backend, causal) at the same shape, the attention the
  rotation is paid against (the design target: applying the rotation costs <= 5% of attention time).

each in ``fwd`` (inputs need no grad) and ``fwd+bwd`` (gradients of q and k, and of the rotation when it is
learned). Rotations: s = 2 is rope-like (shared by the batch and the heads, fixed: no gradient); s = 8 is
LieRE-like (one per key/value head, learned: its gradient is computed); ``--rot-layout`` / ``--rot-grad``
override both. Times are medians of CUDA-event timings after warmup, with the L2 cache flushed before
each repetition. Each configuration also checks the kernel against the float32 reference (relative error).
Prints a markdown table and writes JSON (default ``benchmarks/results/rotary_<device-name>.json``) with the
device, its SM count and the versions of torch, CUDA, triton and transformers.
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

METHODS = ("reference", "compile", "triton", "sdpa")
LAYOUTS = {"shared": (False, False), "heads": (False, True), "batch_heads": (True, True)}


from _common import append_row, device_name, slug, versions  # noqa: E402  (benchmarks/ is on sys.path)


# -- timing ---------------------------------------------------------------------------------------------


class Timer:
    """Median time (ms) of a callable: CUDA events on a GPU (L2 flushed before each repetition), wall clock
    on the CPU."""

    def __init__(self, device: torch.device, budget_ms: float, warmup: int, max_reps: int):
        self.device = device
        self.budget_ms = budget_ms
        self.warmup = warmup
        self.max_reps = max_reps
        self.flush = torch.empty(256 * 2**20, dtype=torch.int8, device=device) if device.type == "cuda" else None

    def __call__(self, fn) -> float:
        cuda = self.device.type == "cuda"
        for _ in range(self.warmup):
            fn()
        self._sync()
        t0 = time.perf_counter()
        fn()
        self._sync()
        estimate_ms = max((time.perf_counter() - t0) * 1e3, 1e-3)
        reps = int(min(self.max_reps, max(3, self.budget_ms / estimate_ms)))
        times = []
        for _ in range(reps):
            if cuda:
                self.flush.zero_()
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
        return statistics.median(times)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def guarded(fn):
    """fn() or None when it runs out of memory (the reference at large L may)."""
    try:
        return fn()
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None


# -- workloads ------------------------------------------------------------------------------------------


def make_inputs(b, h, hkv, length, d, s, layout, rot_grad, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    per_batch, per_head = LAYOUTS[layout]
    # q as transformers hands it over: a transposed view of (B, L, H, D)
    q = torch.randn(b, length, h, d, generator=g).to(device=device, dtype=dtype).transpose(1, 2)
    k = torch.randn(b, hkv, length, d, generator=g).to(device=device, dtype=dtype)
    # random orthogonal blocks (rotations): QR of Gaussian blocks
    shape = (b if per_batch else 1, hkv if per_head else 1, length, d // s, s, s)
    rot = torch.linalg.qr(torch.randn(shape, generator=g).to(device))[0].contiguous()
    gq = torch.randn(b, h, length, d, generator=g).to(device=device, dtype=dtype)
    gk = torch.randn(b, hkv, length, d, generator=g).to(device=device, dtype=dtype)
    return q, k, rot.requires_grad_(rot_grad), gq, gk


def rotation_step(fn, q, k, rot, gq, gk, backward: bool):
    """A closure running fn forward (and backward) on leaves built from q, k, rot."""
    if not backward:
        qd, kd, rd = q.detach(), k.detach(), rot.detach()

        def step():
            return fn(qd, kd, rd)

        return step
    ql, kl = q.detach().requires_grad_(), k.detach().requires_grad_()
    rl = rot.detach().requires_grad_(rot.requires_grad)

    def step():
        ql.grad = kl.grad = rl.grad = None
        qo, ko = fn(ql, kl, rl)
        torch.autograd.backward((qo, ko), (gq, gk))

    return step


def sdpa_step(b, h, hkv, length, d, dtype, device, backward: bool):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    q = torch.randn(b, h, length, d, device=device, dtype=dtype, requires_grad=backward)
    k = torch.randn(b, hkv, length, d, device=device, dtype=dtype, requires_grad=backward)
    v = torch.randn(b, hkv, length, d, device=device, dtype=dtype, requires_grad=backward)
    go = torch.randn(b, h, length, d, device=device, dtype=dtype)
    gqa = hkv != h

    def step():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = sdpa(q, k, v, is_causal=True, enable_gqa=gqa)
        if backward:
            q.grad = k.grad = v.grad = None
            out.backward(go)

    return step


def kernel_bytes(b, h, hkv, length, d, s, layout, rot_grad, elem: int, backward: bool) -> int:
    """DRAM bytes the fused kernel must move at least (q/k read + write, rotation read; backward: the
    incoming gradients read, dq/dk written, the rotation read, and with dR: q/k read again, dR written)."""
    per_batch, per_head = LAYOUTS[layout]
    qk = b * (h + hkv) * length * d * elem
    rot = (b if per_batch else 1) * (hkv if per_head else 1) * length * d * s * 4
    total = 2 * qk + rot
    if backward:
        total += 2 * qk + rot + ((qk + rot) if rot_grad else 0)
    return total


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


# -- main -----------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 2, 4])
    p.add_argument("--lengths", nargs="+", type=int, default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--block-sizes", nargs="+", type=int, default=[2, 8], choices=[2, 4, 8])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads (no GQA)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--rot-layout", default="auto", choices=["auto", *LAYOUTS],
                   help="auto: s=2 shared by batch and heads, s>2 one per kv head")
    p.add_argument("--rot-grad", default="auto", choices=["auto", "yes", "no"], help="auto: s=2 fixed, s>2 learned")
    p.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--compile", default="static", choices=["static", "dynamic", "off"])
    p.add_argument("--budget-ms", type=float, default=150.0, help="timed milliseconds per measurement (about)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--max-reps", type=int, default=100)
    p.add_argument("--sweep", action="store_true", help="also sweep the kernel's tile size and warps")
    p.add_argument("--tile-elements", type=int, default=None, help="override triton_rotary.TILE_ELEMENTS")
    p.add_argument("--num-warps", type=int, default=None, help="override triton_rotary.NUM_WARPS")
    p.add_argument("--programs-per-sm", type=int, default=None, help="override triton_rotary.PROGRAMS_PER_SM")
    p.add_argument("--rows-jsonl", default=None, help="also append each row to this JSON-lines file as measured")
    p.add_argument("--smoke", action="store_true", help="CPU smoke run: tiny shapes, interpreted kernel, no JSON")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/rotary_<device>.json)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    if args.smoke:
        if not cuda:
            os.environ["TRITON_INTERPRET"] = "1"  # read when the kernel is first built (lazily)
        args.batches, args.lengths, args.heads, args.kv_heads, args.head_dim = [1], [77], 4, 2, 40
        args.budget_ms, args.warmup, args.max_reps = 1.0, 0, 3
        if not cuda:
            args.methods = [m for m in args.methods if m in ("reference", "triton")]
    elif not cuda:
        print(
            "bench_rotary.py times CUDA kernels and needs a CUDA GPU (torch.cuda.is_available() is False).\n"
            "On the CPU, run `python benchmarks/bench_rotary.py --smoke` for a tiny interpreted run.",
            file=sys.stderr,
        )
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    dtype = getattr(torch, args.dtype)
    kv_heads = args.kv_heads or args.heads
    if args.heads % kv_heads:
        print(f"--heads ({args.heads}) must be a multiple of --kv-heads ({kv_heads})", file=sys.stderr)
        return 2
    if args.head_dim % max(args.block_sizes):
        print(f"--head-dim ({args.head_dim}) must be a multiple of every block size", file=sys.stderr)
        return 2

    try:
        from hf_posenc.kernels.rotary import apply_qk_rotation, apply_qk_rotation_reference, rotation_backend
        from hf_posenc.kernels.rotary import triton_rotary
    except ImportError as exc:
        print(f"the Triton kernel does not import ({exc}); install triton (pip install hf_posenc[triton])",
              file=sys.stderr)
        return 2
    for name, attr in (("tile_elements", "TILE_ELEMENTS"), ("num_warps", "NUM_WARPS"),
                       ("programs_per_sm", "PROGRAMS_PER_SM")):
        if getattr(args, name) is not None:
            setattr(triton_rotary, attr, getattr(args, name))
    os.environ.pop("HF_POSENC_BACKEND", None)
    if args.smoke and not cuda:
        os.environ["HF_POSENC_BACKEND"] = "triton"  # on the CPU the dispatcher picks the kernel only if forced

    timer = Timer(device, args.budget_ms, args.warmup, args.max_reps)
    compiled_dynamic = None
    rows = []
    sdpa_cache: dict = {}
    for s in args.block_sizes:
        layout = args.rot_layout if args.rot_layout != "auto" else ("shared" if s == 2 else "heads")
        rot_grad = (args.rot_grad == "yes") if args.rot_grad != "auto" else s > 2
        for b in args.batches:
            for length in args.lengths:
                shape = (b, args.heads, kv_heads, length, args.head_dim)
                q, k, rot, gq, gk = make_inputs(*shape, s, layout, rot_grad, dtype, device)
                assert rotation_backend(q, k, rot) == "triton", "apply_qk_rotation would not use the kernel"
                # correctness of the kernel at this shape, against the float32 reference
                with torch.no_grad():
                    got = apply_qk_rotation(q, k, rot)
                    want = apply_qk_rotation_reference(q.float(), k.float(), rot)
                err = max(rel_err(got[0], want[0]), rel_err(got[1], want[1]))
                del got, want
                compiled = None
                if "compile" in args.methods and args.compile != "off":
                    if args.compile == "static":
                        torch._dynamo.reset()
                        compiled = torch.compile(apply_qk_rotation_reference, dynamic=False)
                    else:
                        if compiled_dynamic is None:
                            compiled_dynamic = torch.compile(apply_qk_rotation_reference, dynamic=True)
                        compiled = compiled_dynamic
                impls = {"reference": apply_qk_rotation_reference, "compile": compiled, "triton": apply_qk_rotation}
                for mode in args.modes:
                    backward = mode == "fwd+bwd"
                    row = {"s": s, "B": b, "L": length, "H": args.heads, "Hkv": kv_heads, "D": args.head_dim,
                           "dtype": args.dtype, "rot_layout": layout, "rot_grad": rot_grad, "mode": mode,
                           "kernel_rel_err_fwd": err}
                    for method in args.methods:
                        if method == "sdpa":
                            key = (b, length, mode)
                            if key not in sdpa_cache:
                                try:
                                    sdpa_cache[key] = guarded(
                                        lambda: timer(sdpa_step(b, args.heads, kv_heads, length, args.head_dim,
                                                                dtype, device, backward)))
                                except RuntimeError as exc:  # e.g. no flash kernel for this dtype/device
                                    print(f"sdpa (flash) failed at B={b} L={length} {mode}: {exc}", file=sys.stderr)
                                    sdpa_cache[key] = None
                            row["sdpa_ms"] = sdpa_cache[key]
                            continue
                        fn = impls[method]
                        row[f"{method}_ms"] = None if fn is None else guarded(
                            lambda: timer(rotation_step(fn, q, k, rot, gq, gk, backward)))
                    t = row.get("triton_ms")
                    if t:
                        nbytes = kernel_bytes(*shape, s, layout, rot_grad, q.element_size(), backward)
                        row["triton_GBps"] = nbytes / (t * 1e-3) / 1e9
                        for other in ("reference", "compile"):
                            if row.get(f"{other}_ms"):
                                row[f"speedup_vs_{other}"] = row[f"{other}_ms"] / t
                        if row.get("sdpa_ms"):
                            row["rotation_pct_of_attention"] = 100.0 * t / row["sdpa_ms"]
                    rows.append(row)
                    append_row(args.rows_jsonl, row)
                    times = ", ".join(f"{m} {_fmt(row.get(m + '_ms'))} ms" for m in args.methods)
                    print(f"s={s} B={b} L={length} {mode}: {times}, kernel rel err {err:.1e}", flush=True)
                q = k = rot = gq = gk = None  # free before the next shape
                if cuda:
                    torch.cuda.empty_cache()

    sweep = run_sweep(args, triton_rotary, apply_qk_rotation, timer, device, dtype, kv_heads) if args.sweep else []
    print()
    print(markdown(rows))
    if sweep:
        print()
        print(markdown_sweep(sweep))

    result = {
        "benchmark": "rotary",
        "device": device_name(device),
        "sm_count": torch.cuda.get_device_properties(device).multi_processor_count if cuda else None,
        "versions": versions(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "kernel_params": {"TILE_ELEMENTS": triton_rotary.TILE_ELEMENTS, "NUM_WARPS": triton_rotary.NUM_WARPS,
                          "PROGRAMS_PER_SM": triton_rotary.PROGRAMS_PER_SM},
        "results": rows,
        "sweep": sweep,
    }
    if args.smoke and args.out is None:
        print("\n(smoke run: no JSON written; pass --out to write one)")
        return 0
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"rotary_{slug(device_name(device))}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out}")
    return 0


def run_sweep(args, triton_rotary, apply_qk_rotation, timer, device, dtype, kv_heads) -> list[dict]:
    """Kernel time over TILE_ELEMENTS x NUM_WARPS at one mid-size shape per block size (fwd and fwd+bwd)."""
    saved = (triton_rotary.TILE_ELEMENTS, triton_rotary.NUM_WARPS)
    b, length = (1, 77) if args.smoke else (2, 4096)
    out = []
    try:
        for s in args.block_sizes:
            layout = args.rot_layout if args.rot_layout != "auto" else ("shared" if s == 2 else "heads")
            rot_grad = (args.rot_grad == "yes") if args.rot_grad != "auto" else s > 2
            q, k, rot, gq, gk = make_inputs(b, args.heads, kv_heads, length, args.head_dim, s, layout, rot_grad,
                                            dtype, device)
            for tile in (1024, 2048, 4096, 8192):
                for warps in (2, 4, 8):
                    triton_rotary.TILE_ELEMENTS, triton_rotary.NUM_WARPS = tile, warps
                    rec = {"s": s, "B": b, "L": length, "tile_elements": tile, "num_warps": warps}
                    for mode in args.modes:
                        rec[f"{mode}_ms"] = guarded(
                            lambda: timer(rotation_step(apply_qk_rotation, q, k, rot, gq, gk, mode == "fwd+bwd")))
                    out.append(rec)
    finally:
        triton_rotary.TILE_ELEMENTS, triton_rotary.NUM_WARPS = saved
    return out


def _fmt(v, digits=3) -> str:
    if v is None:
        return "OOM"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


COLUMNS = [("s", "s"), ("B", "B"), ("L", "L"), ("mode", "mode"), ("rot_grad", "dR"),
           ("reference_ms", "reference ms"), ("compile_ms", "compile ms"), ("triton_ms", "triton ms"),
           ("speedup_vs_reference", "x ref"), ("speedup_vs_compile", "x compile"), ("triton_GBps", "triton GB/s"),
           ("sdpa_ms", "sdpa ms"), ("rotation_pct_of_attention", "rot % of attn"), ("kernel_rel_err_fwd", "rel err")]


def markdown(rows: list[dict]) -> str:
    if not rows:
        return ""
    cols = [(k, name) for k, name in COLUMNS if any(k in r for r in rows)]
    lines = ["| " + " | ".join(name for _, name in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = []
        for k, _ in cols:
            v = r.get(k)
            if k == "kernel_rel_err_fwd":
                cells.append(f"{v:.1e}")
            elif k in ("speedup_vs_reference", "speedup_vs_compile", "rotation_pct_of_attention"):
                cells.append("-" if v is None else f"{v:.2f}")
            elif k == "triton_GBps":
                cells.append("-" if v is None else f"{v:.0f}")
            elif k.endswith("_ms"):
                cells.append("OOM" if k in r and v is None else ("-" if v is None else f"{v:.3f}"))
            else:
                cells.append(str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown_sweep(recs: list[dict]) -> str:
    modes = [k for k in recs[0] if k.endswith("_ms")]
    lines = ["| s | B | L | tile elements | warps | " + " | ".join(modes) + " |", "|" + "---|" * (5 + len(modes))]
    for r in recs:
        lines.append(f"| {r['s']} | {r['B']} | {r['L']} | {r['tile_elements']} | {r['num_warps']} | "
                     + " | ".join(_fmt(r[m]) for m in modes) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
