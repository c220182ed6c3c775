"""``sba``: stick-breaking attention (replaces the softmax; no other position term).

"Scaling Stick-Breaking Attention: An Efficient Implementation and In-depth Study", Tan, Yang, Courville,
Panda and Shen 2024 (ICLR 2025), https://arxiv.org/abs/2410.17980. "The code" below is the authors'
implementation, github.com/shawntan/stickbreaking-attention (``stickbreaking_attention/sb_ref.py``, the
Triton kernels ``sb_varlen`` with ``attend_current=False`` by default, and the softplus with its linear
branch above 15 in ``sb_varlen/softplus.py``), and their Dolomite Engine model (``SBAttention``,
``decoding_stickbreaking``).

For query i (a token at key index i) and keys j < i, with z_ij = s · q_i·k_j (s = the model's logit
scale, 1/sqrt(head_dim), the code's ``inv_temp``), each key, from the nearest backwards, breaks off a
fraction β_ij = σ(z_ij) of what is left of the stick:

    A_ij = β_ij Π_{j<k<i} (1 − β_ik)
         = exp( z_ij − Σ_{k=j}^{i−1} softplus(z_ik) )          (the log-space form that is computed)
    o_i  = Σ_{j<i} A_ij v_j

using log β = z − softplus(z) and log(1 − β) = −softplus(z), with the stabilised softplus of the code,
softplus(x) = x if x > 15 else log(1 + exp(x)) (``F.softplus(x, threshold=15)``). Everything is computed
in float32 (float64 for float64 inputs): the softplus terms are masked (to 0) where the key is masked
(padding, future, empty cache slots), summed from the right with a reversed cumulative sum, and
exponentiated with masked entries at −inf, so extreme logits (±1e4) stay finite (a key with z = +1e4
takes the whole stick, one with z = −1e4 none of it).

``attend_current`` (default False, the paper's and the code's default): whether the query's own key is a
breakpoint too; with True the products and sums run up to k = i and o_i includes A_ii v_i.

``remainder`` -- what becomes of the stick left after every key, r_i = 1 − Σ_j A_ij = Π_j (1 − β_ij)
= exp(−Σ_j softplus(z_ij)) (computed in that exact, non-negative form):

* ``"discard"`` (default; the paper's formula, and the code's ``sb_attn``, which returns it separately as
  ``rem``): o_i = Σ_j A_ij v_j, the weights of a row sum to less than 1 (the first token of a sequence, which
  has no earlier key, gets o = 0).
* ``"current"``: the remaining stick goes to the query's own value, o_i += r_i v_i (the
  ``o = o + rem[..., None] * v`` of the code's tests, ``tests/test_varlen.py``); the returned
  probabilities then carry r_i on the diagonal and every row sums to 1.
* ``"bias"``: o_i += r_i b_h with a learned vector b_h per head and layer, initialised to zero -- the
  ``head_bias`` of the authors' trained Dolomite model (which also applies a GroupNorm over heads to the
  attention output; that norm is an architecture change outside the position encoding and is not added).

Grouped-query models: each query head uses its own q against its key/value head's keys (``expand_kv``).
Padding: masked keys are no breakpoints (their softplus terms are 0) and get no weight, so a left-padded
row gives the weights of the row alone. KV cache: A_ij involves q_i and the keys only, so the cache holds
all it needs; nothing else is stored.
The causal reference (``stick_breaking_attention``) takes tensors only and lives beside the kernels, in
`hf_posenc.kernels.sba.naive`.

ViT (bidirectional), a documented generalisation. The paper breaks the stick over the keys in order from
the query outwards (nearest first) and defines no order for an image; here each query orders its keys by
their distance to it on the patch grid and breaks the stick nearest first:

    rank_i(j): the query's own key first (distance 0; a breakpoint only with ``attend_current``), then the
               patches by squared Euclidean grid distance to query i, ties broken in raster order, the CLS
               key last; the CLS query (no grid position) orders the patches in raster order
    A_ij = β_ij Π_{k : rank_i(k) < rank_i(j)} (1 − β_ik) = exp( z_ij − Σ_{k : rank_i(k) <= rank_i(j)} softplus(z_ik) )

(`stick_breaking_grid_attention`; same remainder options). On a 1 × n grid without the CLS token this
is the text rule run in both directions at once, nearest key first; the ties (keys at equal distance on
both sides) take raster order, which makes the rule deterministic but not mirror-symmetric.

Bidirectional text (BERT), the same generalisation in one dimension (`sequence_key_ranks`): the query's
own key first, then the keys by |i − j|, the left key before the right one at equal distance; no token is
special (BERT's [CLS] is an ordinary position 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..config import PosEncConfig
from ..kernels._attn_dispatch import reference_inputs
from ..kernels._masks import query_indices
from ..kernels.sba import sba_backend, sba_tiled, stick_breaking
from ..kernels.sba.naive import broken_stick, stick_breaking_attention
from ..registry import param, register_encoding
from .base import EngineAttention, ModelInfo, PosContext

__all__ = ["StickBreaking", "stick_breaking_grid_attention", "grid_key_ranks"]


@dataclass
class SbaParams:
    attend_current: bool = param(
        False,
        "whether the query's own key is a breakpoint too (the paper and its code exclude the diagonal)",
        type=bool,
    )
    remainder: str = param(
        "discard",
        "what becomes of the stick left after every key: 'discard' (the paper: weights sum to < 1), "
        "'current' (added to the query's own value) or 'bias' (times a learned per-head vector, the authors' "
        "trained model)",
        type=str,
        choices=("discard", "current", "bias"),
    )


def grid_key_ranks(grid: tuple[int, int], device: torch.device) -> torch.Tensor:
    """(N, N) long, N = 1 + rows*cols (CLS first, then the patches in raster order): ``ranks[i, j]`` = the place
    of key j in query i's breaking order (0 = first): its own key, then the patches by squared grid distance,
    ties in raster order, the CLS key last; the CLS query orders the patches in raster order."""
    rows, cols = grid
    n = rows * cols + 1
    r = torch.arange(rows, device=device).repeat_interleave(cols)
    c = torch.arange(cols, device=device).repeat(rows)
    dist = (r[:, None] - r[None, :]).square() + (c[:, None] - c[None, :]).square()  # (P, P)
    raster = torch.arange(n, device=device)
    score = torch.zeros(n, n, dtype=torch.long, device=device)
    score[1:, 1:] = dist * (n + 1)
    score = score + raster[None, :]  # ties (and the CLS query's whole row) in raster order
    score[1:, 0] = (rows * rows + cols * cols + 1) * (n + 1)  # the CLS key after every patch
    score.fill_diagonal_(-1)  # the query's own key first
    order = score.argsort(dim=-1)  # (N, N): key at each rank
    return order.argsort(dim=-1)


def sequence_key_ranks(length: int, device: torch.device) -> torch.Tensor:
    """(L, L) long: ``ranks[i, j]`` = the place of key j in query i's breaking order on a bidirectional
    sequence: its own key, then the keys by |i - j|, the left one first at equal distance."""
    idx = torch.arange(length, device=device)
    score = (idx[:, None] - idx[None, :]).abs() * (length + 1) + idx[None, :]
    score.fill_diagonal_(-1)
    return score.argsort(dim=-1).argsort(dim=-1)


def stick_breaking_grid_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None,
                                  scaling: float, ranks: torch.Tensor, attend_current: bool = False,
                                  remainder: str = "discard", bias: torch.Tensor | None = None, dropout: float = 0.0,
                                  training: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Stick-breaking attention with a per-query key order (ViT; bidirectional text), in log space, in the dtype of
    ``q``: the arguments of `stick_breaking_attention` (``allowed`` without causality), with ``ranks`` (Lq, Lk) long,
    each query's breaking order (`grid_key_ranks`, `sequence_key_ranks`; rank 0 is the query's own key), instead of
    the queries' key indices.

    Returns:
        out (B, H, Lq, D) and the weights (B, H, Lq, Lk).
    """
    z = (q @ k.transpose(-1, -2)) * scaling
    breaks = (ranks > 0) if not attend_current else torch.ones_like(ranks, dtype=torch.bool)
    order = ranks.argsort(dim=-1).expand(*z.shape)  # key at each rank

    def broken_by(softplus: torch.Tensor) -> torch.Tensor:
        # Σ_{k : rank(k) <= rank(j)} softplus(z_ik): a cumulative sum in rank order, read back per key
        return softplus.gather(-1, order).cumsum(-1).gather(-1, ranks.expand(*z.shape))

    current = (v, (ranks == 0)[None, None]) if remainder == "current" else None
    return broken_stick(z, breaks, allowed, broken_by, v, remainder, bias, current, dropout, training)


@register_encoding(
    "sba",
    params=SbaParams,
    kind="replaces softmax",
    summary="stick-breaking attention in log space (no other position term); weights sum to <= 1",
    paper="https://arxiv.org/abs/2410.17980",
)
class StickBreaking(EngineAttention):
    """Stick-breaking attention; see the module docstring for the formula.

    Parameters: none, or ``remainder_bias`` (num_layers, num_heads, head_dim) with ``remainder="bias"``.
    """

    no_inert_reason = "stick-breaking replaces the softmax; no parameter setting gives softmax attention back"

    custom_attention = True
    #: ``attend`` runs its own fused kernel for these backends (``hf_posenc.kernels.sba``).
    attention_kernels = ("triton",)
    relative = True  # the stick is broken over key order from the query backwards; position_ids are never read
    reference_footprint = (6.5, 8.5)  # float32 (B, H, Lq, Lk) tensors (hf_posenc.memory)

    def __init__(self, config: PosEncConfig, info: ModelInfo) -> None:
        super().__init__(config, info)
        self.attend_current = config.params["attend_current"]
        self.remainder = config.params["remainder"]
        if self.remainder == "bias":
            self.remainder_bias = nn.Parameter(torch.zeros(info.num_layers, info.num_heads, info.head_dim))

    def engine_backend(self, ctx: PosContext, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       mask: torch.Tensor | None, dropout: float, training: bool) -> str:
        """The fused kernel (``hf_posenc.kernels.sba``) or the tile-wise engine (``hf_posenc.kernels.sba.tiled``),
        as `sba_backend` picks; ViT's grid and bidirectional text (BERT) run the reference on every device."""
        if ctx.grid is not None or not self.info.causal:
            return "reference"
        return sba_backend(query, key, value, mask, ctx.q_offset, ctx.need_weights, dropout, training)

    def engine(self, backend: str, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               mask: torch.Tensor | None, scaling: float, q_offset: int | torch.Tensor, window: int | None,
               sink: int | None) -> torch.Tensor:
        """The kernel, or off Triton the tile-wise engine (O(L·block) memory, no weights formed)."""
        bias = self.remainder_bias[layer] if self.remainder == "bias" else None
        run = stick_breaking if backend == "triton" else sba_tiled
        return run(query, key, value, mask, scaling, q_offset, self.attend_current, self.remainder, bias,
                   window=window, sink=sink)

    def reference(self, ctx: PosContext, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  mask: torch.Tensor | None, scaling: float, dropout: float, training: bool
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """The full-matrix reference: with the weights requested or attention dropout while training (causal), and
        on ViT in grid-distance order, on bidirectional text (BERT) in sequence-distance order (module docstring)."""
        causal = ctx.grid is None and self.info.causal
        dtype, q, k, v, allowed = reference_inputs(query, key, value, mask, ctx.q_offset, causal)
        bias = self.remainder_bias[layer].to(dtype) if self.remainder == "bias" else None
        if causal:
            q_index = query_indices(query.shape[2], ctx.q_offset, query.device)
            out, weights = stick_breaking_attention(
                q, k, v, allowed, scaling, q_index, self.attend_current, self.remainder, bias, dropout, training
            )
        else:
            if ctx.grid is not None:
                ranks = grid_key_ranks(ctx.grid, query.device)[-query.shape[2]:, -key.shape[2]:]
            else:
                ranks = sequence_key_ranks(key.shape[2], query.device)[-query.shape[2]:]
            out, weights = stick_breaking_grid_attention(
                q, k, v, allowed, scaling, ranks, self.attend_current, self.remainder, bias, dropout, training
            )
        return out.to(query.dtype), weights
