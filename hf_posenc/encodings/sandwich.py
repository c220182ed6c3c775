"""``sandwich``: the cosine-sum bias of Sandwich.

"Dissecting Transformer Length Extrapolation via the Lens of Receptive Field Analysis", Chi et al.
2023, https://arxiv.org/abs/2212.10356. The bias is the inner product of two sinusoidal position
embeddings of dimension d (the paper's d-bar), shifted so that it is 0 at distance 0, and divided by a
per-head scale as in ALiBi's slopes (head h = 1..H):

    B_h(i, j) = ( sum_{k=1}^{d/2} cos( (i - j) / 10000^(2k/d) ) - d/2 ) / (8h / H)

The sum is indexed from k = 1 (the authors' implementation), so the highest frequency 1 is not part of
it. The bias has no learned parameters; it is built once per forward, in float32, and shared by every
layer. Under a causal mask only j <= i matters.

On ViT (bidirectional): i - j becomes the Euclidean distance between the two patches on the 2D patch
grid (the cosine is even, so the sign plays no part on text either); pairs involving the CLS token get
no bias.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import PosEncConfig
from ..kernels.attention.terms import KernelTerm
from ..registry import param, register_encoding
from .base import ModelInfo, PosContext, relative_positions
from .term import TermEncoding

__all__ = ["Sandwich"]


def _table_length(q_offset: int | torch.Tensor, q_len: int, k_len: int) -> int:
    """Distances 0 .. n − 1 cover every text pair: query i is key ``q_offset + i`` among Lk keys. A tensor offset
    (a StaticCache's) is not read (a device sync, a graph break): the queries are among the keys there, so
    ``q_offset + Lq <= Lk`` and Lk is enough."""
    return k_len if isinstance(q_offset, torch.Tensor) else max(k_len, q_offset + q_len)


@dataclass
class SandwichParams:
    dim: int | None = param(
        None,
        "d-bar, the dimension of the sinusoids whose inner product forms the bias (default: head_dim)",
        type=int,
        optional=True,
        ge=2,
    )


@register_encoding(
    "sandwich",
    params=SandwichParams,
    kind="score bias",
    summary="fixed cosine-sum bias with per-head scaling; Euclidean patch distance on ViT",
    paper="https://arxiv.org/abs/2212.10356",
)
class Sandwich(TermEncoding):
    """Sandwich; see the module docstring for the formula (the cosine sum, `cosine_sum`, is stated once: the
    ``sandwich`` term reads its table per text distance, ``score_bias`` is that term's reference bias, and ViT's
    form evaluates it at the patches' Euclidean distances)."""

    no_inert_reason = "its cosine-sum bias is fixed (it has no parameters)"

    bias_per_layer = False  # one bias for every layer
    relative = True  # a function of i - j (key/query indices); position_ids are never read
    reference_footprint = (3.0, 3.5)  # float32 (B, H, Lq, Lk) tensors (hf_posenc.memory)
    kernel_kinds = ("sandwich",)

    def cosine_sum(self, distances: torch.Tensor) -> torch.Tensor:
        """(H, N) float32: the bias at the distances ``distances`` (N,) float32, per head (the formula above)."""
        dim = self.posenc_config.params["dim"]
        heads = self.info.num_heads
        device = distances.device
        k = torch.arange(1, dim // 2 + 1, device=device, dtype=torch.float64)
        inv_freq = (10000.0 ** (-2.0 * k / dim)).to(torch.float32)
        table = torch.cos(distances[:, None] * inv_freq).sum(-1) - dim / 2
        scale = torch.arange(1, heads + 1, device=device, dtype=torch.float32) * 8.0 / heads
        return table[None, :] / scale[:, None]

    def distance_table(self, length: int, device: torch.device) -> torch.Tensor:
        """(H, length) float32: the bias at text distance 0 .. length − 1, per head (`cosine_sum`)."""
        return self.cosine_sum(torch.arange(length, device=device, dtype=torch.float32))

    def term(self, ctx: PosContext, layer: int, q_len: int, k_len: int, device: torch.device) -> KernelTerm:
        """The ``sandwich`` term: the table over every distance of this forward (built once per forward, shared by
        the layers; per layer under ``torch.compile``)."""
        length = _table_length(ctx.q_offset, q_len, k_len)
        if torch.compiler.is_compiling():
            # no memo: its key would hold the (symbolic) table length, and Dynamo specialises a graph to a length
            # in a dict key (one graph per length); the table is (H, length), built per layer
            return KernelTerm.sandwich(self.distance_table(length, device))
        memo_key = ("sandwich_table", length, device)
        if memo_key not in ctx.memo:
            ctx.memo[memo_key] = self.distance_table(length, device)
        return KernelTerm.sandwich(ctx.memo[memo_key])

    @classmethod
    def resolve(cls, config: PosEncConfig, info: ModelInfo) -> PosEncConfig:
        p = dict(config.params)
        if p["dim"] is None:
            p["dim"] = info.head_dim
        if p["dim"] % 2:
            raise ValueError(f"sandwich needs an even dim (d-bar), got {p['dim']}")
        return PosEncConfig(config.name, p)

    def grid_bias(
        self, ctx: PosContext, q_len: int, k_len: int, device: torch.device, layer: int = 0
    ) -> torch.Tensor:
        """ViT: (1, H, Lq, Lk) float32, the cosine sum at the patches' Euclidean distances (evaluated once per distinct
        distance, then gathered: O(L^2) memory instead of O(L^2 * d)); 0 on CLS pairs (their distance is 0)."""
        d = relative_positions(ctx, q_len, k_len, device).distance()
        values, index = torch.unique(d, return_inverse=True)
        return self.cosine_sum(values)[:, index][None]
