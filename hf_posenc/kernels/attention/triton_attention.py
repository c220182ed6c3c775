"""Triton kernels: FlashAttention-style attention (online softmax, O(L) memory, forward and backward) with
a position term chosen at compile time, beside the PyTorch reference in ``naive.py``.

Layout in the style of Liger-Kernel: the kernels, their launchers, the ``torch.autograd.Function`` and a
thin wrapper (``fused_attention``). The terms and their tensors are described in ``terms/``: what the host code
passes per term (its tensors, compile-time sizes, gradient reductions) comes from the term's registry entry
(``TermSpec.kernel``, a ``TritonHooks``, in the term's own module); only the kernels' compile-time ``TERM``
branches name terms.

Math (per batch b, query head h, key/value head g = h // G, G = H / Hkv; query i is key qi = q_offset + i)::

    s_ij  = scale · q_i · k_j + B_h(i, j)          (shaw: scale · q_i · (k_j + a^K_ij))
    s_ij  = −inf where masked (causal j > qi, key j invalid, out of bounds)
    P     = softmax_j(s);  o_i = Σ_j P_ij v_j      (shaw: + W_i · a^V, W_ir = Σ_{j: idx_ij = r} P_ij)
    lse_i = log Σ_j exp(s_ij)                      (+inf for a row that sees no key: its o_i is 0)
    backward: dP_ij = dO_i · v_j (shaw: + dW_i[idx_ij]),  Δ_i = Σ_j P_ij dP_ij = dO_i · o_i (+ W_i · dW_i)
              dS_ij = P_ij (dP_ij − Δ_i) is the gradient of the logit s_ij
              dq_i = scale Σ_j dS_ij k_j,  dk_j = scale Σ_i dS_ij q_i,  dv_j = Σ_i P_ij dO_i

Tiling. Forward: one program per (BLOCK_M queries, b, h), looping over BLOCK_N key tiles (causal: only up
to the last key its queries see); running max / sum in float32 (exp2). Backward (FlashAttention-2): a
preprocessing kernel for Δ; a dK/dV kernel, one program per (BLOCK_N keys, b, key/value head) looping over
the G query heads of its group and over their query tiles (GQA without expanding K/V, no atomics); and a
dQ kernel, one program per (BLOCK_M queries, b, h) looping over key tiles. Head dims are padded to a power
of two (at least 16) with masked loads, so 40, 80, 96 work. Products run on the tensor cores in the input
dtype (fp16/bf16) with float32 accumulation; float32 inputs use IEEE float32 products (no TF32). In the
interpreter every product is computed in float32 (``tl.dot`` on bf16 is wrong there).

Gradients of the term tensors, all reduced along tiles first (no atomics), in the dQ kernel unless said:

* kerple: per query row Σ_j dS_ij ∂B/∂r1 and Σ_j dS_ij ∂B/∂r2 ((2, B, H, Lq) float32), summed by PyTorch.
* t5: each dQ program accumulates a bucket histogram Σ dS over its tiles in registers (a loop over the
  buckets present in a tile: one bucket far from the diagonal) and writes it once; PyTorch sums the
  (B, H, Lq tiles, buckets) partials into the table's gradient.
* fire: the same per-program histogram over the table's cells, with the interpolation weights (1 − w, w);
  per query row Σ_j dS ∂B/∂inv_norm and Σ_j dS ∂B/∂c. PyTorch sums them and autograd carries the table's
  gradient into the MLP (the table is the MLP evaluated on the grid), inv_norm's into c and L.
* shaw: per query row histogram of scale · dS over the 2K + 1 relative buckets = the gradient of q·a^K (computed
  in PyTorch, which carries it on to q and a^K). The value term is in the kernel too: the forward
  accumulates W (per-row histogram of P, rescaled with the running max), the backward gathers dW.
* fox: dc_j = −Σ_i dS_ij (dK/dV kernel, per key) and dc_qi += Σ_j dS_ij (dQ kernel, per query; zero up to
  rounding, since the rows of dS sum to 0).

Masks: causal (j <= q_offset + i), a sliding window (HAS_WINDOW, a compile-time switch; the size WINDOW is a
runtime int: causal qi − WINDOW < j, bidirectional |qi − j| < WINDOW; the loops start and stop at the tiles that
meet the band, so the tiles outside it are never loaded), its attention sinks (HAS_SINK, a compile-time switch; SINK
a runtime int: the keys j < SINK are seen besides the band; the query-major loops walk the sink keys' tiles first,
then the window's, never the tiles between; the dK/dV program of a tile holding sink keys walks every query tile
that may see them; with SINK_CACHE, a compile-time switch for ``sink_positions="cache"`` (causal, Toeplitz terms),
a sink outside a row's window takes the term at its cache distance WINDOW + SINK − 1 − j: `_logits` hands that
distance on as the pair's delta, so the term's gradients in the dQ kernel take it too), a per-batch key-valid
vector (padding; a row with no valid key gives 0), bounds. Offsets inside one (b, h) slice are 32-bit (the slice
base is 64-bit): (L − 1) · stride + D must stay below 2^31 (``fused_attention`` checks). Only Triton features present in 3.6 are used.

Resources (checked offline: no GPU was available, so nothing here is timed). Every kernel compiles for
sm_90 for every term, dtype and head dim 40 / 64 / 80 / 96 / 128 (``benchmarks/attention_resources.py``).
``LAUNCH`` holds the largest tiles that need no register spills in bfloat16 (ptxas of Triton 3.9; 70 of 90
half-precision configurations spill-free, the rest at most 40 bytes of stack; at most 148 KB of shared
memory, which fits H100/H200 but not GPUs with ~100 KB per SM). The position terms cost registers: fire (two table
gathers per pair) and shaw (per-row bucket accumulators) get smaller tiles than the plain kernel. Known
costs not yet measured: every tile computes the causal/padding mask (no mask-free path for the tiles
below the diagonal); the t5 and fire histograms loop over the buckets/cells present in a tile, which is
one or two far from the diagonal but up to ~N/2 on the diagonal tile for fire (N = table size).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .._errors import guarded
from .naive import check_window
from .terms import TRITON_BRANCHES, KernelTerm, TritonHooks, enter, enter_sinks, kernel_kinds, triton_id

__all__ = ["FusedAttentionFunction", "fused_attention", "interpreting", "stdlib_matches_mode"]


# Launch parameters: (BLOCK_M, BLOCK_N, num_warps) per kernel, term group and head-dim class ("wide": padded
# head dim 128, i.e. D = 80..128; "narrow": D <= 64). NOT TIMED: no GPU was available when this was written.
# Chosen offline as the largest tiles whose sm_90 code (Triton 3.9 ptxas, bfloat16, causal, padding mask)
# needs no register spills (shaw's dQ at D = 128: 16 bytes of stack), by benchmarks/attention_resources.py
# (compiles without a GPU). A module attribute, so that benchmarks can sweep it on a GPU. Float32 inputs use
# LAUNCH_FLOAT32 below: their dK/dV kernel still spills (3xTF32 products): a correctness path, not a fast one.
# The row of each term is its ``TritonHooks.group``.
LAUNCH = {
    "fwd": {"light": {"wide": (128, 64, 8), "narrow": (128, 64, 8)},
            "t5": {"wide": (128, 64, 8), "narrow": (128, 64, 8)},
            "fire": {"wide": (64, 32, 8), "narrow": (64, 32, 8)},
            "shaw": {"wide": (64, 32, 8), "narrow": (64, 32, 8)}},
    "dkdv": {"light": {"wide": (32, 64, 8), "narrow": (32, 64, 8)},
             "t5": {"wide": (32, 64, 8), "narrow": (32, 64, 8)},
             "fire": {"wide": (32, 32, 8), "narrow": (32, 64, 8)},
             "shaw": {"wide": (32, 64, 8), "narrow": (32, 64, 8)}},
    "dq": {"light": {"wide": (64, 32, 4), "narrow": (128, 32, 8)},
           "t5": {"wide": (64, 32, 8), "narrow": (128, 32, 8)},
           "fire": {"wide": (32, 32, 8), "narrow": (64, 32, 8)},
           "shaw": {"wide": (32, 32, 8), "narrow": (64, 32, 8)}},
}
# Float32 (3xTF32 products, three times the operand registers): measured with hf_posenc.kernels.compile_check
# (Triton 3.6, D = 128, causal + padding; bytes of spill stores per thread, sm_90 / sm_80): dK/dV at
# (64, 32, 8) 2180 / 15232, (32, 32, 8) 1404 / 7616, (32, 16, 8) 1248 / 6292 (chosen; 64 KB of shared memory);
# dQ at (32, 32, 4) 160 / 192, (32, 32, 8) 0 / 8 (chosen); forward (32, 32, 4) none.
LAUNCH_FLOAT32 = {"fwd": (32, 32, 4), "dkdv": (32, 16, 8), "dq": (32, 32, 8)}
NUM_STAGES = 2
#: queries and keys per tile in the interpreter (each program costs Python time there); at L = 77 the
#: tests still see two tiles, a partial one, and the causal skipping.
INTERPRETER_BLOCK = 64

_LOG2E = tl.constexpr(1.4426950408889634)
# compile-time term ids: one branch per entry of terms.TRITON_BRANCHES, its id from the registry (terms.triton_id)
_NONE = tl.constexpr(triton_id("none"))
_ALIBI = tl.constexpr(triton_id("alibi"))
_KERPLE_LOG = tl.constexpr(triton_id("kerple_log"))
_KERPLE_POW = tl.constexpr(triton_id("kerple_pow"))
_SANDWICH = tl.constexpr(triton_id("sandwich"))
_T5 = tl.constexpr(triton_id("t5"))
_FIRE = tl.constexpr(triton_id("fire"))
_SHAW = tl.constexpr(triton_id("shaw"))
_FOX = tl.constexpr(triton_id("fox"))
#: the branches below, in id order; a built-in term with a branch of its own needs one here (and in _term_bias).
_BRANCHES = ("none", "alibi", "kerple_log", "kerple_pow", "sandwich", "t5", "fire", "shaw", "fox")
assert _BRANCHES == TRITON_BRANCHES == kernel_kinds(), (
    f"the Triton branches {_BRANCHES} do not match terms.TRITON_BRANCHES {TRITON_BRANCHES} and the registered "
    f"kinds with a branch of their own {kernel_kinds()}")
assert [c.value for c in (_NONE, _ALIBI, _KERPLE_LOG, _KERPLE_POW, _SANDWICH, _T5, _FIRE, _SHAW, _FOX)] == list(
    range(len(_BRANCHES)))


# -- device helpers (inlined) ---------------------------------------------------------------------------


@triton.jit
def _dot(a, b, F32: tl.constexpr):
    """a @ b with float32 accumulation. F32 = 0: operands as they are (fp16/bf16 tensor cores); 1: both in
    float32 with IEEE products (the interpreter, where tl.dot on bf16 is wrong); 2: float32 operands as
    three TF32 products (tensor cores, about float32 accuracy; compiled float32 inputs)."""
    if F32 == 1:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif F32 == 2:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="tf32x3")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _softmax_step(m_i, l_i, s):
    """One key tile of the online softmax: (the running max m_new, the running sum l_i rescaled and grown,
    p = exp(s − m_new) (0 where s is −inf), the factor alpha = exp(m_i − m_new) for the accumulator); a row that
    has seen no key yet keeps m = −inf and p = 0."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2((s - m_safe[:, None]) * _LOG2E)
    alpha = tl.exp2((m_i - m_safe) * _LOG2E)
    return m_new, l_i * alpha + tl.sum(p, 1), p, alpha


@triton.jit
def _log1p(x):
    """log(1 + x) for x >= 0, accurate for small x (log(u) · x / (u − 1), u = 1 + x)."""
    u = 1.0 + x
    d = u - 1.0
    return tl.where(d == 0.0, x, tl.log(u) * (x / tl.where(d == 0.0, 1.0, d)))


@triton.jit
def _fire_cells(delta, offs_m, b, Lq, TP1, TP2, TP3, tp_sb):
    """FIRE's fractional table cell u of each pair and what its gradients need: (u, psi, inv_norm, c, xs)."""
    dpos = tl.maximum(delta, 0).to(tl.float32)
    c = tl.load(TP2)
    xs = tl.load(TP3)  # (N − 1) / x_max
    inv = tl.load(TP1 + b.to(tl.int64) * tp_sb + offs_m, mask=offs_m < Lq, other=0.0)
    psi = _log1p(c * dpos)
    u = psi * (inv * xs)[:, None]
    return u, psi, inv, c, xs, dpos


@triton.jit
def _term_bias(
    TERM: tl.constexpr, delta, offs_m, offs_n, qpos, ok, b, h, H, Lq, Lk, scale,
    TP0, TP1, TP2, TP3, tp_sb, TI0, TI1,
):
    """The (BLOCK_M, BLOCK_N) float32 position term B_h(i, j) (see terms/); delta = qi − j."""
    if TERM == _ALIBI:
        bias = -tl.load(TP0 + h) * tl.abs(delta).to(tl.float32)
    elif TERM == _KERPLE_LOG:
        dist = tl.abs(delta).to(tl.float32)
        bias = -tl.load(TP0 + h) * _log1p(tl.load(TP1 + h) * dist)
    elif TERM == _KERPLE_POW:
        dist = tl.abs(delta).to(tl.float32)
        powd = tl.exp2(tl.load(TP1 + h) * tl.log2(tl.maximum(dist, 1.0)))
        bias = tl.where(dist > 0.0, -tl.load(TP0 + h) * powd, 0.0)
    elif TERM == _SANDWICH:
        idx = tl.minimum(tl.abs(delta), TI0 - 1)
        bias = tl.load(TP0 + h * TI0 + idx, mask=ok, other=0.0)
    elif TERM == _T5:
        rel = tl.minimum(tl.maximum(-delta, -TI0), TI0) + TI0
        bucket = tl.load(TP1 + rel, mask=ok, other=0)
        bias = tl.load(TP0 + h * TI1 + bucket, mask=ok, other=0.0)
    elif TERM == _FIRE:
        u, psi, inv, c, xs, dpos = _fire_cells(delta, offs_m, b, Lq, TP1, TP2, TP3, tp_sb)
        uc = tl.minimum(tl.maximum(u, 0.0), TI0 - 1.0)
        k0 = tl.minimum(tl.floor(uc), TI0 - 2.0)
        w = uc - k0
        cell = TP0 + h * TI0 + k0.to(tl.int32)
        t0 = tl.load(cell, mask=ok, other=0.0)
        t1 = tl.load(cell + 1, mask=ok, other=0.0)
        bias = t0 + w * (t1 - t0)
    elif TERM == _SHAW:
        idx = tl.minimum(tl.maximum(-delta, -TI0), TI0) + TI0
        rows = ((b * H + h).to(tl.int64) * Lq + offs_m) * (2 * TI0 + 1)
        bias = scale * tl.load(TP0 + rows[:, None] + idx, mask=ok, other=0.0)
    else:  # _FOX
        base = (b * H + h).to(tl.int64) * Lk
        cq = tl.load(TP0 + base + qpos, mask=(offs_m < Lq) & (qpos < Lk), other=0.0)
        ck = tl.load(TP0 + base + offs_n, mask=offs_n < Lk, other=0.0)
        bias = cq[:, None] - ck[None, :]
    return bias


@triton.jit
def _logits(
    q, k, offs_m, offs_n, b, h, H, Lq, Lk, q_offset, scale, VALID, svalb,
    TP0, TP1, TP2, TP3, tp_sb, TI0, TI1, WINDOW, SINK,
    TERM: tl.constexpr, CAUSAL: tl.constexpr, HAS_VALID: tl.constexpr, F32: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SINK: tl.constexpr, SINK_CACHE: tl.constexpr,
):
    """(s (BLOCK_M, BLOCK_N) float32 logits with −inf where masked, the bool mask ok, delta = qi − j: with
    SINK_CACHE, a far sink's cache distance instead, the rule of hf_posenc.kernels._masks.CacheSinks)."""
    qpos = q_offset + offs_m
    ok = (offs_m[:, None] < Lq) & (offs_n[None, :] < Lk)
    if CAUSAL:
        ok = ok & (offs_n[None, :] <= qpos[:, None])
    if HAS_WINDOW:  # the band: qi − window < j (and j < qi + window bidirectionally), or a sink key j < SINK
        band = offs_n[None, :] > qpos[:, None] - WINDOW
        if not CAUSAL:
            band = band & (offs_n[None, :] < qpos[:, None] + WINDOW)
        if HAS_SINK:
            band = band | (offs_n[None, :] < SINK)
        ok = ok & band
    if HAS_VALID:
        kv = tl.load(VALID + b.to(tl.int64) * svalb + offs_n, mask=offs_n < Lk, other=0)
        ok = ok & (kv != 0)[None, :]
    s = _dot(q, tl.trans(k), F32) * scale
    delta = qpos[:, None] - offs_n[None, :]
    if SINK_CACHE:  # a sink the window no longer covers sits just before its oldest key (CacheSinks)
        is_sink = offs_n < SINK  # per key: one (BLOCK_M, BLOCK_N) comparison below, not two and an and
        far = delta >= tl.where(is_sink, WINDOW, 1 << 30)[None, :]
        delta = tl.where(far, (WINDOW + SINK - 1 - offs_n)[None, :], delta)
    if TERM != _NONE:
        s += _term_bias(TERM, delta, offs_m, offs_n, qpos, ok, b, h, H, Lq, Lk, scale,
                        TP0, TP1, TP2, TP3, tp_sb, TI0, TI1)
    s = tl.where(ok, s, float("-inf"))
    return s, ok, delta


@triton.jit
def _key_range(pid_m, q_offset, Lk, WINDOW, SINK, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINK: tl.constexpr):
    """(n_first, n_lo, n_hi): [n_lo, n_hi) are the keys of the window the query tile pid_m may see; n_lo a multiple
    of BLOCK_N. Causal: up to its last query; a window: from its first query's qi − window + 1 (and, bidirectional,
    up to its last query's qi + window − 1). The key tiles outside are never loaded. The loops walk the positions
    n_first, n_first + BLOCK_N, ... < n_hi, each at the key tile `_tile_start` gives: n_first = n_lo, but with
    sinks n_lo less the sink keys' tiles left of n_lo (walked first; bidirectional, n_hi reaches the last sink)."""
    if CAUSAL:
        n_hi = tl.minimum(Lk, q_offset + (pid_m + 1) * BLOCK_M)
    elif HAS_WINDOW:
        n_hi = tl.minimum(Lk, q_offset + (pid_m + 1) * BLOCK_M - 1 + WINDOW)
    else:
        n_hi = Lk
    if HAS_WINDOW:
        n_lo = (tl.maximum(q_offset + pid_m * BLOCK_M - WINDOW + 1, 0) // BLOCK_N) * BLOCK_N
    else:
        n_lo = 0
    n_first = n_lo
    if HAS_SINK:
        if not CAUSAL:
            n_hi = tl.maximum(n_hi, tl.minimum(SINK, Lk))
        n_hi = tl.maximum(n_hi, n_lo)
        n_first = n_lo - tl.minimum((SINK + BLOCK_N - 1) // BLOCK_N * BLOCK_N, n_lo)
    return n_first, n_lo, n_hi


@triton.jit
def _tile_start(walk, n_first, n_lo, HAS_SINK: tl.constexpr):
    """The first key of the tile at walk position ``walk`` (`_key_range`): the window's tile ``walk`` from
    n_lo on; before it (sinks only) the sink keys' tiles 0, BLOCK_N, ... in order."""
    start_n = walk
    if HAS_SINK:
        start_n = tl.where(walk < n_lo, walk - n_first, walk)
    return start_n


@triton.jit
def _row_hist(acc, idx, v, ok, cols):
    """acc (BLOCK_M, RP) += per-row histogram of v over the integer cells idx (loop over the cells present)."""
    lo = tl.min(tl.where(ok, idx, 1 << 30))
    hi = tl.max(tl.where(ok, idx, -1))
    for r in range(lo, hi + 1):
        srow = tl.sum(tl.where(idx == r, v, 0.0), 1)
        acc += tl.where(cols[None, :] == r, srow[:, None], 0.0)
    return acc


@triton.jit
def _table_hist(acc, cells, cid, v0, v1, ok, TWO: tl.constexpr):
    """acc (NHP,) += Σ v0 into cell cid and (TWO) Σ v1 into cell cid + 1, over the cells present in the tile."""
    lo = tl.min(tl.where(ok, cid, 1 << 30))
    hi = tl.max(tl.where(ok, cid, -1))
    for kk in range(lo, hi + 1):
        sel = (cid == kk) & ok
        acc += tl.where(cells == kk, tl.sum(tl.where(sel, v0, 0.0)), 0.0)
        if TWO:
            acc += tl.where(cells == kk + 1, tl.sum(tl.where(sel, v1, 0.0)), 0.0)
    return acc


# -- kernels ---------------------------------------------------------------------------------------------


@triton.jit
def _fwd_kernel(
    Q, K, V, O, LSE, W, VALID, TP0, TP1, TP2, TP3,
    sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sob, soh, som, svalb, tp_sb,
    H, G, Lq, Lk, QOFF, scale, TI0, TI1, WINDOW, SINK,
    TERM: tl.constexpr, CAUSAL: tl.constexpr, HAS_VALID: tl.constexpr,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    RP: tl.constexpr, F32: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINK: tl.constexpr,
    SINK_CACHE: tl.constexpr,
):
    q_offset = tl.load(QOFF)  # a device tensor: the host never reads the offset (no sync, CUDA-graph safe)
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // G
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < HEAD_D
    q = tl.load(Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh + offs_m[:, None] * sqm + offs_d[None, :],
                mask=(offs_m[:, None] < Lq) & dmask[None, :], other=0.0)
    k_base = K + b.to(tl.int64) * skb + hk.to(tl.int64) * skh
    v_base = V + b.to(tl.int64) * svb + hk.to(tl.int64) * svh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    w_acc = tl.zeros([BLOCK_M, RP], tl.float32)  # shaw's value-term histogram (unused otherwise)
    r_cols = tl.arange(0, RP)
    n_first, n_lo, n_hi = _key_range(pid_m, q_offset, Lk, WINDOW, SINK, BLOCK_M, BLOCK_N, CAUSAL, HAS_WINDOW,
                                     HAS_SINK)
    for walk in range(n_first, n_hi, BLOCK_N):
        offs_n = _tile_start(walk, n_first, n_lo, HAS_SINK) + tl.arange(0, BLOCK_N)
        kv_mask = (offs_n[:, None] < Lk) & dmask[None, :]
        k = tl.load(k_base + offs_n[:, None] * skn + offs_d[None, :], mask=kv_mask, other=0.0)
        s, ok, delta = _logits(q, k, offs_m, offs_n, b, h, H, Lq, Lk, q_offset, scale, VALID, svalb,
                               TP0, TP1, TP2, TP3, tp_sb, TI0, TI1, WINDOW, SINK, TERM, CAUSAL, HAS_VALID, F32,
                               HAS_WINDOW, HAS_SINK, SINK_CACHE)
        m_new, l_i, p, alpha = _softmax_step(m_i, l_i, s)
        v = tl.load(v_base + offs_n[:, None] * svn + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, F32)
        if TERM == _SHAW:
            idx = tl.minimum(tl.maximum(-delta, -TI0), TI0) + TI0
            w_acc = _row_hist(w_acc * alpha[:, None], idx, p, ok, r_cols)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    row_ok = offs_m < Lq
    tl.store(O + b.to(tl.int64) * sob + h.to(tl.int64) * soh + offs_m[:, None] * som + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=row_ok[:, None] & dmask[None, :])
    lse = tl.where(l_i == 0.0, float("inf"), m_i + tl.log(l_safe))
    tl.store(LSE + pid_bh.to(tl.int64) * Lq + offs_m, lse, mask=row_ok)
    if TERM == _SHAW:
        R = 2 * TI0 + 1
        w_rows = (pid_bh.to(tl.int64) * Lq + offs_m) * R
        tl.store(W + w_rows[:, None] + r_cols[None, :], w_acc / l_safe[:, None],
                 mask=row_ok[:, None] & (r_cols[None, :] < R))


@triton.jit
def _bwd_delta_kernel(
    O, DO, DELTA, sob, soh, som, sdb, sdh, sdm, H, Lq,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """Δ_i = Σ_d dO_id O_id (float32)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < Lq) & (offs_d[None, :] < HEAD_D)
    o = tl.load(O + b.to(tl.int64) * sob + h.to(tl.int64) * soh + offs_m[:, None] * som + offs_d[None, :],
                mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + b.to(tl.int64) * sdb + h.to(tl.int64) * sdh + offs_m[:, None] * sdm + offs_d[None, :],
                 mask=mask, other=0.0).to(tl.float32)
    tl.store(DELTA + pid_bh.to(tl.int64) * Lq + offs_m, tl.sum(o * do, 1), mask=offs_m < Lq)


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, VALID, TP0, TP1, TP2, TP3, DCK,
    sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sdb, sdh, sdm, sdkb, sdkh, sdkn, sdvb, sdvh, sdvn,
    svalb, tp_sb,
    H, HKV, G, Lq, Lk, QOFF, scale, TI0, TI1, WINDOW, SINK,
    TERM: tl.constexpr, CAUSAL: tl.constexpr, HAS_VALID: tl.constexpr,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    F32: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINK: tl.constexpr, SINK_CACHE: tl.constexpr,
):
    q_offset = tl.load(QOFF)
    pid_n = tl.program_id(0)
    pid_bg = tl.program_id(1)
    b = pid_bg // HKV
    hk = pid_bg % HKV
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < HEAD_D
    kv_mask = (offs_n[:, None] < Lk) & dmask[None, :]
    k = tl.load(K + b.to(tl.int64) * skb + hk.to(tl.int64) * skh + offs_n[:, None] * skn + offs_d[None, :],
                mask=kv_mask, other=0.0)
    v = tl.load(V + b.to(tl.int64) * svb + hk.to(tl.int64) * svh + offs_n[:, None] * svn + offs_d[None, :],
                mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    if CAUSAL:  # the first query tile that sees a key of this tile
        m_lo = (tl.maximum(pid_n * BLOCK_N - q_offset, 0) // BLOCK_M) * BLOCK_M
    elif HAS_WINDOW:  # bidirectional band: queries qi > j − window
        m_lo = (tl.maximum(pid_n * BLOCK_N - WINDOW + 1 - q_offset, 0) // BLOCK_M) * BLOCK_M
    else:
        m_lo = 0
    if HAS_WINDOW:  # queries past the last key of this tile + window − 1 see none of its keys
        m_hi = tl.minimum(Lq, (pid_n + 1) * BLOCK_N - 1 + WINDOW - q_offset)
    else:
        m_hi = Lq
    if HAS_SINK:  # a tile that holds sink keys is seen by every query (causal: those at or after its first key)
        holds_sink = pid_n * BLOCK_N < SINK
        m_hi = tl.where(holds_sink, Lq, m_hi)
        if not CAUSAL:
            m_lo = tl.where(holds_sink, 0, m_lo)
    for hh in range(0, G):
        h = hk * G + hh
        q_base = Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
        do_base = DO + b.to(tl.int64) * sdb + h.to(tl.int64) * sdh
        row_base = (b * H + h).to(tl.int64) * Lq
        dck = tl.zeros([BLOCK_N], tl.float32)
        for start_m in range(m_lo, m_hi, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            q_mask = (offs_m[:, None] < Lq) & dmask[None, :]
            q = tl.load(q_base + offs_m[:, None] * sqm + offs_d[None, :], mask=q_mask, other=0.0)
            do = tl.load(do_base + offs_m[:, None] * sdm + offs_d[None, :], mask=q_mask, other=0.0)
            lse = tl.load(LSE + row_base + offs_m, mask=offs_m < Lq, other=float("inf"))
            dlt = tl.load(DELTA + row_base + offs_m, mask=offs_m < Lq, other=0.0)
            s, ok, delta = _logits(q, k, offs_m, offs_n, b, h, H, Lq, Lk, q_offset, scale, VALID, svalb,
                                   TP0, TP1, TP2, TP3, tp_sb, TI0, TI1, WINDOW, SINK, TERM, CAUSAL, HAS_VALID, F32,
                                   HAS_WINDOW, HAS_SINK, SINK_CACHE)
            p = tl.exp2((s - lse[:, None]) * _LOG2E)
            dv += _dot(tl.trans(p.to(do.dtype)), do, F32)
            dp = _dot(do, tl.trans(v), F32)
            if TERM == _SHAW:
                idx = tl.minimum(tl.maximum(-delta, -TI0), TI0) + TI0
                w_rows = (row_base + offs_m) * (2 * TI0 + 1)
                dp += tl.load(TP1 + w_rows[:, None] + idx, mask=ok, other=0.0)
            ds = p * (dp - dlt[:, None])
            dk += _dot(tl.trans(ds.to(q.dtype)), q, F32)
            if TERM == _FOX:
                dck += tl.sum(ds, 0)
        if TERM == _FOX:
            tl.store(DCK + (b * H + h).to(tl.int64) * Lk + offs_n, -dck, mask=offs_n < Lk)
    out_mask = (offs_n[:, None] < Lk) & dmask[None, :]
    tl.store(DK + b.to(tl.int64) * sdkb + hk.to(tl.int64) * sdkh + offs_n[:, None] * sdkn + offs_d[None, :],
             (dk * scale).to(DK.dtype.element_ty), mask=out_mask)
    tl.store(DV + b.to(tl.int64) * sdvb + hk.to(tl.int64) * sdvh + offs_n[:, None] * sdvn + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=out_mask)


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, VALID, TP0, TP1, TP2, TP3, ROWG0, ROWG1, HIST, DQA,
    sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sdb, sdh, sdm, sdqb, sdqh, sdqm, svalb, tp_sb,
    H, G, Lq, Lk, QOFF, scale, TI0, TI1, N_MBLOCKS, WINDOW, SINK,
    TERM: tl.constexpr, CAUSAL: tl.constexpr, HAS_VALID: tl.constexpr,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    RP: tl.constexpr, NHP: tl.constexpr, ROWG_N: tl.constexpr, HAS_HIST: tl.constexpr, F32: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SINK: tl.constexpr, SINK_CACHE: tl.constexpr,
):
    q_offset = tl.load(QOFF)
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // G
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < HEAD_D
    row_ok = offs_m < Lq
    q_mask = row_ok[:, None] & dmask[None, :]
    q = tl.load(Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh + offs_m[:, None] * sqm + offs_d[None, :],
                mask=q_mask, other=0.0)
    do = tl.load(DO + b.to(tl.int64) * sdb + h.to(tl.int64) * sdh + offs_m[:, None] * sdm + offs_d[None, :],
                 mask=q_mask, other=0.0)
    row_base = pid_bh.to(tl.int64) * Lq
    lse = tl.load(LSE + row_base + offs_m, mask=row_ok, other=float("inf"))
    dlt = tl.load(DELTA + row_base + offs_m, mask=row_ok, other=0.0)
    k_base = K + b.to(tl.int64) * skb + hk.to(tl.int64) * skh
    v_base = V + b.to(tl.int64) * svb + hk.to(tl.int64) * svh

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    g0 = tl.zeros([BLOCK_M], tl.float32)  # per-row term gradients (kerple, fire, fox)
    g1 = tl.zeros([BLOCK_M], tl.float32)
    hist = tl.zeros([NHP], tl.float32)  # per-program table histogram (t5, fire)
    cells = tl.arange(0, NHP)
    dqa = tl.zeros([BLOCK_M, RP], tl.float32)  # shaw: per-row histogram of dS
    r_cols = tl.arange(0, RP)
    n_first, n_lo, n_hi = _key_range(pid_m, q_offset, Lk, WINDOW, SINK, BLOCK_M, BLOCK_N, CAUSAL, HAS_WINDOW,
                                     HAS_SINK)
    for walk in range(n_first, n_hi, BLOCK_N):
        offs_n = _tile_start(walk, n_first, n_lo, HAS_SINK) + tl.arange(0, BLOCK_N)
        kv_mask = (offs_n[:, None] < Lk) & dmask[None, :]
        k = tl.load(k_base + offs_n[:, None] * skn + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + offs_n[:, None] * svn + offs_d[None, :], mask=kv_mask, other=0.0)
        s, ok, delta = _logits(q, k, offs_m, offs_n, b, h, H, Lq, Lk, q_offset, scale, VALID, svalb,
                               TP0, TP1, TP2, TP3, tp_sb, TI0, TI1, WINDOW, SINK, TERM, CAUSAL, HAS_VALID, F32,
                               HAS_WINDOW, HAS_SINK, SINK_CACHE)
        p = tl.exp2((s - lse[:, None]) * _LOG2E)
        dp = _dot(do, tl.trans(v), F32)
        if TERM == _SHAW:
            idx = tl.minimum(tl.maximum(-delta, -TI0), TI0) + TI0
            dp += tl.load(TP1 + (row_base + offs_m)[:, None] * (2 * TI0 + 1) + idx, mask=ok, other=0.0)
        ds = p * (dp - dlt[:, None])
        dq += _dot(ds.to(k.dtype), k, F32)
        # -- gradients of the term tensors, reduced along the tile --
        if TERM == _KERPLE_LOG:
            dist = tl.abs(delta).to(tl.float32)
            r1 = tl.load(TP0 + h)
            r2 = tl.load(TP1 + h)
            g0 += tl.sum(-ds * _log1p(r2 * dist), 1)
            g1 += tl.sum(-ds * r1 * dist / (1.0 + r2 * dist), 1)
        elif TERM == _KERPLE_POW:
            dist = tl.abs(delta).to(tl.float32)
            r1 = tl.load(TP0 + h)
            lg = tl.log(tl.maximum(dist, 1.0))
            powd = tl.exp2(tl.load(TP1 + h) * lg * _LOG2E)
            nz = ok & (dist > 0.0)
            g0 += tl.sum(tl.where(nz, -ds * powd, 0.0), 1)
            g1 += tl.sum(tl.where(nz, -ds * r1 * powd * lg, 0.0), 1)
        elif TERM == _T5:
            rel = tl.minimum(tl.maximum(-delta, -TI0), TI0) + TI0
            bucket = tl.load(TP1 + rel, mask=ok, other=0)
            hist = _table_hist(hist, cells, bucket, ds, ds, ok, False)
        elif TERM == _FIRE:
            u, psi, inv, c, xs, dpos = _fire_cells(delta, offs_m, b, Lq, TP1, TP2, TP3, tp_sb)
            uc = tl.minimum(tl.maximum(u, 0.0), TI0 - 1.0)
            k0 = tl.minimum(tl.floor(uc), TI0 - 2.0)
            w = uc - k0
            ki = k0.to(tl.int32)
            cell = TP0 + h * TI0 + ki
            t0 = tl.load(cell, mask=ok, other=0.0)
            t1 = tl.load(cell + 1, mask=ok, other=0.0)
            slope = tl.where(ok & (u >= 0.0) & (u <= TI0 - 1.0), t1 - t0, 0.0)
            g0 += tl.sum(ds * slope * psi * xs, 1)
            g1 += tl.sum(ds * slope * (inv * xs)[:, None] * dpos / (1.0 + c * dpos), 1)
            hist = _table_hist(hist, cells, ki, ds * (1.0 - w), ds * w, ok, True)
        elif TERM == _SHAW:
            dqa = _row_hist(dqa, idx, ds, ok, r_cols)
        elif TERM == _FOX:
            g0 += tl.sum(ds, 1)

    tl.store(DQ + b.to(tl.int64) * sdqb + h.to(tl.int64) * sdqh + offs_m[:, None] * sdqm + offs_d[None, :],
             (dq * scale).to(DQ.dtype.element_ty), mask=q_mask)
    if ROWG_N >= 1:
        tl.store(ROWG0 + row_base + offs_m, g0, mask=row_ok)
    if ROWG_N >= 2:
        tl.store(ROWG1 + row_base + offs_m, g1, mask=row_ok)
    if HAS_HIST:
        tl.store(HIST + (pid_bh.to(tl.int64) * N_MBLOCKS + pid_m) * NHP + cells, hist)
    if TERM == _SHAW:
        R = 2 * TI0 + 1
        tl.store(DQA + (row_base + offs_m)[:, None] * R + r_cols[None, :], dqa * scale,
                 mask=row_ok[:, None] & (r_cols[None, :] < R))


# -- host side -------------------------------------------------------------------------------------------


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``), read now."""
    try:
        from triton import knobs

        return bool(knobs.runtime.interpret)
    except (ImportError, AttributeError):  # triton < 3.4 has no knobs
        return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def _is_interpreted(fn: object) -> bool:
    return type(fn).__name__ == "InterpretedFunction"


def stdlib_matches_mode() -> bool:
    """Whether these kernels and Triton's own ``@jit`` library functions (``tl.sum``, ``tl.max``; decorated
    when triton was first imported) were built for the mode now in force (interpreted or compiled).

    ``TRITON_INTERPRET`` is read when a function is decorated: it must be set before triton is first
    imported (transformers and torch may import it), or the interpreter fails with "Cannot call
    @triton.jit'd outside of the scope of a kernel"."""
    mode = interpreting()
    return _is_interpreted(tl.sum) == mode and _is_interpreted(_fwd_kernel) == mode


class _Launch:
    """The static description of one call: term id, constants, tile sizes, strides of the term tensors; what differs
    per term comes from its registry entry's ``TritonHooks`` (``self.hooks``)."""

    def __init__(self, term: KernelTerm, q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool,
                 q_offset: int | torch.Tensor, has_valid: bool, window: int | None = None,
                 sink: int | None = None, sink_cache: bool = False) -> None:
        self.kind = term.kind
        self.hooks: TritonHooks = term.spec.kernel
        # a runtime int (one compilation for every window size) and a compile-time switch (no band code without)
        self.window = 0 if window is None else int(window)
        self.has_window = window is not None
        self.sink = 0 if sink is None else int(sink)  # the same for the sinks
        self.has_sink = sink is not None
        self.sink_cache = bool(sink_cache)  # the sinks at their cache positions (SINK_CACHE)
        self.term_id = triton_id(term.kind)
        self.scale = float(scale)
        self.causal = bool(causal)
        # (1,) int32 on the device, loaded by the kernels: a tensor offset (a StaticCache's) is never read here
        self.q_offset = torch.as_tensor(q_offset).to(device=q.device, dtype=torch.int32).reshape(1)
        self.has_valid = has_valid
        b, h, lq, d = q.shape
        self.b, self.h, self.lq, self.d = b, h, lq, d
        self.hkv, self.lk = k.shape[1], k.shape[2]
        self.g = h // self.hkv
        self.block_d = max(16, triton.next_power_of_2(d))
        interp = interpreting()
        self.f32 = 1 if interp else (2 if q.dtype == torch.float32 else 0)
        group = self.hooks.group
        width = "wide" if self.block_d > 64 else "narrow"
        fit_q = lambda s: max(16, min(s, triton.next_power_of_2(lq)))  # noqa: E731
        fit_k = lambda s: max(16, min(s, triton.next_power_of_2(self.lk)))  # noqa: E731
        cfg = {}
        for kernel in ("fwd", "dkdv", "dq"):
            if interp:
                bm, bn, warps = INTERPRETER_BLOCK, INTERPRETER_BLOCK, 4
            elif q.dtype == torch.float32:
                bm, bn, warps = LAUNCH_FLOAT32[kernel]
            else:
                bm, bn, warps = LAUNCH[kernel][group][width]
            cfg[kernel] = (fit_q(bm), fit_k(bn), warps)
        (self.fwd_m, self.fwd_n, self.fwd_warps), (self.dkdv_m, self.dkdv_n, self.dkdv_warps), (
            self.dq_m, self.dq_n, self.dq_warps) = cfg["fwd"], cfg["dkdv"], cfg["dq"]
        sizes = {"ti0": 0, "ti1": 0, "rp": 16, "nhp": 16}
        if self.hooks.sizes is not None:
            sizes.update(self.hooks.sizes(term))
        self.ti0, self.ti1, self.rp, self.nhp = sizes["ti0"], sizes["ti1"], sizes["rp"], sizes["nhp"]
        self.tp_sb = 0

    def shapes(self) -> dict:
        """What a KernelError names: the term and the shapes of q and k/v."""
        return {"term": self.kind, "q": (self.b, self.h, self.lq, self.d), "k/v": (self.b, self.hkv, self.lk, self.d)}

    def consts(self) -> dict:
        return dict(TERM=self.term_id, CAUSAL=self.causal, HAS_VALID=self.has_valid,
                    HEAD_D=self.d, BLOCK_D=self.block_d, F32=self.f32, HAS_WINDOW=self.has_window,
                    HAS_SINK=self.has_sink, SINK_CACHE=self.sink_cache)


def _kernel_tensors(term: KernelTerm, q: torch.Tensor) -> list[torch.Tensor]:
    """The term's tensors as the kernel reads them (see the kernel's TP0..TP3; its registry entry's
    ``TritonHooks.tensors``), in the order of ``FusedAttentionFunction``'s trailing inputs."""
    tensors = term.spec.kernel.tensors(term, q)
    if len(tensors) > 4:
        raise ValueError(f"the {term.kind} term hands the kernel {len(tensors)} tensors; it reads at most 4 (TP0..TP3)")
    return tensors


def _pointers(tensors: list[torch.Tensor], dummy: torch.Tensor) -> list[torch.Tensor]:
    return (list(tensors) + [dummy] * 4)[:4]


class FusedAttentionFunction(torch.autograd.Function):
    """(o (B, H, Lq, D), W (B, H, Lq, 2K + 1) for shaw else empty) with gradients for q, k, v and the term's
    tensors. Inputs: q, k, v, key_valid (B|1, Lk) uint8 or None, a ``_Launch``, then the term's tensors."""

    @staticmethod
    def forward(ctx, q, k, v, valid, launch: _Launch, *tensors):
        L = launch
        dev = q.device
        o_store = torch.empty((L.b, L.lq, L.h, L.d), dtype=q.dtype, device=dev)  # returned as (B, H, Lq, D)
        o = o_store.transpose(1, 2)
        lse = torch.empty((L.b, L.h, L.lq), dtype=torch.float32, device=dev)
        r = 2 * L.ti0 + 1 if L.hooks.values is not None else 0  # the value term's per-row histogram W
        w = torch.empty((L.b, L.h, L.lq, r), dtype=torch.float32, device=dev)
        dummy = lse
        tp = _pointers(tensors, dummy)
        valid_t = valid if valid is not None else dummy
        svalb = (valid.stride(0) if valid.shape[0] > 1 else 0) if valid is not None else 0
        tp_sb = L.hooks.batch_stride(list(tensors)) if L.hooks.batch_stride is not None else 0
        L.tp_sb = tp_sb
        grid = (triton.cdiv(L.lq, L.fwd_m), L.b * L.h)
        guarded(_fwd_kernel, "attention", L.shapes(), q.dtype)[grid](
            q, k, v, o, lse, w, valid_t, *tp,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2), svalb, tp_sb,
            L.h, L.g, L.lq, L.lk, L.q_offset, L.scale, L.ti0, L.ti1, L.window, L.sink,
            BLOCK_M=L.fwd_m, BLOCK_N=L.fwd_n, RP=L.rp, num_warps=L.fwd_warps, num_stages=NUM_STAGES,
            **L.consts(),
        )
        ctx.launch = L
        ctx.svalb = svalb
        ctx.has_valid_tensor = valid is not None
        ctx.save_for_backward(q, k, v, o, lse, w, *( [valid] if valid is not None else []), *tensors)
        if L.hooks.values is None:
            ctx.mark_non_differentiable(w)
        return o, w

    @staticmethod
    def backward(ctx, do, dw):
        L: _Launch = ctx.launch
        saved = ctx.saved_tensors
        q, k, v, o, lse, w = saved[:6]
        rest = saved[6:]
        valid = rest[0] if ctx.has_valid_tensor else None
        tensors = list(rest[1:] if ctx.has_valid_tensor else rest)
        dev = q.device
        if do is None:
            do = torch.zeros_like(o)
        if do.stride(-1) != 1:
            do = do.contiguous()
        delta = torch.empty((L.b, L.h, L.lq), dtype=torch.float32, device=dev)
        guarded(_bwd_delta_kernel, "attention", L.shapes(), q.dtype)[(triton.cdiv(L.lq, L.dq_m), L.b * L.h)](
            o, do, delta, o.stride(0), o.stride(1), o.stride(2), do.stride(0), do.stride(1), do.stride(2),
            L.h, L.lq, HEAD_D=L.d, BLOCK_D=L.block_d, BLOCK_M=L.dq_m,
        )
        dummy = lse
        if L.hooks.values is not None:  # the value term: W's gradient dW (the kernels read it as TP1)
            dw = torch.zeros_like(w) if dw is None else dw.float().contiguous()
            delta = delta + (w * dw).sum(-1)  # Σ_r W_ir dW_ir: the value term's share of Δ_i
            tp = [tensors[0], dw, dummy, dummy]
        else:
            tp = _pointers(tensors, dummy)
        valid_t = valid if valid is not None else dummy

        dq = torch.empty((L.b, L.h, L.lq, L.d), dtype=q.dtype, device=dev)
        dk = torch.empty((L.b, L.hkv, L.lk, L.d), dtype=k.dtype, device=dev)
        dv = torch.empty((L.b, L.hkv, L.lk, L.d), dtype=v.dtype, device=dev)
        dck = torch.empty((L.b, L.h, L.lk), dtype=torch.float32, device=dev) if L.hooks.key_grad else dummy
        guarded(_bwd_dkdv_kernel, "attention", L.shapes(), q.dtype)[(triton.cdiv(L.lk, L.dkdv_n), L.b * L.hkv)](
            q, k, v, do, lse, delta, dk, dv, valid_t, *tp, dck,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2),
            dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
            ctx.svalb, L.tp_sb,
            L.h, L.hkv, L.g, L.lq, L.lk, L.q_offset, L.scale, L.ti0, L.ti1, L.window, L.sink,
            BLOCK_M=L.dkdv_m, BLOCK_N=L.dkdv_n, num_warps=L.dkdv_warps, num_stages=NUM_STAGES, **L.consts(),
        )
        n_mblocks = triton.cdiv(L.lq, L.dq_m)
        n_rows = L.hooks.row_planes
        rowg = torch.empty((n_rows, L.b, L.h, L.lq), dtype=torch.float32, device=dev) if n_rows else dummy
        hist = (torch.empty((L.b, L.h, n_mblocks, L.nhp), dtype=torch.float32, device=dev)
                if L.hooks.histogram else dummy)
        dqa = torch.empty_like(tensors[0]) if L.hooks.values is not None else dummy
        guarded(_bwd_dq_kernel, "attention", L.shapes(), q.dtype)[(n_mblocks, L.b * L.h)](
            q, k, v, do, lse, delta, dq, valid_t, *tp, rowg[0] if n_rows else dummy,
            rowg[1] if n_rows > 1 else dummy, hist, dqa,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2),
            dq.stride(0), dq.stride(1), dq.stride(2), ctx.svalb, L.tp_sb,
            L.h, L.g, L.lq, L.lk, L.q_offset, L.scale, L.ti0, L.ti1, n_mblocks, L.window, L.sink,
            BLOCK_M=L.dq_m, BLOCK_N=L.dq_n, RP=L.rp, NHP=L.nhp, ROWG_N=n_rows,
            HAS_HIST=L.hooks.histogram, num_warps=L.dq_warps, num_stages=NUM_STAGES, **L.consts(),
        )
        return (dq, dk, dv, None, None, *_term_grads(L, ctx.needs_input_grad[5:], tensors, rowg, hist, dqa, dck))


def _term_grads(L: _Launch, needs, tensors, rowg, hist, dqa, dck) -> list[torch.Tensor | None]:
    """The gradient of each kernel tensor from the kernels' partial sums (the term's ``TritonHooks.grads``; None
    where none is needed)."""
    grads: list[torch.Tensor | None] = [None] * len(tensors)
    if L.hooks.grads is not None:
        grads = list(L.hooks.grads(L, list(tensors), rowg, hist, dqa, dck))
    return [g if (n and g is not None) else None for g, n in zip(grads, needs)]


def lower(term: KernelTerm) -> KernelTerm:
    """``term`` on its Triton branch: itself, or (a term registered on another term's branch) rewritten for it
    by its registry entry's ``lower``. ValueError for a term without a Triton branch."""
    spec = term.spec
    if spec.triton is None:
        raise ValueError(f"the {term.kind} term has no Triton branch")
    if spec.triton == term.kind:
        return term
    return spec.lower(term)


def fused_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    term: KernelTerm,
    *,
    scale: float,
    causal: bool,
    q_offset: int | torch.Tensor = 0,
    key_valid: torch.Tensor | None = None,
    window: int | None = None,
    sink: int | None = None,
    sink_positions: str | None = None,
) -> torch.Tensor:
    """Attention with ``term`` in the Triton kernels; same contract as ``naive.attention_reference``.

    Args:
        query: (B, H, Lq, D); key, value: (B, Hkv, Lk, D) (any strides with stride 1 along D; term.key and
            term.value replace them when set); float32, bfloat16 or float16, one dtype; D <= 128.
        term: the position term.
        scale: logit scale.
        causal: query i sees keys j <= q_offset + i only.
        q_offset: key index of the first query: an int, or a 0-d/1-element integer tensor (a StaticCache's)
            that the kernels load on the device (never read on the host).
        key_valid: (B|1, Lk) bool, False on keys no query may see, or None.
        window: None, or an int >= 1 (a sliding window): causal, query i sees keys qi − window < j <= qi;
            bidirectional, |qi − j| < window. Every kernel (forward, dK/dV, dQ) loops only over the tiles that
            meet the band (bounds computed on the device from the offset, tensor offsets included) and masks
            the band inside them.
        sink: None, or an int >= 1 with a ``window``: attention sinks, the keys j < sink seen besides the band.
            The query-major kernels (forward, dQ) walk the sink keys' tiles, then the window's; the dK/dV program
            of a tile holding sink keys walks every query tile that may see them. A runtime int behind the
            compile-time switch HAS_SINK.
        sink_positions: None or ``"text"``, or ``"cache"`` (causal, a Toeplitz term): the sinks outside a row's
            window take the term at their cache distance window + sink − 1 − j (the compile-time switch
            SINK_CACHE), forward and the term's gradients.

    Returns:
        (B, H, Lq, D) in the query's dtype: a transposed view of a contiguous (B, Lq, H, D) tensor.

    Raises:
        TypeError, ValueError: ``window`` or ``sink`` is not None or an int >= 1, or a sink without a window;
            ``sink_positions`` the call cannot take (``terms.enter_sinks``).
    """
    key, value, window = enter(query, key, value, term, q_offset, window, check_window)
    sink, cache = enter_sinks(term, window, sink, sink_positions, causal)
    term = lower(term)
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (query, key, value))
    valid = None
    if key_valid is not None:
        valid = key_valid.to(torch.uint8)
        if valid.stride(-1) != 1:
            valid = valid.contiguous()
    launch = _Launch(term, q, k, scale, causal, q_offset, valid is not None, window, sink, cache is not None)
    tensors = _kernel_tensors(term, q)
    o, w = FusedAttentionFunction.apply(q, k, v, valid, launch, *tensors)
    if launch.hooks.values is not None:  # the value term from the per-row histogram W (shaw: Σ_r W_ir a^V_r)
        o = (o.float() + launch.hooks.values(term, w)).to(query.dtype)
    return o
