"""Stick-breaking attention's reference math in plain PyTorch (Tan et al. 2024, "Scaling Stick-Breaking
Attention: An Efficient Implementation and In-depth Study", https://arxiv.org/abs/2410.17980; the formula is in
``hf_posenc/encodings/sba.py``), and the reference of the stick-breaking kernels behind their interface
(`sba_reference`, the test oracle).

The encoding (``hf_posenc.encodings.sba``) calls `stick_breaking_attention` for what no kernel covers
(the weights, attention dropout); it takes tensors only.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from ...ops import expand_kv
from .._common import compute_dtype
from .._masks import allowed_keys, check_sink, check_window, windowed_allowed

__all__ = ["SOFTPLUS_THRESHOLD", "sba_reference", "stick_breaking_attention"]

#: above this the softplus is linear (the code's threshold, also in its Triton kernel's inline assembly).
SOFTPLUS_THRESHOLD = 15.0


def stick_breaking_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor | None,
    scaling: float,
    q_index: torch.Tensor,
    attend_current: bool = False,
    remainder: str = "discard",
    bias: torch.Tensor | None = None,
    dropout: float = 0.0,
    training: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stick-breaking attention in log space (the reference), in the dtype of ``q``.

    Args:
        q: (B, H, Lq, D); k, v: (B, H, Lk, D) (key/value heads already expanded).
        allowed: (B|1, 1, Lq, Lk) bool, the keys each query may see (causality included), or None.
        scaling: logit scale s.
        q_index: (Lq,) key index of each query (its own key, the diagonal).
        attend_current: whether the diagonal is a breakpoint.
        remainder: "discard", "current" or "bias" (see ``hf_posenc/encodings/sba.py``).
        bias: (H, D) the per-head vector of ``remainder="bias"``.

    Returns:
        out (B, H, Lq, D) and the attention weights (B, H, Lq, Lk) (with the remainder on the diagonal
        for ``remainder="current"``).
    """
    z = (q @ k.transpose(-1, -2)) * scaling
    k_idx = torch.arange(k.shape[2], device=q.device)
    breaks = (k_idx[None, :] < q_index[:, None]) if not attend_current else (k_idx[None, :] <= q_index[:, None])
    breaks = breaks[None, None]
    if allowed is not None:
        breaks = breaks & allowed
    softplus = F.softplus(z, beta=1.0, threshold=SOFTPLUS_THRESHOLD).masked_fill(~breaks, 0.0)
    # Σ_{k >= j} softplus(z_ik) over the breakpoints = Σ_{k=j}^{i-1} (or ^{i}) softplus(z_ik)
    suffix = softplus.flip(-1).cumsum(-1).flip(-1)
    log_a = (z - suffix).masked_fill(~breaks, float("-inf"))
    weights = torch.exp(log_a)
    out = F.dropout(weights, p=dropout, training=training) @ v
    if remainder == "discard":
        return out, weights
    rest = torch.exp(-softplus.sum(-1, keepdim=True))  # 1 - Σ_j A_ij = Π_j (1 - β_ij), >= 0 exactly
    if remainder == "bias":
        return out + rest * bias[None, :, None, :], weights
    # "current": the query's own value takes the rest of the stick
    own = v.index_select(2, q_index)
    diag = (k_idx[None, :] == q_index[:, None])[None, None]
    return out + rest * own, weights + rest * diag


def sba_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    q_offset: int | torch.Tensor,
    attend_current: bool = False,
    remainder: str = "discard",
    bias: torch.Tensor | None = None,
    window: int | None = None,
    sink: int | None = None,
) -> torch.Tensor:
    """Stick-breaking attention as `stick_breaking_attention` computes it, behind the kernels' interface.

    Args:
        q: (B, H, Lq, D); k, v: (B, Hkv, Lk, D), H a multiple of Hkv (expanded here).
        mask: (B|1, 1, Lq, Lk) bool (True = may attend) or None; causality (query i is key ``q_offset + i``)
            is always applied.
        scale: logit scale.
        attend_current, remainder: see the encoding; bias: (H, D) for ``remainder="bias"``.
        window: None, or an int >= 1: a sliding window, applied as the band mask qi − window < j (with the
            causal mask: each query sees its last ``window`` keys, itself included); the keys it removes are
            removed as the mask removes keys (see `windowed_allowed`).
        sink: None, or an int >= 1 with a ``window``: attention sinks, the keys j < sink kept besides the band
            (they count as any visible key does).

    Returns:
        (B, H, Lq, D) in q's dtype, computed in float32 (float64 for float64 inputs).
    """
    dtype = compute_dtype(q.dtype)
    b, h, lq, _ = q.shape
    lk = k.shape[2]
    groups = h // k.shape[1]
    allowed = windowed_allowed(allowed_keys(mask, lq, lk, q_offset, True, q.device), lq, lk, q_offset, window,
                               check_sink(sink, check_window(window)))
    offset = q_offset.to(q.device) if isinstance(q_offset, torch.Tensor) else q_offset
    q_index = torch.arange(lq, device=q.device) + offset
    out, _ = stick_breaking_attention(
        q.to(dtype), expand_kv(k, groups).to(dtype), expand_kv(v, groups).to(dtype), allowed, scale, q_index,
        attend_current, remainder, None if bias is None else bias.to(dtype),
    )
    return out.to(q.dtype)
