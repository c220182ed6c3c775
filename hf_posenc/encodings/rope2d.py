"""``rope2d``: 2D rotary position embedding, axial and mixed.

"Rotary Position Embedding for Vision Transformer", Heo et al. 2024, https://arxiv.org/abs/2403.13298
(official code: github.com/naver-ai/rope-vit). A query or key x of head dimension d is cut into d/2
pairs (x[2k], x[2k+1]) (the paper's complex view, as in its code), and pair k of a token at position
p = (p_1 .. p_N) is rotated by an angle phi_k(p):

    (R(p) x)_pair_k = [[cos phi_k, -sin phi_k], [sin phi_k, cos phi_k]] @ (x[2k], x[2k+1])

* ``axial`` (the paper's RoPE-Axial): fixed frequencies, the pairs alternate between the axes,

      phi_k(p) = theta_t * p_(k mod N),   t = floor(k / N),   theta_t = base^(-2N t / d),  t < d / (2N)

  On ViT (N = 2, p = (x, y) = (column, row) of the patch) this is the paper's
  R(n, 2t) = e^(i theta_t p^x_n), R(n, 2t+1) = e^(i theta_t p^y_n) with theta_t = 100^(-t / (d/4)),
  t = 0 .. d/4 - 1: even pairs take the column, odd pairs the row, both with the same frequency theta_t.
  (The official code concatenates instead: its first d/4 pairs take the column and the last d/4 the
  row; the two differ only by a fixed permutation of the head dimensions, which the q/k projections
  absorb, but the checkpoints are not interchangeable.) ``base`` defaults to 100, the paper's value.

* ``mixed`` (the paper's RoPE-Mixed): learned frequencies for every axis,

      phi_k(p) = sum_i theta^i_k * p_i

  one frequency vector per axis per key/value head per layer (the paper learns them per head and per
  layer). With grouped-query attention a query head uses the frequencies of its key/value head, so that
  q_h . k_g(h) keeps the relative property. Initialisation as in the official code
  (``init_random_2d_freqs``), with ``base`` = 10 by default (the official RoPE-Mixed models' value): per head
  and layer an angle a ~ U[0, 2 pi); pair k gets magnitude theta_t = base^(-2N t / d), t = floor(k / N),
  and direction (cos(a + (k mod 2) pi/2), sin(a + (k mod 2) pi/2)), i.e. even pairs along a, odd pairs
  along a + pi/2. With a = 0 this is exactly RoPE-Axial (same alternating layout as above); the official
  code again puts the first direction on the first d/4 pairs.

Both are relative: phi_k(p) is linear in p, so R(p)^T R(p') = R(p' - p) and shifting every position by
the same vector leaves the attention scores unchanged.

ViT: p = (column, row) of each patch on this forward's patch grid (any resolution: nothing is
interpolated, a larger image just has larger coordinates). The CLS token is not rotated (identity),
as in the paper's code (``q[:, :, 1:]``). Among patches the relative property holds exactly; the
CLS-patch scores depend on the patch's absolute coordinates, as in the paper.

Text (N = 1): the one axis is the logical token position (``position_ids``). The formulas above with
N = 1 give every pair the position: ``axial`` is RoPE in the interleaved layout with
theta_k = base^(-2k/d) (all d/2 pairs rotate; base 100 by default, so pass a larger ``base`` for long
text), and ``mixed`` learns one frequency per pair, initialised at those RoPE frequencies (a 1D
direction has no angle to draw). We chose this over the literal 2D formula at y = 0, which would leave
half of the pairs unrotated and keep dead y-frequency parameters: a 1D sequence has one axis, and the
axial split of the pairs among the axes then gives that axis all of them (the same rule as ComRoPE's
angle-matrix variant with N = 1).

Angles and rotations are computed in float32 (float64 stays float64), whatever the parameters' dtype.

RoPE scaling (``rope``'s ``scaling``, transformers' ``rope_parameters``) is not taken: rope2d's frequencies
are its own per-axis schedule (``base``), which no transformers scaling function describes; a sliding ``window``
(every encoding's) applies per grid axis on ViT.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..config import PosEncConfig
from ..ops import upcast
from ..registry import param, register_encoding
from .base import ModelInfo, PosContext
from .rotary_base import BlockRotationEncoding, token_coordinates

__all__ = ["Rope2d", "axial_frequencies", "axis_coordinates", "pair_rotations"]

#: RoPE-Axial: 100 (the paper's formula); RoPE-Mixed: 10 (the official models' ``rope_theta``).
DEFAULT_BASE = {"axial": 100.0, "mixed": 10.0}


def num_axes(info: ModelInfo) -> int:
    """Position axes: 2 on the ViT patch grid, 1 on text."""
    return 2 if info.grid is not None else 1


def axial_frequencies(head_dim: int, axes: int, base: float) -> torch.Tensor:
    """(d/2, N) float32: F[k, i] = base^(-2N floor(k/N) / d) if i == k mod N else 0 (RoPE-Axial)."""
    half = head_dim // 2
    k = torch.arange(half)
    mag = base ** (-(2.0 * axes) * torch.div(k, axes, rounding_mode="floor").double() / head_dim)
    freqs = torch.zeros(half, axes, dtype=torch.float64)
    freqs[k, k % axes] = mag
    return freqs.float()


def mixed_init(layers: int, heads: int, head_dim: int, axes: int, base: float) -> torch.Tensor:
    """(layers, heads, d/2, N) RoPE-Mixed initial frequencies (see the module docstring)."""
    half = head_dim // 2
    k = torch.arange(half)
    mag = base ** (-(2.0 * axes) * torch.div(k, axes, rounding_mode="floor").double() / head_dim)
    if axes == 1:
        return mag.float()[None, None, :, None].expand(layers, heads, half, 1).clone()
    a = torch.rand(layers, heads, 1, dtype=torch.float64) * 2 * math.pi
    phase = a + (k % 2).double() * (math.pi / 2)  # (layers, heads, d/2)
    return torch.stack([mag * phase.cos(), mag * phase.sin()], dim=-1).float()


def axis_coordinates(ctx: PosContext, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B|1, L, N) float32 coordinates of the new tokens in the paper's axis order, and the CLS mask.

    Text: (position,). ViT: (x, y) = (column, row); the CLS token (flagged in the mask) gets (0, 0)."""
    coords, cls = token_coordinates(ctx, length, device)
    if ctx.grid is None:
        return coords[..., :1], None
    return coords.flip(-1), cls


def pair_rotations(angles: torch.Tensor) -> torch.Tensor:
    """angles (...) -> (..., 2, 2) rotations [[cos, -sin], [sin, cos]] acting on (x[2k], x[2k+1])."""
    c, s = angles.cos(), angles.sin()
    return torch.stack([c, -s, s, c], dim=-1).unflatten(-1, (2, 2))


@dataclass
class Rope2dParams:
    variant: str = param(
        "axial",
        "'axial' (fixed frequencies, the pairs alternate between the axes) or 'mixed' (learned frequencies "
        "for every axis, per key/value head and layer)",
        type=str,
        choices=("axial", "mixed"),
    )
    base: float | None = param(
        None,
        "frequency base, theta_t = base^(-2N t / head_dim) (mixed: the initial magnitudes); None: 100 for axial "
        "(the paper), 10 for mixed (the official models)",
        type=float,
        optional=True,
        gt=1.0,
    )


@register_encoding(
    "rope2d",
    params=Rope2dParams,
    kind="q/k transform",
    summary="2D rotary over the ViT patch grid, axial or learned mixed frequencies; 1D rotary on text",
    paper="https://arxiv.org/abs/2403.13298",
)
class Rope2d(BlockRotationEncoding):
    """RoPE-Axial / RoPE-Mixed; see the module docstring for the formulas."""

    relative = True  # angles linear in the position: R(p)^T R(p') = R(p' - p) (1D on text)

    @classmethod
    def resolve(cls, config: PosEncConfig, info: ModelInfo) -> PosEncConfig:
        p = dict(config.params)
        if p["base"] is None:
            p["base"] = DEFAULT_BASE[p["variant"]]
        return PosEncConfig(config.name, p)

    def check_model(self, info: ModelInfo) -> None:
        n = num_axes(info)
        if info.head_dim % (2 * n):
            where = "on the ViT patch grid (2 axes, pairs alternating between them)" if n == 2 else "on text"
            raise ValueError(f"rope2d needs head_dim divisible by {2 * n} {where}, got head_dim={info.head_dim}")

    def __init__(self, config: PosEncConfig, info: ModelInfo) -> None:
        super().__init__(config, info)
        self.variant = config.params["variant"]
        self.base = float(config.params["base"])
        self.num_axes = num_axes(info)
        if self.variant == "mixed":
            init = mixed_init(info.num_layers, info.num_kv_heads, info.head_dim, self.num_axes, self.base)
            #: (layers, Hkv, d/2, N): theta^i_k of every layer and key/value head.
            self.freqs = nn.Parameter(init)

    def frequencies(self, layer: int = 0) -> torch.Tensor:
        """(Hkv|1, d/2, N) float32 frequencies of ``layer`` (axial: fixed, shared by heads and layers)."""
        if self.variant == "axial":
            return axial_frequencies(self.info.head_dim, self.num_axes, self.base)[None]
        return upcast(self.freqs[layer])

    def angular_rate(self) -> float:
        """Axial: 1.0 (its fastest fixed frequency, base^0); mixed: the largest learned |theta^i_k| (1.0 at the
        start), radians per unit of one axis' coordinate."""
        if self.variant == "axial":
            return 1.0
        with torch.no_grad():
            return float(self.freqs.detach().abs().max())

    def rotation_at(self, coords: torch.Tensor, cls: torch.Tensor | None, layer: int = 0) -> torch.Tensor:
        """Rotations (B|1, Hkv|1, L, d/2, 2, 2) at explicit coordinates (B|1, L, N) (in the axis order of
        the module docstring); tokens flagged in ``cls`` (L,) are not rotated."""
        freqs = self.frequencies(layer).to(coords.device)
        angles = torch.einsum("bln,hkn->bhlk", coords.to(freqs.dtype), freqs)
        if cls is not None:
            angles = angles.masked_fill(cls[:, None].to(angles.device), 0.0)
        return pair_rotations(angles)

    def rotation(self, ctx: PosContext, length: int, device: torch.device) -> torch.Tensor:
        coords, cls = axis_coordinates(ctx, length, device)
        return self.rotation_at(coords, cls)

    def layer_rotation(self, ctx: PosContext, layer: int, length: int, device: torch.device) -> torch.Tensor:
        if self.variant == "axial":  # no parameters: built once per forward, shared by the layers
            return super().layer_rotation(ctx, layer, length, device)
        coords, cls = axis_coordinates(ctx, length, device)
        return self.rotation_at(coords, cls, layer)
