"""The tile engine's autograd Function (see ``tiled.py``): the forward and backward of one call, each through the
fused-CPU path (``_tiled_fused``) where it applies, else through the online-softmax passes over key tiles below."""

from __future__ import annotations

import torch

from .._common import without_autocast
from .._subnormal import exp_flushed
from ._tiled_fused import (
    _channel_fused_backward,
    _flash_available,
    _may_underflow,
    _splits_at_diagonal,
    fused_backward_plain,
    fused_forward,
    uses_key_channel,
)
from ._tiles import (
    _antidiagonal_sums,
    _apply_mask,
    _group,
    _logits,
    _Plan,
    _prepare,
    _query_index,
    _rows,
    _skew_buffer,
    _Tile,
    _ungroup,
    distance_values,
)


class TiledAttentionFunction(torch.autograd.Function):
    """Forward: the fused kernel per query block, or an online softmax over key tiles per query block. Backward:
    tiles recomputed from the saved log-sum-exp; gradients of q, k, v and every term tensor (see ``tiled.py``)."""

    @staticmethod
    @without_autocast
    def forward(ctx, query, key, value, valid, q_off_tensor, plan: _Plan, *tensors):
        dtype, b, h, hkv, q_len, k_len, d, q, k, v = _prepare(query, key, value, plan, tensors)
        q_off = plan.q_offset if plan.q_offset is not None else q_off_tensor
        tile = _Tile(plan, tensors, q_off, q_len, k_len, dtype, query.device)
        out = q.new_empty(b, h, q_len, d)
        lse = q.new_empty(b, h, q_len)
        if _flash_available(plan, query.device, dtype):
            fused_forward(plan, tile, q, k, v, valid, q_off, b, h, d, out, lse)
        else:
            _online_forward(plan, tile, q, k, v, valid, q_off, b, h, hkv, d, out, lse)
        ctx.plan = plan
        ctx.save_for_backward(query, key, value, valid, q_off_tensor, out, lse, *tensors)
        return out.to(query.dtype)

    @staticmethod
    @without_autocast
    def backward(ctx, grad_out):
        query, key, value, valid, q_off_tensor, out, lse, *tensors = ctx.saved_tensors
        plan: _Plan = ctx.plan
        dtype, b, h, hkv, q_len, k_len, d, q, k, v = _prepare(query, key, value, plan, tensors)
        q_off = plan.q_offset if plan.q_offset is not None else q_off_tensor
        tile = _Tile(plan, tensors, q_off, q_len, k_len, dtype, query.device)
        do = grad_out.to(dtype)
        delta = (do * out).sum(-1, keepdim=True)  # (B, H, Lq, 1)
        need = ctx.needs_input_grad[6:]
        want_term = any(need)
        g_dist = q.new_zeros(tile.rev.shape) if plan.form == "toeplitz" and want_term else None
        # the far sinks' dS at their cache distances (H, k), where the sinks sit at their cache positions
        g_sink = q.new_zeros(tile.sink_values.shape) if g_dist is not None and tile.sink_values is not None else None
        dc = torch.zeros_like(tile.c) if plan.form == "gate" and want_term else None
        pair = tile.pair
        if pair is not None:
            pair.start_backward(dict(zip(plan.names, need)))
        if pair is not None and pair.fused_backward is not None and _flash_available(plan, query.device, dtype):
            # the pair term's own fused path (shaw: the forward's frame, _ShawBand)
            dq, dk, dv, by_name = pair.fused_backward(plan, tile, q, k, v, out, lse, do, valid, q_off, b, h, hkv, d)
            grads = _term_grads(plan, tensors, need, tile, None, None, by_name)
            return (dq.mul_(plan.scale).to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), None, None, None,
                    *grads)
        if _flash_available(plan, query.device, dtype) and uses_key_channel(plan, valid):
            # the forward's frame: the key channel (see Tile.key_channel)
            dq, dk, dv, dc = _channel_fused_backward(plan, tile, q, k, v, out, lse, do, valid, q_off, b, h, hkv, d,
                                                     want_term)
            grads = _term_grads(plan, tensors, need, tile, None, dc if want_term else None, {})
            return (dq.mul_(plan.scale).to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), None, None, None,
                    *grads)
        # No term gradient: the fused kernel's backward per query block where the blocks split at their diagonal
        # (the forward's parts, no mask to fill: sandwich's CPU training step 1.28x -> 1.01-1.12x SDPA, ALiBi's
        # 1.46x -> 1.10x, measured on an AMD EPYC, whose fused kernel showed no slowdown on subnormal probabilities:
        # a steep ALiBi head's backward took the time of a mild one's; see _block_parts), or where some probability
        # could be subnormal (a steep decay: ALiBi bidirectional or after a StaticCache), there with
        # ``_subnormal_free`` (ALiBi: 2.8x against 5.6x the SDPA attention step, measured on an Intel Xeon).
        # Otherwise (a mild term with padding or a window) the online passes below beat the fused backward with
        # its per-tile float mask (sandwich's step: 1.32x against 1.71x, measured), and they flush subnormal
        # probabilities themselves (``exp_flushed``).
        underflow = plan.form != "none" and _may_underflow(tile, q, k)
        if not want_term and _flash_available(plan, query.device, dtype) and (
                plan.form == "none" or underflow or _splits_at_diagonal(plan, valid)):
            dq, dk, dv = fused_backward_plain(plan, tile, q, k, v, out, lse, do, valid, q_off, b, h, hkv, d, underflow)
        else:
            dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
            _online_backward(plan, tile, q, k, v, lse, do, delta, valid, q_off, b, h, hkv, d, dq, dk, dv, g_dist, dc,
                             g_sink)
        dq = dq * plan.scale
        grads = _term_grads(plan, tensors, need, tile, g_dist, dc, pair.grads() if pair is not None else {}, g_sink)
        return (dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), None, None, None, *grads)


def _online_forward(plan: _Plan, tile: _Tile, q, k, v, valid, q_off, b, h, hkv, d, out, lse) -> None:
    """Fill ``out`` and ``lse`` by an online softmax (running max and sum) over key tiles of ``block_k`` per query
    block (rows reversed for a Toeplitz term: its tiles are strided views)."""
    q_len, k_len = q.shape[2], k.shape[2]
    rev = plan.form == "toeplitz"
    for q0 in range(0, q_len, plan.block_q):
        q1 = min(q0 + plan.block_q, q_len)
        n = q1 - q0
        qi = _rows(_query_index(q_off, q0, q1, q.device), rev, 0)
        qb = _rows(q[:, :, q0:q1], rev)
        qg = _group(qb, hkv)
        ctx = tile.pair.block(qb) if tile.pair is not None else None  # shaw: scale · q · a^K (B, H, n, 2K + 1)
        row_max = q.new_full((b, h, n, 1), float("-inf"))
        row_sum = q.new_zeros(b, h, n, 1)
        acc = q.new_zeros(b, h, n, d)
        for t, (k0, k1) in enumerate(_key_tiles(plan, q0, q1, k_len)):
            s = _ungroup(qg @ k[:, :, k0:k1].transpose(-1, -2), h)  # (B, H, n, m)
            bias = tile.bias(qi, q0, q1, k0, k1, ctx)
            if bias is not None:
                s = s + bias if s.shape != torch.broadcast_shapes(s.shape, bias.shape) else s.add_(bias)
            s = _apply_mask(s, plan, qi, q0, k0, k1, valid)
            new_max = torch.maximum(row_max, s.amax(-1, keepdim=True))
            safe = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
            p = exp_flushed(s.sub_(safe))  # no subnormal weights, no exp of -inf (kernels._subnormal)
            if t > 0:
                alpha = torch.exp(row_max - safe)
                row_sum.mul_(alpha)
                acc.mul_(alpha)
            row_sum.add_(p.sum(-1, keepdim=True))
            acc.add_(_ungroup(_group(p, hkv) @ v[:, :, k0:k1] if h != hkv else p @ v[:, :, k0:k1], h))
            if tile.pair is not None:
                tile.pair.add_values(acc, p, qi, k0, k1)
            row_max = new_max
        empty = row_sum == 0
        out[:, :, q0:q1] = _rows(acc / torch.where(empty, torch.ones_like(row_sum), row_sum), rev)
        safe_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
        lse_rows = torch.where(empty, torch.full_like(row_sum, float("inf")), safe_max + row_sum.log())[..., 0]
        lse[:, :, q0:q1] = _rows(lse_rows, rev, -1)


def _key_tiles(plan: _Plan, q0: int, q1: int, k_len: int):
    """(k0, k1) of each key tile of ``block_k`` keys the query block q0 .. q1 − 1 walks: its key ranges
    (``_Plan.key_ranges``: the sinks apart from the window's keys) cut into tiles."""
    for lo, hi in plan.key_ranges(q0, q1, k_len):
        for k0 in range(lo, hi, plan.block_k):
            yield k0, min(k0 + plan.block_k, hi)


def _online_backward(plan: _Plan, tile: _Tile, q, k, v, lse, do, delta, valid, q_off, b, h, hkv, d, dq, dk, dv,
                     g_dist, dc, g_sink=None) -> None:
    """Accumulate dq (of the scaled q), dk, dv and the term's per-tile gradient sums (``g_dist``: a Toeplitz term's
    per-distance dS, and ``g_sink`` its far sinks' at their cache distances where the sinks sit at their cache
    positions; ``dc``: a gate's; a pair term's by its tiles, ``PairTiles``) by recomputing each tile's
    probabilities from the saved log-sum-exp, in place."""
    pair = tile.pair
    q_len, k_len = q.shape[2], k.shape[2]
    rev = plan.form == "toeplitz"
    for q0 in range(0, q_len, plan.block_q):
        q1 = min(q0 + plan.block_q, q_len)
        n = q1 - q0
        qi = _rows(_query_index(q_off, q0, q1, q.device), rev, 0)
        qb = _rows(q[:, :, q0:q1], rev)
        qg = _group(qb, hkv)
        dob = _rows(do[:, :, q0:q1], rev)
        dog = _group(dob, hkv)
        lse_b = _rows(lse[:, :, q0:q1, None], rev)
        delta_b = _rows(delta[:, :, q0:q1], rev)
        ctx = pair.block(qb) if pair is not None else None
        state = pair.backward_block(qb, dob, ctx) if pair is not None else None
        dq_b = q.new_zeros(b, hkv, qg.shape[2], d)
        for k0, k1 in _key_tiles(plan, q0, q1, k_len):
            kb, vb = k[:, :, k0:k1], v[:, :, k0:k1]
            s = _logits(qg, kb, tile.bias(qi, q0, q1, k0, k1, ctx), h, pair is not None and pair.fresh)
            s = _apply_mask(s, plan, qi, q0, k0, k1, valid)
            s = s.sub_(lse_b)  # rows that see no key have lse = +inf -> p = 0
            p = exp_flushed(s)  # (B, H, n, m)
            pg = _group(p, hkv)
            dv[:, :, k0:k1] += pg.transpose(-1, -2) @ dog
            dp = _ungroup(dog @ vb.transpose(-1, -2), h)
            if pair is not None:  # a value term's share of dP (shaw)
                pair.grad_dp(state, dp, p, qi, k0, k1)
            if g_dist is not None:  # dS straight into the buffer its anti-diagonal sums read (no copy)
                buf = _skew_buffer(p, k1 - k0)
                ds = torch.mul(dp.sub_(delta_b), p, out=buf[..., : k1 - k0])
            else:
                ds = dp.sub_(delta_b).mul_(p)  # dS: the gradient of the logits
            dsg = _group(ds, hkv)
            dq_b += dsg @ kb
            dk[:, :, k0:k1] += dsg.transpose(-1, -2) @ qg
            if g_dist is not None:  # rows reversed: anti-diagonal c is rev index t0 + c (see Tile.bias)
                if g_sink is not None:  # the far sinks are not at their anti-diagonal's distance
                    tile.far_sink_grads(ds, qi, k0, k1, g_sink)
                t0 = q_len - q1 + k0
                g_dist[:, t0 : t0 + n + (k1 - k0) - 1] += _antidiagonal_sums(buf, k1 - k0)
            elif dc is not None:
                dc[..., k0:k1] -= ds.sum(-2)
                rows = ds.sum(-1)
                if isinstance(q_off, torch.Tensor):
                    dc.index_add_(-1, qi, rows)
                else:
                    dc[..., q_off + q0 : q_off + q1] += rows
            elif pair is not None:
                pair.grad_tile(state, ds, qi, q0, q1, k0, k1)
        dq[:, :, q0:q1] = _rows(_ungroup(dq_b, h), rev)
        if pair is not None:  # shaw: dq of its key term through q · a^K
            extra = pair.end_block(state, qb)
            if extra is not None:
                dq[:, :, q0:q1] += extra


def _term_grads(plan, tensors, need, tile, g_dist, dc, by_name: dict, g_sink=None) -> list:
    """The gradients of the term tensors, in ``plan.names`` order: a Toeplitz term's from its per-distance dS
    (``g_dist``, and ``g_sink`` at the far sinks' cache distances) and a −s · |δ| term's from its key channel's
    (``dc``) by autograd through the registry entry, a gate's ``dc`` itself, a pair term's by name (``by_name``, from
    its tiles)."""
    grads: list = [None] * len(tensors)
    if plan.form == "toeplitz" and g_dist is not None:
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(bool(w)) for t, w in zip(tensors, need)]
            delta, g = tile.delta, g_dist.flip(-1)
            if g_sink is not None:
                delta, g = torch.cat([delta, tile.sink_delta]), torch.cat([g, g_sink], -1)
            values = distance_values(plan.term(tuple(leaves)), delta)
            grads = _autograd(values, g.to(values.dtype), leaves, need)
    elif plan.form == "gate" and dc is not None:
        grads[0] = dc
    elif plan.spec.slope is not None and dc is not None:  # c[j] = −s · j (the key channel): ds = −Σ_j dc_j · j
        j = torch.arange(dc.shape[-1], device=dc.device, dtype=dc.dtype)
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(bool(w)) for t, w in zip(tensors, need)]
            slopes = plan.spec.slope(dict(zip(plan.names, leaves)))
            grads = _autograd(slopes, -(dc * j).sum((0, 2)).to(slopes.dtype), leaves, need)
    elif plan.form == "pair":
        grads = [by_name.get(name) for name in plan.names]
    return [None if g is None else g.to(t.dtype) for g, t in zip(grads, tensors)]


def _autograd(output: torch.Tensor, grad: torch.Tensor, leaves: list, need) -> list:
    """The gradient of each leaf that needs one (None for the others) of ``output`` with incoming ``grad``."""
    wanted = [x for x, w in zip(leaves, need) if w]
    got = iter(torch.autograd.grad(output, wanted, grad, allow_unused=True))
    return [next(got) if w else None for w in need]
