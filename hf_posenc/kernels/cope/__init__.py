"""CoPE attention kernels: the Triton kernels (``triton_cope.py``) beside the reference (``naive.py``).

``cope`` dispatches (``cope_backend`` tells which it will use):

* ``HF_POSENC_BACKEND`` unset: the Triton kernels when the tensors are on a CUDA device and the kernels
  support the inputs; the tile-wise PyTorch engine (``tiled.py``) otherwise (CPU tensors, float64,
  head_dim > 128, attention weights requested, attention dropout while training, the bidirectional ViT variant).
* ``HF_POSENC_BACKEND=triton``: the kernels, or a ``ValueError`` that says why they cannot run (Triton
  missing, tensors on the CPU without ``TRITON_INTERPRET=1``, one of the cases above). Under
  ``TRITON_INTERPRET=1`` the kernels run on CPU tensors in Triton's interpreter (slow; for tests).
* ``HF_POSENC_BACKEND=torch`` (or ``flex``: CoPE has no FlexAttention form): the tile-wise engine.

The kernels are causal (text models). The bidirectional generalisation of the encoding on ViT (raster-order
counts in both directions, a second table, CLS excluded; see ``hf_posenc/encodings/cope.py``) is computed by
the reference: on CUDA the encoding uses the reference for it, and forcing ``triton`` on ViT raises.
The tile-wise engine (``tiled.py``: plain PyTorch, any device, O(L·block) memory, recomputing backward) is
what runs wherever the kernels do not; the full-matrix reference (``naive.py``) is the test oracle, and what
the encoding uses only when it must return the probabilities, apply attention dropout, or run on ViT.
Query i is key ``q_offset + i`` (a tensor offset, from a StaticCache, is loaded
by the kernels on the device, never read on the host).
"""

from __future__ import annotations

import torch

from .._attn_dispatch import check_attention_inputs, choose, common_unsupported, flag_unsupported, last_dim_contiguous
from .._masks import check_sink, check_window
from .naive import cope_reference
from .tiled import cope_tiled

__all__ = ["cope", "cope_backend", "cope_reference", "cope_tiled", "cope_torch", "triton_unsupported"]


def _check(q, k, v, table, mask, q_offset) -> None:
    check_attention_inputs(q, k, v, mask, q_offset)
    d = q.shape[3]
    if table.dim() != 2 or table.shape[0] != d or table.shape[1] < 1:
        raise ValueError(f"table must be (head_dim={d}, npos_max), got {tuple(table.shape)}")


#: why float32 CoPE does not run the Triton kernel on CUDA (measured; bfloat16 and float16 do).
FLOAT32_ON_CUDA = (
    "the CoPE Triton kernel's float32 path failed on an H100 (torch 2.11, Triton 3.6): an out-of-bounds "
    "shared-memory read in _cope_bwd_q at head_dim 40 (compute-sanitizer; an illegal memory access otherwise) "
    "and relative errors up to 3.5e-4 at head_dim 128; float32 CoPE runs the PyTorch engine on CUDA until the "
    "kernel passes there (bfloat16 and float16 passed; benchmarks/results/gpu_check_nvidia-h100-80gb-hbm3*)"
)


def triton_unsupported(q, k, v, mask, q_offset, need_weights=False, dropout=0.0, training=False) -> str | None:
    """The reason the causal CoPE Triton kernel cannot run these inputs (a sentence), or None: the checks every
    attention kernel shares, then float32 on CUDA (`FLOAT32_ON_CUDA`)."""
    why = common_unsupported("cope", "cope.triton_cope", q, k, v, mask, q_offset, need_weights, dropout, training)
    if why is None and q.device.type == "cuda" and q.dtype == torch.float32:
        return FLOAT32_ON_CUDA
    return why


def cope_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                 q_offset: int | torch.Tensor = 0, need_weights: bool = False, dropout: float = 0.0,
                 training: bool = False, causal: bool = True) -> str:
    """``"triton"`` or ``"torch"``: which implementation ``cope`` (and the encoding) uses for these inputs.

    Raises:
        ValueError: ``HF_POSENC_BACKEND`` names no backend, or names ``triton`` and the kernel cannot run.
    """

    static = None if causal else (
        "the CoPE kernels are causal; the bidirectional ViT variant (raster-order counts in both "
        "directions) runs on the PyTorch reference"
    )
    static = static or flag_unsupported("cope", need_weights, dropout, training)

    def reason() -> str | None:
        return static or triton_unsupported(q, k, v, mask, q_offset, need_weights, dropout, training)

    return choose(reason, q.device.type == "cuda", "cope", static)


def cope(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, mask: torch.Tensor | None,
         scale: float, q_offset: int | torch.Tensor = 0, window: int | None = None, sink: int | None = None
         ) -> torch.Tensor:
    """Causal CoPE attention (see ``hf_posenc/encodings/cope.py`` for the formula): fused on CUDA, tile-wise
    PyTorch elsewhere.

    Args:
        q: (B, H, Lq, D); k, v: (B, Hkv, Lk, D) with H a multiple of Hkv (not expanded).
        table: (D, npos_max) position embeddings e; gets a gradient.
        mask: (B|1, 1, Lq, Lk) bool (True = may attend; padding), or None. Causality by index is applied
            in any case.
        scale: logit scale s (gates σ(s q·k); logits s q·k + q·e[p]).
        q_offset: query i is key ``q_offset + i``.
        window: None, or an int >= 1: a sliding window, query i sees only keys qi − window < j <= qi; the keys
            outside are absent as if masked (no weight, no gate). Both engines skip the key tiles outside it.
        sink: None, or an int >= 1 with a ``window``: attention sinks, the keys j < sink kept besides the band (a
            weight and a gate as any visible key); both engines visit their key tiles, not those between them and
            the window.

    Returns:
        (B, H, Lq, D) in q's dtype (computed in float32).

    Raises:
        ValueError, TypeError: bad shapes, a ``window`` or ``sink`` that is not None or an int >= 1, or a sink
            without a window.
    """
    _check(q, k, v, table, mask, q_offset)
    window = check_window(window)
    sink = check_sink(sink, window)
    if cope_backend(q, k, v, mask, q_offset) == "triton":
        from .triton_cope import cope_triton

        return cope_triton(*last_dim_contiguous(q, k, v), table, mask, scale, q_offset, window=window, sink=sink)
    return cope_torch(q, k, v, table, mask, scale, q_offset, window=window, sink=sink)


def cope_torch(q, k, v, table, mask, scale, q_offset=0, window=None, sink=None) -> torch.Tensor:
    """Causal CoPE off Triton (same arguments as `cope`, already checked): the tile-wise engine, or for a
    few queries without gradients (`FEW_QUERIES`) the whole row at once."""
    if _few_queries(q, k, v, table, q_offset):
        return cope_reference(q, k, v, table, mask, scale, q_offset, window=window, sink=sink)
    return cope_tiled(q, k, v, table, mask, scale, q_offset, window=window, sink=sink)


#: At most this many queries (a decoding step) and no gradient wanted: CoPE's row is built whole, O(Lq · Lk)
#: (gates, their reverse cumulative sum, the interpolated position logits, one softmax) by the reference, instead
#: of the tile engine's walk back from the query, which cost a decoding step of SmolLM2's shape (30 layers) some
#: 30 small ops per key tile and a copy of the reversed cache per layer.
FEW_QUERIES = 16


def _few_queries(q, k, v, table, q_offset) -> bool:
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, table))
    return (q.shape[2] <= FEW_QUERIES and not grad and isinstance(q_offset, int)
            and not torch.compiler.is_compiling())
