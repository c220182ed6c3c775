"""``fope``: Fourier position embedding.

"Fourier Position Embedding: Enhancing Attention's Periodic Extension for Length Generalization",
Hua et al. 2024 (ICML 2025), https://arxiv.org/abs/2412.17739 (official code:
https://github.com/TsinghuaC3I/Fourier-Position-Embedding, ``olmo/model.py``, ``FourierEmbedding``).

RoPE multiplies the m-th coordinate pair of a query or key at position n by e^{i ω_m n}. FoPE replaces
that single frequency by a Fourier series over D frequencies {ω_j} and clips the under-trained low
frequencies to zero (paper Eq. 11-13):

    ω_l = 2π / L_train                                   floor frequency
    ω_j = θ^(-j/D),  j = 0 .. D-1;  kept: K = {j : ω_j >= ω_l}   (ω_j < ω_l is clipped to zero)
    pair m, dominant frequency ω_m = θ^(-2m/d) (the rotary one, d = head_dim):
      ω_m <  ω_l:  f_m(n) = 1                                          (zero frequency: not rotated)
      ω_m >= ω_l:  C_m(n) = Σ_{j∈K} a^h_{jm} cos(ω_j n),  S_m(n) = Σ_{j∈K} b^h_{jm} sin(ω_j n)
    (x_m, y_m) -> (x_m C_m(n) - y_m S_m(n),  y_m C_m(n) + x_m S_m(n))      [= (x + iy)(C + iS)]

with per-head coefficient matrices a^h (cos) and b^h (sin), each (D, d/2). "Clipped to zero" means
the frequency becomes 0: its term is constant in n, so it carries no position. For the dominant
frequency of a pair that makes the pair's factor exactly 1 (angle 0); among the harmonics a clipped
frequency is dropped from the sums (the official ``fourier_ignore_zero``; kept, its cos(0) = 1 term
would add a position-independent constant to C_m).

With a = b = the identity on the dominant frequencies (a_{jm} = [ω_j = ω_m]) and no clipping,
C_m = cos(ω_m n), S_m = sin(ω_m n): FoPE is exactly ``rope`` (same layout and sign).

Choices, from the paper and the official code (configs ``*-fourier-eye_xavier_norm_*-sep_basis_head-
ignore_clamp_zero.yaml``):

* Coefficients are fixed random, not learned ("gradients are not required for these matrices",
  Appendix B; ``fourier_learnable: False``); ``learnable=True`` trains them. Fixed ones are buffers, saved
  with the model. Separate matrices for cos and sin, for every head (``fourier_separate_basis``,
  ``fourier_separate_head``) and for every layer (``per_layer``; the official code builds one
  ``FourierEmbedding`` per block); under grouped-query attention one per key/value head, query head h using
  its key/value head's, so that q_h and k_g(h) are transformed alike (as in the official multi-head code).
* Initialisation ``eye_xavier_norm``: the identity above plus ``xavier_normal_(gain=σ)`` of the
  (heads, |K|, P) tensor (P the pairs with a Fourier series), i.e. N(0, σ² · 2 / (P (|K| + heads))).
  The paper's text says N(0, σ); its code, which produced its results, draws the smaller xavier values.
  σ = ``sigma``, 0.3 by default (the paper's 60M setting; 0.4 and 0.6 for 180M and 1.2B).
* D = ``num_frequencies``, default d/2 (the official ``fourier_dim: 0``: the rotary frequencies
  themselves); a multiple of d/2, so that the rotary frequencies are among the ω_j (paper: {ω_m} ⊆ {ω}).
* L_train = ``train_length``, default the model's maximum position count (the context it is trained
  for: Llama's ``max_position_embeddings``, GPT-2's ``n_positions``; the official code uses its
  ``max_sequence_length``); 0 turns clipping off.
* Layout ``half`` pairs x[m] with x[m + d/2] (the official code's ``rotate_half``, and transformers'
  Llama), ``interleaved`` pairs x[2m] with x[2m+1]. The sign is the official code's (and rope's):
  x * C + rotate_half(x) * S.
* Three deviations from the official code (``olmo/model.py``, ``FourierEmbedding``), all following the
  paper's Eq. 13: zero-frequency pairs are left unchanged (the code pads C and S with 1, which multiplies
  those pairs by 1 + i, i.e. rotates them by 45° and doubles their contribution to the logits); every pair
  whose rotary frequency is at or above the floor gets a Fourier series (the pair cap: the code gives a
  series to at most head_dim/4 pairs and marks that line TODO); and the identity part of the
  initialisation sits on each pair's own rotary frequency, a_{jm} = [ω_j = ω_m]. The code's
  ``get_step_eye`` instead puts pair i's unit coefficient on frequency index i · ⌈D / P⌉, P the number of
  pairs with a series; with the cap (P < d/2) that is not pair i's rotary frequency, so its start remaps
  every pair to another, lower frequency and no longer contains RoPE. Here FoPE with σ → 0 and no
  clipping is exactly ``rope`` (the paper: {ω_m} ⊆ {ω}).

θ: the model's ``rope_theta`` on Llama (as ``rope``), else 10000; 100 on ViT (the axial 2D RoPE value).
On ViT (bidirectional) positions are 2D: the first half of the pairs encodes the patch row and the second
half its column, each a FoPE over d/2 dimensions (ω_m = θ^(-4m/d), D/2 frequencies per axis), with the
floor 2π / (patches along that axis at the config's image size), or 2π / ``train_length`` when given;
any resolution runs without interpolation. The CLS token is not transformed. FoPE's factors are not
rotations (|C + iS| ≠ 1 in general) and not relative: the products of two series have cross terms.
The cos/sin of the angles are computed in float32 once per forward; each layer mixes them with its
coefficients (shared coefficients: once per forward, unless trained) and applies C, S in float32.

RoPE scaling (``rope``'s ``scaling``) is not taken: FoPE replaces the frequencies by its own Fourier series and
clips those below ``train_length``'s period, which is its own answer to extension; a sliding ``window`` applies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..config import PosEncConfig
from ..ops import upcast
from ..registry import param, register_encoding
from .base import ModelInfo, PosContext, PositionEncoding, new_tokens_key
from .rope import rope_inv_freq
from .rotary_base import token_coordinates

__all__ = ["Fope"]


@dataclass
class FopeParams:
    theta: float | None = param(
        None,
        "rotary base (default: the model's rope_theta on Llama, 10000 on GPT-2, 100 on ViT)",
        type=float,
        optional=True,
        gt=1.0,
    )
    train_length: int | None = param(
        None,
        "L_train: frequencies below 2*pi/L_train are clipped to zero (default: the model's maximum position "
        "count on text, the training patch grid per axis on ViT); 0 disables clipping",
        type=int,
        optional=True,
        ge=0,
    )
    num_frequencies: int | None = param(
        None,
        "D, the frequencies theta^(-j/D) of each Fourier series (default head_dim/2, the rotary ones; a multiple "
        "of head_dim/2)",
        type=int,
        optional=True,
        ge=1,
    )
    sigma: float = param(
        0.3, "gain of the random part of the coefficient matrices (paper: 0.3, 0.4, 0.6 by model size)", type=float,
        ge=0.0,
    )
    learnable: bool = param(False, "train the coefficient matrices (the paper keeps them fixed)", type=bool)
    per_layer: bool = param(
        True, "coefficients per layer (the official code: one FourierEmbedding per block) or shared", type=bool
    )
    layout: str = param(
        "half",
        "coordinate pairs: 'half' (x[i], x[i+d/2], the official code and transformers' Llama) or 'interleaved' "
        "(x[2i], x[2i+1])",
        type=str,
        choices=("half", "interleaved"),
    )


@register_encoding(
    "fope",
    params=FopeParams,
    kind="q/k transform",
    summary="Fourier series over several frequencies per coordinate pair, low ones clipped to zero; axial on ViT",
    paper="https://arxiv.org/abs/2412.17739",
)
class Fope(PositionEncoding):
    """Fourier position embedding; see the module docstring for the formula and the choices."""

    rotates_qk = True
    prepares_qkv = True  # so that the layer index reaches the per-layer coefficients
    relative = False  # products of two Fourier series have cross terms: not a function of n - m alone

    @classmethod
    def resolve(cls, config: PosEncConfig, info: ModelInfo) -> PosEncConfig:
        p = dict(config.params)
        vit = info.family == "vit"
        if p["theta"] is None:
            if vit:
                p["theta"] = 100.0
            else:
                if info.rope_type not in (None, "default"):
                    raise ValueError(
                        f"the model's rope_parameters use rope_type={info.rope_type!r}, which fope does not "
                        "implement; pass an explicit theta"
                    )
                p["theta"] = float(info.rope_theta) if info.rope_theta is not None else 10000.0
        if p["train_length"] is None and not vit:
            if info.max_positions is None:
                raise ValueError(
                    "fope clips frequencies below 2*pi/L_train and this model defines no maximum position count; "
                    "pass train_length (0 disables clipping)"
                )
            p["train_length"] = int(info.max_positions)
        if p["num_frequencies"] is None:
            p["num_frequencies"] = info.head_dim // 2
        return PosEncConfig(config.name, p)

    def check_model(self, info: ModelInfo) -> None:
        axes = 2 if info.family == "vit" else 1
        if info.head_dim % (2 * axes):
            raise ValueError(
                f"fope needs head_dim divisible by {2 * axes} on {info.family} (coordinate pairs"
                f"{', half of them per grid axis' if axes == 2 else ''}), got {info.head_dim}"
            )
        d = self.posenc_config.params["num_frequencies"]
        pairs = info.head_dim // 2
        if d is not None and d % pairs:
            raise ValueError(
                f"fope's num_frequencies must be a multiple of head_dim/2 = {pairs} (so that the rotary frequencies "
                f"are among them), got {d}"
            )

    def __init__(self, config: PosEncConfig, info: ModelInfo) -> None:
        super().__init__(config, info)
        p = config.params
        self.layout = p["layout"]
        self.num_axes = 2 if info.family == "vit" else 1
        self.pairs = info.head_dim // 2 // self.num_axes  # pairs per axis
        self.freqs_per_axis = p["num_frequencies"] // self.num_axes
        self.step = self.freqs_per_axis // self.pairs  # index of pair m's dominant frequency: m * step
        self.per_layer = p["per_layer"]
        heads = info.num_kv_heads
        shape = (info.num_layers if self.per_layer else 1, self.num_axes, heads, self.freqs_per_axis, self.pairs)
        eye = torch.zeros(shape)
        eye[..., torch.arange(self.pairs) * self.step, torch.arange(self.pairs)] = 1.0
        keep, fourier = self._masks()
        self._keep, self._fourier = keep, fourier  # fixed by the config: computed once (CPU, bool)
        std = torch.zeros(1, self.num_axes, 1, 1, 1)
        for a in range(self.num_axes):
            n_keep, n_pairs = int(keep[a].sum()), int(fourier[a].sum())
            if n_pairs:  # xavier_normal_ of the official (heads, |K|, P) tensor
                std[0, a] = p["sigma"] * math.sqrt(2.0 / (n_pairs * (n_keep + heads)))
        cos_coef = eye + torch.randn(shape) * std
        sin_coef = eye + torch.randn(shape) * std
        if p["learnable"]:
            self.cos_coef = nn.Parameter(cos_coef)
            self.sin_coef = nn.Parameter(sin_coef)
        else:
            self.register_buffer("cos_coef", cos_coef)
            self.register_buffer("sin_coef", sin_coef)

    # -- frequencies and masks ---------------------------------------------------------------------
    def frequencies(self) -> torch.Tensor:
        """ω_j = θ^(-j/D_axis), j < D_axis: (D_axis,) float32 (the rotary frequencies when D = head_dim/2)."""
        return rope_inv_freq(2 * self.freqs_per_axis, self.posenc_config.params["theta"])

    def floors(self) -> list[float]:
        """The floor frequency 2π / L_train of each axis (0 when clipping is off)."""
        length = self.posenc_config.params["train_length"]
        if self.num_axes == 1 or length is not None:
            lengths = [length] * self.num_axes
        else:
            lengths = list(self.info.grid)
        return [2 * math.pi / n if n else 0.0 for n in lengths]

    def _masks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(keep (axes, D_axis), fourier (axes, pairs)) bool: kept frequencies, pairs with a Fourier series."""
        freqs = self.frequencies()
        keep = torch.stack([freqs >= floor for floor in self.floors()])
        fourier = keep[:, :: self.step][:, : self.pairs]
        return keep, fourier

    # -- the math ----------------------------------------------------------------------------------
    def basis(self, coords: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos(ω_j p_a) and sin(ω_j p_a) of positions ``coords`` (B, L, axes), clipped frequencies zeroed:
        each (B, L, axes, D_axis) float32."""
        keep = self._keep.to(coords.device)
        angles = coords.to(torch.float32)[..., None] * self.frequencies().to(coords.device)  # (B, L, A, D)
        return angles.cos() * keep, angles.sin() * keep

    def combine(self, cos: torch.Tensor, sin: torch.Tensor, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """C and S of ``layer`` from `basis`: each (B, Hkv, L, head_dim/2), pairs in order (on ViT the
        row axis's pairs, then the column axis's), in the coefficients' compute dtype (float32, or float64)."""
        idx = layer if self.per_layer else 0
        cos_coef, sin_coef = upcast(self.cos_coef[idx]), upcast(self.sin_coef[idx])  # (A, H, D, P)
        fourier = self._fourier.to(cos_coef.device).flatten()  # (A*P,)
        c = torch.einsum("blad,ahdm->bhlam", cos.to(cos_coef.dtype), cos_coef).flatten(-2)
        s = torch.einsum("blad,ahdm->bhlam", sin.to(sin_coef.dtype), sin_coef).flatten(-2)
        return torch.where(fourier, c, torch.ones_like(c)), torch.where(fourier, s, torch.zeros_like(s))

    def fourier_terms(self, coords: torch.Tensor, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """C and S (B, Hkv, L, head_dim/2) of ``layer`` at positions ``coords`` (B, L, axes)."""
        return self.combine(*self.basis(coords), layer)

    def terms(
        self, ctx: PosContext, layer: int, length: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(C, S) of ``layer`` for the ``length`` new tokens, (B|1, Hkv, L, head_dim/2) float32; CLS gets (1, 0).
        The cos/sin basis is built once per forward; shared coefficients' C and S too (unless trained)."""
        shared = not self.per_layer and not (self.training and self.cos_coef.requires_grad)
        key = ("fope_terms", new_tokens_key(length), str(device))
        if shared and key in ctx.memo:
            return ctx.memo[key]
        basis_key = ("fope_basis", new_tokens_key(length), str(device))
        if basis_key not in ctx.memo:  # depends on positions only: no parameter, no graph
            coords, cls = token_coordinates(ctx, length, device)
            ctx.memo[basis_key] = (*self.basis(coords[..., : self.num_axes]), cls)
        cos, sin, cls = ctx.memo[basis_key]
        c, s = self.combine(cos, sin, layer)
        c, s = upcast(c), upcast(s)  # float32 (float64 stays float64: gradcheck)
        if cls is not None:  # no `if cls.any()`: reading it is a sync and a graph break (torch.compile)
            mask = cls.to(c.device)[None, None, :, None]
            c = c.masked_fill(mask, 1.0)
            s = s.masked_fill(mask, 0.0)
        if shared:
            ctx.memo[key] = (c, s)
        return c, s

    def apply(self, x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """x (B, H, L, D) times (C + iS) pair by pair; c, s (B|1, H, L, D/2) float32. Returns x's dtype."""
        xf = upcast(x)  # float32 (float64 stays float64: gradcheck)
        if self.layout == "half":
            half = x.shape[-1] // 2
            x1, x2 = xf[..., :half], xf[..., half:]
            return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        return torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2).to(x.dtype)

    def rotate(
        self, ctx: PosContext, q: torch.Tensor, k: torch.Tensor, layer: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Transform q (B, H, L, D) and k (B, Hkv, L, D) of the new tokens with ``layer``'s coefficients."""
        c, s = self.terms(ctx, layer, q.shape[2], q.device)
        groups = q.shape[1] // k.shape[1]
        cq, sq = (c, s) if groups == 1 else (c.repeat_interleave(groups, 1), s.repeat_interleave(groups, 1))
        return self.apply(q, cq, sq), self.apply(k, c, s)

    def prepare(
        self, ctx: PosContext, layer: int, hidden: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The attention modules' entry point (it carries the layer index); v passes through unchanged."""
        q, k = self.rotate(ctx, q, k, layer)
        return q, k, v
