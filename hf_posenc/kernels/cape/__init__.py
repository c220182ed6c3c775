"""CAPE attention kernels: the tile-wise PyTorch implementation (``tiled.py``, O(L · block) memory, any
device; what ``cape`` runs) and the full-matrix reference (``naive.py``, the test oracle and the path for
attention probabilities, attention dropout and ViT's 2D grid). There is no Triton kernel for CAPE."""

from .bias_tile import base_bias_tile, base_unsupported
from .naive import cape_attention_reference, cape_scores_reference
from .tiled import cape_attention_tiled

__all__ = [
    "base_bias_tile",
    "base_unsupported",
    "cape_attention_reference",
    "cape_attention_tiled",
    "cape_scores_reference",
]
