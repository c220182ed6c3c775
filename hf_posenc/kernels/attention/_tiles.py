"""The tile engine's tiles (see ``tiled.py`` for the engine): the call's plan and geometry, each term's tile of
values by form (a Toeplitz term's strided view of its per-distance values from the term registry, a gate's
per-token vector, FIRE's table cells, Shaw's buckets), the masks, and the per-tile helpers both engine paths use."""

from __future__ import annotations

import torch

from .._masks import CacheSinks
from .term_spec import KernelTerm, term_spec


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def distance_values(term: KernelTerm, delta: torch.Tensor) -> torch.Tensor:
    """The Toeplitz term at distances ``delta`` (N,) (δ = qi − j, integer-valued) -> (H, N), from its registry
    entry's ``distance``, in the term's compute dtype (float32, float64 for float64 tensors), differentiable in
    the term's tensors."""
    spec = term.spec
    if spec.form != "toeplitz":
        raise ValueError(f"{term.kind!r} is not a Toeplitz term")
    heads = torch.arange(term.num_heads, device=delta.device)[:, None]
    return spec.distance_values(term.tensors, heads, delta[None])


class PairTiles:
    """A pair term's tiles on the tile engine (its ``terms.TermSpec``'s ``tiles``, a subclass of this one),
    built once per call and direction (forward, backward) from the call's plan, the term's tensors by name and the
    compute dtype. What the engine asks of it, in order: ``block`` once per query block, ``bias`` per tile
    (and ``add_values`` on the online forward); in backward ``start_backward``, then per query block
    ``backward_block``, per tile ``grad_dp`` and ``grad_tile``, per block ``end_block``, and at the
    end ``grads``. The defaults describe a term with no value term and no gradient reduction of its own."""

    #: whether ``bias`` returns a new tensor of the tile's full shape (B, H, n, m): the logits are then added
    #: into it in place.
    fresh = False
    #: a fused-CPU path of its own (``_tiled_fused``): ``fused_forward(plan, tile, q, k, v, valid, q_off, b, h,
    #: d, out, lse)`` and ``fused_backward(plan, tile, q, k, v, out, lse, do, valid, q_off, b, h, hkv, d)`` -> (dq,
    #: dk, dv, {name: gradient}); None: the engine's float-mask path (a fresh bias per block).
    fused_forward = None
    fused_backward = None

    def __init__(self, plan: "_Plan", tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        self.plan, self.dtype = plan, dtype

    @classmethod
    def fused(cls, plan: "_Plan") -> bool:
        """Whether the fused-CPU path takes this call (the autotuner then chooses between it and the online passes)."""
        return True

    def spread(self) -> float | None:
        """The largest gap between two of the term's values within a head (an upper bound), or None where it is not
        cheap to know."""
        return None

    def block(self, qb: torch.Tensor) -> torch.Tensor | None:
        """A query block's context for ``bias`` (shaw: scale · q · a^K), from its scaled queries qb (B, H, n, D)."""
        return None

    def bias(self, qi: torch.Tensor, q0: int, q1: int, k0: int, k1: int, ctx: torch.Tensor | None) -> torch.Tensor:
        """The term on the tile of the queries at key indices ``qi`` (rows q0 .. q1 − 1) and the keys k0 .. k1 − 1,
        broadcastable to (B, H, n, m)."""
        raise NotImplementedError

    def add_values(self, acc: torch.Tensor, p: torch.Tensor, qi: torch.Tensor, k0: int, k1: int) -> None:
        """The value term's share of a tile (probabilities ``p`` (B, H, n, m), unnormalised) added to ``acc``."""

    def start_backward(self, need: dict[str, bool]) -> None:
        """Before the backward passes: which of the term's tensors need a gradient."""

    def backward_block(self, qb: torch.Tensor, dob: torch.Tensor, ctx: torch.Tensor | None) -> object:
        """A query block's state for the backward (scaled queries qb, output gradient dob, ``block``'s ctx)."""
        return None

    def grad_dp(self, state: object, dp: torch.Tensor, p: torch.Tensor, qi: torch.Tensor, k0: int, k1: int) -> None:
        """The value term's share of dP (B, H, n, m), added in place (and its tables' gradient from ``p``)."""

    def grad_tile(self, state: object, ds: torch.Tensor, qi: torch.Tensor, q0: int, q1: int, k0: int, k1: int) -> None:
        """A tile's dS (B, H, n, m) reduced into the term's gradients."""

    def end_block(self, state: object, qb: torch.Tensor) -> torch.Tensor | None:
        """After a query block: what its rows' dq (of the scaled queries) gains from the term, or None."""
        return None

    def grads(self) -> dict[str, torch.Tensor]:
        """The term tensors' gradients, by name (absent: none)."""
        return {}


def _skew_buffer(like: torch.Tensor, m: int) -> torch.Tensor:
    """An uninitialised (..., n, m + n) buffer for a tile (..., n, m) whose anti-diagonals
    `_antidiagonal_sums` will sum: the tile is written into its first m columns, the n others are zero."""
    n = like.shape[-2]
    buf = like.new_empty(*like.shape[:-1], m + n)
    buf[..., m:].zero_()
    return buf


def _antidiagonal_sums(buf: torch.Tensor, m: int) -> torch.Tensor:
    """buf (B, H, n, m + n) from `_skew_buffer`, the tile ds in its first m columns -> (H, n + m − 1):
    entry c = Σ_{b, i + j = c} ds[b, :, i, j].

    The Toeplitz tiles run with their query rows reversed (row i' is query q1 − 1 − i'), so the diagonals
    of constant δ = qi − j are these anti-diagonals. Skew trick: rows of length m + n read back with row length
    m + n − 1: row i is shifted right by i (the zero columns fill the gaps)."""
    b, h, n, _ = buf.shape
    skew = buf.view(b, h, n * (m + n))[..., : n * (m + n - 1)].view(b, h, n, m + n - 1)
    return skew.sum((0, 2))


class _Plan:
    """What one call needs besides q, k, v: shapes, the term's detached precomputation, tile geometry."""

    def __init__(
        self,
        kind: str,
        names: tuple[str, ...],
        ints: dict[str, int],
        scale: float,
        causal: bool,
        q_offset: int | None,
        block_q: int,
        block_k: int,
        window: int | None = None,
        sink: int | None = None,
        cache_sinks: CacheSinks | None = None,
    ) -> None:
        self.kind, self.names, self.ints = kind, names, ints
        self.spec = term_spec(kind)
        self.form = self.spec.form
        self.scale, self.causal, self.q_offset = scale, causal, q_offset
        self.block_q, self.block_k = block_q, block_k
        self.window = window
        #: attention sinks (with a window): the keys j < sink are seen besides the band (causal: by the queries at
        #: or after them). Their key tiles are visited, the tiles between them and the window are not.
        self.sink = sink if window is not None else None
        #: the sinks at their cache positions (``sink_positions="cache"``, a Toeplitz term): the far sinks' term at
        #: their cache distance (`_Tile.bias`, `_Tile.far_sink_grads`); None: at their text positions.
        self.cache_sinks = cache_sinks if self.sink is not None else None
        #: the autotuner's choice between the two exact CPU paths (hf_posenc.kernels.autotune, site
        #: ``tiled.engine``): True for torch's fused kernel per block, False for the online passes, None where
        #: the fused kernel does not apply (``_flash_available`` decides). Forward and backward read the same one.
        self.fused: bool | None = None

    def term(self, tensors: tuple[torch.Tensor, ...]) -> KernelTerm:
        return KernelTerm(self.kind, dict(zip(self.names, tensors)), dict(self.ints))

    def key_stop(self, q1: int, k_len: int) -> int:
        """End of the keys the queries before ``q1`` may see: all of them unless causal or windowed with an int
        offset (the last query q1 − 1 sees keys up to its own index, or up to index + window − 1 bidirectionally;
        bidirectional with sinks, at least up to the last sink key)."""
        if self.q_offset is None:
            return k_len
        if self.causal:
            return max(0, min(k_len, self.q_offset + q1))
        if self.window is not None:
            return max(0, min(k_len, max(self.q_offset + q1 - 1 + self.window, self.sink or 0)))
        return k_len

    def key_start(self, q0: int, k_len: int) -> int:
        """First key of the window's range for the queries from ``q0`` on: 0 unless windowed with an int offset (the
        first query q0 sees keys from its index − window + 1; 0 where that edge is at or before the end of the
        sinks, which then join the range); the key tiles before it are never built (but the sinks', see
        `key_ranges`)."""
        if self.window is None or self.q_offset is None:
            return 0
        start = max(0, min(k_len, self.q_offset + q0 - self.window + 1))
        return 0 if self.sink is not None and start <= self.sink else start

    def key_ranges(self, q0: int, q1: int, k_len: int) -> list[tuple[int, int]]:
        """The keys the queries q0 .. q1 − 1 may see, as disjoint ranges [lo, hi) in key order (none empty): the
        sink keys [0, sink) when a gap separates them from the window's range, then [key_start, key_stop). Every
        query of the block sees every sink key of such a separate range by position (causal: each query is past
        its window's first key, which is past the sinks)."""
        start, stop = self.key_start(q0, k_len), self.key_stop(q1, k_len)
        ranges = [(0, min(self.sink, k_len))] if self.sink is not None and start > 0 else []
        if stop > start:
            ranges.append((start, stop))
        return ranges


def _rows(x: torch.Tensor, reverse: bool, dim: int = -2) -> torch.Tensor:
    """``x`` with its query rows (dimension ``dim``) reversed when ``reverse`` (the Toeplitz tiles' order)."""
    return x.flip(dim) if reverse else x


def _query_index(q_off: int | torch.Tensor, q0: int, q1: int, device: torch.device) -> torch.Tensor:
    """Key index (n,) int64 of the queries q0 .. q1 − 1."""
    return torch.arange(q0, q1, device=device) + q_off


def _query_blocks(plan: "_Plan", q_len: int, k_len: int, q_off, device: torch.device):
    """(q0, q1, key index of the queries q0 .. q1 − 1, the key ranges they may see (``_Plan.key_ranges``)) per
    query block."""
    for q0 in range(0, q_len, plan.block_q):
        q1 = min(q0 + plan.block_q, q_len)
        yield q0, q1, _query_index(q_off, q0, q1, device), plan.key_ranges(q0, q1, k_len)


def _apply_mask(
    s: torch.Tensor, plan: _Plan, qi: torch.Tensor, q0: int, k0: int, k1: int, valid: torch.Tensor | None
) -> torch.Tensor:
    """Fill the masked logits of a tile s (B|1, H, n, m) (keys k0 .. k1 − 1, queries at key indices ``qi``,
    in any row order) with −inf, in place (made B wide first when the padding differs per batch).
    With an int offset only the columns right of the block's first query are compared (the causal window).
    The sink keys (``plan.sink``) are exempt from the window's edges (not from causality)."""
    if valid is not None and valid.shape[0] > s.shape[0]:
        s = s.expand(valid.shape[0], *s.shape[1:]).contiguous()
    w = plan.window
    sink = plan.sink or 0
    if plan.causal or w is not None:  # upper edge: j <= qi (causal), j < qi + window (bidirectional window)
        reach = 1 if plan.causal else w
        c0 = k0 if plan.q_offset is None else max(k0, plan.q_offset + q0 + reach)
        if not plan.causal:  # every query sees the sinks
            c0 = max(c0, sink)
        if c0 < k1:
            cols = torch.arange(c0, k1, device=s.device)
            s[..., c0 - k0 :].masked_fill_(cols[None, :] >= qi[:, None] + reach, float("-inf"))
    if w is not None:  # lower edge of the window: j > qi − window; only columns left of the last query's edge
        c1 = k1 if plan.q_offset is None else min(k1, plan.q_offset + q0 + qi.shape[0] - w)
        lo = max(k0, sink)  # right of the sinks
        if c1 > lo:
            cols = torch.arange(lo, c1, device=s.device)
            s[..., lo - k0 : c1 - k0].masked_fill_(cols[None, :] <= qi[:, None] - w, float("-inf"))
    if valid is not None:
        s.masked_fill_(~valid[:, None, None, k0:k1], float("-inf"))
    return s


class _Tile:
    """The term's contribution to one (query block, key block) tile, and the reduction of its gradient."""

    def __init__(self, plan: _Plan, tensors: tuple[torch.Tensor, ...], q_off: int | torch.Tensor,
                 q_len: int, k_len: int, dtype: torch.dtype, device: torch.device) -> None:
        self.plan, self.kind, self.form = plan, plan.kind, plan.form
        self.t = dict(zip(plan.names, tensors))
        self.q_off, self.q_len, self.k_len = q_off, q_len, k_len
        self.dtype, self.device = dtype, device
        if self.form == "toeplitz":
            # δ = q_offset + r for r = i − j = −(Lk − 1) .. Lq − 1, indexed by e = r + Lk − 1
            self.delta = torch.arange(-(k_len - 1), q_len, device=device) + q_off
            with torch.no_grad():
                values = distance_values(plan.term(tensors), self.delta).to(dtype)
            self.rev = values.flip(-1).contiguous()  # rev[t] = F[N − 1 − t]
            self.squares: dict[int, torch.Tensor] = {}  # the diagonal square's term per size (see square)
        #: with the sinks at their cache positions: each sink key's cache distance (k,) and the term there (H, k)
        self.sink_delta = self.sink_values = None
        if self.form == "toeplitz" and plan.cache_sinks is not None:
            self.sink_delta = plan.cache_sinks.distance(torch.arange(min(plan.sink, k_len), device=device))
            with torch.no_grad():
                self.sink_values = distance_values(plan.term(tensors), self.sink_delta).to(dtype)
        #: a pair term's tiles (its registry entry's ``tiles``), else None
        self.pair = plan.spec.tiles(plan, self.t, dtype) if self.form == "pair" else None
        if self.form == "gate":
            self.c = tensors[0].detach().to(dtype)  # a gate's per-token vector c (B, H, Lk)
        elif plan.spec.slope is not None and plan.causal and plan.q_offset is not None:  # for the key channel
            # −s[h] · |δ| (ALiBi's form) is FoX's c with a constant log-gate −s (see key_channel and _slope_channel)
            self.slopes = plan.spec.slope(self.t).detach().to(dtype)
            self.c = -(self.slopes[:, None] * torch.arange(k_len, device=device, dtype=dtype))[None]  # (1, H, Lk)

    def spread(self) -> float | None:
        """The largest gap between two of the term's values within a head (an upper bound), or None where it is
        not cheap to know (data-dependent terms)."""
        if self.form == "toeplitz":
            values = self.rev if self.sink_values is None else torch.cat([self.rev, self.sink_values], -1)
            return float((values.amax(-1) - values.amin(-1)).max()) if values.numel() else 0.0
        if self.pair is not None:
            return self.pair.spread()
        if self.form == "none":
            return 0.0
        return None

    def square(self, qi: torch.Tensor, q0: int, q1: int, k0: int, b: int, h: int) -> torch.Tensor | None:
        """The term on a block's diagonal square (queries at key indices ``qi`` = k0 .. k0 + n − 1, rows in order,
        keys k0 .. k0 + n − 1): (B, H, n, n), or None without a term. A Toeplitz term's square is the same on
        every block (δ = i − j): one copy per size for the call."""
        n = q1 - q0
        if self.form == "toeplitz":
            if n not in self.squares:
                self.squares[n] = self.bias(None, q0, q1, k0, k0 + n, None).flip(-2)  # rows back in order
            sq = self.squares[n]
        else:
            sq = self.bias(qi, q0, q1, k0, k0 + n, None)
        return None if sq is None else sq.expand(b, h, n, n)

    def key_channel(self, qi: torch.Tensor, k0: int, k1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """FoX's (and a causal −s[h] · |δ| term's, ALiBi's) term as one more key channel, for the queries at key
        indices ``qi``: (c[r] − c[j] for the keys k0 .. k1 − 1 (B|1, H, m), c[r] (B|1, H, 1)), r the block's middle
        query.

        The bias c[qi] − c[j] is the row constant c[qi] − c[r] (which a softmax row ignores) plus c[r] − c[j]:
        small near the diagonal, where the weight is (at most half a block of log-gates, which float32 rounds to
        ~1e-7 of it); the row's log-sum-exp is kept in that frame, in forward and backward alike. ALiBi's
        channel is slope · (j − r), rounded once (c[r] − c[j] would carry the rounding of two large values)."""
        r = qi[qi.shape[0] // 2 :][:1]
        ref = self.c.index_select(-1, r)
        if self.form == "gate":
            return ref - self.c[..., k0:k1], ref
        dist = (torch.arange(k0, k1, device=qi.device) - r).to(self.dtype)
        return (self.slopes[:, None] * dist[None])[None], ref

    def _far_sinks(self, qi: torch.Tensor, k0: int, k1: int) -> torch.Tensor:
        """(n, s) bool: which of the sink keys k0 .. k0 + s − 1 of the tile of keys k0 .. k1 − 1 (the sinks among them)
        the rows at key indices ``qi`` (in the tile's row order) see outside their window (`CacheSinks.far`)."""
        j = torch.arange(k0, min(k1, self.sink_values.shape[-1]), device=qi.device)
        return self.plan.cache_sinks.far(qi[:, None] - j[None, :], j[None, :])

    def far_sink_grads(self, ds: torch.Tensor, qi: torch.Tensor, k0: int, k1: int, g_sink: torch.Tensor) -> None:
        """With the sinks at their cache positions: the dS (B, H, n, m) of the tile's far sinks (rows at key indices
        ``qi``, keys k0 .. k1 − 1) summed into their per-sink gradient ``g_sink`` (H, k) and zeroed in ``ds`` in
        place, so that the anti-diagonal sums (the gradient per distance δ = qi − j) leave them out."""
        if self.sink_values is None or k0 >= self.sink_values.shape[-1]:
            return
        far = self._far_sinks(qi, k0, k1)
        sinks = ds[..., : far.shape[-1]]
        g_sink[:, k0 : k0 + far.shape[-1]] += sinks.masked_fill(~far, 0.0).sum((0, 2))
        sinks.masked_fill_(far, 0.0)

    def bias(self, qi: torch.Tensor, q0: int, q1: int, k0: int, k1: int, ctx_q: torch.Tensor | None):
        """The additive term of the tile, broadcastable to (B, H, n, m), or None."""
        n, m = q1 - q0, k1 - k0
        if self.form == "toeplitz":  # rows reversed: row i' is query q1 − 1 − i', T[i', j] = rev[t0 + i' + j]
            t0 = self.q_len - q1 + k0
            view = self.rev.unfold(-1, m, 1)[None, :, t0 : t0 + n]  # (1, H, n, m), a strided view
            if self.sink_values is None or k0 >= self.sink_values.shape[-1]:
                return view
            far = self._far_sinks(qi, k0, k1)  # a tile that holds sinks: theirs at their cache distance
            out = view.clone()
            sinks = out[..., : far.shape[-1]]
            sinks.copy_(torch.where(far, self.sink_values[None, :, None, k0 : k0 + far.shape[-1]], sinks))
            return out
        if self.form == "gate":
            if isinstance(self.q_off, torch.Tensor):
                cq = self.c.index_select(-1, qi)
            else:
                cq = self.c[..., self.q_off + q0 : self.q_off + q1]
            return cq[..., :, None] - self.c[..., None, k0:k1]
        if self.pair is not None:
            return self.pair.bias(qi, q0, q1, k0, k1, ctx_q)
        return None


def _prepare(query, key, value, plan: _Plan, tensors):
    dtype = _compute_dtype(query.dtype)
    b, h, q_len, d = query.shape
    hkv, k_len = key.shape[1], key.shape[2]
    q = query.to(dtype) * plan.scale
    k = key.to(dtype)
    v = value.to(dtype)
    return dtype, b, h, hkv, q_len, k_len, d, q, k, v


def _group(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """(B, H, n, X) -> (B, Hkv, G·n, X): the G query heads of each key/value head stacked (h = kv·G + g)."""
    b, h, n, e = x.shape
    if h == hkv:
        return x
    return x.reshape(b, hkv, (h // hkv) * n, e)


def _ungroup(x: torch.Tensor, h: int) -> torch.Tensor:
    b, hkv, gn, e = x.shape
    return x if h == hkv else x.reshape(b, h, gn * hkv // h, e)


def _empty_rows(plan: _Plan, qi: torch.Tensor, valid: torch.Tensor | None, k_start: int,
                k_stop: int) -> torch.Tensor | None:
    """(B|1, 1, n, 1) bool: query rows that see no key among the keys k_start .. k_stop − 1 (left padding, a window
    past the keys), or None when every row sees one (with one range per block, those are the block's keys: the
    others are outside every row's view)."""
    if plan.window is not None:
        w = plan.window
        lo = (qi - w + 1).clamp(k_start, k_stop)  # each row's visible key range [lo, hi) by position
        hi = (qi + (1 if plan.causal else w)).clamp(k_start, k_stop)
        hi = torch.maximum(hi, lo)
        if plan.sink is not None:  # and its sink keys [k_start, sk) (causal: up to its own), overlapping [lo, both)
            sk = (torch.clamp(qi + 1, max=plan.sink) if plan.causal else torch.full_like(qi, plan.sink))
            sk = sk.clamp(k_start, k_stop)
            both = torch.maximum(torch.minimum(hi, sk), lo)
        if valid is None:
            seen = hi - lo if plan.sink is None else hi - lo + (sk - k_start) - (both - lo)
            return (seen == 0)[None, None, :, None]
        count = torch.cat([valid.new_zeros(valid.shape[0], 1, dtype=torch.long),
                           valid[:, k_start:k_stop].long().cumsum(-1)], dim=-1)  # [b, t]: valid keys < k_start + t
        at = lambda x: count.index_select(-1, x - k_start)  # noqa: E731
        # the band's keys, plus the sinks' (count[k_start] = 0) less those in both: at(both) − at(lo)
        seen = at(hi) - at(lo) if plan.sink is None else at(hi) + at(sk) - at(both)
        return (seen == 0)[:, None, :, None]
    if valid is None:
        return None
    v = valid[:, :k_stop]
    if plan.causal:
        seen_any = torch.cat([v.new_zeros(v.shape[0], 1), v.cumsum(-1) > 0], dim=-1)  # [b, t]: a valid key < t
        idx = (qi + 1).clamp(0, k_stop)
        return ~seen_any.index_select(-1, idx)[:, None, :, None]
    return ~v.any(-1)[:, None, None, None].expand(-1, 1, qi.shape[0], 1)


def _expand_heads(x: torch.Tensor, h: int) -> torch.Tensor:
    """(B, Hkv, L, D) -> (B, H, L, D) (a broadcast view made contiguous: the fused kernel takes no GQA)."""
    b, hkv, n, d = x.shape
    return x if hkv == h else x[:, :, None].expand(b, hkv, h // hkv, n, d).reshape(b, h, n, d)


def _logits(qg: torch.Tensor, kb: torch.Tensor, bias: torch.Tensor | None, h: int, fresh: bool) -> torch.Tensor:
    """q · k + bias of a tile (B, H, n, m), from the grouped queries qg (B, Hkv, G·n, D) and keys kb (B, Hkv, m, D).
    A ``fresh`` bias of the full shape (FIRE's, built for this tile) takes the product in place (``baddbmm_``: one
    pass over the tile less than a product and an add)."""
    b, hkv, gn, d = qg.shape
    m = kb.shape[2]
    if bias is not None and fresh and bias.shape == (b, h, gn * hkv // h, m) and bias.is_contiguous():
        bias.view(b * hkv, gn, m).baddbmm_(qg.reshape(b * hkv, gn, d), kb.reshape(b * hkv, m, d).transpose(1, 2))
        return bias
    s = _ungroup(qg @ kb.transpose(-1, -2), h)
    if bias is None:
        return s
    return s + bias if s.shape != torch.broadcast_shapes(s.shape, bias.shape) else s.add_(bias)
