"""The one mechanism behind every decoder family whose attention is shaped like Llama's.

Llama, Mistral, Qwen2, Qwen3, Gemma 3 (text), Phi-3 and GPT-NeoX differ, as far as positions go, in a
few facts only, and a family file states just those:

* how q, k and v come out of the hidden states (`AttentionLayout`): three projections
  (``q_proj``/``k_proj``/``v_proj``), Phi-3's fused ``qkv_proj`` ([q | k | v] along the features), or
  GPT-NeoX's fused ``query_key_value`` ([q | k | v] inside each head);
* QK-norm (Qwen3, Gemma 3): an RMSNorm over each head's q and k, before the rotation;
* the output projection's name (``o_proj``, GPT-NeoX's ``dense``);
* what the config says about the native rotary (partial rotary: GPT-NeoX ``rotary_pct`` and Phi-3
  ``partial_rotary_factor``; Gemma 3's per-layer bases), query scaling (Gemma 3's
  ``query_pre_attn_scalar``, already the attention module's ``scaling``) and sliding windows, all read by
  `DecoderPatch.info`.

The patch swaps (per instance) the base model and each attention module for subclasses: the native rotary
embedding is removed (``rotary_emb`` returns nothing), absolute terms are added to the token embeddings
(after Gemma 3's embedding scale), q/k transforms run after QK-norm and before the KV-cache update, and
attention goes through `hf_posenc.attention.posenc_attention`. Everything else -- the decoder layers,
their norms, GPT-NeoX's parallel residual, Phi-3's residual dropout -- stays the native code.

Sliding windows (Mistral, Qwen2 with ``use_sliding_window``, Gemma 3's local layers, Phi-3 with
``sliding_window``): transformers builds each layer's attention mask from its window, and every encoding's
term is added under that mask, so keys beyond the window have no influence; the tile engine and the kernels
also get the window as a number (``PosContext.native_window``) and skip the key tiles outside it. Which tokens
are real is recorded apart from the banded masks (``PosContext.key_padding``, from the 2D attention mask), for
FoX Pro's token shift. The KV cache keeps every key
(sliding-window cache layers are replaced by full ones before the first token is stored): hf_posenc's
relative terms index a key by its absolute position, which a cache that drops its oldest keys loses. A
``StaticCache`` whose sliding layers are shorter than its length cannot be converted and is refused.

transformers 5.x renamed the cache argument from ``past_key_values`` to ``cache`` (5.2x); both are taken.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from ..encodings.base import ModelInfo
from .base import (
    FamilyPatch, add_embeddings, check_embeds, check_token_ids, make_context, require_ctx, run_attention,
    swap_attention, swap_class, text_positions,
)

__all__ = [
    "AttentionLayout",
    "DecoderPatch",
    "NoRotaryEmbedding",
    "PatchedDecoderAttention",
    "PatchedDecoderModel",
    "cache_arg",
    "full_cache_layers",
    "pop_cache",
]

#: names under which transformers releases hand the KV cache to a model or an attention module.
CACHE_ARGS = ("cache", "past_key_values", "layer_past")


def pop_cache(kwargs: dict[str, Any]) -> Any:
    """Remove every cache argument from ``kwargs`` and return the cache (None if none was given)."""
    found = None
    for name in CACHE_ARGS:
        value = kwargs.pop(name, None)
        if value is not None:
            found = value
    return found


def cache_arg(cls: type) -> str:
    """The name under which ``cls.forward`` (a transformers base model) takes the cache."""
    params = inspect.signature(cls.forward).parameters
    return next((name for name in CACHE_ARGS if name in params), "past_key_values")


def full_cache_layers(cache: Any) -> bool:
    """Replace the empty sliding-window layers of ``cache`` by full layers (in place).

    hf_posenc's encodings place key j of a layer at absolute position j; a sliding-window cache layer drops
    its oldest keys, so the keys it returns no longer start at position 0. The window itself is kept by the
    attention mask. Raises ``ValueError`` for a sliding layer that already holds keys, or a static one
    shorter than the cache (its full length is lost). Returns whether a layer was replaced.
    """
    inner = getattr(cache, "self_attention_cache", cache)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, list) or not any(getattr(layer, "is_sliding", False) for layer in layers):
        return False
    from transformers.cache_utils import DynamicLayer, StaticLayer

    full_lengths = [getattr(layer, "max_cache_len", None) for layer in layers if not getattr(layer, "is_sliding", 0)]
    for i, layer in enumerate(layers):
        if not getattr(layer, "is_sliding", False):
            continue
        if getattr(layer, "is_initialized", False) and getattr(layer, "keys", None) is not None and layer.keys.numel():
            raise ValueError(
                "the KV cache holds keys in a sliding-window layer, filled before hf_posenc patched the model; "
                "start from an empty cache (hf_posenc keeps every key and masks the window)"
            )
        if isinstance(getattr(layer, "max_cache_len", None), int):  # static: max_cache_len = min(window, length)
            if full_lengths and all(isinstance(n, int) for n in full_lengths):
                length = max(full_lengths)
            elif getattr(layer, "_is_croppable", False):  # the cache's length was within the window
                length = layer.max_cache_len
            else:
                raise ValueError(
                    "a StaticCache whose sliding-window layers are shorter than its max_cache_len cannot hold every "
                    "key, which hf_posenc needs (its terms index keys by absolute position); use a DynamicCache or "
                    "a max_cache_len no longer than the sliding window"
                )
            layers[i] = StaticLayer(max_cache_len=length)
        else:
            layers[i] = DynamicLayer()
    return True


def key_padding(attention_mask: Any) -> torch.Tensor | bool | None:
    """``PosContext.key_padding`` from the mask a decoder's forward receives: True for none, the 2D mask as
    bool, the keys its queries may see for ``generate``'s precomputed masks (the full-attention one: no window
    bands it), None for anything else (a custom 4D mask: the attention masks are all there is)."""
    if attention_mask is None:
        return True
    if isinstance(attention_mask, dict):
        if "full_attention" not in attention_mask:
            return None
        attention_mask = attention_mask["full_attention"]
        if attention_mask is None:  # transformers skips the mask of causal attention without padding
            return True
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 4:
            return None
        if attention_mask.dtype != torch.bool:
            attention_mask = attention_mask > torch.finfo(attention_mask.dtype).min / 2
        return attention_mask[:, 0].any(dim=-2)
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
        return attention_mask.to(torch.bool)
    return None


def window_masks_for_full_cache(masks: dict, window: int, q_len: int, cache: Any, device: torch.device) -> dict:
    """``generate`` builds the masks of a static cache before the first forward, with the sizes of its sliding
    layers; once they are full layers (see `full_cache_layers`, which runs on an empty cache, so the
    queries are keys 0 .. Lq-1) the sliding-window mask is rebuilt over the full keys: the full-attention
    mask (causal + padding, (B, 1, Lq, Lk) bool; causal over the cache's length when there is none)
    restricted to the window, as transformers' ``sliding_window_overlay`` (key j > query i - window)."""
    if "sliding_attention" not in masks:
        return masks
    full = masks.get("full_attention")
    if isinstance(full, torch.Tensor):
        if full.dtype != torch.bool:
            full = full > torch.finfo(full.dtype).min / 2
        k_len = full.shape[-1]
    else:
        inner = getattr(cache, "self_attention_cache", cache)
        k_len = max(getattr(layer, "max_cache_len", 0) or 0 for layer in inner.layers) or q_len
    q_idx = torch.arange(q_len, device=device)[:, None]
    k_idx = torch.arange(k_len, device=device)[None, :]
    band = (k_idx > q_idx - window) & (k_idx <= q_idx)
    return {**masks, "sliding_attention": (full & band) if isinstance(full, torch.Tensor) else band[None, None]}


@dataclass(frozen=True)
class AttentionLayout:
    """How a family's attention module computes q, k and v, and what it calls its output projection.

    Attributes:
        qkv: ``"separate"`` (``q``/``k``/``v`` projections named by ``projections``), ``"fused"`` (one
            projection ``projections[0]`` giving [q | k | v] along the features: Phi-3's ``qkv_proj``) or
            ``"fused_per_head"`` (one projection giving, per head, [q | k | v]: GPT-NeoX's
            ``query_key_value``).
        projections: the projection attribute names.
        output: the output projection's attribute name (empty where it is outside the module: BERT).
        qk_norm: whether ``q_norm`` and ``k_norm`` (RMSNorm over the head dim) run before the rotation.
    """

    qkv: str = "separate"
    projections: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")
    output: str = "o_proj"
    qk_norm: bool = False

    def project(self, module: nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden (B, L, C) -> q (B, H, L, D), k and v (B, Hkv, L, D), after QK-norm when the family has it. D is the
        module's ``head_dim`` (``head_size``: GPT-NeoX; ``attention_head_size``: BERT)."""
        head_dim = getattr(module, "head_dim", None) or getattr(module, "head_size", None) or module.attention_head_size
        shape = (*hidden.shape[:-1], -1, head_dim)
        if self.qkv == "separate":
            q, k, v = (getattr(module, name)(hidden).view(shape) for name in self.projections)
        elif self.qkv == "fused":
            qkv = getattr(module, self.projections[0])(hidden)
            q_size = module.config.num_attention_heads * head_dim
            kv_size = (qkv.shape[-1] - q_size) // 2
            q, k, v = (t.view(shape) for t in qkv.split((q_size, kv_size, kv_size), dim=-1))
        elif self.qkv == "fused_per_head":
            qkv = getattr(module, self.projections[0])(hidden).view(*hidden.shape[:-1], -1, 3 * head_dim)
            q, k, v = qkv.chunk(3, dim=-1)
        else:
            raise ValueError(f"unknown qkv layout {self.qkv!r}; allowed: separate, fused, fused_per_head")
        if self.qk_norm:
            q, k = module.q_norm(q), module.k_norm(k)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


class NoRotaryEmbedding(nn.Module):
    """Stands in for the native rotary embedding in a patched model: the encoding owns position handling."""

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None, *args: Any, **kwargs: Any) -> None:
        return None


class PatchedDecoderModel:
    """Mixin (first base, before the native base model class) whose forward builds the hf_posenc context,
    adds absolute terms to the token embeddings and hands the native forward a cache with full layers."""

    #: the attribute holding the token embedding (``embed_tokens``; GPT-NeoX: ``embed_in``).
    posenc_embed_attr: ClassVar[str] = "embed_tokens"
    #: the name under which the native forward takes the cache (set per subclass from its signature).
    posenc_cache_arg: ClassVar[str] = "past_key_values"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.posenc_cache_arg = cache_arg(cls.__bases__[-1])

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Any,
    ):
        cache = pop_cache(kwargs)
        embed = getattr(self, self.posenc_embed_attr)
        if input_ids is not None and inputs_embeds is None:
            check_token_ids(input_ids, embed, two_d=True)
            inputs_embeds = embed(input_ids)
            input_ids = None
        if inputs_embeds is None:
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        check_embeds(inputs_embeds, self.config.hidden_size, getattr(getattr(embed, "weight", None), "dtype", None))
        if cache is None and (use_cache if use_cache is not None else getattr(self.config, "use_cache", False)):
            from transformers.cache_utils import DynamicCache

            cache = DynamicCache(config=self.config)  # here, so that its sliding layers are replaced below
        if cache is not None and full_cache_layers(cache) and isinstance(attention_mask, dict):
            window, q_len = self.config.sliding_window, inputs_embeds.shape[1]
            attention_mask = window_masks_for_full_cache(attention_mask, window, q_len, cache, inputs_embeds.device)
        position_ids, past = text_positions(
            inputs_embeds.shape[1], inputs_embeds.device, position_ids, cache, batch=inputs_embeds.shape[0]
        )
        # which tokens are real, apart from the masks a model's own window bands (read only on such models)
        padding = key_padding(attention_mask) if self.posenc_info.sliding_windows else None
        ctx = make_context(self, need_weights=kwargs.get("output_attentions"), position_ids=position_ids, q_offset=past,
                           key_padding=padding)
        inputs_embeds = add_embeddings(ctx, inputs_embeds)
        kwargs[self.posenc_cache_arg] = cache
        return super().forward(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            posenc_ctx=ctx,
            **kwargs,
        )


class PatchedDecoderAttention:
    """Mixin (first base, before the native attention class) that applies the encoding instead of the
    native rotary embedding. ``posenc_layout`` says how this family computes q, k, v."""

    posenc_layout: ClassVar[AttentionLayout] = AttentionLayout()

    def forward(
        self, hidden_states: torch.Tensor, *, attention_mask: torch.Tensor | None = None, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        ctx = require_ctx(kwargs, type(self).__bases__[-1].__name__)
        ctx, layer = ctx.at(self.posenc_layer)  # under a plan: this layer's encoding, its index there
        cache = pop_cache(kwargs)
        input_shape = hidden_states.shape[:-1]
        query, key, value = self.posenc_layout.project(self, hidden_states)
        query, key, value = ctx.prepare(layer, hidden_states, query, key, value)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)
        out, weights = run_attention(self, ctx, layer, hidden_states, query, key, value, attention_mask,
                                     float(getattr(self, "attention_dropout", 0.0)))
        out = getattr(self, self.posenc_layout.output)(out.reshape(*input_shape, -1).contiguous())
        return out, weights


def _rope_facts(config: Any, head_dim: int, num_layers: int) -> dict[str, Any]:
    """ModelInfo fields about the native rotary: rope_theta, rope_type, rope_parameters, rotary_dim and
    layer_rope_parameters, read from transformers 5.x configs (and the older attribute names)."""
    rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    layer_types = getattr(config, "layer_types", None)
    layer_rope = None
    if rope and all(isinstance(v, dict) for v in rope.values()):  # one set per layer type (Gemma 3)
        if not layer_types:
            raise ValueError("the config gives rope_parameters per layer type but no layer_types")
        layer_rope = tuple(dict(rope[t]) for t in layer_types[:num_layers])
        rope = dict(rope.get("full_attention") or next(iter(rope.values())))
    else:
        if "rope_theta" not in rope:
            theta = getattr(config, "rope_theta", None) or getattr(config, "rotary_emb_base", None)
            if theta is not None:
                rope["rope_theta"] = theta
        rope.setdefault("rope_type", rope.pop("type", "default"))
        local = getattr(config, "rope_local_base_freq", None)  # Gemma 3 before nested rope_parameters
        if local is not None and layer_types:
            local_rope = {"rope_type": "default", "rope_theta": local}
            layer_rope = tuple(local_rope if t == "sliding_attention" else dict(rope) for t in layer_types[:num_layers])
    partial = rope.get("partial_rotary_factor")
    if partial is None:
        partial = getattr(config, "partial_rotary_factor", None) or getattr(config, "rotary_pct", None)
    rotary_dim = int(head_dim * partial) if partial is not None and int(head_dim * partial) != head_dim else None
    if rope.get("rope_type") == "proportional":
        # transformers' proportional RoPE reads partial_rotary_factor itself and returns head_dim / 2
        # frequencies, the unrotated ones as zeros: every dim goes through the rotation
        rotary_dim = None
    return {
        "rope_theta": rope.get("rope_theta"),
        "rope_type": rope.get("rope_type"),
        "rope_parameters": rope or None,
        "rotary_dim": rotary_dim,
        "layer_rope_parameters": layer_rope,
    }


def _sliding_windows(config: Any, num_layers: int) -> tuple[int | None, ...] | None:
    """Per-layer windows: every layer's when the config has no ``layer_types`` (Mistral, Phi-3), else the
    ``sliding_attention`` layers' (Gemma 3, Qwen2/3); None when no layer has one."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        windows = tuple(window if t == "sliding_attention" else None for t in layer_types[:num_layers])
    else:
        windows = (window,) * num_layers
    return windows if any(w is not None for w in windows) else None


class DecoderPatch(FamilyPatch):
    """A decoder family shaped like Llama: the family file names its classes and attributes only."""

    #: the patched subclasses (mixin first, native class last).
    model_class: ClassVar[type]
    attention_class: ClassVar[type]
    #: the attribute of each decoder layer that holds its attention module.
    attention_attr: ClassVar[str] = "self_attn"

    def check_config(self, config: Any) -> None:
        """Raise ``ValueError`` for config options the patched attention does not reproduce."""

    def info(self, config: Any) -> ModelInfo:
        self.check_config(config)
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        layers = config.num_hidden_layers
        return self.model_info(
            config,
            hidden_size=config.hidden_size,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            num_layers=layers,
            causal=True,
            max_positions=getattr(config, "max_position_embeddings", None),
            sliding_windows=_sliding_windows(config, layers),
            **_rope_facts(config, head_dim, layers),
        )

    def install(self, base: nn.Module) -> list[str]:
        swap_class(base, self.model_class)
        for name in ("rotary_emb", "rotary_emb_local"):
            native = getattr(base, name, None)
            if isinstance(native, nn.Module) and not isinstance(native, NoRotaryEmbedding):
                setattr(base, name, NoRotaryEmbedding())
        attr = self.attention_attr
        return swap_attention(((f"layers.{i}.{attr}", getattr(layer, attr)) for i, layer in enumerate(base.layers)),
                              self.attention_class)
