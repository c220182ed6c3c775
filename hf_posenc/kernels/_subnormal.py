"""Flush-to-zero for the tile engines' softmax on the CPU, stated.

A probability exp(x) with x < ln(1.18e-38) ≈ −87.3 is a subnormal float32 number, and x86 CPUs compute with
subnormal numbers many times slower (measured: CAPE's CPU training step ran 8.2x SDPA's with them, 5.8x with
flush-to-zero set for the whole process). GPUs flush them to zero; here the engines do it themselves: such a
weight is below float32's resolution of a softmax row (whose largest weight is 1). The same clamp keeps the
masked entries' −inf away from the exponential, which is as slow on it (see `exp_flushed`).
"""

from __future__ import annotations

import torch

__all__ = ["EXP_FLOOR", "exp_flushed"]

#: ln of float32's smallest normal number (1.18e-38).
EXP_FLOOR = -87.3
#: what the exponential's results are zeroed at or below: 2^-125, twice float32's smallest normal number, so
#: that a clamped entry (e^EXP_FLOOR ≈ 1.2192e-38) is zeroed whatever the device's exp rounds it to. A threshold
#: at e^EXP_FLOOR as the CPU computes it (1.21924331e-38) failed on an H100 (torch 2.11), whose exp gives
#: 1.21924345e-38: masked entries kept that weight, a query row with no visible key (left padding) summed to
#: a positive number instead of 0 and returned the mean of the masked values (tile engine, relative error 0.15;
#: benchmarks/results/gpu_check_nvidia-h100-80gb-hbm3_diagnostics.md). Weights between e^EXP_FLOOR and 2^-125
#: (x in (−87.3, −86.6]) are below float32's resolution of a softmax row, like the subnormal ones.
_FLUSH_AT = 2.0**-125


def exp_flushed(x: torch.Tensor) -> torch.Tensor:
    """``x.exp_()`` in place, with 0 where exp(x) <= 2^-125 (x <= about −86.6: every subnormal or zero result,
    and the −inf of masked entries, on any device); float64 as is.

    The exponential never sees an argument below the floor: x is clamped to it, and what comes out at the floor
    is zeroed (``threshold_``; NaN stays NaN). x86's vectorised exp takes a slow path for every argument whose
    result is not a normal number, −inf included: measured on the 2-core CPU, (8, 128, 256) float32 tiles,
    22 µs for arguments in [−80, 0], 250 µs with half of them −inf, 1.1 ms with half at −200, 2.6 ms at −88;
    this function takes 45-52 µs on each of those tiles."""
    if x.dtype == torch.float64:
        return x.exp_()
    return torch.threshold_(x.clamp_min_(EXP_FLOOR).exp_(), _FLUSH_AT, 0.0)
