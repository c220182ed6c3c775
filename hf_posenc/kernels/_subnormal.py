"""Flush-to-zero for the tile engines' softmax on the CPU, stated.

A probability exp(x) with x < ln(1.18e-38) ≈ −87.3 is a subnormal float32 number, and x86 CPUs compute with
subnormal numbers many times slower (measured: CAPE's CPU training step ran 8.2x SDPA's with them, 5.8x with
flush-to-zero set for the whole process). GPUs flush them to zero; here the engines do it themselves, where a
term can produce them: such a weight is below float32's resolution of a softmax row (whose largest weight is 1).
"""

from __future__ import annotations

import torch

__all__ = ["EXP_FLOOR", "exp_flushed"]

#: ln of float32's smallest normal number (1.18e-38).
EXP_FLOOR = -87.3


def exp_flushed(x: torch.Tensor) -> torch.Tensor:
    """``x.exp_()`` in place, with 0 where the result would be subnormal (x <= EXP_FLOOR); float64 as is.

    One in-place pass before the exponential (``threshold_``: x <= floor -> -inf; NaN stays NaN), measured at
    a third of the time of a comparison and a ``masked_fill_`` on a (8, 128, 256) tile on the 2-core CPU."""
    if x.dtype == torch.float64:
        return x.exp_()
    return torch.threshold_(x, EXP_FLOOR, float("-inf")).exp_()
