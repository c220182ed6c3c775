"""Reference of the CoPE kernels: the encoding's own PyTorch math, behind the kernel's interface."""

from __future__ import annotations

import torch

from ...encodings.cope import allowed_keys, cope_attention
from ...ops import expand_kv
from ..attention.naive import band_allowed, check_window

__all__ = ["cope_reference", "windowed_allowed"]


def windowed_allowed(
    allowed: torch.Tensor, lq: int, lk: int, q_offset: int | torch.Tensor, window: int | None
) -> torch.Tensor:
    """(B|1, 1, Lq, Lk) bool: ``allowed`` (causal, from ``allowed_keys``) and, with a ``window``, the band
    j > qi − window (query i is key ``q_offset + i``). The encodings' references treat a key the mask removes as
    absent: no weight, no CoPE gate, no stick-breaking break; so does the window. TypeError / ValueError for a
    window that is neither None nor an int >= 1."""
    window = check_window(window)
    if window is None:
        return allowed
    off = q_offset.to(allowed.device) if isinstance(q_offset, torch.Tensor) else q_offset
    qi = torch.arange(lq, device=allowed.device) + off
    return allowed & band_allowed(qi, torch.arange(lk, device=allowed.device), True, window)[None, None]


def cope_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    table: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    q_offset: int | torch.Tensor = 0,
    window: int | None = None,
) -> torch.Tensor:
    """Causal CoPE attention as ``hf_posenc.encodings.cope.cope_attention`` computes it.

    Args:
        q: (B, H, Lq, D); k, v: (B, Hkv, Lk, D), H a multiple of Hkv (expanded here).
        table: (D, npos) position embeddings e.
        mask: (B|1, 1, Lq, Lk) bool (True = may attend) or None; causality (query i is key ``q_offset + i``)
            is always applied.
        scale: logit scale (gates σ(s q·k), logits s q·k + q·e[p]).
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
    out, _ = cope_attention(
        q.to(dtype), expand_kv(k, groups).to(dtype), expand_kv(v, groups).to(dtype), allowed, scale, table.to(dtype)
    )
    return out.to(q.dtype)
