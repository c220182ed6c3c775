"""torch's fused CPU attention kernel, as the tile-wise engines call it (``attention/tiled.py``, ``cope/tiled.py``).

``FLASH_FORWARD(q, k, v, dropout, is_causal, attn_mask=None, scale=None) -> (out, logsumexp)`` and
``FLASH_BACKWARD(dout, q, k, v, out, logsumexp, dropout, is_causal, attn_mask=None, scale=None) -> (dq, dk, dv)``:
q (B, H, Lq, E), k, v (B, H, Lk, E) (no GQA), a float mask broadcastable to (B, H, Lq, Lk) and read by its strides
(a view serves, measured: same results as a contiguous copy), ``is_causal`` and a mask together allowed. None where
this torch build lacks them (the engines then take their online passes).
"""

from __future__ import annotations

import torch

__all__ = ["FLASH_BACKWARD", "FLASH_FORWARD"]

FLASH_FORWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
FLASH_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
