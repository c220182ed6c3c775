"""GPT-2: ``GPT2Model`` and every head built on it.

The native ``wpe`` table is removed (its slot returns a zero, so no position can overflow it); absolute
terms are added to ``inputs_embeds`` before GPT-2's own embedding dropout, as ``wpe`` was; each
self-attention module is swapped (per instance) for a subclass that applies the encoding. Cross-attention
modules (``add_cross_attention``) are left alone: they have no positions.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.cache_utils import EncoderDecoderCache
from transformers.models.gpt2.modeling_gpt2 import GPT2Attention, GPT2Model

from ..encodings.base import ModelInfo
from .base import (
    FamilyPatch, add_embeddings, check_embeds, check_token_ids, make_context, require_ctx, run_attention,
    swap_attention, swap_class, text_positions,
)
from .decoder import cache_arg, pop_cache


#: the name under which ``GPT2Model.forward`` takes the cache (``cache`` since transformers 5.2x).
_CACHE_ARG = cache_arg(GPT2Model)


class NoPositionTable(nn.Module):
    """Stands in for GPT-2's ``wpe``: contributes a zero, whatever the position."""

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros((), device=position_ids.device)


class PosEncGPT2Model(GPT2Model):
    """``GPT2Model`` whose forward builds the hf_posenc context and adds absolute terms."""

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Any,
    ):
        past_key_values = pop_cache(kwargs)  # ``cache`` since transformers 5.2x, ``past_key_values`` before
        if input_ids is not None and inputs_embeds is None:
            check_token_ids(input_ids, self.wte, two_d=False)  # GPT-2 flattens leading dims itself
            self.warn_if_padding_and_no_attention_mask(input_ids, attention_mask)
            input_ids = input_ids.view(-1, input_ids.shape[-1])
            inputs_embeds = self.wte(input_ids)
            input_ids = None
        if inputs_embeds is None:
            raise ValueError("You have to specify either input_ids or inputs_embeds")
        check_embeds(inputs_embeds, self.config.n_embd, getattr(getattr(self.wte, "weight", None), "dtype", None))
        if position_ids is not None and isinstance(position_ids, torch.Tensor) and position_ids.dim() > 0:
            position_ids = position_ids.view(-1, position_ids.shape[-1])
        position_ids, past = text_positions(
            inputs_embeds.shape[1], inputs_embeds.device, position_ids, past_key_values, batch=inputs_embeds.shape[0]
        )
        ctx = make_context(self, need_weights=kwargs.get("output_attentions"), position_ids=position_ids, q_offset=past)
        inputs_embeds = add_embeddings(ctx, inputs_embeds)
        kwargs[_CACHE_ARG] = past_key_values
        return super().forward(
            input_ids=input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            encoder_hidden_states=encoder_hidden_states,
            encoder_attention_mask=encoder_attention_mask,
            use_cache=use_cache,
            posenc_ctx=ctx,
            **kwargs,
        )


class PosEncGPT2Attention(GPT2Attention):
    """GPT-2 self-attention that applies the encoding."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        output_attentions: bool | None = False,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        ctx = require_ctx(kwargs, "GPT2Attention")
        ctx, layer = ctx.at(self.posenc_layer)  # under a plan: this layer's encoding, its index there
        past_key_values = pop_cache(kwargs)
        if encoder_hidden_states is not None:
            raise ValueError("a patched GPT-2 self-attention module got encoder_hidden_states")
        query, key, value = self.c_attn(hidden_states).split(self.split_size, dim=2)
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query = query.view(shape).transpose(1, 2)
        key = key.view(shape).transpose(1, 2)
        value = value.view(shape).transpose(1, 2)
        query, key, value = ctx.prepare(layer, hidden_states, query, key, value)
        if past_key_values is not None:
            cache = past_key_values
            if isinstance(cache, EncoderDecoderCache):
                cache = cache.self_attention_cache
            key, value = cache.update(key, value, self.layer_idx)
        out, weights = run_attention(self, ctx, layer, hidden_states, query, key, value, attention_mask,
                                     self.attn_dropout.p)
        out = self.c_proj(out.reshape(*out.shape[:-2], -1).contiguous())
        out = self.resid_dropout(out)
        return out, weights


class GPT2Patch(FamilyPatch):
    family = "gpt2"
    base_attr = "transformer"
    base_class = GPT2Model
    native_keys = ("wpe.weight",)

    def info(self, config: Any) -> ModelInfo:
        return self.model_info(
            config,
            hidden_size=config.n_embd,
            num_heads=config.n_head,
            head_dim=config.n_embd // config.n_head,
            num_layers=config.n_layer,
            causal=True,
            max_positions=config.n_positions,
        )

    def native_weights(self, base: nn.Module) -> dict[str, torch.Tensor]:
        wpe = base.wpe
        return {"table": wpe.weight.detach()} if isinstance(wpe, nn.Embedding) else {}

    def install(self, base: nn.Module) -> list[str]:
        swap_class(base, PosEncGPT2Model)
        if not isinstance(base.wpe, NoPositionTable):
            base.wpe = NoPositionTable()
        return swap_attention(((f"h.{i}.attn", block.attn) for i, block in enumerate(base.h)), PosEncGPT2Attention)
