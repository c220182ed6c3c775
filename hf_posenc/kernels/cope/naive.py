"""CoPE's reference math in plain PyTorch (Golovneva et al. 2024, "Contextual Position Encoding",
https://arxiv.org/abs/2405.18719; the formula is in ``hf_posenc/encodings/cope.py``), and the reference of the
CoPE kernels behind their interface (`cope_reference`, the test oracle).

The encoding (``hf_posenc.encodings.cope``) calls `cope_attention` for what no kernel covers (the
probabilities, attention dropout, the bidirectional variants); it takes tensors only.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from .._attn_dispatch import reference_inputs

__all__ = ["cope_attention", "cope_positions", "cope_reference", "interpolate_logits"]


def cope_positions(gates: torch.Tensor, direction: str = "before") -> torch.Tensor:
    """Contextual positions from masked gates (..., Lq, Lk).

    ``before``: p_ij = Σ_{k >= j} g_ik (with the gates after the query zeroed, = Σ_{k=j..i} g_ik; the
    paper's flip-cumsum-flip). ``after``: p_ij = Σ_{k <= j} g_ik (with the gates before the query zeroed,
    = Σ_{k=i..j} g_ik)."""
    if direction == "before":
        return gates.flip(-1).cumsum(-1).flip(-1)
    return gates.cumsum(-1)


def interpolate_logits(z: torch.Tensor, positions: torch.Tensor, npos_max: int) -> torch.Tensor:
    """z_i[p_ij] interpolated between ⌊p⌋ and ⌈p⌉.

    Args:
        z: (B, H, Lq, npos_max) = q_i · e[p] for the integer positions.
        positions: (B, H, Lq, Lk) non-negative contextual positions (clipped here to npos_max - 1).

    Returns:
        (B, H, Lq, Lk): (p − ⌊p⌋) z[⌈p⌉] + (1 − p + ⌊p⌋) z[⌊p⌋].
    """
    positions = positions.clamp(max=npos_max - 1)
    floor = positions.floor()
    w = positions - floor  # differentiable, as in the code
    idx_floor = floor.long()
    idx_ceil = positions.ceil().long()
    z_floor = z.gather(-1, idx_floor)
    z_ceil = z.gather(-1, idx_ceil)
    return z_ceil * w + z_floor * (1 - w)


def cope_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None, scaling: float,
                   table: torch.Tensor, table_after: torch.Tensor | None = None, q_index: torch.Tensor | None = None,
                   no_position: torch.Tensor | None = None, uncounted: torch.Tensor | None = None,
                   dropout: float = 0.0, training: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """CoPE attention (the reference), everything in the dtype of ``q``.

    Args:
        q: (B, H, Lq, D); k, v: (B, H, Lk, D) (key/value heads already expanded).
        allowed: (B|1, 1, Lq, Lk) bool (True = attend), or None (every key).
        scaling: logit scale s (gates σ(s q·k), logits s q·k + z).
        table: (D, npos_max) position embeddings e (keys at or before the query).
        table_after: (D, npos_max) for keys after the query (bidirectional models) or None (causal).
        q_index: (Lq,) key index of each query; needed with ``table_after``.
        no_position: (Lq, Lk) bool, pairs that take no position term (those involving CLS), or None.
        uncounted: (Lk,) bool, keys whose gates are never counted (CLS), or None.

    Returns:
        out (B, H, Lq, D) and the probabilities (B, H, Lq, Lk).
    """
    npos = table.shape[-1]
    logits = (q @ k.transpose(-1, -2)) * scaling
    gates = torch.sigmoid(logits)
    if allowed is not None:
        gates = gates.masked_fill(~allowed, 0.0)
    if uncounted is not None:
        gates = gates.masked_fill(uncounted, 0.0)
    if table_after is None:
        position_logits = interpolate_logits(q @ table, cope_positions(gates, "before"), npos)
    else:
        k_idx = torch.arange(k.shape[2], device=q.device)
        before = k_idx[None, :] <= q_index[:, None]  # (Lq, Lk)
        p_before = cope_positions(gates.masked_fill(~before, 0.0), "before")
        p_after = cope_positions(gates.masked_fill(before & (k_idx[None, :] != q_index[:, None]), 0.0), "after")
        position_logits = torch.where(
            before,
            interpolate_logits(q @ table, p_before, npos),
            interpolate_logits(q @ table_after, p_after, npos),
        )
    if no_position is not None:
        position_logits = position_logits.masked_fill(no_position, 0.0)
    scores = logits + position_logits
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)  # fully masked rows (left padding) -> 0
    dropped = F.dropout(probs, p=dropout, training=training)
    return dropped @ v, probs


def cope_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, mask: torch.Tensor | None,
                   scale: float, q_offset: int | torch.Tensor = 0, window: int | None = None, sink: int | None = None
                   ) -> torch.Tensor:
    """Causal CoPE attention as `cope_attention` computes it, behind the kernels' interface: the arguments of
    `hf_posenc.kernels.cope.cope` (k and v expanded here), a ``window`` and its ``sink`` applied as masks
    (`reference_inputs`): the keys they remove are removed as the mask removes keys (no weight, no gate).

    Returns:
        (B, H, Lq, D) in q's dtype, computed in float32 (float64 for float64 inputs).
    """
    dtype, qc, kc, vc, allowed = reference_inputs(q, k, v, mask, q_offset, window=window, sink=sink)
    out, _ = cope_attention(qc, kc, vc, allowed, scale, table.to(dtype))
    return out.to(q.dtype)
