"""The attention function of patched models, and its registration with transformers.

``posenc_attention`` follows transformers' attention-function contract: it is called as
``fn(module, q, k, v, attention_mask, dropout=, scaling=, **kwargs)`` with q (B, H, Lq, D) and k, v
(B, Hkv, Lk, D) (grouped-query heads not expanded) and returns ``(out (B, Lq, H, D), weights | None)``.
The encoding's terms reach it through ``kwargs["posenc_ctx"]`` (a `PosContext`).

Backends of the attention itself (`attention_backend`; ``HF_POSENC_BACKEND`` in `hf_posenc.backend`):

* ``torch``: for an encoding with a kernel term, the tile-wise PyTorch engine
  (`hf_posenc.kernels.attention.tiled_attention`: online softmax over key tiles, O(L·block) memory,
  the term's gradients reduced per tile). The full-matrix references (``scaled_dot_product_attention`` with
  the encoding's score bias, or the encoding's own ``attend``) run only where the engine does not apply:
  attention dropout while training, ``output_attentions``, a mask that is not causal + key padding (packed
  sequences, a custom 4D mask; a model's own sliding window is accepted as a band and handed over as a
  number), ViT's 2D grid (the terms are 1D), and encodings without a kernel term. Under ``torch.compile`` the
  engine runs as a custom op (`hf_posenc.kernels.custom_ops`), which checks the mask's form inside (the
  compiled graph cannot read it) and runs the reference there for a mask of another form; each fallback under
  compile is logged at debug level with its reason.
  Encodings without a term inside the attention (absolute, rotary) always use SDPA.
* ``triton``: the fused kernels of `hf_posenc.kernels.attention` with the encoding's ``kernel_term``.
  Chosen by default when the tensors are on CUDA, Triton imports and the encoding has a kernel term.
* ``flex``: torch's FlexAttention with the term as a score_mod (only when forced).

This module is the one place that picks: a forced backend that cannot run these inputs raises a
``ValueError`` saying why; an unforced choice falls back to ``torch`` (attention dropout in training, a
4D mask that is not causal + key padding, ViT's 2D grid, unsupported dtype or head_dim). Attention
probabilities (``output_attentions``) always come from the eager ``torch`` path.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from .backend import forced_backend
from .encodings.base import PLAIN_CAUSAL, UNWINDOWED_MASK, PosContext, PositionEncoding, unwrap, vit_token_coords
from .kernels.attention import (
    KernelTerm,
    flex_attention_term,
    flex_unsupported,
    fused_attention,
    kernel_unsupported,
)
from .kernels.attention import _triton_import_error as _attention_triton_error
from .kernels.attention.terms import flex_kinds
from .kernels._common import compute_dtype, debug_log
from .kernels.defaults import cuda_default_backend
from .kernels._masks import band_allowed, mask_key_validity
from .kernels.attention.tiled import tiled_attention, tiled_unsupported
from .kernels.custom_ops import tiled_attention_op
from .kernels.remap import remap_attention
from .ops import expand_kv, masked_softmax

__all__ = ["ATTN_IMPLEMENTATION", "attention_backend", "posenc_attention", "register_with_transformers"]

#: The name under which hf_posenc registers with transformers' AttentionInterface and AttentionMaskInterface.
ATTN_IMPLEMENTATION = "hf_posenc"
#: query block of the causal bias path (see posenc_attention).
_QUERY_BLOCK = 128
#: query rows per step when a mask is checked for the kernels' form (causal + key padding).
_MASK_CHECK_ROWS = 1024


def attention_backend(encoding: object | None, device: torch.device | str | None = None) -> str:
    """The backend of the attention itself for ``encoding`` on ``device``: ``torch``, ``triton`` or ``flex``.

    ``torch`` for encodings without a term inside the attention (SDPA; their own ops, e.g. rotations, pick
    their kernels themselves) and under ``HF_POSENC_BACKEND=torch``. Otherwise the forced backend, or, when
    none is forced, ``triton`` if ``device`` is a CUDA device, Triton imports and the encoding has kernel
    terms (``kernel_kinds``). A call may still fall back to ``torch`` for inputs the kernels do not take,
    unless the backend is forced (see `posenc_attention`).

    Raises:
        ValueError: ``HF_POSENC_BACKEND`` names no backend, or forces ``triton``/``flex`` for an encoding
            that has no such kernel.
    """
    forced = forced_backend()
    enc = unwrap(encoding) if encoding is not None else None
    in_attention = enc is not None and (
        getattr(enc, "has_score_bias", False) or getattr(enc, "custom_attention", False)
    )
    if not in_attention or forced == "torch":
        return "torch"
    if forced is not None and forced in getattr(enc, "attention_kernels", ()):
        return "torch"  # the encoding's ``attend`` dispatches to its own kernel (sba, cope) and raises if it cannot
    kinds = tuple(getattr(enc, "kernel_kinds", ()))
    if forced == "triton" and not kinds:
        raise ValueError(
            f"HF_POSENC_BACKEND='triton': hf_posenc has no triton attention kernel for {enc.name!r}; unset "
            "HF_POSENC_BACKEND or set it to 'torch'"
        )
    if forced == "flex" and not any(kind in flex_kinds() for kind in kinds):
        raise ValueError(
            f"HF_POSENC_BACKEND='flex': hf_posenc has no flex attention kernel for {enc.name!r} (its term has no "
            "FlexAttention score_mod); unset HF_POSENC_BACKEND or set it to 'torch'"
            + (" or 'triton'" if kinds else "")
        )
    if forced is not None:
        return forced
    on_cuda = device is not None and torch.device(device).type == "cuda"
    if not (kinds and on_cuda):
        return "torch"
    default = cuda_default_backend(kinds)  # the one table of defaults (hf_posenc/kernels/defaults.py)
    if default == "triton" and _attention_triton_error() is not None:
        return "torch"
    return default


def _backend_of_forward(ctx: PosContext | None, device: torch.device) -> str:
    """`attention_backend` of ``ctx``'s encoding, decided once per forward and device (kept in ``ctx.memo``;
    a decoding step asked it in each of its layers). Eager mode only: under ``torch.compile`` at each call."""
    if ctx is None:
        return attention_backend(None, device)
    if torch.compiler.is_compiling():
        return attention_backend(ctx.encoding, device)
    key = ("attention_backend", device)
    backend = ctx.memo.get(key)
    if backend is None:
        backend = ctx.memo[key] = attention_backend(ctx.encoding, device)
    return backend


def _as_bool_mask(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """transformers hands us a bool mask (True = attend) or None; a user's 4D float mask is converted."""
    if attention_mask is None or attention_mask.dtype == torch.bool:
        return attention_mask
    return attention_mask > torch.finfo(attention_mask.dtype).min / 2


def _causal_mask(q_len: int, k_len: int, q_offset: int | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Causal mask (Lq, Lk): query i is key ``q_offset + i`` (a StaticCache has empty slots after it)."""
    q_idx = torch.arange(q_len, device=device)[:, None] + q_offset
    return q_idx >= torch.arange(k_len, device=device)[None, :]


def _full_mask(
    attention_mask: torch.Tensor | None,
    causal: bool,
    q_len: int,
    k_len: int,
    q_offset: int | torch.Tensor,
    device: torch.device,
) -> torch.Tensor | None:
    """A bool mask (B|1, 1, Lq, Lk), or None when every query sees every key.

    transformers hands over no mask when plain causal attention is enough (an empty cache, no padding).
    """
    mask = _as_bool_mask(attention_mask)
    if mask is None and causal and _needs_causal_mask(q_len, k_len, q_offset):
        mask = _causal_mask(q_len, k_len, q_offset, device)[None, None]
    return mask


def _needs_causal_mask(q_len: int, k_len: int, q_offset: int | torch.Tensor) -> bool:
    """Whether causality must be enforced by a mask: several queries, or keys past the last query (the
    empty slots of a StaticCache, whose offset is a tensor)."""
    if isinstance(q_offset, torch.Tensor):
        return True
    # a Python bool under torch.compile too (SDPA's is_causal takes no SymBool; ``bool()`` keeps one symbolic)
    return True if q_len > 1 or k_len > q_offset + q_len else False


def window_band(
    window: int, causal: bool, q_len: int, k_len: int, q_offset: int | torch.Tensor, device: torch.device,
    grid: tuple[int, int] | None = None, sink: int | None = None,
) -> torch.Tensor:
    """(1, 1, Lq, Lk) bool: the keys a sliding window of ``window`` lets each query see (query i is key
    qi = q_offset + i). Text: the kernels' own band (``naive.band_allowed``): causal, qi - window < j <= qi (its
    last ``window`` keys, itself included; as transformers' ``sliding_window_overlay``); bidirectional,
    |qi - j| < window. ViT's grid: both
    the row and the column offsets below ``window``, the CLS token seeing and seen by every token. ``sink``: the
    keys j < sink are seen besides the band (causality still applies)."""
    if grid is not None:
        coords = vit_token_coords(grid, device)
        q, k = coords[-q_len:], coords[-k_len:]
        near = ((q[:, None, 0] - k[None, :, 0]).abs() < window) & ((q[:, None, 1] - k[None, :, 1]).abs() < window)
        is_cls = torch.zeros(coords.shape[0], dtype=torch.bool, device=device)
        is_cls[0] = True
        band = near | is_cls[-q_len:, None] | is_cls[None, -k_len:]
        if sink:
            band = band | (torch.arange(k_len, device=device) < sink)[None, :]
        return band[None, None]
    q_idx = torch.arange(q_len, device=device) + q_offset
    return band_allowed(q_idx, torch.arange(k_len, device=device), causal, window, sink)[None, None]


def _windowed_mask(
    ctx: PosContext, window: int, attention_mask: torch.Tensor | None, causal: bool, q_len: int, k_len: int,
    q_offset: int | torch.Tensor, device: torch.device,
) -> torch.Tensor:
    """The attention mask (B|1, 1, Lq, Lk) bool with the sliding window applied, built once per forward for a
    given mask (the layers of an encoding share it)."""
    sink = ctx.own_sink()
    memo_key = ("window_mask", window, sink, causal, q_len, k_len, _offset_key(q_offset),
                None if attention_mask is None else (attention_mask.data_ptr(), tuple(attention_mask.shape)))
    cached = ctx.memo.get(memo_key)
    if cached is not None:
        return cached
    band = window_band(window, causal, q_len, k_len, q_offset, device, ctx.grid, sink)
    mask = _full_mask(attention_mask, causal, q_len, k_len, q_offset, device)
    if mask is None and causal:  # one query at the end of the keys: causality holds without a mask
        mask = _causal_mask(q_len, k_len, q_offset, device)[None, None]
    out = band if mask is None else mask & band
    ctx.memo[memo_key] = out
    ctx.memo[UNWINDOWED_MASK, id(out)] = mask
    return out


def _eager(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    scaling: float,
    dropout: float,
    training: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention with explicit probabilities (for ``output_attentions``), softmax in float32."""
    groups = query.shape[1] // key.shape[1]
    key, value = expand_kv(key, groups), expand_kv(value, groups)
    scores = torch.matmul(query.float(), key.float().transpose(-1, -2)) * scaling
    if bias is not None:
        scores = scores + bias
    probs = masked_softmax(scores, mask)  # rows with every key masked (left padding) give zeros
    probs = F.dropout(probs, p=dropout, training=training).to(query.dtype)
    return torch.matmul(probs, value), probs


def _bias_mask(
    ctx: PosContext, mask: torch.Tensor | None, bias: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """bias + mask as one additive float mask in ``dtype``, built once per forward (shared by all layers)."""
    if not ctx.is_shared(bias):  # a per-layer (or trained) bias: combine it afresh, see PosContext.score_bias
        out = bias.to(dtype)
        return out if mask is None else out.masked_fill(~mask, float("-inf"))
    key = ("bias_mask", bias.data_ptr(), tuple(bias.shape), None if mask is None else (tuple(mask.shape), mask.data_ptr()), dtype)
    cached = ctx.memo.get(key)
    if cached is not None:
        return cached
    out = bias.to(dtype)
    if mask is not None:
        out = out.masked_fill(~mask, float("-inf"))
    ctx.memo[key] = out
    return out


def _offset_key(q_offset: int | torch.Tensor) -> int | tuple[str, int]:
    """A memo key for ``q_offset`` that never reads a tensor's value (that would be a device sync and a graph
    break): an int is its own key; a tensor offset (a StaticCache's, cloned once per forward and shared by
    every layer) is keyed by identity within the per-forward memo."""
    return q_offset if isinstance(q_offset, int) else ("tensor", id(q_offset))


def _key_validity(
    ctx: PosContext, mask: torch.Tensor | None, causal: bool, q_len: int, k_len: int, q_offset: int | torch.Tensor,
    band: int | None = None,
) -> tuple[torch.Tensor | None, str | None]:
    """The kernels' form of ``mask``: (key_valid (B|1, Lk) bool or None, None), or (None, reason) when the
    mask is not causal (at ``q_offset``) + key padding (+ the sliding-window ``band`` the model's own window
    put in it, which the caller hands to the engine as its ``window``). Checked once per forward (memoised in
    ``ctx``).

    The check reads the mask's values (one device sync per forward, in eager mode). Under ``torch.compile``
    that read would break the graph, so there the answer is a reason (the ``torch`` engine runs the call,
    unless a backend is forced)."""
    if mask is None:
        return None, None
    if torch.compiler.is_compiling():
        return None, ("under torch.compile an attention mask's form (causal + key padding) cannot be checked "
                      "without reading it (a graph break)")
    memo_key = (
        "kernel_key_valid", mask.data_ptr(), tuple(mask.shape), mask.stride(), causal, _offset_key(q_offset), q_len,
        band,
    )
    if memo_key in ctx.memo:
        return ctx.memo[memo_key]
    result = mask_key_validity(mask, causal, q_len, k_len, q_offset, band, _MASK_CHECK_ROWS)
    ctx.memo[memo_key] = result
    return result


def _engine_term(
    backend: str, ctx: PosContext, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    mask: torch.Tensor | None,
) -> tuple[KernelTerm | None, str | None]:
    """(the encoding's ``kernel_term`` for engine ``backend`` (``triton``, ``flex`` or ``torch``, the tile-wise
    engine), None), or (None, the reason) where the encoding has none. ``mask``: the bool mask or None."""
    term = ctx.encoding("kernel_term", ctx, layer, query, key, value, mask)
    if term is None:
        where = "the 2D patch grid" if ctx.grid is not None else ctx.info.family
        return None, f"{unwrap(ctx.encoding).name!r} has no {backend} attention term on {where}"
    return term, None


def _term_unsupported(
    backend: str, ctx: PosContext, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, term: KernelTerm
) -> str | None:
    """The reason engine ``backend`` cannot run ``term`` on these inputs (a sentence), or None."""
    unsupported = {"triton": kernel_unsupported, "flex": flex_unsupported, "torch": tiled_unsupported}[backend]
    reason = unsupported(query, key, value, term)
    if reason is None and ctx.own_window() is not None and ctx.grid is not None:
        reason = "a sliding window on ViT's grid is per axis; the kernels' window is 1D"
    return reason


def _engine_attention(
    backend: str, ctx: PosContext, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, causal: bool, q_offset: int | torch.Tensor, scaling: float, dropout: float,
    training: bool,
) -> tuple[torch.Tensor | None, str | None]:
    """The one eligibility check of the engines that take the encoding's ``kernel_term`` (``triton``, ``flex`` or
    ``torch``, the tile-wise engine), and their run: (out (B, H, Lq, D), None) when ``backend`` can run this call,
    else (None, the reason: a sentence)."""
    mask = _as_bool_mask(attention_mask)
    if dropout > 0 and training:  # the engines have no attention dropout: the reference drops the probabilities
        return None, f"attention dropout ({dropout}) is not implemented by the {backend} attention"
    if mask is not None and (mask.dim() != 4 or tuple(mask.shape[-2:]) != (query.shape[2], key.shape[2])):
        return None, f"the attention mask {tuple(mask.shape)} does not fit {query.shape[2]} queries and " \
                     f"{key.shape[2]} keys"
    term, reason = _engine_term(backend, ctx, layer, query, key, value, mask)
    key_valid = None
    if reason is None:
        key_valid, reason = _key_validity(ctx, mask, causal, query.shape[2], key.shape[2], q_offset,
                                          ctx.native_window(layer))
    if reason is None:
        reason = _term_unsupported(backend, ctx, query, key, value, term)
    if reason is not None:
        return None, reason
    run = {"triton": fused_attention, "flex": flex_attention_term, "torch": tiled_attention}[backend]
    extra = {} if backend == "triton" else {"memo": ctx.memo}
    return run(query, key, value, term, scale=scaling, causal=causal, q_offset=q_offset, key_valid=key_valid,
               window=ctx.engine_window(layer), sink=ctx.own_sink(), sink_positions=ctx.own_sink_positions(),
               **extra), None


def _kernel_attention(
    backend: str, ctx: PosContext, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, causal: bool, q_offset: int | torch.Tensor, scaling: float, dropout: float,
    training: bool,
) -> torch.Tensor | None:
    """out (B, H, Lq, D) from the ``triton`` or ``flex`` backend, or None to run the reference (only when
    the backend is not forced; a forced backend that cannot run raises a ValueError with the reason)."""
    out, reason = _engine_attention(backend, ctx, layer, query, key, value, attention_mask, causal, q_offset, scaling,
                                    dropout, training)
    if reason is not None and forced_backend() is not None and reason != "empty tensors":
        raise ValueError(f"HF_POSENC_BACKEND={backend}, but {reason}")
    return out


def _tiled_torch_attention(
    ctx: PosContext, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, causal: bool, q_offset: int | torch.Tensor, scaling: float, dropout: float,
    training: bool, backend: str = "torch",
) -> torch.Tensor | None:
    """out (B, H, Lq, D) from the tile-wise PyTorch engine with the encoding's ``kernel_term``, or None where
    the engine does not apply and the full-matrix reference runs instead (documented in the module
    docstring: dropout while training, no term for this model, a mask that is not causal + key padding).
    Under ``torch.compile`` the engine's custom op, which runs the Triton kernels instead when ``backend`` is
    ``triton``."""
    if not getattr(unwrap(ctx.encoding), "kernel_kinds", ()):
        return None
    if dropout > 0 and training:
        return None  # the engine has no attention dropout: the reference drops the probabilities
    if torch.compiler.is_compiling():  # the engine as a custom op (hf_posenc.kernels.custom_ops)
        return _compiled_tiled_attention(ctx, layer, query, key, value, attention_mask, causal, q_offset, scaling,
                                         "triton" if backend == "triton" else "torch")
    return _engine_attention("torch", ctx, layer, query, key, value, attention_mask, causal, q_offset, scaling,
                             dropout, training)[0]


def _compiled_tiled_attention(
    ctx: PosContext, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, causal: bool, q_offset: int | torch.Tensor, scaling: float,
    engine: str = "torch",
) -> torch.Tensor | None:
    """Under ``torch.compile``: out (B, H, Lq, D) from the tile-wise engine as a custom op
    (`hf_posenc.kernels.custom_ops.tiled_attention_op`, one node of the graph, forward and backward), or
    None where the reference must run (logged at debug level with the reason). The mask's form is checked inside
    the op (reading it here would break the graph); a mask of another form runs the reference there. With
    ``engine="triton"`` (the model's backend on CUDA) the op runs the Triton kernels where they take the inputs
    (checked inside the op, where the tensors are real), the tile engine elsewhere."""
    mask = _as_bool_mask(attention_mask)
    term, reason = None, None
    if mask is not None and (mask.dim() != 4 or mask.shape[1] != 1
                             or tuple(mask.shape[-2:]) != (query.shape[2], key.shape[2])):
        reason = f"the kernels take no attention mask of shape {tuple(mask.shape)}"
    else:
        term, reason = _engine_term("torch", ctx, layer, query, key, value, mask)
    if reason is None:
        reason = _term_unsupported("torch", ctx, query, key, value, term)
    if reason is not None:
        debug_log(__name__, f"torch.compile: the full-matrix reference runs layer {layer}: {reason}")
        return None
    return tiled_attention_op(query, key, value, term, scale=scaling, causal=causal, q_offset=q_offset, mask=mask,
                              window=ctx.engine_window(layer), band=ctx.native_window(layer), engine=engine,
                              sink=ctx.own_sink(), sink_positions=ctx.own_sink_positions())


def _remapped_attention(
    ctx: PosContext,
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    causal: bool,
    q_offset: int | torch.Tensor,
    scaling: float,
    dropout: float,
    training: bool,
    need_weights: bool,
) -> torch.Tensor | None:
    """out (B, H, Lq, D) from the remap engine (`hf_posenc.kernels.remap`) for a rotary with a ``remap``, or with
    its own sliding ``window`` (and sinks) on a causal text model; None for any other encoding.

    A remap, or sinks at their cache positions, have no other path: inputs the engine does not take (attention
    probabilities, attention dropout while training, a static cache's tensor offset, a mask that is not causal +
    one interval of valid keys per row) raise a ValueError saying so. A plain window (its sinks at their text
    positions) on such inputs goes back to the full-matrix path with its band mask (logged at debug level)."""
    enc = unwrap(ctx.encoding)
    remap = enc.remap() if callable(getattr(enc, "remap", None)) else None
    if remap is None or not causal or ctx.grid is not None:
        return None
    reason, key_valid = None, None
    if need_weights:
        reason = "attention probabilities (output_attentions) are not computed by the remap engine"
    elif dropout > 0 and training:
        reason = "the remap engine has no attention dropout"
    elif not isinstance(q_offset, int):
        reason = "a static cache's offset is a tensor; the remap engine plans its pieces from the cache length"
    else:
        key_valid, reason = _key_validity(ctx, _as_bool_mask(attention_mask), causal, query.shape[2], key.shape[2],
                                          q_offset, ctx.native_window(layer))
    if reason is not None:
        if remap.kind is not None:
            raise ValueError(f"rope with remap={remap.kind!r}: {reason}")
        if remap.sink_positions == "cache":  # the band mask would put the sinks back at their text positions
            raise ValueError(f"rope with sink_positions='cache': {reason}")
        debug_log(__name__, f"layer {layer}: the window's band mask (full matrix) runs: {reason}")
        return None
    inputs = enc.remap_inputs(ctx, layer, query.device)
    if inputs["q_factor"] is not None:
        query = (query.to(compute_dtype(query.dtype)) * inputs["q_factor"]).to(query.dtype)
    return remap_attention(query, key, value, remap, scale=scaling, pos_q=ctx.position_ids,
                           inv_freq=inputs["inv_freq"], rotary_dim=inputs["rotary_dim"], layout=inputs["layout"], q_offset=q_offset,
                           key_valid=key_valid, band=ctx.native_window(layer))


def posenc_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    posenc_ctx: PosContext | None = None,
    posenc_layer: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention with the position terms of ``posenc_ctx`` (none when it is None).

    The one place that picks the implementation (see `attention_backend`): the fused Triton kernels
    (or FlexAttention, when forced) with the encoding's ``kernel_term``; otherwise SDPA with the score bias
    or the encoding's own ``attend``. Probabilities (``need_weights``) always come from the eager path.

    Args:
        module: the attention module; ``module.is_causal`` tells causal from bidirectional.
        query: (B, H, Lq, D); key, value: (B, Hkv, Lk, D) with H a multiple of Hkv.
        attention_mask: None, or (B|1, 1, Lq, Lk) bool (True = attend) or additive float.
        dropout: attention dropout probability (already 0 in eval).
        scaling: logit scale (default 1/sqrt(D)).
        posenc_ctx: the per-forward context built by the patched model (under a plan, the layer's, from
            `PosContext.at`).
        posenc_layer: the layer's index for its encoding (default: ``module.posenc_layer``).

    A sliding ``window`` in the encoding's config is applied as a band on the mask (`window_band`).

    Returns:
        out (B, Lq, H, D), and the probabilities (B, H, Lq, Lk) when ``posenc_ctx.need_weights`` else None.
    """
    backend = _backend_of_forward(posenc_ctx, query.device)
    b, h, q_len, d = query.shape
    k_len = key.shape[2]
    if h % key.shape[1]:
        raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({key.shape[1]})")
    scaling = d**-0.5 if scaling is None else scaling
    if posenc_ctx is not None:  # an encoding's own logit scale (nope's softmax_scale: DroPE)
        scaling = getattr(unwrap(posenc_ctx.encoding), "softmax_scale", None) or scaling
    causal = bool(getattr(module, "is_causal", False))
    layer = getattr(module, "posenc_layer", 0) if posenc_layer is None else posenc_layer
    # Index of the first query among the keys: the cache length before this forward.
    q_offset = posenc_ctx.q_offset if posenc_ctx is not None else k_len - q_len
    if posenc_ctx is not None:  # a length-scaled softmax (length_scale) is a scale of each query: every path takes it
        query = posenc_ctx.scale_queries(layer, query, k_len, _as_bool_mask(attention_mask), causal)
    # The encoding's sliding window: the references below get it as a band on the mask; the kernels and the tile
    # engine take it as a number (with the model's own, already in the mask transformers built: the narrower,
    # PosContext.engine_window) and skip the key tiles outside it.
    window = posenc_ctx.own_window() if posenc_ctx is not None else None
    training = module.training
    need_weights = bool(posenc_ctx is not None and posenc_ctx.need_weights)
    # under torch.compile the Triton kernels run inside the engine's custom op (below), which checks the mask there
    in_op = backend == "triton" and torch.compiler.is_compiling()
    # an encoding whose own path is the faster one for this call (fox_pro's and fire's CPU decoding steps)
    enc = unwrap(posenc_ctx.encoding) if posenc_ctx is not None else None
    own = isinstance(enc, PositionEncoding) and enc.skips_engines(posenc_ctx, query, key)
    if posenc_ctx is not None:  # a rotary's remapped distances, or its own window: the remap engine
        out = _remapped_attention(posenc_ctx, layer, query, key, value, attention_mask, causal, q_offset, scaling,
                                  dropout, training, need_weights)
        if out is not None:
            return out.transpose(1, 2).contiguous(), None
    if backend != "torch" and not need_weights and not in_op and not own:
        out = _kernel_attention(
            backend, posenc_ctx, layer, query, key, value, attention_mask, causal, q_offset, scaling, dropout, training,
        )
        if out is not None:
            return out.transpose(1, 2).contiguous(), None
    if posenc_ctx is not None and not need_weights and not own:
        out = _tiled_torch_attention(
            posenc_ctx, layer, query, key, value, attention_mask, causal, q_offset, scaling, dropout, training,
            backend,
        )
        if out is not None:
            return out.transpose(1, 2).contiguous(), None
    if window is not None:
        attention_mask = _windowed_mask(posenc_ctx, window, attention_mask, causal, q_len, k_len, q_offset,
                                        query.device)
    if posenc_ctx is not None and getattr(unwrap(posenc_ctx.encoding), "custom_attention", False):
        mask = _full_mask(attention_mask, causal, q_len, k_len, q_offset, query.device)
        # Whether ``mask`` is causality alone (no padding, no cache): an ``attend`` may then run is_causal kernels.
        posenc_ctx.memo[PLAIN_CAUSAL] = (
            attention_mask is None and causal and isinstance(q_offset, int) and q_offset == 0 and q_len == k_len
        )
        out, probs = posenc_ctx.encoding("attend", posenc_ctx, layer, query, key, value, mask, scaling, dropout, training)
        return out.transpose(1, 2).contiguous(), (probs.to(query.dtype) if need_weights else None)
    bias = posenc_ctx.score_bias(q_len, k_len, query.device, layer) if posenc_ctx is not None else None

    if need_weights:
        mask = _full_mask(attention_mask, causal, q_len, k_len, q_offset, query.device)
        out, probs = _eager(query, key, value, mask, bias, scaling, dropout, training)
        return out.transpose(1, 2).contiguous(), probs

    gqa = key.shape[1] != h
    if bias is None:
        mask = _as_bool_mask(attention_mask)
        is_causal = mask is None and causal and _needs_causal_mask(q_len, k_len, q_offset)
        if is_causal and not (q_len == k_len and isinstance(q_offset, int) and q_offset == 0):
            mask, is_causal = _causal_mask(q_len, k_len, q_offset, query.device)[None, None], False
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, dropout_p=dropout, is_causal=is_causal, scale=scaling, enable_gqa=gqa
        )
        return out.transpose(1, 2).contiguous(), None

    mask = _full_mask(attention_mask, causal, q_len, k_len, q_offset, query.device)
    # The query-block path slices by the offset, so it needs a Python int: a tensor offset (a StaticCache's)
    # takes the one-mask path instead (reading it would sync the device and break a compiled graph).
    if not (causal and q_len >= 2 * _QUERY_BLOCK and isinstance(q_offset, int)):
        float_mask = _bias_mask(posenc_ctx, mask, bias, query.dtype)
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=float_mask, dropout_p=dropout, scale=scaling, enable_gqa=gqa
        )
        return out.transpose(1, 2).contiguous(), None
    # Causal with a bias: split the queries into blocks and give each block only the keys it can see
    # (query i is key q_offset + i), so the fused kernel skips the masked upper triangle.
    first = q_offset
    if attention_mask is None:  # causal only: -inf is needed just above the diagonal of each block
        float_mask = _causal_block_mask(posenc_ctx, bias, query.dtype, q_len, first)
    else:
        float_mask = _bias_mask(posenc_ctx, mask, bias, query.dtype)
    outs = []
    for start in range(0, q_len, _QUERY_BLOCK):
        stop = min(start + _QUERY_BLOCK, q_len)
        k_stop = min(first + stop, k_len)
        outs.append(
            F.scaled_dot_product_attention(
                query[:, :, start:stop],
                key[:, :, :k_stop],
                value[:, :, :k_stop],
                attn_mask=float_mask[..., start:stop, :k_stop],
                dropout_p=dropout,
                scale=scaling,
                enable_gqa=gqa,
            )
        )
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def _causal_block_mask(
    ctx: PosContext, bias: torch.Tensor, dtype: torch.dtype, q_len: int, first: int
) -> torch.Tensor:
    """The float mask of the causal query-block path when no padding mask exists: the bias with -inf only
    where a block's queries meet its own later keys (the strict upper triangle of each diagonal block).
    Nothing right of a block's last key is ever read, so the rest of the upper triangle is left as is.
    A bias shared by the layers is filled in place (it is needed for nothing else), once per forward."""
    shared = ctx.is_shared(bias)
    key = ("causal_blocks", bias.data_ptr(), tuple(bias.shape), dtype)
    if shared and key in ctx.memo:
        return ctx.memo[key]
    out = bias.to(dtype)
    if out is bias and (not shared or bias.requires_grad):
        out = bias.clone()  # never write into a tensor that autograd or another layer still needs
    above = torch.ones(_QUERY_BLOCK, _QUERY_BLOCK, dtype=torch.bool, device=bias.device).triu(1)
    for start in range(0, q_len, _QUERY_BLOCK):
        stop = min(start + _QUERY_BLOCK, q_len)
        n = stop - start
        out[..., start:stop, first + start : first + stop].masked_fill_(above[:n, :n], float("-inf"))
    if shared:
        ctx.memo[key] = out
    return out


_registered = False


def register_with_transformers() -> None:
    """Register ``hf_posenc`` in transformers' AttentionInterface and AttentionMaskInterface (idempotent).

    The mask function is transformers' own ``sdpa_mask``: a bool mask, or None when plain causal (or full)
    attention needs none. Registering only adds a new name; no existing entry is changed.
    """
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, posenc_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
    _registered = True
