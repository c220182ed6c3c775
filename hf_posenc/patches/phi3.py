"""Phi-3: ``Phi3Model`` and every head built on it. One fused projection ``qkv_proj`` gives [q | k | v]
along the features; the native rotary may be partial (``partial_rotary_factor``) and longrope-scaled, both
reproduced by ``rope``."""

from __future__ import annotations

from transformers.models.phi3.modeling_phi3 import Phi3Attention, Phi3Model

from .decoder import AttentionLayout, DecoderPatch, PatchedDecoderAttention, PatchedDecoderModel


class PosEncPhi3Model(PatchedDecoderModel, Phi3Model):
    """``Phi3Model`` whose forward builds the hf_posenc context and adds absolute terms."""


class PosEncPhi3Attention(PatchedDecoderAttention, Phi3Attention):
    """``Phi3Attention`` (fused qkv) that applies the encoding instead of the native rotary embedding."""

    posenc_layout = AttentionLayout(qkv="fused", projections=("qkv_proj",))


class Phi3Patch(DecoderPatch):
    family = "phi3"
    base_attr = "model"
    base_class = Phi3Model
    model_class = PosEncPhi3Model
    attention_class = PosEncPhi3Attention
