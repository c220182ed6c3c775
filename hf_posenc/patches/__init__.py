"""One patch per model family, looked up by ``config.model_type``.

Adding a family: one file here (for a decoder shaped like Llama's, two subclasses and a
``decoder.DecoderPatch`` naming them), its entry in ``_PATCHES`` below and in
``hf_posenc.registry.FAMILY_KINDS``, and its tiny config in ``tests/conftest.py`` (docs/families.md, "Adding a
family").
"""

from __future__ import annotations

from ..registry import FAMILIES, did_you_mean
from .base import FamilyPatch
from .bert import BertPatch
from .gemma3 import Gemma3Patch
from .gpt2 import GPT2Patch
from .gpt_neox import GPTNeoXPatch
from .llama import LlamaPatch
from .mistral import MistralPatch
from .phi3 import Phi3Patch
from .qwen2 import Qwen2Patch
from .qwen3 import Qwen3Patch
from .vit import ViTPatch

__all__ = ["ADDING_A_FAMILY", "get_family", "FamilyPatch"]

#: Where the error for an unsupported model type points: how a family is added.
ADDING_A_FAMILY = (
    "To add a family: a patch file in hf_posenc/patches/ (for a decoder shaped like Llama's, two subclasses and a "
    "DecoderPatch, as in patches/mistral.py), its entry in _PATCHES there and in hf_posenc.registry.FAMILY_KINDS; "
    "see 'Adding a family' in docs/families.md"
)

_PATCHES: dict[str, FamilyPatch] = {
    p.family: p
    for p in (
        LlamaPatch(), GPT2Patch(), ViTPatch(), MistralPatch(), Qwen2Patch(), Qwen3Patch(), Gemma3Patch(),
        Phi3Patch(), GPTNeoXPatch(), BertPatch(),
    )
}
if tuple(_PATCHES) != FAMILIES:
    raise RuntimeError(f"hf_posenc.registry.FAMILIES {FAMILIES} and the patches {tuple(_PATCHES)} disagree")


def get_family(model_type: str | None) -> FamilyPatch:
    """The patch for ``model_type`` (a family's, or hf_posenc's own ``posenc_<family>``); ``ValueError`` naming
    the supported families otherwise."""
    if isinstance(model_type, str) and model_type.startswith("posenc_"):
        model_type = model_type[len("posenc_"):]
    try:
        return _PATCHES[model_type]
    except KeyError:
        hint = did_you_mean(model_type, FAMILIES) if isinstance(model_type, str) else ""
        raise ValueError(
            f"unsupported model type {model_type!r}{hint}; hf_posenc patches these families: {', '.join(FAMILIES)}. "
            f"{ADDING_A_FAMILY}"
        ) from None
