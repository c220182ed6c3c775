"""``hf-posenc doctor`` / ``hf_posenc.doctor()``: check every engine on this machine against the reference.

What it does, on the machine it runs on (the installed package; no repository needed):

1. prints the versions (Python, torch, CUDA, Triton, transformers, hf_posenc), the device and its compute
   capability;
2. runs every engine available there on small shapes, forward **and** gradients (q, k, v and the term's
   parameter tensors), against the package's full-matrix references computed in float64 from the same
   (rounded) inputs:

   * ``triton``: the Triton kernels (CUDA; on the CPU only in Triton's interpreter, with tiny shapes, when
     ``TRITON_INTERPRET=1`` is set or ``--interpret`` asks for it);
   * ``flex``: torch's FlexAttention with the term as a score_mod (attention terms but shaw; on the CPU it
     has no backward, so the row checks the forward only and says so);
   * ``tiled``: the tile-wise PyTorch engines (any device), with small tiles so that every cross-tile carry
     is exercised;

   over every registered attention term (the term registry: alibi, kerple log and power, sandwich, t5, fire,
   shaw, fox, dpb, and a term a user's module registered before the doctor runs), stick-breaking
   attention (SBA), CoPE, CAPE, the rotary kernel (block sizes 2 and 8) and windowed launches (alibi, SBA,
   CoPE with a sliding window). Each row gives the relative error of the output and of every gradient
   (||engine − reference|| / ||reference||), pass or fail against the tolerance of its dtype
   (``TOLERANCE``), and the time of the engine's forward+backward against SDPA's (causal, no bias) on
   the same shape;
3. says which backend each registered encoding uses by default on this device, and why
   (``default_backends``).

The report (``doctor``'s return value, ``--out PATH``) is one JSON object, schema ``SCHEMA``;
``make gpu-check`` commits the same object (with a ``benchmarks`` key added) as
``benchmarks/results/gpu_check_<gpu>.json``. The exit status of the command is 1 when any row fails or
errors. See docs/doctor.md.

The package is not named ``doctor`` because ``hf_posenc.doctor`` is the function. Its modules, along its
concerns: ``probe`` (the machine), ``explain`` (the default backends and why), ``cases`` (the checks and their
inputs: one per registered attention term, from the term registry), ``rows`` (one row: an engine against the
reference, timed), ``run`` (``doctor``, ``merge_reports``), ``report`` (the text), ``cli`` (the command).
"""

from __future__ import annotations

from .cases import QUICK_CASES, SHAPE, SHAPE_INTERPRETED, TILES, Case, cases
from .cli import DESCRIPTION, _argv_of, _interpreter_ready, add_arguments, run_cli
from .explain import default_backends
from .probe import environment
from .report import format_report
from .rows import GRAD_FLOOR, TOLERANCE
from .run import ENGINES, REPORT_NAME, SCHEMA, doctor, merge_reports, report_path

__all__ = ["CASES", "DESCRIPTION", "ENGINES", "QUICK_CASES", "SCHEMA", "SHAPE", "SHAPE_INTERPRETED", "TILES",
           "TOLERANCE", "GRAD_FLOOR", "Case", "add_arguments", "cases", "default_backends", "doctor", "environment",
           "format_report", "merge_reports", "run_cli", "REPORT_NAME", "report_path"]


def __getattr__(name: str):
    """``CASES``: every check, built from the term registry now (``cases.cases``)."""
    if name == "CASES":
        return cases()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
