"""What the attentions with their own softmax (``sba``, ``cope``) share around their engines: the checks of their
inputs (`check_attention_inputs`), the inputs of their full-matrix references (`reference_inputs`), and the choice
of a backend.

Each dispatcher asks `common_unsupported` (and its own checks) for a reason the Triton kernel cannot
run these inputs, then `choose` turns it into a backend: ``HF_POSENC_BACKEND=torch`` (or ``flex``,
which has no form of these attentions) -> the reference; ``triton`` -> the kernel or a ``ValueError`` naming
the reason; unset -> the kernel on CUDA when it supports the inputs, the reference otherwise.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..backend import forced_backend
from ..ops import eager_value_checks, expand_kv
from ._common import KERNEL_DTYPES, MAX_HEAD_DIM, compute_dtype, triton_import_error
from ._masks import allowed_keys, check_sink, check_window, windowed_allowed
from .defaults import cuda_default_backend

__all__ = [
    "check_attention_inputs", "choose", "common_unsupported", "kernel_preferred", "last_dim_contiguous",
    "reference_inputs",
]


def check_attention_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, q_offset: int | torch.Tensor
) -> None:
    """Validate the shapes a causal attention with its own softmax takes, whatever the backend: q (B, H, Lq, D);
    k, v (B, Hkv, Lk, D) with q's B and D and H a multiple of Hkv; query i is key ``q_offset + i`` with
    ``q_offset + Lq <= Lk``; mask (B|1, 1, Lq, Lk) or None.

    Raises:
        ValueError: a shape or an offset outside those.
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4D (B, H, L, D), got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    b, h, lq, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k and v must be (B, Hkv, Lk, D) with q's B and D, got {tuple(k.shape)}, {tuple(v.shape)}")
    if h % k.shape[1]:
        raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({k.shape[1]})")
    # A tensor offset (a StaticCache's) is read in eager mode on CPU only (elsewhere: a device sync per layer, a
    # graph break under torch.compile); a StaticCache keeps its queries among its keys.
    if not isinstance(q_offset, torch.Tensor) or eager_value_checks(q_offset):
        offset = int(q_offset)
        if offset < 0 or offset + lq > k.shape[2]:
            raise ValueError(f"q_offset={offset} with {lq} queries needs q_offset + Lq <= Lk={k.shape[2]}")
    if mask is not None and (mask.dim() != 4 or mask.shape[0] not in (1, b) or mask.shape[1] != 1
                             or mask.shape[2:] != (lq, k.shape[2])):
        raise ValueError(f"mask must be (B|1, 1, Lq, Lk) = ({b}|1, 1, {lq}, {k.shape[2]}), got {tuple(mask.shape)}")


def last_dim_contiguous(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The tensors with a contiguous last dim, as the Triton kernels load them (copied only where it is not)."""
    return [t if t.stride(-1) == 1 else t.contiguous() for t in tensors]


def reference_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    q_offset: int | torch.Tensor,
    causal: bool = True,
    window: int | None = None,
    sink: int | None = None,
) -> tuple[torch.dtype, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """What a full-matrix reference computes from: (dtype, q, k, v, allowed), q (B, H, Lq, D) and k, v expanded to
    (B, H, Lk, D), all in the compute dtype (float32; float64 for float64 inputs), and the keys each query may see
    (B|1, 1, Lq, Lk) bool or None (`allowed_keys`: the mask, causality on ``causal`` models, and with a ``window``
    its band, the ``sink`` first keys besides it: `windowed_allowed`).

    Raises:
        TypeError, ValueError: a ``window`` or ``sink`` that is not None or an int >= 1, or a sink without a window.
    """
    window = check_window(window)
    sink = check_sink(sink, window)
    dtype = compute_dtype(q.dtype)
    lq, lk = q.shape[2], k.shape[2]
    groups = q.shape[1] // k.shape[1]
    allowed = allowed_keys(mask, lq, lk, q_offset, causal, q.device)
    if window is not None:
        allowed = windowed_allowed(allowed, lq, lk, q_offset, window, sink)
    return dtype, q.to(dtype), expand_kv(k, groups).to(dtype), expand_kv(v, groups).to(dtype), allowed


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
