"""One place that reads ``HF_POSENC_BACKEND``: ``torch`` (references), ``flex`` or ``triton`` (kernels).

Unset, every op picks for itself: its Triton kernel when the tensors are on CUDA and the kernel supports
them, its PyTorch reference otherwise. Set, it forces that backend on every op that has one, and an op
that cannot honour it raises a ``ValueError`` saying why; nothing falls back silently.
"""

from __future__ import annotations

import os

__all__ = ["BACKENDS", "forced_backend"]

BACKENDS = ("torch", "flex", "triton")


def forced_backend() -> str | None:
    """The backend named by ``HF_POSENC_BACKEND`` (validated), or None when it is unset or empty."""
    forced = os.environ.get("HF_POSENC_BACKEND", "").strip().lower()
    if not forced:
        return None
    if forced not in BACKENDS:
        raise ValueError(f"HF_POSENC_BACKEND={forced!r} is not a backend; allowed: {', '.join(BACKENDS)}")
    return forced
