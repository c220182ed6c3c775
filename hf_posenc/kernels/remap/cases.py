"""Remapped rotary distances: the one statement of each remap, f(i, j), and its cases.

A rotary's logit q_i · k_j depends on the distance i − j alone (R(a)ᵀR(b) = R(b − a)). The training-free
extensions rotate the pair by a remapped distance f(i, j) instead, bounded by what the model saw in training.
Positions i, j below are the tokens' positions (``position_ids``: the cache index less the row's left padding).

* ``rerope`` (ReRoPE, Su 2023, https://github.com/bojone/rerope, ``rerope_patch.py``):
  f = i − j below the window w, else w (= min(i − j, w)).
* ``leaky_rerope`` (``leaky_rerope_patch.py``): f = i − j below w, else w + (i − j − w) / g (the far queries
  rotated at (i + w(g − 1)) / g, the keys at j / g: a linear scaling by g with the offset w(g − 1)).
* ``self_extend`` (Self-Extend, Jin et al., ICML 2024, arXiv:2401.01325; datamllab/LongLM,
  ``self_extend_patch/Llama.py``): f = i − j below the neighbour window w, else ⌊i/g⌋ − ⌊j/g⌋ + w − ⌊w/g⌋
  (queries at ⌊i/g⌋ + w − w/g, keys at ⌊j/g⌋). LongLM's non-flash patch writes w − w/g with a true division,
  its flash decoding path ⌊w/g⌋; they agree when g divides w, and hf_posenc takes ⌊w/g⌋ (the paper's form).
* ``dca`` (Dual Chunk Attention, An et al., ICML 2024, arXiv:2402.17463; HKUNLP/ChunkLlama,
  ``chunkllama_attn_replace.py``): chunks of c = s − w positions (s the chunk size, w the local window). Keys
  sit at j mod c. A query in the same chunk as the key sits at i mod c (intra-chunk); in the next chunk at
  min(i mod c + c, s) (successive-chunk); farther at min(2c − 1, s) (inter-chunk; ChunkLlama rotates those
  queries by its successive-chunk table at c − 1). So f = (i mod c) − (j mod c), min(i mod c + c, s) − (j mod
  c), or min(2c − 1, s) − (j mod c). ChunkLlama also multiplies the rotary tables of q and k by
  m = 0.05 ln(L/P) + 1 once a forward's length L passes the model's context P (``get_mscale``), which scales
  the logits by m²: hf_posenc applies m² per query, at L = i + 1 (what ChunkLlama's decoding computes for
  each new token; its prefill takes the forward's whole length for every query), see `dca_logit_scale`.
* the window's sinks at their cache positions (StreamingLLM, Xiao et al. 2023, arXiv:2309.17453): with a window
  of W keys and k sinks, a key i − j < W is at its distance; a sink j < k that the window no longer covers
  sits just before the window's oldest key, f = W + k − 1 − j (j the sink's position; the sinks are the first k
  keys by cache index, as for the window; the rule is `hf_posenc.kernels._masks.CacheSinks`, which the position
  terms' engines read too). With the sinks at their text positions
  (``sink_positions="text"``) f = i − j everywhere.

Each remap is stated once here, as `Remap.distance` (the oracle's f) and as `Remap.cases`: the pieces the
engines compute, each a rotation of the queries to ``q_pos(i)`` and of the keys to ``k_pos(j)`` (f = q_pos −
k_pos on the pairs where the piece holds) and, per query, the interval of keys it holds on (``span``), so that
the engines look only at those keys. ``tests/test_remap.py`` checks that the cases cover every pair once
and give `Remap.distance`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from .._masks import CacheSinks

__all__ = ["REMAPS", "Case", "Remap", "dca_logit_scale", "remap_defaults"]

#: the remaps of rope's ``remap`` parameter.
REMAPS = ("rerope", "leaky_rerope", "self_extend", "dca")


def remap_defaults(kind: str, context: int) -> dict[str, int]:
    """The authors' defaults of ``kind`` for a model pretrained at ``context`` positions (P), as
    ``{"remap_window": w, "remap_group": g, "remap_chunk": s}`` (the parameters it reads):

    * rerope: w = P/8 (``rerope_patch.py``: window 512 at training_length 4096);
    * leaky_rerope: w = P/8, g = 16 (``leaky_rerope_patch.py``: window 512, scaling_factor 16 at 4096);
    * self_extend: w = P/4, g = 8 (``self_extend_patch/Llama.py``: group_size_1 = 8, group_size_2 = 1024, the
      neighbour window, for Llama-2 at 4096);
    * dca: s = 3P/4, w = P/8 (``replace_with_chunkllama``: chunk_size = P * 3 // 4, local_window = P // 8)."""
    if kind == "rerope":
        return {"remap_window": context // 8}
    if kind == "leaky_rerope":
        return {"remap_window": context // 8, "remap_group": 16}
    if kind == "self_extend":
        return {"remap_window": context // 4, "remap_group": 8}
    if kind == "dca":
        return {"remap_window": context // 8, "remap_chunk": context * 3 // 4}
    raise ValueError(f"remap must be one of {list(REMAPS)}, got {kind!r}")


def dca_logit_scale(positions: torch.Tensor, context: int) -> torch.Tensor:
    """ChunkLlama's m² per query at ``positions`` (any shape, int): m = 0.05 ln((i + 1)/P) + 1 where i + 1 > P,
    else 1 (``get_mscale``, applied to the rotary tables of q and k, so the logits get m²); float32."""
    n = positions.to(torch.float32) + 1
    m = torch.where(n > context, 0.05 * torch.log(n / context) + 1.0, torch.ones_like(n))
    return m * m


def _bounded(d_min: int, d_max: int | None) -> Callable[[torch.Tensor, torch.Tensor], tuple]:
    """The span of a piece that holds at the distances d_min <= i − j <= d_max (None: unbounded)."""
    def span(pi: torch.Tensor, qi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lo = torch.zeros_like(qi) if d_max is None else qi - d_max
        return lo, qi - d_min + 1
    return span


@dataclass(frozen=True)
class Case:
    """One piece of a remap: where it holds and how it rotates.

    ``span(pi, qi)`` -> (lo, hi): the keys the piece holds on for a query at position ``pi`` and cache index
    ``qi`` (broadcasting int tensors), as cache indices lo <= j < hi (every piece's keys are contiguous; the
    caller clips them to the keys that exist and are valid). ``q_pos(pi)`` / ``k_pos(pj)`` -> the positions the
    queries and keys are rotated to (None: their own, no re-rotation)."""

    name: str
    span: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    q_pos: Callable[[torch.Tensor], torch.Tensor] | None = None
    k_pos: Callable[[torch.Tensor], torch.Tensor] | None = None


@dataclass(frozen=True)
class Remap:
    """A causal remap of rotary distances, or a window with sinks (``kind`` None).

    Args:
        kind: one of `REMAPS`, or None for a plain sliding window.
        window: w of the remaps (rerope, leaky_rerope, self_extend: the neighbour window; dca: the local
            window); or, with ``kind`` None, the sliding window W (keys each query sees, itself included).
        group: g of leaky_rerope and self_extend.
        chunk: s of dca (chunk size; c = s − w positions per chunk).
        sink: with ``kind`` None: the first ``sink`` keys stay visible beside the window.
        sink_positions: ``"text"`` (the sinks at their own positions) or ``"cache"`` (StreamingLLM's: just
            before the window's oldest key).
    """

    kind: str | None
    window: int
    group: int | None = None
    chunk: int | None = None
    sink: int | None = None
    sink_positions: str = "text"

    def __post_init__(self) -> None:
        if self.kind is not None and self.kind not in REMAPS:
            raise ValueError(f"remap must be one of {list(REMAPS)}, got {self.kind!r}")
        if self.window < 1:
            raise ValueError(f"the remap's window must be >= 1, got {self.window}")
        if self.kind in ("leaky_rerope", "self_extend") and (self.group is None or self.group < 1):
            raise ValueError(f"{self.kind} needs a group size g >= 1, got {self.group}")
        if self.kind == "dca" and (self.chunk is None or self.chunk <= self.window):
            raise ValueError(f"dca needs a chunk size s > its local window w ({self.window}), got s = {self.chunk}")
        if self.sink_positions not in ("text", "cache"):
            raise ValueError(f"sink_positions must be 'text' or 'cache', got {self.sink_positions!r}")

    @property
    def chunk_len(self) -> int:
        """c = s − w, dca's positions per chunk."""
        return self.chunk - self.window

    def distance(self, pi: torch.Tensor, pj: torch.Tensor, kj: torch.Tensor | None = None) -> torch.Tensor:
        """f(i, j), float64, for broadcasting int tensors of query and key positions ``pi``, ``pj`` (j <= i;
        ``kj``: the keys' cache indices, which pick the sinks; default ``pj``). The oracle's one formula per
        remap (see the module docstring); the values where j > i are meaningless."""
        pi, pj = pi.to(torch.float64), pj.to(torch.float64)
        d = pi - pj
        w = self.window
        if self.kind is None:
            if self.sink is None or self.sink_positions == "text":
                return d
            kj = pj if kj is None else kj.to(torch.float64)
            return CacheSinks(w, self.sink).delta(d, kj, pj)  # which keys are sinks: by cache index
        if self.kind == "rerope":
            return torch.clamp(d, max=w)
        if self.kind == "leaky_rerope":
            return torch.where(d < w, d, w + (d - w) / self.group)
        if self.kind == "self_extend":
            g = self.group
            grouped = torch.floor(pi / g) - torch.floor(pj / g) + w - math.floor(w / g)
            return torch.where(d < w, d, grouped)
        s, c = self.chunk, self.chunk_len
        ci, cj = torch.floor(pi / c), torch.floor(pj / c)
        ri, rj = pi - ci * c, pj - cj * c
        intra = ri - rj
        succ = torch.clamp(ri + c, max=s) - rj
        inter = min(2 * c - 1, s) - rj
        return torch.where(ci == cj, intra, torch.where(ci - cj == 1, succ, inter))

    def allowed(self, qi: torch.Tensor, kj: torch.Tensor) -> torch.Tensor:
        """Which keys each query sees by cache index (broadcasting): j <= i, and with a plain window (``kind``
        None) i − j < W or j < sink."""
        causal = kj <= qi
        if self.kind is not None:
            return causal
        seen = qi - kj < self.window
        if self.sink is not None:
            seen = seen | (kj < self.sink)
        return causal & seen

    def cases(self) -> list[Case]:
        """The pieces the engines compute (see `Case`): they cover every pair of `allowed` once, and on each
        q_pos − k_pos = `distance`."""
        w = self.window
        near = Case("near", _bounded(0, w - 1))
        if self.kind is None:
            out = [Case("window", near.span)]
            if self.sink is not None:
                k = self.sink

                def sink_span(pi, qi):
                    return torch.zeros_like(qi), torch.clamp(qi - w + 1, max=k)

                # "cache": the sink's key keeps its rotation (at its position j), the query moves to W + k − 1
                q_pos = None if self.sink_positions == "text" else (lambda pi: torch.full_like(pi, w + k - 1))
                out.append(Case("sink", sink_span, q_pos=q_pos))
            return out
        far = _bounded(w, None)
        if self.kind == "rerope":
            return [near, Case("far", far, q_pos=lambda pi: torch.full_like(pi, w), k_pos=torch.zeros_like)]
        if self.kind == "leaky_rerope":
            g = self.group
            return [near, Case("far", far, q_pos=lambda pi: pi.double() / g + (w - w / g),
                               k_pos=lambda pj: pj.double() / g)]
        if self.kind == "self_extend":
            g = self.group
            shift = w - w // g
            return [near, Case("far", far, q_pos=lambda pi: torch.div(pi, g, rounding_mode="floor") + shift,
                               k_pos=lambda pj: torch.div(pj, g, rounding_mode="floor"))]
        s, c = self.chunk, self.chunk_len

        def k_pos(pj):
            return torch.remainder(pj, c)

        def first_of_chunk(pi, qi):  # the cache index of the query's chunk's first position
            return qi - torch.remainder(pi, c)

        def intra(pi, qi):
            return first_of_chunk(pi, qi), qi + 1

        def successive(pi, qi):
            start = first_of_chunk(pi, qi)
            return start - c, start

        def inter(pi, qi):
            return torch.zeros_like(qi), first_of_chunk(pi, qi) - c

        return [
            Case("intra", intra, q_pos=lambda pi: torch.remainder(pi, c), k_pos=k_pos),
            Case("successive", successive, q_pos=lambda pi: torch.clamp(torch.remainder(pi, c) + c, max=s),
                 k_pos=k_pos),
            Case("inter", inter, q_pos=lambda pi: torch.full_like(pi, min(2 * c - 1, s)), k_pos=k_pos),
        ]
