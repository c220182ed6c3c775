"""The rotary kernel inside compiled graphs: ``hf_posenc::rotary``, a PyTorch custom op.

Dynamo cannot trace the Triton kernel's dispatch (Triton's interpreter switch is a C++ call it skips, and the
launch goes through a wrapper object), so under ``torch.compile`` a model whose rotations would run the Triton
kernel in eager mode (`kernel_preferred`: ``HF_POSENC_BACKEND=triton``, or CUDA's default) calls this op
instead: one opaque node of the graph, whose fake gives the shapes. Inside, where the tensors are real, the kernel
runs when it takes the inputs (``_kernel_unsupported``), else the PyTorch reference (logged at debug level), or,
under ``HF_POSENC_BACKEND=triton``, a ValueError says why, as in eager mode. Where the kernel is not preferred
(the CPU), compiled models trace the reference itself, which inductor fuses.

* ``hf_posenc::rotary`` (q?, k, rot) -> [q_out, k_out] (or [k_out] without q), contiguous, in the inputs' dtypes;
* ``hf_posenc::rotary_backward`` (the output gradients, q?, k, rot, whether rot needs one) -> [dq?, dk, drot]
  (an empty tensor for drot when not wanted): the forward recomputed with autograd (a rotation is one pass over
  q and k; the kernel's own backward runs on it).
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from ...backend import forced_backend
from .._attn_dispatch import kernel_preferred as _kernel_preferred
from ..custom_ops import _autograd_inside
from . import _kernel_unsupported, apply_qk_rotation_reference
from .naive import apply_block_rotation_reference

__all__ = ["kernel_preferred", "rotary_op"]

logger = logging.getLogger(__name__)


def kernel_preferred(device: torch.device) -> bool:
    """Whether rotations on ``device`` prefer the Triton kernel, before the inputs are checked (no tensor read):
    the shared rule of `hf_posenc.kernels._attn_dispatch.kernel_preferred` for the ``rotary`` kind."""
    return _kernel_preferred("rotary", "rotary.triton_rotary", device)


def _run(q: Tensor | None, k: Tensor, rot: Tensor) -> tuple[Tensor | None, Tensor]:
    """(q_out or None, k_out) by the kernel where it takes the inputs, else the reference."""
    reason = _kernel_unsupported(q, k, rot)
    if reason is None:
        from .triton_rotary import RotaryQKFunction

        return RotaryQKFunction.apply(q, k, rot)
    if forced_backend() == "triton" and reason != "empty tensors":
        raise ValueError(f"HF_POSENC_BACKEND=triton, but {reason}")
    logger.debug("hf_posenc::rotary runs the PyTorch reference, not the Triton kernel: %s", reason)
    if q is None:
        return None, apply_block_rotation_reference(k, rot)
    return apply_qk_rotation_reference(q, k, rot)


@torch.library.custom_op("hf_posenc::rotary", mutates_args=())
def _rotary(q: Tensor | None, k: Tensor, rot: Tensor) -> list[Tensor]:
    with torch.no_grad():
        q_out, k_out = _run(q, k, rot)
    return [t.contiguous() for t in (q_out, k_out) if t is not None]


@_rotary.register_fake
def _(q, k, rot):
    return [t.new_empty(t.shape) for t in (q, k) if t is not None]


@torch.library.custom_op("hf_posenc::rotary_backward", mutates_args=())
def _rotary_backward(grads: list[Tensor], q: Tensor | None, k: Tensor, rot: Tensor, rot_grad: bool) -> list[Tensor]:
    leaves = [None if q is None else q.detach().requires_grad_(), k.detach().requires_grad_(),
              rot.detach().requires_grad_(rot_grad)]
    with _autograd_inside(), torch.enable_grad():
        outs = [t for t in _run(*leaves) if t is not None]
        wanted = [t for t in leaves if t is not None and t.requires_grad]
        got = torch.autograd.grad(outs, wanted, [g.to(o.dtype) for g, o in zip(grads, outs)], allow_unused=True)
    got = [g if g is not None else torch.zeros_like(t) for g, t in zip(got, wanted)]
    if not rot_grad:
        got.append(rot.new_empty(0))
    return [g.contiguous() for g in got]


@_rotary_backward.register_fake
def _(grads, q, k, rot, rot_grad):
    return [t.new_empty(t.shape) for t in (q, k) if t is not None] + [rot.new_empty(rot.shape if rot_grad else 0)]


def _setup_context(ctx, inputs, output) -> None:
    q, k, rot = inputs
    ctx.has_q = q is not None
    ctx.save_for_backward(q, k, rot)


def _autograd(ctx, grads):
    q, k, rot = ctx.saved_tensors
    rot_grad = bool(ctx.needs_input_grad[2])
    outs = [q, k] if ctx.has_q else [k]
    grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, outs)]
    got = _rotary_backward(grads, q, k, rot, rot_grad)
    dq = got.pop(0) if ctx.has_q else None
    dk, drot = got
    return dq, dk, (drot if rot_grad else None)


_rotary.register_autograd(_autograd, setup_context=_setup_context)


def rotary_op(q: Tensor | None, k: Tensor, rot: Tensor) -> tuple[Tensor | None, Tensor]:
    """(q_out or None, k_out) through ``hf_posenc::rotary`` (shapes already checked by the caller)."""
    outs = _rotary(q, k, rot)
    return (outs[0], outs[1]) if q is not None else (None, outs[0])
