"""Triton kernels of stick-breaking attention (forward and backward), their launchers and autograd Function.

Math (``naive.py`` and ``hf_posenc/encodings/sba.py``): for query i (key index q_i = q_offset + i) and its
breakpoints j (keys j < q_i, or j <= q_i with ``attend_current``, that the mask allows), with
z_ij = s q_i·k_j and sp = softplus (linear above 15)::

    A_ij = exp(z_ij - Σ_{k >= j, k breakpoint} sp(z_ik)),     o_i = Σ_j A_ij v_j  [+ r_i u_i]
    r_i  = exp(-Λ_i), Λ_i = Σ_j sp(z_ij)                       (the remaining stick)

with u_i = v_{q_i} (``remainder="current"``), b_h (``"bias"``), or no term (``"discard"``).

Forward (``_sba_fwd``; grid: query blocks x (batch, head)). A program owns BM queries of one head and walks
the key tiles (BN keys) from the diagonal backwards. It carries, per query, the log-space stick already
broken to its right, c_i = Σ sp over the keys of the tiles already walked (float32). In a tile:
z = s q kᵀ, sp masked to 0 off the breakpoints, the in-tile suffix sum of sp (a reversed
``associative_scan``), log A = z - suffix - c, acc += A v (A cast to the input dtype for the dot, as
FlashAttention casts P), then c += Σ_tile sp. No normaliser, no rescaling. A query whose carry exceeds 110
has no stick left: every further A_ij <= exp(-c) underflows to exactly 0 in float32 (z - sp(z) <= 0), so
the walk stops once every query of the block is exhausted -- exact, not an approximation. The remainder
term is added in-kernel. Half-precision outputs also return their float32 rounding residual (acc - o,
stored in the input dtype) for the backward (see below).

Backward. With g_ij = A_ij (do_i·v_j) and T_i = Σ_j g_ij + r_i (do_i·u_i) = do_i·o_i (the full output),
the gradient of the logits is

    dz_ij = g_ij - sp'(z_ij) P_ij,    P_ij = r_i (do_i·u_i) + Σ_{j' <= j} g_ij' = T_i - Σ_{j' > j} g_ij'

so a walk from the diagonal backwards needs T_i up front and carries S_i = Σ g over the tiles walked.
T_i is computed from the output in float32 -- o plus the residual the forward saved, i.e. its float32
accumulator -- and the backward forms g_ij from A_ij rounded to the input dtype, exactly as the forward's
A·V dot used it. T and Σ g then describe the same (computed) function and T - S is exact up to float32
rounding. (Any inconsistency between them -- T from the bf16-rounded output, or g from unrounded A -- is
multiplied by sp'(z_ij) at every live key of the row, up to Σ sp' <= 110 of them: with keys that share a
mean direction, dq was 13% off the float32 reference at L = 200 in bf16, against 0.9% now.) Where the
carry to the right of j exceeds 110, P_ij (bounded by e^-110) is set to exactly 0, as the float32
reference computes it, instead of T - S (which would leave rounding noise).

* ``_sba_bwd_q`` (query-major, like the forward): dq = s Σ_j dz_ij k_j accumulated in registers; it
  writes T_i, r_i and, every ``CSTRIDE``-th key tile, the carries (c_i, S_i) at the right edge of that tile
  ("checkpoints", float32, ``CARRY_SLOTS`` per query row at most: O(L·H·CARRY_SLOTS) memory, never O(L²)).
* ``_sba_bwd_kv`` (key-major): a program owns BN keys of one key/value head and loops over the query
  heads of its group (GQA: K/V are never expanded; the group is reduced in registers) and over the query
  blocks that see its keys. The carries at the right edge of its tile come from the nearest checkpoint
  at or to the right of it, advanced over the (at most ``CSTRIDE - 1``) tiles in between by recomputing
  their sp and g sums; with L <= CARRY_SLOTS·BN every tile is a checkpoint and nothing is recomputed.
  dk = s Σ_i dz_ij q_i, dv = Σ_i A_ij do_i accumulated in registers and written once: no atomics.

The remainder gradients (d b_h = Σ r_i do_i; for "current" dv[q_i] += Σ_heads r_i do_i) are O(L·D) sums
done in PyTorch from r. The carry checkpoints are allocated per chunk of (batch, key/value head) pairs
whose buffers fit in ``CARRY_BUDGET_BYTES``; each chunk runs both backward kernels.

Only builtins of ``triton.language`` and Triton >= 3.3 features (``tl.associative_scan(reverse=)``,
``tl.reduce``, ``input_precision``) are used; the functions below are jitted lazily per mode by
`hf_posenc.kernels._jit.LazyJit` (see there why). Dots on bfloat16/float16 use the tensor cores with
float32 accumulation; float32 inputs use 3xTF32 dots (tensor cores, about float32 accuracy) unless
``torch.backends.cuda.matmul.allow_tf32`` is set (then TF32). In the interpreter every dot is done in
float32 (its bfloat16 dot is wrong).
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from .._errors import guarded
from .._jit import LazyJit, interpreting
from .._triton_tiles import (
    BIG as _BIG,
    DEVICE_HELPERS,
    INTERPRETER_COMBINES,
    backward_outputs,
    backward_tiles,
    bhld_out,
    dot_precision,
    launch_options,
    mask_args,
    pair_chunks,
    pick_blocks,
    strides,
    window_args,
    window_switches,
)

__all__ = ["SbaFunction", "sba_triton", "REMAINDERS", "interpreting"]

REMAINDERS = {"discard": 0, "current": 1, "bias": 2}

#: a carry above this leaves exp(-carry) < the smallest float32 subnormal: no stick left.
EXHAUSTED = tl.constexpr(110.0)

# Launch parameters (module attributes; benchmarks/bench_sba_cope.py can override them on a GPU).
#: (BLOCK_M, BLOCK_N, num_warps) of the forward / query-major backward / key-major backward on a GPU; the two
#: backward kernels share BLOCK_N (the carry tile). Not timed (no GPU was available): chosen from the sm_90
#: cubins (Triton 3.9, bf16, D = 128), the candidates with the least local-memory spill: forward 64x64 x 8
#: warps (40 B of stack; 4 warps: 1440 B), backward 64x32 x 8 warps (160 B / 24 B; 64x64 x 8: 600 / 416 B).
GPU_FWD = (64, 64, 8)
GPU_BWD_Q = (64, 32, 8)
GPU_BWD_KV = (64, 32, 8)
#: float32 inputs (3xTF32 / TF32 dots, twice the bytes of every tile): (BLOCK_M, BLOCK_N, num_warps) per kernel.
#: See ``hf_posenc.kernels._triton_tiles.pick_blocks`` for where the numbers come from.
#: Measured with hf_posenc.kernels.compile_check (Triton 3.6, sm_90, D = 128, mask, 1 stage; spill stores per
#: thread): forward 64x64 820 B, 64x32 688 B (chosen); query-major backward 64x32 1384 B, 32x32 536 B (chosen);
#: key-major backward 64x32 3400 B (chosen; on sm_80 ptxas falls back to 32 registers: ~21 KB), 32x32
#: 19464 B (32 registers on sm_90 too). Float32 is the correctness path; these spills are known.
GPU_FP32 = {"fwd": (64, 32, 8), "bwd_q": (32, 32, 8), "bwd_kv": (64, 32, 8)}
#: software-pipelining stages of the key loop (``num_stages``; Triton's default is 3 on sm_80/sm_90, and every
#: stage holds one more K and V tile in shared memory), per input class.
NUM_STAGES = {"half": 2, "float32": 1}
#: the same in the interpreter (small tiles: every cross-tile path is exercised by small tests).
INTERPRETER_BLOCKS = (32, 32)
#: at most this many carry checkpoints per query row (and head) in the backward.
CARRY_SLOTS = 64
#: the checkpoint buffers of one chunk of (batch, key/value head) pairs stay under this.
CARRY_BUDGET_BYTES = 256 * 1024 * 1024


# ----------------------------------------------------------------------------------------------------
# helpers (jitted lazily; see the module docstring). The tile-walk helpers shared with the CoPE kernels -- _add,
# _min, _max, _mm, _first_tile, _load_rows, _query_rows, _batch_kv_head, _store_rows, _key_tile,
# _window_and_mask, _store_checkpoint, _query_blocks, _load_checkpoint -- are in hf_posenc/kernels/_triton_tiles.py and bound into this module's globals by _JIT.


def _softplus(z):
    """softplus with the reference's linear branch above 15 (``F.softplus(threshold=15)``)."""
    e = tl.exp(tl.minimum(z, 15.0))
    return tl.where(z > 15.0, z, tl.where(z < -15.0, e, tl.log(1.0 + e)))


def _dsoftplus(z):
    """Its derivative: the sigmoid, 1 above the threshold."""
    return tl.where(z > 15.0, 1.0, 1.0 / (1.0 + tl.exp(-z)))


def _breakpoints(rows, keys, qidx, row_ok, LK, mptr, sm_m, sm_n, WINDOW, SINK, ATTEND_CURRENT: tl.constexpr,
                 HAS_MASK: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINK: tl.constexpr):
    """(BM, BN) bool: key j is a breakpoint of query i (causal by index, the window's band, and the mask)."""
    if ATTEND_CURRENT:
        ok = keys[None, :] <= qidx[:, None]
    else:
        ok = keys[None, :] < qidx[:, None]
    ok = ok & row_ok[:, None] & (keys < LK)[None, :]
    return _window_and_mask(ok, rows, keys, qidx, mptr, sm_m, sm_n, WINDOW, SINK, HAS_MASK, HAS_WINDOW, HAS_SINK)


def _stick(q, k, c, rows, keys, qidx, row_ok, LK, mptr, sm_m, sm_n, scale, WINDOW, SINK,
           ATTEND_CURRENT: tl.constexpr, HAS_MASK: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
           HAS_WINDOW: tl.constexpr, HAS_SINK: tl.constexpr):
    """One tile: logits z, breakpoints, masked softplus, its in-tile suffix sums and the weights A."""
    z = _mm(q, tl.trans(k), PREC, UPCAST) * scale
    brk = _breakpoints(rows, keys, qidx, row_ok, LK, mptr, sm_m, sm_n, WINDOW, SINK, ATTEND_CURRENT, HAS_MASK,
                       HAS_WINDOW, HAS_SINK)
    sp = tl.where(brk, _softplus(z), 0.0)
    suffix = tl.associative_scan(sp, 1, _add, reverse=True)
    a = tl.where(brk, tl.exp(z - suffix - c[:, None]), 0.0)
    return z, brk, sp, suffix, a


# ----------------------------------------------------------------------------------------------------
# forward


def _sba_fwd(
    Q, K, V, O, R, BIAS, M,
    sq_b, sq_h, sq_m, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, so_b, so_h, so_m, sr_b, sr_h, sr_m,
    sm_b, sm_m, sm_n,
    H, G, LQ, LK, Q_OFF_PTR, scale, WINDOW, SINK,
    D: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    ATTEND_CURRENT: tl.constexpr, REMAINDER: tl.constexpr, HAS_MASK: tl.constexpr, SAVE_RES: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINK: tl.constexpr,
):
    Q_OFF = tl.load(Q_OFF_PTR)  # the query offset, a device tensor: never read on the host
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    g = h // G
    rows, row_ok, qidx = _query_rows(pid_m, LQ, Q_OFF, BM)
    offs_d = tl.arange(0, BD)
    d_ok = offs_d < D
    q = _load_rows(Q + b * sq_b + h * sq_h, rows, sq_m, offs_d, row_ok, d_ok)
    k_base = K + b * sk_b + g * sk_h
    v_base = V + b * sv_b + g * sv_h
    m_base = M + b * sm_b

    # the last key any query of the block may break at, and the number of key tiles up to it
    hi = tl.minimum(pid_m * BM + BM, LQ) - 1 + Q_OFF
    if not ATTEND_CURRENT:
        hi = hi - 1
    n_tiles = (hi + BN) // BN
    t_lo = _first_tile(pid_m, Q_OFF, WINDOW, BM, BN, HAS_WINDOW)
    n_walk, n_window, n_sink = _sink_walk(n_tiles, t_lo, SINK, BN, HAS_SINK)  # then the sinks' tiles

    c = tl.where(row_ok, 0.0, _BIG)
    acc = tl.full((BM, BD), 0.0, tl.float32)
    for it in range(0, n_walk):
        t = _walk_tile(it, n_tiles, n_window, n_sink, HAS_SINK)
        if tl.reduce(c, 0, _min) <= EXHAUSTED:
            keys, k_ok, k, v = _key_tile(k_base, v_base, t, sk_n, sv_n, offs_d, d_ok, LK, BN)
            z, brk, sp, suffix, a = _stick(q, k, c, rows, keys, qidx, row_ok, LK, m_base, sm_m, sm_n, scale,
                                           WINDOW, SINK, ATTEND_CURRENT, HAS_MASK, PREC, UPCAST, HAS_WINDOW, HAS_SINK)
            acc += _mm(a.to(v.dtype), v, PREC, UPCAST)
            c = c + tl.reduce(sp, 1, _add)

    if REMAINDER != 0:
        rest = tl.exp(-c)
        if REMAINDER == 1:
            own = _load_rows(v_base, qidx, sv_n, offs_d, row_ok, d_ok).to(tl.float32)
            acc += rest[:, None] * own
        else:
            bias = tl.load(BIAS + h * D + offs_d, mask=d_ok, other=0.0).to(tl.float32)
            acc += rest[:, None] * bias[None, :]
    out = acc.to(O.dtype.element_ty)
    o_mask = row_ok[:, None] & d_ok[None, :]
    o_ptrs = rows[:, None].to(tl.int64) * so_m + offs_d[None, :]
    tl.store(O + b * so_b + h * so_h + o_ptrs, out, mask=o_mask)
    if SAVE_RES:
        r_ptrs = rows[:, None].to(tl.int64) * sr_m + offs_d[None, :]
        tl.store(R + b * sr_b + h * sr_h + r_ptrs, (acc - out.to(tl.float32)).to(R.dtype.element_ty), mask=o_mask)


# ----------------------------------------------------------------------------------------------------
# backward, query-major: dq, T, r and the carry checkpoints


def _sba_bwd_q(
    Q, K, V, O, R, DO, DQ, TT, REST, CK, SK, M,
    sq_b, sq_h, sq_m, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, so_b, so_h, so_m, sr_b, sr_h, sr_m,
    sd_b, sd_h, sd_m, sdq_b, sdq_h, sdq_m, sm_b, sm_m, sm_n,
    H, G, HKV, PAIR0, LQ, LK, Q_OFF_PTR, scale, CSTRIDE, NSLOT, WINDOW, SINK,
    D: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    ATTEND_CURRENT: tl.constexpr, REMAINDER: tl.constexpr, HAS_MASK: tl.constexpr, HAS_RES: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINK: tl.constexpr,
):
    Q_OFF = tl.load(Q_OFF_PTR)  # the query offset, a device tensor: never read on the host
    pid_m = tl.program_id(0)
    lbh = tl.program_id(1)  # (pair, head of the group) within this chunk
    pair = PAIR0 + lbh // G
    b, g = _batch_kv_head(pair, HKV)
    h = g * G + (lbh % G)
    rows, row_ok, qidx = _query_rows(pid_m, LQ, Q_OFF, BM)
    offs_d = tl.arange(0, BD)
    d_ok = offs_d < D
    q = _load_rows(Q + b * sq_b + h * sq_h, rows, sq_m, offs_d, row_ok, d_ok)
    do = _load_rows(DO + b * sd_b + h * sd_h, rows, sd_m, offs_d, row_ok, d_ok)
    o = _load_rows(O + b * so_b + h * so_h, rows, so_m, offs_d, row_ok, d_ok).to(tl.float32)
    if HAS_RES:
        o += _load_rows(R + b * sr_b + h * sr_h, rows, sr_m, offs_d, row_ok, d_ok).to(tl.float32)
    total = tl.reduce(do.to(tl.float32) * o, 1, _add)  # T_i = do_i · o_i (float32 output)
    k_base = K + b * sk_b + g * sk_h
    v_base = V + b * sv_b + g * sv_h
    m_base = M + b * sm_b
    ck_base = CK + lbh.to(tl.int64) * NSLOT * LQ
    sk_base = SK + lbh.to(tl.int64) * NSLOT * LQ

    hi = tl.minimum(pid_m * BM + BM, LQ) - 1 + Q_OFF
    if not ATTEND_CURRENT:
        hi = hi - 1
    n_tiles = (hi + BN) // BN
    t_lo = _first_tile(pid_m, Q_OFF, WINDOW, BM, BN, HAS_WINDOW)  # checkpoints left of it are never read
    n_walk, n_window, n_sink = _sink_walk(n_tiles, t_lo, SINK, BN, HAS_SINK)  # then the sinks' tiles

    c = tl.where(row_ok, 0.0, _BIG)  # Σ sp over the keys right of the tile
    s_g = tl.full((BM,), 0.0, tl.float32)  # Σ g over the keys right of the tile
    dq = tl.full((BM, BD), 0.0, tl.float32)
    for it in range(0, n_walk):
        t = _walk_tile(it, n_tiles, n_window, n_sink, HAS_SINK)
        if HAS_SINK:
            if it == n_window:
                _store_gap_checkpoints(ck_base, sk_base, n_sink, t_lo, CSTRIDE, LQ, rows, row_ok, c, s_g)
        _store_checkpoint(ck_base, sk_base, t, CSTRIDE, LQ, rows, row_ok, c, s_g)
        if tl.reduce(c, 0, _min) <= EXHAUSTED:
            keys, k_ok, k, v = _key_tile(k_base, v_base, t, sk_n, sv_n, offs_d, d_ok, LK, BN)
            z, brk, sp, suffix, a = _stick(q, k, c, rows, keys, qidx, row_ok, LK, m_base, sm_m, sm_n, scale,
                                           WINDOW, SINK, ATTEND_CURRENT, HAS_MASK, PREC, UPCAST, HAS_WINDOW, HAS_SINK)
            gg = a.to(v.dtype).to(tl.float32) * _mm(do, tl.trans(v), PREC, UPCAST)
            g_after = s_g[:, None] + (tl.associative_scan(gg, 1, _add, reverse=True) - gg)
            live = brk & (c[:, None] + (suffix - sp) <= EXHAUSTED)
            pref = tl.where(live, total[:, None] - g_after, 0.0)
            dz = tl.where(brk, gg - _dsoftplus(z) * pref, 0.0)
            dq += _mm(dz.to(k.dtype), k, PREC, UPCAST)
            c = c + tl.reduce(sp, 1, _add)
            s_g = s_g + tl.reduce(gg, 1, _add)

    dq_ptrs = rows[:, None].to(tl.int64) * sdq_m + offs_d[None, :]
    tl.store(DQ + b * sdq_b + h * sdq_h + dq_ptrs, (dq * scale).to(DQ.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])
    bh = (b * H + h) * LQ
    tl.store(TT + bh + rows, total, mask=row_ok)
    if REMAINDER != 0:
        tl.store(REST + bh + rows, tl.exp(-c), mask=row_ok)


# ----------------------------------------------------------------------------------------------------
# backward, key-major: dk and dv


def _sba_bwd_kv(
    Q, K, V, DO, DK, DV, TT, CK, SK, M,
    sq_b, sq_h, sq_m, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, sd_b, sd_h, sd_m,
    sdk_b, sdk_h, sdk_n, sdv_b, sdv_h, sdv_n, sm_b, sm_m, sm_n,
    H, G, HKV, PAIR0, LQ, LK, Q_OFF_PTR, scale, CSTRIDE, NSLOT, WINDOW, SINK,
    D: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    ATTEND_CURRENT: tl.constexpr, HAS_MASK: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SINK: tl.constexpr,
):
    Q_OFF = tl.load(Q_OFF_PTR)  # the query offset, a device tensor: never read on the host
    pid_n = tl.program_id(0)
    lpair = tl.program_id(1)
    pair = PAIR0 + lpair
    b, g = _batch_kv_head(pair, HKV)
    offs_d = tl.arange(0, BD)
    d_ok = offs_d < D
    n_start = pid_n * BN
    k_base = K + b * sk_b + g * sk_h
    v_base = V + b * sv_b + g * sv_h
    m_base = M + b * sm_b
    keys, k_ok, k, v = _key_tile(k_base, v_base, pid_n, sk_n, sv_n, offs_d, d_ok, LK, BN)
    dk = tl.full((BN, BD), 0.0, tl.float32)
    dv = tl.full((BN, BD), 0.0, tl.float32)

    # the query blocks that can see a key of this tile, and the checkpoint at or right of the tile
    m_lo, m_hi = _query_blocks(n_start, LQ, Q_OFF, WINDOW, SINK, BM, BN, HAS_WINDOW, HAS_SINK)
    ckpt = pid_n + (CSTRIDE - 1) - pid_n % CSTRIDE
    for hh in range(0, G):
        h = g * G + hh
        lbh = lpair * G + hh
        ck_base = CK + lbh.to(tl.int64) * NSLOT * LQ
        sk_base = SK + lbh.to(tl.int64) * NSLOT * LQ
        q_base = Q + b * sq_b + h * sq_h
        do_base = DO + b * sd_b + h * sd_h
        bh = (b * H + h) * LQ
        for m in range(m_lo, m_hi):
            rows, row_ok, qidx = _query_rows(m, LQ, Q_OFF, BM)
            sees = row_ok & (qidx >= n_start)
            q = _load_rows(q_base, rows, sq_m, offs_d, row_ok, d_ok)
            do = _load_rows(do_base, rows, sd_m, offs_d, row_ok, d_ok)
            total = tl.load(TT + bh + rows, mask=row_ok, other=0.0)
            c, s_g, start = _load_checkpoint(ck_base, sk_base, ckpt, m, rows, row_ok, qidx, sees, LQ, Q_OFF, CSTRIDE,
                                             BM, BN)
            # advance the carries from the checkpoint over the tiles start, ..., pid_n + 1
            for w in range(0, start - pid_n):
                t = start - w
                if tl.reduce(c, 0, _min) <= EXHAUSTED:
                    wkeys, wk_ok, wk, wv = _key_tile(k_base, v_base, t, sk_n, sv_n, offs_d, d_ok, LK, BN)
                    wz, wbrk, wsp, wsuffix, wa = _stick(q, wk, c, rows, wkeys, qidx, row_ok, LK, m_base, sm_m, sm_n,
                                                        scale, WINDOW, SINK, ATTEND_CURRENT, HAS_MASK, PREC, UPCAST,
                                                        HAS_WINDOW, HAS_SINK)
                    wg = wa.to(wv.dtype).to(tl.float32) * _mm(do, tl.trans(wv), PREC, UPCAST)
                    c = c + tl.reduce(wsp, 1, _add)
                    s_g = s_g + tl.reduce(wg, 1, _add)
            if tl.reduce(c, 0, _min) <= EXHAUSTED:
                z, brk, sp, suffix, a = _stick(q, k, c, rows, keys, qidx, row_ok, LK, m_base, sm_m, sm_n, scale,
                                               WINDOW, SINK, ATTEND_CURRENT, HAS_MASK, PREC, UPCAST, HAS_WINDOW,
                                               HAS_SINK)
                gg = a.to(v.dtype).to(tl.float32) * _mm(do, tl.trans(v), PREC, UPCAST)
                g_after = s_g[:, None] + (tl.associative_scan(gg, 1, _add, reverse=True) - gg)
                live = brk & (c[:, None] + (suffix - sp) <= EXHAUSTED)
                pref = tl.where(live, total[:, None] - g_after, 0.0)
                dz = tl.where(brk, gg - _dsoftplus(z) * pref, 0.0)
                dv += _mm(tl.trans(a).to(do.dtype), do, PREC, UPCAST)
                dk += _mm(tl.trans(dz).to(q.dtype), q, PREC, UPCAST)

    _store_rows(DK + b * sdk_b + g * sdk_h, keys, sdk_n, offs_d, k_ok, d_ok, (dk * scale).to(DK.dtype.element_ty))
    _store_rows(DV + b * sdv_b + g * sdv_h, keys, sdv_n, offs_d, k_ok, d_ok, dv.to(DV.dtype.element_ty))


_JIT = LazyJit(
    globals(),
    [*DEVICE_HELPERS, _softplus, _dsoftplus, _breakpoints, _stick],
    [_sba_fwd, _sba_bwd_q, _sba_bwd_kv],
    INTERPRETER_COMBINES,
)


# ----------------------------------------------------------------------------------------------------
# launchers


def _blocks(kind: str, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of ``kind`` ("fwd", "bwd_q", "bwd_kv") for inputs of ``dtype``:
    `pick_blocks` from this module's launch tables."""
    return pick_blocks(kind, dtype, sys.modules[__name__])


def _forward(q, k, v, mask, bias, scale, q_offset, attend_current, remainder, save_residual, window=None, sink=None):
    b, h, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    bm, bn, warps, stages = _blocks("fwd", q.dtype)
    o = bhld_out(b, h, lq, d, q)
    res = bhld_out(b, h, lq, d, q) if save_residual else o
    m, sm_b, sm_m, sm_n = mask_args(mask, q)
    bias_t = bias.contiguous() if bias is not None else q
    _JIT.bind()
    grid = (triton.cdiv(lq, bm), b * h)
    guarded(_sba_fwd, "sba", {"q": q.shape, "k/v": k.shape}, q.dtype)[grid](
        q, k, v, o, res, bias_t, m, *strides(q, k, v, o, res), sm_b, sm_m, sm_n,
        h, h // hkv, lq, lk, q_offset, scale, *window_args(window, sink),
        D=d, BD=max(16, triton.next_power_of_2(d)), BM=bm, BN=bn,
        ATTEND_CURRENT=attend_current, REMAINDER=REMAINDERS[remainder], HAS_MASK=mask is not None,
        SAVE_RES=save_residual, PREC=dot_precision(q.dtype), UPCAST=interpreting(), **window_switches(window, sink),
        num_warps=warps, num_stages=stages,
    )
    return o, (res if save_residual else None)


def _backward(q, k, v, o, res, do, mask, scale, q_offset, attend_current, remainder, window=None, sink=None):
    b, h, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    groups = h // hkv
    bd = max(16, triton.next_power_of_2(d))
    bn, cstride, nslot, (bm1, warps1, stages1), (bm2, warps2, stages2) = backward_tiles(
        lambda kind: _blocks(kind, q.dtype), lk, CARRY_SLOTS)
    do, dq, dk, dv = backward_outputs(q, k, v, do)
    total = torch.empty((b, h, lq), dtype=torch.float32, device=q.device)
    rest = torch.empty((b, h, lq), dtype=torch.float32, device=q.device) if remainder != "discard" else total
    m, sm_b, sm_m, sm_n = mask_args(mask, q)
    resid = res if res is not None else o
    prec, upcast = dot_precision(q.dtype), interpreting()
    _JIT.bind()
    for pair0, n_pairs in pair_chunks(b * hkv, 2 * 4 * nslot * lq * groups, CARRY_BUDGET_BYTES):
        ck = torch.empty((n_pairs * groups, nslot, lq), dtype=torch.float32, device=q.device)
        sk = torch.empty_like(ck)
        guarded(_sba_bwd_q, "sba", {"q": q.shape, "k/v": k.shape}, q.dtype)[(triton.cdiv(lq, bm1), n_pairs * groups)](
            q, k, v, o, resid, do, dq, total, rest, ck, sk, m, *strides(q, k, v, o, resid, do, dq), sm_b, sm_m, sm_n,
            h, groups, hkv, pair0, lq, lk, q_offset, scale, cstride, nslot, *window_args(window, sink),
            D=d, BD=bd, BM=bm1, BN=bn, ATTEND_CURRENT=attend_current, REMAINDER=REMAINDERS[remainder],
            HAS_MASK=mask is not None, HAS_RES=res is not None, PREC=prec, UPCAST=upcast,
            **window_switches(window, sink), num_warps=warps1, num_stages=stages1,
        )
        guarded(_sba_bwd_kv, "sba", {"q": q.shape, "k/v": k.shape}, q.dtype)[(triton.cdiv(lk, bn), n_pairs)](
            q, k, v, do, dk, dv, total, ck, sk, m, *strides(q, k, v, do, dk, dv), sm_b, sm_m, sm_n,
            h, groups, hkv, pair0, lq, lk, q_offset, scale, cstride, nslot, *window_args(window, sink),
            D=d, BD=bd, BM=bm2, BN=bn, ATTEND_CURRENT=attend_current, HAS_MASK=mask is not None,
            PREC=prec, UPCAST=upcast, **window_switches(window, sink), num_warps=warps2, num_stages=stages2,
        )
    return dq, dk, dv, (rest if remainder != "discard" else None)


class SbaFunction(torch.autograd.Function):
    """Stick-breaking attention with gradients for q, k, v and the remainder bias."""

    @staticmethod
    def forward(ctx, q, k, v, mask, bias, scale, q_offset, attend_current, remainder, window=None, sink=None):
        needs_grad = any(ctx.needs_input_grad[i] for i in (0, 1, 2, 4))
        save_residual = needs_grad and q.dtype != torch.float32
        o, res = _forward(q, k, v, mask, bias, scale, q_offset, attend_current, remainder, save_residual, window,
                          sink)
        if needs_grad:
            ctx.save_for_backward(q, k, v, o, res, mask, bias)
        ctx.args = (scale, q_offset, attend_current, remainder, window, sink)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, res, mask, bias = ctx.saved_tensors
        scale, q_offset, attend_current, remainder, window, sink = ctx.args
        dq, dk, dv, rest = _backward(q, k, v, o, res, do, mask, scale, q_offset, attend_current, remainder, window,
                                     sink)
        dbias = None
        if remainder != "discard":
            b, h, lq, d = q.shape
            hkv = k.shape[1]
            weighted = rest[..., None] * do.float()  # (B, H, Lq, D): r_i do_i
            if remainder == "current":  # o_i += r_i v_{q_i}: dv at the queries' own keys
                own = weighted.view(b, hkv, h // hkv, lq, d).sum(2)
                dv = dv.float()
                dv.index_add_(2, q_offset.long() + torch.arange(lq, device=dv.device), own.to(dv.dtype))
                dv = dv.to(v.dtype)
            elif ctx.needs_input_grad[4]:
                dbias = weighted.sum(dim=(0, 2)).to(bias.dtype)
        return dq, dk, dv, None, dbias, None, None, None, None, None, None


def sba_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
               q_offset: int | torch.Tensor, attend_current: bool = False, remainder: str = "discard",
               bias: torch.Tensor | None = None, window: int | None = None, sink: int | None = None) -> torch.Tensor:
    """Stick-breaking attention with the Triton kernels (inputs validated by the dispatcher,
    `hf_posenc.kernels.sba.stick_breaking`, whose arguments these are): q, k, v with contiguous last dims, one dtype
    of ``hf_posenc.kernels._common.KERNEL_DTYPES``, D <= ``MAX_HEAD_DIM`` (128); ``q_offset`` an int or a
    1-element integer tensor the kernels load; ``window`` and ``sink`` as
    `hf_posenc.kernels._triton_tiles.launch_options` takes them.

    Returns:
        (B, H, Lq, D) in q's dtype (a transposed view of a (B, Lq, H, D) tensor).

    Raises:
        TypeError, ValueError: ``window`` or ``sink`` is not None or an int >= 1, or a sink without a window.
    """
    window, sink, offset = launch_options(window, sink, q_offset, q.device)  # offset: loaded by the kernels
    return SbaFunction.apply(q, k, v, mask, bias, float(scale), offset, bool(attend_current), remainder, window,
                             sink)
