"""The static KV cache of ``generate`` for encodings that store state channels with the keys and values.

Fox, Fox Pro and TAPE append per-token state to k (and v) in ``prepare`` (e.g. fox's log forget gates,
see ``encodings/fox.py``), so that the cache carries it through ``crop``, beam-search reordering and a
``StaticCache``. A ``StaticCache`` allocates its tensors lazily from the first keys and values it stores
(``StaticLayer.lazy_initialization``), which is right for those widths. But with ``prefill_chunk_size``
transformers allocates it eagerly instead (``GenerationMixin._prepare_static_cache`` ->
``Cache.early_initialization``, transformers 5.17 and 5.24), with the ``(num_kv_heads, head_dim)`` that
``GenerationMixin._get_static_cache_init_shape`` reads from the config: without the state channels, and
with one width for keys and values. The first ``index_copy_`` of a wider key then raises.

`install_static_cache_shape` gives a patched model instance (never the class, never transformers'
globals) its own ``_get_static_cache_init_shape``: for an encoding that widens the cached k or v it
returns ``None``, transformers' documented "cannot be early initialized" answer, and the cache is
allocated from the first chunk's keys and values; for every other encoding it returns what the class
method returns. The widths are measured, not declared: the encoding's ``prepare`` runs on zero tokens
(no compute) and the resulting k/v widths are compared with ``head_dim``.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

from ..encodings.base import PosContext, unwrap

__all__ = ["cached_kv_widths", "install_static_cache_shape"]

_ATTR = "_get_static_cache_init_shape"


def cached_kv_widths(base: nn.Module) -> tuple[int, int] | None:
    """The (key, value) widths that a patched base model stores in its KV cache: ``head_dim`` plus whatever
    the encoding's ``prepare`` appends, measured on the encoding's first layer with zero tokens in the model's
    dtype (every layer of an encoding appends the same channels; later TAPE layers need the previous layer's
    output). Under a plan the layers of different entries may store different widths: None then."""
    info = base.posenc_info
    d = info.head_dim
    ref = next((p for p in base.parameters() if p.is_floating_point()), None)
    dtype = ref.dtype if ref is not None else torch.float32
    device = ref.device if ref is not None else torch.device("cpu")
    root = PosContext(encoding=base.posenc, info=info, position_ids=torch.zeros(1, 0, dtype=torch.long, device=device))
    entries = getattr(unwrap(base.posenc), "layer_entries", None)
    first_layers = [0] if entries is None else [layer for layer, (_, local) in enumerate(entries) if local == 0]
    widths = set()
    for layer in first_layers:
        ctx, local = root.at(layer)
        if not getattr(unwrap(ctx.encoding), "prepares_qkv", False):
            widths.add((d, d))
            continue
        hidden = torch.zeros(1, 0, info.hidden_size, dtype=dtype, device=device)
        q = torch.zeros(1, info.num_heads, 0, d, dtype=dtype, device=device)
        kv = torch.zeros(1, info.num_kv_heads, 0, d, dtype=dtype, device=device)
        with torch.no_grad():
            _, k, v = ctx.prepare(local, hidden, q, kv, kv)
        widths.add((k.shape[-1], v.shape[-1]))
    return widths.pop() if len(widths) == 1 else None


def _static_cache_init_shape(self: nn.Module) -> Any:
    """``GenerationMixin._get_static_cache_init_shape`` of a patched model: ``None`` (allocate the cache from
    the first keys and values) when the encoding widens the cached k or v or the model has sliding-window
    layers, else the class's answer."""
    base = _find_base(self)
    if base is not None:
        d = base.posenc_info.head_dim
        if cached_kv_widths(base) != (d, d):
            return None
        # Sliding-window layers: hf_posenc replaces them by full layers before the first keys are stored
        # (patches/decoder.py ``full_cache_layers``); an eagerly allocated one would already count as filled.
        if any(w is not None for w in (base.posenc_info.sliding_windows or ())):
            return None
    return type(self)._get_static_cache_init_shape(self)


def _find_base(model: nn.Module) -> nn.Module | None:
    """The patched base model inside ``model`` (the module holding ``posenc``), or None."""
    for module in model.modules():
        if isinstance(getattr(module, "posenc", None), nn.Module):
            return module
    return None


def install_static_cache_shape(model: nn.Module) -> None:
    """Give ``model`` (a patched generation head, e.g. ``LlamaForCausalLM``) the instance-level
    ``_get_static_cache_init_shape`` above. A model without the hook (a base model, ViT) is left alone."""
    if callable(getattr(type(model), _ATTR, None)):
        setattr(model, _ATTR, types.MethodType(_static_cache_init_shape, model))
