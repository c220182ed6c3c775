"""Triton kernels of CoPE attention (causal; forward and backward), their launchers and autograd Function.

Math (``naive.py`` and ``hf_posenc/encodings/cope.py``): for query i (key index q_i = q_offset + i) and the
keys j <= q_i the mask allows, with s the logit scale and e the (D, npos) table::

    w_ij = s q_i·k_j,  g_ij = σ(w_ij) (0 off the allowed keys),  p_ij = min(Σ_{k=j..q_i} g_ik, npos - 1)
    z_i  = q_i e  (npos entries),  pos_ij = (p - ⌊p⌋) z_i[⌈p⌉] + (1 - p + ⌊p⌋) z_i[⌊p⌋]
    o_i  = softmax_j(w_ij + pos_ij) v

Forward (``_cope_fwd``; grid: query blocks x (batch, head)). A program owns BM queries of one head, computes
their table z = q·e (BM x npos, float32, exact float32 dot) once and keeps it in registers, and walks the
key tiles from the diagonal backwards carrying, per query, the gate mass of the keys already walked
(float32). In a tile: w = s q kᵀ, the gates, their in-tile suffix sums (a reversed ``associative_scan``,
made exactly monotone by a reversed running max so that ⌊p⌋ never increases along the keys), p = carry +
suffix clamped to npos - 1, the two table entries by ``tl.gather`` and their interpolation, then the
online softmax (running max and sum per query, rescaled accumulator) with the position logit inside.
Once every query of the block has a carry >= npos - 1, all further positions are clamped: the tile uses
z_i[npos - 1] and skips the scans and gathers. Extra memory: the log-sum-exp per query (O(L·H)).

Backward. With dS = P ⊙ (dP - δ) (dP = do vᵀ, δ_i = do_i·o_i) the logit gradient is

    dw_ij = dS_ij + σ'(w_ij) Σ_{j' <= j} dp_ij',   dp_ij = dS_ij (z_i[⌈p⌉] - z_i[⌊p⌋]) [p_ij < npos - 1]
    dz_i[t] = Σ_j dS_ij tent(p_ij - t)                       (the interpolation weights, scattered)
    dq_i = s Σ_j dw_ij k_j + e dz_i,   de = Σ_i q_i ⊗ dz_i,   dk_j = s Σ_i dw_ij q_i,   dv_j = Σ_i P_ij do_i

Σ_{j' <= j} dp is a prefix from the far end of the row: a walk from the diagonal gets it as
Dp_i - Σ_{j' > j} dp with the row total Dp_i = Σ_j dp_ij, which is non-zero only inside the row's
"window" (p < npos - 1); outside it the prefix is exactly 0 (p is monotone, so every dp to the left is 0).

* ``_cope_bwd_q`` (query-major, a program per query block and head): a first walk over the window tiles
  only (until every query of the block is clamped) gives Dp_i; the main walk accumulates dq in registers
  and the table gradient dz in a (BM, npos) register tile. Scattering dS·(1 - frac) to ⌊p⌋ and dS·frac
  to ⌊p⌋ + 1 needs no atomics: ⌊p⌋ is non-increasing along the keys of a row, so the keys with ⌊p⌋ >= t
  are a prefix of the tile, found by a binary search (log2(BN) + 1 gathers of a (BM, npos) index), and
  the sum over them is a gather of the prefix sums of the weights; the bin sums are the differences over
  t. Clamped tiles add Σ_j dS_ij to z_i[npos - 1] only. At the end of the block dq += dz eᵀ in-kernel,
  and dz (BM, npos) is written out once: the table gradient de = Σ_i q_i ⊗ dz_i is one float32 GEMM in
  PyTorch per chunk (a reduction with no atomics; an in-kernel per-program accumulator cost registers:
  the sm_90 cubin spilled ~0.6 KB more per thread). It also writes z (for the key-major kernel), δ, Dp,
  z[npos - 1] and, every ``CSTRIDE``-th key tile, the carries (gate mass, Σ dp) at the right edge of that
  tile ("checkpoints", at most ``CARRY_SLOTS`` per row: O(L·H·CARRY_SLOTS) memory, never O(L²)).
* ``_cope_bwd_kv`` (key-major; GQA groups reduced in registers): as the sba kernel, the carries at the
  right edge of the program's tile come from the nearest checkpoint at or right of it, advanced over the
  (at most ``CSTRIDE - 1``) tiles in between; a pair whose queries are all clamped is plain attention
  with the per-query bias z_i[npos - 1]. dk, dv accumulated in registers and written once.

The carry checkpoints, z and dz are allocated per chunk of (batch, key/value head) pairs within
``CARRY_BUDGET_BYTES``: extra memory O(L·H·(npos + CARRY_SLOTS)). Only builtins of ``triton.language`` and
Triton >= 3.3 features (``tl.gather``, ``tl.associative_scan(reverse=)``, ``tl.reduce``) are used; the
functions are jitted lazily per mode (see ``hf_posenc.kernels._jit``). Bidirectional (ViT) CoPE is not done in-kernel: see the dispatcher.
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

__all__ = ["CopeFunction", "cope_triton", "interpreting"]

_NEG_INF = tl.constexpr(float("-inf"))
_POS_INF = tl.constexpr(float("inf"))

# Launch parameters (module attributes; benchmarks/bench_sba_cope.py can override them on a GPU).
#: (BLOCK_M, BLOCK_N, num_warps) of the forward / query-major backward / key-major backward on a GPU; the two
#: backward kernels share BLOCK_N. Not timed (no GPU was available): chosen from the sm_90 cubins (Triton 3.9,
#: bf16, D = 128, npos 64) by local-memory spill per thread: forward 64x64 x 8 warps 104 B (4 warps: 936 B);
#: key-major backward 64x32 x 8 warps 8 B; the query-major backward spills in every candidate tried
#: (64x32 x 8: 800 B; 4 warps: 1.7-2.7 KB) -- the first thing to tune on a GPU.
GPU_FWD = (64, 64, 8)
GPU_BWD_Q = (64, 32, 8)
GPU_BWD_KV = (64, 32, 8)
#: float32 inputs (3xTF32 / TF32 dots, twice the bytes of every tile): (BLOCK_M, BLOCK_N, num_warps) per kernel.
#: See ``hf_posenc.kernels._triton_tiles.pick_blocks`` for where the numbers come from.
#: Measured with hf_posenc.kernels.compile_check (Triton 3.6, sm_90, D = 128, npos 64, mask; shared memory,
#: spill stores per thread): at 3 stages (Triton's default, before) the forward needed 240-256 KiB and the
#: query-major backward 384 KiB on sm_90 (over the 227 KiB limit); at 1 stage forward 64x64 65536 B / 2056 B,
#: 64x32 98304 B / 1112 B (chosen); backward 64x32 x 8 warps 131072 B / 4352 B (query-major) and
#: 163840 B / 3564 B (key-major), chosen over 32x32 x 4 or 8 warps, which fall back to 32 registers and
#: spill 19-25 KB per thread.
GPU_FP32 = {"fwd": (64, 32, 8), "bwd_q": (64, 32, 8), "bwd_kv": (64, 32, 8)}
#: software-pipelining stages of the key loop (``num_stages``; Triton's default is 3 on sm_80/sm_90, and every
#: stage holds one more K and V tile in shared memory), per input class.
NUM_STAGES = {"half": 2, "float32": 1}
INTERPRETER_BLOCKS = (32, 32)
CARRY_SLOTS = 64
CARRY_BUDGET_BYTES = 256 * 1024 * 1024


# ----------------------------------------------------------------------------------------------------
# helpers


# (the tile-walk helpers shared with the stick-breaking kernels -- _add, _min, _max, _mm, _first_tile,
# _load_rows, _query_rows, _batch_kv_head, _store_rows, _key_tile, _window_and_mask, _store_checkpoint,
# _query_blocks, _load_checkpoint -- are in hf_posenc/kernels/_triton_tiles.py and bound into this module's
# globals by _JIT)


def _allowed(rows, keys, qidx, row_ok, LK, mptr, sm_m, sm_n, WINDOW, SINK, HAS_MASK: tl.constexpr,
             HAS_WINDOW: tl.constexpr, HAS_SINK: tl.constexpr):
    """(BM, BN) bool: causal by index, the window's band and the mask (a key outside either adds no gate)."""
    ok = (keys[None, :] <= qidx[:, None]) & row_ok[:, None] & (keys < LK)[None, :]
    return _window_and_mask(ok, rows, keys, qidx, mptr, sm_m, sm_n, WINDOW, SINK, HAS_MASK, HAS_WINDOW, HAS_SINK)


def _logits_gates(q, k, rows, keys, qidx, row_ok, LK, mptr, sm_m, sm_n, scale, WINDOW, SINK,
                  HAS_MASK: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, HAS_WINDOW: tl.constexpr,
                  HAS_SINK: tl.constexpr):
    w = _mm(q, tl.trans(k), PREC, UPCAST) * scale
    ok = _allowed(rows, keys, qidx, row_ok, LK, mptr, sm_m, sm_n, WINDOW, SINK, HAS_MASK, HAS_WINDOW, HAS_SINK)
    gate = tl.where(ok, 1.0 / (1.0 + tl.exp(-w)), 0.0)
    return w, ok, gate


def _positions(gate, carry, zq, npm1, MONO: tl.constexpr):
    """Clamped positions p, ⌊p⌋ (int32), frac, z[⌊p⌋], z[⌈p⌉] of one tile."""
    suffix = tl.associative_scan(gate, 1, _add, reverse=True)
    if MONO:  # a parallel scan may break monotonicity by an ulp; the interpreter's numpy cumsum cannot
        suffix = tl.associative_scan(suffix, 1, _max, reverse=True)  # exactly non-increasing along the keys
    p = tl.minimum(carry[:, None] + suffix, npm1)
    f = tl.floor(p)
    fi = f.to(tl.int32)
    ci = tl.ceil(p).to(tl.int32)
    frac = p - f
    zf = tl.gather(zq, fi, 1)
    zc = tl.gather(zq, ci, 1)
    return p, fi, frac, zf, zc


def _dp_tile(q, do, lse, delta, carry, zq, npm1, k_base, v_base, t, sk_n, sv_n, offs_d, d_ok, rows, qidx, row_ok, LK,
             mptr, sm_m, sm_n, scale, WINDOW, SINK, BN: tl.constexpr, HAS_MASK: tl.constexpr, PREC: tl.constexpr,
             UPCAST: tl.constexpr, MONO: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINK: tl.constexpr):
    """Key tile ``t`` of a backward walk that only carries sums (the query-major kernel's first walk, the key-major
    kernel's advance from a checkpoint): (Σ_j dp_ij, Σ_j g_ij) over its keys, (BM,) each."""
    keys, k_ok, k, v = _key_tile(k_base, v_base, t, sk_n, sv_n, offs_d, d_ok, LK, BN)
    w, ok, gate = _logits_gates(q, k, rows, keys, qidx, row_ok, LK, mptr, sm_m, sm_n, scale, WINDOW, SINK, HAS_MASK,
                                PREC, UPCAST, HAS_WINDOW, HAS_SINK)
    p, fi, frac, zf, zc = _positions(gate, carry, zq, npm1, MONO)
    prob = tl.exp(tl.where(ok, w + frac * zc + (1.0 - frac) * zf, _NEG_INF) - lse[:, None])
    ds = prob * (_mm(do, tl.trans(v), PREC, UPCAST) - delta[:, None])
    dp = tl.where(ok & (p < npm1), ds * (zc - zf), 0.0)
    return tl.reduce(dp, 1, _add), tl.reduce(gate, 1, _add)


def _table(E, offs_d, d_ok, tcol, NPOS, se_d, se_t):
    """The (BD, NP) float32 table, zero-padded."""
    return tl.load(E + offs_d[:, None].to(tl.int64) * se_d + tcol[None, :].to(tl.int64) * se_t,
                   mask=d_ok[:, None] & (tcol < NPOS)[None, :], other=0.0).to(tl.float32)


def _bins(wa, wb, fi, BM: tl.constexpr, BN: tl.constexpr, NP: tl.constexpr, LOG2_BN: tl.constexpr):
    """out[i, t] = Σ_j wa_ij [fi_ij == t] + wb_ij [fi_ij + 1 == t], for fi non-increasing along j."""
    tcol = tl.arange(0, NP)[None, :] + tl.full((BM, NP), 0, tl.int32)
    # cnt[i, t] = #{j : fi_ij >= t}: those keys are the first cnt of the row (binary search).
    cnt = tl.full((BM, NP), 0, tl.int32)
    step = tl.program_id(0) * 0 + BN // 2  # a runtime int32 (loop-carried)
    for _ in range(0, LOG2_BN):
        probe = tl.gather(fi, cnt + (step - 1), 1)
        cnt = tl.where(probe >= tcol, cnt + step, cnt)
        step = step // 2
    last = tl.gather(fi, tl.full((BM, NP), BN - 1, tl.int32), 1)
    cnt = tl.where((cnt == BN - 1) & (last >= tcol), BN, cnt)
    at = tl.maximum(cnt - 1, 0)
    ca = tl.where(cnt > 0, tl.gather(tl.associative_scan(wa, 1, _add), at, 1), 0.0)  # Σ_{fi >= t} wa
    cb = tl.where(cnt > 0, tl.gather(tl.associative_scan(wb, 1, _add), at, 1), 0.0)  # Σ_{fi >= t} wb
    ca_next = tl.where(tcol < NP - 1, tl.gather(ca, tl.minimum(tcol + 1, NP - 1), 1), 0.0)
    cb_prev = tl.gather(cb, tl.maximum(tcol - 1, 0), 1)  # t = 0: cb itself (no key has fi + 1 == 0)
    return (ca - ca_next) + (cb_prev - cb)


# ----------------------------------------------------------------------------------------------------
# forward


def _cope_fwd(
    Q, K, V, E, O, LSE, M,
    sq_b, sq_h, sq_m, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, so_b, so_h, so_m, se_d, se_t, sm_b, sm_m, sm_n,
    H, G, LQ, LK, Q_OFF_PTR, scale, NPOS, WINDOW, SINK,
    D: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, NP: tl.constexpr,
    HAS_MASK: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, MONO: tl.constexpr, TPREC: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SINK: tl.constexpr,
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
    tcol = tl.arange(0, NP)
    npm1 = NPOS - 1.0
    q = _load_rows(Q + b * sq_b + h * sq_h, rows, sq_m, offs_d, row_ok, d_ok)
    zq = tl.dot(q.to(tl.float32), _table(E, offs_d, d_ok, tcol, NPOS, se_d, se_t), input_precision=TPREC)
    zlast = tl.reduce(tl.where(tcol[None, :] == NPOS - 1, zq, 0.0), 1, _add)
    k_base = K + b * sk_b + g * sk_h
    v_base = V + b * sv_b + g * sv_h
    m_base = M + b * sm_b

    hi = tl.minimum(pid_m * BM + BM, LQ) - 1 + Q_OFF
    t_lo = _first_tile(pid_m, Q_OFF, WINDOW, BM, BN, HAS_WINDOW)  # tiles left of the window: never visited
    n_tiles = (hi + BN) // BN
    n_walk, n_window, n_sink = _sink_walk(n_tiles, t_lo, SINK, BN, HAS_SINK)  # then the sinks' tiles
    carry = tl.where(row_ok, 0.0, _BIG)
    m_i = tl.full((BM,), _NEG_INF, tl.float32)
    l_i = tl.full((BM,), 0.0, tl.float32)
    acc = tl.full((BM, BD), 0.0, tl.float32)
    for it in range(0, n_walk):
        t = _walk_tile(it, n_tiles, n_window, n_sink, HAS_SINK)
        keys, k_ok, k, v = _key_tile(k_base, v_base, t, sk_n, sv_n, offs_d, d_ok, LK, BN)
        w, ok, gate = _logits_gates(q, k, rows, keys, qidx, row_ok, LK, m_base, sm_m, sm_n, scale,
                                    WINDOW, SINK, HAS_MASK, PREC, UPCAST, HAS_WINDOW, HAS_SINK)
        if tl.reduce(carry, 0, _min) >= npm1:  # every position clamped: z[npos - 1]
            pos = zlast[:, None] + tl.full((BM, BN), 0.0, tl.float32)
        else:
            p, fi, frac, zf, zc = _positions(gate, carry, zq, npm1, MONO)
            pos = frac * zc + (1.0 - frac) * zf
        s = tl.where(ok, w + pos, _NEG_INF)
        m_new = tl.maximum(m_i, tl.reduce(s, 1, _max))
        m_safe = tl.where(m_new == _NEG_INF, 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        pexp = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.reduce(pexp, 1, _add)
        acc = acc * alpha[:, None] + _mm(pexp.to(v.dtype), v, PREC, UPCAST)
        m_i = m_new
        carry = carry + tl.reduce(gate, 1, _add)

    has = l_i > 0.0
    out = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
    o_ptrs = rows[:, None].to(tl.int64) * so_m + offs_d[None, :]
    tl.store(O + b * so_b + h * so_h + o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), _POS_INF)  # +inf: a fully masked row, P = 0
    tl.store(LSE + (b * H + h) * LQ + rows, lse, mask=row_ok)


# ----------------------------------------------------------------------------------------------------
# backward, query-major: dq, the table gradient, and what the key-major kernel needs


def _cope_bwd_q(
    Q, K, V, E, O, DO, LSE, DQ, DZQ, ZQB, ZL, DELTA, DTOT, GK, SK, M,
    sq_b, sq_h, sq_m, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, so_b, so_h, so_m, sd_b, sd_h, sd_m,
    sdq_b, sdq_h, sdq_m, se_d, se_t, sm_b, sm_m, sm_n,
    H, G, HKV, PAIR0, LQ, LK, Q_OFF_PTR, scale, NPOS, CSTRIDE, NSLOT, WINDOW, SINK,
    D: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, NP: tl.constexpr,
    LOG2_BN: tl.constexpr, HAS_MASK: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, MONO: tl.constexpr,
    TPREC: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINK: tl.constexpr,
):
    Q_OFF = tl.load(Q_OFF_PTR)  # the query offset, a device tensor: never read on the host
    mb = tl.program_id(0)
    lbh = tl.program_id(1)
    pair = PAIR0 + lbh // G
    b, g = _batch_kv_head(pair, HKV)
    h = g * G + (lbh % G)
    offs_d = tl.arange(0, BD)
    d_ok = offs_d < D
    tcol = tl.arange(0, NP)
    npm1 = NPOS - 1.0
    k_base = K + b * sk_b + g * sk_h
    v_base = V + b * sv_b + g * sv_h
    m_base = M + b * sm_b
    bh = (b * H + h) * LQ
    gk_base = GK + lbh.to(tl.int64) * NSLOT * LQ
    sk_base = SK + lbh.to(tl.int64) * NSLOT * LQ
    zq_base = ZQB + lbh.to(tl.int64) * LQ * NP
    dzq_base = DZQ + lbh.to(tl.int64) * LQ * NP
    rows, row_ok, qidx = _query_rows(mb, LQ, Q_OFF, BM)
    q = _load_rows(Q + b * sq_b + h * sq_h, rows, sq_m, offs_d, row_ok, d_ok)
    do = _load_rows(DO + b * sd_b + h * sd_h, rows, sd_m, offs_d, row_ok, d_ok)
    o = _load_rows(O + b * so_b + h * so_h, rows, so_m, offs_d, row_ok, d_ok)
    delta = tl.reduce(do.to(tl.float32) * o.to(tl.float32), 1, _add)
    lse = tl.load(LSE + bh + rows, mask=row_ok, other=_POS_INF)
    q32 = q.to(tl.float32)
    # the table is re-read (from L2) where it is used rather than held in registers across the walks
    zq = tl.dot(q32, _table(E, offs_d, d_ok, tcol, NPOS, se_d, se_t), input_precision=TPREC)
    zlast = tl.reduce(tl.where(tcol[None, :] == NPOS - 1, zq, 0.0), 1, _add)
    tl.store(zq_base + rows[:, None].to(tl.int64) * NP + tcol[None, :], zq, mask=row_ok[:, None])
    tl.store(ZL + bh + rows, zlast, mask=row_ok)
    tl.store(DELTA + bh + rows, delta, mask=row_ok)
    hi = tl.minimum(mb * BM + BM, LQ) - 1 + Q_OFF
    n_tiles = (hi + BN) // BN
    t_lo = _first_tile(mb, Q_OFF, WINDOW, BM, BN, HAS_WINDOW)  # checkpoints left of it are never read
    n_walk, n_window, n_sink = _sink_walk(n_tiles, t_lo, SINK, BN, HAS_SINK)  # then the sinks' tiles

    # first walk, over the window tiles: the row totals Dp = Σ_j dp_ij
    carry = tl.where(row_ok, 0.0, _BIG)
    dtot = tl.full((BM,), 0.0, tl.float32)
    for it in range(0, n_walk):
        t = _walk_tile(it, n_tiles, n_window, n_sink, HAS_SINK)
        if tl.reduce(carry, 0, _min) < npm1:
            dp_sum, gate_sum = _dp_tile(q, do, lse, delta, carry, zq, npm1, k_base, v_base, t, sk_n, sv_n, offs_d,
                                        d_ok, rows, qidx, row_ok, LK, m_base, sm_m, sm_n, scale, WINDOW, SINK, BN,
                                        HAS_MASK, PREC, UPCAST, MONO, HAS_WINDOW, HAS_SINK)
            dtot = dtot + dp_sum
            carry = carry + gate_sum
    tl.store(DTOT + bh + rows, dtot, mask=row_ok)

    # main walk
    carry = tl.where(row_ok, 0.0, _BIG)
    s_dp = tl.full((BM,), 0.0, tl.float32)
    dq = tl.full((BM, BD), 0.0, tl.float32)
    dzq = tl.full((BM, NP), 0.0, tl.float32)
    for it in range(0, n_walk):
        t = _walk_tile(it, n_tiles, n_window, n_sink, HAS_SINK)
        if HAS_SINK:
            if it == n_window:
                _store_gap_checkpoints(gk_base, sk_base, n_sink, t_lo, CSTRIDE, LQ, rows, row_ok, carry, s_dp)
        _store_checkpoint(gk_base, sk_base, t, CSTRIDE, LQ, rows, row_ok, carry, s_dp)
        keys, k_ok, k, v = _key_tile(k_base, v_base, t, sk_n, sv_n, offs_d, d_ok, LK, BN)
        w, ok, gate = _logits_gates(q, k, rows, keys, qidx, row_ok, LK, m_base, sm_m, sm_n, scale,
                                    WINDOW, SINK, HAS_MASK, PREC, UPCAST, HAS_WINDOW, HAS_SINK)
        dprob = _mm(do, tl.trans(v), PREC, UPCAST) - delta[:, None]
        if tl.reduce(carry, 0, _min) >= npm1:
            ds = tl.exp(tl.where(ok, w + zlast[:, None], _NEG_INF) - lse[:, None]) * dprob
            dw = ds
            dzq += tl.where(tcol[None, :] == NPOS - 1, tl.reduce(ds, 1, _add)[:, None], 0.0)
        else:
            p, fi, frac, zf, zc = _positions(gate, carry, zq, npm1, MONO)
            ds = tl.exp(tl.where(ok, w + frac * zc + (1.0 - frac) * zf, _NEG_INF) - lse[:, None]) * dprob
            win = ok & (p < npm1)
            dp = tl.where(win, ds * (zc - zf), 0.0)
            dp_after = tl.associative_scan(dp, 1, _add, reverse=True) - dp
            prefix = tl.where(win, dtot[:, None] - s_dp[:, None] - dp_after, 0.0)
            dw = ds + gate * (1.0 - gate) * prefix
            dzq += _bins(ds * (1.0 - frac), ds * frac, fi, BM, BN, NP, LOG2_BN)
            s_dp = s_dp + tl.reduce(dp, 1, _add)
        dq += _mm(dw.to(k.dtype), k, PREC, UPCAST)
        carry = carry + tl.reduce(gate, 1, _add)

    table = _table(E, offs_d, d_ok, tcol, NPOS, se_d, se_t)
    dq = dq * scale + tl.dot(dzq, tl.trans(table), input_precision=TPREC)
    dq_ptrs = rows[:, None].to(tl.int64) * sdq_m + offs_d[None, :]
    tl.store(DQ + b * sdq_b + h * sdq_h + dq_ptrs, dq.to(DQ.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(dzq_base + rows[:, None].to(tl.int64) * NP + tcol[None, :], dzq, mask=row_ok[:, None])


# ----------------------------------------------------------------------------------------------------
# backward, key-major: dk and dv


def _cope_bwd_kv(
    Q, K, V, DO, DK, DV, LSE, ZQB, ZL, DELTA, DTOT, GK, SK, M,
    sq_b, sq_h, sq_m, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, sd_b, sd_h, sd_m,
    sdk_b, sdk_h, sdk_n, sdv_b, sdv_h, sdv_n, sm_b, sm_m, sm_n,
    H, G, HKV, PAIR0, LQ, LK, Q_OFF_PTR, scale, NPOS, CSTRIDE, NSLOT, WINDOW, SINK,
    D: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, NP: tl.constexpr,
    HAS_MASK: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, MONO: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SINK: tl.constexpr,
):
    Q_OFF = tl.load(Q_OFF_PTR)  # the query offset, a device tensor: never read on the host
    pid_n = tl.program_id(0)
    lpair = tl.program_id(1)
    pair = PAIR0 + lpair
    b, g = _batch_kv_head(pair, HKV)
    offs_d = tl.arange(0, BD)
    d_ok = offs_d < D
    tcol = tl.arange(0, NP)
    npm1 = NPOS - 1.0
    n_start = pid_n * BN
    k_base = K + b * sk_b + g * sk_h
    v_base = V + b * sv_b + g * sv_h
    m_base = M + b * sm_b
    keys, k_ok, k, v = _key_tile(k_base, v_base, pid_n, sk_n, sv_n, offs_d, d_ok, LK, BN)
    dk = tl.full((BN, BD), 0.0, tl.float32)
    dv = tl.full((BN, BD), 0.0, tl.float32)

    m_lo, m_hi = _query_blocks(n_start, LQ, Q_OFF, WINDOW, SINK, BM, BN, HAS_WINDOW, HAS_SINK)
    ckpt = pid_n + (CSTRIDE - 1) - pid_n % CSTRIDE
    for hh in range(0, G):
        h = g * G + hh
        lbh = lpair * G + hh
        gk_base = GK + lbh.to(tl.int64) * NSLOT * LQ
        sk_base = SK + lbh.to(tl.int64) * NSLOT * LQ
        zq_base = ZQB + lbh.to(tl.int64) * LQ * NP
        q_base = Q + b * sq_b + h * sq_h
        do_base = DO + b * sd_b + h * sd_h
        bh = (b * H + h) * LQ
        for m in range(m_lo, m_hi):
            rows, row_ok, qidx = _query_rows(m, LQ, Q_OFF, BM)
            sees = row_ok & (qidx >= n_start)
            q = _load_rows(q_base, rows, sq_m, offs_d, row_ok, d_ok)
            do = _load_rows(do_base, rows, sd_m, offs_d, row_ok, d_ok)
            lse = tl.load(LSE + bh + rows, mask=row_ok, other=_POS_INF)
            delta = tl.load(DELTA + bh + rows, mask=row_ok, other=0.0)
            dtot = tl.load(DTOT + bh + rows, mask=row_ok, other=0.0)
            zlast = tl.load(ZL + bh + rows, mask=row_ok, other=0.0)
            carry, s_dp, start = _load_checkpoint(gk_base, sk_base, ckpt, m, rows, row_ok, qidx, sees, LQ, Q_OFF,
                                                  CSTRIDE, BM, BN)
            zq = tl.full((BM, NP), 0.0, tl.float32)
            if tl.reduce(carry, 0, _min) < npm1:
                zq = tl.load(zq_base + rows[:, None].to(tl.int64) * NP + tcol[None, :], mask=row_ok[:, None], other=0.0)
            # advance the carries from the checkpoint over the tiles start, ..., pid_n + 1
            for wi in range(0, start - pid_n):
                t = start - wi
                if tl.reduce(carry, 0, _min) < npm1:
                    dp_sum, gate_sum = _dp_tile(q, do, lse, delta, carry, zq, npm1, k_base, v_base, t, sk_n, sv_n,
                                                offs_d, d_ok, rows, qidx, row_ok, LK, m_base, sm_m, sm_n, scale, WINDOW,
                                                SINK, BN, HAS_MASK, PREC, UPCAST, MONO, HAS_WINDOW, HAS_SINK)
                    s_dp = s_dp + dp_sum
                    carry = carry + gate_sum
            w, ok, gate = _logits_gates(q, k, rows, keys, qidx, row_ok, LK, m_base, sm_m, sm_n, scale,
                                        WINDOW, SINK, HAS_MASK, PREC, UPCAST, HAS_WINDOW, HAS_SINK)
            dprob = _mm(do, tl.trans(v), PREC, UPCAST) - delta[:, None]
            if tl.reduce(carry, 0, _min) >= npm1:
                prob = tl.exp(tl.where(ok, w + zlast[:, None], _NEG_INF) - lse[:, None])
                dw = prob * dprob
            else:
                p, fi, frac, zf, zc = _positions(gate, carry, zq, npm1, MONO)
                prob = tl.exp(tl.where(ok, w + frac * zc + (1.0 - frac) * zf, _NEG_INF) - lse[:, None])
                ds = prob * dprob
                win = ok & (p < npm1)
                dp = tl.where(win, ds * (zc - zf), 0.0)
                dp_after = tl.associative_scan(dp, 1, _add, reverse=True) - dp
                prefix = tl.where(win, dtot[:, None] - s_dp[:, None] - dp_after, 0.0)
                dw = ds + gate * (1.0 - gate) * prefix
            dv += _mm(tl.trans(prob).to(do.dtype), do, PREC, UPCAST)
            dk += _mm(tl.trans(dw).to(q.dtype), q, PREC, UPCAST)

    _store_rows(DK + b * sdk_b + g * sdk_h, keys, sdk_n, offs_d, k_ok, d_ok, (dk * scale).to(DK.dtype.element_ty))
    _store_rows(DV + b * sdv_b + g * sdv_h, keys, sdv_n, offs_d, k_ok, d_ok, dv.to(DV.dtype.element_ty))


_JIT = LazyJit(
    globals(),
    [*DEVICE_HELPERS, _allowed, _logits_gates, _positions, _dp_tile, _table, _bins],
    [_cope_fwd, _cope_bwd_q, _cope_bwd_kv],
    INTERPRETER_COMBINES,
)


# ----------------------------------------------------------------------------------------------------
# launchers


def _table_precision(dtype: torch.dtype) -> str:
    """The position-table dots (z = q e, dq += dz eᵀ, de += qᵀ dz) take float32 operands. For half-precision
    inputs TF32: q (bf16/fp16) is exact in TF32, e and dz are rounded to 10 mantissa bits (2^-11, well below
    the 2^-9 rounding of the bf16 outputs); 3xTF32 (about float32) for float32 inputs, where it costs
    registers (sm_90 cubin, D = 128: about 1.2 KB of spill per thread in the query-major backward)."""
    if interpreting():
        return "ieee"
    return "tf32x3" if dtype == torch.float32 else "tf32"


def _blocks(kind: str, dtype: torch.dtype, npos: int = 64) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of ``kind`` ("fwd", "bwd_q", "bwd_kv") for inputs of ``dtype``:
    `pick_blocks` from this module's launch tables, BLOCK_M smaller for float32 tables of more than 64 positions."""
    bm, bn, warps, stages = pick_blocks(kind, dtype, sys.modules[__name__])
    if dtype == torch.float32 and not interpreting():
        # the (BM, NP) float32 table tiles grow with npos: at NP = 256 and BM = 64 the forward needed 256 KiB and
        # the query-major backward 384 KiB of shared memory on sm_90 (Triton 3.6); halve BM per doubling of NP.
        # At NP = 256, BM = 16 (compile_check, Triton 3.6, D = 128): forward 131072 B, query-major backward
        # 139264 B, key-major 98304 B on sm_90 and sm_80; spill stores 724 / 2908 / 1084 B per thread (sm_90).
        bm = max(16, bm * 64 // max(64, _np(npos)))
    return bm, bn, warps, stages


def _np(npos: int) -> int:
    return max(16, triton.next_power_of_2(npos))


def _forward(q, k, v, table, mask, scale, q_offset, window=None, sink=None):
    b, h, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    npos = table.shape[1]
    bm, bn, warps, stages = _blocks("fwd", q.dtype, npos)
    o = bhld_out(b, h, lq, d, q)
    lse = torch.empty((b, h, lq), dtype=torch.float32, device=q.device)
    m, sm_b, sm_m, sm_n = mask_args(mask, q)
    _JIT.bind()
    shapes = {"q": q.shape, "k/v": k.shape, "table": table.shape}
    guarded(_cope_fwd, "cope", shapes, q.dtype)[(triton.cdiv(lq, bm), b * h)](
        q, k, v, table, o, lse, m, *strides(q, k, v, o), table.stride(0), table.stride(1), sm_b, sm_m, sm_n,
        h, h // hkv, lq, lk, q_offset, scale, npos, *window_args(window, sink),
        D=d, BD=max(16, triton.next_power_of_2(d)), BM=bm, BN=bn, NP=_np(npos), HAS_MASK=mask is not None,
        PREC=dot_precision(q.dtype), UPCAST=interpreting(), MONO=not interpreting(), TPREC=_table_precision(q.dtype),
        **window_switches(window, sink), num_warps=warps, num_stages=stages,
    )
    return o, lse


def _backward(q, k, v, table, o, lse, do, mask, scale, q_offset, window=None, sink=None):
    b, h, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    groups = h // hkv
    npos = table.shape[1]
    np_ = _np(npos)
    bd = max(16, triton.next_power_of_2(d))
    bn, cstride, nslot, (bm1, warps1, stages1), (bm2, warps2, stages2) = backward_tiles(
        lambda kind: _blocks(kind, q.dtype, npos), lk, CARRY_SLOTS)
    do, dq, dk, dv = backward_outputs(q, k, v, do)
    rows = torch.empty((4, b, h, lq), dtype=torch.float32, device=q.device)
    zl, delta, dtot = rows[0], rows[1], rows[2]
    m, sm_b, sm_m, sm_n = mask_args(mask, q)
    prec, upcast = dot_precision(q.dtype), interpreting()
    n_mblocks = triton.cdiv(lq, bm1)
    dtable = torch.zeros((d, npos), dtype=torch.float32, device=q.device)
    # (B*Hkv, G, Lq, D): the query heads of each (batch, key/value head) pair, for the table gradient
    q_pairs = q.unflatten(1, (hkv, groups)).flatten(0, 1)
    _JIT.bind()
    shapes = {"q": q.shape, "k/v": k.shape, "table": table.shape}
    per_pair = groups * 4 * lq * (2 * nslot + 2 * np_ + d)
    for pair0, n_pairs in pair_chunks(b * hkv, per_pair, CARRY_BUDGET_BYTES):
        nbh = n_pairs * groups
        gk = torch.empty((nbh, nslot, lq), dtype=torch.float32, device=q.device)
        sk = torch.empty_like(gk)
        zqb = torch.empty((nbh, lq, np_), dtype=torch.float32, device=q.device)
        dzqb = torch.empty((nbh, lq, np_), dtype=torch.float32, device=q.device)
        guarded(_cope_bwd_q, "cope", shapes, q.dtype)[(n_mblocks, nbh)](
            q, k, v, table, o, do, lse, dq, dzqb, zqb, zl, delta, dtot, gk, sk, m, *strides(q, k, v, o, do, dq),
            table.stride(0), table.stride(1), sm_b, sm_m, sm_n,
            h, groups, hkv, pair0, lq, lk, q_offset, scale, npos, cstride, nslot, *window_args(window, sink),
            D=d, BD=bd, BM=bm1, BN=bn, NP=np_, LOG2_BN=bn.bit_length() - 1, HAS_MASK=mask is not None,
            PREC=prec, UPCAST=upcast, MONO=not upcast, TPREC=_table_precision(q.dtype),
            **window_switches(window, sink), num_warps=warps1, num_stages=stages1,
        )
        # de = Σ over the chunk's queries of q ⊗ dz: one float32 GEMM, (D, rows) @ (rows, npos)
        q_chunk = q_pairs[pair0:pair0 + n_pairs].reshape(nbh * lq, d).float()
        dtable += q_chunk.t() @ dzqb[:, :, :npos].reshape(nbh * lq, npos)
        del q_chunk
        guarded(_cope_bwd_kv, "cope", shapes, q.dtype)[(triton.cdiv(lk, bn), n_pairs)](
            q, k, v, do, dk, dv, lse, zqb, zl, delta, dtot, gk, sk, m, *strides(q, k, v, do, dk, dv), sm_b, sm_m, sm_n,
            h, groups, hkv, pair0, lq, lk, q_offset, scale, npos, cstride, nslot, *window_args(window, sink),
            D=d, BD=bd, BM=bm2, BN=bn, NP=np_, HAS_MASK=mask is not None, PREC=prec, UPCAST=upcast,
            MONO=not upcast, **window_switches(window, sink), num_warps=warps2, num_stages=stages2,
        )
    return dq, dk, dv, dtable


class CopeFunction(torch.autograd.Function):
    """Causal CoPE attention with gradients for q, k, v and the position table."""

    @staticmethod
    def forward(ctx, q, k, v, table, mask, scale, q_offset, window=None, sink=None):
        o, lse = _forward(q, k, v, table, mask, scale, q_offset, window, sink)
        if any(ctx.needs_input_grad[:4]):
            ctx.save_for_backward(q, k, v, table, o, lse, mask)
        ctx.args = (scale, q_offset, window, sink)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, table, o, lse, mask = ctx.saved_tensors
        scale, q_offset, window, sink = ctx.args
        dq, dk, dv, dtable = _backward(q, k, v, table, o, lse, do, mask, scale, q_offset, window, sink)
        return (dq, dk, dv, (dtable.to(table.dtype) if ctx.needs_input_grad[3] else None), None, None, None, None,
                None)


def cope_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, mask: torch.Tensor | None,
                scale: float, q_offset: int | torch.Tensor, window: int | None = None, sink: int | None = None
                ) -> torch.Tensor:
    """Causal CoPE attention with the Triton kernels (inputs validated by the dispatcher,
    `hf_posenc.kernels.cope.cope`, whose arguments these are): q, k, v with contiguous last dims, one dtype of
    ``hf_posenc.kernels._common.KERNEL_DTYPES``, D <= ``MAX_HEAD_DIM`` (128); the table in any float dtype (read in
    float32); ``q_offset`` an int or a 1-element integer tensor the kernels load; ``window`` and ``sink`` as
    `hf_posenc.kernels._triton_tiles.launch_options` takes them.

    Returns:
        (B, H, Lq, D) in q's dtype (a transposed view of a (B, Lq, H, D) tensor).

    Raises:
        TypeError, ValueError: ``window`` or ``sink`` is not None or an int >= 1, or a sink without a window.
    """
    window, sink, offset = launch_options(window, sink, q_offset, q.device)  # offset: loaded by the kernels
    return CopeFunction.apply(q, k, v, table, mask, float(scale), offset, window, sink)
