"""Llama: ``LlamaModel`` and every head built on it.

The patch swaps (per instance) the base model and each ``LlamaAttention`` for subclasses whose forward
runs the encoding: the native rotary embedding is removed (``rotary_emb`` returns nothing), absolute
terms are added to ``inputs_embeds``, q/k transforms run before the KV-cache update, and attention goes
through :func:`hf_posenc.attention.posenc_attention`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaModel

from ..attention import posenc_attention
from ..encodings.base import ModelInfo
from .base import (
    FamilyPatch,
    add_embeddings,
    cache_kwarg,
    check_embeds,
    check_token_ids,
    make_context,
    pop_cache,
    require_ctx,
    swap_class,
    text_positions,
)


#: the keyword under which LlamaModel.forward takes the KV cache (``cache`` from transformers 5.24 on).
_CACHE_KW = cache_kwarg(LlamaModel.forward)


class NoRotaryEmbedding(nn.Module):
    """Stands in for ``LlamaRotaryEmbedding`` in a patched model: the encoding owns position handling."""

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> None:
        return None


class PosEncLlamaModel(LlamaModel):
    """``LlamaModel`` whose forward builds the hf_posenc context and adds absolute terms."""

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Any,
    ):
        past_key_values = pop_cache(past_key_values, kwargs)
        if input_ids is not None and inputs_embeds is None:
            check_token_ids(input_ids, self.embed_tokens, two_d=True)
            inputs_embeds = self.embed_tokens(input_ids)
            input_ids = None
        if inputs_embeds is None:
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        weight = getattr(self.embed_tokens, "weight", None)
        check_embeds(inputs_embeds, self.config.hidden_size, getattr(weight, "dtype", None))
        position_ids, past = text_positions(
            inputs_embeds.shape[1], inputs_embeds.device, position_ids, past_key_values, batch=inputs_embeds.shape[0]
        )
        ctx = make_context(self, need_weights=kwargs.get("output_attentions"), position_ids=position_ids, q_offset=past)
        inputs_embeds = add_embeddings(ctx, inputs_embeds)
        return super().forward(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            **{_CACHE_KW: past_key_values},
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            posenc_ctx=ctx,
            **kwargs,
        )


class PosEncLlamaAttention(LlamaAttention):
    """``LlamaAttention`` that applies the encoding instead of the native rotary embedding."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: Any = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Any = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        ctx = require_ctx(kwargs, "LlamaAttention")
        past_key_values = pop_cache(past_key_values, kwargs)
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        query, key, value = ctx.prepare(self.posenc_layer, hidden_states, query, key, value)
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)
        out, weights = posenc_attention(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=self.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
            posenc_ctx=ctx,
        )
        out = ctx.finish(self.posenc_layer, hidden_states, out)
        out = self.o_proj(out.reshape(*input_shape, -1).contiguous())
        return out, weights


class LlamaPatch(FamilyPatch):
    family = "llama"
    base_attr = "model"
    base_class = LlamaModel

    def info(self, config: Any) -> ModelInfo:
        heads = config.num_attention_heads
        rope = getattr(config, "rope_parameters", None) or {}
        return ModelInfo(
            family=self.family,
            hidden_size=config.hidden_size,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            num_layers=config.num_hidden_layers,
            causal=True,
            max_positions=getattr(config, "max_position_embeddings", None),
            rope_theta=rope.get("rope_theta"),
            rope_type=rope.get("rope_type"),
            initializer_range=getattr(config, "initializer_range", 0.02),
            rope_parameters=dict(rope) or None,
        )

    def install(self, base: nn.Module) -> list[str]:
        swap_class(base, PosEncLlamaModel)
        if not isinstance(base.rotary_emb, NoRotaryEmbedding):
            base.rotary_emb = NoRotaryEmbedding()
        names = []
        for i, layer in enumerate(base.layers):
            swap_class(layer.self_attn, PosEncLlamaAttention)
            layer.self_attn.posenc_layer = i
            names.append(f"layers.{i}.self_attn")
        return names
