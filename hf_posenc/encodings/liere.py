"""``liere``: Lie rotational position encodings.

"LieRE: Lie Rotational Positional Encodings", Ostmeier et al. 2024 (ICML 2025),
https://arxiv.org/abs/2406.10322 (official code: https://github.com/StanfordMIMI/LieRE). A token at
position p = (p_1 .. p_n) (n = 1 on text, 2 on ViT) rotates its query and key by

    A_i  = P_i - P_i^T                        learned skew-symmetric generator of axis i (P_i unconstrained)
    R(p) = exp(p_1 A_1 + ... + p_n A_n)       matrix exponential, computed in float32
    q' = R(p_q) q,   k' = R(p_k) k,           so   q'^T k' = q^T R(p_q)^T R(p_k) k

The generators are block-diagonal with blocks of ``block_size`` s (exp acts block by block, so R(p) is
block-diagonal too and the rotary kernel applies it); each block of each generator is learned. By
default one set of generators serves every head and layer (the official ``ModelArgs`` defaults and
ImageNet config, ``rotary_embedding_per_head/per_layer: False``); ``per_head`` and ``per_layer`` (both
True in the official CIFAR-100 config) give each key/value head and each layer its own. Under
grouped-query attention query head h uses the rotation of its key/value head, so q_h^T k_g(h) sees
R(p_q)^T R(p_k) with one set of generators.

Relative or not: R(p_q)^T R(p_k) = exp(-G(p_q)) exp(G(p_k)) equals exp(G(p_k - p_q)) when G(p_q) and
G(p_k) commute. On text there is one axis, G(p) = p A_1, so liere is exactly relative there. With two
axes (ViT) A_1 and A_2 do not commute in general and liere is NOT relative: shifting every patch by the
same offset changes the attention. (ComRoPE's commuting constraint is what restores it.)

Choices, from the official code (``models/rope_vit.py``, ``LierePositionEncoder``):

* Initialisation: generator entries above the diagonal ~ U[0, 2π) (``torch.rand(...) * 2 * math.pi``,
  "RoPE-Mixed drew random angles from zero to 2 pi"); here P_i = that upper triangle, so that
  A_i = P_i - P_i^T has exactly the official initial values (the official code learns only the upper
  triangle; learning the whole P_i is the same family of generators).
* Positions are normalised as in the official code: on ViT each axis of an n-patch grid spans
  [0, n / n_train] (``torch.linspace(0, n / n_train, n)``, n_train the patch count along that axis at the
  config's image size), so the training grid spans [0, 1] and another resolution extends or shrinks it,
  without interpolating anything. The paper covers images only; on text the same normalisation is
  p = position / (L_train - 1), L_train the model's maximum position count, so the training context
  spans [0, 1]; queries and keys use their logical ``position_ids`` (left padding, the KV cache).
  ``position_scale`` replaces this by p = index * position_scale on every axis.
* Block size: the official generator is one dense skew-symmetric block over the head
  (``generator_dim`` 64 at head_dim 64, ``models/rope_vit.py``), so ``block_size`` defaults to head_dim.
  Any divisor of head_dim from 2 up is allowed: smaller blocks restrict the rotations to a block-diagonal
  subgroup (a departure from the official code, for speed). The Triton rotary kernel applies blocks of
  2, 4 and 8; larger blocks rotate through the PyTorch reference (a batched matrix-vector product), on
  every device.

Where this departs from the official code: the whole P_i is learned (same family, see above); ``per_head``
and ``per_layer`` follow its two configs; positions on text (which the paper does not cover) are
normalised by the model's maximum position count; ``block_size`` below head_dim is an option the official
code does not have.

The CLS token of ViT is not rotated (identity, as the official code's zero generator for it).
Rotations are computed once per forward for the positions present (one matrix exponential per distinct
``position_ids`` value of the batch, or per patch) and shared by every layer; with ``per_layer`` each
layer computes its own once; while training shared generators they are recomputed in each layer (as
score biases are), so that gradient checkpointing recomputes a layer exactly as its first pass ran it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..kernels._common import compute_dtype
from ..kernels.rotary.skew_exp import skew_exp
from ..config import PosEncConfig
from ..ops import upcast
from ..registry import param, register_encoding
from .base import ModelInfo, PosContext
from .rotary_base import BlockRotationEncoding, distinct_positions, token_coordinates

__all__ = ["Liere"]


@dataclass
class LiereParams:
    block_size: int | None = param(
        None,
        "size s of the diagonal blocks of the generators (a divisor of head_dim, at least 2; default: head_dim, "
        "one dense block per head as in the official code)",
        type=int,
        optional=True,
        ge=2,
    )
    per_head: bool = param(
        False, "generators per key/value head (the official CIFAR-100 config) or shared by all heads (its default)",
        type=bool,
    )
    per_layer: bool = param(
        False, "generators per layer (the official CIFAR-100 config) or shared by all layers (its default)", type=bool
    )
    position_scale: float | None = param(
        None,
        "multiplier of the integer positions (default: the official normalisation, the training grid or "
        "context spanning [0, 1])",
        type=float,
        optional=True,
        gt=0.0,
    )


@register_encoding(
    "liere",
    params=LiereParams,
    kind="q/k transform",
    summary="rotation exp(sum_i p_i A_i) of learned block-diagonal skew-symmetric generators; 2D grid on ViT",
    paper="https://arxiv.org/abs/2406.10322",
)
class Liere(BlockRotationEncoding):
    """LieRE; see the module docstring for the formula and the choices."""

    # Text has one axis, R(p) = exp(p A): exactly relative. NOT on ViT (two generators that need not commute).
    relative = True

    @classmethod
    def resolve(cls, config: PosEncConfig, info: ModelInfo) -> PosEncConfig:
        p = dict(config.params)
        if p["block_size"] is None:
            if info.head_dim < 2:
                raise ValueError(f"liere needs head_dim >= 2 (a rotation block), got {info.head_dim}")
            p["block_size"] = info.head_dim  # the official code: one dense generator over the head
        if p["position_scale"] is None and info.family != "vit":
            if info.max_positions is None or info.max_positions < 2:
                raise ValueError(
                    "liere normalises text positions by the model's maximum position count, which this model "
                    f"does not define (max_positions={info.max_positions}); pass position_scale"
                )
        return PosEncConfig(config.name, p)

    def check_model(self, info: ModelInfo) -> None:
        s = self.posenc_config.params["block_size"]
        if s is not None and info.head_dim % s:
            raise ValueError(
                f"liere's block_size must divide head_dim: block_size={s}, head_dim={info.head_dim}; "
                f"allowed here: {[b for b in range(2, info.head_dim + 1) if info.head_dim % b == 0]}"
            )

    def __init__(self, config: PosEncConfig, info: ModelInfo) -> None:
        super().__init__(config, info)
        s = config.params["block_size"]
        self.block_size = s
        self.num_axes = 2 if info.family == "vit" else 1
        self.per_layer = config.params["per_layer"]
        layers = info.num_layers if self.per_layer else 1
        heads = info.num_kv_heads if config.params["per_head"] else 1
        shape = (layers, self.num_axes, heads, info.head_dim // s, s, s)
        #: (layers|1, axes, Hkv|1, D/s, s, s), unconstrained; the generators are P - P^T.
        self.generator_raw = nn.Parameter(torch.triu(torch.rand(shape) * (2 * math.pi), diagonal=1))

    # -- the math ----------------------------------------------------------------------------------
    def generators(self) -> torch.Tensor:
        """A_i = P_i - P_i^T: (layers|1, axes, Hkv|1, D/s, s, s), at least float32."""
        p = upcast(self.generator_raw)
        return p - p.transpose(-1, -2)

    def axis_scales(self) -> list[float]:
        """The factor of each axis' integer coordinate (token index on text, patch row and column on ViT at the
        config's grid), as `positions` applies it."""
        scale = self.posenc_config.params["position_scale"]
        if scale is not None:
            return [float(scale)] * self.num_axes
        if self.info.grid is None:
            return [1.0 / (self.info.max_positions - 1)]
        return [1.0 / (n - 1) if n > 1 else 0.0 for n in self.info.grid]

    def angular_rate(self) -> float:
        """The fastest turn of R(p) per unit of position: max over axes, layers, heads and blocks of the axis scale
        times the spectral radius of the generator block (a real skew-symmetric block's largest |eigenvalue|,
        its spectral norm). Measured from the current generators."""
        with torch.no_grad():
            radius = torch.linalg.matrix_norm(self.generators().double(), ord=2)  # (layers|1, axes, Hkv|1, D/s)
            per_axis = radius.transpose(0, 1).flatten(1).amax(dim=1)  # (axes,)
            return max(float(r) * a for r, a in zip(per_axis.tolist(), self.axis_scales()))

    def rotations_at(self, coords: torch.Tensor, layer: int = 0) -> torch.Tensor:
        """R(p) = exp(sum_i p_i A_i) with ``layer``'s generators for N positions ``coords`` (N, axes), already
        scaled. Returns (Hkv|1, N, D/s, s, s) in the generators' compute dtype (float32; float64 for gradcheck)."""
        gens = self.generators()[layer if self.per_layer else 0]
        coords = coords.to(device=gens.device, dtype=gens.dtype)
        if gens.shape[0] == 1:
            # One axis (text): exp(p A) for every position p from one eigendecomposition of each block A
            # (exact spectral form, hf_posenc.kernels.rotary.skew_exp), not a matrix exponential per position.
            return skew_exp(gens[0], coords[:, :1].expand(-1, gens.shape[2]).contiguous())
        # (N, axes) x (axes, H, K, s, s) -> (H, N, K, s, s)
        algebra = torch.einsum("na,ahkij->hnkij", coords, gens).contiguous()
        return torch.linalg.matrix_exp(algebra)

    def positions(self, ctx: PosContext, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Scaled coordinates of the new tokens (B|1, L, axes) in the generators' compute dtype (float32; float64 in
        a float64 model: float32 positions moved its logits by 4.1e-3 when 266 tokens were shifted by 300 at
        position_scale 1.65) and the ViT CLS mask (L,) or None."""
        coords, cls = token_coordinates(ctx, length, device, compute_dtype(self.generator_raw.dtype))
        coords = coords[..., : self.num_axes]
        scale = self.posenc_config.params["position_scale"]
        if scale is not None:
            return coords * scale, cls
        if ctx.grid is None:
            return coords / (self.info.max_positions - 1), cls
        # official: each axis of n patches is linspace(0, n / n_train, n), n_train at the config's image size
        train = self.info.grid
        factors = []
        for n, n_train in zip(ctx.grid, train):
            factors.append((n / n_train) / (n - 1) if n > 1 else 0.0)
        return coords * torch.tensor(factors, device=device, dtype=coords.dtype), cls

    def spectral_terms(
        self, ctx: PosContext, layer: int, length: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Text (one axis): (A (Hkv|1, D/s, s, s), p (B|1, L, D/s)), the rotation being exp(p A) blockwise; ViT's
        two generators do not commute: None (matrix exponentials). Shared generators (``per_layer=False``): None
        too, as their rotations are built once per forward for every layer (and their gradient summed over the
        layers before the one backward of ``skew_exp``), which measured faster on the CPU."""
        if self.num_axes != 1 or not self.per_layer:
            return None
        gens = self.generators()[layer][0]  # (Hkv|1, D/s, s, s): this layer's generators of the one axis
        coords, _ = self.positions(ctx, length, device)  # (B|1, L, 1), scaled
        coords = coords.to(device=gens.device, dtype=gens.dtype)
        return gens, coords.expand(-1, -1, gens.shape[1])

    def _rotations(self, ctx: PosContext, layer: int, length: int, device: torch.device) -> torch.Tensor:
        """(B|1, Hkv|1, L, D/s, s, s) float32 rotations of ``layer``'s generators for the ``length`` new tokens:
        one matrix exponential per distinct position, gathered to the tokens."""
        coords, cls = self.positions(ctx, length, device)
        b, n, axes = coords.shape
        unique, inverse = distinct_positions(coords.reshape(b * n, axes))
        rot = self.rotations_at(unique, layer)  # (H, U, K, s, s)
        if inverse is not None:
            rot = rot[:, inverse]
        rot = rot.reshape(rot.shape[0], b, n, *rot.shape[2:]).transpose(0, 1)  # (B, H, L, K, s, s)
        if cls is not None:  # no `if cls.any()`: reading it is a sync and a graph break (torch.compile)
            eye = torch.eye(self.block_size, device=rot.device, dtype=rot.dtype)
            rot = torch.where(cls.to(rot.device)[None, None, :, None, None, None], eye, rot)
        return upcast(rot)  # float32 (float64 generators stay float64: gradcheck)

    def rotation(self, ctx: PosContext, length: int, device: torch.device) -> torch.Tensor:
        """(B|1, Hkv|1, L, D/s, s, s) float32 rotations of the ``length`` new tokens (layer 0's with ``per_layer``)."""
        return self._rotations(ctx, 0, length, device)

    def layer_rotation(self, ctx: PosContext, layer: int, length: int, device: torch.device) -> torch.Tensor:
        """``layer``'s rotations. Shared generators: built once per forward and memoised for every layer (unless
        they are being trained); per-layer generators: each layer builds its own, once per forward."""
        if self.per_layer:
            return self._rotations(ctx, layer, length, device)
        return super().layer_rotation(ctx, 0, length, device)
