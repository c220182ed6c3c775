"""Small tensor helpers shared by the attention function and the encodings that compute attention themselves."""

from __future__ import annotations

import torch

__all__ = ["eager_value_checks", "expand_kv", "masked_softmax", "upcast"]


def expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, Hkv, L, D) -> (B, Hkv * groups, L, D): each key/value head serves ``groups`` query heads."""
    if groups == 1:
        return x
    b, h, n, d = x.shape
    return x[:, :, None].expand(b, h, groups, n, d).reshape(b, h * groups, n, d)


def masked_softmax(scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim in float32 (float64 stays float64) with ``mask`` (True = attend); fully masked rows give zeros."""
    scores = upcast(scores)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)


def upcast(t: torch.Tensor) -> torch.Tensor:
    """At least float32: half/bfloat16 parameters are computed in float32, float64 stays float64 (gradcheck)."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def eager_value_checks(t: torch.Tensor) -> bool:
    """Whether a check that reads the values of ``t`` may run: in eager mode and on a CPU tensor only.

    Reading a value (``int(t.max())``) is a device-to-host synchronisation on an accelerator, and under
    ``torch.compile`` (``torch.compiler.is_compiling()``) a data-dependent Python value breaks the graph
    (``fullgraph=True`` fails). Checks that read values step aside there; shape and dtype checks never do.
    """
    return t.device.type == "cpu" and not torch.compiler.is_compiling()
