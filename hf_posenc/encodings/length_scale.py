"""The length-scaled softmax, the layer option ``length_scale``: a per-query factor on the attention logits that grows
with the number of keys the query sees, so that attention does not flatten as the context grows.

* ``"ssmax"``: Scalable-Softmax (Nakanishi 2025, "Scalable-Softmax Is Superior for Attention",
  https://arxiv.org/abs/2501.19399, eq. 2): softmax(s · log n · z) for the logits z of a query that sees n keys,
  with s a learned scalar per head and layer. The paper trains s from the start of pretraining and shows that
  SSMax can also replace softmax after pretraining (its Section 4.3); hf_posenc adds it to a trained model, so s
  starts at 1 / log P, P the model's context (``max_position_embeddings``): a query that sees P keys keeps its
  logits at the start, fewer keys flatten them, more sharpen them. That start is hf_posenc's choice, not the
  paper's.
* ``"logn"``: Qwen's log-n attention scaling (Qwen-7B's ``modeling_qwen.py``, ``use_logn_attn``): the query at
  1-based position n is multiplied by max(1, log n / log P), P the training length; fixed, nothing to learn.

How it acts: the query vector the attention receives (after the rotary and any QK-norm) is multiplied by the
factor, which is how both papers' code applies it. For dot-product logits that is the logits times the factor;
terms added to the logits (score biases, FoX's forget gates, TaPE's state products) are not scaled, and the
encodings that read q in other ways (CoPE's gates, stick-breaking's breaks) read the scaled q. Because it is a
scale of q, every engine (the tile engine, FlexAttention, the Triton kernels, the encodings' own attention) and
the KV cache take it unchanged.

n, the number of keys a query sees: on causal models the query at position p (its ``position_ids`` entry, the
logical position under left padding) sees n = p + 1 keys; with a sliding window W, n = min(p + 1, W), plus its
attention sinks outside the window, min(sink, max(p + 1 - W, 0)). On bidirectional models (BERT, ViT) n is the
number of keys the attention mask lets the query see (all of them without a mask); a window is not allowed there
with ``length_scale``.
"""

from __future__ import annotations

import math

import torch

from ..kernels._masks import query_indices

__all__ = ["check_length_scale_model", "keys_seen", "length_scale_factor", "ssmax_start"]


def check_length_scale_model(length_scale: str | None, info, sink: int | None, window: int | None,
                             name: str) -> None:
    """``ValueError`` where the model cannot take ``length_scale``: no context length to scale against, or a window
    on a bidirectional model (whose n would depend on the position within the band)."""
    if length_scale is None:
        return
    if not info.max_positions or info.max_positions < 2:
        raise ValueError(f"length_scale={length_scale!r} of {name!r} needs the model's context length P "
                         f"(max_position_embeddings >= 2); this {info.family} model has {info.max_positions!r}")
    if window is not None and not info.causal:
        raise ValueError(f"length_scale={length_scale!r} of {name!r} with a window is defined on causal models only "
                         f"(n, the keys a query sees, counts positions before it); {info.family} is bidirectional")


def ssmax_start(info) -> float:
    """The starting value of SSMax's s: 1 / log P (a query that sees P keys keeps its logits)."""
    return 1.0 / math.log(info.max_positions)


def keys_seen(
    position_ids: torch.Tensor | None,
    mask: torch.Tensor | None,
    causal: bool,
    q_len: int,
    k_len: int,
    q_offset: int | torch.Tensor,
    window: int | None,
    sink: int | None,
    device: torch.device,
) -> torch.Tensor:
    """n, the number of keys each query sees, float32 (B|1, 1, Lq, 1) (see the module docstring).

    Args:
        position_ids: (B|1, Lq) positions of the queries (causal text), or None (then ``q_offset + i``).
        mask: the attention mask (B|1, 1, Lq, Lk) bool or None; read on bidirectional models only.
        window, sink: the layer's sliding window and attention sinks (causal models).
    """
    if not causal:
        if mask is None:
            return torch.full((1, 1, q_len, 1), float(k_len), device=device)
        return mask.sum(-1, keepdim=True, dtype=torch.float32).clamp_min(1.0)
    if position_ids is None:
        position_ids = query_indices(q_len, q_offset, device)[None]
    n = position_ids.to(device=device, dtype=torch.float32)[:, None, :, None] + 1.0
    if window is not None:
        capped = n.clamp(max=float(window))
        if sink:
            capped = capped + (n - window).clamp(min=0.0, max=float(sink))
        n = capped
    return n.clamp_min(1.0)


def length_scale_factor(kind: str, n: torch.Tensor, context: int, s: torch.Tensor | None = None) -> torch.Tensor:
    """The factor on each query (B|1, H|1, Lq, 1) float32 for n (B|1, 1, Lq, 1) keys seen.

    Args:
        kind: ``"ssmax"`` (s · log n) or ``"logn"`` (max(1, log n / log P)).
        context: P, the model's context length.
        s: SSMax's (H,) scales of the layer (``"ssmax"`` only).
    """
    log_n = n.log()
    if kind == "logn":
        return (log_n / math.log(context)).clamp_min(1.0)
    if kind == "ssmax":
        return s.float()[None, :, None, None] * log_n
    raise ValueError(f"length_scale must be one of ['ssmax', 'logn'], got {kind!r}")
