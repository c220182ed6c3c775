"""Tile bookkeeping shared by the tile-wise PyTorch engines of CoPE and stick-breaking attention.

Both encodings need, for every query, sums over its keys taken *from the query backwards* (CoPE's gate
counts p_ij = Σ_{k=j..i} g_ik, SBA's broken stick Σ_{k=j..i-1} softplus(z_ik)). The engines
(``hf_posenc/kernels/cope/tiled.py``, ``hf_posenc/kernels/sba/tiled.py``) walk, per block of queries, the
key blocks right to left, carrying those sums per query across blocks, as the Triton kernels do.

To make every in-tile suffix sum a plain ``cumsum`` (exact, monotone, no flips per tile), the keys and
values are reversed once per call: reversed index r = Lk - 1 - j. A query block then walks r upwards,
and "to the right of key j" means "before r" in the walk. Memory: the reversed keys and values, O(L·D),
and per tile O(B·H·block_m·block_n).

Tiles: for an int ``q_offset`` the walk of the query block [m0, m1) starts at the reversed index of its
last query's diagonal, so tiles above the diagonal are never visited and only the first tiles of the walk
need the causal mask; for a tensor ``q_offset`` (a StaticCache; never read as a number, issue 19) the walk
covers every key and the causal mask is applied in every tile.

A sliding window (``window``: query i sees keys qi − window < j <= qi) ends the walk of an int-offset block
at the reversed index of its first query's window edge: the key tiles left of the window are never visited
(their keys contribute nothing: no weight, and neither a CoPE gate nor a stick-breaking break, exactly as a
mask that removes them), and only the last tiles of the walk need the band mask. With a tensor offset every
tile takes the band mask.

Attention sinks (``sink``, with a window: the keys j < sink are seen besides the band) are walked last, after the
window's tiles: their own tiles when a gap separates them from the block's window (the tiles in the gap are never
visited; the carries pass over it unchanged, its keys being absent), else the walk goes on from the window's edge
down to key 0, the band mask sparing the sink keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._common import compute_dtype
from ._masks import check_sink, check_window

__all__ = [
    "Geometry", "Tile", "blocked_mask_rows", "call_options", "fill_blocked", "from_groups", "key_tiles",
    "query_blocks", "reversed_inputs", "tile_blocked", "tile_sizes", "to_groups", "walk",
]


@dataclass(frozen=True)
class Geometry:
    """Sizes of one call: batch, query heads, key/value heads, group size, Lq, Lk, head_dim."""

    b: int
    h: int
    hkv: int
    groups: int
    lq: int
    lk: int
    d: int

    @staticmethod
    def of(q: torch.Tensor, k: torch.Tensor) -> "Geometry":
        b, h, lq, d = q.shape
        hkv, lk = k.shape[1], k.shape[2]
        return Geometry(b, h, hkv, h // hkv, lq, lk, d)


@dataclass(frozen=True)
class Tile:
    """Reversed key range [r0, r1) of one tile, whether it needs the causal mask, and the window's band mask."""

    r0: int
    r1: int
    causal: bool
    band: bool = False


def key_tiles(
    m0: int, m1: int, lk: int, q_offset: int | torch.Tensor, block_n: int, strict: bool, window: int | None = None,
    sink: int | None = None,
) -> list[Tile]:
    """The tiles (reversed key ranges, right to left in key order) walked by the query block [m0, m1).

    Query i is key ``q_offset + i``; it sees keys j <= q_offset + i (j < with ``strict``), and with a
    ``window`` only keys j > q_offset + i − window, or with ``sink`` keys j < sink (see the module docstring).
    """
    if isinstance(q_offset, torch.Tensor):
        return [Tile(r0, min(r0 + block_n, lk), True, window is not None) for r0 in range(0, lk, block_n)]
    last_key = min(q_offset + m1 - 1 - int(strict), lk - 1)  # the last key any query of the block sees
    start = lk - 1 - last_key  # its reversed index
    if last_key < 0:
        return []
    # rows before the last one see fewer keys: their first (m1 - 1 - m0) reversed indices are masked
    ragged = start + (m1 - 1 - m0)
    stop, edge = lk, lk
    sinks: list[Tile] = []
    if window is not None:
        # the first query sees keys from q_offset + m0 − window + 1: reversed, up to lk − q_offset − m0 + window − 2
        stop = max(start, min(lk, lk - q_offset - m0 + window - 1))
        # the last query's first key, reversed: tiles reaching past it need the band mask
        edge = lk - 1 - (q_offset + m1 - window)
        if sink is not None:
            first = lk - min(sink, lk)  # the last sink key, reversed
            if stop >= first:  # the window's walk reaches the sinks: it goes on down to key 0
                stop = lk
            else:  # their own tiles after a gap; every query of the block is past them (no causal or band mask)
                sinks = [Tile(r0, min(r0 + block_n, lk), False) for r0 in range(first, lk, block_n)]
    return [Tile(r0, min(r0 + block_n, stop), r0 < ragged, min(r0 + block_n, stop) - 1 > edge)
            for r0 in range(start, stop, block_n)] + sinks


def tile_blocked(
    tile: Tile,
    m0: int,
    m1: int,
    lk: int,
    q_offset: int | torch.Tensor,
    strict: bool,
    blocked_rows: torch.Tensor | None,
    device: torch.device,
    window: int | None = None,
    sink: int | None = None,
) -> torch.Tensor | None:
    """(B|1, 1, 1, BM, BN) bool: True where a query of [m0, m1) may NOT use a key of ``tile``; None when
    every query may use every key of it.

    ``blocked_rows``: the block's rows of the inverted mask with reversed keys, (B|1, 1, BM, Lk) (see
    `blocked_mask_rows`). ``window``: the band (keys j <= qi − window blocked, but the ``sink`` first keys)
    in tiles marked ``band``.
    """
    blocked = None
    if tile.causal or tile.band:
        key = (lk - 1) - torch.arange(tile.r0, tile.r1, device=device)
        off = q_offset.to(device) if isinstance(q_offset, torch.Tensor) else q_offset
        qidx = torch.arange(m0, m1, device=device) + off
    if tile.causal:
        blocked = (key[None, :] >= qidx[:, None]) if strict else (key[None, :] > qidx[:, None])
    if tile.band:
        out = key[None, :] <= qidx[:, None] - window
        if sink is not None:
            out = out & (key >= sink)[None, :]
        blocked = out if blocked is None else (blocked | out)
    if blocked_rows is not None:
        m = blocked_rows[..., tile.r0:tile.r1]
        blocked = m if blocked is None else (m | blocked)
    return None if blocked is None else blocked.unsqueeze(-3)


def walk(
    m0: int, m1: int, geo: "Geometry", q_offset: int | torch.Tensor, block_n: int, strict: bool,
    blocked_rows: torch.Tensor | None, device: torch.device, window: int | None = None, sink: int | None = None,
):
    """(tile, blocked) for each key tile the query block [m0, m1) walks, right to left in key order: `key_tiles`
    and each one's `tile_blocked` (arguments as there)."""
    for tile in key_tiles(m0, m1, geo.lk, q_offset, block_n, strict, window, sink):
        yield tile, tile_blocked(tile, m0, m1, geo.lk, q_offset, strict, blocked_rows, device, window, sink)


def blocked_mask_rows(mask: torch.Tensor | None, m0: int, m1: int) -> torch.Tensor | None:
    """Rows [m0, m1) of a (B|1, 1, Lq, Lk) bool mask (True = may attend), inverted, with the keys reversed:
    (B|1, 1, BM, Lk), True = blocked."""
    if mask is None:
        return None
    return ~mask[:, :, m0:m1].flip(-1)


def to_groups(x: torch.Tensor, geo: Geometry, m0: int, m1: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows [m0, m1) of a (B, H, Lq, X) tensor as (B, Hkv, G·BM, X) in ``dtype``: always a new contiguous
    tensor (callers scale it in place), the query heads of one key/value head stacked, so one matmul serves
    a whole GQA group."""
    out = torch.empty(geo.b, geo.hkv, geo.groups * (m1 - m0), x.shape[-1], dtype=dtype, device=x.device)
    out.view(geo.b, geo.h, m1 - m0, x.shape[-1]).copy_(x[:, :, m0:m1])
    return out


def from_groups(x: torch.Tensor, geo: Geometry, bm: int) -> torch.Tensor:
    """(B, Hkv, G·BM, X) back to (B, H, BM, X) (a view)."""
    return x.view(geo.b, geo.h, bm, x.shape[-1])


#: elements of one (B, H, block_m, block_n) float tile when the key tile is sized automatically.
TILE_ELEMENTS = 1 << 21


def tile_sizes(geo: Geometry, block_m: int, block_n: int | None) -> tuple[int, int]:
    """(block_m, block_n): ``block_n`` None sizes the key tile to about ``TILE_ELEMENTS`` per float tile
    (a multiple of 64, at least 64, at most Lk). Key tiles cost no extra work (the walk starts at each query
    block's diagonal; only the block_m x block_m triangle there is masked work), so they are made as long
    as memory allows: fewer, larger operations."""
    if block_n is None:
        per_key = max(1, geo.b * geo.h * block_m)
        block_n = max(64, (TILE_ELEMENTS // per_key) // 64 * 64)
    return block_m, max(1, min(block_n, max(1, geo.lk)))


def reversed_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_m: int, block_n: int | None
) -> tuple["Geometry", int, int, torch.dtype, torch.Tensor, torch.Tensor]:
    """What a walk starts from: (geo, block_m, block_n, dtype, kr, vr), the call's sizes, its tile sizes
    (`tile_sizes`), the compute dtype (float32; float64 for float64 inputs) and the keys and values reversed along
    Lk (reversed index r = Lk - 1 - j), in that dtype."""
    geo = Geometry.of(q, k)
    block_m, block_n = tile_sizes(geo, block_m, block_n)
    dtype = compute_dtype(q.dtype)
    return geo, block_m, block_n, dtype, k.flip(2).to(dtype), v.flip(2).to(dtype)


def query_blocks(lq: int, block_m: int):
    """(m0, m1, bm) for each block [m0, m1) of ``block_m`` queries (bm = m1 - m0: the last one may be shorter)."""
    for m0 in range(0, lq, block_m):
        m1 = min(m0 + block_m, lq)
        yield m0, m1, m1 - m0


def fill_blocked(x: torch.Tensor, blocked: torch.Tensor | None, value: float) -> torch.Tensor:
    """Fill, in place, the entries of a (B, Hkv, G·BM, BN) tile that ``blocked`` (B|1, 1, 1, BM, BN) marks."""
    if blocked is not None:
        x.view(x.shape[0], x.shape[1], -1, blocked.shape[-2], x.shape[-1]).masked_fill_(blocked, value)
    return x


def call_options(
    block_m: int | None, block_n: int | None, default_m: int, default_n: int | None, q_offset: int | torch.Tensor,
    window: object = None, sink: object = None,
) -> tuple[int, int | None, int | torch.Tensor]:
    """The (block_m, block_n, q_offset) an engine's autograd Function is applied with: the query block and key tile
    sizes, the engine module's defaults (``BLOCK_M``, ``BLOCK_N``, read at each call) where None is given
    (``block_n`` None: sized to memory, `tile_sizes`), checked positive; an int offset, or a 0-d tensor (a
    StaticCache's) snapshotted (the cache mutates its length in place before backward) and never read as a number
    (every key tile is then walked, with the causal mask). The walk of an int-offset query block stops at its first
    query's ``window`` edge, and visits the ``sink`` keys' tiles after the window's (module docstring). Raises
    ``ValueError`` for a non-positive size, and ``TypeError`` / ``ValueError`` for a ``window`` that is neither None
    nor an int >= 1, or a ``sink`` that is neither None nor an int >= 1 with a window."""
    check_sink(sink, check_window(window))
    block_m = default_m if block_m is None else block_m
    block_n = default_n if block_n is None else block_n
    if block_m < 1 or (block_n is not None and block_n < 1):
        raise ValueError(
            f"block_m and block_n must be positive (block_n None: sized to memory), got {block_m}, {block_n}"
        )
    if isinstance(q_offset, torch.Tensor):
        q_offset = q_offset.detach().clone()
    return int(block_m), block_n, q_offset
