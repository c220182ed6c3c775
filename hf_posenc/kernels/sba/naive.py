"""Stick-breaking attention's reference math in plain PyTorch (Tan et al. 2024, "Scaling Stick-Breaking
Attention: An Efficient Implementation and In-depth Study", https://arxiv.org/abs/2410.17980; the formula is in
``hf_posenc/encodings/sba.py``), and the reference of the stick-breaking kernels behind their interface
(`sba_reference`, the test oracle).

The encoding (``hf_posenc.encodings.sba``) calls `stick_breaking_attention` for what no kernel covers
(the weights, attention dropout); it takes tensors only.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.nn import functional as F

from .._attn_dispatch import reference_inputs
from .._masks import query_indices

__all__ = ["SOFTPLUS_THRESHOLD", "broken_stick", "sba_reference", "stick_breaking_attention"]

#: above this the softplus is linear (the code's threshold, also in its Triton kernel's inline assembly).
SOFTPLUS_THRESHOLD = 15.0


def stick_breaking_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None,
                             scaling: float, q_index: torch.Tensor, attend_current: bool = False,
                             remainder: str = "discard", bias: torch.Tensor | None = None, dropout: float = 0.0,
                             training: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
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
    current = None
    if remainder == "current":  # the query's own value takes the rest of the stick
        current = v.index_select(2, q_index), (k_idx[None, :] == q_index[:, None])[None, None]
    # Σ_{k >= j} softplus(z_ik) over the breakpoints = Σ_{k=j}^{i-1} (or ^{i}) softplus(z_ik)
    return broken_stick(z, breaks, allowed, lambda sp: sp.flip(-1).cumsum(-1).flip(-1), v, remainder, bias, current,
                        dropout, training)


def broken_stick(
    z: torch.Tensor, breaks: torch.Tensor, allowed: torch.Tensor | None,
    broken_by: Callable[[torch.Tensor], torch.Tensor], v: torch.Tensor, remainder: str, bias: torch.Tensor | None,
    current: tuple[torch.Tensor, torch.Tensor] | None, dropout: float, training: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What every order of breaking shares: from the logits z (B, H, Lq, Lk) and the breakpoints ``breaks`` (Lq, Lk)
    bool (and ``allowed``), the weights A = exp(z − broken_by(sp)) of the breakpoints (sp = softplus(z), 0 off them;
    ``broken_by`` sums, per key j, sp over the keys broken before it and j itself, in the query's order), out = A v
    (after attention dropout) and the remainder r = exp(−Σ_j sp) = 1 − Σ_j A (>= 0 exactly): dropped, times the
    per-head ``bias`` (H, D), or for ``"current"`` times the query's own value, ``current`` = (its value
    (B, H, Lq, D), its place in the weights (1, 1, Lq, Lk) bool), which the returned weights then include."""
    breaks = breaks[None, None]
    if allowed is not None:
        breaks = breaks & allowed
    softplus = F.softplus(z, beta=1.0, threshold=SOFTPLUS_THRESHOLD).masked_fill(~breaks, 0.0)
    log_a = (z - broken_by(softplus)).masked_fill(~breaks, float("-inf"))
    weights = torch.exp(log_a)
    out = F.dropout(weights, p=dropout, training=training) @ v
    if remainder == "discard":
        return out, weights
    rest = torch.exp(-softplus.sum(-1, keepdim=True))  # 1 - Σ_j A_ij = Π_j (1 - β_ij), >= 0 exactly
    if remainder == "bias":
        return out + rest * bias[None, :, None, :], weights
    own, diag = current
    return out + rest * own, weights + rest * diag


def sba_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                  q_offset: int | torch.Tensor, attend_current: bool = False, remainder: str = "discard",
                  bias: torch.Tensor | None = None, window: int | None = None, sink: int | None = None) -> torch.Tensor:
    """Stick-breaking attention as `stick_breaking_attention` computes it, behind the kernels' interface: the
    arguments of `hf_posenc.kernels.sba.stick_breaking` (k and v expanded here), a ``window`` and its ``sink``
    applied as masks (`reference_inputs`): the keys they remove are removed as the mask removes keys (no weight,
    no break).

    Returns:
        (B, H, Lq, D) in q's dtype, computed in float32 (float64 for float64 inputs).
    """
    dtype, qc, kc, vc, allowed = reference_inputs(q, k, v, mask, q_offset, window=window, sink=sink)
    out, _ = stick_breaking_attention(qc, kc, vc, allowed, scale, query_indices(q.shape[2], q_offset, q.device),
                                      attend_current, remainder, None if bias is None else bias.to(dtype))
    return out.to(q.dtype)
