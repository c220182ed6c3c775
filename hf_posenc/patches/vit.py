"""ViT: ``ViTModel`` and the heads built on it (classification, masked image modeling).

The native ``position_embeddings`` parameter is removed; the patched embeddings add the encoding's
absolute term (if any) for the patch grid of each forward's images; attention modules are swapped (per
instance) for subclasses that apply q/k transforms and biases over the grid. Sequence layout:
[CLS] followed by the patches in raster order (row-major). Images of any size divisible by the patch
size work with encodings that are not tables; the learned table interpolates as transformers does.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from transformers.models.vit.modeling_vit import ViTAttention, ViTEmbeddings, ViTModel

from ..encodings.base import ModelInfo
from .base import (
    FamilyPatch, add_embeddings, lend_context, lent_context, make_context, require_ctx, run_attention, swap_attention,
    swap_class,
)
from .decoder import AttentionLayout


def _pair(x: Any) -> tuple[int, int]:
    return tuple(x) if isinstance(x, Iterable) else (x, x)


class PosEncViTModel(ViTModel):
    """``ViTModel`` whose forward builds the hf_posenc context for this forward's patch grid."""

    def forward(
        self,
        pixel_values: torch.Tensor | None = None,
        bool_masked_pos: torch.BoolTensor | None = None,
        interpolate_pos_encoding: bool | None = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ):
        if pixel_values is None:
            raise ValueError("You have to specify pixel_values")
        if not isinstance(pixel_values, torch.Tensor) or pixel_values.dim() != 4:
            shape = tuple(pixel_values.shape) if isinstance(pixel_values, torch.Tensor) else type(pixel_values).__name__
            raise ValueError(f"pixel_values must have shape (batch, channels, height, width), got {shape}")
        ph, pw = self.posenc_info.patch_size
        height, width = pixel_values.shape[-2:]
        if height % ph or width % pw:
            raise ValueError(
                f"image size {height}x{width} is not a multiple of the patch size {ph}x{pw}; hf_posenc places "
                "every patch on the grid"
            )
        ctx = make_context(
            self,
            need_weights=kwargs.get("output_attentions"),
            grid=(height // ph, width // pw),
            interpolate=bool(interpolate_pos_encoding),
        )
        with lend_context(self.embeddings, ctx):
            return super().forward(
                pixel_values,
                bool_masked_pos=bool_masked_pos,
                interpolate_pos_encoding=interpolate_pos_encoding,
                attention_mask=attention_mask,
                posenc_ctx=ctx,
                **kwargs,
            )


class PosEncViTEmbeddings(ViTEmbeddings):
    """Patch and CLS embeddings plus the encoding's absolute term (the native table is gone)."""

    posenc_ctx = None

    def forward(
        self,
        pixel_values: torch.Tensor,
        bool_masked_pos: torch.BoolTensor | None = None,
        interpolate_pos_encoding: bool = False,
    ) -> torch.Tensor:
        ctx = lent_context(self, "ViT")
        batch_size = pixel_values.shape[0]
        embeddings = self.patch_embeddings(pixel_values)
        if bool_masked_pos is not None:
            mask_tokens = self.mask_token.expand(batch_size, embeddings.shape[1], -1)
            mask = bool_masked_pos.unsqueeze(-1).type_as(mask_tokens)
            embeddings = embeddings * (1.0 - mask) + mask_tokens * mask
        cls_tokens = self.cls_token.expand(batch_size, -1, -1)
        embeddings = torch.cat((cls_tokens, embeddings), dim=1)
        embeddings = add_embeddings(ctx, embeddings)
        return self.dropout(embeddings)


class PosEncViTAttention(ViTAttention):
    """ViT self-attention that applies the encoding over the patch grid."""

    #: how ViT computes q, k and v and projects the output (``q_proj`` ... ``o_proj``, transformers 5.x).
    posenc_layout = AttentionLayout()

    def forward(
        self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        ctx = require_ctx(kwargs, "ViTAttention")
        ctx, layer = ctx.at(self.posenc_layer)  # under a plan: this layer's encoding, its index there
        query, key, value = ctx.prepare(layer, hidden_states, *self.posenc_layout.project(self, hidden_states))
        out, weights = run_attention(self, ctx, layer, hidden_states, query, key, value, attention_mask,
                                     self.attention_dropout)
        return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1).contiguous()), weights


class ViTPatch(FamilyPatch):
    family = "vit"
    base_attr = "vit"
    base_class = ViTModel
    native_keys = ("embeddings.position_embeddings",)

    def info(self, config: Any) -> ModelInfo:
        heads = config.num_attention_heads
        image = _pair(config.image_size)
        patch = _pair(config.patch_size)
        grid = (image[0] // patch[0], image[1] // patch[1])
        return self.model_info(
            config,
            hidden_size=config.hidden_size,
            num_heads=heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            num_layers=config.num_hidden_layers,
            causal=False,
            max_positions=grid[0] * grid[1] + 1,
            grid=grid,
            patch_size=patch,
        )

    def native_weights(self, base: nn.Module) -> dict[str, torch.Tensor]:
        table = getattr(base.embeddings, "position_embeddings", None)
        return {"table": table.detach()} if isinstance(table, torch.Tensor) else {}

    def install(self, base: nn.Module) -> list[str]:
        swap_class(base, PosEncViTModel)
        swap_class(base.embeddings, PosEncViTEmbeddings)
        if isinstance(getattr(base.embeddings, "position_embeddings", None), nn.Parameter):
            del base.embeddings.position_embeddings
            base.embeddings.position_embeddings = None
        return swap_attention(((f"layers.{i}.attention", layer.attention) for i, layer in enumerate(base.layers)),
                              PosEncViTAttention)
