"""``comrope``: rotary position embedding with trainable commuting angle matrices.

"ComRoPE: Scalable and Robust Rotary Position Embedding Parameterized by Trainable Commuting Angle
Matrices", Yu et al. 2025, https://arxiv.org/abs/2506.03737 (official code: github.com/Longin-Yu/ComRoPE).
A token at position x = (x_1 .. x_N) (N position axes) rotates its queries and keys by

    R(x) = exp(sum_i A_i x_i),   A_i = blockdiag(B_i1, ..., B_im),   B_ij in R^(b x b) skew-symmetric,

with m = d / b blocks of size b. (R(x) q)^T (R(y) k) = q^T R(y - x) k for all x, y iff the A_i pairwise
commute (the paper's theorem); both variants make them commute by construction:

* ``ap`` (angle matrices, ComRoPE-AP):  B_ij = P_j - P_j^T if j = i (mod N), else 0.
  Block j belongs to axis (j mod N) alone (0-based), so in any block at most one A_i is non-zero.
* ``ld`` (linearly dependent, ComRoPE-LD): B_ij = theta_ij (P_j - P_j^T).
  Within a block every axis uses a multiple of the same skew matrix.

So block j of R(x) is exp(c_j(x) S_j) with S_j = P_j - P_j^T and a scalar c_j(x) = x_(j mod N) (ap) or
sum_i theta_ij x_i (ld). The exponentials are computed in float32 (float64 stays float64), once per
forward and layer for the distinct positions present, through the spectral form of each skew block
(``hf_posenc.kernels.rotary.skew_exp``: one eigendecomposition of i S_j per block and layer, then
exp(c S_j) = V diag(exp(-i c w)) V^H for every position, exact; its backward is the Daleckii-Krein
adjoint, no matrix exponential per position). Those rotation tensors are what the Triton rotary kernel takes;
wherever it does not run (the CPU), ``spectral_terms`` hands (S, c) to
``hf_posenc.kernels.rotary.spectral.spectral_qk_rotation``, which rotates q and k in each block's eigenbasis
and builds no (L, D/b, b, b) tensor, in forward or backward (measured on the 2-core CPU, issue 14's setting:
training step 2.1x -> 1.3x SDPA's, peak memory 3.0x -> 1.1x).

Parameters, as in the official code: P (one b x b matrix per block, per key/value head, per layer; with
grouped-query attention a query head uses its key/value head's rotation) drawn from N(0, init_std^2),
init_std = 1 by default (the code's ``init_std``); for ``ld``, theta (per axis and block, per layer,
shared by the heads, the code's ``multiplier``) drawn from N(0, 1). ``block_size`` defaults to 8 (the
largest block the fused rotary kernel takes; the official code's configuration default is 2), lowered to
4 or 2 where the head dimension needs it (ap also needs a whole number of blocks per axis, as the
official code requires: head_dim divisible by N * b). The block size of the paper's experiments could not
be confirmed from the sources at hand (the official README and model.py give none besides the config
default 2), so 8 stays a choice of this package, not the paper's setting.

Positions. ViT (N = 2): x = (row, column) of the patch, scaled by 1 / (rows, columns) of the config's
patch grid, as the official code normalises positions to [0, 1] over the training image (its
(p + 0.5) / n differs by a constant shift, which a relative encoding ignores). The scale is fixed by
the config's grid, so an image of another resolution keeps the same step per patch and extends past 1:
nothing is interpolated, and the relative property holds across resolutions. The CLS token is not
rotated (R = I; the official code instead places it at the image centre). Text (N = 1): the paper and
the official code have no 1D sequence setting (experiments: ImageNet 2D, UCF-101 3D, MSCOCO; the code's
``CustomVITConfig.get_positions`` is 2D/3D only). Its rule on every axis is ``axis_scale=True``: positions
normalised by the training extent of the axis, ``(p + 0.5) / num_patches_on_single_axis``. The 1D
analogue is the default here: x = the logical token position times 1 / ``max_positions`` (the model's
context length, e.g. ``max_position_embeddings``), so that, as on the training image, the whole trained
context spans a unit range and init_std = 1 gives rotations of O(1) radians across the context rather
than per token (unscaled positions gave a median angle near 2.9 rad per token: no low frequency). A
model without a maximum position needs ``position_scale``. With one axis both variants give every block
to it, so ``ap`` is a learned block rotation exp(x S_j) per block and ``ld`` the same with a learned
scalar per block. ``position_scale`` overrides the scale on every axis (1.0 gives unscaled positions).

RoPE scaling (``rope``'s ``scaling``) is not taken: ComRoPE's angle matrices are trained, not a frequency
schedule that transformers' scaling functions could rescale; a sliding ``window`` applies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..config import PosEncConfig
from ..kernels._common import compute_dtype
from ..kernels.rotary.skew_exp import skew_exp
from ..ops import upcast
from ..registry import param, register_encoding
from .base import ModelInfo, PosContext
from .rotary_base import BlockRotationEncoding, distinct_positions, token_coordinates

__all__ = ["ComRope", "default_block_size"]

#: the default block size, then the smaller ones tried when the head dimension needs it.
BLOCK_SIZES = (8, 4, 2)


def num_axes(info: ModelInfo) -> int:
    """Position axes: 2 on the ViT patch grid (row, column), 1 on text."""
    return 2 if info.grid is not None else 1


def _block_problem(variant: str, head_dim: int, b: int, axes: int) -> str | None:
    if head_dim % b:
        return f"head_dim={head_dim} is not divisible by block_size={b}"
    if variant == "ap" and (head_dim // b) % axes:
        return (
            f"the ap variant gives block j to axis j mod {axes}, and needs the same number of blocks per axis: "
            f"head_dim={head_dim} must be divisible by {axes} * block_size = {axes * b}"
        )
    return None


def default_block_size(variant: str, head_dim: int, axes: int) -> int:
    """The largest of 8, 4, 2 that fits the head dimension (and, for ap, gives every axis its blocks)."""
    for b in BLOCK_SIZES:
        if _block_problem(variant, head_dim, b, axes) is None:
            return b
    raise ValueError(
        f"comrope-{variant} finds no block size in {list(BLOCK_SIZES)} for head_dim={head_dim} with {axes} "
        f"position axis(es); pass block_size explicitly"
    )


@dataclass
class ComRopeParams:
    variant: str = param(
        "ap",
        "'ap' (angle matrices: block j rotates with axis j mod N) or 'ld' (linearly dependent: "
        "B_ij = theta_ij (P_j - P_j^T))",
        type=str,
        choices=("ap", "ld"),
    )
    block_size: int | None = param(
        None,
        "size b of the skew-symmetric diagonal blocks; None: 8, or the largest of 4, 2 the head dimension allows",
        type=int,
        optional=True,
        ge=2,
        le=8,
    )
    init_std: float = param(1.0, "standard deviation of the entries of P at initialisation", type=float, gt=0.0)
    position_scale: float | None = param(
        None,
        "factor applied to the coordinates on every axis; None: 1 / (rows, columns) of the config's patch grid "
        "on ViT, 1 / max_positions (the model's context length) on text",
        type=float,
        optional=True,
        gt=0.0,
    )


@register_encoding(
    "comrope",
    params=ComRopeParams,
    kind="q/k transform",
    summary="exp of trainable commuting block-diagonal angle matrices (ap / ld); patch grid on ViT",
    paper="https://arxiv.org/abs/2506.03737",
)
class ComRope(BlockRotationEncoding):
    """ComRoPE-AP / ComRoPE-LD; see the module docstring for the formula."""

    relative = True  # commuting generators: R(x)^T R(y) = R(y - x) (on the ViT grid too)

    @classmethod
    def resolve(cls, config: PosEncConfig, info: ModelInfo) -> PosEncConfig:
        p = dict(config.params)
        if p["block_size"] is None:
            p["block_size"] = default_block_size(p["variant"], info.head_dim, num_axes(info))
        if p["position_scale"] is None and info.grid is None:
            if not info.max_positions:
                raise ValueError(
                    f"comrope on text scales positions by 1 / the model's context length, but the {info.family} "
                    "config has no maximum position; pass position_scale (e.g. 1 / your training length)"
                )
            p["position_scale"] = 1.0 / info.max_positions
        return PosEncConfig(config.name, p)

    def check_model(self, info: ModelInfo) -> None:
        p = self.posenc_config.params
        problem = _block_problem(p["variant"], info.head_dim, p["block_size"], num_axes(info))
        if problem is not None:
            raise ValueError(f"comrope-{p['variant']}: {problem}")

    def __init__(self, config: PosEncConfig, info: ModelInfo) -> None:
        super().__init__(config, info)
        p = config.params
        self.variant = p["variant"]
        self.block_size = b = p["block_size"]
        self.num_axes = n = num_axes(info)
        self.num_blocks = m = info.head_dim // b
        #: (layers, Hkv, m, b, b): P_j of every layer and key/value head; S_j = P_j - P_j^T.
        self.P = nn.Parameter(torch.randn(info.num_layers, info.num_kv_heads, m, b, b) * p["init_std"])
        if self.variant == "ld":
            #: (layers, N, m): theta_ij of every layer.
            self.theta = nn.Parameter(torch.randn(info.num_layers, n, m))
        if p["position_scale"] is not None:
            scale = [float(p["position_scale"])] * n
        elif info.grid is not None:
            scale = [1.0 / info.grid[0], 1.0 / info.grid[1]]
        else:
            raise ValueError("comrope on text needs position_scale (resolve() sets 1 / max_positions)")
        self.axis_scale = tuple(scale)

    # -- the angle matrices -----------------------------------------------------------------------
    def skew(self, layer: int = 0) -> torch.Tensor:
        """(Hkv, m, b, b) float32 S_j = P_j - P_j^T of ``layer``."""
        P = upcast(self.P[layer])
        return P - P.transpose(-1, -2)

    def coefficients(self, layer: int = 0) -> torch.Tensor:
        """(N, m) float32 C with B_ij = C_ij S_j: the axis mask (ap) or theta (ld) of ``layer``."""
        if self.variant == "ld":
            return upcast(self.theta[layer])
        j = torch.arange(self.num_blocks, device=self.P.device)
        axes = torch.arange(self.num_axes, device=self.P.device)
        dtype = torch.float64 if self.P.dtype == torch.float64 else torch.float32
        return (j[None, :] % self.num_axes == axes[:, None]).to(dtype)

    def angle_matrices(self, layer: int = 0) -> torch.Tensor:
        """(N, Hkv, m, b, b) float32 blocks B_ij of every axis i (A_i = blockdiag_j B_ij)."""
        return self.coefficients(layer)[:, None, :, None, None] * self.skew(layer)[None]

    def angular_rate(self) -> float:
        """The fastest turn of R(x) per unit of position: block j of axis i turns by scale_i · |C_ij| · rho(S_j)
        radians per unit of x_i (rho: the spectral radius of the skew block, its spectral norm); the max over
        layers, heads, axes and blocks. Measured from the current parameters."""
        with torch.no_grad():
            radius = torch.stack([torch.linalg.matrix_norm(self.skew(layer).double(), ord=2).amax(dim=0)
                                  for layer in range(self.P.shape[0])])  # (layers, m)
            coeff = torch.stack([self.coefficients(layer).double().abs() for layer in range(self.P.shape[0])])
            scale = torch.tensor(self.axis_scale, dtype=torch.float64, device=coeff.device)
            return float((scale[None, :, None] * coeff * radius[:, None, :]).max())

    # -- rotations --------------------------------------------------------------------------------
    def rotation_at(self, coords: torch.Tensor, cls: torch.Tensor | None = None, layer: int = 0) -> torch.Tensor:
        """R(x) (B|1, Hkv, L, m, b, b) at explicit, unscaled coordinates (B|1, L, N) ((row, col) on the grid,
        (position,) on text); tokens flagged in ``cls`` (L,) get the identity. Computed once per distinct
        coordinate."""
        skew = self.skew(layer)
        coeff = self.coefficients(layer).to(skew.device)
        coords = self._scaled(coords, cls, skew)
        lead = coords.shape[:-1]  # (B|1, L)
        unique, inverse = distinct_positions(coords.reshape(-1, self.num_axes))
        c = unique @ coeff  # (U, m): c_j(x) = sum_i x_i C_ij
        rot = skew_exp(skew, c)  # (Hkv, U, m, b, b) exp(c_j S_j), spectral form (exact)
        if inverse is not None:
            rot = rot[:, inverse]
        rot = rot.unflatten(1, lead)  # (Hkv, B|1, L, m, b, b)
        return rot.transpose(0, 1)

    def _scaled(self, coords: torch.Tensor, cls: torch.Tensor | None, skew: torch.Tensor) -> torch.Tensor:
        """Coordinates (B|1, L, N) times the axis scale, in the skew's dtype and device; 0 at CLS tokens."""
        scale = torch.tensor(self.axis_scale, dtype=skew.dtype, device=skew.device)
        coords = coords.to(device=skew.device, dtype=skew.dtype) * scale
        if cls is not None:
            coords = coords.masked_fill(cls[:, None].to(coords.device), 0.0)
        return coords

    def spectral_terms(
        self, ctx: PosContext, layer: int, length: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(S (Hkv, m, b, b), c (B|1, L, m)): block j of a token's rotation is exp(c_j S_j) (see the module)."""
        skew = self.skew(layer)
        coords = self._scaled(*self._coords(ctx, length, device), skew)
        return skew, coords @ self.coefficients(layer).to(skew.device)

    def _coords(self, ctx: PosContext, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Unscaled coordinates (B|1, L, N) in the compute dtype of P (float64 in a float64 model) and the CLS mask."""
        coords, cls = token_coordinates(ctx, length, device, compute_dtype(self.P.dtype))
        return (coords[..., :1] if ctx.grid is None else coords), cls

    def rotation(self, ctx: PosContext, length: int, device: torch.device) -> torch.Tensor:
        return self.rotation_at(*self._coords(ctx, length, device))

    def layer_rotation(self, ctx: PosContext, layer: int, length: int, device: torch.device) -> torch.Tensor:
        return self.rotation_at(*self._coords(ctx, length, device), layer=layer)
