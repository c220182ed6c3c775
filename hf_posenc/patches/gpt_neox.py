"""GPT-NeoX (Pythia): ``GPTNeoXModel`` and every head built on it. One fused projection ``query_key_value``
gives, per head, [q | k | v]; the output projection is ``dense``; the native rotary is partial
(``rotary_pct``, 0.25 by default), reproduced by ``rope``. The parallel residual
(``use_parallel_residual``) is the native layer's code, untouched."""

from __future__ import annotations

from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXAttention, GPTNeoXModel

from .decoder import AttentionLayout, DecoderPatch, PatchedDecoderAttention, PatchedDecoderModel


class PosEncGPTNeoXModel(PatchedDecoderModel, GPTNeoXModel):
    """``GPTNeoXModel`` whose forward builds the hf_posenc context and adds absolute terms."""

    posenc_embed_attr = "embed_in"


class PosEncGPTNeoXAttention(PatchedDecoderAttention, GPTNeoXAttention):
    """``GPTNeoXAttention`` that applies the encoding instead of the native rotary embedding."""

    posenc_layout = AttentionLayout(qkv="fused_per_head", projections=("query_key_value",), output="dense")


class GPTNeoXPatch(DecoderPatch):
    family = "gpt_neox"
    base_attr = "gpt_neox"
    base_class = GPTNeoXModel
    model_class = PosEncGPTNeoXModel
    attention_class = PosEncGPTNeoXAttention
    attention_attr = "attention"
