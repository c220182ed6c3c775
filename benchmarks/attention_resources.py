"""Compile the fused attention kernels for a GPU target without a GPU and report registers, spills, shared memory.

    python benchmarks/attention_resources.py                        # sm_90, every term, bf16, D = 64 and 128
    python benchmarks/attention_resources.py --terms fire shaw --dtypes bfloat16 float32 --head-dims 40 80 128

For each term, dtype and head dim it builds the launch that ``fused_attention`` would make (``_Launch``: tile
sizes and warps from ``triton_attention.LAUNCH``), compiles the forward, dK/dV, dQ and Δ kernels with
``triton.compile`` for ``--arch`` (causal, with a padding mask) and reads the cubin's resource usage with
the ``cuobjdump`` bundled with Triton: registers per thread, stack bytes (register spills) and shared memory.
This is how ``LAUNCH`` was chosen when no GPU was available: it finds compile errors the interpreter cannot
see and tiles that spill, but it measures no time. TRITON_INTERPRET must be unset.
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--terms", nargs="+", default=None)
    p.add_argument("--dtypes", nargs="+", default=["bfloat16"], choices=["bfloat16", "float16", "float32"])
    p.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 80, 90")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: this compiles the kernels", file=sys.stderr)
        return 2
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from hf_posenc.kernels.attention import KernelTerm
    from hf_posenc.kernels.attention import triton_attention as ta

    target = GPUTarget("cuda", args.arch, 32)
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"

    def usage(fn, pointers: dict, consts: dict, warps: int) -> tuple[int, int, int]:
        sig = {}
        for name in inspect.signature(fn.fn).parameters:
            sig[name] = "constexpr" if name in consts else pointers.get(name, "fp32" if name == "scale" else "i32")
        names = list(sig)
        src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()})
        kernel = triton.compile(src, target=target, options={"num_warps": warps, "num_stages": ta.NUM_STAGES})
        with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
            f.write(kernel.asm["cubin"])
        out = subprocess.run([str(cuobjdump), "-res-usage", f.name], capture_output=True, text=True).stdout
        os.unlink(f.name)
        regs, stack = re.search(r"REG:(\d+)", out), re.search(r"STACK:(\d+)", out)
        return int(regs.group(1)), int(stack.group(1)), kernel.metadata.shared

    heads, length = 8, 4096

    def term_for(kind: str, d: int) -> KernelTerm:
        ones = torch.ones(heads)
        return {
            "none": KernelTerm.none(), "alibi": KernelTerm.alibi(ones),
            "kerple_log": KernelTerm.kerple_log(ones, ones), "kerple_pow": KernelTerm.kerple_pow(ones, ones),
            "sandwich": KernelTerm.sandwich(torch.ones(heads, length)),
            "t5": KernelTerm.t5(torch.ones(32, heads), torch.zeros(257, dtype=torch.long)),
            "fire": KernelTerm.fire(torch.ones(heads, 256), torch.tensor(0.1), torch.ones(1, length), torch.tensor(1.0)),
            "shaw": KernelTerm.shaw(torch.ones(33, d), torch.ones(33, d)),
            "fox": KernelTerm.fox(torch.ones(1, heads, length)),
        }[kind]

    ptr = {"bfloat16": "*bf16", "float16": "*fp16", "float32": "*fp32"}
    print("term       dtype    D    kernel  BM  BN warps  regs stack smem")
    for kind, dname, d in itertools.product(args.terms or ta.KERNEL_KINDS, args.dtypes, args.head_dims):
        dtype = getattr(torch, dname)
        q, k = torch.empty(1, heads, length, d, dtype=dtype), torch.empty(1, 2, length, d, dtype=dtype)
        launch = ta._Launch(term_for(kind, d), q, k, 0.1, True, 0, True)
        x = ptr[dname]
        tp = {"TP0": "*fp32", "TP1": "*i32" if kind == "t5" else "*fp32", "TP2": "*fp32", "TP3": "*fp32"}
        c = launch.consts()
        runs = {
            "fwd": (ta._fwd_kernel, {"Q": x, "K": x, "V": x, "O": x, "LSE": "*fp32", "W": "*fp32", "VALID": "*u8", **tp},
                    dict(c, BLOCK_M=launch.fwd_m, BLOCK_N=launch.fwd_n, RP=launch.rp), launch.fwd_warps),
            "dkdv": (ta._bwd_dkdv_kernel, {"Q": x, "K": x, "V": x, "DO": x, "LSE": "*fp32", "DELTA": "*fp32", "DK": x,
                                            "DV": x, "VALID": "*u8", **tp, "DCK": "*fp32"},
                     dict(c, BLOCK_M=launch.dkdv_m, BLOCK_N=launch.dkdv_n), launch.dkdv_warps),
            "dq": (ta._bwd_dq_kernel, {"Q": x, "K": x, "V": x, "DO": x, "LSE": "*fp32", "DELTA": "*fp32", "DQ": x,
                                        "VALID": "*u8", **tp, "ROWG0": "*fp32", "ROWG1": "*fp32", "HIST": "*fp32",
                                        "DQA": "*fp32"},
                   dict(c, BLOCK_M=launch.dq_m, BLOCK_N=launch.dq_n, RP=launch.rp, NHP=launch.nhp,
                        ROWG_N=ta._ROWG_PLANES.get(kind, 0), HAS_HIST=kind in ("t5", "fire")), launch.dq_warps),
        }
        for name, (fn, pointers, consts, warps) in runs.items():
            regs, stack, smem = usage(fn, pointers, consts, warps)
            print(f"{kind:10s} {dname:8s} {d:4d} {name:6s} {consts['BLOCK_M']:4d} {consts['BLOCK_N']:3d} {warps:5d} "
                  f"{regs:5d} {stack:5d} {smem:6d}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
