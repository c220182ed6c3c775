"""Llama: ``LlamaModel`` and every head built on it (the shared decoder mechanism, `decoder`)."""

from __future__ import annotations

from transformers.models.llama.modeling_llama import LlamaAttention, LlamaModel

from .decoder import DecoderPatch, NoRotaryEmbedding, PatchedDecoderAttention, PatchedDecoderModel

__all__ = ["LlamaPatch", "NoRotaryEmbedding", "PosEncLlamaAttention", "PosEncLlamaModel"]


class PosEncLlamaModel(PatchedDecoderModel, LlamaModel):
    """``LlamaModel`` whose forward builds the hf_posenc context and adds absolute terms."""


class PosEncLlamaAttention(PatchedDecoderAttention, LlamaAttention):
    """``LlamaAttention`` that applies the encoding instead of the native rotary embedding."""


class LlamaPatch(DecoderPatch):
    family = "llama"
    base_attr = "model"
    base_class = LlamaModel
    model_class = PosEncLlamaModel
    attention_class = PosEncLlamaAttention
