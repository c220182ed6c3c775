"""hf_posenc: swap the position encoding of Hugging Face models (Llama, Mistral, Qwen2, Qwen3, Gemma 3, Phi-3,
GPT-NeoX, GPT-2, BERT, ViT) with one call."""

from . import encodings as _encodings  # noqa: F401  (registers every encoding)
from .api import describe, encoding_module, from_pretrained, patch_model, support_matrix
from .config import PosEncConfig
from .diagnostics import doctor
from .encodings.base import ModelInfo, PosContext, PositionEncoding
from .encodings.term import TermEncoding
from .export import export_native, native_export
from .kernels.attention.terms import KernelTerm, TensorSpec, TermExample, TermSpec, list_terms, register_term
from .profile import position_profile
from .registry import list_encodings, param, register_encoding
from .training import (
    check_adapter,
    encoding_parameters,
    install_peft_hooks as _install_peft_hooks,
    load_adapter,
    param_groups,
    trainable_modules,
)

from .auto import register as _register_auto
from . import hf_posenc_loader as _hf_posenc_loader  # noqa: F401  (save_pretrained copies its file beside the weights)

_install_peft_hooks()  # the adapter checks of PeftModel.save_pretrained / load_adapter (see hf_posenc.training)
_register_auto()  # posenc_<family> model types with transformers' Auto classes (see hf_posenc.auto)

__version__ = "0.1.0"

__all__ = [
    "KernelTerm",
    "ModelInfo",
    "PosContext",
    "PosEncConfig",
    "PositionEncoding",
    "TensorSpec",
    "TermEncoding",
    "TermExample",
    "TermSpec",
    "check_adapter",
    "describe",
    "doctor",
    "encoding_module",
    "encoding_parameters",
    "export_native",
    "from_pretrained",
    "list_encodings",
    "list_terms",
    "load_adapter",
    "native_export",
    "param_groups",
    "param",
    "patch_model",
    "position_profile",
    "register_encoding",
    "register_term",
    "support_matrix",
    "trainable_modules",
    "__version__",
]
