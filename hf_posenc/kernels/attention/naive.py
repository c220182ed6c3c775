"""Reference of the fused attention kernel family: every position term in plain PyTorch (float32, O(L²)).

Same interface as the kernel (``fused_attention`` in ``triton_attention.py``): q (B, H, Lq, D), k and v
(B, Hkv, Lk, D) with H a multiple of Hkv (query head h reads key/value head h // (H / Hkv)), a
:class:`~hf_posenc.kernels.attention.terms.KernelTerm`, the logit scale, causal or bidirectional, the key
index of the first query (``q_offset``: query i is key q_offset + i) and an optional per-batch key-valid
vector, and an optional sliding ``window`` (a band mask: causal, key j visible iff qi − window < j <= qi;
bidirectional, iff |qi − j| < window). Gradients come from autograd, for q, k, v and every term tensor that
requires them.
"""

from __future__ import annotations

import torch

from ...ops import expand_kv
from .._masks import band_allowed, check_window
from .terms import KernelTerm

__all__ = ["attention_reference", "fire_interpolate", "term_bias"]


def _upcast(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def fire_interpolate(table: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Linear interpolation of ``table`` (H, N) at fractional cells ``u`` (...) (clamped to [0, N − 1])
    -> (H, ...): table[⌊u⌋] (1 − w) + table[⌊u⌋ + 1] w, w = u − ⌊u⌋, ⌊u⌋ <= N − 2."""
    n = table.shape[1]
    u = u.clamp(0.0, n - 1.0)
    k0 = u.detach().floor().clamp(max=n - 2)
    w = u - k0
    idx = k0.long()
    t0 = table[:, idx.reshape(-1)].reshape(table.shape[0], *u.shape)
    t1 = table[:, (idx + 1).reshape(-1)].reshape(table.shape[0], *u.shape)
    return t0 + w * (t1 - t0)


def term_bias(
    term: KernelTerm, query: torch.Tensor | None, q_len: int, k_len: int, q_offset: int = 0
) -> torch.Tensor | None:
    """The additive logit term (B|1, H, Lq, Lk) float32 of ``term`` (None for ``none``).

    ``query`` (B, H, Lq, D) is needed by ``shaw`` only (its key term is scale-free here: the caller scales
    q . a^K with the logits; see :func:`attention_reference`)."""
    kind, t = term.kind, term.tensors
    if kind == "none":
        return None
    device = next(iter(t.values())).device if t else query.device
    q_idx = torch.arange(q_len, device=device) + q_offset
    k_idx = torch.arange(k_len, device=device)
    delta = q_idx[:, None] - k_idx[None, :]  # (Lq, Lk) int64: key index of the query minus the key's
    dist = delta.abs().float()
    if kind == "alibi":
        return -(_upcast(t["slopes"])[:, None, None] * dist)[None]
    if kind == "kerple_log":
        r1, r2 = _upcast(t["r1"])[:, None, None], _upcast(t["r2"])[:, None, None]
        return (-r1 * torch.log1p(r2 * dist))[None]
    if kind == "kerple_pow":
        r1, r2 = _upcast(t["r1"])[:, None, None], _upcast(t["r2"])[:, None, None]
        safe = torch.where(dist > 0, dist, torch.ones_like(dist))
        return torch.where(dist > 0, -r1 * safe.pow(r2), torch.zeros_like(r1 * dist))[None]
    if kind == "sandwich":
        table = _upcast(t["table"])
        idx = delta.abs().clamp(max=table.shape[1] - 1)
        return table[:, idx][None]
    if kind == "t5":
        table, buckets = _upcast(t["table"]), t["buckets"].long()
        m = (buckets.shape[0] - 1) // 2
        rel = (-delta).clamp(-m, m) + m
        return table[buckets[rel]].permute(2, 0, 1)[None]
    if kind == "fire":
        table, c, inv_norm = _upcast(t["table"]), _upcast(t["c"]), _upcast(t["inv_norm"])
        n = table.shape[1]
        psi = torch.log1p(c * delta.clamp(min=0).float())  # (Lq, Lk)
        u = psi[None] * inv_norm[:, :, None] * ((n - 1) / _upcast(t["x_max"]).detach())  # (B|1, Lq, Lk)
        return fire_interpolate(table, u).movedim(0, 1)
    if kind == "shaw":
        k = term.ints["max_relative_position"]
        idx = (-delta).clamp(-k, k) + k  # (Lq, Lk)
        qa = _upcast(query) @ _upcast(t["key_table"]).T  # (B, H, Lq, 2K + 1)
        return qa.gather(-1, idx.expand(*qa.shape[:2], q_len, k_len))
    if kind == "fox":
        c = _upcast(t["c"])
        return c[:, :, q_idx, None] - c[:, :, None, :]
    raise ValueError(f"unknown kernel term {kind!r}")


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

    Returns:
        (B, H, Lq, D) in the query's dtype; rows without any visible key are 0.

    Raises:
        TypeError, ValueError: ``window`` is not None or an int >= 1.
    """
    window = check_window(window)
    key = term.key if term.key is not None else key
    value = term.value if term.value is not None else value
    term.check(query, key, q_offset)
    b, h, q_len, _ = query.shape
    k_len = key.shape[2]
    groups = h // key.shape[1]
    q = _upcast(query)
    k = expand_kv(_upcast(key), groups)
    v = expand_kv(_upcast(value), groups)
    scores = q @ k.transpose(-1, -2)
    bias = term_bias(term, query, q_len, k_len, q_offset)
    if term.kind == "shaw":
        scores = (scores + bias) * scale
    else:
        scores = scores * scale
        if bias is not None:
            scores = scores + bias
    q_idx = torch.arange(q_len, device=q.device) + q_offset
    allowed = band_allowed(q_idx, torch.arange(k_len, device=q.device), causal, window)[None, None]
    if key_valid is not None:
        allowed = allowed & key_valid[:, None, None, :].to(torch.bool)
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)
    out = probs @ v
    if term.kind == "shaw":
        kmax = term.ints["max_relative_position"]
        q_idx = torch.arange(q_len, device=q.device) + q_offset
        rel = (torch.arange(k_len, device=q.device)[None, :] - q_idx[:, None]).clamp(-kmax, kmax) + kmax
        buckets = probs.new_zeros(b, h, q_len, 2 * kmax + 1).scatter_add(-1, rel.expand(b, h, q_len, k_len), probs)
        out = out + buckets @ _upcast(term.tensors["value_table"])
    return out.to(query.dtype)
