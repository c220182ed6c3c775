"""``t5``: learned per-head bias over bucketed relative positions.

"Exploring the Limits of Transfer Learning with a Unified Text-to-Text Transformer", Raffel et al. 2020,
https://arxiv.org/abs/1910.10683 (section 2.1, "relative position embeddings"). The logit of query i
and key j in head h gets a learned scalar

    B_h(i, j) = table[bucket(j - i), h]

where the relative position is key - query (T5's ``memory_position - query_position``) and ``bucket`` is
T5's bucketing (Mesh TensorFlow ``_relative_position_bucket``, reproduced bit for bit; tested against
transformers' ``T5Attention._relative_position_bucket``):

* causal models (Llama, GPT-2; T5's decoder): n = max(i - j, 0) (future keys, masked anyway, fall into
  bucket 0); buckets 0 .. max_exact - 1 hold n exactly, with max_exact = num_buckets // 2; above,
  bucket = max_exact + floor(log(n / max_exact) / log(max_distance / max_exact) * (num_buckets - max_exact)),
  clamped to num_buckets - 1 (every n >= max_distance shares the last bucket);
* bidirectional (ViT; T5's encoder): half of the buckets per sign: keys after the query (j - i > 0) are
  offset by num_buckets // 2, and n = |j - i| is bucketed as above with num_buckets // 2 buckets.

T5 itself has no 1/sqrt(d) on its logits (its initialisation absorbs it). Here the bias is added to the
host model's logits, which Llama, GPT-2 and ViT scale by 1/sqrt(head_dim): the logits become
q.k / sqrt(d) + B_h(i, j). The bias is not scaled.

One table (num_buckets, num_heads) is shared by every layer, as in T5 (where the first layer owns it);
``per_layer=True`` gives each layer its own (num_layers, num_buckets, num_heads) table. Initialisation:
normal with std = the model's ``initializer_range`` (T5 also draws its table from a normal, with std
d_model^-0.5 in transformers' ``T5PreTrainedModel._init_weights``). Zeros would be defensible too (the
gradient of every bucket and head is non-zero from the first step, so nothing stays symmetric), but a
random start lets the position terms, and every test of them, matter from the first forward, as with the
other learned tables of hf_posenc. The bias is computed in float32 (float64 if the table is float64),
whatever the model's dtype.

On ViT (bidirectional, 2D grid + CLS): a per-axis relative table, with separate tables for rows and
columns, each bucketed bidirectionally on its own axis:

    B_h(i, j) = table_row[bucket(r_j - r_i), h] + table_col[bucket(c_j - c_i), h]

and every pair that involves the CLS token gets no positional term (bias 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..config import PosEncConfig
from ..kernels.attention.terms import KernelTerm
from ..ops import upcast
from ..registry import param, register_encoding
from .base import ModelInfo, PosContext, relative_positions
from .term import TermEncoding

__all__ = ["T5Bias", "t5_relative_position_bucket"]


def t5_relative_position_bucket(
    relative_position: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int
) -> torch.Tensor:
    """T5's bucket of each relative position (key - query), any shape, integer-valued -> int64 same shape.

    Same arithmetic, in the same order and precision (float32 logarithm), as Mesh TensorFlow and
    transformers' ``T5Attention._relative_position_bucket``. Causal: n = max(-rel, 0); bidirectional:
    num_buckets // 2 buckets per sign, positive offsets shifted by num_buckets // 2, n = |rel|. Then n
    itself below max_exact = (buckets per sign) // 2, logarithmic buckets up to max_distance above,
    clamped to the last bucket.
    """
    rel = relative_position.long()
    buckets = torch.zeros_like(rel)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (rel > 0).long() * num_buckets
        n = rel.abs()
    else:
        n = (-rel).clamp(min=0)
    max_exact = num_buckets // 2
    is_small = n < max_exact
    # n is raised to max_exact where it is small (those entries are not used): log(0) = -inf has no int64 value.
    large = max_exact + (
        torch.log(n.clamp(min=max_exact).float() / max_exact)
        / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    ).to(torch.long)
    large = large.clamp(max=num_buckets - 1)
    return buckets + torch.where(is_small, n, large)


@dataclass
class T5Params:
    num_buckets: int = param(
        32, "number of relative-position buckets (T5: 32; on ViT, per axis, half of them per sign)", type=int, ge=2
    )
    max_distance: int = param(
        128, "relative distance from which every position shares the last bucket (T5: 128)", type=int, ge=2
    )
    per_layer: bool = param(
        False, "one table per layer instead of one table shared by every layer (T5 shares one)", type=bool
    )


@register_encoding(
    "t5",
    params=T5Params,
    kind="score bias",
    summary="learned per-head bias over T5's log-bucketed relative positions; per-axis row + column tables on ViT",
    paper="https://arxiv.org/abs/1910.10683",
)
class T5Bias(TermEncoding):
    """T5's relative position bias; see the module docstring for the formula (on text stated once, by the ``t5``
    term with this file's bucketing: ``score_bias`` is its reference bias; ViT's per-axis tables in
    `grid_bias`).

    Parameters: text: ``table`` (num_buckets, H), or (num_layers, num_buckets, H) with ``per_layer``;
    ViT: ``table_row`` and ``table_col`` of those shapes.
    """

    inert_zero = ("table", "table_row", "table_col")  # a zero table adds 0 everywhere: exact

    relative = True  # buckets of key - query (indices); position_ids are never read
    reference_footprint = (5.0, 6.0)  # float32 (B, H, Lq, Lk) tensors (hf_posenc.memory)
    kernel_kinds = ("t5",)

    def term(self, ctx: PosContext, layer: int, q_len: int, k_len: int, device: torch.device) -> KernelTerm:
        """The ``t5`` term: the table (num_buckets, H) of ``layer`` and the bucket of each relative position
        −max_distance .. max_distance (this file's bucketing; positions past ±max_distance share the bucket of
        ±max_distance, as the bucketing gives them)."""
        memo_key = ("t5_buckets", device)
        if memo_key not in ctx.memo:
            rel = torch.arange(-self.max_distance, self.max_distance + 1, device=device)
            ctx.memo[memo_key] = t5_relative_position_bucket(rel, self.bidirectional, self.num_buckets, self.max_distance)
        return KernelTerm.t5(self._table("table", layer), ctx.memo[memo_key])

    def check_model(self, info: ModelInfo) -> None:
        p = self.posenc_config.params
        per_sign = p["num_buckets"] if info.causal else p["num_buckets"] // 2
        max_exact = per_sign // 2
        where = "causal" if info.causal else "bidirectional"
        if max_exact < 1:
            raise ValueError(
                f"t5 on {info.family} ({where} bucketing) needs num_buckets >= {2 if info.causal else 4}, "
                f"got {p['num_buckets']}"
            )
        if p["max_distance"] <= max_exact:
            raise ValueError(
                f"t5 on {info.family} ({where} bucketing) needs max_distance > {max_exact} (the number of exact "
                f"buckets for num_buckets={p['num_buckets']}), got {p['max_distance']}"
            )

    def __init__(self, config: PosEncConfig, info: ModelInfo) -> None:
        super().__init__(config, info)
        p = config.params
        self.num_buckets = p["num_buckets"]
        self.max_distance = p["max_distance"]
        self.bias_per_layer = bool(p["per_layer"])
        self.bidirectional = not info.causal
        shape = (info.num_layers,) if self.bias_per_layer else ()
        shape += (self.num_buckets, info.num_heads)
        names = ("table_row", "table_col") if info.family == "vit" else ("table",)
        for name in names:
            weight = nn.Parameter(torch.empty(shape))
            with torch.no_grad():
                nn.init.normal_(weight, mean=0.0, std=info.initializer_range)
            self.register_parameter(name, weight)

    def _table(self, name: str, layer: int) -> torch.Tensor:
        """(num_buckets, H) of ``layer`` in float32 (float64 if the table is float64)."""
        table = getattr(self, name)
        if self.bias_per_layer:
            table = table[layer]
        return upcast(table)

    def _lookup(self, name: str, layer: int, rel: torch.Tensor) -> torch.Tensor:
        """table[bucket(rel)]: (Lq, Lk) -> (H, Lq, Lk)."""
        buckets = t5_relative_position_bucket(rel, self.bidirectional, self.num_buckets, self.max_distance)
        return self._table(name, layer)[buckets].permute(2, 0, 1)

    def grid_bias(
        self, ctx: PosContext, q_len: int, k_len: int, device: torch.device, layer: int = 0
    ) -> torch.Tensor:
        """ViT: (1, H, Lq, Lk) float32, the row and column tables at the per-axis offsets, 0 on CLS pairs."""
        rp = relative_positions(ctx, q_len, k_len, device)
        bias = self._lookup("table_row", layer, rp.rows) + self._lookup("table_col", layer, rp.cols)
        return bias.masked_fill(rp.cls, 0.0)[None]
