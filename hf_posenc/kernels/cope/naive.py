"""Reference of the CoPE kernels: the encoding's own PyTorch math, behind the kernel's interface."""

from __future__ import annotations

import torch

from ...encodings.cope import allowed_keys, cope_attention
from ...ops import expand_kv

__all__ = ["cope_reference"]


def cope_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    table: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    q_offset: int | torch.Tensor = 0,
) -> torch.Tensor:
    """Causal CoPE attention as ``hf_posenc.encodings.cope.cope_attention`` computes it.

    Args:
        q: (B, H, Lq, D); k, v: (B, Hkv, Lk, D), H a multiple of Hkv (expanded here).
        table: (D, npos) position embeddings e.
        mask: (B|1, 1, Lq, Lk) bool (True = may attend) or None; causality (query i is key ``q_offset + i``)
            is always applied.
        scale: logit scale (gates σ(s q·k), logits s q·k + q·e[p]).

    Returns:
        (B, H, Lq, D) in q's dtype, computed in float32 (float64 for float64 inputs).
    """
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    b, h, lq, _ = q.shape
    lk = k.shape[2]
    groups = h // k.shape[1]
    allowed = allowed_keys(mask, lq, lk, q_offset, True, q.device)
    out, _ = cope_attention(
        q.to(dtype), expand_kv(k, groups).to(dtype), expand_kv(v, groups).to(dtype), allowed, scale, table.to(dtype)
    )
    return out.to(q.dtype)
