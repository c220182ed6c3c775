"""BERT: ``BertModel`` and the heads built on it (``BertForMaskedLM``, ``BertForSequenceClassification``, ...).

A bidirectional text encoder: every token sees every other token (no causal mask; padding is masked by the
attention mask transformers builds). The native ``position_embeddings`` table is removed; the patched
embeddings add word and token-type embeddings, then the encoding's absolute term (if any), then BERT's
LayerNorm and dropout, as the native table was added; each self-attention module is swapped (per instance)
for a subclass that applies the encoding. Encodings that are defined in causal order use their documented
bidirectional 1D form (see each encoding's docstring). Only the encoder configuration is supported
(``is_decoder`` and cross-attention are refused: BERT as a decoder is what the decoder families are for).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.models.bert.modeling_bert import BertEmbeddings, BertModel, BertSelfAttention

from ..encodings.base import ModelInfo
from .base import (
    FamilyPatch, add_embeddings, check_embeds, check_token_ids, lend_context, lent_context, make_context,
    require_ctx, run_attention, swap_attention, swap_class, text_positions,
)
from .decoder import AttentionLayout, pop_cache


class PosEncBertModel(BertModel):
    """``BertModel`` whose forward builds the hf_posenc context for its embeddings and attention modules."""

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: Any,
    ):
        if kwargs.get("encoder_hidden_states") is not None:
            raise ValueError("a patched BERT is an encoder; it takes no encoder_hidden_states")
        if pop_cache(kwargs) is not None:
            raise ValueError("a patched BERT is an encoder; it takes no KV cache")
        kwargs.pop("use_cache", None)  # as the native encoder: no cache, whatever use_cache says
        if input_ids is not None and inputs_embeds is None:
            check_token_ids(input_ids, self.embeddings.word_embeddings, two_d=True)
            shape, device = input_ids.shape, input_ids.device
        elif inputs_embeds is not None and input_ids is None:
            weight = getattr(self.embeddings.word_embeddings, "weight", None)
            check_embeds(inputs_embeds, self.config.hidden_size, getattr(weight, "dtype", None))
            shape, device = inputs_embeds.shape[:2], inputs_embeds.device
        else:
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        position_ids, _ = text_positions(shape[1], device, position_ids, None, batch=shape[0])
        ctx = make_context(self, need_weights=kwargs.get("output_attentions"), position_ids=position_ids)
        with lend_context(self.embeddings, ctx):
            return super().forward(
                input_ids=input_ids,
                attention_mask=attention_mask,
                token_type_ids=token_type_ids,
                position_ids=position_ids,
                inputs_embeds=inputs_embeds,
                use_cache=False,
                posenc_ctx=ctx,
                **kwargs,
            )


class PosEncBertEmbeddings(BertEmbeddings):
    """Word and token-type embeddings plus the encoding's absolute term (the native table is gone)."""

    posenc_ctx = None

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        ctx = lent_context(self, "BERT")
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)
        if token_type_ids is None:  # the native buffer is all zeros: the same, at any length
            token_type_ids = torch.zeros(inputs_embeds.shape[:2], dtype=torch.long, device=inputs_embeds.device)
        embeddings = inputs_embeds + self.token_type_embeddings(token_type_ids)
        embeddings = add_embeddings(ctx, embeddings)
        embeddings = self.LayerNorm(embeddings)
        return self.dropout(embeddings)


class PosEncBertSelfAttention(BertSelfAttention):
    """BERT self-attention (bidirectional) that applies the encoding."""

    #: how BERT computes q, k and v (its output projection is in ``BertSelfOutput``, outside this module).
    posenc_layout = AttentionLayout(projections=("query", "key", "value"), output="")

    def forward(
        self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        ctx = require_ctx(kwargs, "BertSelfAttention")
        ctx, layer = ctx.at(self.posenc_layer)  # under a plan: this layer's encoding, its index there
        if kwargs.get("encoder_hidden_states") is not None:
            raise ValueError("a patched BERT self-attention module got encoder_hidden_states")
        query, key, value = ctx.prepare(layer, hidden_states, *self.posenc_layout.project(self, hidden_states))
        out, weights = run_attention(self, ctx, layer, hidden_states, query, key, value, attention_mask,
                                     self.dropout.p)
        return out.reshape(*hidden_states.shape[:-1], -1).contiguous(), weights


class BertPatch(FamilyPatch):
    family = "bert"
    base_attr = "bert"
    base_class = BertModel
    native_keys = ("embeddings.position_embeddings.weight",)

    def info(self, config: Any) -> ModelInfo:
        if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
            raise ValueError("hf_posenc patches BERT as an encoder; is_decoder and add_cross_attention must be False")
        kind = getattr(config, "position_embedding_type", "absolute")
        if kind not in (None, "absolute"):
            raise ValueError(
                f"hf_posenc patches BERT models with position_embedding_type='absolute', got {kind!r}"
            )
        heads = config.num_attention_heads
        return self.model_info(
            config,
            hidden_size=config.hidden_size,
            num_heads=heads,
            head_dim=config.hidden_size // heads,
            num_layers=config.num_hidden_layers,
            causal=False,
            max_positions=config.max_position_embeddings,
        )

    def native_weights(self, base: nn.Module) -> dict[str, torch.Tensor]:
        table = getattr(base.embeddings, "position_embeddings", None)
        return {"table": table.weight.detach()} if isinstance(table, nn.Embedding) else {}

    def install(self, base: nn.Module) -> list[str]:
        swap_class(base, PosEncBertModel)
        swap_class(base.embeddings, PosEncBertEmbeddings)
        if isinstance(getattr(base.embeddings, "position_embeddings", None), nn.Module):
            base.embeddings.position_embeddings = None
        layers = enumerate(base.encoder.layer)
        return swap_attention(((f"encoder.layer.{i}.attention.self", layer.attention.self) for i, layer in layers),
                              PosEncBertSelfAttention)
