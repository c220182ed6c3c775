"""What every family patch shares: the family interface, class swaps, context building, config un-sharing."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import torch
from torch import nn

from ..attention import posenc_attention
from ..encodings.base import ModelInfo, PosContext, model_norm_eps, unwrap
from ..ops import eager_value_checks

__all__ = [
    "FamilyPatch", "swap_class", "unshare_config", "require_ctx", "text_positions", "make_context", "check_token_ids",
    "check_embeds", "tap_mlp_outputs", "run_attention", "swap_attention", "lend_context", "lent_context",
]


def swap_class(module: nn.Module, new_cls: type) -> None:
    """Give one module instance a subclass of its class (instance-level; the class itself is untouched)."""
    if type(module) is new_cls:
        return
    native = new_cls.__bases__[-1]  # patched classes list their mixins first and the native class last
    if type(module) is not native:
        raise ValueError(
            f"cannot patch {type(module).__name__}: hf_posenc expects {native.__name__} here "
            f"(subclasses with their own forward are not supported)"
        )
    module.__class__ = new_cls
    # transformers keys its output-capturing registry (output_attentions / output_hidden_states) on the model
    # instance (5.2x) or on ``str(type(model))`` (5.17): give the swapped class the native class's entry, in
    # the form this release reads (an entry keyed by a class name is what 5.17 itself writes for every class).
    if getattr(module, "_can_record_outputs", None) is not None:
        try:
            from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY
        except ImportError:
            return
        if type(_CAN_RECORD_REGISTRY) is dict:  # 5.17: a plain dict keyed by str(class)
            _CAN_RECORD_REGISTRY[str(new_cls)] = module._can_record_outputs
        else:
            _CAN_RECORD_REGISTRY[module] = module._can_record_outputs


def unshare_config(model: nn.Module) -> None:
    """Give ``model`` its own copy of its config, so that patching it cannot change another model built from
    the same config object (``Model(cfg)`` keeps a reference to ``cfg``)."""
    old = model.config
    if getattr(model, "_hf_posenc_own_config", False):
        return
    new = copy.deepcopy(old)
    for m in model.modules():
        if getattr(m, "config", None) is old:
            m.config = new
    model._hf_posenc_own_config = True


def require_ctx(kwargs: dict[str, Any], where: str) -> PosContext:
    ctx = kwargs.pop("posenc_ctx", None)
    if ctx is None:
        raise RuntimeError(
            f"{where} was patched by hf_posenc but called without its position context; call the whole model "
            "(or its base model), not the layer alone"
        )
    return ctx


def _is_integer(t: torch.Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def check_token_ids(input_ids: Any, embedding: nn.Module, two_d: bool) -> None:
    """``input_ids``: an integer tensor ((batch, length) when ``two_d``) of ids inside the embedding table.

    Type and shape are checked always (they are Python facts, free under ``torch.compile``). The id range reads
    tensor values, so it is checked only in eager mode on CPU tensors (see `eager_value_checks`): elsewhere
    reading the ids would synchronise the device in every forward, and under ``torch.compile`` it would break
    the graph. Out-of-range ids then surface as torch's own index error from the embedding.
    """
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a torch.Tensor of token ids, got {type(input_ids).__name__}")
    if not _is_integer(input_ids):
        raise TypeError(
            f"input_ids must hold integer token ids (torch.long or torch.int), got {input_ids.dtype}; pass "
            "embeddings as inputs_embeds"
        )
    if two_d and input_ids.dim() != 2:
        raise ValueError(f"input_ids must have shape (batch, length), got {tuple(input_ids.shape)}")
    size = getattr(embedding, "num_embeddings", None)
    if size is not None and input_ids.numel() and eager_value_checks(input_ids):
        low, high = int(input_ids.min()), int(input_ids.max())
        if low < 0 or high >= size:
            raise ValueError(
                f"input_ids hold the token id {high if high >= size else low}, outside the embedding table "
                f"(ids 0 .. {size - 1})"
            )


def check_embeds(inputs_embeds: Any, hidden_size: int, model_dtype: torch.dtype | None = None) -> None:
    """``inputs_embeds``: a float tensor (batch, length, hidden_size), in the model's dtype unless autocast runs."""
    if not isinstance(inputs_embeds, torch.Tensor) or not inputs_embeds.is_floating_point():
        what = inputs_embeds.dtype if isinstance(inputs_embeds, torch.Tensor) else type(inputs_embeds).__name__
        raise TypeError(f"inputs_embeds must be a floating-point tensor, got {what}")
    if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != hidden_size:
        raise ValueError(
            f"inputs_embeds must have shape (batch, length, hidden_size={hidden_size}), got {tuple(inputs_embeds.shape)}"
        )
    if (
        model_dtype is not None
        and model_dtype.is_floating_point
        and inputs_embeds.dtype != model_dtype
        and not torch.is_autocast_enabled(inputs_embeds.device.type)
    ):
        raise TypeError(
            f"inputs_embeds are {inputs_embeds.dtype} but the model is {model_dtype}; cast them with "
            "inputs_embeds.to(model.dtype) (or run under torch.autocast)"
        )


def text_positions(
    length: int,
    device: torch.device,
    position_ids: torch.Tensor | None,
    past_key_values: Any,
    batch: int | None = None,
) -> tuple[torch.Tensor, int | torch.Tensor]:
    """Logical positions of the new tokens (B|1, L) and the cache length before them (the query offset).

    As in transformers: ``position_ids`` when given (``generate`` derives them from the attention mask, so
    left padding shifts them), else ``arange(L) + past``. Given ones must be integers of shape (B|1, L)
    (or (L,)); ``batch`` is B, checked when given.
    """
    if position_ids is not None:
        if not isinstance(position_ids, torch.Tensor) or not _is_integer(position_ids):
            what = position_ids.dtype if isinstance(position_ids, torch.Tensor) else type(position_ids).__name__
            raise TypeError(f"position_ids must be an integer tensor (torch.long) of logical positions, got {what}")
        if position_ids.dim() == 1:
            position_ids = position_ids[None]
        if (
            position_ids.dim() != 2
            or position_ids.shape[-1] != length
            or (batch is not None and position_ids.shape[0] not in (1, batch))
        ):
            rows = "1" if batch in (None, 1) else f"1 or {batch}"
            raise ValueError(
                f"position_ids must have shape ({rows}, {length}) for {length} new tokens, got {tuple(position_ids.shape)}"
            )
    past: int | torch.Tensor = 0
    if past_key_values is not None:
        past = past_key_values.get_seq_length()
        if isinstance(past, torch.Tensor):  # a StaticCache returns a tensor that it later mutates in place
            past = past.clone()
    if position_ids is None:
        position_ids = (torch.arange(length, device=device) + past).unsqueeze(0)
    return position_ids, past


def make_context(base: nn.Module, *, need_weights: bool | None, **fields: Any) -> PosContext:
    if need_weights is None:
        need_weights = bool(getattr(base.config, "output_attentions", False))
    return PosContext(encoding=base.posenc, info=base.posenc_info, need_weights=bool(need_weights), **fields)


@contextmanager
def lend_context(embeddings: nn.Module, ctx: PosContext) -> Iterator[None]:
    """``embeddings.posenc_ctx = ctx`` while the native forward runs (BERT's and ViT's embeddings are called without
    the context, and read it there: `lent_context`)."""
    embeddings.posenc_ctx = ctx
    try:
        yield
    finally:
        embeddings.posenc_ctx = None


def lent_context(embeddings: nn.Module, model: str) -> PosContext:
    """The context `lend_context` gave ``embeddings``; ``RuntimeError`` when the embeddings are called on their own
    (outside the forward of the patched ``model``)."""
    ctx = embeddings.posenc_ctx
    if ctx is None:
        name = type(embeddings).__bases__[-1].__name__
        raise RuntimeError(f"{name} was patched by hf_posenc; call the whole {model} model, not its embeddings")
    return ctx


def run_attention(
    module: nn.Module, ctx: PosContext, layer: int, hidden_states: torch.Tensor, query: torch.Tensor,
    key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A patched attention module's attention: `posenc_attention` of q (B, H, Lq, D), k, v (B, Hkv, Lk, D) with the
    module's ``scaling`` (``dropout`` while training, else none), then the encoding's ``finish`` with the module's
    input ``hidden_states`` (B, Lq, C). Returns out (B, Lq, H, D) and the probabilities or None."""
    out, weights = posenc_attention(
        module,
        query,
        key,
        value,
        attention_mask,
        dropout=dropout if module.training else 0.0,
        scaling=module.scaling,
        posenc_ctx=ctx,
        posenc_layer=layer,
    )
    return ctx.finish(layer, hidden_states, out), weights


def swap_attention(modules: Iterable[tuple[str, nn.Module]], new_cls: type) -> list[str]:
    """Swap each (name, attention module), layer by layer, for ``new_cls`` (`swap_class`) and give it its layer index
    (``posenc_layer``); returns the names."""
    names = []
    for i, (name, module) in enumerate(modules):
        swap_class(module, new_cls)
        module.posenc_layer = i
        names.append(name)
    return names


def add_embeddings(ctx: PosContext, embeds: torch.Tensor) -> torch.Tensor:
    """embeds + the encoding's absolute term, if it has one."""
    if not getattr(unwrap(ctx.encoding), "adds_embeddings", False):
        return embeds
    return embeds + ctx.encoding("embed", ctx, embeds.dtype, embeds.device)


class _MlpTap:
    """Instance-level hooks of one decoder layer: a forward pre-hook on its patched attention module notes the
    forward's `PosContext` (every patched attention receives it as ``posenc_ctx``), and a forward hook
    on the layer's MLP hands the MLP output to the encoding (``encoding("mlp_output", ctx, layer, out)``),
    whose return value replaces it. Outside a patched forward (no context noted) the MLP runs untouched."""

    def __init__(self, layer: int) -> None:
        self.layer = layer
        self.ctx: PosContext | None = None

    def on_attention(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.ctx = kwargs.get("posenc_ctx")

    def on_mlp(self, module: nn.Module, args: tuple, output: Any) -> Any:
        ctx, self.ctx = self.ctx, None
        if ctx is None or not isinstance(output, torch.Tensor):
            return None
        ctx, layer = ctx.at(self.layer)  # under a plan: the layer's own encoding and its index there
        return ctx.encoding("mlp_output", ctx, layer, output)


def _layer_mlp(base: nn.Module, name: str) -> nn.Module | None:
    """The MLP of the layer that holds the attention module ``name``: the nearest enclosing module's ``mlp``
    (Llama-shaped decoders, GPT-2, GPT-NeoX, ViT), or a BERT layer's output projection ``output.dense`` (its
    MLP is ``intermediate`` then ``output.dense``; the residual and LayerNorm come after)."""
    parts = name.split(".")
    for cut in range(len(parts) - 1, -1, -1):
        module = base.get_submodule(".".join(parts[:cut])) if cut else base
        mlp = getattr(module, "mlp", None)
        if isinstance(mlp, nn.Module):
            return mlp
        out = getattr(getattr(module, "output", None), "dense", None)
        if isinstance(getattr(module, "intermediate", None), nn.Module) and isinstance(out, nn.Module):
            return out
    return None


def tap_mlp_outputs(base: nn.Module, layers: list[tuple[int, str]]) -> None:
    """Give an encoding that reads each layer's MLP output (``reads_mlp_output``) that output.

    ``layers`` are (model layer index, patched attention module name relative to ``base``) of the layers whose
    encoding reads it (every layer with one encoding; under a plan, the layers of such entries); the MLP is found
    by `_layer_mlp` (e.g. Llama's ``LlamaDecoderLayer.mlp``, GPT-2's ``GPT2Block.mlp``, ViT's
    ``ViTLayer.mlp``, BERT's ``BertLayer.output.dense``). Hooks installed by an earlier patch are removed first.
    """
    for handle in getattr(base, "_hf_posenc_mlp_taps", ()):
        handle.remove()
    handles = []
    for i, name in layers:
        mlp = _layer_mlp(base, name)
        if mlp is None:
            raise ValueError(
                f"{base.posenc.name if hasattr(base, 'posenc') else 'this encoding'} reads each layer's MLP output, "
                f"but no MLP was found around {name} (looked for .mlp, or BERT's intermediate + output.dense)"
            )
        tap = _MlpTap(i)
        handles.append(base.get_submodule(name).register_forward_pre_hook(tap.on_attention, with_kwargs=True))
        handles.append(mlp.register_forward_hook(tap.on_mlp))
    base._hf_posenc_mlp_taps = handles


class FamilyPatch:
    """One model family. Subclasses implement the four hooks below."""

    family: ClassVar[str]
    #: attribute that holds the base model on the head classes (``model`` for Llama, ...).
    base_attr: ClassVar[str]
    base_class: ClassVar[type]
    #: keys of the native position weights that a patched checkpoint does not carry (suffixes).
    native_keys: ClassVar[tuple[str, ...]] = ()

    def base_model(self, model: nn.Module) -> nn.Module:
        if isinstance(model, self.base_class):
            return model
        base = getattr(model, self.base_attr, None)
        if not isinstance(base, self.base_class):  # heads that name it otherwise (LlamaForQuestionAnswering:
            base = getattr(model, "base_model", None)  # .transformer): transformers' base_model_prefix
        if not isinstance(base, self.base_class):
            raise ValueError(
                f"{type(model).__name__} has model_type {self.family!r} but no {self.base_class.__name__} at "
                f".{self.base_attr}; hf_posenc supports {self.base_class.__name__} and the transformers head "
                "classes built on it"
            )
        return base

    def info(self, config: Any) -> ModelInfo:
        raise NotImplementedError

    def model_info(self, config: Any, **fields: Any) -> ModelInfo:
        """`ModelInfo` of this family from ``fields`` and what every family reads alike: as many key/value heads as
        heads unless given, the initializer range (0.02 by default) and the norm's eps."""
        fields.setdefault("num_kv_heads", fields["num_heads"])
        return ModelInfo(family=self.family, initializer_range=getattr(config, "initializer_range", 0.02),
                         norm_eps=model_norm_eps(config), **fields)

    def native_weights(self, base: nn.Module) -> dict[str, torch.Tensor]:
        """The model's own position weights, for encodings that can adopt them (before the first patch)."""
        return {}

    def install(self, base: nn.Module) -> list[str]:
        """Neutralise the native encoding and swap in the patched classes; returns the patched layer names."""
        raise NotImplementedError
