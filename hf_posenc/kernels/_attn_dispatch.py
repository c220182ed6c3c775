"""Checks shared by the dispatchers of the attention kernels (``sba``, ``cope``).

Each dispatcher asks `common_unsupported` (and its own checks) for a reason the Triton kernel cannot
run these inputs, then `choose` turns it into a backend: ``HF_POSENC_BACKEND=torch`` (or ``flex``,
which has no form of these attentions) -> the reference; ``triton`` -> the kernel or a ``ValueError`` naming
the reason; unset -> the kernel on CUDA when it supports the inputs, the reference otherwise.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..backend import forced_backend
from ._common import KERNEL_DTYPES, MAX_HEAD_DIM, triton_import_error
from .defaults import cuda_default_backend

__all__ = ["choose", "common_unsupported", "kernel_preferred"]


def _interpreting() -> bool:
    from ._jit import interpreting

    return interpreting()


def flag_unsupported(name: str, need_weights: bool, dropout: float, training: bool) -> str | None:
    """The reason the ``name`` kernel cannot run a call, from its Python flags alone (traceable), or None."""
    if need_weights:
        return f"the attention weights were requested (output_attentions); the {name} kernel never forms them"
    if dropout > 0.0 and training:
        return f"the {name} kernel has no attention dropout (dropout={dropout} while training)"
    return None


def common_unsupported(
    name: str,
    module: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    q_offset: int | torch.Tensor,
    need_weights: bool,
    dropout: float,
    training: bool,
) -> str | None:
    """The reason the ``name`` kernel cannot run these inputs (a sentence), or None."""
    err = triton_import_error(module)
    if err is not None:
        return f"Triton is not available ({err}); install it with `pip install hf_posenc[triton]`"
    if q.device.type != "cuda" and not _interpreting():
        return (
            f"the tensors are on {q.device.type}; the Triton {name} kernel needs CUDA tensors, or "
            "TRITON_INTERPRET=1 to run on the CPU in Triton's interpreter (slow, for tests)"
        )
    why = flag_unsupported(name, need_weights, dropout, training)
    if why is not None:
        return why
    for label, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in KERNEL_DTYPES:
            return f"the {name} kernel supports float32, bfloat16 and float16, got {label}.dtype={t.dtype}"
    if not (q.dtype == k.dtype == v.dtype):
        return f"the {name} kernel needs q, k and v of one dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
    if q.shape[-1] > MAX_HEAD_DIM:
        return f"the {name} kernel supports head_dim up to {MAX_HEAD_DIM}, got {q.shape[-1]}"
    if len({q.device, k.device, v.device} | ({mask.device} if mask is not None else set())) > 1:
        return "q, k, v and the mask are not on one device"
    if mask is not None and (mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1):
        return f"the {name} kernel takes a (B|1, 1, Lq, Lk) bool mask, got {tuple(mask.shape)} {mask.dtype}"
    if q.numel() == 0 or k.numel() == 0:
        return "empty tensors"
    return None


def kernel_preferred(kind: str, module: str, device: torch.device) -> bool:
    """Whether a call of ``kind`` (``"sba"``, ``"cope"``, ``"rotary"``) on ``device`` prefers its Triton kernel
    (the kernel module ``module``), before its inputs are checked: ``HF_POSENC_BACKEND=triton``, or none forced,
    a CUDA device, the kind's CUDA default ``triton`` and Triton importable. No tensor is read (traceable)."""
    forced = forced_backend()
    if forced is not None:
        return forced == "triton"
    return (torch.device(device).type == "cuda" and cuda_default_backend(kind) == "triton"
            and triton_import_error(module) is None)


def choose(reason: Callable[[], str | None], on_cuda: bool, kind: str, static: str | None = None) -> str:
    """``"triton"`` or ``"torch"`` from ``HF_POSENC_BACKEND`` and ``reason()`` (None: the kernel can run).

    Unforced on CUDA, the default of ``kind`` (``"sba"``, ``"cope"``) in
    `hf_posenc.kernels.defaults.CUDA_DEFAULT_BACKEND` decides whether the kernel is tried at all.

    Under ``torch.compile``: ``"torch"``, the tile engine's custom op (``hf_posenc::engine``), which runs the kernel
    inside where `kernel_preferred` and the inputs allow (checked in the op, where the tensors are real;
    neither the kernel's launch nor Triton's mode can be traced). ``static`` is the part of ``reason`` that only
    Python flags decide (a bidirectional CoPE, output_attentions, attention dropout): those calls never reach the
    op, so with ``HF_POSENC_BACKEND=triton`` it raises while tracing, as eager mode does, instead of running the
    reference in the graph.

    Raises:
        ValueError: ``HF_POSENC_BACKEND=triton`` and the kernel cannot run these inputs.
    """
    forced = forced_backend()
    if torch.compiler.is_compiling():
        if forced == "triton" and static is not None:
            raise ValueError(f"HF_POSENC_BACKEND=triton, but {static}")
        return "torch"
    if forced in ("torch", "flex"):
        return "torch"
    if forced == "triton":
        why = reason()
        if why is not None and why != "empty tensors":
            raise ValueError(f"HF_POSENC_BACKEND=triton, but {why}")
        return "torch" if why else "triton"  # empty tensors: nothing to launch
    if not on_cuda or cuda_default_backend(kind) != "triton":
        return "torch"
    return "torch" if reason() is not None else "triton"
