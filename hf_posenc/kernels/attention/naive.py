"""Reference of the fused attention kernel family: every position term in plain PyTorch (float32, O(L²)).

Same interface as the kernel (``fused_attention`` in ``triton_attention.py``): q (B, H, Lq, D), k and v
(B, Hkv, Lk, D) with H a multiple of Hkv (query head h reads key/value head h // (H / Hkv)), a
`KernelTerm`, the logit scale, causal or bidirectional, the key
index of the first query (``q_offset``: query i is key q_offset + i) and an optional per-batch key-valid
vector, and an optional sliding ``window`` (a band mask: causal, key j visible iff qi − window < j <= qi;
bidirectional, iff |qi − j| < window), with optional attention sinks (``sink``: the keys j < sink are visible
besides the band, causally), at their text positions or, causal with a Toeplitz term, at their cache positions
(``sink_positions="cache"``: the term of a far sink at its cache distance, `hf_posenc.kernels._masks.CacheSinks`).
Gradients come from autograd, for q, k, v and every term tensor that
requires them.
"""

from __future__ import annotations

import torch

from ...ops import expand_kv
from .._masks import CacheSinks, band_allowed, check_window
from .terms import KernelTerm, at_least_float32, enter, enter_sinks

__all__ = ["attention_reference", "band_allowed", "check_window", "term_bias"]


def _upcast(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def term_bias(
    term: KernelTerm, query: torch.Tensor | None, q_len: int, k_len: int, q_offset: int = 0,
    memo: dict | None = None, cache_sinks: CacheSinks | None = None,
) -> torch.Tensor | None:
    """The additive logit term (B|1, H, Lq, Lk) float32 of ``term`` (None for ``none``): its registry entry's
    value (`TermSpec`) evaluated on broadcast index tensors (b, h, i, j); with ``cache_sinks`` (the sinks at their
    cache positions, a Toeplitz term) a far sink's at its cache distance (`CacheSinks.delta`).

    ``query`` (B, H, Lq, D) is needed by terms with a ``prepare`` step only (shaw: its key term is scale-free
    here: the caller scales q . a^K with the logits; see `attention_reference`). ``memo`` (a per-forward
    dict, e.g. ``PosContext.memo``): the index tensors are built once for every layer of a forward that asks
    with the same sizes and offset (a decoding step's 30 layers built 4 aranges each)."""
    spec = term.spec
    if spec.form == "none":
        return None
    t = {name: at_least_float32(x) for name, x in term.tensors.items()}
    if spec.prepare is not None:
        t.update(spec.prepare(term, query))
    device = next(iter(t.values())).device
    heads = term.num_heads if term.num_heads is not None else query.shape[1]
    batch = query.shape[0] if spec.prepare is not None else max(
        [t[ts.name].shape[ts.batch_dim] for ts in spec.tensors if ts.batch_dim is not None], default=1)
    key = ("term_bias_index", batch, heads, q_len, k_len, q_offset, device, cache_sinks)
    grid = None if memo is None else memo.get(key)
    if grid is None:
        b = torch.arange(batch, device=device)[:, None, None, None]
        h = torch.arange(heads, device=device)[None, :, None, None]
        i = torch.arange(q_len, device=device)[:, None]
        qi = i + q_offset  # (Lq, 1) key index of each query
        j = torch.arange(k_len, device=device)[None, :]
        grid = (b, h, i, qi, j, qi - j if cache_sinks is None else cache_sinks.delta(qi - j, j))
        if memo is not None:
            memo[key] = grid
    b, h, i, qi, j, delta = grid
    if spec.form == "toeplitz":  # a function of (h, δ): no batch dimension
        return spec.distance(t, h[0], delta)[None]
    return spec.pair(t, term.ints, b, h, i, qi, j)


def attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    term: KernelTerm,
    *,
    scale: float,
    causal: bool,
    q_offset: int = 0,
    key_valid: torch.Tensor | None = None,
    window: int | None = None,
    sink: int | None = None,
    sink_positions: str | None = None,
) -> torch.Tensor:
    """softmax(scale · q kᵀ + B) v (+ shaw's value term), in float32, cast back to the query's dtype.

    Args:
        query: (B, H, Lq, D); key, value: (B, Hkv, Lk, D), H a multiple of Hkv.
        term: the position term (its ``key``/``value`` replacements are used when set).
        scale: logit scale (applied to q . k, and to q . a^K for shaw; not to the other terms).
        causal: query i sees keys j <= q_offset + i only.
        q_offset: key index of the first query.
        key_valid: (B|1, Lk) bool, False on keys no query may see (padding), or None.
        window: None, or an int >= 1: causal, query i sees keys qi − window < j <= qi (its last ``window``
            keys, itself included); bidirectional, keys |qi − j| < window. Applied as a band mask (the oracle of
            the tile-wise engine and the kernels, which skip the tiles outside it).
        sink: None, or an int >= 1 with a ``window``: attention sinks, the keys j < sink visible besides the band
            (causal: to the queries at or after them; bidirectional: to every query).
        sink_positions: None or ``"text"`` (the sinks at their own positions), or ``"cache"`` (causal, a Toeplitz
            term): a sink the window no longer covers takes the term at distance window + sink − 1 − j
            (`hf_posenc.kernels._masks.CacheSinks`).

    Returns:
        (B, H, Lq, D) in the query's dtype; rows without any visible key are 0.

    Raises:
        TypeError, ValueError: ``window`` or ``sink`` is not None or an int >= 1, or a sink without a window;
            ``sink_positions`` that is not None, "text" or "cache", or "cache" without sinks, bidirectional or with a
            term that is not Toeplitz.
    """
    key, value, window = enter(query, key, value, term, q_offset, window, check_window)
    sink, cache = enter_sinks(term, window, sink, sink_positions, causal)
    b, h, q_len, _ = query.shape
    k_len = key.shape[2]
    groups = h // key.shape[1]
    q = _upcast(query)
    k = expand_kv(_upcast(key), groups)
    v = expand_kv(_upcast(value), groups)
    scores = q @ k.transpose(-1, -2)
    bias = term_bias(term, query, q_len, k_len, q_offset, cache_sinks=cache)
    if term.spec.value_term is not None:  # shaw: scale · q · (k + a^K), its key term scale-free above
        scores = (scores + bias) * scale
    else:
        scores = scores * scale
        if bias is not None:
            scores = scores + bias
    q_idx = torch.arange(q_len, device=q.device) + q_offset
    allowed = band_allowed(q_idx, torch.arange(k_len, device=q.device), causal, window, sink)[None, None]
    if key_valid is not None:
        allowed = allowed & key_valid[:, None, None, :].to(torch.bool)
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)
    out = probs @ v
    if term.spec.value_term is not None:  # shaw's value term
        q_idx = torch.arange(q_len, device=q.device) + q_offset
        out = out + term.spec.value_term(term.tensors, term.ints, probs, q_idx[:, None],
                                         torch.arange(k_len, device=q.device)[None, :])
    return out.to(query.dtype)
