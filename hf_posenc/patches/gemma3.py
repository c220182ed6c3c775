"""Gemma 3 (text): ``Gemma3TextModel`` and ``Gemma3ForCausalLM``. Llama's layout plus QK-norm before the
rotation, its own query scaling (``query_pre_attn_scalar ** -0.5``, the attention module's ``scaling``),
embeddings scaled by sqrt(hidden_size) (the native embedding module, untouched: absolute terms are added
after it), and local layers (``layer_types``: ``sliding_attention``) with a sliding window and their own
rotary base, which ``rope`` reproduces per layer. Attention logit soft-capping and bidirectional attention
(``use_bidirectional_attention``) are not reproduced and are refused."""

from __future__ import annotations

from typing import Any

from transformers.models.gemma3.modeling_gemma3 import Gemma3Attention, Gemma3TextModel

from .decoder import AttentionLayout, DecoderPatch, PatchedDecoderAttention, PatchedDecoderModel


class PosEncGemma3TextModel(PatchedDecoderModel, Gemma3TextModel):
    """``Gemma3TextModel`` whose forward builds the hf_posenc context and adds absolute terms."""


class PosEncGemma3Attention(PatchedDecoderAttention, Gemma3Attention):
    """``Gemma3Attention`` that applies QK-norm, then the encoding instead of the native rotary embedding."""

    posenc_layout = AttentionLayout(qk_norm=True)


class Gemma3Patch(DecoderPatch):
    family = "gemma3_text"
    base_attr = "model"
    base_class = Gemma3TextModel
    model_class = PosEncGemma3TextModel
    attention_class = PosEncGemma3Attention

    def check_config(self, config: Any) -> None:
        if getattr(config, "attn_logit_softcapping", None) is not None:
            raise ValueError(
                "hf_posenc does not reproduce Gemma's attention logit soft-capping; set attn_logit_softcapping=None "
                "(Gemma 3's default)"
            )
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("hf_posenc patches Gemma 3 as a causal decoder; use_bidirectional_attention must be False")
