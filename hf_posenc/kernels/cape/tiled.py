"""Tile-wise CAPE attention in plain PyTorch: O(L · block) memory, any device.

Per batch row, query block × key block it computes every head's scaled logits L for the tile, the base bias
tile B from its small tensors (`bias_tile`), the MLP f across the heads at each (i, j) (heads first, as
(hidden, 2H + 1) x (2H + 1, n * nk) matrix products on reused buffers, see ``_Workspace``), the scores
A = L + B + f(L, B), the mask (skipped on fully visible tiles), and an online softmax over the key blocks
(running max and sum per row and head). One batch row at a time keeps every product 2D on its reused buffers
(what the CPU needs). With ALiBi's fixed slopes as the base (any term whose registry entry states its −s[h] · |δ|
form, ``slope``), B = −slopes ⊗ |δ| is rank one: the MLP's first layer
takes [L; |δ|; 1] (H + 2 rows instead of 2H + 1; its bias columns folded into one, −(w1_B · slopes), by autograd
outside the Function) and the scores add −slopes ⊗ |δ| (CAPE's CPU training step 3.36x -> 3.11x SDPA, AMD EPYC,
2 threads, L = 2048). On a GPU, where this engine also runs (CAPE has no Triton kernel), a batch of B rows
then takes B times as many kernel launches: unmeasured so far (no GPU lent yet, issue 13). Key blocks
entirely above the causal diagonal are skipped when the offset is a Python int (a 0-d tensor offset, e.g. a
StaticCache, computes every tile and relies on the mask: no tensor is turned into a Python number; the mask's
"fully visible" test reads values on the CPU in eager mode only, see ``_tile_mask``).

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

from ...ops import eager_value_checks
from .._common import without_autocast
from .._subnormal import exp_flushed
from ..attention.term_spec import term_spec
from .bias_tile import base_bias_tile, base_unsupported
from ..custom_ops import EngineSpec, engine_op, offset_arg, register_engine

__all__ = ["cape_attention_tiled"]

#: default query and key block sizes: a CAPE layer's training step on the 2-core CPU (8 heads, L = 2048) measured
#: 350 ms with them, within noise of 256 x 256 (345 ms) and ahead of the other sizes tried (32-512 query rows,
#: 64-1024 keys: 357-434 ms).
BLOCK_Q = 128
BLOCK_K = 256
_SLOPE = 0.01  # LeakyReLU negative slope (PyTorch's default, the authors' code)


def _tile_mask(mask, qs, qe, ks, ke):
    """The tile (1, n, nk) of one batch row's mask (1, Lq, Lk) where some pair of it is masked, else None (a
    fully visible tile needs no fill). The test reads the mask's values, so it runs only where that is free
    (``eager_value_checks``: a CPU tensor, eager mode); elsewhere every tile is filled (no device sync per tile,
    no graph break)."""
    if mask is None:
        return None
    tile = mask[:, qs:qe, ks:ke]
    return tile if not eager_value_checks(tile) or not bool(tile.all()) else None


class _Workspace:
    """Reusable per-tile buffers of one batch row, heads first (N = n · nk pairs), contiguous at every tile size:

    * ``feat`` (2H + 1, N): the scaled logits, the base bias and a row of ones (the MLP's first layer with its
      bias is then one product ``w1x @ feat``, ``w1x = [w1 | b1]``, and so is its gradient); (H + 2, N) in
      ALiBi's rank-one form (``neg_slopes``: one bias row |δ|);
    * ``hid`` (hidden + 1, N): the MLP's activation (the LeakyReLU runs in place: its sign is the
      pre-activation's, which is all its backward needs) and a row of ones (for ``w2x = [w2 | b2]``);
    * scratch buffers by name (the scores, the backward's dP and the pre-activation's gradient).

    Reusing them matters on the CPU: a fresh tensor of a MiB or more per tile costs its page faults every time
    (profiled: the same products ran 3-4x slower into fresh outputs than into these buffers).
    """

    def __init__(self, h: int, hidden: int, pairs: int, dt: torch.dtype, device: torch.device,
                 neg_slopes: torch.Tensor | None = None) -> None:
        self.h, self.hidden, self.pairs, self.size = h, hidden, pairs, -1
        # ALiBi's rank-one form (see cape_attention_tiled): one bias row |δ|, the scores add −slopes ⊗ |δ|
        self.neg_slopes = neg_slopes
        self.bias_rows = h if neg_slopes is None else 1
        self._flat: dict[str, torch.Tensor] = {}
        self._like = torch.empty(0, dtype=dt, device=device)

    def scratch(self, name: str, rows: int) -> torch.Tensor:
        """The buffer ``name`` as a contiguous (rows, N) tensor for the current tile."""
        flat = self._flat.get(name)
        if flat is None:
            flat = self._flat[name] = self._like.new_empty(rows * self.pairs)
        return flat[: rows * self.size].view(rows, self.size)

    def tile(self, n: int, nk: int) -> torch.Tensor:
        """Start a tile of n queries and nk keys; returns the (H, n, nk) slot of its base bias in ``feat`` ((1, n, nk)
        for ALiBi's |δ| in the rank-one form)."""
        h, hidden, rows = self.h, self.hidden, self.bias_rows
        moved, self.size = n * nk != self.size, n * nk
        self.feat, self.hid = self.scratch("feat", h + rows + 1), self.scratch("hid", hidden + 1)
        if moved:  # the rows of ones move with the tile size
            self.feat[h + rows].fill_(1.0)
            self.hid[hidden].fill_(1.0)
        return self.feat[h : h + rows].view(rows, n, nk)

    def features(self, qb: torch.Tensor, kb: torch.Tensor, w1x: torch.Tensor, w2x: torch.Tensor) -> torch.Tensor:
        """Fill ``feat`` (its bias slot filled already) and ``hid``; returns the scores A (H, N).

        qb (Hkv, G·n, D) already scaled, kb (Hkv, nk, D)."""
        h, feat, hid = self.h, self.feat, self.hid
        torch.bmm(qb, kb.transpose(1, 2), out=feat[:h].view(qb.shape[0], qb.shape[1], kb.shape[1]))
        F.leaky_relu_(torch.mm(w1x, feat, out=hid[: self.hidden]), _SLOPE)
        scores = self.scratch("scores", h)
        if self.neg_slopes is None:
            torch.add(feat[:h], feat[h : 2 * h], out=scores)
        else:  # L + B with B = −slopes ⊗ |δ|
            torch.addr(feat[:h], self.neg_slopes, feat[h], out=scores)
        return scores.addmm_(w2x, hid)


def _add_outer(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, chunks: int = 8) -> None:
    """acc (M, K) += a (M, N) @ b (K, N)^T for a long N: as a batch of ``chunks`` products summed. Measured on the
    2-core CPU at N = 32768: (8, N) x (N, 33) takes a third of the time of one ``addmm_`` (which does not split
    N); (32, N) x (N, 17), bound by reading its operands, gains nothing and keeps ``addmm_``."""
    n = a.shape[1]
    if n % chunks:
        acc.addmm_(a, b.T)
        return
    m = n // chunks
    parts = torch.bmm(a.view(a.shape[0], chunks, m).transpose(0, 1), b.view(b.shape[0], chunks, m).permute(1, 2, 0))
    acc += parts.sum(0)


def _key_stop(k_len: int, static_offset: int | None, q_stop: int) -> int:
    """Keys the queries [.., q_stop) may see: all of them unless the causal offset is a Python int."""
    return k_len if static_offset is None else max(0, min(k_len, static_offset + q_stop))


def _row(t: torch.Tensor | None, r: int) -> torch.Tensor | None:
    """Batch row ``r`` of a (B|1, ...) tensor (row 0 of a broadcast one)."""
    return None if t is None else t[r if t.shape[0] > 1 else 0]


def _neg_slopes(kind: str, bias_tensors) -> torch.Tensor:
    """−s (H,) of a base term stated as −s[h] · |δ| (its registry entry's ``slope``): the rank-one form's factor."""
    spec = term_spec(kind)
    return -spec.slope(dict(zip((ts.name for ts in spec.tensors), bias_tensors)))


def _bias_into(slot, kind, bias_tensors, q_index, k_index, rows, r, rank_one: bool) -> None:
    """Write the tile's base bias into its slot of ``feat``: |δ| (1, n, nk) in the rank-one form (ALiBi), else the bias
    (H, n, nk) (`bias_tile.base_bias_tile`)."""
    if rank_one:
        torch.sub(q_index[:, None], k_index[None, :], out=slot[0]).abs_()
    else:
        base_bias_tile(kind, bias_tensors, q_index, k_index, rows, r, out=slot)


class _CapeTiled(torch.autograd.Function):
    @staticmethod
    @without_autocast
    def forward(ctx, q, k, v, mask, w1x, w2x, q_offset, scaling, kind, static_offset, block_q, block_k, rank_one,
                *bias_tensors):  # type: ignore[override]
        dt = w1x.dtype
        b, h, q_len, d = q.shape
        hkv, k_len = k.shape[1], k.shape[2]
        g = h // hkv
        ws = _Workspace(h, w1x.shape[0], min(block_q, q_len) * min(block_k, k_len), dt, q.device,
                        _neg_slopes(kind, bias_tensors) if rank_one else None)
        kc, vc = k.to(dt).contiguous(), v.to(dt).contiguous()  # a model's k, v are transposed views
        out = torch.zeros(b, h, q_len, v.shape[-1], dtype=dt, device=q.device)
        lse = torch.full((b, h, q_len), float("inf"), dtype=dt, device=q.device)
        k_all = torch.arange(k_len, device=q.device, dtype=dt)
        for r in range(b):
            for qs in range(0, q_len, block_q):
                qe = min(qs + block_q, q_len)
                n = qe - qs
                qb = (q[r, :, qs:qe].to(dt) * scaling).reshape(hkv, g * n, d)
                q_index = torch.arange(qs, qe, device=q.device, dtype=dt) + q_offset
                m = torch.full((h, n), float("-inf"), dtype=dt, device=q.device)
                l_sum = torch.zeros(h, n, dtype=dt, device=q.device)
                acc = torch.zeros(hkv, g * n, v.shape[-1], dtype=dt, device=q.device)
                stop = _key_stop(k_len, static_offset, qe)
                for ks in range(0, stop, block_k):
                    ke = min(ks + block_k, stop)
                    slot = ws.tile(n, ke - ks)
                    _bias_into(slot, kind, bias_tensors, q_index, k_all[ks:ke], slice(qs, qe), r, rank_one)
                    s = ws.features(qb, kc[r, :, ks:ke], w1x, w2x).view(h, n, ke - ks)
                    tile = _tile_mask(_row(mask, r), qs, qe, ks, ke)
                    if tile is not None:
                        s = s.masked_fill_(~tile, float("-inf"))
                    m_new = torch.maximum(m, s.amax(dim=-1))
                    m_safe = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
                    alpha = torch.exp(m - m_safe)  # 0 while the row had no key yet
                    p = exp_flushed(s.sub_(m_safe[..., None]))  # no subnormal weights (hf_posenc.kernels._subnormal)
                    l_sum = l_sum * alpha + p.sum(dim=-1)
                    acc = acc * alpha.view(hkv, g * n, 1) + torch.bmm(p.view(hkv, g * n, ke - ks), vc[r, :, ks:ke])
                    m = m_new
                l_h = l_sum.view(hkv, g * n, 1)
                out[r, :, qs:qe] = torch.where(l_h > 0, acc / l_h.clamp_min(torch.finfo(dt).tiny), 0.0).view(h, n, -1)
                m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
                lse[r, :, qs:qe] = torch.where(l_sum > 0, m_safe + torch.log(l_sum), float("inf"))  # +inf: empty row
        ctx.save_for_backward(q, k, v, mask, w1x, w2x, out, lse, *bias_tensors)
        ctx.q_offset = q_offset
        ctx.static = (scaling, kind, static_offset, block_q, block_k, rank_one)
        return out.to(v.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    @without_autocast
    def backward(ctx, grad_out):  # type: ignore[override]
        q, k, v, mask, w1x, w2x, out, lse, *bias_tensors = ctx.saved_tensors
        scaling, kind, static_offset, block_q, block_k, rank_one = ctx.static
        q_offset = ctx.q_offset
        dt = w1x.dtype
        b, h, q_len, d = q.shape
        hkv, k_len = k.shape[1], k.shape[2]
        g, hidden = h // hkv, w1x.shape[0]
        # the transposed weights as contiguous copies (tiny), for the products with the per-tile buffers
        w1a_t, w1b_t, w2_t = (t.T.contiguous() for t in (w1x[:, :h], w1x[:, h : 2 * h], w2x[:, :hidden]))
        ws = _Workspace(h, hidden, min(block_q, q_len) * min(block_k, k_len), dt, q.device,
                        _neg_slopes(kind, bias_tensors) if rank_one else None)
        kc, vc = k.to(dt).contiguous(), v.to(dt).contiguous()  # a model's k, v are transposed views
        grad_out = grad_out.to(dt).contiguous()
        delta = (grad_out * out).sum(dim=-1)  # (B, H, Lq)
        dq = torch.zeros(b, h, q_len, d, dtype=dt, device=q.device)
        dk = torch.zeros(b, hkv, k_len, d, dtype=dt, device=q.device)
        dv = torch.zeros(b, hkv, k_len, v.shape[-1], dtype=dt, device=q.device)
        dw1x, dw2x = torch.zeros_like(w1x), torch.zeros_like(w2x)
        first = 13  # index of the first bias tensor among forward's inputs
        bias_need = [ctx.needs_input_grad[first + i] for i in range(len(bias_tensors))]
        d_bias_tensors = [torch.zeros_like(t) if need else None for t, need in zip(bias_tensors, bias_need)]
        k_all = torch.arange(k_len, device=q.device, dtype=dt)
        for r in range(b):
            for qs in range(0, q_len, block_q):
                qe = min(qs + block_q, q_len)
                n = qe - qs
                qb = (q[r, :, qs:qe].to(dt) * scaling).reshape(hkv, g * n, d)
                dob = grad_out[r, :, qs:qe].reshape(hkv, g * n, -1)
                lse_b, delta_b = lse[r, :, qs:qe, None], delta[r, :, qs:qe, None]  # (H, n, 1)
                q_index = torch.arange(qs, qe, device=q.device, dtype=dt) + q_offset
                dqb = torch.zeros_like(qb)
                stop = _key_stop(k_len, static_offset, qe)
                for ks in range(0, stop, block_k):
                    ke = min(ks + block_k, stop)
                    nk = ke - ks
                    kb, vb = kc[r, :, ks:ke], vc[r, :, ks:ke]
                    slot = ws.tile(n, nk)
                    if any(bias_need):
                        leaves = [t.detach().requires_grad_(need) for t, need in zip(bias_tensors, bias_need)]
                        with torch.enable_grad():
                            bias_graph = base_bias_tile(kind, tuple(leaves), q_index, k_all[ks:ke], slice(qs, qe), r)
                        slot.copy_(bias_graph.detach()[0])
                    else:
                        _bias_into(slot, kind, bias_tensors, q_index, k_all[ks:ke], slice(qs, qe), r, rank_one)
                    s = ws.features(qb, kb, w1x, w2x).view(h, n, nk)
                    feat, hid = ws.feat, ws.hid
                    tile = _tile_mask(_row(mask, r), qs, qe, ks, ke)
                    if tile is not None:
                        s = s.masked_fill_(~tile, float("-inf"))
                    p = exp_flushed(s.sub_(lse_b))  # (H, n, nk); 0 on masked keys and empty rows
                    p3 = p.view(hkv, g * n, nk)
                    dv[r, :, ks:ke] += torch.bmm(p3.transpose(1, 2), dob)
                    dp = torch.bmm(dob, vb.transpose(1, 2), out=ws.scratch("dp", h).view(hkv, g * n, nk)).view(h, n, nk)
                    ds = p.mul_(dp.sub_(delta_b)).view(h, n * nk)  # dL/dA (H, N)
                    # A = L + B + w2 leaky(w1a L + w1b B + b1) + b2, heads first; feat = [L; B; 1], hid = [act; 1]
                    _add_outer(dw2x, ds, hid)
                    dpre = torch.mm(w2_t, ds, out=ws.scratch("dpre", hidden))
                    torch.ops.aten.leaky_relu_backward.grad_input(dpre, hid[:hidden], _SLOPE, True, grad_input=dpre)
                    dw1x.addmm_(dpre, feat.T)
                    if any(bias_need):
                        dbias = torch.addmm(ds, w1b_t, dpre).view(bias_graph.shape)
                        wanted = [t for t, need in zip(leaves, bias_need) if need]
                        grads = torch.autograd.grad(bias_graph, wanted, dbias)
                        it = iter(grads)
                        for i, need in enumerate(bias_need):
                            if need:
                                d_bias_tensors[i] += next(it)
                    dl = ds.addmm_(w1a_t, dpre).view(hkv, g * n, nk)  # dL/dlogits (ds is spent)
                    dqb += torch.bmm(dl, kb)
                    dk[r, :, ks:ke] += torch.bmm(dl.transpose(1, 2), qb)
                dq[r, :, qs:qe] = dqb.view(h, n, d) * scaling
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, dw1x, dw2x,
                None, None, None, None, None, None, None, *d_bias_tensors)


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
        kind, bias_tensors: the base bias: a registered term's kind and its tensors (see `bias_tile`).
        mask: (B|1, 1, Lq, Lk) bool (True = attend), or None (every query sees every key).
        scaling: logit scale.
        q_offset: key index of the first query (an int, or a 0-d tensor: then no tile is skipped).
        causal: whether keys after ``q_offset + i`` are masked for query i (then key tiles past the diagonal
            are skipped when ``q_offset`` is an int; the mask must hold the causality).
        block_q, block_k: tile sizes (larger tiles: fewer, larger operations; memory O(block_q · block_k · hidden)).
    """
    reason = base_unsupported(kind)  # ValueError for an unknown kind too
    if reason is not None:
        raise ValueError(reason)
    names = [ts.name for ts in term_spec(kind).tensors]
    if len(bias_tensors) != len(names):
        raise ValueError(f"CAPE's {kind} base takes the tensors {names} (in that order), got {len(bias_tensors)}")
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
    bias_tensors = tuple(t.to(dt) if t.is_floating_point() else t for t in bias_tensors)
    static_offset = q_offset if (causal and isinstance(q_offset, int)) else None
    if isinstance(q_offset, torch.Tensor):
        q_offset = q_offset.to(device=query.device, dtype=dt)
    if mask is not None and mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor (True = attend), got {mask.dtype}")
    # ALiBi's bias −slopes ⊗ |δ| is rank one: the first layer's bias columns act as one column, −(w1_B · slopes), on
    # |δ| (autograd carries its gradient back to w1 outside the Function), so each tile's first layer and its weight
    # gradient take H + 2 rows of features instead of 2H + 1, and the scores add −slopes ⊗ |δ| (fixed slopes only:
    # learned ones keep the full tile, whose gradient reaches them).
    spec = term_spec(kind)
    rank_one = spec.slope is not None and not any(t.requires_grad for t in bias_tensors)
    if rank_one:
        slopes = spec.slope(dict(zip((ts.name for ts in spec.tensors), bias_tensors)))
        w1x = torch.cat([w1[:, :h], -(w1[:, h:] @ slopes)[:, None], b1[:, None]], dim=1)  # (hidden, H + 2)
    else:
        w1x = torch.cat([w1, b1[:, None]], dim=1)  # (hidden, 2H + 1): the first layer on [L; B; 1]
    w2x = torch.cat([w2, b2[:, None]], dim=1)  # (H, hidden + 1): the second on [act; 1]
    if torch.compiler.is_compiling():  # one custom op in the compiled graph (hf_posenc.kernels.custom_ops)

        offset = q_offset if isinstance(q_offset, torch.Tensor) else None
        return engine_op("cape", [query, key, value, mask, w1x, w2x, offset, *bias_tensors],
                         {"scaling": float(scaling), "kind": kind, "static_offset": static_offset, "block_q": block_q,
                          "block_k": block_k, "rank_one": bool(rank_one)}, q_offset)
    return _CapeTiled.apply(
        query, key, value, mask, w1x, w2x, q_offset, scaling, kind, static_offset, block_q, block_k, rank_one,
        *bias_tensors
    )


register_engine("cape", EngineSpec(  # tensors [q, k, v, mask?, w1x, w2x, q_offset?, *bias_tensors]
    _CapeTiled,
    lambda t, s, o: (t[0], t[1], t[2], t[3], t[4], t[5], offset_arg(t[6], o), s["scaling"], s["kind"],
                     s["static_offset"], s["block_q"], s["block_k"], s["rank_one"], *t[7:]),
    lambda t: [0, 1, 2, 3, 4, 5, 6] + list(range(13, 13 + len(t) - 7)),
    lambda t, s: ((*t[0].shape[:3], t[2].shape[3]), t[2].dtype),
))
