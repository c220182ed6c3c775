"""The oracle of the remap engine: the full (B, H, Lq, Lk) matrix written from f(i, j) (`Remap.distance`).

Test oracle only: it builds (B, H, Lq, Lk, R) angles and is never what a model runs.
"""

from __future__ import annotations

import torch

from ...ops import expand_kv
from ..rotary.naive import rotate_leading
from .cases import Remap

__all__ = ["remap_reference", "rotation_tables"]


def rotation_tables(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of the angles positions · θ: ``positions`` (...) float, ``inv_freq`` (R/2,) -> (..., R/2) each,
    computed in float32 (float64 for float64 ``dtype``) and cast to ``dtype``."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    angles = positions.to(work)[..., None] * inv_freq.to(device=positions.device, dtype=work)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def remap_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    remap: Remap,
    *,
    scale: float,
    pos_q: torch.Tensor,
    pos_k: torch.Tensor,
    inv_freq: torch.Tensor,
    rotary_dim: int,
    layout: str,
    q_offset: int = 0,
    key_valid: torch.Tensor | None = None,
    band: int | None = None,
) -> torch.Tensor:
    """Causal attention whose pairs are rotated by f(i, j), from the full matrix.

    Args:
        q: (B, H, Lq, D), rotated by the model's rotary at ``pos_q`` (its attention scaling included); k, v:
            (B, Hkv, Lk, D), k rotated at ``pos_k``. The rotary acts on the first ``rotary_dim`` dims in
            ``layout`` ("half" or "interleaved") with frequencies ``inv_freq`` (R/2,).
        remap: the remap (or window with sinks).
        scale: the logit scale.
        pos_q: (B|1, Lq) int positions of the queries; pos_k: (B|1, Lk) of the keys.
        q_offset: the cache index of the first query (query i is key q_offset + i).
        key_valid: (B|1, Lk) bool, False for padding keys; None: all valid.
        band: the model's own sliding window (keys each query sees, itself included), or None.

    Returns:
        out (B, H, Lq, D) in q's dtype; a query that sees no key gets zeros.

    Each pair: q and k are turned back to position 0 (R(−pos)), then q_i is rotated by f(i, j) and dotted with
    k_j: R(f) q · k = the logit of a rotary pair at distance f.
    """
    b, h, lq, d = q.shape
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    qf, kf, vf = q.to(work), expand_kv(k, h // k.shape[1]).to(work), expand_kv(v, h // v.shape[1]).to(work)
    q0 = rotate_leading(qf, *rotation_tables(-pos_q[:, None], inv_freq, work), rotary_dim, layout)
    k0 = rotate_leading(kf, *rotation_tables(-pos_k[:, None], inv_freq, work), rotary_dim, layout)
    qi = torch.arange(lq, device=q.device) + q_offset
    kj = torch.arange(k.shape[2], device=q.device)
    f = remap.distance(pos_q[:, :, None], pos_k[:, None, :], kj)  # (B|1, Lq, Lk)
    cos, sin = rotation_tables(f[:, None], inv_freq, work)  # (B|1, 1, Lq, Lk, R/2)
    rotated = rotate_leading(q0[:, :, :, None, :], cos, sin, rotary_dim, layout)  # (B, H, Lq, Lk, D)
    scores = (rotated * k0[:, :, None]).sum(-1) * scale
    allowed = remap.allowed(qi[:, None], kj[None, :])[None, None]
    if band is not None:
        allowed = allowed & (qi[:, None] - kj[None, :] < band)
    if key_valid is not None:
        allowed = allowed & key_valid[:, None, None, :]
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row with no key: zeros
    return (probs @ vf).to(q.dtype)
