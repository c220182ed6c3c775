"""Stick-breaking attention kernels: the Triton kernels (``triton_sba.py``) beside the reference (``naive.py``).

``stick_breaking`` dispatches (``sba_backend`` tells which it will use):

* ``HF_POSENC_BACKEND`` unset: the Triton kernels when the tensors are on a CUDA device and the kernels
  support the inputs; the tile-wise PyTorch engine (``tiled.py``) otherwise (CPU tensors, float64,
  head_dim > 128, attention weights requested, attention dropout while training).
* ``HF_POSENC_BACKEND=triton``: the kernels, or a ``ValueError`` that says why they cannot run (Triton
  missing, tensors on the CPU without ``TRITON_INTERPRET=1``, one of the cases above). Under
  ``TRITON_INTERPRET=1`` the kernels run on CPU tensors in Triton's interpreter (slow; for tests).
* ``HF_POSENC_BACKEND=torch`` (or ``flex``: stick-breaking has no FlexAttention form): the tile-wise engine.

The tile-wise engine (``tiled.py``: plain PyTorch, any device, O(L·block) memory, recomputing backward) is
what runs wherever the kernels do not; the full-matrix reference (``naive.py``) is the test oracle, and what
the encoding uses only when it must return the attention weights or apply attention dropout.

Every option of the encoding runs in-kernel: ``attend_current`` (the diagonal as a breakpoint) and the three
``remainder`` modes (``discard``, ``current``, ``bias``). Causal only: the kernels and the engine serve text; the encoding's
grid-ordered generalisation on ViT runs its own reference. Query i is key ``q_offset + i`` (a tensor offset, from a StaticCache, is loaded
by the kernels on the device, never read on the host).
"""

from __future__ import annotations

import torch

from .._attn_dispatch import check_attention_inputs, choose, common_unsupported, flag_unsupported, last_dim_contiguous
from .._masks import check_sink, check_window
from .naive import sba_reference
from .tiled import sba_tiled

__all__ = ["sba_backend", "sba_reference", "sba_tiled", "stick_breaking"]

_REMAINDERS = ("discard", "current", "bias")


def _check(q, k, v, mask, q_offset, remainder, bias) -> None:
    """Validate shapes and options (ValueError), whatever the backend."""
    check_attention_inputs(q, k, v, mask, q_offset)
    if remainder not in _REMAINDERS:
        raise ValueError(f"remainder must be one of {_REMAINDERS}, got {remainder!r}")
    h, d = q.shape[1], q.shape[3]
    if remainder == "bias" and (bias is None or tuple(bias.shape) != (h, d)):
        got = None if bias is None else tuple(bias.shape)
        raise ValueError(f"remainder='bias' needs a bias of shape ({h}, {d}), got {got}")


def sba_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                q_offset: int | torch.Tensor = 0, need_weights: bool = False, dropout: float = 0.0,
                training: bool = False) -> str:
    """``"triton"`` or ``"torch"``: which implementation ``stick_breaking`` uses for these inputs.

    Raises:
        ValueError: ``HF_POSENC_BACKEND`` names no backend, or names ``triton`` and the kernel cannot run.
    """
    return choose(
        lambda: common_unsupported("sba", "sba.triton_sba", q, k, v, mask, q_offset, need_weights, dropout, training),
        q.device.type == "cuda",
        "sba",
        flag_unsupported("sba", need_weights, dropout, training),
    )


def stick_breaking(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                   q_offset: int | torch.Tensor = 0, attend_current: bool = False, remainder: str = "discard",
                   bias: torch.Tensor | None = None, window: int | None = None, sink: int | None = None
                   ) -> torch.Tensor:
    """Stick-breaking attention (see ``hf_posenc/encodings/sba.py`` for the formula): fused on CUDA, tile-wise
    PyTorch elsewhere.

    Args:
        q: (B, H, Lq, D); k, v: (B, Hkv, Lk, D) with H a multiple of Hkv (not expanded).
        mask: (B|1, 1, Lq, Lk) bool (True = may attend; padding), or None. Causality by index is applied
            in any case.
        scale: logit scale (1/sqrt(D) for the models).
        q_offset: query i is key ``q_offset + i`` (the cache length before this forward).
        attend_current: whether the query's own key is a breakpoint.
        remainder: ``"discard"``, ``"current"`` or ``"bias"``.
        bias: (H, D) per-head remainder vector (``remainder="bias"``); gets a gradient.
        window: None, or an int >= 1: a sliding window, query i sees only keys qi − window < j <= qi; the keys
            outside are absent as if masked (no weight, no break). Both engines skip the key tiles outside it.
        sink: None, or an int >= 1 with a ``window``: attention sinks, the keys j < sink kept besides the band
            (breakpoints and weights as any visible key); both engines visit their key tiles, not those between
            them and the window.

    Returns:
        (B, H, Lq, D) in q's dtype (computed in float32).

    Raises:
        ValueError, TypeError: bad shapes or options, a ``window`` or ``sink`` that is not None or an int >= 1, or
            a sink without a window.
    """
    _check(q, k, v, mask, q_offset, remainder, bias)
    window = check_window(window)
    sink = check_sink(sink, window)
    if sba_backend(q, k, v, mask, q_offset) == "triton":
        from .triton_sba import sba_triton

        return sba_triton(*last_dim_contiguous(q, k, v), mask, scale, q_offset, attend_current, remainder, bias,
                          window=window, sink=sink)
    return sba_tiled(q, k, v, mask, scale, q_offset, attend_current, remainder, bias, window=window, sink=sink)
