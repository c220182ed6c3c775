"""What the Triton kernels of CoPE (``cope/triton_cope.py``) and stick-breaking attention
(``sba/triton_sba.py``) share: the device helpers of their key-tile walks and the host side of their launchers.

Both kernels walk the key tiles of a query block from the diagonal backwards, carrying a per-query sum (CoPE's
gate count, SBA's broken stick) across tiles (with a window, down to its first query's window edge, then, with
attention sinks, the sink keys' tiles: `_sink_walk`);
their backward runs a query-major kernel that stores that carry
every ``CSTRIDE``-th tile ("checkpoints") and a key-major kernel that restarts from the nearest checkpoint.
The device functions here are written undecorated, like every function those kernels call: each kernel module
lists the ones it uses among the helpers of its `LazyJit`, which jits them in
the mode in force and binds them into that module's globals (where its kernels find them by name). None of
them calls another helper, so each works from any module's namespace.

Imported by the two kernel modules only (it imports triton).
"""

from __future__ import annotations

from types import ModuleType
from typing import Callable

import torch
import triton
import triton.language as tl

from ._jit import interpreting
from ._masks import check_sink, check_window

__all__ = [
    "BIG", "DEVICE_HELPERS", "backward_outputs", "backward_tiles", "bhld_out", "carry_layout", "device_offset",
    "dot_precision", "launch_options", "mask_args", "pair_chunks", "pick_blocks", "strides", "window_args",
    "window_switches",
]

#: the carry of rows past the end of the queries (or that see no key of a tile): never blocks an early exit.
BIG = tl.constexpr(1.0e30)


# ----------------------------------------------------------------------------------------------------
# device helpers (undecorated; jitted by each kernel module's LazyJit)


def _add(a, b):
    return a + b


def _min(a, b):
    return tl.minimum(a, b)


def _max(a, b):
    return tl.maximum(a, b)


def _mm(a, b, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b with float32 accumulation (both operands in float32 in the interpreter)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PREC)


def _first_tile(pid_m, Q_OFF, WINDOW, BM: tl.constexpr, BN: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """The first key tile the query block pid_m may see: 0, or with a window the tile of its first query's
    first key (qi − WINDOW + 1); the tiles left of it are never visited (their keys add no gate, break nothing)."""
    t_lo = 0
    if HAS_WINDOW:
        t_lo = tl.maximum(Q_OFF + pid_m * BM - WINDOW + 1, 0) // BN
    return t_lo


def _load_rows(ptr, rows, stride, offs_d, row_ok, d_ok):
    """The (len(rows), BD) tile of rows ``rows`` of a (L, D) slice with row stride ``stride``; 0 outside."""
    return tl.load(ptr + rows[:, None].to(tl.int64) * stride + offs_d[None, :],
                   mask=row_ok[:, None] & d_ok[None, :], other=0.0)


def _query_rows(m, LQ, Q_OFF, BM: tl.constexpr):
    """Query block ``m``: its rows (BM,), which exist (BM,) bool, and their key indices (query i is key
    Q_OFF + i)."""
    rows = m * BM + tl.arange(0, BM)
    row_ok = rows < LQ
    qidx = rows + Q_OFF
    return rows, row_ok, qidx


def _batch_kv_head(pair, HKV):
    """The batch index and the key/value head (int64) of the (batch, key/value head) ``pair``."""
    b = (pair // HKV).to(tl.int64)
    g = (pair % HKV).to(tl.int64)
    return b, g


def _store_rows(ptr, rows, stride, offs_d, row_ok, d_ok, value):
    """Store ``value`` (len(rows), BD) into rows ``rows`` of a (L, D) slice with row stride ``stride``
    (`_load_rows`'s counterpart)."""
    tl.store(ptr + rows[:, None].to(tl.int64) * stride + offs_d[None, :], value, mask=row_ok[:, None] & d_ok[None, :])


def _key_tile(k_base, v_base, t, sk_n, sv_n, offs_d, d_ok, LK, BN: tl.constexpr):
    """Key tile ``t``: its key indices (BN,), which exist (BN,) bool, and its K and V tiles (BN, BD)."""
    keys = t * BN + tl.arange(0, BN)
    k_ok = keys < LK
    tile = k_ok[:, None] & d_ok[None, :]
    k = tl.load(k_base + keys[:, None].to(tl.int64) * sk_n + offs_d[None, :], mask=tile, other=0.0)
    v = tl.load(v_base + keys[:, None].to(tl.int64) * sv_n + offs_d[None, :], mask=tile, other=0.0)
    return keys, k_ok, k, v


def _window_and_mask(ok, rows, keys, qidx, mptr, sm_m, sm_n, WINDOW, SINK, HAS_MASK: tl.constexpr,
                     HAS_WINDOW: tl.constexpr, HAS_SINK: tl.constexpr):
    """(BM, BN) bool: ``ok`` (causal by index, rows and keys in range) and the window's band (with its sink keys
    j < SINK) and the mask: keys outside the window are absent (no weight, no gate, no break), as are the keys the
    mask removes."""
    if HAS_WINDOW:
        band = keys[None, :] > qidx[:, None] - WINDOW
        if HAS_SINK:
            band = band | (keys < SINK)[None, :]
        ok = ok & band
    if HAS_MASK:
        mv = tl.load(mptr + rows[:, None].to(tl.int64) * sm_m + keys[None, :].to(tl.int64) * sm_n, mask=ok, other=0)
        ok = ok & (mv != 0)
    return ok


def _store_checkpoint(c_base, s_base, t, CSTRIDE, LQ, rows, row_ok, carry, other):
    """In the query-major backward: at every ``CSTRIDE``-th key tile (the last of each group of CSTRIDE), store
    the carries at its right edge, the walk's ``carry`` and its second running sum ``other``."""
    if t % CSTRIDE == CSTRIDE - 1:
        slot = t // CSTRIDE
        tl.store(c_base + slot * LQ + rows, carry, mask=row_ok)
        tl.store(s_base + slot * LQ + rows, other, mask=row_ok)


def _query_blocks(n_start, LQ, Q_OFF, WINDOW, SINK, BM: tl.constexpr, BN: tl.constexpr, HAS_WINDOW: tl.constexpr,
                  HAS_SINK: tl.constexpr):
    """In the key-major backward: the query blocks [m_lo, m_hi) that may see a key of the tile starting at key
    ``n_start`` (causal: the first query at or right of it; with a window, the last whose window reaches it, or
    every later one when the tile holds sink keys)."""
    first_row = tl.maximum(n_start - Q_OFF, 0)
    m_lo = first_row // BM
    n_mblocks = (LQ + BM - 1) // BM
    m_hi = n_mblocks
    if HAS_WINDOW:  # query blocks whose first query's window starts right of this tile see none of its keys
        reach = n_start + BN + WINDOW - 2 - Q_OFF  # the last query row whose window reaches the tile
        m_hi = tl.where(reach < 0, 0, tl.minimum(n_mblocks, tl.maximum(reach, 0) // BM + 1))
        if HAS_SINK:
            m_hi = tl.where(n_start < SINK, n_mblocks, m_hi)
    return m_lo, m_hi


def _sink_walk(n_tiles, t_lo, SINK, BN: tl.constexpr, HAS_SINK: tl.constexpr):
    """(steps, window steps, sink tiles) of a query block's walk: the window's tiles n_tiles − 1 down to t_lo, then,
    with sinks, the n_sink tiles holding sink keys left of t_lo (n_sink − 1 down to 0; `_walk_tile`). The
    tiles between them are never visited: their keys are absent, the carries pass them unchanged."""
    n_window = n_tiles - t_lo
    n_sink = 0
    if HAS_SINK:
        n_window = tl.maximum(n_window, 0)
        n_sink = tl.minimum((SINK + BN - 1) // BN, t_lo)
    return n_window + n_sink, n_window, n_sink


def _walk_tile(it, n_tiles, n_window, n_sink, HAS_SINK: tl.constexpr):
    """The key tile of step ``it`` of the walk (`_sink_walk`)."""
    t = n_tiles - 1 - it
    if HAS_SINK:
        t = tl.where(it < n_window, t, n_sink - 1 - (it - n_window))
    return t


def _store_gap_checkpoints(c_base, s_base, n_sink, t_lo, CSTRIDE, LQ, rows, row_ok, carry, other):
    """In the query-major backward, with sinks, before the walk's first sink tile: the checkpoints of the tiles
    between the sinks and the window (n_sink .. t_lo − 1, never walked): their keys are absent, so the carries at
    their right edges are the ones the window's walk ended with (the key-major kernel may start from them)."""
    for slot in range(n_sink // CSTRIDE, t_lo // CSTRIDE):
        tl.store(c_base + slot * LQ + rows, carry, mask=row_ok)
        tl.store(s_base + slot * LQ + rows, other, mask=row_ok)


def _load_checkpoint(c_base, s_base, ckpt, m, rows, row_ok, qidx, sees, LQ, Q_OFF, CSTRIDE,
                     BM: tl.constexpr, BN: tl.constexpr):
    """In the key-major backward: the carries of query block ``m`` at the right edge of checkpoint tile
    ``ckpt`` (0 where the block's last tile is left of it), and the tile to advance them from. Rows that do not
    see the key tile get the carry BIG. Returns (carry, other, start)."""
    dmax = (tl.minimum(m * BM + BM, LQ) - 1 + Q_OFF) // BN
    if ckpt <= dmax:
        ld = row_ok & (qidx // BN >= ckpt)
        carry = tl.load(c_base + (ckpt // CSTRIDE) * LQ + rows, mask=ld, other=0.0)
        other = tl.load(s_base + (ckpt // CSTRIDE) * LQ + rows, mask=ld, other=0.0)
        start = ckpt
    else:
        carry = tl.full((BM,), 0.0, tl.float32)
        other = tl.full((BM,), 0.0, tl.float32)
        start = dmax
    carry = tl.where(sees, carry, BIG)
    return carry, other, start


#: every device helper above, for the kernel modules' LazyJit (each binds them into its own globals).
DEVICE_HELPERS = [
    _add, _min, _max, _mm, _first_tile, _load_rows, _query_rows, _batch_kv_head, _store_rows, _key_tile,
    _window_and_mask, _store_checkpoint, _query_blocks, _load_checkpoint, _sink_walk, _walk_tile,
    _store_gap_checkpoints,
]
#: the combine functions among them, and the equivalents of ``triton.language.standard`` the interpreter binds.
INTERPRETER_COMBINES = {"_add": "_sum_combine", "_min": "_elementwise_min", "_max": "_elementwise_max"}


# ----------------------------------------------------------------------------------------------------
# host side of the launchers


def dot_precision(dtype: torch.dtype) -> str:
    """Dot precision for float32 inputs: 3xTF32 (tensor cores, about float32 accuracy; an "ieee" dot runs on
    the FMA units and spills heavily at these tiles), or TF32 where torch allows it
    (``torch.backends.cuda.matmul.allow_tf32``). Half-precision inputs ignore it."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "tf32x3"
    return "tf32"


def pick_blocks(kind: str, dtype: torch.dtype, tables: ModuleType) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of ``kind`` ("fwd", "bwd_q", "bwd_kv") for inputs of ``dtype``,
    from a kernel module's launch tables, read now (benchmarks and tests override them as module attributes):
    ``INTERPRETER_BLOCKS`` with 1 warp and 1 stage in the interpreter, ``GPU_FP32[kind]`` and
    ``NUM_STAGES["float32"]`` for float32, ``GPU_FWD`` / ``GPU_BWD_Q`` / ``GPU_BWD_KV`` and ``NUM_STAGES["half"]``
    for bfloat16 / float16.

    The tables were chosen offline (no GPU yet; nothing in them is timed) from the cubins of ``python -m
    hf_posenc.kernels.compile_check`` (sm_90 and sm_80, Triton 3.6) at D = 128, the widest head dim: among the
    few candidates compared (see each module's ``GPU_FP32``), the tiles whose shared memory fits an A100's
    per-block limit (166912 B) with the fewest register spills. Half precision keeps its tiles (sm_90, Triton 3.9)
    at 2 stages.
    """
    if interpreting():
        bm, bn = tables.INTERPRETER_BLOCKS
        return bm, bn, 1, 1
    if dtype == torch.float32:
        bm, bn, warps = tables.GPU_FP32[kind]
        return bm, bn, warps, tables.NUM_STAGES["float32"]
    bm, bn, warps = {"fwd": tables.GPU_FWD, "bwd_q": tables.GPU_BWD_Q, "bwd_kv": tables.GPU_BWD_KV}[kind]
    return bm, bn, warps, tables.NUM_STAGES["half"]


def backward_tiles(
    blocks: Callable[[str], tuple[int, int, int, int]], lk: int, slots: int
) -> tuple[int, int, int, tuple[int, int, int], tuple[int, int, int]]:
    """(BLOCK_N, CSTRIDE, NSLOT, (BLOCK_M, num_warps, num_stages) of the query-major backward, the same of the
    key-major one): ``blocks(kind)`` gives each kernel's `pick_blocks`; the two share their key tile BLOCK_N (the
    carry checkpoints are per key tile: `carry_layout`, at most ``slots`` per row). ``ValueError`` where the tables
    give them two."""
    bm1, bn, warps1, stages1 = blocks("bwd_q")
    bm2, bn2, warps2, stages2 = blocks("bwd_kv")
    if bn2 != bn:
        raise ValueError(f"the two backward kernels must share their key tile (BLOCK_N {bn} != {bn2})")
    cstride, nslot = carry_layout(lk, bn, slots)
    return bn, cstride, nslot, (bm1, warps1, stages1), (bm2, warps2, stages2)


def backward_outputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(do, dq, dk, dv) of a backward: ``do`` with a contiguous last dim, dq laid out as `bhld_out`, dk and dv
    (B, Hkv, Lk, D) empty, each in its input's dtype."""
    if do.stride(-1) != 1:
        do = do.contiguous()
    b, h, lq, d = q.shape
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    return do, bhld_out(b, h, lq, d, q), dk, dv


def strides(*tensors: torch.Tensor) -> tuple[int, ...]:
    """The strides of the first three dims of each tensor, in order: the (batch, head, row) strides a kernel takes
    per (B, H, L, D) tensor."""
    return tuple(st for t in tensors for st in t.stride()[:3])


def window_args(window: int | None, sink: int | None) -> tuple[int, int]:
    """(WINDOW, SINK), the kernels' runtime ints (0 for None: the compile-time switches of `window_switches` are off
    then; one compilation serves every size)."""
    return 0 if window is None else window, 0 if sink is None else sink


def window_switches(window: int | None, sink: int | None) -> dict[str, bool]:
    """The compile-time switches HAS_WINDOW and HAS_SINK of a kernel launch."""
    return {"HAS_WINDOW": window is not None, "HAS_SINK": sink is not None}


def launch_options(
    window: object, sink: object, q_offset: int | torch.Tensor, device: torch.device
) -> tuple[int | None, int | None, torch.Tensor]:
    """(window, sink, offset) of a call of the CoPE or SBA kernels, checked: ``window`` None, or an int >= 1: query i
    sees only keys qi − window < j <= qi, the keys outside being absent (no weight; no gate, no break). The
    query-major kernels start their walk at the tile of the first query's window edge; the key-major kernel stops
    at the last query block whose window reaches its keys. ``sink`` None, or an int >= 1 with a ``window``:
    attention sinks, the keys j < sink kept besides the band (as any visible key): the query-major kernels walk the
    sink keys' tiles after the window's (never the tiles between); the key-major program of a tile holding sink keys
    serves every later query block. Both are runtime ints behind compile-time switches (`window_switches`). The
    offset (query i is key ``q_offset + i``) becomes the (1,) int32 tensor the kernels load (`device_offset`).

    Raises:
        TypeError, ValueError: ``window`` or ``sink`` is not None or an int >= 1, or a sink without a window.
    """
    window = check_window(window)
    return window, check_sink(sink, window), device_offset(q_offset, device)


def mask_args(mask: torch.Tensor | None, q: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """(pointer tensor, stride_b, stride_m, stride_n) of the (B|1, 1, Lq, Lk) bool mask, as uint8."""
    if mask is None:
        return q, 0, 0, 0  # never dereferenced (HAS_MASK is False)
    m = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
    sb = 0 if m.shape[0] == 1 else m.stride(0)
    return m, sb, m.stride(2), m.stride(3)


def bhld_out(b: int, h: int, length: int, d: int, like: torch.Tensor) -> torch.Tensor:
    """An empty (B, H, L, D) tensor laid out as (B, L, H, D): the attention function's transpose(1, 2)
    of it is then contiguous and copy-free."""
    return torch.empty((b, length, h, d), dtype=like.dtype, device=like.device).transpose(1, 2)


def carry_layout(lk: int, bn: int, slots: int) -> tuple[int, int]:
    """(CSTRIDE, NSLOT): checkpoints every CSTRIDE key tiles, NSLOT <= ``slots`` of them per query row."""
    n_tiles = triton.cdiv(lk, bn)
    stride = max(1, triton.cdiv(n_tiles, max(1, slots)))
    return stride, max(1, n_tiles // stride)


def pair_chunks(n_pairs: int, per_pair_bytes: int, budget_bytes: int) -> list[tuple[int, int]]:
    """[(first pair, pair count)] covering the n_pairs (batch, key/value head) pairs, each chunk's backward
    buffers (``per_pair_bytes`` a pair) within ``budget_bytes``."""
    per_chunk = max(1, min(n_pairs, budget_bytes // max(1, per_pair_bytes)))
    return [(p, min(per_chunk, n_pairs - p)) for p in range(0, n_pairs, per_chunk)]


def device_offset(q_offset: int | torch.Tensor, device: torch.device) -> torch.Tensor:
    """(1,) int32 on ``device``, loaded by the kernels: a tensor offset (a StaticCache's) is never read on the
    host."""
    return torch.as_tensor(q_offset).to(device=device, dtype=torch.int32).reshape(1)
