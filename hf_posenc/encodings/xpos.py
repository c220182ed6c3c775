"""``xpos``: rotary position embedding with an exponential decay per frequency (xPos).

"A Length-Extrapolatable Transformer", Sun et al. 2022, https://arxiv.org/abs/2212.10554. xPos is RoPE whose
queries and keys are also scaled, per frequency, by powers of zeta_i in (0, 1]: with R rotated dims,

    theta_i = base^(-2i/R),   zeta_i = (i / (R/2) + gamma) / (1 + gamma),   i = 0 .. R/2 - 1   (gamma = 0.4)

    f_q(q, n)_pair_i = zeta_i^((n - c)/B)  * Rot(n theta_i) q_pair_i
    f_k(k, m)_pair_i = zeta_i^(-(m - c)/B) * Rot(m theta_i) k_pair_i

so that the score of a query at position n and a key at position m is

    f_q(q, n) . f_k(k, m) = sum_i zeta_i^((n - m)/B) Re[ q~_i conj(k~_i) e^(i (n - m) theta_i) ]

(q~_i, k~_i: pair i as a complex number x_a + i x_b). It depends on n - m only (the encoding is relative), and
for n >= m every term is RoPE's times a factor zeta_i^((n - m)/B) <= 1 that decays with the distance, fastest
for the high frequencies (small i, zeta_0 = gamma / (1 + gamma)) and hardly at all for the lowest
(zeta_(R/2-1) -> 1). B is the scale base (``scale_base``, 512). The two sources:

* The paper defines zeta_i with gamma = 0.4 and the q/k scaling above; its code is torchscale's
  ``torchscale/component/xpos_relative_position.py`` (class ``XPOS``, ``xpos_scale_base`` = 512 in torchscale's
  configs): ``scale = (arange(0, d, 2) + 0.4 d) / (1.4 d)``, i.e. zeta_i above, raised to (position - c) / 512;
  frequencies 10000^(-2i/d); pairs (x[2i], x[2i+1]) (``rotate_every_two``, ``duplicate_interleave``: the
  interleaved layout); queries scaled by zeta^(+), keys by zeta^(-) (``downscale=True``).
* lucidrains' rotary-embedding-torch (``RotaryEmbedding(use_xpos=True, xpos_scale_base=512)``): the same zeta
  and base, the interleaved layout too; positions centred at ``seq_len // 2``. Until its PR #34 (2024) it laid
  the scale out as two halves (``torch.cat((scale, scale))``) against interleaved frequencies, so the two dims
  of a rotated pair got different scales and the scores were not relative; the fixed releases repeat each scale
  per pair, as here.

Where they differ and what hf_posenc does:

* Layout. Both use the interleaved pairs; ``layout`` (rope's parameter) picks it, and defaults to ``"half"``
  (x[i], x[i + R/2]) as rope does, so that switching a Llama-style model from ``rope`` to ``xpos`` keeps its
  rotation and only adds the decay. Pair i gets theta_i and zeta_i in both layouts: the two differ by a fixed
  permutation of the head dims (absorbed by the q/k projections), and ``layout="interleaved"`` reproduces
  torchscale's scores exactly (tests/test_xpos.py compares them).
* Centring (c). zeta_i^((n - c)/B) * zeta_i^(-(m - c)/B) does not depend on c: c only keeps the factors
  bounded (unscaled, a key at m = 8192 would be multiplied by zeta_0^(-16) ~ 5e8). torchscale and lucidrains
  cache keys before the scaling and rescale every key in every step with c = half the current length; here, as
  for rope, keys are scaled before they enter the KV cache, so c must stay fixed for the life of a cache:
  ``center`` (default: half the model's maximum position count, the centre torchscale uses for a sequence of
  that length). The scores are the same (up to float rounding) for any c.
* The rotation is rope's in every other respect (every rope parameter, with the same defaults: theta, layout,
  partial_rotary_factor, scaling; the model's own scaled or per-layer rotary where theta is None). With partial
  rotary only the R rotated dims are scaled (zeta over R/2 frequencies); the pass-through dims carry no
  position and no decay. A large ``scale_base`` turns xpos into rope (zeta^(x/B) -> 1).
* The paper's second component, blockwise causal attention at inference (attending to the keys of the previous
  and the current block of the training length), is an attention pattern, not part of this encoding; every
  encoding's sliding ``window`` is the nearest thing hf_posenc offers.
* Angles and the scales are computed in float32, then the combined factors cos * zeta^(+-) and sin * zeta^(+-)
  are cast to the activations' dtype, as rope casts cos and sin. Positions are the logical ``position_ids``
  (the KV-cache offset and left padding included), as for rope.

Range. The largest factor, zeta_0^(-|n - c|/B), must stay representable: hf_posenc requires its log2 to be at
most half the dtype's exponent range (about 64 in float32 and bfloat16: |n - c| <= 18,129 at B = 512; 8 in float16:
|n - c| <= 2,266), leaving room for the magnitudes of q and k themselves. In eager mode with positions on the
CPU a forward beyond that raises a ValueError that names the bound; on a GPU the check would cost a device
sync per forward, so it is skipped there, as DESIGN.md asks for value checks: keep the positions within the
bound (set ``center`` near them), or raise ``scale_base``.

Bidirectional models (BERT, ViT) are refused. The paper defines xPos for causal language models (its blockwise
causal attention too), where n >= m and every factor zeta^((n - m)/B) <= 1. On a bidirectional model keys
after the query (m > n) would get zeta^((n - m)/B) > 1: the score would grow exponentially with the distance
to the right (torchscale's encoder config accepts ``xpos_rel_pos`` and does exactly that). The symmetric
generalisation, zeta^(|n - m|/B), is not a product of a query factor and a key factor, so it cannot be a q/k
transform (it would need a second score per pair inside the attention kernels, a different encoding).
x-transformers refuses it too (``rotary xpos is not compatible with bidirectional attention``). So xpos is
registered for the causal-text families only, and ``patch_model`` on BERT or ViT raises a ValueError listing
the families it supports.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..config import PosEncConfig
from ..registry import param, register_encoding
from .base import ModelInfo, PosContext
from .rope import Rope, RotaryParams, _check_scaling

__all__ = ["Xpos", "xpos_zeta", "xpos_decay", "xpos_max_distance"]


def xpos_zeta(rotary_dim: int, gamma: float) -> torch.Tensor:
    """zeta_i = (i / (R/2) + gamma) / (1 + gamma) for i < R/2, float32 (R = ``rotary_dim``, even)."""
    i = torch.arange(rotary_dim // 2, dtype=torch.float64)
    return ((i / (rotary_dim // 2) + gamma) / (1.0 + gamma)).float()


def xpos_decay(positions: torch.Tensor, zeta: torch.Tensor, scale_base: float, center: int) -> torch.Tensor:
    """The query factors zeta_i^((n - c)/B): (B|1, L, R/2) float32 for integer ``positions`` n (B|1, L),
    ``zeta`` (R/2,); the key factors are their reciprocals. n - c is taken in int64 (exact), then float32."""
    exponent = (positions.long() - center).to(torch.float32) / scale_base
    return torch.pow(zeta.to(positions.device), exponent[..., None])


def xpos_max_distance(gamma: float, scale_base: float, dtype: torch.dtype) -> int:
    """The largest |n - c| whose factor zeta_0^(-|n - c|/B) has log2 at most half the exponent range of
    ``dtype`` (see the module docstring)."""
    zeta0 = gamma / (1.0 + gamma)
    return int(math.floor(math.log2(torch.finfo(dtype).max) / 2 * scale_base / -math.log2(zeta0)))


@dataclass
class XposParams(RotaryParams):
    scale_base: float = param(
        512.0,
        "scale base B of the decay: pair i of a query at n and a key at m is weighted by zeta_i^((n - m) / B) "
        "(512: the paper's code); large values approach plain rope",
        type=float,
        gt=0.0,
    )
    gamma: float = param(
        0.4,
        "offset in zeta_i = (i / (R/2) + gamma) / (1 + gamma), the per-frequency decay rate (0.4: the paper)",
        type=float,
        gt=0.0,
    )
    center: int | None = param(
        None,
        "position c the decay exponents are measured from, (n - c) / B: numerics only (the scores do not depend "
        "on it; it keeps the query and key factors bounded); None: half the model's maximum position count",
        type=int,
        optional=True,
        ge=0,
    )

    def __post_init__(self) -> None:
        if self.scaling is not None:
            _check_scaling(self.scaling, "xpos")


@register_encoding(
    "xpos",
    params=XposParams,
    kind="q/k transform",
    summary="rotary with an exponential decay per frequency, zeta^((n - m)/B) (xPos); causal models only",
    paper="https://arxiv.org/abs/2212.10554",
    families=("llama",),  # every causal-text family; bidirectional ones refused (see the module docstring)
)
class Xpos(Rope):
    """xPos: rope's rotation times zeta^((n - c)/B) on queries and zeta^(-(m - c)/B) on keys; see the module
    docstring for the formula and the choices."""

    # f_q(q, n) . f_k(k, m) depends on n - m only (the centre c cancels), as rope's rotation does; not across
    # longrope's switch or dynamic scaling past the original length (rope's own exceptions).
    relative = True
    # its scale decays with n - m beside the rotation: the remap engine (rope's remap, a window's cache sinks) rotates
    # pairs by another distance and would leave the scale at the true one; xpos keeps the band mask for a window
    remappable = False
    cache_sink_positions = False

    @classmethod
    def resolve(cls, config: PosEncConfig, info: ModelInfo) -> PosEncConfig:
        config = super().resolve(config, info)
        if config.params["center"] is not None:
            return config
        p = dict(config.params)
        p["center"] = cls._default_center(info)
        return PosEncConfig(config.name, p)

    @staticmethod
    def _default_center(info: ModelInfo) -> int:
        """Half the model's maximum position count (0 for a model without one)."""
        return int(info.max_positions) // 2 if info.max_positions else 0

    def check_model(self, info: ModelInfo) -> None:
        if not info.causal:
            raise ValueError(
                f"xpos is defined for causal attention only: on the bidirectional {info.family} a key after the "
                "query would be weighted by zeta^((n - m)/B) > 1, growing with the distance (see hf_posenc.encodings"
                ".xpos); use rope there"
            )
        super().check_model(info)

    def __init__(self, config: PosEncConfig, info: ModelInfo) -> None:
        super().__init__(config, info)
        p = config.params
        self.scale_base = float(p["scale_base"])
        self.gamma = float(p["gamma"])
        center = p["center"]
        self.center = int(center) if center is not None else self._default_center(info)
        #: zeta_i over the rotated dims (R/2,), float32 on the CPU (a plain attribute: it stays float32 under
        #: ``model.to``).
        self.zeta = xpos_zeta(self.rotary_dim, self.gamma)

    def decay(
        self, ctx: PosContext, positions: torch.Tensor, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(zeta_i^((n - c)/B), its reciprocal): (B|1, 1, L, R/2) float32 each, the query and key factors of the
        new tokens at ``positions`` (B|1, L); built once per forward (``ctx.memo``) and shared by the layers.
        Raises ValueError (eager, positions on the CPU) where a factor would leave the range of ``dtype`` (module
        docstring, Range)."""
        key = ("xpos_decay", device, dtype)
        if key in ctx.memo:
            return ctx.memo[key]
        if not torch.compiler.is_compiling() and positions.device.type == "cpu" and positions.numel():
            self._check_range(positions, dtype)
        up = xpos_decay(positions.to(device), self.zeta, self.scale_base, self.center)[:, None]
        ctx.memo[key] = out = (up, 1.0 / up)
        return out

    def _check_range(self, positions: torch.Tensor, dtype: torch.dtype) -> None:
        limit = xpos_max_distance(self.gamma, self.scale_base, dtype)
        low, high = int(positions.min()), int(positions.max())
        worst = high if high - self.center >= self.center - low else low
        if abs(worst - self.center) > limit:
            raise ValueError(
                f"xpos: position {worst} is {abs(worst - self.center)} from the centre c={self.center}; at "
                f"scale_base={self.scale_base:g} and gamma={self.gamma:g} the factors zeta^(+-(n - c)/B) stay within "
                f"the range of {dtype} up to |n - c| = {limit}. Raise scale_base, set center nearer the positions "
                "in use, or compute in a wider dtype"
            )

    def rotate(
        self, ctx: PosContext, q: torch.Tensor, k: torch.Tensor, layer: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate the first ``rotary_dim`` dims of q (B, H, L, D) and k (B, Hkv, L, D) of the new tokens as rope
        does and scale pair i by zeta_i^((n - c)/B) on the queries, zeta_i^(-(n - c)/B) on the keys."""
        positions, cos, sin = self.rotation_tables(ctx, q.device, layer)
        up, down = self.decay(ctx, positions, q.device, q.dtype)
        q_tables = ((cos * up).to(q.dtype), (sin * up).to(q.dtype))
        k_tables = ((cos * down).to(q.dtype), (sin * down).to(q.dtype))
        return self.apply_tables(q, k, q_tables, k_tables)
