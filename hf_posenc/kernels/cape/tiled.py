"""Tile-wise CAPE attention in plain PyTorch: O(L · block) memory, any device.

Per query block × key block it computes every head's scaled logits L for the tile, the base bias tile B
from its small tensors (:mod:`.bias_tile`), the MLP f across the heads at each (i, j) (heads first, as
(hidden, H) x (H, n * nk) matrix products), the scores A = L + B + f(L, B), the mask, and an online softmax over the
key blocks (running max and sum per row and head). Key blocks entirely above the causal diagonal are
skipped when the offset is a Python int (a 0-d tensor offset, e.g. a StaticCache, computes every tile
and relies on the mask: no tensor is turned into a Python number).

Backward (a custom autograd Function) recomputes each tile from q, k, v, the saved log-sum-exp and
D_i = sum_d dO_id O_id: dS = P ∘ (dO V^T − D), then through A = L + B + f(L, B) by hand (the MLP's
weight gradients are reduced per tile) and, for base biases with parameters, with a local autograd pass
over the small bias tile whose parameter gradients are summed tile by tile. No (B, H, Lq, Lk) tensor is
built in either pass. Softmax and the MLP run in float32 (float64 stays float64); the output has the
dtype of ``value``.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from .._subnormal import exp_flushed
from .bias_tile import BASE_KINDS, base_bias_tile

__all__ = ["cape_attention_tiled"]

#: default query and key block sizes.
BLOCK_Q = 128
BLOCK_K = 128
_SLOPE = 0.01  # LeakyReLU negative slope (PyTorch's default, the authors' code)


def _lin(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """w (O, C) applied over the channels of x (B, C, N) -> (B, O, N), one 2D product per batch row."""
    if x.shape[0] == 1:
        return torch.mm(w, x[0])[None]
    return torch.matmul(w, x)


def _outer(a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """sum over the batch and N of a (B, O, N) times x (B, C, N) -> (O, C)."""
    if a.shape[0] == 1 and x.shape[0] == 1:
        return torch.mm(a[0], x[0].T)
    return torch.matmul(a, x.transpose(-1, -2)).sum(dim=0)


def _tile_features(qb, kb, bias, w1a, w1b, b1, w2, b2):
    """Logits (B, H, N), the bias (B|1, H, N), the MLP's pre-activation and activation (B, hidden, N) and the
    scores (B, H, N), N = n * nk, heads
    first (the MLP runs as (hidden, H) x (H, N) products: no permutes).

    qb (B, Hkv, G, n, D) already scaled, kb (B, Hkv, 1, nk, D), bias (B|1, H, n, nk)."""
    b, hkv, g, n, _ = qb.shape
    nk = kb.shape[3]
    logits = torch.matmul(qb, kb.transpose(-1, -2)).view(b, hkv * g, n * nk)
    bias = bias.reshape(bias.shape[0], hkv * g, n * nk)
    if b == 1 and bias.shape[0] == 1:  # 2D products with the additions fused (addmm)
        pre = torch.addmm(torch.addmm(b1[:, None], w1b, bias[0]), w1a, logits[0])[None]
        hidden = F.leaky_relu(pre, _SLOPE)
        base = (logits[0] + bias[0]).add_(b2[:, None])
        return logits, bias, pre, hidden, torch.addmm(base, w2, hidden[0])[None]
    pre = _lin(w1b, bias).add_(b1[:, None]).add(_lin(w1a, logits))
    hidden = F.leaky_relu(pre, _SLOPE)
    scores = _lin(w2, hidden).add_(b2[:, None]).add_(logits).add_(bias)
    return logits, bias, pre, hidden, scores


def _key_stop(k_len: int, static_offset: int | None, q_stop: int) -> int:
    """Keys the queries [.., q_stop) may see: all of them unless the causal offset is a Python int."""
    return k_len if static_offset is None else max(0, min(k_len, static_offset + q_stop))


class _CapeTiled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, w1, b1, w2, b2, q_offset, scaling, kind, static_offset, block_q, block_k,
                *bias_tensors):  # type: ignore[override]
        dt = w1.dtype
        b, h, q_len, d = q.shape
        hkv, k_len = k.shape[1], k.shape[2]
        g = h // hkv
        w1a, w1b = w1[:, :h], w1[:, h:]
        out = torch.zeros(b, h, q_len, v.shape[-1], dtype=dt, device=q.device)
        lse = torch.full((b, h, q_len), float("inf"), dtype=dt, device=q.device)
        k_all = torch.arange(k_len, device=q.device, dtype=dt)
        for qs in range(0, q_len, block_q):
            qe = min(qs + block_q, q_len)
            n = qe - qs
            qb = (q[:, :, qs:qe].to(dt) * scaling).view(b, hkv, g, n, d)
            q_index = torch.arange(qs, qe, device=q.device, dtype=dt) + q_offset
            m = torch.full((b, h, n), float("-inf"), dtype=dt, device=q.device)
            l_sum = torch.zeros(b, h, n, dtype=dt, device=q.device)
            acc = torch.zeros(b, hkv, g, n, v.shape[-1], dtype=dt, device=q.device)
            stop = _key_stop(k_len, static_offset, qe)
            for ks in range(0, stop, block_k):
                ke = min(ks + block_k, stop)
                kb = k[:, :, None, ks:ke].to(dt)
                bias = base_bias_tile(kind, bias_tensors, q_index, k_all[ks:ke], slice(qs, qe))
                s = _tile_features(qb, kb, bias, w1a, w1b, b1, w2, b2)[4].view(b, h, n, ke - ks)
                if mask is not None:
                    s = s.masked_fill_(~mask[:, :, qs:qe, ks:ke], float("-inf"))
                m_new = torch.maximum(m, s.amax(dim=-1))
                m_safe = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
                alpha = torch.exp(m - m_safe)  # 0 while the row had no key yet
                p = exp_flushed(s.sub_(m_safe[..., None]))  # no subnormal weights (hf_posenc.kernels._subnormal)
                l_sum = l_sum * alpha + p.sum(dim=-1)
                acc = acc * alpha.view(b, hkv, g, n, 1) + torch.matmul(
                    p.view(b, hkv, g, n, ke - ks), v[:, :, None, ks:ke].to(dt)
                )
                m = m_new
            l_h = l_sum.view(b, hkv, g, n, 1)
            out[:, :, qs:qe] = torch.where(l_h > 0, acc / l_h.clamp_min(torch.finfo(dt).tiny), 0.0).view(b, h, n, -1)
            m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
            lse[:, :, qs:qe] = torch.where(l_sum > 0, m_safe + torch.log(l_sum), float("inf"))  # +inf: empty row
        ctx.save_for_backward(q, k, v, mask, w1, b1, w2, b2, out, lse, *bias_tensors)
        ctx.q_offset = q_offset
        ctx.static = (scaling, kind, static_offset, block_q, block_k)
        return out.to(v.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):  # type: ignore[override]
        q, k, v, mask, w1, b1, w2, b2, out, lse, *bias_tensors = ctx.saved_tensors
        scaling, kind, static_offset, block_q, block_k = ctx.static
        q_offset = ctx.q_offset
        dt = w1.dtype
        b, h, q_len, d = q.shape
        hkv, k_len = k.shape[1], k.shape[2]
        g = h // hkv
        w1a, w1b = w1[:, :h], w1[:, h:]
        grad_out = grad_out.to(dt)
        delta = (grad_out * out).sum(dim=-1)  # (B, H, Lq)
        dq = torch.zeros(b, h, q_len, d, dtype=dt, device=q.device)
        dk = torch.zeros(b, hkv, k_len, d, dtype=dt, device=q.device)
        dv = torch.zeros(b, hkv, k_len, v.shape[-1], dtype=dt, device=q.device)
        dw1, db1, dw2, db2 = (torch.zeros_like(t) for t in (w1, b1, w2, b2))
        bias_need = [ctx.needs_input_grad[14 + i] for i in range(len(bias_tensors))]
        d_bias_tensors = [torch.zeros_like(t) if need else None for t, need in zip(bias_tensors, bias_need)]
        k_all = torch.arange(k_len, device=q.device, dtype=dt)
        for qs in range(0, q_len, block_q):
            qe = min(qs + block_q, q_len)
            n = qe - qs
            qb = (q[:, :, qs:qe].to(dt) * scaling).view(b, hkv, g, n, d)
            dob = grad_out[:, :, qs:qe].reshape(b, hkv, g, n, -1)
            lse_b, delta_b = lse[:, :, qs:qe, None], delta[:, :, qs:qe, None]  # (B, H, n, 1)
            q_index = torch.arange(qs, qe, device=q.device, dtype=dt) + q_offset
            dqb = torch.zeros_like(qb)
            stop = _key_stop(k_len, static_offset, qe)
            for ks in range(0, stop, block_k):
                ke = min(ks + block_k, stop)
                nk = ke - ks
                kb, vb = k[:, :, None, ks:ke].to(dt), v[:, :, None, ks:ke].to(dt)
                if any(bias_need):
                    leaves = [t.detach().requires_grad_(need) for t, need in zip(bias_tensors, bias_need)]
                    with torch.enable_grad():
                        bias_graph = base_bias_tile(kind, tuple(leaves), q_index, k_all[ks:ke], slice(qs, qe))
                    bias = bias_graph.detach()
                else:
                    bias = base_bias_tile(kind, bias_tensors, q_index, k_all[ks:ke], slice(qs, qe))
                logits, bias_flat, pre, hidden, s = _tile_features(qb, kb, bias, w1a, w1b, b1, w2, b2)
                s = s.view(b, h, n, nk)
                if mask is not None:
                    s = s.masked_fill_(~mask[:, :, qs:qe, ks:ke], float("-inf"))
                p = exp_flushed(s.sub_(lse_b))  # (B, H, n, nk); 0 on masked keys and empty rows
                dv[:, :, ks:ke] += torch.matmul(p.view(b, hkv, g, n, nk).transpose(-1, -2), dob).sum(dim=2)
                dp = torch.matmul(dob, vb.transpose(-1, -2)).view(b, h, n, nk)
                ds = p.mul_(dp.sub_(delta_b)).view(b, h, n * nk)  # dL/dA (B, H, N)
                # A = L + B + w2 leaky(w1a L + w1b B + b1) + b2, heads first
                dw2 += _outer(ds, hidden)
                db2 += ds.sum(dim=(0, 2))
                dpre = torch.ops.aten.leaky_relu_backward(_lin(w2.T, ds), pre, _SLOPE, False)  # (B, hid, N)
                dw1[:, :h] += _outer(dpre, logits)
                dpre_b = dpre if bias_flat.shape[0] == b else dpre.sum(dim=0, keepdim=True)
                dw1[:, h:] += _outer(dpre_b, bias_flat)
                db1 += dpre.sum(dim=(0, 2))
                if any(bias_need):
                    dbias = _lin(w1b.T, dpre).add_(ds)
                    if bias_flat.shape[0] != b:
                        dbias = dbias.sum(dim=0, keepdim=True)
                    grads = torch.autograd.grad(
                        bias_graph, [t for t, need in zip(leaves, bias_need) if need], dbias.view(bias.shape)
                    )
                    it = iter(grads)
                    for i, need in enumerate(bias_need):
                        if need:
                            d_bias_tensors[i] += next(it)
                dl_h = _lin(w1a.T, dpre).add_(ds).view(b, hkv, g, n, nk)  # dL/dlogits
                dqb += torch.matmul(dl_h, kb)
                dk[:, :, ks:ke] += torch.matmul(dl_h.transpose(-1, -2), qb).sum(dim=2)
            dq[:, :, qs:qe] = dqb.view(b, h, n, d) * scaling
        return (
            dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, dw1, db1, dw2, db2,
            None, None, None, None, None, None, *d_bias_tensors,
        )


def cape_attention_tiled(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor,
    w2: torch.Tensor,
    b2: torch.Tensor,
    kind: str,
    bias_tensors: tuple[torch.Tensor, ...],
    mask: torch.Tensor | None,
    scaling: float,
    q_offset: int | torch.Tensor = 0,
    causal: bool = True,
    block_q: int = BLOCK_Q,
    block_k: int = BLOCK_K,
) -> torch.Tensor:
    """CAPE attention out (B, H, Lq, D) in the dtype of ``value``, tile by tile.

    Args:
        query: (B, H, Lq, D); key, value: (B, Hkv, Lk, D) with H a multiple of Hkv (grouped-query heads
            are not expanded).
        w1: (hidden, 2H), b1: (hidden,), w2: (H, hidden), b2: (H,): the MLP f (any float dtype; computed in
            float32, float64 stays float64; gradients reach them through the cast).
        kind, bias_tensors: the base bias (see :mod:`.bias_tile`).
        mask: (B|1, 1, Lq, Lk) bool (True = attend), or None (every query sees every key).
        scaling: logit scale.
        q_offset: key index of the first query (an int, or a 0-d tensor: then no tile is skipped).
        causal: whether keys after ``q_offset + i`` are masked for query i (then key tiles past the diagonal
            are skipped when ``q_offset`` is an int; the mask must hold the causality).
        block_q, block_k: tile sizes (larger tiles: fewer, larger operations; memory O(block_q · block_k · hidden)).
    """
    if kind not in BASE_KINDS:
        raise ValueError(f"unknown CAPE base bias kind {kind!r}; allowed: {', '.join(BASE_KINDS)}")
    if query.dim() != 4 or key.dim() != 4 or value.shape[:3] != key.shape[:3]:
        raise ValueError(
            f"expected query (B, H, Lq, D) and key/value (B, Hkv, Lk, D), got {tuple(query.shape)}, "
            f"{tuple(key.shape)}, {tuple(value.shape)}"
        )
    h = query.shape[1]
    if h % key.shape[1]:
        raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({key.shape[1]})")
    if w1.shape[-1] != 2 * h or w2.shape[0] != h:
        raise ValueError(
            f"the MLP must map 2H = {2 * h} values to H = {h}, got w1 {tuple(w1.shape)}, w2 {tuple(w2.shape)}"
        )
    if block_q < 1 or block_k < 1:
        raise ValueError(f"block sizes must be >= 1, got {block_q}, {block_k}")
    dt = torch.float64 if query.dtype == torch.float64 else torch.float32
    w1, b1, w2, b2 = (t.to(dt) for t in (w1, b1, w2, b2))
    bias_tensors = tuple(t.to(dt) for t in bias_tensors)
    static_offset = q_offset if (causal and isinstance(q_offset, int)) else None
    if isinstance(q_offset, torch.Tensor):
        q_offset = q_offset.to(device=query.device, dtype=dt)
    if mask is not None and mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor (True = attend), got {mask.dtype}")
    return _CapeTiled.apply(
        query, key, value, mask, w1, b1, w2, b2, q_offset, scaling, kind, static_offset, block_q, block_k,
        *bias_tensors,
    )
