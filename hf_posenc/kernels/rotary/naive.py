"""Reference of the rotary kernel: apply block-diagonal rotations to queries or keys."""

from __future__ import annotations

import torch

from ...ops import upcast

__all__ = ["apply_block_rotation_reference"]


def apply_block_rotation_reference(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """out[b, h, l, blk*s + i] = sum_j rot[b, h, l, blk, i, j] * x[b, h, l, blk*s + j].

    Args:
        x: (B, H, L, D) queries or keys, any float dtype.
        rot: (B or 1, H or 1, L, D // s, s, s) rotations (float32), s the block size; D % s == 0.

    Returns:
        (B, H, L, D) in x's dtype, computed in float32 (float64 for float64 inputs).
    """
    b, h, n, d = x.shape
    s = rot.shape[-1]
    blocks = upcast(x).reshape(b, h, n, d // s, s)
    out = torch.einsum("...kij,...kj->...ki", rot.to(blocks.dtype), blocks)
    return out.reshape(b, h, n, d).to(x.dtype)
