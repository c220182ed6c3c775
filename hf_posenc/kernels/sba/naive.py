"""Reference of the stick-breaking kernels: the encoding's own PyTorch math, behind the kernel's interface."""

from __future__ import annotations

import torch

from ...encodings.cope import allowed_keys
from ...encodings.sba import stick_breaking_attention
from ...ops import expand_kv
from ..cope.naive import windowed_allowed

__all__ = ["sba_reference"]


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
) -> torch.Tensor:
    """Stick-breaking attention as ``hf_posenc.encodings.sba.stick_breaking_attention`` computes it.

    Args:
        q: (B, H, Lq, D); k, v: (B, Hkv, Lk, D), H a multiple of Hkv (expanded here).
        mask: (B|1, 1, Lq, Lk) bool (True = may attend) or None; causality (query i is key ``q_offset + i``)
            is always applied.
        scale: logit scale.
        attend_current, remainder: see the encoding; bias: (H, D) for ``remainder="bias"``.
        window: None, or an int >= 1: a sliding window, applied as the band mask qi − window < j (with the
            causal mask: each query sees its last ``window`` keys, itself included); the keys it removes are
            removed as the mask removes keys (see :func:`windowed_allowed`).

    Returns:
        (B, H, Lq, D) in q's dtype, computed in float32 (float64 for float64 inputs).
    """
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    b, h, lq, _ = q.shape
    lk = k.shape[2]
    groups = h // k.shape[1]
    allowed = windowed_allowed(allowed_keys(mask, lq, lk, q_offset, True, q.device), lq, lk, q_offset, window)
    offset = q_offset.to(q.device) if isinstance(q_offset, torch.Tensor) else q_offset
    q_index = torch.arange(lq, device=q.device) + offset
    out, _ = stick_breaking_attention(
        q.to(dtype), expand_kv(k, groups).to(dtype), expand_kv(v, groups).to(dtype), allowed, scale, q_index,
        attend_current, remainder, None if bias is None else bias.to(dtype),
    )
    return out.to(q.dtype)
