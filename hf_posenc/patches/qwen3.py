"""Qwen3: ``Qwen3Model`` and every head built on it. Llama's layout plus QK-norm (an RMSNorm over each
head's q and k) before the rotation."""

from __future__ import annotations

from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3Model

from .decoder import AttentionLayout, DecoderPatch, PatchedDecoderAttention, PatchedDecoderModel


class PosEncQwen3Model(PatchedDecoderModel, Qwen3Model):
    """``Qwen3Model`` whose forward builds the hf_posenc context and adds absolute terms."""


class PosEncQwen3Attention(PatchedDecoderAttention, Qwen3Attention):
    """``Qwen3Attention`` that applies QK-norm, then the encoding instead of the native rotary embedding."""

    posenc_layout = AttentionLayout(qk_norm=True)


class Qwen3Patch(DecoderPatch):
    family = "qwen3"
    base_attr = "model"
    base_class = Qwen3Model
    model_class = PosEncQwen3Model
    attention_class = PosEncQwen3Attention
