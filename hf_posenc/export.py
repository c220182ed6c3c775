"""A patched model to a plain transformers checkpoint of a stock architecture, where one computes the same function.

A model converted with hf_posenc saves as ``posenc_<family>``: only hf_posenc (or ``trust_remote_code`` with its
loader) reads it, and no serving engine does. Many conversions have an exact equivalent among transformers' own
architectures, though: a plan of ``rope`` and ``nope`` layers with sliding windows is SmolLM3 (``no_rope_layers``,
``layer_types``, ``sliding_window``), ``rope`` with ``scaling`` is the family's own ``rope_parameters``, ``rope``
with one ``window`` on every layer is Mistral, ``learned`` on GPT-2 is GPT-2. `export_native` writes such a
model as that architecture, with its tokenizer, so that ``AutoModelForCausalLM.from_pretrained`` loads it on a
machine without hf_posenc, and every engine that runs the architecture runs it.

The mapping is one table, `EXPORT_ROUTES` (rendered by `export_table` on the docs page
``docs/export.md``): per source family, which plans map to which architecture, through which config keys, and
what must hold. The first route of the model's family that fits is taken. A model no route fits raises a
``ValueError`` that names each part with no stock equivalent (an encoding, a layer option such as ``sink``, a
parameter such as rope's ``layout``, windows of two sizes) and the nearest recipe that does export.

Each layer is described by two facts (`LayerFacts`): its rotary, in transformers' ``rope_parameters`` form
(None for a NoPE layer), and the window it attends through -- the narrower of the entry's own ``window`` and the
model's native sliding window on that layer (hf_posenc's ``window`` keeps the keys transformers' ``sliding_window``
keeps: key j > query i - window). The weights are the patched model's own: rope and nope hold none, so the
native weights carry over under their names; ``learned`` puts its table back where the family keeps one (GPT-2's
``wpe``, BERT's and ViT's ``position_embeddings``).

Before anything is written, `export_native` builds the target model from the same tensors and compares its
output with the patched model's on a probe input (float32 and float64 models; ``check=False`` skips it). The
tests load each route's export in a fresh process that never imports hf_posenc and compare logits and greedy
generations (tests/test_export.py, tests/test_real.py).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from .api import _resolve_plan, layer_encodings
from .config import CONFIG_KEY, PosEncConfig
from .encodings.base import ModelInfo, narrowest_window
from .patches import get_family

logger = logging.getLogger(__name__)

__all__ = ["EXPORT_ROUTES", "ExportRoute", "LayerFacts", "NativeExport", "export_native", "export_table",
           "native_export", "tokenizer_source"]

#: How the docs and the errors name each family.
FAMILY_NAMES = {
    "llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "gemma3_text": "Gemma 3",
    "phi3": "Phi-3", "gpt_neox": "GPT-NeoX", "gpt2": "GPT-2", "bert": "BERT", "vit": "ViT",
}
#: Families whose stock rotary can be partial (``partial_rotary_factor`` in ``rope_parameters``).
_PARTIAL_ROTARY = ("phi3", "gpt_neox")
#: Families whose stock position encoding is a learned table (``learned`` exports as the family itself).
_LEARNED = ("gpt2", "bert", "vit")
#: Families that map to SmolLM3, whose layers may drop the rotary (``no_rope_layers``).
_NOPE_LAYERS = ("llama", "mistral")
#: rope's parameters the export reads (any other must keep its default).
_ROPE_KNOWN = ("theta", "layout", "partial_rotary_factor", "scaling")
#: Config keys that are not carried to the target config (what the target's class and hf_posenc own).
_NOT_CARRIED = ("architectures", "model_type", "transformers_version", "auto_map", CONFIG_KEY, "_name_or_path",
                "rope_scaling", "rope_theta", "_commit_hash", "_attn_implementation_autoset")


@dataclass(frozen=True)
class LayerFacts:
    """What a layer's position handling is, in the terms a stock architecture takes.

    Attributes:
        rotary: the layer's rotary in transformers' ``rope_parameters`` form (``rope_type``, ``rope_theta``, the
            scaling's own keys, ``partial_rotary_factor`` when only part of each head rotates); None for a layer
            without one (NoPE).
        window: the keys each query sees, itself included (transformers' ``sliding_window``), or None.
    """

    rotary: dict | None
    window: int | None

    def rotary_key(self) -> str | None:
        """The rotary as a canonical string (layers with equal rotaries have equal keys)."""
        return None if self.rotary is None else json.dumps(self.rotary, sort_keys=True)


@dataclass
class _Plan:
    """A patched model's position handling, as the routes read it."""

    family: str
    info: ModelInfo
    config: Any  # the source transformers config
    kind: str  # "rotary" (every layer rope or nope) or "learned" (one table on the embeddings)
    layers: list[LayerFacts] = field(default_factory=list)
    table_rows: int | None = None  # learned: rows of the table

    # -- what the routes ask ------------------------------------------------------------------------------
    def rotaries(self) -> list[str]:
        """The distinct rotaries of the rope layers, as canonical strings, in order of first use."""
        return list(dict.fromkeys(k for k in (layer.rotary_key() for layer in self.layers) if k is not None))

    def windows(self) -> list[int]:
        """The distinct windows of the windowed layers, in order of first use."""
        return list(dict.fromkeys(layer.window for layer in self.layers if layer.window is not None))

    def first_rotary(self, windowed: bool | None = None) -> dict | None:
        """The rotary of the first rope layer (of the windowed ones, or of the others, when ``windowed`` says)."""
        for layer in self.layers:
            if layer.rotary is not None and (windowed is None or (layer.window is not None) == windowed):
                return dict(layer.rotary)
        return None


# -- the routes ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExportRoute:
    """One row of the mapping table.

    Attributes:
        families: the source families it applies to.
        layers: which plans it takes (docs).
        target: the target's ``model_type``; the architecture is the target's class for the source's head
            (``SmolLM3ForCausalLM`` for a ``LlamaForCausalLM``).
        keys: the target config keys that carry the encoding (docs).
        holds: what must hold besides (docs).
        fits: the plan -> None when the route takes it, else why not (one phrase).
        overrides: the plan -> the target config's values that carry the encoding.
        must_be: source config keys the target has no field for, with the value they must have (a Llama's
            ``attention_bias`` and ``mlp_bias`` on Mistral, which has neither).
        extra_keys: source config keys the target lacks as fields but reads (SmolLM3 reads ``head_dim``).
    """

    families: tuple[str, ...]
    layers: str
    target: str
    keys: str
    holds: str
    fits: Callable[[_Plan], str | None]
    overrides: Callable[[_Plan], dict[str, Any]]
    must_be: tuple[tuple[str, Any], ...] = ()
    extra_keys: tuple[str, ...] = ()


def _every_layer_rope(plan: _Plan) -> str | None:
    if plan.kind != "rotary":
        return "the plan is not one of rope and nope layers"
    nope = [i for i, layer in enumerate(plan.layers) if layer.rotary is None]
    if nope:
        return f"NoPE on {_layer_list(nope, len(plan.layers))}: the architecture rotates every layer"
    return None


def _one_rotary(plan: _Plan) -> str | None:
    found = plan.rotaries()
    if len(found) > 1:
        return (f"the rope layers use {len(found)} different rotaries ({'; '.join(found)}): the architecture has one "
                "rope_parameters for every layer")
    return None


def _one_window_size(plan: _Plan) -> str | None:
    found = plan.windows()
    if len(found) > 1:
        return (f"windows of {len(found)} sizes ({', '.join(map(str, found))}): the architecture has one "
                "sliding_window for every windowed layer")
    return None


def _no_window(plan: _Plan) -> str | None:
    windowed = [i for i, layer in enumerate(plan.layers) if layer.window is not None]
    if windowed:
        return f"a sliding window on {_layer_list(windowed, len(plan.layers))}: the architecture has none"
    return None


def _same_window_everywhere(plan: _Plan) -> str | None:
    if len({layer.window for layer in plan.layers}) > 1:
        return "windows that differ between layers: the architecture puts one sliding_window on every layer"
    return None


def _all(*checks: Callable[[_Plan], str | None]) -> Callable[[_Plan], str | None]:
    def fits(plan: _Plan) -> str | None:
        for check in checks:
            reason = check(plan)
            if reason is not None:
                return reason
        return None

    return fits


def _gemma3_types(plan: _Plan) -> str | None:
    for windowed, what in ((True, "windowed"), (False, "unwindowed")):
        found = {layer.rotary_key() for layer in plan.layers if (layer.window is not None) == windowed}
        if len(found) > 1:
            return (f"the {what} layers use {len(found)} different rotaries: Gemma 3 has one rotary per layer type "
                    "(sliding_attention, full_attention)")
    return None


def _learned(plan: _Plan) -> str | None:
    if plan.kind != "learned":
        return "the architecture's only position encoding is its learned table (learned)"
    return None


def _rope_parameters(plan: _Plan) -> dict[str, Any]:
    """``{"rope_parameters": ...}``: the rope layers' rotary; nothing (the source's stays) when no layer rotates."""
    rotary = plan.first_rotary()
    return {} if rotary is None else {"rope_parameters": rotary}


def _layer_types(plan: _Plan) -> list[str]:
    return ["sliding_attention" if layer.window is not None else "full_attention" for layer in plan.layers]


def _window_of(plan: _Plan) -> int | None:
    windows = plan.windows()
    return windows[0] if windows else None


def _llama_overrides(plan: _Plan) -> dict[str, Any]:
    return _rope_parameters(plan)


def _mistral_overrides(plan: _Plan) -> dict[str, Any]:
    return {**_rope_parameters(plan), "sliding_window": _window_of(plan)}


def _smollm3_overrides(plan: _Plan) -> dict[str, Any]:
    window = _window_of(plan)
    return {
        **_rope_parameters(plan),
        "no_rope_layers": [int(layer.rotary is not None) for layer in plan.layers],
        "layer_types": _layer_types(plan),
        "use_sliding_window": window is not None,
        "sliding_window": window,
    }


def _qwen_overrides(plan: _Plan) -> dict[str, Any]:
    window = _window_of(plan)
    return {**_rope_parameters(plan), "layer_types": _layer_types(plan), "use_sliding_window": window is not None,
            "sliding_window": window}


def _gemma3_overrides(plan: _Plan) -> dict[str, Any]:
    own = dict(getattr(plan.config, "rope_parameters", None) or {})
    local = plan.first_rotary(windowed=True) or own.get("sliding_attention")
    full = plan.first_rotary(windowed=False) or own.get("full_attention")
    out: dict[str, Any] = {"layer_types": _layer_types(plan),
                           "rope_parameters": {"sliding_attention": local, "full_attention": full}}
    window = _window_of(plan)
    if window is not None:
        out["sliding_window"] = window
    return out


def _phi3_overrides(plan: _Plan) -> dict[str, Any]:
    return {**_rope_parameters(plan), "sliding_window": _window_of(plan)}


def _learned_overrides(plan: _Plan) -> dict[str, Any]:
    key = {"gpt2": "n_positions", "bert": "max_position_embeddings"}.get(plan.family)
    return {key: plan.table_rows} if key is not None else {}


_ROPE = "`rope` on every layer"
_ONE_ROTARY = "one rotary for every rope layer (its `theta`, `scaling`)"
#: The mapping table: per source family, the plans that map to a stock architecture. The first that fits is
#: taken. Rendered on docs/export.md by `export_table`.
EXPORT_ROUTES: tuple[ExportRoute, ...] = (
    ExportRoute(("llama",), f"{_ROPE}, no window", "llama", "`rope_parameters`", _ONE_ROTARY,
                _all(_every_layer_rope, _one_rotary, _no_window), _llama_overrides),
    ExportRoute(("llama", "mistral"), f"{_ROPE}, one window on every layer (Mistral: or none)", "mistral",
                "`sliding_window`, `rope_parameters`",
                f"{_ONE_ROTARY}; the same window on every layer; no attention or MLP biases",
                _all(_every_layer_rope, _one_rotary, _same_window_everywhere), _mistral_overrides,
                must_be=(("attention_bias", False), ("mlp_bias", False))),
    ExportRoute(("llama", "mistral"), "`rope` and `nope` layers, each with or without a window (SmolLM3's NoPE every "
                "4th layer, RNoPE-SWA, all `nope`)", "smollm3",
                "`no_rope_layers`, `layer_types`, `use_sliding_window`, `sliding_window`, `rope_parameters`",
                f"{_ONE_ROTARY}; one window size for every windowed layer",
                _all(_one_rotary, _one_window_size), _smollm3_overrides, extra_keys=("head_dim",)),
    ExportRoute(("qwen2",), f"{_ROPE}, each layer with or without a window", "qwen2",
                "`layer_types`, `use_sliding_window`, `sliding_window`, `rope_parameters`",
                f"{_ONE_ROTARY}; one window size for every windowed layer",
                _all(_every_layer_rope, _one_rotary, _one_window_size), _qwen_overrides),
    ExportRoute(("qwen3",), f"{_ROPE}, each layer with or without a window", "qwen3",
                "`layer_types`, `use_sliding_window`, `sliding_window`, `rope_parameters`",
                f"{_ONE_ROTARY}; one window size for every windowed layer",
                _all(_every_layer_rope, _one_rotary, _one_window_size), _qwen_overrides),
    ExportRoute(("gemma3_text",), f"{_ROPE} (the model's own local and global bases, or one rotary), each layer "
                "with or without a window", "gemma3_text",
                "`layer_types`, `sliding_window`, `rope_parameters` per layer type",
                "one window size; one rotary for the windowed layers and one for the others",
                _all(_every_layer_rope, _one_window_size, _gemma3_types), _gemma3_overrides),
    ExportRoute(("phi3",), f"{_ROPE} (partial too), one window on every layer or none", "phi3",
                "`sliding_window`, `rope_parameters` (with `partial_rotary_factor`)",
                f"{_ONE_ROTARY}; the same window on every layer",
                _all(_every_layer_rope, _one_rotary, _same_window_everywhere), _phi3_overrides),
    ExportRoute(("gpt_neox",), f"{_ROPE} (partial too), no window", "gpt_neox",
                "`rope_parameters` (with `partial_rotary_factor`)", _ONE_ROTARY,
                _all(_every_layer_rope, _one_rotary, _no_window), _llama_overrides),
    ExportRoute(("gpt2",), "`learned`, no window", "gpt2", "`wpe` (the table), `n_positions` (its rows)",
                "none beyond", _learned, _learned_overrides),
    ExportRoute(("bert",), "`learned`, no window", "bert",
                "`embeddings.position_embeddings` (the table), `max_position_embeddings` (its rows)",
                "none beyond", _learned, _learned_overrides),
    ExportRoute(("vit",), "`learned`, no window", "vit", "`embeddings.position_embeddings` (the table)",
                "none beyond (the table follows the config's image grid)", _learned, _learned_overrides),
)


def export_table() -> str:
    """The mapping table as markdown (docs/export.md holds it): one row per route of `EXPORT_ROUTES`."""
    rows = ["| family | layers | exports as | config keys | what must hold |", "|---|---|---|---|---|"]
    for route in EXPORT_ROUTES:
        families = ", ".join(FAMILY_NAMES[f] for f in route.families)
        heads = " and its heads" if route.target in ("bert", "vit") else ""
        rows.append(f"| {families} | {route.layers} | `{_architecture_name(route.target)}`{heads} | {route.keys} | "
                    f"{route.holds} |")
    return "\n".join(rows)


# -- reading a patched model --------------------------------------------------------------------------------


def _layer_list(layers: list[int], total: int) -> str:
    """``every layer`` or ``layers 3, 7, 11 of 12`` (at most six named, then ``...``)."""
    if len(layers) == total:
        return "every layer"
    shown = ", ".join(map(str, layers[:6])) + (", ..." if len(layers) > 6 else "")
    return f"layer{'s' if len(layers) > 1 else ''} {shown} of {total}"


def _show(config: PosEncConfig, defaults: dict | None = None) -> str:
    """``name`` or ``name(key=value, ...)`` with what differs from ``defaults`` (the encoding's own by default) and
    the layer options that are set."""
    defaults = PosEncConfig(config.name).params if defaults is None else defaults
    changed = {k: v for k, v in config.params.items() if v != defaults.get(k)}
    changed.update({k: v for k, v in config.to_dict().items() if k != "name" and k not in config.params})
    return config.name + ("(" + ", ".join(f"{k}={v!r}" for k, v in changed.items()) + ")" if changed else "")


def _rotary(config: PosEncConfig, info: ModelInfo, layer: int, family: str) -> tuple[dict | None, list[str]]:
    """The rope layer's rotary in ``rope_parameters`` form, and the parts of its config with no stock form."""
    p = config.params
    problems = []
    if p.get("layout", "half") != "half":
        problems.append(f"rope(layout={p['layout']!r}): transformers rotates the half-split pairs (x[i], x[i+d/2]); "
                        "no stock architecture takes interleaved pairs")
    defaults = PosEncConfig("rope").params
    unknown = [k for k in p if k not in _ROPE_KNOWN and p[k] != defaults.get(k)]
    if unknown:
        problems.append(f"rope({', '.join(f'{k}={p[k]!r}' for k in unknown)}): not known to the export")
    if p.get("scaling") is not None:
        rotary = {**p["scaling"], "rope_theta": float(p["theta"])}
    elif p.get("theta") is None:  # the model's own: per layer (Gemma 3), or its scaled rotary
        rotary = dict(info.layer_rope_parameters[layer] if info.layer_rope_parameters else info.rope_parameters)
    else:
        rotary = {"rope_type": "default", "rope_theta": float(p["theta"])}
    rotary.pop("partial_rotary_factor", None)
    factor = p.get("partial_rotary_factor")
    rotated = int(info.head_dim * factor) if factor is not None else (info.rotary_dim or info.head_dim)
    if family in _PARTIAL_ROTARY:
        rotary["partial_rotary_factor"] = _partial_factor(config, info, rotated)
    elif rotated != info.head_dim:
        problems.append(f"rope(partial_rotary_factor={factor}): {FAMILY_NAMES[family]}'s stock rotary turns every "
                        f"dim of the head ({info.head_dim}), not {rotated}")
    return rotary, problems


def _partial_factor(config: PosEncConfig, info: ModelInfo, rotated: int) -> float:
    """A ``partial_rotary_factor`` f with int(head_dim * f) == ``rotated``: rope's own, the model's, or the ratio."""
    native = (info.rope_parameters or {}).get("partial_rotary_factor")
    for f in (config.params.get("partial_rotary_factor"), native, rotated / info.head_dim):
        if f is not None and int(info.head_dim * f) == rotated:
            return float(f)
    raise ValueError(f"no partial_rotary_factor gives {rotated} rotated dims of head_dim={info.head_dim}")


def _why_not(config: PosEncConfig, family: str) -> str:
    """Why an encoding other than rope, nope or learned has no stock equivalent (one phrase)."""
    from .registry import get_encoding

    name = FAMILY_NAMES[family]
    if "+" in config.name:
        term = config.name.split("+", 1)[1]
        return f"no stock {name}-family architecture adds {term}'s {get_encoding(term).kind} term beside the rotary"
    kind = get_encoding(config.name).kind
    what = {
        "score bias": "adds a score bias",
        "score mix": "mixes the attention scores across heads",
        "score + value": "adds relative terms to the scores and the values",
        "data-dependent": "gates attention by the data",
        "replaces softmax": "replaces the softmax",
        "contextual states": "carries position states from layer to layer",
        "q/k transform": f"applies {config.name}'s transform of the queries and keys",
        "absolute": f"adds {config.name}'s table to the embeddings",
    }.get(kind, f"has {config.name}")
    return f"no stock {name}-family architecture {what}"


def _layer_problems(configs: list[PosEncConfig], family: str) -> dict[str, list[int]]:
    """Per part with no stock form (a phrase naming it and why), the layers where it occurs."""
    problems: dict[str, list[int]] = {}

    def add(text: str, layer: int) -> None:
        problems.setdefault(text, []).append(layer)

    for i, config in enumerate(configs):
        stored = config.to_dict()
        for option in sorted(k for k in stored if k not in ("name", "window") and k not in config.params):
            add(f"{option}={stored[option]!r}: no stock architecture has it (" + {
                "sink": "attention sinks beside a sliding window",
                "length_scale": "a softmax scaled by the number of keys",
            }.get(option, f"the layer option {option}") + ")", i)
        if config.name == "nope" and family in _LEARNED:
            add(f"nope: no stock {FAMILY_NAMES[family]}-family architecture runs without its position table", i)
        elif config.name == "nope" and family not in _NOPE_LAYERS:
            add(f"nope: no stock {FAMILY_NAMES[family]}-family architecture has layers without a rotary (SmolLM3's "
                "NoPE layers take Llama's and Mistral's layout only)", i)
        elif config.name == "nope":
            defaults = PosEncConfig("nope").params
            changed = [k for k, v in config.params.items() if v != defaults.get(k)]
            named = [k for k in changed if not any(k.startswith(o + "_") for o in changed)]  # qk_norm, not its eps
            if changed:
                add(f"{_show(config)}: no stock architecture with NoPE layers has {', '.join(sorted(named))}", i)
        elif config.name == "learned":
            if family not in _LEARNED:
                add(f"learned: {_why_not(config, family)}", i)
        elif config.name != "rope" or family in _LEARNED:
            add(f"{config.name}: {_why_not(config, family)}", i)
    return problems


def _read(configs: list[PosEncConfig], info: ModelInfo, family: str, source_config: Any,
          table_rows: int | None = None) -> tuple[_Plan, dict[str, list[int]]]:
    """The plan the routes read from per-layer resolved configs, and the parts with no stock form."""
    problems = _layer_problems(configs, family)
    native = info.sliding_windows or (None,) * info.num_layers
    names = {c.name for c in configs}
    if names == {"learned"}:
        plan = _Plan(family, info, source_config, "learned", table_rows=table_rows)
        if configs[0].window is not None or any(w is not None for w in native):
            problems.setdefault(f"window={configs[0].window}: {FAMILY_NAMES[family]}'s learned table has no sliding "
                                "window", []).extend(range(info.num_layers))
        return plan, problems
    plan = _Plan(family, info, source_config, "rotary")
    for i, config in enumerate(configs):
        rotary = None
        if config.name == "rope":
            rotary, found = _rotary(config, info, i, family)
            for text in found:
                problems.setdefault(text, []).append(i)
        plan.layers.append(LayerFacts(rotary, narrowest_window(config.window, native[i])))
    return plan, problems


# -- choosing a route ---------------------------------------------------------------------------------------


def _route(plan: _Plan) -> tuple[ExportRoute | None, list[str]]:
    """The first route of the plan's family that fits it, and why each route of the family does not."""
    reasons = []
    for route in EXPORT_ROUTES:
        if plan.family not in route.families:
            continue
        reason = route.fits(plan) or _config_misfit(route, plan.config)
        if reason is None:
            return route, reasons
        reasons.append(f"{_architecture_name(route.target)}: {reason}")
    return None, reasons


def _architecture_name(model_type: str) -> str:
    """The target's causal-LM class name (``SmolLM3ForCausalLM``); its base model's for the encoders."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES

    if model_type in _LEARNED and model_type != "gpt2":
        return MODEL_MAPPING_NAMES[model_type]
    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type) or MODEL_MAPPING_NAMES[model_type]


@functools.lru_cache(maxsize=None)
def _target_fields(model_type: str) -> frozenset[str]:
    """The keys of the target config class (those of a default instance's ``to_dict``)."""
    from transformers import CONFIG_MAPPING

    return frozenset(CONFIG_MAPPING[model_type]().to_dict())


#: Source config fields the Llama-shaped families have and the targets lack, which no modeling code reads.
_UNREAD_FIELDS = ("pretraining_tp",)


def _config_misfit(route: ExportRoute, config: Any) -> str | None:
    """Why the source config's own fields keep ``route`` from fitting (a field the target has no counterpart for,
    with a value that matters), or None. Attributes that are not fields of the source's config class (metadata
    such as a checkpoint's ``unk_token_id``) are carried over as they are."""
    source = config.to_dict()
    for key, want in route.must_be:
        if key in source and source[key] != want:
            return f"{key}={source[key]!r} (the architecture has no {key})"
    family = get_family(getattr(config, "model_type", None)).family
    if route.target == family:
        return None  # the family's own config class
    lost = _target_fields(family) - _target_fields(route.target) - set(route.extra_keys) - set(_UNREAD_FIELDS)
    lost -= {k for k, _ in route.must_be}
    if lost:
        return f"the {FAMILY_NAMES[family]} config fields {sorted(lost)} have no counterpart"
    return None


@dataclass(frozen=True)
class NativeExport:
    """Where a patched model exports (what `native_export` returns).

    Attributes:
        architecture: the target class's name for the model's head (``SmolLM3ForCausalLM`` for a
            ``LlamaForCausalLM``).
        model_type: the target's ``model_type`` (``smollm3``).
        config: the target's transformers config, ready to build the model.
        route: the row of `EXPORT_ROUTES` that was taken.
        layers: per layer, what it runs (`LayerFacts`; empty for ``learned``).
    """

    architecture: str
    model_type: str
    config: Any
    route: ExportRoute
    layers: tuple[LayerFacts, ...]


def _target_config(route: ExportRoute, plan: _Plan) -> Any:
    """The target's config: the source's settings (but the source family's fields the target lacks), then the
    route's values."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[route.target]
    source = plan.config.to_dict()
    # the source family's fields that the target lacks stay behind (checked by _config_misfit); everything else
    # (fields the two share, the target's extra_keys, attributes that are no field of either) carries over
    lost = (_target_fields(plan.family) - _target_fields(route.target) - set(route.extra_keys)
            if route.target != plan.family else set())
    kwargs = {k: copy.deepcopy(v) for k, v in source.items() if k not in lost and k not in _NOT_CARRIED}
    kwargs.update(route.overrides(plan))
    return cls(**kwargs)


def _head_class(model: nn.Module, family: str, target: str) -> type:
    """The target's class for the source's head: the one transformers' Auto class of that head maps ``target``
    to (``LlamaForCausalLM`` -> ``SmolLM3ForCausalLM``; a base model -> the target's base model)."""
    import transformers
    from transformers.models.auto import modeling_auto

    patch = get_family(family)
    source = patch.base_class if isinstance(model, patch.base_class) else type(model)
    if family == target:
        return source
    for name in sorted(dir(modeling_auto)):
        mapping = getattr(modeling_auto, name)
        if not (name.startswith("MODEL_") and name.endswith("_MAPPING_NAMES") and isinstance(mapping, dict)):
            continue
        names = mapping.get(family)
        names = names if isinstance(names, (list, tuple)) else (names,)
        if source.__name__ in names and isinstance(mapping.get(target), str):
            cls = getattr(transformers, mapping[target], None)
            if cls is not None:
                return cls
    raise ValueError(
        f"{source.__name__} has no counterpart in {_architecture_name(target)} (no transformers Auto class maps both "
        f"families for this head); export the base model or another head"
    )


def _model_configs(model: nn.Module) -> tuple[str, ModelInfo, list[PosEncConfig], int | None]:
    """(family, model description, per-layer resolved configs, learned table rows) of a patched model."""
    from .api import encoding_module

    for name, module in model.named_modules():
        if type(module).__module__.split(".")[0] == "peft":
            raise ValueError(f"the model holds PEFT layers ({name or 'the model'}: {type(module).__name__}); export the "
                             "merged model: peft_model.merge_and_unload(), then export_native")

    family = get_family(getattr(model.config, "model_type", None)).family
    layers = layer_encodings(model)  # raises for an unpatched model
    configs = [module.posenc_config for module, _ in layers]
    base = get_family(family).base_model(model)
    rows = None
    if {c.name for c in configs} == {"learned"}:
        weight = encoding_module(model).weight
        rows = int(weight.shape[-2]) if family != "vit" else None
    return family, base.posenc_info, configs, rows


def native_export(model: nn.Module) -> NativeExport:
    """Where a patched model exports, without writing anything.

    Args:
        model: a model patched by hf_posenc (``patch_model`` or ``from_pretrained``).

    Returns:
        A `NativeExport`: the target architecture and its config.

    Raises:
        ValueError: no stock architecture computes what the model computes. The message names each part with no
            stock equivalent (``"alibi: no stock Llama-family architecture adds a score bias"``) and the nearest
            recipe that exports, where there is one. Also for a model that is not patched.
    """
    family, info, configs, rows = _model_configs(model)
    found = _classify(family, info, configs, model.config, rows)
    return dataclasses.replace(found, architecture=_head_class(model, family, found.model_type).__name__)


def _classify(family: str, info: ModelInfo, configs: list[PosEncConfig], source_config: Any,
              rows: int | None) -> NativeExport:
    plan, problems = _read(configs, info, family, source_config, rows)
    route, reasons = (None, []) if problems else _route(plan)
    if route is not None:
        config = _target_config(route, plan)
        return NativeExport(_architecture_name(route.target), route.target, config, route, tuple(plan.layers))
    name = FAMILY_NAMES[family]
    if problems:
        parts = [f"{text} (on {_layer_list(layers, info.num_layers)})" if len(layers) < info.num_layers else text
                 for text, layers in problems.items()]
    else:
        parts = [f"no stock architecture takes this {name} plan: " + "; ".join(reasons)]
    message = f"cannot export this {name} model to a stock transformers architecture: " + "; ".join(parts)
    nearest = _nearest(family, info, configs, source_config, rows)
    message += f". Nearest exportable recipe: {nearest}" if nearest else ". No recipe of this family exports"
    raise ValueError(message)


# -- the nearest recipe that exports ------------------------------------------------------------------------


def _plain(config: PosEncConfig, family: str, **keep: Any) -> PosEncConfig:
    """``config``'s encoding with only what exports: rope's theta and scaling (half layout, the model's own partial
    rotary), nope's defaults; its window (unless ``keep`` says otherwise)."""
    if config.name == "rope":
        p = config.params
        params = {"theta": p.get("theta"), "scaling": p.get("scaling")}
        if family in _PARTIAL_ROTARY:
            params["partial_rotary_factor"] = p.get("partial_rotary_factor")
        return PosEncConfig("rope", params, window=keep.get("window", config.window))
    return PosEncConfig(config.name, {}, window=keep.get("window", config.window))


def _nearest_plans(family: str, configs: list[PosEncConfig]) -> list[list[PosEncConfig]]:
    """Candidate recipes, nearest first: the plan with each part that has no stock form replaced (an encoding by
    nope in a plan with rope layers on families that take NoPE layers, else by rope; layer options and rope's
    other parameters dropped), then with one window size (the most common), then one rotary (the most common),
    then the model's own rope on every layer; ``learned`` on the families whose stock encoding it is."""
    n = len(configs)
    if family in _LEARNED:
        return [[PosEncConfig("learned")] * n]
    rope_layers = [c for c in configs if c.name == "rope" or c.name.startswith("rope+")]
    mixed = family in _NOPE_LAYERS and len(rope_layers) not in (0, n)
    fixed = []
    for c in configs:
        if c.name in ("rope", "nope"):
            fixed.append(_plain(c, family))
        elif c.name.startswith("rope+"):
            fixed.append(PosEncConfig("rope", {}, window=c.window))
        else:
            fixed.append(PosEncConfig("nope" if mixed else "rope", {}, window=c.window))
    windows = Counter(c.window for c in fixed if c.window is not None)
    common = max(windows, key=lambda w: (windows[w], -w)) if windows else None
    one_window = [_plain(c, family, window=common if c.window is not None else None) for c in fixed]
    rotaries = Counter(json.dumps(c.params, sort_keys=True) for c in one_window if c.name == "rope")
    if rotaries:
        first = json.loads(max(rotaries, key=rotaries.__getitem__))
        one_rotary = [PosEncConfig("rope", first, window=c.window) if c.name == "rope" else c for c in one_window]
    else:
        one_rotary = one_window
    return [fixed, one_window, one_rotary, [PosEncConfig("rope")] * n]


def _recipe_text(configs: list[PosEncConfig], info: ModelInfo) -> str:
    """The recipe as ``patch_model`` takes it: one encoding, or the shortest period of the plan; parameters shown
    where they differ from what the encoding resolves to on this model (rope's theta: the model's own)."""
    defaults: dict[str, dict] = {}
    for c in configs:
        if c.name not in defaults:
            defaults[c.name] = dict(_resolve_plan([PosEncConfig(c.name)] * info.num_layers, info)[0].params)
    shown = [_show(c, defaults[c.name]) for c in configs]
    for period in range(1, len(shown) + 1):
        if len(shown) % period == 0 and shown == shown[:period] * (len(shown) // period):
            shown = shown[:period]
            break
    return shown[0] if len(shown) == 1 else "[" + ", ".join(shown) + "]"


def _nearest(family: str, info: ModelInfo, configs: list[PosEncConfig], source_config: Any,
             rows: int | None) -> str | None:
    """The first candidate of `_nearest_plans` that exports, with the architecture it exports as."""
    seen = set()
    for candidate in _nearest_plans(family, configs):
        try:
            resolved = _resolve_plan(candidate, info)
            text = _recipe_text(resolved, info)
            if text in seen:
                continue
            seen.add(text)
            plan, problems = _read(resolved, info, family, source_config, rows or info.max_positions)
        except (ValueError, TypeError):
            continue
        route, _ = (None, []) if problems else _route(plan)
        if route is not None:
            return f"{text} (exports as {_architecture_name(route.target)})"
    return None


# -- writing ------------------------------------------------------------------------------------------------


def _state_dict(model: nn.Module, family: str, kind: str) -> dict[str, torch.Tensor]:
    """The patched model's weights under the target's names: the native ones as they are; a learned table back
    where the family keeps one (``family.native_keys``)."""
    native_key = get_family(family).native_keys[0] if kind == "learned" else None
    out = {}
    for key, value in model.state_dict().items():
        parts = key.split(".")
        if "posenc" not in parts:
            out[key] = value
            continue
        at = parts.index("posenc")
        if native_key is None or parts[at + 1:] != ["weight"]:
            raise ValueError(f"the patched model holds the encoding weight {key!r}, which the target has no place for")
        out[".".join([*parts[:at], native_key])] = value
    return out


def _build(model: nn.Module, target: NativeExport, family: str) -> nn.Module:
    """The target model holding the patched model's tensors (shared, not copied), on the model's device."""
    from transformers.initialization import no_init_weights

    cls = _head_class(model, family, target.model_type)
    target.config.dtype = next(model.parameters()).dtype
    with no_init_weights():
        built = cls(target.config)
    state = _state_dict(model, family, "learned" if not target.layers else "rotary")
    expected = built.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"the weights do not fit {cls.__name__}: missing {missing}, unexpected {unexpected}")
    for key, value in state.items():
        want = expected[key].shape
        if value.shape != want:
            raise ValueError(f"{key!r} has shape {tuple(value.shape)}, {cls.__name__} expects {tuple(want)}")
    built.load_state_dict(state, strict=True, assign=True)
    built.tie_weights()
    device = next(model.parameters()).device
    built.to(device)  # the non-persistent buffers (rotary frequencies): the parameters are the model's own already
    built.train(False)
    if getattr(model, "generation_config", None) is not None and getattr(built, "generation_config", None) is not None:
        built.generation_config = copy.deepcopy(model.generation_config)
    return built


def _probe(model: nn.Module, family: str, length: int) -> dict[str, torch.Tensor]:
    """A fixed probe input for ``model``: token ids (text) or pixels (ViT) on its device."""
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(0)
    if family == "vit":
        size = model.config.image_size
        size = (size, size) if isinstance(size, int) else tuple(size)
        pixels = torch.randn(1, model.config.num_channels, *size, generator=g)
        return {"pixel_values": pixels.to(device=device, dtype=next(model.parameters()).dtype)}
    ids = torch.randint(0, model.config.vocab_size, (1, length), generator=g)
    return {"input_ids": ids.to(device)}


def _output_tensors(output: Any) -> torch.Tensor:
    """Every tensor a forward returns (logits; a QA head's start and end logits; a base model's hidden states),
    flattened and joined."""
    return torch.cat([v.float().flatten() for v in output.values() if isinstance(v, torch.Tensor)])


def _check(model: nn.Module, built: nn.Module, family: str, target: NativeExport) -> float | None:
    """Max |difference| of the two models' outputs on a probe that runs past the narrowest window (at most 512
    tokens; within the position table of a learned one); ``RuntimeError`` when above float32 rounding. None for
    other dtypes (not checked)."""
    dtype = next(model.parameters()).dtype
    if dtype not in (torch.float32, torch.float64):
        logger.warning("export_native: the %s model is not checked against the export (only float32 and float64 "
                       "models are); export a float32 copy to have it checked", dtype)
        return None
    windows = [layer.window for layer in target.layers if layer.window is not None]
    length = min(512, max(32, (min(windows) + 16) if windows else 32))
    if not target.layers:  # a learned table: within its rows
        settings = target.config.to_dict()
        length = min(length, int(settings.get("n_positions") or settings.get("max_position_embeddings") or length))
    inputs = _probe(model, family, length)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            want = _output_tensors(model(**inputs, **({} if family == "vit" else {"use_cache": False})))
            got = _output_tensors(built(**inputs, **({} if family == "vit" else {"use_cache": False})))
    finally:
        model.train(was_training)
    diff = float((want - got).abs().max())
    scale = max(1.0, float(want.abs().max()))
    if not diff <= 1e-4 * scale:
        raise RuntimeError(
            f"export_native: {target.architecture} gives outputs {diff:.3g} away from the patched model's (scale "
            f"{scale:.3g}) on a {length}-token probe; nothing was written. Please report this with the model's config"
        )
    return diff


def tokenizer_source(model: nn.Module) -> Path | None:
    """The model's own directory (``name_or_path``) when it holds a tokenizer."""
    path = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", None)
    if not path or not Path(path).is_dir():
        return None
    names = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "vocab.txt")
    return Path(path) if any((Path(path) / n).is_file() for n in names) else None


def export_native(model: nn.Module, path: str | os.PathLike, *, tokenizer: Any = None,
                  check: bool = True) -> NativeExport:
    """Write a patched model as a plain transformers checkpoint of the stock architecture that computes the same
    function (see the table on docs/export.md), with its tokenizer.

    ``AutoModelForCausalLM.from_pretrained(path)`` (``AutoModel`` and the family's other Auto classes alike) then
    loads it on any machine, without hf_posenc, and gives the patched model's outputs; serving engines that run
    the architecture run it. The weights are the model's own (trained ones included); nothing of hf_posenc is
    written (no ``position_encoding``, no ``auto_map``, no loader module).

    Args:
        model: a model patched by hf_posenc (``patch_model`` or ``from_pretrained``), base model or head class;
            with a LoRA adapter, merged first (``merge_and_unload()``). Unchanged by the export; its tensors are
            shared with the target model while it is written.
        path: the output directory (created; files of the same names are overwritten).
        tokenizer: the tokenizer to save beside the weights: a tokenizer object, or a directory or hub name
            ``AutoTokenizer.from_pretrained`` reads. None: the model's own directory (``model.name_or_path``)
            when it holds one, else none is written (a warning says so).
        check: compare the exported model's output with the patched model's on a probe input before writing
            (float32 and float64 models; a ``RuntimeError`` if they differ beyond rounding, and nothing is
            written).

    Returns:
        The `NativeExport` that was written (architecture, config, the route taken).

    Raises:
        ValueError: no stock architecture computes what the model computes; the message names each part with no
            stock equivalent and the nearest recipe that exports (see `native_export`).
    """
    target = native_export(model)
    family = get_family(model.config.model_type).family
    built = _build(model, target, family)
    if check:
        _check(model, built, family, target)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    built.save_pretrained(out)
    source = tokenizer if tokenizer is not None else tokenizer_source(model)
    if source is None:
        logger.warning("export_native: no tokenizer given and none beside the model; %s holds the model only", out)
    else:
        if isinstance(source, (str, os.PathLike)):
            from transformers import AutoTokenizer

            source = AutoTokenizer.from_pretrained(source)
        source.save_pretrained(out)
    return target
