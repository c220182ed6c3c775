"""Registry of position encodings: ``register_encoding`` / ``get_encoding`` / ``list_encodings``.

Each encoding registers its module class, a dataclass describing its parameters (every field carries
help text and its allowed values in ``metadata``), its kind, and the model families it supports.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
from dataclasses import dataclass
from typing import Any, Callable

__all__ = [
    "EncodingSpec",
    "param",
    "register_encoding",
    "get_encoding",
    "list_encodings",
    "FAMILIES",
    "FAMILY_KINDS",
    "supported_families",
    "set_composer",
    "defining_module",
    "did_you_mean",
    "is_registered",
]

#: The model families hf_posenc can patch, by ``config.model_type``, each with the kind of sequence its
#: attention sees: ``causal text`` (decoders), ``bidirectional text`` (BERT-style encoders) or ``image grid``
#: (ViT: bidirectional over a 2D patch grid plus CLS). Adding a family is one entry here and one patch file.
FAMILY_KINDS: dict[str, str] = {
    "llama": "causal text",
    "gpt2": "causal text",
    "vit": "image grid",
    "mistral": "causal text",
    "qwen2": "causal text",
    "qwen3": "causal text",
    "gemma3_text": "causal text",
    "phi3": "causal text",
    "gpt_neox": "causal text",
    "bert": "bidirectional text",
}
FAMILIES: tuple[str, ...] = tuple(FAMILY_KINDS)


def supported_families(declared: tuple[str, ...]) -> tuple[str, ...]:
    """The families an encoding supports, derived from the families (or kinds) it declares.

    A declared family stands for its kind: an encoding written for Llama works on every causal-text family,
    since they differ only in how the patch builds q, k and v, never in what the encoding sees. An encoding
    with a bidirectional form on ViT's grid has one on a line of text (the grid with one row and no CLS
    token: its docstrings give the 1D form), so ``image grid`` implies ``bidirectional text``. Kinds may be
    declared directly too (``"bidirectional text"``).
    """
    kinds = {FAMILY_KINDS.get(name, name) for name in declared}
    unknown = kinds - set(FAMILY_KINDS.values())
    if unknown:
        raise ValueError(
            f"unknown families or kinds {sorted(unknown)}; families: {', '.join(FAMILIES)}; kinds: "
            f"{', '.join(sorted(set(FAMILY_KINDS.values())))}"
        )
    if "image grid" in kinds:
        kinds.add("bidirectional text")
    return tuple(f for f in FAMILIES if FAMILY_KINDS[f] in kinds)

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
        gt: numeric bound: the value must be strictly greater.
        ge: numeric bound: greater or equal.
        le: numeric bound: less or equal.
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
    #: every family the encoding supports (derived from its declaration by `supported_families`).
    families: tuple[str, ...] = FAMILIES
    #: compositions only (``"rope+fox"``, see `hf_posenc.encodings.compose`): the full stored parameters
    #: from what the user gave, validated; None for a registered encoding (its ``params`` fields validate it).
    normalise: Callable[[Any], dict] | None = None
    #: the module that defines (registers) the encoding, where that is not hf_posenc itself (a user's own file): a
    #: checkpoint records it, and loading one without it imported says which module to import. None for built-ins.
    module: str | None = None

    def param_fields(self) -> list[dataclasses.Field]:
        """The dataclass fields of the parameter schema, in declaration order."""
        return list(dataclasses.fields(self.params))

    def param_names(self) -> list[str]:
        return [f.name for f in self.param_fields()]


_REGISTRY: dict[str, EncodingSpec] = {}
#: builds the spec of a composition ``"<first>+<term>"``; set by `hf_posenc.encodings.compose` (the registry
#: sits below the encodings and never imports them).
_COMPOSER: Callable[[str], EncodingSpec] | None = None


def set_composer(composer: Callable[[str], EncodingSpec]) -> None:
    """Install the builder of composition specs (called once, by ``hf_posenc.encodings.compose``)."""
    global _COMPOSER
    _COMPOSER = composer


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

    ``params`` must be a dataclass whose fields are built with `param`.
    """
    if not dataclasses.is_dataclass(params):
        raise TypeError(f"params for encoding {name!r} must be a dataclass, got {params!r}")

    def deco(cls: type) -> type:
        if name in _REGISTRY and _REGISTRY[name].cls is not cls:
            raise ValueError(f"encoding {name!r} is already registered by {_REGISTRY[name].cls.__qualname__}")
        cls.name = name
        _REGISTRY[name] = EncodingSpec(name, cls, params, kind, summary, paper, supported_families(tuple(families)),
                                       module=defining_module(cls))
        return cls

    return deco


def defining_module(cls: type) -> str | None:
    """The module that defines ``cls`` where it is not hf_posenc's own: its import name, or for a script run as
    ``__main__`` the script's path; None for hf_posenc's built-in encodings."""
    module = getattr(cls, "__module__", None) or ""
    if module == __package__ or module.startswith(__package__ + "."):
        return None
    if module == "__main__":
        path = getattr(sys.modules.get("__main__"), "__file__", None)
        return path or module
    return module


def get_encoding(name: str) -> EncodingSpec:
    """The spec registered under ``name``; ``ValueError`` listing the known names otherwise."""
    if not isinstance(name, str):
        raise TypeError(f"encoding name must be a str, got {type(name).__name__}")
    if "+" in name and _COMPOSER is not None:
        return _COMPOSER(name)
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown position encoding {name!r}{did_you_mean(name, list_encodings())}; known encodings: "
            f"{', '.join(list_encodings())}"
        ) from None


def did_you_mean(name: str, choices: "list[str] | tuple[str, ...]") -> str:
    """The hint for a misspelt ``name`` among ``choices``: ``" (did you mean 'alibi'?)"``, or ``""`` when nothing is
    close.

    A match that differs only in case comes first (``"ALiBi"`` -> ``alibi``); otherwise the choices within a small
    edit distance, closest first (``difflib``'s ratio of at least 0.75, compared in lower case: ``"allibi"`` ->
    ``alibi``, ``"kerpel"`` -> ``kerple``), then those that begin with a name of three letters or more
    (``"gemma3"`` -> ``gemma3_text``); at most three.

    Args:
        name: what the user wrote.
        choices: the allowed names.
    """
    folded = {c.lower(): c for c in choices}
    word = name.lower()
    if word in folded:
        close = [folded[word]]
    else:
        close = [folded[c] for c in difflib.get_close_matches(word, list(folded), n=3, cutoff=0.75)]
        if len(word) >= 3:
            close += [c for f, c in folded.items() if f.startswith(word) and c not in close]
        close = close[:3]
    if not close:
        return ""
    return " (did you mean " + " or ".join(repr(c) for c in close) + "?)"


def is_registered(name: str) -> bool:
    """Whether ``name`` is a registered encoding (a composition's parts are registered one by one)."""
    return name in _REGISTRY


def list_encodings() -> list[str]:
    """Every registered encoding name, sorted."""
    return sorted(_REGISTRY)
