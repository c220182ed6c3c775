"""``alibi``: attention with linear biases.

"Train Short, Test Long: Attention with Linear Biases Enables Input Length Extrapolation", Press et al.
2022, https://arxiv.org/abs/2108.12409. The logit of query i and key j gets

    B_h(i, j) = -m_h * |i - j|

with fixed per-head slopes: for n heads a power of two, m_h = 2^(-8h/n), h = 1..n. For other n (the
paper's code): the slopes of the closest power of two 2^k < n, followed by every other slope of 2^(k+1)
(indices 0, 2, 4, ...) until n slopes. Under a causal mask only j <= i remains, where the bias is
-m_h * (i - j) as in the paper. Distances are built in float32 from the key index in the cache, so the
bias of a decode step spans the whole key length; left padding only adds masked keys on the left, so
the distances between real tokens are unchanged.

On ViT (bidirectional, no order): |i - j| becomes the Euclidean distance between the two patches on the
2D patch grid, sqrt((r_i - r_j)^2 + (c_i - c_j)^2); every pair involving the CLS token gets no bias.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..kernels.attention.terms import KernelTerm
from ..registry import register_encoding
from .base import PosContext
from .term import TermEncoding

__all__ = ["Alibi", "alibi_slopes"]


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """The per-head slopes m_h (num_heads,) float32, following the paper's rule for any head count."""
    if num_heads < 1:
        raise ValueError(f"num_heads must be >= 1, got {num_heads}")

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    if math.log2(num_heads).is_integer():
        slopes = power_of_two(num_heads)
    else:
        closest = 2 ** math.floor(math.log2(num_heads))
        slopes = power_of_two(closest) + power_of_two(2 * closest)[0::2][: num_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)


@dataclass
class AlibiParams:
    pass


@register_encoding(
    "alibi",
    params=AlibiParams,
    kind="score bias",
    summary="-m_h * distance with fixed per-head slopes; Euclidean patch distance on ViT",
    paper="https://arxiv.org/abs/2108.12409",
)
class Alibi(TermEncoding):
    """ALiBi; see the module docstring for the formula (stated once, by the ``alibi`` term: its ``score_bias`` is
    that term's reference bias; on ViT, the term at the patches' Euclidean distance)."""

    no_inert_reason = "its slopes are fixed (Press et al.), so its bias is never zero"

    bias_per_layer = False  # one bias for every layer
    relative = True  # -m_h |i - j| from key/query indices; position_ids are never read
    reference_footprint = (2.0, 3.0)  # float32 (B, H, Lq, Lk) tensors (hf_posenc.memory)
    kernel_kinds = ("alibi",)
    grid_distance = "euclidean"

    def term(self, ctx: PosContext, layer: int, q_len: int, k_len: int, device: torch.device) -> KernelTerm:
        """The ``alibi`` term: the slopes (H,)."""
        if torch.compiler.is_compiling():
            return KernelTerm.alibi(alibi_slopes(self.info.num_heads).to(device))
        # one tensor per device for every layer and forward: a decoding step's engine then evaluates the bias once
        # per forward, not in every layer (hf_posenc.kernels.attention.tiled._layer_shared_bias)
        slopes = self.__dict__.setdefault("_slopes", {})  # a plain attribute, per device (no buffer: checkpoints)
        device = torch.device(device)
        if device not in slopes:
            slopes[device] = alibi_slopes(self.info.num_heads).to(device)
        return KernelTerm.alibi(slopes[device])
