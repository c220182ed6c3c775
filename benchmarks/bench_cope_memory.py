"""Peak memory of the ``cope`` reference attention: O(L²·H), not O(L²·H·D).

    python benchmarks/bench_cope_memory.py                        # CPU, L = 1024, H = 4, D = 16 64 256
    python benchmarks/bench_cope_memory.py --device cuda --lengths 1024 4096 --head-dims 64 128

CoPE's optimised form computes z = q @ e (B, H, L, npos) and gathers it at ⌊p⌋ and ⌈p⌉, instead of
interpolating embedding *vectors* e[p_ij] (B, H, L, L, D). This script runs ``Cope.attend`` (causal mask,
batch 1) at several head dims and reports the peak extra memory of one call, forward only (no grad) and
forward + backward, in bytes and in units of one float32 (B, H, L, L) tensor. If the reference formed a
(B, H, L, L, D) tensor, the peak would grow linearly with D (and be at least D of those units); it stays a
handful of units whatever D is.

Measurement: CPU -- each configuration runs in a fresh subprocess; peak = the process's maximum resident
set size (``ru_maxrss``) minus its resident size after the inputs are built. CUDA -- ``max_memory_allocated``
minus the memory allocated before the call. Prints a markdown table and writes JSON (default
``benchmarks/results/cope_memory_<device>.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import torch

UNIT = "float32 (B, H, L, L) tensors"


def current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(device: str, length: int, heads: int, head_dim: int, npos: int, backward: bool) -> dict:
    """Peak extra bytes of one ``Cope.attend`` call (run in this process)."""
    import hf_posenc
    from hf_posenc.encodings.base import ModelInfo, PosContext
    from hf_posenc.encodings.cope import Cope

    torch.set_num_threads(1)
    dev = torch.device(device)
    info = ModelInfo("llama", heads * head_dim, heads, heads, head_dim, 1, True, None)
    enc = Cope(hf_posenc.PosEncConfig("cope", {"npos_max": npos}), info).to(dev)
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(1, heads, length, head_dim, generator=g).to(dev).requires_grad_(backward) for _ in range(3))
    mask = torch.ones(length, length, dtype=torch.bool, device=dev).tril()[None, None]
    ctx = PosContext(encoding=enc, info=info)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
    else:
        base = current_rss()
    with torch.set_grad_enabled(backward):
        out, _ = enc.attend(ctx, 0, q, k, v, mask, head_dim**-0.5, 0.0, False)
        if backward:
            out.square().sum().backward()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    unit = 4 * heads * length * length
    return {
        "length": length,
        "heads": heads,
        "head_dim": head_dim,
        "npos_max": npos,
        "backward": backward,
        "peak_bytes": int(peak),
        "peak_in_LLH_units": peak / unit,
        "bytes_of_one_BHLLD_float32_tensor": unit * head_dim,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--npos-max", type=int, default=64)
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child is not None:  # one configuration, in a fresh process
        length, head_dim, backward = (int(x) for x in args.child.split(","))
        print(json.dumps(measure(args.device, length, args.heads, head_dim, args.npos_max, bool(backward))))
        return

    rows = []
    for length in args.lengths:
        for head_dim in args.head_dims:
            for backward in (0, 1):
                spec = f"{length},{head_dim},{backward}"
                if args.device == "cpu":
                    cmd = [sys.executable, __file__, "--device", "cpu", "--heads", str(args.heads),
                           "--npos-max", str(args.npos_max), "--child", spec]
                    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
                    rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
                else:
                    rows.append(measure(args.device, length, args.heads, head_dim, args.npos_max, bool(backward)))

    print(f"cope reference peak memory, batch 1, H = {args.heads}, npos_max = {args.npos_max}, device {args.device}\n")
    print(f"| L | head_dim | pass | peak MiB | peak in {UNIT} | one (B,H,L,L,D) float32 tensor, MiB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['length']} | {r['head_dim']} | {'fwd+bwd' if r['backward'] else 'fwd'} | "
            f"{r['peak_bytes'] / 2**20:.1f} | {r['peak_in_LLH_units']:.1f} | "
            f"{r['bytes_of_one_BHLLD_float32_tensor'] / 2**20:.0f} |"
        )
    for backward in (False, True):
        sel = [r for r in rows if r["backward"] == backward and r["length"] == args.lengths[-1]]
        if len(sel) > 1:
            lo, hi = sel[0], sel[-1]
            print(
                f"\n{'fwd+bwd' if backward else 'fwd'}: head_dim x{hi['head_dim'] / lo['head_dim']:.0f} -> peak "
                f"x{hi['peak_bytes'] / max(lo['peak_bytes'], 1):.2f} (O(L²·H·D) would be x{hi['head_dim'] / lo['head_dim']:.0f})"
            )
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / f"cope_memory_{args.device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": args.device, "torch": torch.__version__, "rows": rows}, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
