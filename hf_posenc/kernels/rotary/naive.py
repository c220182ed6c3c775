"""References of the rotary kernels: block-diagonal rotations of queries or keys, and the plain 2D rotary by
angles (``apply_rotary``, ``rotate_leading``: what `hf_posenc.encodings.rope` and the remap engine apply)."""

from __future__ import annotations

import torch

from ...ops import upcast

__all__ = ["apply_block_rotation_reference", "apply_rotary", "rotate_leading"]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str) -> torch.Tensor:
    """Rotate ``x`` (..., L, D) by angles whose cos/sin have shape (..., L, D/2), broadcasting over the leading
    dims. ``layout="half"`` pairs x[i] with x[i + D/2] (transformers' Llama), ``"interleaved"`` x[2i] with
    x[2i + 1] (the RoFormer paper)."""
    if layout == "half":
        cos = torch.cat([cos, cos], dim=-1)
        sin = torch.cat([sin, sin], dim=-1)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.flatten(-2)


def rotate_leading(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int, layout: str
                   ) -> torch.Tensor:
    """`apply_rotary` on the first ``rotary_dim`` dims of ``x`` (..., L, D), cos/sin (..., L, rotary_dim/2); the
    dims past it pass through (partial rotary, as transformers' GPT-NeoX and Phi)."""
    if rotary_dim == x.shape[-1]:
        return apply_rotary(x, cos, sin, layout)
    rotated = apply_rotary(x[..., :rotary_dim], cos, sin, layout)
    rest = x[..., rotary_dim:]
    if rest.shape[:-1] != rotated.shape[:-1]:  # the angles broadcast over more dims than x has
        rest = rest.expand(*rotated.shape[:-1], rest.shape[-1])
    return torch.cat([rotated, rest], dim=-1)


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
