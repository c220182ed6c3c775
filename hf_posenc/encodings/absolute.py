"""Absolute encodings added to the token embeddings: ``nope``, ``sinusoidal``, ``learned``.

* NoPE: "Length Generalization of Causal Transformers without Position Encoding", Wang et al. 2024,
  https://arxiv.org/abs/2404.12224 -- no position signal at all; a causal mask alone lets a decoder
  infer order. On ViT there is no such cue: the model becomes permutation-invariant over patches.

  DroPE ("Extending the Context of Pretrained LLMs by Dropping Their Positional Embeddings", Gelberg et al.,
  ICLR 2026; the authors' code: github.com/SakanaAI/DroPE, ``custom_models/attention.py``) drops a pretrained
  model's RoPE and recalibrates it at its original context: ``nope`` on a pretrained RoPE model. Its options, as
  the authors' code has them:

  - ``qk_norm`` ("q", "k", "qk"): an RMSNorm over the whole query projection, the whole key projection, or both
    (all heads of a token at once: q_norm = RMSNorm(H·D), k_norm = RMSNorm(H_kv·D)), with a learned weight that
    starts at 1 and the model's own ``rms_norm_eps`` (``qk_norm_eps``); applied to the projections before the
    attention (after a family's own per-head QK-norm, where it has one). One weight per layer.
  - ``softmax_scale``: the logit scale of the attention instead of the model's (1/√D for most families); the
    authors' default is the model's own (their config sets none).
  Neither is in NoPE's paper; both default to off, which is plain NoPE.
* Sinusoidal: "Attention Is All You Need", Vaswani et al. 2017, https://arxiv.org/abs/1706.03762 --
  PE(pos, 2i) = sin(pos / base^(2i/d)),  PE(pos, 2i+1) = cos(pos / base^(2i/d)), interleaved as in the
  paper, added to the token embeddings. On ViT: the 2D form (MAE, https://arxiv.org/abs/2111.06377):
  the first d/2 channels encode the patch row, the last d/2 the column, each with the 1D formula at
  dimension d/2; the CLS token gets no positional term.

  Scale (``scale``, default: the model's ``initializer_range``). The paper adds the unit-amplitude table
  to embeddings multiplied by √d_model (Section 3.4), embeddings that are themselves of scale ~1/√d_model
  (shared with the pre-softmax projection), so tokens and positions enter at comparable, O(1) scales.
  Hugging Face models do not multiply their embeddings and initialise them with std ``initializer_range``
  σ (0.02 for Llama, GPT-2 and ViT, whose own learned position table starts at the same σ): the raw table
  would be ~35× larger than the tokens and drown them. ``scale`` multiplies the table; its default σ keeps
  the paper's token-to-position ratio (token std σ, position amplitude σ). ``scale=1.0`` is the raw table.
* Learned: a trained table added to the embeddings (GPT-2's and ViT's native kind, e.g.
  "Improving Language Understanding by Generative Pre-Training", Radford et al. 2018, and
  "An Image is Worth 16x16 Words", https://arxiv.org/abs/2010.11929). On GPT-2 and ViT the model's
  own table is adopted, so the patched model reproduces the unpatched one. On ViT the table has a
  CLS slot (as in the paper) and is interpolated bicubically for other image sizes exactly as
  transformers does when ``interpolate_pos_encoding=True``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..config import PosEncConfig
from ..ops import eager_value_checks
from ..registry import param, register_encoding
from .base import ModelInfo, PosContext, PositionEncoding

__all__ = ["NoPE", "Sinusoidal", "Learned", "sinusoidal_table"]


@dataclass
class NoPEParams:
    qk_norm: str | None = param(
        None, "DroPE's QK-norm: an RMSNorm with a learned weight over the whole query projection ('q'), the whole "
        "key projection ('k') or both ('qk'), before the attention (SakanaAI/DroPE); None: none",
        type=str, optional=True, choices=("q", "k", "qk"))
    qk_norm_eps: float | None = param(
        None, "epsilon of qk_norm's RMSNorm; None: the model's own rms_norm_eps (as DroPE's code), 1e-6 where the "
        "model has none", type=float, optional=True, gt=0.0)
    softmax_scale: float | None = param(
        None, "DroPE's softmax_scale: the attention's logit scale instead of the model's (1/sqrt(head_dim) for "
        "most families); None: the model's", type=float, optional=True, gt=0.0)


@register_encoding(
    "nope",
    params=NoPEParams,
    kind="absolute",
    summary="no position signal: removes the model's own encoding",
    paper="https://arxiv.org/abs/2404.12224",
)
class NoPE(PositionEncoding):
    """No position encoding: the patch removes the model's own and adds nothing; optionally DroPE's QK-norm and
    softmax scale (see the module docstring)."""

    relative = True  # no position signal at all: position_ids are never read

    def __init__(self, config: PosEncConfig, info: ModelInfo) -> None:
        super().__init__(config, info)
        self.qk_norm = config.params["qk_norm"]
        #: the attention's logit scale instead of the model's (read by the attention function), or None.
        self.softmax_scale = config.params["softmax_scale"]
        #: q/k pass through ``prepare`` only with a QK-norm.
        self.prepares_qkv = self.qk_norm is not None
        if self.qk_norm is not None:
            n = info.num_layers
            if "q" in self.qk_norm:
                #: DroPE's q_norm weights (layers, H·D), from 1 (nn.RMSNorm's start)
                self.q_norm_weight = nn.Parameter(torch.ones(n, info.num_heads * info.head_dim))
            if "k" in self.qk_norm:
                self.k_norm_weight = nn.Parameter(torch.ones(n, info.num_kv_heads * info.head_dim))

    @classmethod
    def resolve(cls, config: PosEncConfig, info: ModelInfo) -> PosEncConfig:
        if config.params["qk_norm"] is None or config.params["qk_norm_eps"] is not None:
            return config
        return config.replace(qk_norm_eps=info.norm_eps if info.norm_eps is not None else 1e-6)

    def prepare(
        self, ctx: PosContext, layer: int, hidden: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B, H, Lq, D) and k (B, Hkv, Lq, D) through DroPE's RMSNorm over all heads of each token."""
        eps = self.posenc_config.params["qk_norm_eps"] or 1e-6
        if "q" in self.qk_norm:
            q = _rms_norm_over_heads(q, self.q_norm_weight[layer], eps)
        if "k" in self.qk_norm:
            k = _rms_norm_over_heads(k, self.k_norm_weight[layer], eps)
        return q, k, v


def _rms_norm_over_heads(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x (B, H, L, D) over all H·D channels of each token (the whole projection, as DroPE's
    ``nn.RMSNorm(H·D)`` before the head split), with ``weight`` (H·D,); computed in float32, returned in x's dtype
    (``torch.nn.functional.rms_norm`` on the token's channels)."""
    b, h, n, d = x.shape
    flat = x.transpose(1, 2).reshape(b, n, h * d)
    out = torch.nn.functional.rms_norm(flat.float(), (h * d,), weight.float(), eps)
    return out.to(x.dtype).reshape(b, n, h, d).transpose(1, 2)


def sinusoidal_table(positions: torch.Tensor, dim: int, base: float) -> torch.Tensor:
    """Interleaved sin/cos of Vaswani et al. for integer ``positions`` (...,) -> (..., dim) float32.

    out[..., 2i] = sin(pos * base^(-2i/dim)), out[..., 2i+1] = cos(pos * base^(-2i/dim)).
    """
    half = torch.arange(0, dim, 2, device=positions.device, dtype=torch.float64)
    inv_freq = torch.exp(-math.log(base) * half / dim).to(torch.float32)
    angles = positions.to(torch.float32)[..., None] * inv_freq
    out = torch.stack([angles.sin(), angles.cos()], dim=-1)
    return out.flatten(-2)


@dataclass
class SinusoidalParams:
    base: float = param(10000.0, "wavelength base of the sinusoids (10000 in the paper)", type=float, gt=1.0)
    scale: float | None = param(
        None,
        "amplitude of the sin/cos table (default: the model's initializer_range, the std of its token embeddings "
        "at initialisation, which keeps the paper's token-to-position ratio; 1.0 = the raw table)",
        type=float,
        optional=True,
        gt=0.0,
    )


@register_encoding(
    "sinusoidal",
    params=SinusoidalParams,
    kind="absolute",
    summary="fixed interleaved sin/cos added to the embeddings; 2D over the patch grid on ViT",
    paper="https://arxiv.org/abs/1706.03762",
)
class Sinusoidal(PositionEncoding):
    """Fixed sinusoids added to the embeddings; see the module docstring for the formula."""

    adds_embeddings = True

    @classmethod
    def resolve(cls, config: PosEncConfig, info: ModelInfo) -> PosEncConfig:
        if config.params.get("scale") is not None:
            return config
        return PosEncConfig(config.name, dict(config.params, scale=float(info.initializer_range)))

    def check_model(self, info: ModelInfo) -> None:
        mult = 4 if info.family == "vit" else 2
        if info.hidden_size % mult:
            raise ValueError(
                f"sinusoidal needs hidden_size divisible by {mult} on {info.family}, got {info.hidden_size}"
            )

    def embed(self, ctx: PosContext, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Text: (B or 1, Lq, D) at ``ctx.position_ids``; ViT: (1, 1 + rows*cols, D), zero for CLS."""
        base = self.posenc_config.params["base"]
        scale = self.posenc_config.params["scale"]
        scale = float(self.info.initializer_range) if scale is None else scale
        dim = self.info.hidden_size
        if ctx.grid is None:
            return (scale * sinusoidal_table(ctx.position_ids.to(device), dim, base)).to(dtype)
        rows, cols = ctx.grid
        r = torch.arange(rows, device=device).repeat_interleave(cols)
        c = torch.arange(cols, device=device).repeat(rows)
        pe = torch.cat([sinusoidal_table(r, dim // 2, base), sinusoidal_table(c, dim // 2, base)], dim=-1)
        pe = torch.cat([pe.new_zeros(1, dim), pe], dim=0)
        return (scale * pe[None]).to(dtype)


@dataclass
class LearnedParams:
    max_positions: int | None = param(
        None,
        "rows of the table on text models (default: the model's own maximum, e.g. n_positions); "
        "not used on ViT, whose table follows the patch grid",
        type=int,
        optional=True,
        ge=1,
    )
    init_std: float | None = param(
        None,
        "standard deviation of the initial table (default: the model's initializer_range)",
        type=float,
        optional=True,
        gt=0.0,
    )


@register_encoding(
    "learned",
    params=LearnedParams,
    kind="absolute",
    summary="learned table added to the embeddings (GPT-2's and ViT's native kind)",
    paper="https://arxiv.org/abs/2010.11929",
)
class Learned(PositionEncoding):
    """A learned table ``weight`` added to the embeddings; see the module docstring."""

    adds_embeddings = True

    @classmethod
    def resolve(cls, config: PosEncConfig, info: ModelInfo) -> PosEncConfig:
        p = dict(config.params)
        if info.family == "vit":
            if p["max_positions"] is not None:
                raise ValueError(
                    "learned on ViT takes no max_positions: its table has one row per patch of the config's "
                    "image grid plus the CLS token"
                )
        elif p["max_positions"] is None:
            if info.max_positions is None:
                raise ValueError(f"learned needs max_positions: the {info.family} config has no maximum position")
            p["max_positions"] = info.max_positions
        if p["init_std"] is None:
            p["init_std"] = float(info.initializer_range)
        return PosEncConfig(config.name, p)

    def __init__(self, config: PosEncConfig, info: ModelInfo) -> None:
        super().__init__(config, info)
        p = config.params
        if info.family == "vit":
            rows, cols = info.grid
            shape = (1, rows * cols + 1, info.hidden_size)
        else:
            shape = (p["max_positions"], info.hidden_size)
        self.weight = nn.Parameter(torch.empty(shape))
        with torch.no_grad():
            nn.init.trunc_normal_(self.weight, std=p["init_std"], a=-2 * p["init_std"], b=2 * p["init_std"])

    def adopt_native(self, native: dict[str, torch.Tensor]) -> bool:
        table = native.get("table")
        if table is None or table.shape != self.weight.shape:
            return False
        with torch.no_grad():
            self.weight.copy_(table)
        return True

    def embed(self, ctx: PosContext, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Text: rows ``ctx.position_ids`` of the table (B or 1, Lq, D); ViT: (1, 1 + rows*cols, D)."""
        if ctx.grid is None:
            pos = ctx.position_ids
            n = self.weight.shape[0]
            # Reading the positions is a device sync (and a graph break under torch.compile): eager CPU only;
            # elsewhere an out-of-range position surfaces as the embedding's own index error.
            if pos.numel() and eager_value_checks(pos):
                top, low = int(pos.max()), int(pos.min())
                if top >= n or low < 0:
                    raise ValueError(
                        f"position {top if top >= n else low} is outside the learned table of {n} positions "
                        f"(0 .. {n - 1}, max_positions={n}); use shorter inputs, non-negative position_ids, patch "
                        "with a larger max_positions, or use a relative encoding"
                    )
            return nn.functional.embedding(pos, self.weight).to(dtype)
        return self._vit_table(ctx).to(dtype)

    def _vit_table(self, ctx: PosContext) -> torch.Tensor:
        rows, cols = ctx.grid
        trows, tcols = self.info.grid
        num_patches = rows * cols
        num_positions = self.weight.shape[1] - 1
        # Same rule as transformers' ViTEmbeddings.interpolate_pos_encoding.
        if (rows, cols) == (trows, tcols) and not ctx.interpolate:
            return self.weight
        if not ctx.interpolate:
            ph, pw = self.info.patch_size
            raise ValueError(
                f"Input image size ({rows * ph}*{cols * pw}) doesn't match model ({trows * ph}*{tcols * pw}); "
                "the learned table is interpolated only with interpolate_pos_encoding=True"
            )
        if not torch.jit.is_tracing() and num_patches == num_positions and rows == cols:
            return self.weight
        cls_pos = self.weight[:, :1]
        patch_pos = self.weight[:, 1:]
        dim = self.weight.shape[-1]
        # the table's own grid (transformers assumes a square one, sqrt(num_positions) per side, and fails on a
        # non-square image_size; the same for square grids)
        patch_pos = patch_pos.reshape(1, trows, tcols, dim).permute(0, 3, 1, 2)
        patch_pos = nn.functional.interpolate(patch_pos, size=(rows, cols), mode="bicubic", align_corners=False)
        patch_pos = patch_pos.permute(0, 2, 3, 1).view(1, -1, dim)
        return torch.cat((cls_pos, patch_pos), dim=1)
