"""Remapped rotary distances past the pretrained context (ReRoPE, leaky ReRoPE, Self-Extend, DCA) and a window's
sinks at their cache positions (StreamingLLM): their one statement (`cases`), the oracle (`naive`) and the
O(L·block) engine (`engine`). Kernels take tensors: the rotary's frequencies, its rotated width and layout."""

from .cases import REMAPS, Case, Remap, dca_logit_scale, remap_defaults
from .engine import DEFAULT_BLOCK, remap_attention
from .naive import remap_reference

__all__ = ["DEFAULT_BLOCK", "REMAPS", "Case", "Remap", "dca_logit_scale", "remap_attention", "remap_defaults",
           "remap_reference"]
