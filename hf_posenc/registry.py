"""Registry of position encodings: ``register_encoding`` / ``get_encoding`` / ``list_encodings``.

Each encoding registers its module class, a dataclass describing its parameters (every field carries
help text and its allowed values in ``metadata``), its kind, and the model families it supports.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

__all__ = [
    "EncodingSpec",
    "param",
    "register_encoding",
    "get_encoding",
    "list_encodings",
    "FAMILIES",
]

#: The model families hf_posenc can patch, by ``config.model_type``.
FAMILIES: tuple[str, ...] = ("llama", "gpt2", "vit")

_MISSING = dataclasses.MISSING


def param(
    default: Any,
    help: str,
    *,
    type: type | tuple[type, ...],
    optional: bool = False,
    choices: tuple[Any, ...] | None = None,
    gt: float | None = None,
    ge: float | None = None,
    le: float | None = None,
) -> Any:
    """A dataclass field for an encoding parameter, with the metadata used for validation and docs.

    Args:
        default: the default value; ``None`` with ``optional=True`` means "resolved from the model".
        help: one sentence shown in errors, ``describe`` and the README.
        type: the accepted Python type(s); ``int`` is accepted where ``float`` is.
        optional: whether ``None`` is accepted.
        choices: the allowed values, if the parameter is an enumeration.
        gt, ge, le: numeric bounds (strictly greater, greater or equal, less or equal).
    """
    meta = {"help": help, "type": type, "optional": optional, "choices": choices, "gt": gt, "ge": ge, "le": le}
    return dataclasses.field(default=default, metadata=meta)


@dataclass(frozen=True)
class EncodingSpec:
    """What the registry knows about one encoding."""

    name: str
    cls: type
    params: type
    kind: str
    summary: str
    paper: str
    families: tuple[str, ...] = FAMILIES

    def param_fields(self) -> list[dataclasses.Field]:
        """The dataclass fields of the parameter schema, in declaration order."""
        return list(dataclasses.fields(self.params))

    def param_names(self) -> list[str]:
        return [f.name for f in self.param_fields()]


_REGISTRY: dict[str, EncodingSpec] = {}


def register_encoding(
    name: str,
    *,
    params: type,
    kind: str,
    summary: str,
    paper: str,
    families: tuple[str, ...] = FAMILIES,
) -> Callable[[type], type]:
    """Class decorator that registers a ``PositionEncoding`` subclass under ``name``.

    ``params`` must be a dataclass whose fields are built with :func:`param`.
    """
    if not dataclasses.is_dataclass(params):
        raise TypeError(f"params for encoding {name!r} must be a dataclass, got {params!r}")

    def deco(cls: type) -> type:
        if name in _REGISTRY and _REGISTRY[name].cls is not cls:
            raise ValueError(f"encoding {name!r} is already registered by {_REGISTRY[name].cls.__qualname__}")
        cls.name = name
        _REGISTRY[name] = EncodingSpec(name, cls, params, kind, summary, paper, tuple(families))
        return cls

    return deco


def get_encoding(name: str) -> EncodingSpec:
    """The spec registered under ``name``; ``ValueError`` listing the known names otherwise."""
    if not isinstance(name, str):
        raise TypeError(f"encoding name must be a str, got {type(name).__name__}")
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown position encoding {name!r}; known encodings: {', '.join(list_encodings())}") from None


def list_encodings() -> list[str]:
    """Every registered encoding name, sorted."""
    return sorted(_REGISTRY)
