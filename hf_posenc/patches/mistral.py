"""Mistral: ``MistralModel`` and every head built on it. Llama's layout plus a sliding window on every layer
(``config.sliding_window``), which the attention mask carries (see `decoder`)."""

from __future__ import annotations

from transformers.models.mistral.modeling_mistral import MistralAttention, MistralModel

from .decoder import DecoderPatch, PatchedDecoderAttention, PatchedDecoderModel


class PosEncMistralModel(PatchedDecoderModel, MistralModel):
    """``MistralModel`` whose forward builds the hf_posenc context and adds absolute terms."""


class PosEncMistralAttention(PatchedDecoderAttention, MistralAttention):
    """``MistralAttention`` that applies the encoding instead of the native rotary embedding."""


class MistralPatch(DecoderPatch):
    family = "mistral"
    base_attr = "model"
    base_class = MistralModel
    model_class = PosEncMistralModel
    attention_class = PosEncMistralAttention
