"""Rotary kernel family: apply per-position block-diagonal rotations to q and k.

``apply_qk_rotation`` (queries and keys in one pass) and ``apply_block_rotation`` (one tensor) dispatch:

* ``HF_POSENC_BACKEND`` unset: the Triton kernel (``triton_rotary.py``) when the tensors are on a CUDA
  device, Triton imports and the kernel supports the inputs (block size 2, 4 or 8; float32, bfloat16 or
  float16); the PyTorch reference (``naive.py``) otherwise.
* ``HF_POSENC_BACKEND=triton``: the Triton kernel, or a ``ValueError`` that says why it cannot run (Triton
  missing, tensors on the CPU without ``TRITON_INTERPRET=1``, unsupported block size or dtype). Under
  ``TRITON_INTERPRET=1`` the kernel runs on CPU tensors in Triton's interpreter (slow; for tests).
* ``HF_POSENC_BACKEND=torch``: the reference. ``flex`` names an attention backend; rotations have no
  FlexAttention form, so under ``flex`` they use the reference too.

Where the rotations are exponentials exp(c S) of skew-symmetric blocks with a scalar c per token (``comrope``;
``liere`` on text with per-layer generators), the encodings skip the rotation tensor wherever the dispatch
above picks ``"torch"``: they rotate through `spectral.spectral_qk_rotation` (the eigenbasis of each S;
no (L, D/s, s, s) tensor).
"""

from __future__ import annotations

import functools

import torch

from ...backend import forced_backend
from .._common import KERNEL_DTYPES, triton_import_error
from ..defaults import cuda_default_backend
from .naive import apply_block_rotation_reference

__all__ = [
    "apply_block_rotation",
    "apply_block_rotation_reference",
    "apply_qk_rotation",
    "apply_qk_rotation_reference",
    "rotation_backend",
]

_KERNEL_BLOCK_SIZES = (2, 4, 8)
#: None when Triton and the kernel module import, else why not.
_triton_import_error = functools.partial(triton_import_error, "rotary.triton_rotary")


def _interpreting() -> bool:
    from .triton_rotary import interpreting

    return interpreting()


def _check_shapes(q: torch.Tensor | None, k: torch.Tensor, rot: torch.Tensor) -> None:
    """Validate q (B, H, L, D) or None, k (B, Hkv, L, D), rot (B|1, Hkv|1, L, D/s, s, s)."""
    if k.dim() != 4:
        raise ValueError(f"keys must be (B, Hkv, L, D), got shape {tuple(k.shape)}")
    b, hkv, length, d = k.shape
    if q is not None:
        if q.dim() != 4 or q.shape[0] != b or q.shape[2] != length or q.shape[3] != d:
            raise ValueError(
                f"queries must be (B, H, L, D) with the keys' B, L and D; got q {tuple(q.shape)}, k {tuple(k.shape)}"
            )
        if q.shape[1] % hkv:
            raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({hkv})")
    if rot.dim() != 6 or rot.shape[-1] != rot.shape[-2]:
        raise ValueError(f"rot must be (B|1, Hkv|1, L, D/s, s, s), got shape {tuple(rot.shape)}")
    s = rot.shape[-1]
    if s < 1 or d % s or rot.shape[3] != d // s or rot.shape[2] != length:
        raise ValueError(
            f"rot of shape {tuple(rot.shape)} does not fit L={length}, D={d}: expected (B|1, Hkv|1, {length}, "
            f"D/s, s, s) with D a multiple of the block size s"
        )
    if rot.shape[0] not in (1, b) or rot.shape[1] not in (1, hkv):
        raise ValueError(f"rot's first two dims must be (1 or B={b}, 1 or Hkv={hkv}), got {tuple(rot.shape[:2])}")
    if not rot.is_floating_point():
        raise TypeError(f"rot must be a float tensor (float32), got {rot.dtype}")
    devices = {t.device for t in (q, k, rot) if t is not None}
    if len(devices) > 1:
        raise ValueError(f"q, k and rot must be on the same device, got {sorted(str(x) for x in devices)}")


def _kernel_unsupported(q: torch.Tensor | None, k: torch.Tensor, rot: torch.Tensor | int) -> str | None:
    """None when the Triton kernel supports these inputs on this device, else the reason (a sentence). ``rot``:
    the rotations, or their block size."""
    err = _triton_import_error()
    if err is not None:
        return f"Triton is not available ({err}); install it with `pip install hf_posenc[triton]`"
    if k.device.type != "cuda" and not _interpreting():
        return (
            f"the tensors are on {k.device.type}; the Triton kernel needs CUDA tensors, or TRITON_INTERPRET=1 "
            "to run on the CPU in Triton's interpreter (slow, for tests)"
        )
    s = rot if isinstance(rot, int) else rot.shape[-1]
    if s not in _KERNEL_BLOCK_SIZES:
        return f"the Triton rotary kernel supports block sizes {_KERNEL_BLOCK_SIZES}, got {s}"
    for name, t in (("q", q), ("k", k)):
        if t is not None and t.dtype not in KERNEL_DTYPES:
            return f"the Triton rotary kernel supports float32, bfloat16 and float16, got {name}.dtype={t.dtype}"
    if q is not None and q.dtype != k.dtype:
        return f"the Triton rotary kernel needs q and k of one dtype, got {q.dtype} and {k.dtype}"
    if k.numel() == 0:
        return "empty tensors"
    return None


def rotation_backend(q: torch.Tensor | None, k: torch.Tensor, rot: torch.Tensor | int) -> str:
    """``"triton"`` or ``"torch"``: which implementation ``apply_qk_rotation`` uses for these inputs (``rot``: the
    rotations, or their block size).

    Under ``torch.compile``: ``"triton"`` where the kernel is preferred (`custom_op.kernel_preferred`; it
    then runs inside the custom op ``hf_posenc::rotary``, which checks the inputs), else ``"torch"``.

    Raises:
        ValueError: ``HF_POSENC_BACKEND`` names no backend, or names ``triton`` and the kernel cannot run.
    """
    if torch.compiler.is_compiling():
        return "triton" if kernel_preferred(k.device) else "torch"
    forced = forced_backend()
    if forced in ("torch", "flex"):
        return "torch"
    if forced == "triton":
        reason = _kernel_unsupported(q, k, rot)
        if reason is not None and reason != "empty tensors":
            raise ValueError(f"HF_POSENC_BACKEND=triton, but {reason}")
        return "torch" if reason else "triton"  # empty tensors: nothing to launch
    if k.device.type != "cuda" or cuda_default_backend("rotary") != "triton":  # hf_posenc/kernels/defaults.py
        return "torch"
    return "torch" if _kernel_unsupported(q, k, rot) else "triton"


def apply_qk_rotation_reference(
    q: torch.Tensor, k: torch.Tensor, rot: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of ``apply_qk_rotation``: ``apply_block_rotation_reference`` on q with rot repeated per
    group (query head h takes the rotation of key/value head h // (H / Hkv)), and on k."""
    groups = q.shape[1] // k.shape[1]
    rot_q = rot if rot.shape[1] == 1 or groups == 1 else rot.repeat_interleave(groups, dim=1)
    return apply_block_rotation_reference(q, rot_q), apply_block_rotation_reference(k, rot)


def apply_qk_rotation(q: torch.Tensor, k: torch.Tensor, rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate queries and keys by per-position block-diagonal rotations, in one pass on CUDA.

    out[b, h, l, blk*s + i] = sum_j rot[b', g, l, blk, i, j] * x[b, h, l, blk*s + j], with g = h // (H / Hkv)
    for the queries and g = h for the keys (b' = b, or 0 when rot is shared over the batch; likewise g).

    Args:
        q: (B, H, L, D) queries, H a multiple of Hkv; float32, bfloat16 or float16 (any strides).
        k: (B, Hkv, L, D) keys, same dtype.
        rot: (B or 1, Hkv or 1, L, D // s, s, s) float32 rotations, s the block size (D % s == 0).
            Gradients flow to rot when it requires them (learned rotations).

    Returns:
        (q_out (B, H, L, D), k_out (B, Hkv, L, D)) in the inputs' dtypes, computed in float32.

    Raises:
        ValueError: shapes that do not fit, or ``HF_POSENC_BACKEND`` asks for a backend that cannot run.
    """
    _check_shapes(q, k, rot)
    if torch.compiler.is_compiling() and kernel_preferred(k.device):
        return rotary_op(q, k, rot)  # the kernel inside a custom op (hf_posenc.kernels.rotary.custom_op)
    if rotation_backend(q, k, rot) == "triton":
        from .triton_rotary import rotary_qk

        return rotary_qk(q, k, rot)
    return apply_qk_rotation_reference(q, k, rot)


def apply_block_rotation(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (B, H, L, D) by ``rot`` (B|1, H|1, L, D/s, s, s); see ``naive.py`` for the formula.

    Dispatches like ``apply_qk_rotation`` (the same kernel, with no query heads).
    """
    _check_shapes(None, x, rot)
    if torch.compiler.is_compiling() and kernel_preferred(x.device):
        return rotary_op(None, x, rot)[1]
    if rotation_backend(None, x, rot) == "triton":
        from .triton_rotary import rotary_single

        return rotary_single(x, rot)
    return apply_block_rotation_reference(x, rot)


# the custom op imports the dispatch's pieces above (its module needs them defined first)
from .custom_op import kernel_preferred, rotary_op  # noqa: E402
