"""Triton kernels of the remap engine (`hf_posenc.kernels.remap.engine`): one piece of a remap on CUDA, its softmax
attention over one interval of keys per query, and its backward from the merged output and log-sum-exp.

A remap's piece (`hf_posenc.kernels.remap.cases.Case`) is a plain attention of re-rotated queries over re-rotated
keys, restricted per query row i to the keys lo_i <= j < hi_i (`Case.span`, clamped to the row's valid keys,
causality and the model's own window). Per piece the engine calls:

* `span_forward`: o_i = Σ_{lo_i <= j < hi_i} softmax_j(scale · q_i · k_j) v_j (float32) and
  lse_i = log Σ_j exp(scale · q_i · k_j) (−inf where the interval is empty, o_i = 0), the engine merging the pieces
  by their log-sum-exp in PyTorch (O(L·D) per piece);
* `span_backward`: given the merged output's rows Δ_i = dO_i · O_i and the merged log-sum-exp (+inf where a row sees
  no key at all), P_ij = exp(s_ij − lse_i) is the merged softmax's probability of the pairs of this piece, and
  dS_ij = P_ij (dO_i · v_j − Δ_i): dq_i = scale Σ_j dS_ij k_j, dk_j = scale Σ_i dS_ij q_i, dv_j = Σ_i P_ij dO_i,
  whose sum over the pieces is the exact gradient (float32; the engine turns dq and dk back through the piece's
  rotation).

Tiling (FlashAttention-2, as ``attention/triton_attention.py``): the forward and dQ kernels run one program per
(BLOCK_M queries, b, h) over the key tiles from the smallest lo to the largest hi of its rows (`block_bounds`, per
query block, computed on the device: nothing is read on the host); the dK/dV kernel one program per (BLOCK_N keys,
b, key/value head) over the G query heads of its group and the query tiles whose intervals may reach its keys
(`key_rows`): grouped-query attention without expanding K/V, no atomics. Nothing is L × L: the per-block tables are
(L / BLOCK_M) × (L / BLOCK_N). Head dims are padded to a power of two (at least 16) with masked loads. Products run on
the tensor cores in the input dtype (fp16/bf16) with float32 accumulation, float32 inputs as 3xTF32, every product in
float32 in the interpreter (``F32`` of `hf_posenc.kernels.attention.triton_attention._dot`).

Tiles: ``attention/triton_attention.py``'s ``LAUNCH`` rows of the plain kernel ("light"), chosen offline there; not
timed (no GPU in the session that wrote this). ``python -m hf_posenc.kernels.compile_check`` compiles these kernels
for sm_90 and sm_80 without a GPU; the tests run them in the interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._errors import guarded
from ..attention.triton_attention import LAUNCH, LAUNCH_FLOAT32, NUM_STAGES, _dot, _softmax_step, interpreting

__all__ = ["block_bounds", "key_rows", "span_backward", "span_forward", "INTERPRETER_BLOCK"]

#: queries and keys per tile in the interpreter (each program costs Python time there).
INTERPRETER_BLOCK = 16
_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _span_mask(offs_m, offs_n, LO, HI, lo_base, Lq):
    """(BLOCK_M, BLOCK_N) bool: lo_i <= j < hi_i for the rows that exist."""
    row_ok = offs_m < Lq
    lo = tl.load(LO + lo_base + offs_m, mask=row_ok, other=0)
    hi = tl.load(HI + lo_base + offs_m, mask=row_ok, other=0)
    return (offs_n[None, :] >= lo[:, None]) & (offs_n[None, :] < hi[:, None])


@triton.jit
def _query_tile(pid_m, pid_bh, Q, K, V, QBLK, sqb, sqh, sqm, skb, skh, svb, svh, sqbb, H, G, Lq,
                HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """A query-major program's tile: (b, h (int64), its rows, the head-dim columns and which exist, which rows exist,
    its queries (BLOCK_M, BLOCK_D), the bases of its key/value head's K and V, the keys [n_lo, n_hi) its rows' intervals
    span (`block_bounds`))."""
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    hk = h // G
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < HEAD_D
    row_ok = offs_m < Lq
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :],
                mask=row_ok[:, None] & dmask[None, :], other=0.0)
    n_lo = tl.load(QBLK + b * sqbb + 2 * pid_m)
    n_hi = tl.load(QBLK + b * sqbb + 2 * pid_m + 1)
    return b, h, offs_m, offs_d, dmask, row_ok, q, K + b * skb + hk * skh, V + b * svb + hk * svh, n_lo, n_hi


@triton.jit
def _span_fwd_kernel(
    Q, K, V, O, LSE, LO, HI, QBLK,
    sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sob, soh, som, slob, sqbb,
    H, G, Lq, scale,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, F32: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b, h, offs_m, offs_d, dmask, row_ok, q, k_base, v_base, n_lo, n_hi = _query_tile(
        pid_m, pid_bh, Q, K, V, QBLK, sqb, sqh, sqm, skb, skh, svb, svh, sqbb, H, G, Lq, HEAD_D, BLOCK_D, BLOCK_M)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(n_lo, n_hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_mask = (offs_n[:, None] < n_hi) & dmask[None, :]
        k = tl.load(k_base + offs_n[:, None] * skn + offs_d[None, :], mask=kv_mask, other=0.0)
        ok = _span_mask(offs_m, offs_n, LO, HI, b * slob, Lq)
        s = tl.where(ok, _dot(q, tl.trans(k), F32) * scale, float("-inf"))
        m_new, l_i, p, alpha = _softmax_step(m_i, l_i, s)
        v = tl.load(v_base + offs_n[:, None] * svn + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, F32)
        m_i = m_new
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    tl.store(O + b * sob + h * soh + offs_m[:, None] * som + offs_d[None, :], acc / l_safe[:, None],
             mask=row_ok[:, None] & dmask[None, :])
    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(l_safe))
    tl.store(LSE + pid_bh.to(tl.int64) * Lq + offs_m, lse, mask=row_ok)


@triton.jit
def _span_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, LO, HI, QBLK,
    sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sdb, sdh, sdm, sdqb, sdqh, sdqm, slob, sqbb,
    H, G, Lq, scale,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, F32: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b, h, offs_m, offs_d, dmask, row_ok, q, k_base, v_base, n_lo, n_hi = _query_tile(
        pid_m, pid_bh, Q, K, V, QBLK, sqb, sqh, sqm, skb, skh, svb, svh, sqbb, H, G, Lq, HEAD_D, BLOCK_D, BLOCK_M)
    q_mask = row_ok[:, None] & dmask[None, :]
    do = tl.load(DO + b * sdb + h * sdh + offs_m[:, None] * sdm + offs_d[None, :], mask=q_mask, other=0.0)
    lse = tl.load(LSE + pid_bh.to(tl.int64) * Lq + offs_m, mask=row_ok, other=float("inf"))
    dlt = tl.load(DELTA + pid_bh.to(tl.int64) * Lq + offs_m, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(n_lo, n_hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_mask = (offs_n[:, None] < n_hi) & dmask[None, :]
        k = tl.load(k_base + offs_n[:, None] * skn + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + offs_n[:, None] * svn + offs_d[None, :], mask=kv_mask, other=0.0)
        ok = _span_mask(offs_m, offs_n, LO, HI, b * slob, Lq)
        s = _dot(q, tl.trans(k), F32) * scale
        p = tl.where(ok, tl.exp2((s - lse[:, None]) * _LOG2E), 0.0)
        dp = _dot(do, tl.trans(v), F32)
        ds = p * (dp - dlt[:, None])
        dq += _dot(ds.to(k.dtype), k, F32)
    tl.store(DQ + b * sdqb + h * sdqh + offs_m[:, None] * sdqm + offs_d[None, :], dq * scale, mask=q_mask)


@triton.jit
def _span_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, LO, HI, KROWS,
    sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sdb, sdh, sdm, sdkb, sdkh, sdkn, sdvb, sdvh, sdvn, slob, skrb,
    H, HKV, G, Lq, Lk, scale,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, F32: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bg = tl.program_id(1)
    b = (pid_bg // HKV).to(tl.int64)
    hk = (pid_bg % HKV).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < HEAD_D
    kv_mask = (offs_n[:, None] < Lk) & dmask[None, :]
    k = tl.load(K + b * skb + hk * skh + offs_n[:, None] * skn + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + b * svb + hk * svh + offs_n[:, None] * svn + offs_d[None, :], mask=kv_mask, other=0.0)
    m_lo = tl.load(KROWS + b * skrb + 2 * pid_n)  # the rows whose intervals may reach these keys
    m_hi = tl.load(KROWS + b * skrb + 2 * pid_n + 1)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for hh in range(0, G):
        h = hk * G + hh
        q_base = Q + b * sqb + h * sqh
        do_base = DO + b * sdb + h * sdh
        row_base = (b * H + h) * Lq
        for start_m in range(m_lo, m_hi, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            row_ok = offs_m < m_hi
            q_mask = row_ok[:, None] & dmask[None, :]
            q = tl.load(q_base + offs_m[:, None] * sqm + offs_d[None, :], mask=q_mask, other=0.0)
            do = tl.load(do_base + offs_m[:, None] * sdm + offs_d[None, :], mask=q_mask, other=0.0)
            lse = tl.load(LSE + row_base + offs_m, mask=row_ok, other=float("inf"))
            dlt = tl.load(DELTA + row_base + offs_m, mask=row_ok, other=0.0)
            ok = _span_mask(offs_m, offs_n, LO, HI, b * slob, Lq) & row_ok[:, None]
            s = _dot(q, tl.trans(k), F32) * scale
            p = tl.where(ok, tl.exp2((s - lse[:, None]) * _LOG2E), 0.0)
            dv += _dot(tl.trans(p.to(do.dtype)), do, F32)
            dp = _dot(do, tl.trans(v), F32)
            ds = p * (dp - dlt[:, None])
            dk += _dot(tl.trans(ds.to(q.dtype)), q, F32)
    tl.store(DK + b * sdkb + hk * sdkh + offs_n[:, None] * sdkn + offs_d[None, :], dk * scale, mask=kv_mask)
    tl.store(DV + b * sdvb + hk * sdvh + offs_n[:, None] * sdvn + offs_d[None, :], dv, mask=kv_mask)


# -- host side -------------------------------------------------------------------------------------------


def _tiles(kernel: str, q: torch.Tensor, lk: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, F32) of ``kernel`` ("fwd", "dq", "dkdv") for these inputs."""
    if interpreting():
        bm, bn, warps, f32 = INTERPRETER_BLOCK, INTERPRETER_BLOCK, 1, 1
    elif q.dtype == torch.float32:
        (bm, bn, warps), f32 = LAUNCH_FLOAT32[kernel], 2
    else:
        width = "wide" if _block_d(q) > 64 else "narrow"
        (bm, bn, warps), f32 = LAUNCH[kernel]["light"][width], 0
    fit = lambda s, n: max(16, min(s, triton.next_power_of_2(max(n, 1))))  # noqa: E731
    return fit(bm, q.shape[2]), fit(bn, lk), warps, f32


def _block_d(q: torch.Tensor) -> int:
    return max(16, triton.next_power_of_2(q.shape[-1]))


def block_bounds(lo: torch.Tensor, hi: torch.Tensor, bm: int) -> torch.Tensor:
    """(R, ⌈Lq/bm⌉, 2) int32: per query block of ``bm`` rows, the smallest lo and the largest hi over its rows with a
    key ([0, 0) where none has one); lo, hi (R, Lq) int32 with hi <= lo for an empty row."""
    r, lq = lo.shape
    nb = triton.cdiv(lq, bm)
    pad = nb * bm - lq
    live = hi > lo
    big = torch.iinfo(torch.int32).max
    lo_b = torch.nn.functional.pad(torch.where(live, lo, big), (0, pad), value=big).view(r, nb, bm).amin(-1)
    hi_b = torch.nn.functional.pad(torch.where(live, hi, 0), (0, pad), value=0).view(r, nb, bm).amax(-1)
    lo_b = torch.where(hi_b > 0, lo_b, 0)
    return torch.stack([lo_b, hi_b], -1).to(torch.int32).contiguous()


def key_rows(blocks: torch.Tensor, bm: int, bn: int, lq: int, lk: int) -> torch.Tensor:
    """(R, ⌈Lk/bn⌉, 2) int32: per key block of ``bn`` keys, the query rows [first, stop) of the query blocks of
    ``blocks`` (`block_bounds` at ``bm``) whose key range meets it ([0, 0) where none does); (⌈Lq/bm⌉ × ⌈Lk/bn⌉)
    booleans per row of R, never L × L."""
    nk = triton.cdiv(lk, bn)
    k0 = torch.arange(nk, device=blocks.device, dtype=torch.int32) * bn
    meets = (blocks[:, :, None, 0] < k0 + bn) & (blocks[:, :, None, 1] > k0)  # (R, NQB, NKB)
    qb = torch.arange(blocks.shape[1], device=blocks.device, dtype=torch.int32)[None, :, None]
    first = torch.where(meets, qb, blocks.shape[1]).amin(1)
    last = torch.where(meets, qb, -1).amax(1)
    any_ = last >= 0
    start = torch.where(any_, first * bm, 0)
    stop = torch.where(any_, torch.clamp((last + 1) * bm, max=lq), 0)
    return torch.stack([start, stop], -1).to(torch.int32).contiguous()


def _row_stride(t: torch.Tensor) -> int:
    return 0 if t.shape[0] == 1 else t.stride(0)


def _shapes(q, k) -> dict:
    return {"q": tuple(q.shape), "k/v": tuple(k.shape)}


def span_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, scale: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """One piece forward: (o (B, H, Lq, D) float32, lse (B, H, Lq) float32, −inf where a row sees no key).

    Args:
        q: (B, H, Lq, D); k, v: (B, Hkv, Lk, D), H a multiple of Hkv, one dtype (float32, bfloat16, float16), the last
            dim contiguous.
        lo, hi: (B|1, Lq) int32, contiguous: row i sees the keys lo_i <= j < hi_i (0 <= lo, hi <= Lk; empty where
            hi <= lo).
        scale: the logit scale.
    """
    b, h, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    bm, bn, warps, f32 = _tiles("fwd", q, lk)
    o = torch.empty((b, h, lq, d), dtype=torch.float32, device=q.device)
    lse = torch.empty((b, h, lq), dtype=torch.float32, device=q.device)
    qblk = block_bounds(lo, hi, bm)
    grid = (triton.cdiv(lq, bm), b * h)
    guarded(_span_fwd_kernel, "remap", _shapes(q, k), q.dtype)[grid](
        q, k, v, o, lse, lo, hi, qblk,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2), _row_stride(lo),
        _row_stride(qblk), h, h // hkv, lq, float(scale),
        HEAD_D=d, BLOCK_D=_block_d(q), BLOCK_M=bm, BLOCK_N=bn, F32=f32, num_warps=warps, num_stages=NUM_STAGES,
    )
    return o, lse


def span_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor,
                  delta: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, scale: float
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One piece backward: (dq (B, H, Lq, D), dk, dv (B, Hkv, Lk, D)), float32, from the merged attention.

    Args:
        do: (B, H, Lq, D) the output's gradient, in q's dtype, the last dim contiguous.
        q, k, v, lo, hi, scale: as `span_forward`.
        lse: (B, H, Lq) float32 contiguous, the merged log-sum-exp, +inf where a row sees no key at all.
        delta: (B, H, Lq) float32 contiguous, dO_i · O_i of the merged output.
    """
    b, h, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    dq = torch.empty((b, h, lq, d), dtype=torch.float32, device=q.device)
    dk = torch.empty((b, hkv, lk, d), dtype=torch.float32, device=q.device)
    dv = torch.empty((b, hkv, lk, d), dtype=torch.float32, device=q.device)
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0),
               v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2))
    bm, bn, warps, f32 = _tiles("dq", q, lk)
    qblk = block_bounds(lo, hi, bm)
    guarded(_span_bwd_dq_kernel, "remap", _shapes(q, k), q.dtype)[(triton.cdiv(lq, bm), b * h)](
        q, k, v, do, lse, delta, dq, lo, hi, qblk, *strides, dq.stride(0), dq.stride(1), dq.stride(2),
        _row_stride(lo), _row_stride(qblk), h, h // hkv, lq, float(scale),
        HEAD_D=d, BLOCK_D=_block_d(q), BLOCK_M=bm, BLOCK_N=bn, F32=f32, num_warps=warps, num_stages=NUM_STAGES,
    )
    bm, bn, warps, f32 = _tiles("dkdv", q, lk)
    rows = key_rows(block_bounds(lo, hi, bm), bm, bn, lq, lk)
    guarded(_span_bwd_dkdv_kernel, "remap", _shapes(q, k), q.dtype)[(triton.cdiv(lk, bn), b * hkv)](
        q, k, v, do, lse, delta, dk, dv, lo, hi, rows, *strides, dk.stride(0), dk.stride(1), dk.stride(2),
        dv.stride(0), dv.stride(1), dv.stride(2), _row_stride(lo), _row_stride(rows), h, hkv, h // hkv, lq, lk,
        float(scale),
        HEAD_D=d, BLOCK_D=_block_d(q), BLOCK_M=bm, BLOCK_N=bn, F32=f32, num_warps=warps, num_stages=NUM_STAGES,
    )
    return dq, dk, dv
