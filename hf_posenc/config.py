"""``PosEncConfig``: an encoding name plus validated parameters, and its form in ``config.position_encoding``."""

from __future__ import annotations

import dataclasses
import math
import numbers
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping

from .registry import EncodingSpec, get_encoding

__all__ = ["PosEncConfig", "CONFIG_KEY"]

#: The attribute of a transformers config that holds the encoding, as a plain dict.
CONFIG_KEY = "position_encoding"


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


@dataclass(frozen=True)
class PosEncConfig:
    """A position encoding: its registered ``name`` and its parameters, validated against the registry.

    ``params`` always holds every parameter of the encoding, with defaults filled in. A value of ``None``
    means "resolved from the model when patching"; :func:`hf_posenc.patch_model` writes the resolved
    values to ``model.config.position_encoding``.
    """

    name: str
    params: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        spec = get_encoding(self.name)
        if not isinstance(self.params, Mapping):
            raise TypeError(f"params must be a mapping, got {type(self.params).__name__}")
        known = {f.name: f for f in spec.param_fields()}
        unknown = sorted(set(self.params) - set(known))
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

    def replace(self, **params: Any) -> "PosEncConfig":
        """A copy with some parameters changed (validated again)."""
        return PosEncConfig(self.name, {**self.params, **params})

    def to_dict(self) -> dict[str, Any]:
        """The form stored in ``config.position_encoding``: ``{"name": ..., **params}``."""
        return {"name": self.name, **self.params}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, unknown: str = "error") -> "PosEncConfig":
        """Inverse of :meth:`to_dict`; clear errors for a missing name, unknown names and parameters.

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
        params = {k: v for k, v in data.items() if k != "name"}
        if unknown == "warn":
            known = get_encoding(data["name"]).param_names()
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
