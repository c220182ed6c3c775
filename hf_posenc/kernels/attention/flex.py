"""The position terms as FlexAttention ``score_mod`` functions (``torch.nn.attention.flex_attention``).

Same contract as ``naive.attention_reference`` for every kind of `flex_kinds` (shaw's value
term has no score_mod form). Masks (causal with the query offset, a sliding window and its attention sinks,
per-batch key validity) become a block mask (FlexAttention skips the blocks it marks empty: those outside the
window and its sinks), built once per forward when the caller passes a ``memo`` dict. On CUDA the call goes through
``torch.compile`` (FlexAttention's fused kernels; gradients of the captured term tensors included); on
the CPU it runs eagerly, which materialises the scores and has no backward in torch 2.13.
"""

from __future__ import annotations

import functools
import warnings

import torch

from .naive import check_window
from .._masks import CacheSinks
from .terms import KernelTerm, at_least_float32, enter, enter_sinks, flex_kinds

__all__ = ["flex_attention_term", "score_mod_for"]


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def score_mod_for(term: KernelTerm, q_offset: int, cache_sinks: CacheSinks | None = None):
    """The score_mod ``(score, b, h, q_idx, kv_idx) -> score + B_h(i, j)`` of ``term`` (None for ``none``): its
    registry entry's value (`value`) on FlexAttention's indices; with ``cache_sinks`` (a Toeplitz term) a far
    sink's at its cache distance (`CacheSinks.delta`)."""
    spec = term.spec
    if not spec.flex:
        raise ValueError(f"the {term.kind} term has no FlexAttention form; allowed: {', '.join(flex_kinds())}")
    if spec.form == "none":
        return None
    t, ints = {name: at_least_float32(x) for name, x in term.tensors.items()}, dict(term.ints)
    value = spec.distance if spec.form == "toeplitz" else None

    def score_mod(score, b, h, q_idx, kv_idx):
        if value is not None:
            delta = q_idx + q_offset - kv_idx
            return score + value(t, h, delta if cache_sinks is None else cache_sinks.delta(delta, kv_idx))
        return score + spec.pair(t, ints, b, h, q_idx, q_idx + q_offset, kv_idx)

    return score_mod


def _block_mask(causal: bool, q_offset: int, key_valid: torch.Tensor | None, batch: int, q_len: int, k_len: int,
                device: torch.device, memo: dict | None, window: int | None = None, sink: int | None = None):
    if not causal and key_valid is None and window is None:
        return None
    key = ("flex_block_mask", causal, q_offset, q_len, k_len, batch, window, sink,
           None if key_valid is None else (key_valid.data_ptr(), tuple(key_valid.shape)))
    if memo is not None and key in memo:
        return memo[key]
    from torch.nn.attention.flex_attention import create_block_mask

    valid = None if key_valid is None else key_valid.to(device=device, dtype=torch.bool).expand(batch, k_len)

    def mask_mod(b, h, q_idx, kv_idx):
        ok = kv_idx < k_len
        if causal:
            ok = ok & (kv_idx <= q_idx + q_offset)
        if window is not None:  # the band: qi − window < j (and j < qi + window bidirectionally), or a sink j < sink
            band = kv_idx > q_idx + q_offset - window
            if not causal:
                band = band & (kv_idx < q_idx + q_offset + window)
            ok = ok & (band | (kv_idx < sink)) if sink is not None else ok & band
        if valid is not None:
            ok = ok & valid[b, kv_idx]
        return ok

    mask = create_block_mask(mask_mod, batch if valid is not None else None, None, q_len, k_len, device=device)
    if memo is not None:
        memo[key] = mask
    return mask


def flex_attention_term(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    term: KernelTerm,
    *,
    scale: float,
    causal: bool,
    q_offset: int = 0,
    key_valid: torch.Tensor | None = None,
    memo: dict | None = None,
    window: int | None = None,
    sink: int | None = None,
    sink_positions: str | None = None,
) -> torch.Tensor:
    """softmax(scale · q kᵀ + B) v with FlexAttention; q (B, H, Lq, D), k, v (B, Hkv, Lk, D) -> (B, H, Lq, D).

    ``memo`` (e.g. the per-forward ``PosContext.memo``) keeps the block mask across layers. ``window``: None or
    an int >= 1, a sliding window folded into the block mask (causal: qi − window < j <= qi; bidirectional:
    |qi − j| < window), so the key blocks outside it are skipped; TypeError / ValueError otherwise. ``sink``:
    None or an int >= 1 with a window, the keys j < sink seen besides the band (their blocks are kept);
    ``sink_positions="cache"`` puts them at their cache positions in the score_mod (as ``naive.attention_reference``
    does)."""
    key, value, window = enter(query, key, value, term, q_offset, window, check_window)
    sink, cache = enter_sinks(term, window, sink, sink_positions, causal)
    from torch.nn.attention.flex_attention import flex_attention

    b, h, q_len, _ = query.shape
    k_len = key.shape[2]
    score_mod = score_mod_for(term, int(q_offset), cache)
    block_mask = _block_mask(causal, int(q_offset), key_valid, b, q_len, k_len, query.device, memo, window, sink)
    gqa = key.shape[1] != h
    if query.device.type == "cuda":
        fn = _compiled_flex()
    else:
        fn = flex_attention
        if not torch.is_grad_enabled():  # flex refuses CPU inputs that require grad, even under no_grad
            query, key, value = query.detach(), key.detach(), value.detach()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        out = fn(query, key.to(query.dtype), value.to(query.dtype), score_mod=score_mod, block_mask=block_mask,
                 scale=scale, enable_gqa=gqa)
    return out
