"""``rope``: rotary position embedding.

"RoFormer: Enhanced Transformer with Rotary Position Embedding", Su et al. 2021,
https://arxiv.org/abs/2104.09864. For a query or key x at position m and head dimension d,

    theta_i = base^(-2i/d),  i = 0 .. d/2 - 1
    (R_m x)_pair_i = [[cos(m theta_i), -sin(m theta_i)], [sin(m theta_i), cos(m theta_i)]] @ x_pair_i

so that (R_m q)^T (R_n k) = q^T R_(n-m) k depends only on n - m. ``layout`` picks which coordinates form
a pair: ``"half"`` pairs x[i] with x[i + d/2] (the layout of transformers' Llama, so a Llama patched with
rope reproduces the unpatched model), ``"interleaved"`` pairs x[2i] with x[2i+1] (the paper's layout).
Angles are computed in float32. Queries and keys are rotated before they enter the KV cache, at their
logical ``position_ids`` (left padding shifts them as transformers does).

On ViT the patches are rotated by their index in raster order (row * cols + col); the CLS token is not
rotated (it takes no positional term).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import PosEncConfig
from ..registry import param, register_encoding
from .base import ModelInfo, PosContext, PositionEncoding

__all__ = ["Rope", "rope_inv_freq", "apply_rotary"]


def rope_inv_freq(dim: int, base: float) -> torch.Tensor:
    """theta_i = base^(-2i/dim) for i < dim/2, float32, computed on the CPU as transformers does."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str) -> torch.Tensor:
    """Rotate ``x`` (B, H, L, D) by angles whose cos/sin have shape (B or 1, 1, L, D/2)."""
    if layout == "half":
        cos = torch.cat([cos, cos], dim=-1)
        sin = torch.cat([sin, sin], dim=-1)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.flatten(-2)


@dataclass
class RopeParams:
    theta: float | None = param(
        None,
        "rotary base (default: the model's rope_theta on Llama, else 10000)",
        type=float,
        optional=True,
        gt=1.0,
    )
    layout: str = param(
        "half",
        "which coordinates are rotated together: 'half' (x[i], x[i+d/2], transformers' Llama) or "
        "'interleaved' (x[2i], x[2i+1], the paper)",
        type=str,
        choices=("half", "interleaved"),
    )


@register_encoding(
    "rope",
    params=RopeParams,
    kind="q/k transform",
    summary="rotary embedding of queries and keys (Llama's native kind); raster order on ViT",
    paper="https://arxiv.org/abs/2104.09864",
)
class Rope(PositionEncoding):
    """Rotary position embedding; see the module docstring for the formula."""

    rotates_qk = True

    @classmethod
    def resolve(cls, config: PosEncConfig, info: ModelInfo) -> PosEncConfig:
        p = dict(config.params)
        if p["theta"] is None:
            if info.rope_type not in (None, "default"):
                raise ValueError(
                    f"the model's rope_parameters use rope_type={info.rope_type!r}, which hf_posenc's rope does not "
                    "implement yet; pass an explicit theta to use plain rotary embedding"
                )
            p["theta"] = float(info.rope_theta) if info.rope_theta is not None else 10000.0
        return PosEncConfig(config.name, p)

    def check_model(self, info: ModelInfo) -> None:
        if info.head_dim % 2:
            raise ValueError(f"rope needs an even head_dim, got {info.head_dim}")

    def _angles(self, positions: torch.Tensor, device: torch.device) -> torch.Tensor:
        inv_freq = rope_inv_freq(self.info.head_dim, self.posenc_config.params["theta"]).to(device)
        return positions.to(device=device, dtype=torch.float32)[..., None] * inv_freq

    def rotate(self, ctx: PosContext, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q (B, H, L, D) and k (B, Hkv, L, D) of the new tokens."""
        if ctx.grid is None:
            positions = ctx.position_ids
        else:
            rows, cols = ctx.grid
            positions = torch.arange(rows * cols + 1, device=q.device)[None] - 1
        angles = self._angles(positions, q.device)[:, None]  # (B|1, 1, L, D/2)
        cos, sin = angles.cos(), angles.sin()
        if ctx.grid is not None:  # CLS (index 0, position -1) stays unrotated
            cos = cos.clone()
            sin = sin.clone()
            cos[..., 0, :] = 1.0
            sin[..., 0, :] = 0.0
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        layout = self.posenc_config.params["layout"]
        return apply_rotary(q, cos, sin, layout), apply_rotary(k, cos, sin, layout)
