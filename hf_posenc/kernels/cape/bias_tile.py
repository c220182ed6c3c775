"""One tile of CAPE's base bias B, built from the base encoding's small tensors (text positions).

``kind`` and ``tensors`` (all in the compute dtype):

============  ==========================================  =============================================
kind          tensors                                     B_h(i, j), δ = qi − j (qi = q_offset + i)
============  ==========================================  =============================================
``alibi``     slopes (H,)                                 −slopes[h] · |δ|          (hf_posenc.encodings.alibi)
``kerple_log`` r1 (H,), r2 (H,)                           −r1[h] · log(1 + r2[h] · |δ|)  (…kerple)
``kerple_pow`` r1 (H,), r2 (H,)                           −r1[h] · |δ|^r2[h], 0 at δ = 0
``fire``      w1 (hid,), b1 (hid,), w2 (H, hid), b2 (H,),  f(log(1 + c·max(δ, 0)) / (log(1 + c·max(L, p_i)) + eps))_h
              c (), L (), positions (B|1, Lq)             f(x) = w2 · relu(x·w1 + b1) + b2, eps = 1e-6 (exact: no table)
============  ==========================================  =============================================

The formulas are those of the encodings' ``score_bias``; tests check the tiles against them.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

__all__ = ["BASE_KINDS", "base_bias_tile"]

#: the base biases with a tile form.
BASE_KINDS = ("alibi", "kerple_log", "kerple_pow", "fire")
FIRE_EPS = 1e-6


def base_bias_tile(
    kind: str,
    tensors: tuple[torch.Tensor, ...],
    q_index: torch.Tensor,
    k_index: torch.Tensor,
    rows: slice,
    batch_row: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The bias tile, heads first: (B|1, H, n, nk), or (1, H, n, nk) for one ``batch_row``.

    Args:
        kind: one of `BASE_KINDS`.
        tensors: the kind's tensors (module docstring).
        q_index: (n,) key index of each query of the tile (q_offset + i), in the compute dtype.
        k_index: (nk,) key indices of the tile.
        rows: the tile's query rows (slices fire's per-query positions).
        batch_row: the one batch row wanted (fire's positions may differ per row; the other kinds are the
            same on every row), or None for all of them.
        out: where to write the tile of that one row, (H, n, nk) (no autograd through it); the result is then
            ``out[None]``.
    """
    if out is not None:
        if batch_row is None:
            raise ValueError("base_bias_tile writes one batch row into out: give batch_row")
        if kind == "alibi":  # straight into out: no tile-sized temporary
            (slopes,) = tensors
            delta = (q_index[:, None] - k_index[None, :]).abs_()
            return torch.mul(delta, -slopes[:, None, None], out=out)[None]
        return out.copy_(base_bias_tile(kind, tensors, q_index, k_index, rows, batch_row)[0])[None]
    delta = q_index[:, None] - k_index[None, :]  # (n, nk) i - j
    if kind == "alibi":
        (slopes,) = tensors
        return (delta.abs() * -slopes[:, None, None])[None]
    if kind == "kerple_log":
        r1, r2 = tensors
        return (-r1[:, None, None] * torch.log1p(r2[:, None, None] * delta.abs()))[None]
    if kind == "kerple_pow":
        r1, r2 = tensors
        d = delta.abs()
        r1, r2 = r1[:, None, None], r2[:, None, None]
        safe = torch.where(d > 0, d, torch.ones_like(d))
        return torch.where(d > 0, -r1 * safe.pow(r2), torch.zeros_like(r1 * d))[None]
    if kind == "fire":
        w1, b1, w2, b2, c, threshold, positions = tensors
        if batch_row is not None and positions.shape[0] > 1:
            positions = positions[batch_row : batch_row + 1]
        pos = positions[:, rows]  # (B|1, n)
        normaliser = torch.log1p(c * torch.maximum(threshold, pos)) + FIRE_EPS  # (B|1, n)
        x = torch.log1p(c * delta.clamp_min(0.0))[None] / normaliser[..., None]  # (B|1, n, nk)
        return F.linear(F.relu(x[..., None] * w1 + b1), w2, b2).movedim(-1, 1)
    raise ValueError(f"unknown CAPE base bias kind {kind!r}; allowed: {', '.join(BASE_KINDS)}")
