"""Qwen2: ``Qwen2Model`` and every head built on it. Llama's layout with biased q/k/v projections (native
code, untouched) and optional sliding windows on the layers ``layer_types`` marks (``use_sliding_window``)."""

from __future__ import annotations

from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention, Qwen2Model

from .decoder import DecoderPatch, PatchedDecoderAttention, PatchedDecoderModel


class PosEncQwen2Model(PatchedDecoderModel, Qwen2Model):
    """``Qwen2Model`` whose forward builds the hf_posenc context and adds absolute terms."""


class PosEncQwen2Attention(PatchedDecoderAttention, Qwen2Attention):
    """``Qwen2Attention`` that applies the encoding instead of the native rotary embedding."""


class Qwen2Patch(DecoderPatch):
    family = "qwen2"
    base_attr = "model"
    base_class = Qwen2Model
    model_class = PosEncQwen2Model
    attention_class = PosEncQwen2Attention
