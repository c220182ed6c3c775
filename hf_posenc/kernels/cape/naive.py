"""The full-matrix CAPE attention: the reference (and test oracle) of `hf_posenc.kernels.cape.tiled`.

Pre-softmax scores A = L + B + f(L, B) with L = Q K^T * scaling (B, H, Lq, Lk), B the base bias
(B|1, H, Lq, Lk) and f the two-layer MLP with a LeakyReLU (slope 0.01) over the 2H values [L_1..H, B_1..H]
at each (i, j) (see `hf_posenc.encodings.cape`). It builds (B, Lq, Lk, 2H) and (B, Lq, Lk, hidden)
tensors: O(L^2) memory.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from ...ops import expand_kv, masked_softmax, upcast

__all__ = ["cape_attention_reference", "cape_scores_reference"]


def cape_scores_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    bias: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor,
    w2: torch.Tensor,
    b2: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """Pre-mask scores (B, H, Lq, Lk), float32 (float64 inputs stay float64).

    Args:
        query: (B, H, Lq, D); key: (B, Hkv, Lk, D), H a multiple of Hkv.
        bias: (B|1, H, Lq, Lk) base bias.
        w1: (hidden, 2H), b1: (hidden,), w2: (H, hidden), b2: (H,): the MLP f.
        scaling: the logit scale.
    """
    b, h = query.shape[:2]
    if h % key.shape[1]:
        raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({key.shape[1]})")
    key = expand_kv(key, h // key.shape[1])
    logits = torch.matmul(upcast(query), upcast(key).transpose(-1, -2)) * scaling
    dt = torch.promote_types(logits.dtype, bias.dtype)
    logits, bias = logits.to(dt), bias.to(dt).expand(b, -1, -1, -1)
    feats = torch.cat([logits, bias], dim=1).permute(0, 2, 3, 1)  # (B, Lq, Lk, 2H)
    w1, b1, w2, b2 = (t.to(dt) for t in (w1, b1, w2, b2))
    f = F.linear(F.leaky_relu(F.linear(feats, w1, b1), negative_slope=0.01), w2, b2).permute(0, 3, 1, 2)
    return logits + bias + f


def cape_attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bias: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor,
    w2: torch.Tensor,
    b2: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    training: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CAPE attention: out (B, H, Lq, D) in the dtype of ``query`` and the probabilities (B, H, Lq, Lk).

    ``mask`` (B|1, 1, Lq, Lk) bool (True = attend) or None; rows with every key masked give zeros."""
    scores = cape_scores_reference(query, key, bias, w1, b1, w2, b2, scaling)
    probs = masked_softmax(scores, mask)
    probs = F.dropout(probs, p=dropout, training=training).to(query.dtype)
    value = expand_kv(value, query.shape[1] // value.shape[1])
    return torch.matmul(probs, value), probs
