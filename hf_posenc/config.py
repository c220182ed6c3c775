"""``PosEncConfig``: an encoding name plus validated parameters, and its form in ``config.position_encoding``."""

from __future__ import annotations

import dataclasses
import math
import numbers
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping

from .kernels._masks import SINK_POSITIONS, check_sink, check_sink_positions, check_window  # noqa: F401
from .registry import EncodingSpec, get_encoding, is_registered

__all__ = [
    "PosEncConfig", "CONFIG_KEY", "LAYER_OPTIONS", "LENGTH_SCALES", "WINDOW_HELP", "check_window", "coerce_plan",
    "is_plan",
]

#: The attribute of a transformers config that holds the encoding, as a plain dict.
CONFIG_KEY = "position_encoding"
#: the key of ``config.position_encoding`` that records the modules outside hf_posenc defining its encodings.
MODULES_KEY = "modules"


def _plain(value: Any) -> Any:
    """A numpy (or other ``numbers``) scalar as the Python int or float it holds: the config is stored as JSON."""
    if value is None or isinstance(value, bool) or type(value) in (int, float, str):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


def _check_value(spec: EncodingSpec, f: dataclasses.Field, value: Any) -> Any:
    meta = f.metadata
    value = _plain(value)
    where = f"parameter {f.name!r} of encoding {spec.name!r}"
    if value is None:
        if meta.get("optional"):
            return None
        raise ValueError(f"{where} may not be None ({meta['help']})")
    types = meta["type"] if isinstance(meta["type"], tuple) else (meta["type"],)
    if isinstance(value, bool) and bool not in types:
        raise TypeError(f"{where} must be of type {'/'.join(t.__name__ for t in types)}, got bool")
    if float in types and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, types):
        raise TypeError(
            f"{where} must be of type {'/'.join(t.__name__ for t in types)}, got {type(value).__name__} ({value!r})"
        )
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where} must be finite, got {value!r}")
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        raise ValueError(f"{where} must be one of {list(choices)}, got {value!r}")
    for bound, ok, text in (
        ("gt", lambda v, b: v > b, "> {}"),
        ("ge", lambda v, b: v >= b, ">= {}"),
        ("le", lambda v, b: v <= b, "<= {}"),
    ):
        b = meta.get(bound)
        if b is not None and not ok(value, b):
            raise ValueError(f"{where} must be {text.format(b)}, got {value!r} ({meta['help']})")
    return value


#: help text of ``window``, the parameter every encoding takes (shown by ``hf-posenc list -v``).
WINDOW_HELP = (
    "sliding window of this encoding's layers: each query sees only its last `window` keys, itself included "
    "(the keys transformers' sliding_window gives Mistral); on bidirectional models the keys less than `window` "
    "positions away on either side (per grid axis on ViT); None: every key"
)
#: help text of ``sink``.
SINK_HELP = (
    "attention sinks beside the sliding window (StreamingLLM, Xiao et al. 2023, arXiv:2309.17453): the first "
    "`sink` keys (positions 0 .. sink - 1 of the sequence) stay visible to every query that the window would hide "
    "them from; needs `window`; None: no sink"
)
#: help text of ``sink_positions``.
SINK_POSITIONS_HELP = (
    "where the attention sinks sit for the position encoding: 'text' (None, the default: at their own positions "
    "0 .. sink - 1, so past P a query sees them farther away than anything in training) or 'cache' (StreamingLLM's: "
    "a sink the window no longer covers sits just before the window's oldest key, at distance W + sink - 1 - j "
    "for sink j); 'cache' needs sink, a causal model and an encoding whose term depends on the distance alone: rope "
    "and the Toeplitz score biases (alibi, kerple, sandwich, t5, dpb); the others refuse it"
)
#: the length-scaled softmaxes ``length_scale`` takes.
LENGTH_SCALES = ("ssmax", "logn")
#: help text of ``length_scale``.
LENGTH_SCALE_HELP = (
    "a per-query factor on the attention logits, by the number n of keys the query sees (n = its position + 1 on "
    "causal models, capped by the window and its sinks): 'ssmax' multiplies them by s * log n with s learned per "
    "head and layer (Scalable-Softmax, Nakanishi 2025, arXiv:2501.19399; s starts at 1 / log P, P the model's "
    "context); 'logn' by max(1, log n / log P) (Qwen's log-n scaling, fixed); applied as a scale of the query; "
    "None: off"
)
#: The options of a layer that every encoding takes beside its own parameters, with their help text. They are
#: attributes of `PosEncConfig` (not entries of ``params``), stored in ``to_dict`` only when set.
LAYER_OPTIONS: dict[str, str] = {"window": WINDOW_HELP, "sink": SINK_HELP, "length_scale": LENGTH_SCALE_HELP,
                                 "sink_positions": SINK_POSITIONS_HELP}


def check_length_scale(value: object, where: str = "length_scale") -> str | None:
    """``length_scale`` validated: None, ``"ssmax"`` or ``"logn"``."""
    if value is None:
        return None
    if not isinstance(value, str) or value not in LENGTH_SCALES:
        raise ValueError(f"{where} must be one of {list(LENGTH_SCALES)} or None, got {value!r}")
    return value


def encoding_modules(name: str) -> dict[str, str]:
    """{encoding: module} for the encodings ``name`` names (itself, or a composition's two parts) that a module
    outside hf_posenc defines (``EncodingSpec.module``); empty for built-ins."""
    out = {}
    for part in name.split("+"):
        if is_registered(part):
            module = get_encoding(part).module
            if module is not None:
                out[part] = module
    return out


def check_modules(modules: Any) -> None:
    """Raise ``ValueError`` naming the module to import for each encoding of a stored ``"modules"`` record
    (``PosEncConfig.to_dict``) that is not registered now; ``TypeError`` for a record that is not a dict."""
    if modules is None:
        return
    if not isinstance(modules, Mapping):
        raise TypeError(f"{CONFIG_KEY}[{MODULES_KEY!r}] must be a dict {{encoding: module}}, got "
                        f"{type(modules).__name__}")
    missing = {name: module for name, module in modules.items() if not is_registered(name)}
    if missing:
        which = "; ".join(f"{name!r} is defined by the module {module!r}" for name, module in missing.items())
        first = next(iter(missing.values()))
        how = f"`import {first}`" if all(p.isidentifier() for p in first.split(".")) else f"importing {first}"
        raise ValueError(
            f"{CONFIG_KEY} names encodings that are not registered: {which}. Import it before loading (e.g. {how}; "
            "on the command line `hf-posenc --import MODULE ...`): importing it registers them"
        )


@dataclass(frozen=True)
class PosEncConfig:
    """A position encoding: its registered ``name`` and its parameters, validated against the registry.

    ``params`` always holds every parameter of the encoding, with defaults filled in. A value of ``None``
    means "resolved from the model when patching"; `hf_posenc.patch_model` writes the resolved
    values to ``model.config.position_encoding``.

    The layer options (every encoding takes them; `LAYER_OPTIONS`): ``window`` limits the keys each query
    of the encoding's layers sees, ``sink`` keeps the first keys visible beside the window, ``length_scale``
    scales each query's logits by the number of keys it sees. They may be given among ``params`` too, and are
    stored in ``to_dict`` only when set, so configs without them keep their form.
    """

    name: str
    params: Mapping[str, Any] = field(default_factory=dict)
    window: int | None = None
    sink: int | None = None
    length_scale: str | None = None
    sink_positions: str | None = None

    def __post_init__(self) -> None:
        spec = get_encoding(self.name)
        if not isinstance(self.params, Mapping):
            raise TypeError(f"params must be a mapping, got {type(self.params).__name__}")
        if any(option in self.params for option in LAYER_OPTIONS):
            params = dict(self.params)
            for option in LAYER_OPTIONS:
                if option not in params:
                    continue
                given, own = params.pop(option), getattr(self, option)
                if own is not None and given != own:
                    raise ValueError(f"{option} given twice, as {own!r} and {given!r}")
                object.__setattr__(self, option, given)
            object.__setattr__(self, "params", params)
        where = f"of encoding {self.name!r}"
        object.__setattr__(self, "window", check_window(self.window, f"window {where}"))
        object.__setattr__(self, "sink", check_sink(self.sink, self.window, f"sink {where}"))
        object.__setattr__(self, "length_scale", check_length_scale(self.length_scale, f"length_scale {where}"))
        object.__setattr__(self, "sink_positions",
                           check_sink_positions(self.sink_positions, self.sink, f"sink_positions {where}"))
        if spec.normalise is not None:  # a composition ("rope+fox"): its parts validate their own parameters
            object.__setattr__(self, "params", spec.normalise(self.params))
            return
        known = {f.name: f for f in spec.param_fields()}
        unknown = sorted(set(self.params) - set(known))
        if unknown == ["init"]:
            raise ValueError(
                f"init= starts the term of a composition inert beside the model's own rotary or absolute encoding; "
                f"{self.name!r} alone has no such option: use a composition such as "
                f"'{'rope+fire' if spec.kind in ('absolute', 'q/k transform') else 'rope+' + self.name}' "
                "(see hf_posenc.encodings.compose)"
            )
        if unknown:
            allowed = ", ".join(known) if known else "none"
            raise ValueError(
                f"unknown parameter(s) {', '.join(map(repr, unknown))} for encoding {self.name!r}; allowed: {allowed}"
            )
        full: dict[str, Any] = {}
        for name, f in known.items():
            value = self.params[name] if name in self.params else f.default
            full[name] = _check_value(spec, f, value)
        # Cross-field checks live on the params dataclass itself.
        spec.params(**full)
        object.__setattr__(self, "params", full)

    @property
    def spec(self) -> EncodingSpec:
        return get_encoding(self.name)

    def layer_options(self) -> dict[str, Any]:
        """The layer options (`LAYER_OPTIONS`) by name, None where unset."""
        return {option: getattr(self, option) for option in LAYER_OPTIONS}

    def with_params(self, params: Mapping[str, Any]) -> "PosEncConfig":
        """The same encoding and layer options with ``params`` instead of its parameters (validated again)."""
        return PosEncConfig(self.name, params, **self.layer_options())

    def replace(self, **params: Any) -> "PosEncConfig":
        """A copy with some parameters changed (validated again); layer options (``window``, ...) may be among
        them."""
        options = {option: params.pop(option, value) for option, value in self.layer_options().items()}
        return PosEncConfig(self.name, {**self.params, **params}, **options)

    def to_dict(self) -> dict[str, Any]:
        """The form stored in ``config.position_encoding``: ``{"name": ..., **params}`` (and each layer option,
        ``"window"`` ..., when set; and ``"modules"``: {encoding: module} for the encodings it names that a module
        outside hf_posenc defines, so that loading says which module to import)."""
        out = {"name": self.name, **self.params}
        out.update({option: value for option, value in self.layer_options().items() if value is not None})
        modules = encoding_modules(self.name)
        if modules:
            out[MODULES_KEY] = modules
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, unknown: str = "error") -> "PosEncConfig":
        """Inverse of `to_dict`; clear errors for a missing name, unknown names and parameters.

        Args:
            data: ``{"name": ..., **params}``.
            unknown: what to do with parameter keys the encoding does not define. ``"error"`` (the default,
                for what a user typed): ``ValueError``. ``"warn"`` (for a stored config, e.g. the
                ``position_encoding`` of a checkpoint saved by a newer hf_posenc): a ``UserWarning`` naming
                them, and they are dropped. An unknown encoding name is an error either way.
        """
        if unknown not in ("error", "warn"):
            raise ValueError(f"unknown must be 'error' or 'warn', got {unknown!r}")
        if not isinstance(data, Mapping):
            raise TypeError(f"{CONFIG_KEY} must be a dict with a 'name' key, got {type(data).__name__}")
        if "name" not in data:
            raise ValueError(f"{CONFIG_KEY} must have a 'name' key, got keys {sorted(data)}")
        check_modules(data.get(MODULES_KEY))
        params = {k: v for k, v in data.items() if k not in ("name", MODULES_KEY)}
        if unknown == "warn":
            known = [*get_encoding(data["name"]).param_names(), *LAYER_OPTIONS]
            extra = sorted(set(params) - set(known), key=str)
            if extra:
                warnings.warn(
                    f"{CONFIG_KEY} of encoding {data['name']!r} has parameter(s) this version of hf_posenc does not "
                    f"know: {', '.join(map(repr, extra))} (saved by a newer version?); they are ignored. Known "
                    f"parameters: {', '.join(known) if known else 'none'}",
                    UserWarning,
                    stacklevel=3,
                )
                params = {k: v for k, v in params.items() if k in known}
        return cls(data["name"], params)

    @classmethod
    def coerce(cls, name: "str | Mapping[str, Any] | PosEncConfig", **params: Any) -> "PosEncConfig":
        """Build from a name, a dict (``{"name": ..., **params}``) or a ``PosEncConfig``; ``params`` override."""
        if isinstance(name, PosEncConfig):
            return name.replace(**params) if params else name
        if isinstance(name, Mapping):
            base = cls.from_dict(name)
            return base.replace(**params) if params else base
        if isinstance(name, str):
            return cls(name, params)
        raise TypeError(
            f"encoding must be a name (str), a dict with a 'name' key, or a PosEncConfig; got {type(name).__name__}"
        )


def is_plan(value: Any) -> bool:
    """Whether ``value`` is a plan: a list or tuple of encodings (names, dicts or ``PosEncConfig``)."""
    return isinstance(value, (list, tuple))


def coerce_plan(plan: Any, num_layers: int, *, unknown: str = "error") -> list[PosEncConfig]:
    """One `PosEncConfig` per layer from a plan: a list of entries (a name, a dict
    ``{"name": ..., **params}`` or a ``PosEncConfig`` each), repeated over the depth.

    Args:
        plan: the list; its length must divide ``num_layers``.
        num_layers: the model's number of layers.
        unknown: for dict entries, as in `PosEncConfig.from_dict` (``"warn"`` for a stored plan).

    Raises:
        ValueError: an empty list, or a length that does not divide ``num_layers``; errors of the entries,
            naming the entry.
    """
    if not is_plan(plan):
        raise TypeError(f"a plan is a list of encodings, got {type(plan).__name__}")
    if not plan:
        raise ValueError("a plan needs at least one encoding; got an empty list")
    if num_layers % len(plan):
        raise ValueError(
            f"a plan of {len(plan)} encodings is repeated over the depth, so its length must divide the number of "
            f"layers ({num_layers}); got {len(plan)}"
        )
    entries = []
    for i, entry in enumerate(plan):
        try:
            if isinstance(entry, Mapping) and not isinstance(entry, PosEncConfig):
                entries.append(PosEncConfig.from_dict(entry, unknown=unknown))
            else:
                entries.append(PosEncConfig.coerce(entry))
        except (ValueError, TypeError) as e:
            raise type(e)(f"plan entry {i} ({entry!r}): {e}") from None
    return [entries[layer % len(entries)] for layer in range(num_layers)]
