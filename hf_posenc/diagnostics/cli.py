"""``hf-posenc doctor``: the command's options and entry point."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import torch

from .cases import cases
from .probe import _interpreting
from .run import ENGINES, REPORT_NAME, doctor, report_path

__all__ = ["DESCRIPTION", "add_arguments", "run_cli"]

# -- command line ----------------------------------------------------------------------------------------

DESCRIPTION = """\
Check hf_posenc's engines on this machine: every engine available here (Triton kernels on CUDA,
FlexAttention, the tile-wise PyTorch engines) against the package's float64 references on small shapes,
forward and gradients, timed against SDPA; then which backend each encoding uses here by default, and why.
The exit status is 1 when a check fails. Attach the --out report to bug reports."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``hf-posenc doctor`` (also ``python -m hf_posenc doctor``)."""
    p.add_argument("--out", metavar="PATH", help="write the JSON report to this file, or into this directory as "
                   f"{REPORT_NAME} (rewritten after every check)")
    p.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    p.add_argument("--dtype", dest="dtypes", metavar="DTYPES",
                   help="comma-separated: float32 (fp32), bfloat16 (bf16), float16 (fp16); default fp32,bf16 on "
                        "CUDA, fp32 on the CPU")
    p.add_argument("--engines", metavar="LIST", help=f"comma-separated subset of {','.join(ENGINES)}")
    p.add_argument("--cases", metavar="LIST", help="comma-separated subset of " + ",".join(c.name for c in cases()))
    p.add_argument("--quick", action="store_true", help="one case per family (and one dtype on CUDA)")
    p.add_argument("--no-timing", dest="timing", action="store_false", help="skip the timings against SDPA")
    p.add_argument("--interpret", action="store_true",
                   help="CPU: run the Triton kernels in Triton's interpreter (tiny shapes; slow). The doctor "
                        "re-runs itself with TRITON_INTERPRET=1 when triton was already imported without it")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")


def _argv_of(args: argparse.Namespace) -> list[str]:
    """The command-line options that give ``args`` (to re-run the doctor in a child process)."""
    argv = []
    for name in ("out", "device", "dtypes", "engines", "cases"):
        value = getattr(args, name)
        if value is not None:
            argv += [f"--{'dtype' if name == 'dtypes' else name}", str(value)]
    argv += ["--seed", str(args.seed)]
    argv += [flag for flag, on in (("--quick", args.quick), ("--no-timing", not args.timing),
                                   ("--interpret", args.interpret), ("--no-progress", not args.progress)) if on]
    return argv


def run_cli(args: argparse.Namespace) -> int:
    """Run the doctor from parsed arguments; 0 when every check passed, 1 otherwise, 2 on bad arguments."""
    on_cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    if args.interpret and on_cuda:
        print("hf-posenc doctor: --interpret runs the Triton kernels in Triton's CPU interpreter; with a CUDA "
              "device they run compiled (give --device cpu to interpret them)", file=sys.stderr)
        return 2
    if args.interpret and not _interpreter_ready():
        if os.environ.get("_HF_POSENC_DOCTOR_CHILD"):
            print("hf-posenc doctor: TRITON_INTERPRET=1 did not take effect", file=sys.stderr)
            return 2
        cmd = [sys.executable, "-m", "hf_posenc", "doctor", *_argv_of(args)]
        env = dict(os.environ, TRITON_INTERPRET="1", _HF_POSENC_DOCTOR_CHILD="1")
        return subprocess.run(cmd, env=env).returncode
    try:
        report = doctor(device=args.device, dtypes=args.dtypes, engines=args.engines, cases=args.cases,
                        quick=args.quick, timing=args.timing, out=args.out, progress=args.progress, seed=args.seed)
    except ValueError as exc:
        print(f"hf-posenc doctor: {exc}", file=sys.stderr)
        return 2
    if args.out:
        print(f"report written to {report_path(args.out)}")
    return 0 if report["ok"] else 1


def _interpreter_ready() -> bool:
    """Whether Triton's interpreter can run every kernel now: TRITON_INTERPRET was set before triton's import."""
    if not _interpreting():
        return False
    from ..kernels._errors import KernelImportError
    from ..kernels.attention import _triton_import_error

    try:
        if _triton_import_error() is not None:
            return True  # no triton: nothing to interpret, the rows say so
    except KernelImportError:
        return True  # a kernel module that fails to import: every Triton row reports it as an error
    from ..kernels.attention.triton_attention import stdlib_matches_mode

    return stdlib_matches_mode()
