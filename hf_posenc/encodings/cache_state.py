"""Float32 state stored in extra channels of a KV cache (FoX's and FoX Pro's gates, TaPE's position states).

Encodings that carry per-token state append it to the keys (and values) in ``prepare``, so transformers' caches
store it and it follows ``crop``, beam-search ``reorder_cache`` and StaticCache for free. The state is float32;
the cache has the model's dtype. One packing serves them all:

* float32 / float64 cache: the values themselves (one channel per value).
* bfloat16 / float16 cache: each value x as two channels, hi = x.to(dtype) and lo = ((x − hi) · s).to(dtype),
  read back as hi + lo / s in float32 (s = 1 for bfloat16; s = 2^11 for float16, which keeps lo a normal
  float16 number for values down to ~1e-7 in magnitude: float16's smallest normal is 6e-5, and
  |x − hi| <= 2^-11 |x|). That is 16 (bfloat16) or 22 (float16) significant bits instead of 8 or 11, a
  relative error below 2^-15 per value: the cumulative sum of 4096 FoX log-gates read from a bfloat16 cache
  stays within 3e-3 of the exact one (float32's own rounding of that sum is ~2e-4; a single bfloat16 channel
  is off by 0.5).

The split is differentiable (the gradient reaching x is that of hi + lo / s); a bit-exact alternative, viewing
the float32 bits as two 16-bit values, would carry no gradient and be corrupted by any arithmetic on the cache.
float16 cannot hold |x| > 65504: values are clamped to [−30000, 30000] before packing into float16 (FoX's
log-gates: exp(−30000) = 0 either way).
"""

from __future__ import annotations

import torch

__all__ = ["pack_state", "state_width", "unpack_state"]

#: values are clamped to ±this before they are packed into a float16 cache (|x| <= 65504 there).
FP16_LIMIT = 30000.0
#: the lo part of a float16 pair is stored times 2^11 (|x - hi| <= 2^-11 |x|), so that it stays a normal
#: float16 number for values down to ~1e-7; bfloat16 has float32's range.
_LO_SCALE = {torch.float16: 2048.0}


def state_width(dtype: torch.dtype) -> int:
    """Channels per stored float32 value in a cache of ``dtype``: 1 (float32/64) or 2 (hi/lo, 16-bit)."""
    return 1 if dtype in (torch.float32, torch.float64) else 2


def pack_state(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(..., n) float32 values -> (..., n * w) channels of ``dtype`` (w = `state_width`): the values
    themselves, or [hi (n), lo (n)] with hi = x.to(dtype), lo = ((x - hi) * s).to(dtype) (s = 2^11 for
    float16, 1 for bfloat16); read back by `unpack_state` as hi + lo / s."""
    if state_width(dtype) == 1:
        return x.to(dtype)
    scale = _LO_SCALE.get(dtype, 1.0)
    if dtype == torch.float16:
        x = x.clamp(-FP16_LIMIT, FP16_LIMIT)
    hi = x.to(dtype)
    lo = ((x - hi.to(x.dtype)) * scale).to(dtype)
    return torch.cat([hi, lo], dim=-1)


def unpack_state(t: torch.Tensor, n: int, compute: torch.dtype) -> torch.Tensor:
    """Inverse of `pack_state`: (..., n * w) channels (the first n * w of the last dim) -> (..., n) in
    ``compute`` dtype."""
    if state_width(t.dtype) == 1:
        return t[..., :n].to(compute)
    return t[..., :n].to(compute) + t[..., n : 2 * n].to(compute) / _LO_SCALE.get(t.dtype, 1.0)
