"""Stick-breaking attention tile by tile in plain PyTorch: the engine wherever the Triton kernels do not run.

Math (``hf_posenc/encodings/sba.py``, the paper's eq. for A_ij in log space, and ``naive.py``): for query i
(key index q_i = q_offset + i), its breakpoints j (keys j < q_i, or j <= q_i with ``attend_current``, that
the mask allows), z_ij = s q_i·k_j and sp = softplus with the code's linear branch above 15::

    A_ij = exp(z_ij - Σ_{k >= j, k breakpoint} sp(z_ik)),     o_i = Σ_j A_ij v_j  [+ r_i u_i]
    r_i  = exp(-Σ_j sp(z_ij))                                   (the remaining stick)

with u_i = v_{q_i} (``remainder="current"``), the per-head vector b_h (``"bias"``), or no term
(``"discard"``, the default). Everything in float32 (float64 for float64 inputs).

Forward: per block of ``block_m`` queries (all query heads of a key/value head at once: GQA is never
expanded), the key tiles of ``block_n`` keys are walked right to left (``hf_posenc.kernels._reverse_tiles``:
the keys are reversed once, so the in-tile suffix sums are one ``cumsum``), carrying per query the stick
broken so far, c_i = Σ sp over the keys already walked. In a tile: z, sp (0 off the breakpoints), its
cumulative sum, log A = z - cumsum - c, A v accumulated, c += Σ_tile sp. Tiles above the diagonal are never
visited (int offsets), nor, with a sliding ``window``, the tiles left of the block's first window edge (their
keys are absent: no weight, no break), but the tiles of its attention sinks (``sink``: the keys j < sink, walked
last, breakpoints as any visible key). Weights below e^-87 are 0 (see ``_LOG_FLOOR``). Extra memory: the float32
output and per-tile temporaries, O(L·D + B·H·block_m·block_n).

Exhausted sticks. Once every row of a query block has broken more than 110 of stick (c > 110, float32), every
tile further left adds exactly nothing: its weights are below e^-c and zeroed (the floor above), its P is set to
0 (below), and the remaining stick e^-c is 0 in float32 either way. On the CPU in eager mode the walks (forward
and backward) stop there: the result is bit for bit the same, and the work is O(L · (keys to exhaustion)) per
row instead of O(L²). With random logits (sp ≈ log 2 per key) that is about 160 keys; SBA's learned attention
is recent-biased, but a row whose gates stay near 0 walks on.

Backward (recomputed; the same walk): with g_ij = A_ij (do_i·v_j) and T_i = do_i·o_i (the float32 output,
saved), the logit gradient is

    dz_ij = g_ij - sp'(z_ij) P_ij,     P_ij = r_i (do_i·u_i) + Σ_{j' <= j} g_ij' = T_i - Σ_{j' > j} g_ij'

and the walk carries S_i = Σ g over the tiles already walked. As in the Triton kernels, where the stick right
of key j is exhausted (Σ_{k > j} sp > 110: every A_ij' with j' <= j, and r_i, are below e^-110) P_ij is set
to exactly 0 rather than left as the rounding noise of T - S; a row exhausted at a tile's right edge also
takes T_i - S_i = 0 from there on. sp' = σ (above the linear threshold 15 the code's 1;
1 - σ(15) < 3.1e-7). dq_i = s Σ_j dz_ij k_j,
dk_j = s Σ_i dz_ij q_i and dv_j = Σ_i A_ij do_i are accumulated per tile (dk, dv into one (B, Hkv, Lk, D)
buffer each: no atomics, no slices of a full matrix). Remainder gradients: d b_h = Σ_i r_i do_i and, for
"current", dv_{q_i} += r_i do_i.
"""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F

from ...ops import eager_value_checks
from .._common import without_autocast
from .._reverse_tiles import (
    Geometry, blocked_mask_rows, call_options, fill_blocked, query_blocks, reversed_inputs, to_groups, walk,
)
from .naive import SOFTPLUS_THRESHOLD  # softplus is linear above this (the paper code's threshold)
from ..custom_ops import EngineSpec, attention_output, compiled_engine, kernel_operands, offset_arg, register_engine

__all__ = ["sba_tiled", "SbaTiledFunction", "BLOCK_M", "BLOCK_N"]

#: default query block; the key tile is sized to about ``_reverse_tiles.TILE_ELEMENTS`` per float tile (None).
BLOCK_M = 128
BLOCK_N: int | None = 256
#: a stick carry above this leaves exp(-carry) below the smallest float32 subnormal.
_EXHAUSTED = 110.0
#: weights below exp(floor) -- about the smallest normal number, 1.2e-38 in float32 -- are set to exactly 0:
#: on CPUs exp takes a slow path (10-30x, measured with torch 2.13) for every input below -87.3 (and -inf),
#: and products of subnormal numbers are as slow, so the log-weights are clamped at the floor before the exp
#: and what comes out at the floor is zeroed (float32 would round most of those weights to 0 anyway).
_LOG_FLOOR = {torch.float32: -87.0, torch.float64: -707.0}


def _exhausted(c: torch.Tensor, stop_early: bool) -> bool:
    """Whether every row of the block has broken more than ``_EXHAUSTED`` of stick (c, in float32): then every
    tile further left adds exactly nothing (each weight there is at most e^-c < e^-87: zeroed; every P there is
    set to 0; the remainder e^-c is 0 in float32 either way), so the walk may stop. ``stop_early``: float32 and
    eager on the CPU (reading ``c`` is a host sync; float64 keeps weights down to e^-707)."""
    return stop_early and bool((c > _EXHAUSTED).all())


def _stop_early(q: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the walks may stop once every stick is exhausted (`_exhausted`)."""
    return dtype == torch.float32 and eager_value_checks(q)


def _tile(qs, kt, c, blocked):
    """One tile: logits z (-inf off the breakpoints), softplus, its cumulative sum from the right *including
    the carry* c (reversed keys: a plain cumsum; the carry is folded into the first column, so that column
    of the returned softplus holds sp + c) and the weights A = exp(z - Σ_{k >= j} sp)."""
    z = fill_blocked(qs @ kt.transpose(-1, -2), blocked, float("-inf"))
    sp = F.softplus(z, beta=1.0, threshold=SOFTPLUS_THRESHOLD)  # softplus(-inf) = 0: blocked keys break nothing
    sp[..., 0] += c
    cs = sp.cumsum(-1)
    floor = _LOG_FLOOR[z.dtype]
    a = torch.sub(z, cs).clamp_(min=floor).exp_()
    a = F.threshold_(a, math.exp(floor) * 1.0001, 0.0)
    return z, sp, cs, a


def _own_values(v: torch.Tensor, geo: Geometry, m0: int, m1: int, q_offset, dtype) -> torch.Tensor:
    """(B, Hkv, G·BM, D): v at each query's own key (``remainder="current"``), repeated over the group."""
    off = q_offset.to(v.device) if isinstance(q_offset, torch.Tensor) else q_offset
    own = v.index_select(2, torch.arange(m0, m1, device=v.device) + off).to(dtype)  # (B, Hkv, BM, D)
    return own[:, :, None].expand(geo.b, geo.hkv, geo.groups, m1 - m0, geo.d).reshape(geo.b, geo.hkv, -1, geo.d)


def _forward(q, k, v, mask, bias, scale, q_offset, attend_current, remainder, block_m, block_n, window=None,
             sink=None):
    geo, block_m, block_n, dtype, kr, vr = reversed_inputs(q, k, v, block_m, block_n)
    out = torch.empty(geo.b, geo.h, geo.lq, geo.d, dtype=dtype, device=q.device)
    strict = not attend_current
    early = _stop_early(q, dtype)
    for m0, m1, bm in query_blocks(geo.lq, block_m):
        qs = to_groups(q, geo, m0, m1, dtype).mul_(scale)
        c = torch.zeros(geo.b, geo.hkv, geo.groups * bm, dtype=dtype, device=q.device)
        acc = torch.zeros(geo.b, geo.hkv, geo.groups * bm, geo.d, dtype=dtype, device=q.device)
        rows = blocked_mask_rows(mask, m0, m1)
        for tile, blocked in walk(m0, m1, geo, q_offset, block_n, strict, rows, q.device, window, sink):
            _, _, cs, a = _tile(qs, kr[:, :, tile.r0:tile.r1], c, blocked)
            acc.add_(a @ vr[:, :, tile.r0:tile.r1])
            c = cs[..., -1].clone()
            if _exhausted(c, early):
                break
        if remainder == "current":
            acc.add_(torch.exp(-c)[..., None] * _own_values(v, geo, m0, m1, q_offset, dtype))
        elif remainder == "bias":
            rest = torch.exp(-c).view(geo.b, geo.hkv, geo.groups, bm, 1)
            acc.view(geo.b, geo.hkv, geo.groups, bm, geo.d).add_(
                rest * bias.to(dtype).view(1, geo.hkv, geo.groups, 1, geo.d)
            )
        out[:, :, m0:m1] = acc.view(geo.b, geo.h, bm, geo.d)
    return out


def _backward(q, k, v, o, do, mask, bias, scale, q_offset, attend_current, remainder, block_m, block_n,
              window=None, sink=None):
    geo, block_m, block_n, dtype, kr, vr = reversed_inputs(q, k, v, block_m, block_n)
    dq = torch.empty(geo.b, geo.h, geo.lq, geo.d, dtype=dtype, device=q.device)
    dkr = torch.zeros(geo.b, geo.hkv, geo.lk, geo.d, dtype=dtype, device=q.device)
    dvr = torch.zeros_like(dkr)
    dbias = torch.zeros(geo.h, geo.d, dtype=dtype, device=q.device) if remainder == "bias" else None
    strict = not attend_current
    early = _stop_early(q, dtype)
    for m0, m1, bm in query_blocks(geo.lq, block_m):
        qs = to_groups(q, geo, m0, m1, dtype).mul_(scale)
        dob = to_groups(do, geo, m0, m1, dtype)
        # T_i - S_i: the output's do-product less the g already walked (S starts at 0)
        t_minus_s = (dob * to_groups(o, geo, m0, m1, dtype)).sum(-1)
        c = torch.zeros(geo.b, geo.hkv, geo.groups * bm, dtype=dtype, device=q.device)
        dqb = torch.zeros(geo.b, geo.hkv, geo.groups * bm, geo.d, dtype=dtype, device=q.device)
        rows = blocked_mask_rows(mask, m0, m1)
        for tile, blocked in walk(m0, m1, geo, q_offset, block_n, strict, rows, q.device, window, sink):
            kt, vt = kr[:, :, tile.r0:tile.r1], vr[:, :, tile.r0:tile.r1]
            z, sp, cs, a = _tile(qs, kt, c, blocked)
            g = a * (dob @ vt.transpose(-1, -2))
            gs = g.cumsum(-1)
            # P = T - S - Σ_{j' > j in the tile} g; rows with no stick left at the tile's right edge
            # (c > 110: every P of the row is below e^-110) take T - S = 0, so that their P is the tiny
            # -Σ g + g rather than the rounding noise of T - S
            t_minus_s = torch.where(c > _EXHAUSTED, 0.0, t_minus_s)
            pref = torch.sub(t_minus_s[..., None], gs).add_(g)
            # and per key, as the kernels do: where Σ sp right of j > 110 (column 0 of sp holds sp + c)
            right = cs - sp
            right[..., 0] = c
            pref.masked_fill_(right > _EXHAUSTED, 0.0)
            # dz = g - sp'(z) P, sp' = σ (1 - σ(15) < 3.1e-7 above the linear threshold; blocked: σ(-inf) = 0)
            dz = torch.addcmul(g, torch.sigmoid(z), pref, value=-1.0)
            dqb.add_(dz @ kt)
            dkr[:, :, tile.r0:tile.r1].add_(dz.transpose(-1, -2) @ qs)
            dvr[:, :, tile.r0:tile.r1].add_(a.transpose(-1, -2) @ dob)
            c = cs[..., -1].clone()
            t_minus_s = t_minus_s - gs[..., -1]
            if _exhausted(c, early):
                break
        dq[:, :, m0:m1] = dqb.mul_(scale).view(geo.b, geo.h, bm, geo.d)
        if remainder != "discard":
            weighted = torch.exp(-c)[..., None] * dob  # r_i do_i, (B, Hkv, G·BM, D)
            if remainder == "bias":
                dbias.add_(weighted.view(geo.b, geo.h, bm, geo.d).sum(dim=(0, 2)))
            else:  # o_i += r_i v_{q_i}: the query's own key, reversed index Lk - 1 - q_i
                own = weighted.view(geo.b, geo.hkv, geo.groups, bm, geo.d).sum(2)
                off = q_offset.to(q.device) if isinstance(q_offset, torch.Tensor) else q_offset
                ridx = (geo.lk - 1 - off) - torch.arange(m0, m1, device=q.device)
                dvr.index_add_(2, ridx, own)
    return dq, dkr.flip(2), dvr.flip(2), dbias


class SbaTiledFunction(torch.autograd.Function):
    """Stick-breaking attention, tile-wise, recomputing in backward; gradients for q, k, v and the bias."""

    @staticmethod
    @without_autocast
    def forward(ctx, q, k, v, mask, bias, scale, q_offset, attend_current, remainder, block_m, block_n, window=None,
                sink=None):
        out = _forward(q, k, v, mask, bias, scale, q_offset, attend_current, remainder, block_m, block_n, window,
                       sink)
        if any(ctx.needs_input_grad[i] for i in (0, 1, 2, 4)):
            ctx.save_for_backward(q, k, v, out, mask, bias)
        ctx.args = (scale, q_offset, attend_current, remainder, block_m, block_n, window, sink)
        return out.to(q.dtype)

    @staticmethod
    @without_autocast
    def backward(ctx, do):
        q, k, v, out, mask, bias = ctx.saved_tensors
        scale, q_offset, attend_current, remainder, block_m, block_n, window, sink = ctx.args
        dq, dk, dv, dbias = _backward(
            q, k, v, out, do, mask, bias, scale, q_offset, attend_current, remainder, block_m, block_n, window, sink
        )
        return (
            dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None,
            None if dbias is None or not ctx.needs_input_grad[4] else dbias.to(bias.dtype),
            None, None, None, None, None, None, None, None,
        )


def sba_tiled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
              q_offset: int | torch.Tensor = 0, attend_current: bool = False, remainder: str = "discard",
              bias: torch.Tensor | None = None, block_m: int | None = None, block_n: int | None = None,
              window: int | None = None, sink: int | None = None) -> torch.Tensor:
    """Stick-breaking attention computed tile by tile (any device), recomputed in backward: the arguments of
    `hf_posenc.kernels.sba.stick_breaking` (any float dtype, computed in float32, float64 for float64) and the tile
    sizes, checked as `hf_posenc.kernels._reverse_tiles.call_options` says (``TypeError``, ``ValueError``). The keys
    outside a window have no weight and break nothing: the stick is broken over the window's keys only.

    Returns:
        (B, H, Lq, D) in q's dtype.
    """
    block_m, block_n, q_offset = call_options(block_m, block_n, BLOCK_M, BLOCK_N, q_offset, window, sink)
    if torch.compiler.is_compiling():  # one custom op in the compiled graph (hf_posenc.kernels.custom_ops)
        return compiled_engine("sba", "sba.triton_sba", [q, k, v, mask, bias], {
            "scale": float(scale), "attend_current": bool(attend_current), "remainder": remainder, "block_m": block_m,
            "block_n": block_n, "window": window, "sink": sink}, q_offset)
    return SbaTiledFunction.apply(
        q, k, v, mask, bias, float(scale), q_offset, bool(attend_current), remainder, block_m, block_n, window, sink
    )


def _kernel(t: list, s: dict, o: int) -> tuple[type, tuple]:
    """The Triton kernel's Function and forward arguments (same positions as SbaTiledFunction's)."""
    from .triton_sba import SbaFunction

    q, k, v, offset = kernel_operands(t, o)
    return SbaFunction, (q, k, v, t[3], t[4], s["scale"], offset, s["attend_current"], s["remainder"], s["window"],
                         s["sink"])


def _kernel_unsupported(t: list, s: dict, o: int) -> str | None:
    from .._attn_dispatch import common_unsupported

    return common_unsupported("sba", "sba.triton_sba", t[0], t[1], t[2], t[3], offset_arg(t[5], o), False, 0.0,
                              False)


register_engine("sba", EngineSpec(  # tensors [q, k, v, mask?, bias?, q_offset?]
    SbaTiledFunction,
    lambda t, s, o: (t[0], t[1], t[2], t[3], t[4], s["scale"], offset_arg(t[5], o), s["attend_current"],
                     s["remainder"], s["block_m"], s["block_n"], s["window"], s["sink"]),
    lambda t: [0, 1, 2, 3, 4, 6],
    attention_output,
    _kernel,
    _kernel_unsupported,
))
