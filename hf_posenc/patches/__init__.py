"""One patch per model family, looked up by ``config.model_type``."""

from __future__ import annotations

from ..registry import FAMILIES
from .base import FamilyPatch
from .gpt2 import GPT2Patch
from .llama import LlamaPatch
from .vit import ViTPatch

__all__ = ["get_family", "FamilyPatch"]

_PATCHES: dict[str, FamilyPatch] = {p.family: p for p in (LlamaPatch(), GPT2Patch(), ViTPatch())}
assert tuple(_PATCHES) == FAMILIES


def get_family(model_type: str | None) -> FamilyPatch:
    """The patch for ``model_type``; ``ValueError`` naming the supported families otherwise."""
    try:
        return _PATCHES[model_type]
    except KeyError:
        raise ValueError(
            f"unsupported model type {model_type!r}; hf_posenc patches these families: {', '.join(FAMILIES)}"
        ) from None
