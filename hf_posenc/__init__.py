"""hf_posenc: swap the position encoding of Hugging Face Llama, GPT-2 and ViT models with one call."""

from . import encodings as _encodings  # noqa: F401  (registers every encoding)
from .api import describe, encoding_module, from_pretrained, patch_model, support_matrix
from .config import PosEncConfig
from .registry import list_encodings, register_encoding

__version__ = "0.1.0"

__all__ = [
    "PosEncConfig",
    "describe",
    "encoding_module",
    "from_pretrained",
    "list_encodings",
    "patch_model",
    "register_encoding",
    "support_matrix",
    "__version__",
]
