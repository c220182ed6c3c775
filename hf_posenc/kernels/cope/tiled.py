"""CoPE attention tile by tile in plain PyTorch: the engine wherever the Triton kernels do not run.

Math (``hf_posenc/encodings/cope.py``, the paper's eqs. 3-7 with the code's scaling, and ``naive.py``): for
query i (key index q_i = q_offset + i) and the keys j <= q_i the mask allows, with s the logit scale and e
the (D, npos) table::

    w_ij = s q_i·k_j,  g_ij = σ(w_ij) (0 off the allowed keys: masked before the sum)
    p_ij = min(Σ_{k=j..q_i} g_ik, npos - 1)              (j included)
    z_i  = q_i e  (npos entries),  pos_ij = (p - ⌊p⌋) z_i[⌈p⌉] + (1 - p + ⌊p⌋) z_i[⌊p⌋]
    o_i  = softmax_j(w_ij + pos_ij) v

Everything in float32 (float64 for float64 inputs).

Forward: per block of ``block_m`` queries (all query heads of a key/value head at once: GQA is never
expanded), the table z_i = q_i e is computed once, (G·block_m, npos), and gathered per tile; the key tiles
are walked right to left (``hf_posenc.kernels._reverse_tiles``: keys reversed once, so the in-tile suffix sums
are one ``cumsum``), carrying per query the gate mass of the keys already walked, with an online softmax
(running max and sum, rescaled accumulator). Tiles above the diagonal are never visited (int offsets), nor,
with a sliding ``window``, the tiles left of the block's first window edge (their keys are absent: no
weight, no gate), but the tiles of its attention sinks (``sink``: the keys j < sink, walked last, gates counted).
pos is computed as z[⌊p⌋] + (p - ⌊p⌋) Δz[⌊p⌋] with Δz[t] = z[t + 1] - z[t] (0 at npos - 1): the same value
as the interpolation between ⌊p⌋ and ⌈p⌉, with one gather (z and Δz stored as adjacent pairs). Extra memory:
O(L·H·(npos + D)) rows and per-tile temporaries, never O(L²).

Saturated keys. Positions only grow leftwards, and once a row's gate mass reaches npos − 1 every key further left
sits at the clamped position: pos = z_i[npos − 1], a constant of the row, so those keys are plain softmax
attention (and their dw is dS, their Δz 0). On the CPU in float32 (eager, int offset, no window), when every
row of a query block has saturated by a tile's left edge and the mask blocks none of the keys left of it, the
walk stops there and torch's fused CPU attention kernel takes all of those keys in one call, merged by
log-sum-exp; the backward makes the same decision and puts their dS at npos − 1 as −Σ dS of the keys walked (a
row's dS sums to 0). With random gates (≈ 1/2) a row saturates after about 2 npos keys, so at L = 2048 most keys
take the fused call; a trained CoPE whose gates are sparse saturates later, or never (no change then).

Backward (recomputed; the same walk). With dS = P ⊙ (dP - δ) (dP = do vᵀ, δ_i = do_i·o_i)::

    dp_ij  = dS_ij (z_i[⌈p⌉] - z_i[⌊p⌋])   where p_ij < npos - 1 (0 where clamped)
    dw_ij  = dS_ij + σ'(w_ij) Σ_{j' <= j} dp_ij'          (p_ij sums the gates of the keys j..q_i)
    dz_i[t] = Σ_j dS_ij tent(p_ij - t),   dq_i = s Σ_j dw_ij k_j + e dz_i,   de = Σ_i q_i ⊗ dz_i
    dk_j = s Σ_i dw_ij q_i,   dv_j = Σ_i P_ij do_i

The prefix Σ_{j' <= j} dp runs from the far end of the row, against the walk: it is Dp_i - Σ_{j' > j} dp
with the row total Dp_i = Σ_j dp_ij. That total needs no extra pass: Dp_i = do_i·U_i - δ_i c_i with
U_i = Σ_j P_ij Δz_ij v_j and c_i = Σ_j P_ij Δz_ij, which the forward accumulates beside its output
(O(L·H·D), only when a gradient is needed). Once a row's carry reaches npos - 1 every further position is
clamped (p grows monotonically leftwards) and its prefix is exactly 0: the row's running total is then set
to 0 rather than left as rounding noise. At an integer p the slope used is the one of the segment above
(Δz[p]); the reference's ⌈p⌉ = ⌊p⌋ there gives 0 -- both are one-sided derivatives of the piecewise-linear
interpolation, and an interior integer p needs gates of exactly 0 or 1. dz is scattered per tile
(``scatter_add_`` of dS and dS·(p - ⌊p⌋) at ⌊p⌋ into two (G·block_m, npos) row tables), dk and dv are
accumulated per tile into one (B, Hkv, Lk, D) buffer each: no slices of a full matrix, no (B, H, L, L) tensor.
"""

from __future__ import annotations

import torch

from ...ops import eager_value_checks
from .._common import without_autocast
from .._cpu_flash import FLASH_BACKWARD as _flash_bwd, FLASH_FORWARD as _flash_fwd
from .._subnormal import exp_flushed
from .._reverse_tiles import (
    Geometry, blocked_mask_rows, call_options, fill_blocked, query_blocks, reversed_inputs, to_groups, walk,
)
from ..custom_ops import EngineSpec, attention_output, compiled_engine, kernel_operands, offset_arg, register_engine

__all__ = ["cope_tiled", "CopeTiledFunction", "BLOCK_M", "BLOCK_N"]

#: default query block; the key tile is sized to about ``_reverse_tiles.TILE_ELEMENTS`` per float tile (None).
BLOCK_M = 128
BLOCK_N: int | None = 256


def _row_tables(qb: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """(B, Hkv, R, npos, 2): z = q e and its forward differences Δz[t] = z[t + 1] - z[t] (0 at t = npos - 1,
    where p is clamped and its weight p - ⌊p⌋ is 0), so that pos = z[⌊p⌋] + (p - ⌊p⌋) Δz[⌊p⌋]. The
    pairs are adjacent in memory: for float32, one gather of a float64 view fetches both (see `_gather2`)."""
    z = qb @ table
    pairs = torch.zeros(z.shape + (2,), dtype=z.dtype, device=z.device)
    pairs[..., 0] = z
    pairs[..., :-1, 1] = z[..., 1:] - z[..., :-1]
    return pairs


def _query_block(q: torch.Tensor, geo: Geometry, m0: int, m1: int, dtype: torch.dtype, scale: float,
                 e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query block [m0, m1) as a walk takes it: its rows qb (B, Hkv, G·BM, D) in ``dtype`` (`to_groups`), scaled
    (s·qb), and their tables of z = qb e and Δz (`_row_tables`)."""
    qb = to_groups(q, geo, m0, m1, dtype)
    return qb, qb * scale, _row_tables(qb, e)


def _gather2(pairs: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(z[idx], Δz[idx]) from the (..., npos, 2) table: one gather of 8-byte pairs for float32."""
    if pairs.dtype == torch.float32:
        both = pairs.view(torch.float64).squeeze(-1).gather(-1, idx).view(torch.float32)
        return both[..., 0::2], both[..., 1::2]
    return pairs[..., 0].gather(-1, idx), pairs[..., 1].gather(-1, idx)


def _saturated_tail(carry: torch.Tensor, top: float, tile, stop: int, plain: bool, rows: torch.Tensor | None
                    ) -> int:
    """The number of keys left of ``tile`` (reversed indices tile.r1 .. stop − 1) when every row's gate mass has
    reached npos − 1 by the tile's left edge and the mask blocks none of those keys, else 0 (then the walk goes on
    tile by tile).

    Past that point every position is clamped: p = npos − 1, pos = z_i[npos − 1] is a constant of the row, Δz = 0,
    and the prefix Σ dp is 0, so those keys are plain softmax attention with the row's logits shifted by z_i[npos −
    1] (and dw = dS in backward): torch's fused CPU attention kernel takes all of them in one call. ``plain``: the
    call may be made (float32 on the CPU in eager mode, an int offset, no window); ``rows``: the block's blocked
    mask rows, reversed keys (a model's causal mask blocks none of them; padding does). The tests read ``carry``
    and ``rows`` (host syncs, CPU only). Backward makes the same decision from the same values."""
    if not plain or tile.r1 >= stop or not bool((carry >= top).all()):
        return 0
    if rows is not None and bool(rows[..., tile.r1 : stop].any()):
        return 0
    return stop - tile.r1


def _tile(qs, kt, pairs, carry, blocked, top, with_slope):
    """One tile: logits w (-inf off the allowed keys), gates, σ' (``with_slope``), the clamped positions p
    (a cumsum from the right with the carry folded into the first column), ⌊p⌋ (int64), p - ⌊p⌋, Δz[⌊p⌋],
    the scores w + pos, and the unclamped gate mass up to the tile's left edge (the next carry)."""
    w = fill_blocked(qs @ kt.transpose(-1, -2), blocked, float("-inf"))
    gate = torch.sigmoid(w)  # σ(-inf) = 0: masked before the sum
    slope = torch.addcmul(gate, gate, gate, value=-1.0) if with_slope else None  # σ' = g - g²
    gate[..., 0] += carry
    p = gate.cumsum(-1)
    carry = p[..., -1].clone()
    p.clamp_(max=top)
    idx = p.long()  # ⌊p⌋ (p >= 0)
    frac = torch.frac(p)
    zf, dz = _gather2(pairs, idx)
    s = torch.addcmul(zf, frac, dz).add_(w)
    return w, slope, p, idx, frac, dz, s, carry


def _forward(q, k, v, table, mask, scale, q_offset, block_m, block_n, with_rows, window=None, sink=None):
    geo, block_m, block_n, dtype, kr, vr = reversed_inputs(q, k, v, block_m, block_n)
    top = float(table.shape[1] - 1)
    e = table.to(dtype)
    dev = q.device
    out = torch.empty(geo.b, geo.h, geo.lq, geo.d, dtype=dtype, device=dev)
    lse = torch.empty(geo.b, geo.h, geo.lq, dtype=dtype, device=dev)
    u_rows = torch.empty_like(out) if with_rows else None
    c_rows = torch.empty_like(lse) if with_rows else None
    neg_inf = torch.tensor(float("-inf"), dtype=dtype, device=dev)
    zero = torch.zeros((), dtype=dtype, device=dev)
    plain = _plain_tail_allowed(q, dtype, window, q_offset)
    for m0, m1, bm in query_blocks(geo.lq, block_m):
        nr = geo.groups * bm
        _, qs, pairs = _query_block(q, geo, m0, m1, dtype, scale, e)
        carry = torch.zeros(geo.b, geo.hkv, nr, dtype=dtype, device=dev)
        m_i = torch.full_like(carry, float("-inf"))
        l_i = torch.zeros_like(carry)
        acc = torch.zeros(geo.b, geo.hkv, nr, geo.d, dtype=dtype, device=dev)
        if with_rows:
            u_acc = torch.zeros_like(acc)
            c_acc = torch.zeros_like(carry)
        rows = blocked_mask_rows(mask, m0, m1)
        for tile, blocked in walk(m0, m1, geo, q_offset, block_n, False, rows, dev, window, sink):
            vt = vr[:, :, tile.r0:tile.r1]
            _, _, _, _, frac, dz, s, carry = _tile(qs, kr[:, :, tile.r0:tile.r1], pairs, carry, blocked, top, False)
            m_new = torch.maximum(m_i, s.amax(-1))
            m_safe = torch.where(m_new == neg_inf, zero, m_new)
            alpha = torch.exp(m_i - m_safe)
            pexp = exp_flushed(s.sub_(m_safe[..., None]))  # no exp of -inf or subnormals (kernels._subnormal)
            l_i.mul_(alpha).add_(pexp.sum(-1))
            acc.mul_(alpha[..., None]).add_(pexp @ vt)
            if with_rows:  # U = Σ P Δz v and c = Σ P Δz (Δz = 0 where p is clamped)
                pw = pexp.mul(dz)
                u_acc.mul_(alpha[..., None]).add_(pw @ vt)
                c_acc.mul_(alpha).add_(pw.sum(-1))
            m_i = m_new
            rest = _saturated_tail(carry, top, tile, geo.lk, plain, rows)
            if rest:  # the keys 0 .. rest − 1, all at the clamped position: one fused call, merged by lse
                # (the keys in walk order: a softmax over a set of keys ignores their order)
                o_far, l_far = _flash_fwd(qs, kr[:, :, tile.r1:], vr[:, :, tile.r1:], 0.0, False, scale=1.0)
                l_far = l_far + pairs[..., -1, 0]  # + z_i[npos − 1]
                m_new = torch.maximum(m_i, l_far)
                alpha, beta = torch.exp(m_i - m_new), torch.exp(l_far - m_new)
                l_i.mul_(alpha).add_(beta)
                acc.mul_(alpha[..., None]).add_(o_far * beta[..., None])
                if with_rows:  # Δz = 0 there: U and c gain nothing, only the new scale
                    u_acc.mul_(alpha[..., None])
                    c_acc.mul_(alpha)
                m_i = m_new
                break
        has = l_i > 0
        inv = torch.where(has, 1.0 / torch.where(has, l_i, torch.ones_like(l_i)), torch.zeros_like(l_i))
        out[:, :, m0:m1] = (acc * inv[..., None]).view(geo.b, geo.h, bm, geo.d)
        row_lse = torch.where(has, m_i + torch.log(torch.where(has, l_i, torch.ones_like(l_i))), -neg_inf)
        lse[:, :, m0:m1] = row_lse.view(geo.b, geo.h, bm)
        if with_rows:
            u_rows[:, :, m0:m1] = (u_acc * inv[..., None]).view(geo.b, geo.h, bm, geo.d)
            c_rows[:, :, m0:m1] = (c_acc * inv).view(geo.b, geo.h, bm)
    return out, lse, u_rows, c_rows


def _backward(q, k, v, table, mask, scale, q_offset, block_m, block_n, out, lse, u_rows, c_rows, do, window=None,
              sink=None):
    geo, block_m, block_n, dtype, kr, vr = reversed_inputs(q, k, v, block_m, block_n)
    npos = table.shape[1]
    top = float(npos - 1)
    e = table.to(dtype)
    dev = q.device
    dq = torch.empty(geo.b, geo.h, geo.lq, geo.d, dtype=dtype, device=dev)
    dkr = torch.zeros(geo.b, geo.hkv, geo.lk, geo.d, dtype=dtype, device=dev)
    dvr = torch.zeros_like(dkr)
    de = torch.zeros(geo.d, npos, dtype=dtype, device=dev)
    plain = _plain_tail_allowed(q, dtype, window, q_offset)
    for m0, m1, bm in query_blocks(geo.lq, block_m):
        nr = geo.groups * bm
        qb, qs, pairs = _query_block(q, geo, m0, m1, dtype, scale, e)
        dob = to_groups(do, geo, m0, m1, dtype)
        delta = (dob * to_groups(out, geo, m0, m1, dtype)).sum(-1)
        lse_b = to_groups(lse[..., None], geo, m0, m1, dtype)
        # Dp_i - (Σ dp over the tiles already walked): the row total from the forward's U, c
        left = (dob * to_groups(u_rows, geo, m0, m1, dtype)).sum(-1) - delta * to_groups(
            c_rows[..., None], geo, m0, m1, dtype
        )[..., 0]
        carry = torch.zeros(geo.b, geo.hkv, nr, dtype=dtype, device=dev)
        dqb = torch.zeros(geo.b, geo.hkv, nr, geo.d, dtype=dtype, device=dev)
        dz_at = torch.zeros(geo.b, geo.hkv, nr, npos, dtype=dtype, device=dev)  # Σ dS at ⌊p⌋
        dz_frac = torch.zeros_like(dz_at)  # Σ dS (p - ⌊p⌋) at ⌊p⌋
        rows = blocked_mask_rows(mask, m0, m1)
        ds_walked = torch.zeros_like(carry)  # Σ dS over the keys walked (a row's dS sums to 0 over all its keys)
        for tile, blocked in walk(m0, m1, geo, q_offset, block_n, False, rows, dev, window, sink):
            kt, vt = kr[:, :, tile.r0:tile.r1], vr[:, :, tile.r0:tile.r1]
            # rows whose positions are all clamped from here on (carry >= npos - 1): Σ_{j' <= j} dp is exactly 0
            left = torch.where(carry >= top, 0.0, left)
            w, slope, p, idx, frac, dz, s, carry = _tile(qs, kt, pairs, carry, blocked, top, True)
            prob = exp_flushed(s.sub_(lse_b))  # -inf off the allowed keys, lse = +inf on empty rows: 0
            ds = (dob @ vt.transpose(-1, -2)).sub_(delta[..., None]).mul_(prob)
            dp = ds * dz  # Δz = 0 where p is clamped
            dps = dp.cumsum(-1)
            # Σ_{j' <= j} dp = Dp - Σ_{j' > j} dp
            pre = torch.sub(left[..., None], dps).add_(dp)
            dw = torch.addcmul(ds, slope, pre)
            dqb.add_(dw @ kt)
            dkr[:, :, tile.r0:tile.r1].add_(dw.transpose(-1, -2) @ qs)
            dvr[:, :, tile.r0:tile.r1].add_(prob.transpose(-1, -2) @ dob)
            dz_at.scatter_add_(-1, idx, ds)
            if plain:
                ds_walked.add_(ds.sum(-1))
            dz_frac.scatter_add_(-1, idx, ds.mul_(frac))
            left = left - dps[..., -1]
            rest = _saturated_tail(carry, top, tile, geo.lk, plain, rows)
            if rest:  # the forward's fused call: dw = dS there, and their dS (all at npos − 1) is −Σ dS walked
                ob = to_groups(out, geo, m0, m1, dtype)
                gq, gk, gv = _flash_bwd(dob, qs, kr[:, :, tile.r1:], vr[:, :, tile.r1:], ob,
                                        lse_b[..., 0] - pairs[..., -1, 0], 0.0, False, scale=1.0)
                dqb.add_(gq)
                dkr[:, :, tile.r1:].add_(gk)
                dvr[:, :, tile.r1:].add_(gv)
                dz_at[..., -1].sub_(ds_walked)
                break
        # dz[t] = Σ dS (1 - frac) at ⌊p⌋ = t, plus Σ dS frac at ⌊p⌋ + 1 = t
        dzr = dz_at.sub_(dz_frac)
        dzr[..., 1:] += dz_frac[..., :-1]
        dqb.mul_(scale).add_(dzr @ e.transpose(0, 1))
        dq[:, :, m0:m1] = dqb.view(geo.b, geo.h, bm, geo.d)
        de.add_(qb.reshape(-1, geo.d).transpose(0, 1) @ dzr.reshape(-1, npos))
    return dq, dkr.flip(2), dvr.flip(2), de


def _plain_tail_allowed(q: torch.Tensor, dtype: torch.dtype, window, q_offset) -> bool:
    """Whether the walk may hand its saturated keys to the fused CPU kernel (`_saturated_tail`)."""
    return (dtype == torch.float32 and window is None and isinstance(q_offset, int) and _flash_fwd is not None
            and eager_value_checks(q))


class CopeTiledFunction(torch.autograd.Function):
    """Causal CoPE attention, tile-wise, recomputing in backward; gradients for q, k, v and the table."""

    @staticmethod
    @without_autocast
    def forward(ctx, q, k, v, table, mask, scale, q_offset, block_m, block_n, window=None, sink=None):
        needs = any(ctx.needs_input_grad[:4])
        out, lse, u_rows, c_rows = _forward(q, k, v, table, mask, scale, q_offset, block_m, block_n, needs, window,
                                            sink)
        if needs:
            ctx.save_for_backward(q, k, v, table, mask, out, lse, u_rows, c_rows)
        ctx.args = (scale, q_offset, block_m, block_n, window, sink)
        return out.to(q.dtype)

    @staticmethod
    @without_autocast
    def backward(ctx, do):
        q, k, v, table, mask, out, lse, u_rows, c_rows = ctx.saved_tensors
        scale, q_offset, block_m, block_n, window, sink = ctx.args
        dq, dk, dv, de = _backward(q, k, v, table, mask, scale, q_offset, block_m, block_n, out, lse, u_rows,
                                   c_rows, do, window, sink)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype),
                de.to(table.dtype) if ctx.needs_input_grad[3] else None, None, None, None, None, None, None, None)


def cope_tiled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, mask: torch.Tensor | None,
               scale: float, q_offset: int | torch.Tensor = 0, block_m: int | None = None, block_n: int | None = None,
               window: int | None = None, sink: int | None = None) -> torch.Tensor:
    """Causal CoPE attention computed tile by tile (any device), recomputed in backward: the arguments of
    `hf_posenc.kernels.cope.cope` (any float dtype, computed in float32, float64 for float64) and the tile sizes,
    checked as `hf_posenc.kernels._reverse_tiles.call_options` says (``TypeError``, ``ValueError``). The keys outside
    a window have no weight and no gate: the contextual positions count the window's keys only.

    Returns:
        (B, H, Lq, D) in q's dtype.
    """
    block_m, block_n, q_offset = call_options(block_m, block_n, BLOCK_M, BLOCK_N, q_offset, window, sink)
    if torch.compiler.is_compiling():  # one custom op in the compiled graph (hf_posenc.kernels.custom_ops)
        return compiled_engine("cope", "cope.triton_cope", [q, k, v, table, mask], {
            "scale": float(scale), "block_m": block_m, "block_n": block_n, "window": window, "sink": sink}, q_offset)
    return CopeTiledFunction.apply(q, k, v, table, mask, float(scale), q_offset, block_m, block_n, window, sink)


def _kernel(t: list, s: dict, o: int) -> tuple[type, tuple]:
    """The Triton kernel's Function and forward arguments (same positions as CopeTiledFunction's)."""
    from .triton_cope import CopeFunction

    q, k, v, offset = kernel_operands(t, o)
    return CopeFunction, (q, k, v, t[3], t[4], s["scale"], offset, s["window"], s["sink"])


def _kernel_unsupported(t: list, s: dict, o: int) -> str | None:
    from . import triton_unsupported

    return triton_unsupported(t[0], t[1], t[2], t[4], offset_arg(t[5], o))


register_engine("cope", EngineSpec(  # tensors [q, k, v, table, mask?, q_offset?]
    CopeTiledFunction,
    lambda t, s, o: (t[0], t[1], t[2], t[3], t[4], s["scale"], offset_arg(t[5], o), s["block_m"], s["block_n"],
                     s["window"], s["sink"]),
    lambda t: [0, 1, 2, 3, 4, 6],
    attention_output,
    _kernel,
    _kernel_unsupported,
))
