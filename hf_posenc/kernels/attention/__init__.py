"""Attention kernel family: FlashAttention-style attention with a position term chosen at compile time.

* ``terms/``: the term registry (`TermSpec`, `register_term`: each term's tensors, form
  and value, stated once, one module per built-in term; every engine derives from it) and `KernelTerm`, what
  an encoding hands over (``kernel_term`` on the encoding);
* ``naive.py``: `attention_reference`, the PyTorch reference of every term (float32, O(L²));
* ``triton_attention.py``: `fused_attention`, the Triton kernels (forward and backward, O(L) memory);
* ``flex.py``: `flex_attention_term`, torch's FlexAttention with the same terms as a score_mod;
* ``tiled.py``: `tiled_attention`, the tile-wise PyTorch engine (any device, O(L·block) memory): the
  default of the ``torch`` backend for every encoding with a kernel term (its paths in ``_tiles.py``,
  ``_tiled_fused.py`` and ``_tiled_function.py``).

Every entry point takes ``window`` (None, or an int >= 1: a sliding window, causal qi − window < j <= qi,
bidirectional |qi − j| < window): the reference applies it as a band mask, the tile-wise engine and the Triton
kernels never build or load the key tiles outside it, FlexAttention folds it into its block mask. And ``sink``
(None, or an int >= 1 with a window: attention sinks, the keys j < sink seen besides the band): the engines visit
the sink keys' tiles and still skip those between them and the window. And ``sink_positions`` (None or ``"text"``;
``"cache"``, causal with a Toeplitz term: a sink the window no longer covers takes the term at its cache distance
window + sink − 1 − j, StreamingLLM's, stated once in `hf_posenc.kernels._masks.CacheSinks`).

The one dispatch point is `hf_posenc.attention.posenc_attention`: the kernel when the tensors are on
CUDA, Triton imports and the encoding has a kernel term; the reference otherwise; ``HF_POSENC_BACKEND``
forces one (``triton`` on the CPU runs the kernels in Triton's interpreter when ``TRITON_INTERPRET=1`` was
set before triton was first imported; otherwise it raises a ``ValueError`` that says why).
"""

from __future__ import annotations

import functools

import torch

from .._common import KERNEL_DTYPES, MAX_HEAD_DIM, triton_import_error
from .naive import attention_reference, term_bias
from . import terms as _terms
from .terms import TERMS, KernelTerm, TermSpec, register_term
from .tiled import tiled_attention, tiled_unsupported

__all__ = [
    "FLEX_KINDS",
    "KERNEL_KINDS",
    "KernelTerm",
    "TERMS",
    "TERM_KINDS",
    "TILED_KINDS",
    "TermSpec",
    "attention_reference",
    "flex_attention_term",
    "flex_unsupported",
    "fused_attention",
    "kernel_unsupported",
    "register_term",
    "term_bias",
    "tiled_attention",
    "tiled_unsupported",
]

#: None when Triton and the kernel module import, else why not.
_triton_import_error = functools.partial(triton_import_error, "attention.triton_attention")


def kernel_unsupported(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, term: KernelTerm) -> str | None:
    """None when the Triton kernel can run these inputs here, else the reason (a sentence)."""
    err = _triton_import_error()
    if err is not None:
        return f"Triton is not available ({err}); install it with `pip install hf_posenc[triton]`"
    from .triton_attention import interpreting, stdlib_matches_mode

    spec = term.spec
    if spec.triton is None:
        return f"the {term.kind} term has no Triton branch"
    grad = torch.is_grad_enabled() and any(
        t.requires_grad for t in (query, key, value, *term.tensors.values(), term.key, term.value) if t is not None)
    for ts in spec.tensors:
        if grad and not ts.grad and term.tensors[ts.name].requires_grad:
            return f"the Triton kernel returns no gradient for the {term.kind} term's {ts.name}"
    if spec.triton_limit is not None:
        reason = spec.triton_limit(term, grad)
        if reason is not None:
            return reason
    key = term.key if term.key is not None else key
    value = term.value if term.value is not None else value
    if query.device.type != "cuda" and not interpreting():
        return (
            f"the tensors are on {query.device.type}; the Triton attention kernel needs CUDA tensors, or "
            "TRITON_INTERPRET=1 to run on the CPU in Triton's interpreter (slow, for tests)"
        )
    if not stdlib_matches_mode():
        return (
            "TRITON_INTERPRET changed after triton was first imported (Triton's library functions were built "
            "for the other mode); set TRITON_INTERPRET before importing torch, transformers or triton"
        )
    if len({query.device, key.device, value.device}) > 1:
        return "query, key and value are on different devices"
    dtypes = {query.dtype, key.dtype, value.dtype}
    if len(dtypes) > 1 or query.dtype not in KERNEL_DTYPES:
        return f"the attention kernel supports one of float32, bfloat16, float16 for q, k and v, got {sorted(map(str, dtypes))}"
    d = query.shape[-1]
    if key.shape[-1] != d or value.shape[-1] != d:
        return f"the attention kernel needs one head_dim for q, k and v, got {query.shape[-1]}, {key.shape[-1]}, {value.shape[-1]}"
    if d > MAX_HEAD_DIM:
        return f"the attention kernel supports head_dim <= {MAX_HEAD_DIM}, got {d}"
    if query.shape[1] % key.shape[1]:
        return f"query heads ({query.shape[1]}) must be a multiple of key/value heads ({key.shape[1]})"
    heads = term.num_heads
    if heads is not None and heads != query.shape[1]:
        return f"the {term.kind} term is built for {heads} heads, the queries have {query.shape[1]}"
    if query.numel() == 0 or key.numel() == 0:
        return "empty tensors"
    # offsets inside one (batch, head) slice are 32-bit in the kernels
    q_len, k_len = query.shape[2], key.shape[2]
    extent = max((q_len - 1) * max(query.stride(2), query.shape[1] * d), (k_len - 1) * max(key.stride(2), value.stride(2))) + d
    if extent >= 2**31:
        return f"a (batch, head) slice spans {extent} elements; the attention kernel addresses slices with 32-bit offsets"
    return None


def flex_unsupported(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, term: KernelTerm) -> str | None:
    """None when FlexAttention can express ``term`` for these inputs, else the reason."""
    if not term.spec.flex:
        return f"the {term.kind} term has no FlexAttention form (score_mod cannot add a value term)"
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError as exc:  # pragma: no cover - torch without flex
        return f"FlexAttention is not available ({exc})"
    key = term.key if term.key is not None else key
    value = term.value if term.value is not None else value
    tensors = [query, key, value, *term.tensors.values()]
    if query.device.type != "cuda" and torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return (
            f"FlexAttention has no backward on {query.device.type} in torch {torch.__version__.split('+')[0]}; "
            "run under torch.no_grad() or on a CUDA device"
        )
    if query.shape[-1] != key.shape[-1] or key.shape[-1] != value.shape[-1]:
        return "FlexAttention here needs one head_dim for q, k and v"
    return None


def fused_attention(query, key, value, term, **kwargs):
    """The Triton kernels; see `hf_posenc.kernels.attention.triton_attention.fused_attention`."""
    from .triton_attention import fused_attention as run

    return run(query, key, value, term, **kwargs)


def flex_attention_term(query, key, value, term, **kwargs):
    """FlexAttention with the term as a score_mod; see `hf_posenc.kernels.attention.flex.flex_attention_term`."""
    from .flex import flex_attention_term as run

    return run(query, key, value, term, **kwargs)


def __getattr__(name: str):
    """The kind lists (``TERM_KINDS``, ``KERNEL_KINDS``, ``FLEX_KINDS``, ``TILED_KINDS``), read from the term registry
    now (a term registered later takes part)."""
    if name in ("TERM_KINDS", "KERNEL_KINDS", "FLEX_KINDS", "TILED_KINDS", "TOEPLITZ_KINDS"):
        return getattr(_terms, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
