"""The tile-wise attention engine as PyTorch custom ops, so that ``torch.compile`` keeps it.

Dynamo cannot trace `hf_posenc.kernels.attention.tiled.TiledAttentionFunction` (an autograd Function that
carries a plan object and loops over tiles in Python). Registered as ``torch.library.custom_op`` s, the engine
is one opaque node in the compiled graph, forward and backward:

* ``hf_posenc::tiled_attention`` (q, k, v, mask?, key_valid?, q_offset?, term tensors, the term's kind and
  integer parameters, scale, causal, int offset, block sizes, window, sink, sink_positions, band) -> (out, lse) in
  the compute dtype (float32; float64 for float64 queries). ``register_fake`` gives the shapes from the inputs' (symbolic)
  shapes, so a compiled model that sees several lengths does not recompile per length (with ``dynamic=True``
  or ``mark_dynamic``); the loops over tiles run inside the op, not in the graph.
* ``hf_posenc::tiled_attention_backward`` (the same inputs, the forward's out and lse, dO, which term tensors
  need a gradient) -> [dq, dk, dv, *d(term tensors)]; ``register_autograd`` of the forward calls it, so the
  compiled backward keeps the engine too.

Terms cross the op boundary as a kind string, the term's tensor names joined by commas, its tensors (a list) and
its integer parameters (names and values); nothing else but ints, floats and bools.

Masks. A compiled graph cannot read a mask's values, and transformers (torch < 2.14) always builds one under
``torch.compile``. The op takes the bool mask (B|1, 1, Lq, Lk) itself and, inside (eager), checks it as
``hf_posenc.attention`` does: causal + key padding (+ the model's own window ``band``) gives the engine a
per-batch key-valid vector; any other mask (packed sequences, a custom 4D mask) runs the full-matrix
reference inside the op (``softmax(scale · q kᵀ + term bias)`` with the mask, its backward by autograd on a
recomputation), logged at debug level with the reason.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Iterator

import torch
from torch import Tensor

from ..backend import forced_backend
from ._attn_dispatch import kernel_preferred, last_dim_contiguous
from ._masks import cache_sinks as _cache_sinks, mask_key_validity
from .attention import fused_attention, kernel_unsupported
from .attention.naive import band_allowed, term_bias
from .attention.terms import KernelTerm, enter_sinks
from .attention.tiled import BLOCK_K, BLOCK_Q, TiledAttentionFunction, _Plan, tiled_unsupported

__all__ = ["tiled_attention_op"]

logger = logging.getLogger(__name__)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@contextmanager
def _autograd_inside() -> Iterator[None]:
    """The autograd dispatch keys back on inside an op's implementation (grad mode stays as it is). A custom op
    runs its implementation below them (excluded), but the engine's backward takes some term gradients by a local
    ``torch.enable_grad()`` and ``torch.autograd.grad`` (the Toeplitz terms' distance table), as does the masked
    reference's backward."""
    include, exclude = torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set()
    for key in ("AutogradFunctionality", "AutogradOther", "AutogradCPU", "AutogradCUDA"):
        if hasattr(torch._C.DispatchKey, key):
            exclude = exclude.remove(getattr(torch._C.DispatchKey, key))
    with torch._C._ForceDispatchKeyGuard(include, exclude):
        yield


class _Saved(SimpleNamespace):
    """A stand-in for an autograd ctx: the engine's forward saves into it, its backward reads from it."""

    def save_for_backward(self, *tensors: Tensor | None) -> None:
        self.saved_tensors = tensors


def _plan(kind: str, names: str, ints: str, scale: float, causal: bool,
          q_offset: int | None, block_q: int, block_k: int, window: int | None, sink: int | None = None,
          sink_positions: str | None = None) -> _Plan:
    keys = tuple(n for n in names.split(",") if n)
    params = {n: int(v) for n, v in (item.split("=") for item in ints.split(",") if item)}
    return _Plan(kind, keys, params, float(scale), bool(causal), q_offset, int(block_q), int(block_k), window, sink,
                 _cache_sinks(sink_positions, window, sink, causal))


def _resolve_mask(mask: Tensor | None, key_valid: Tensor | None, causal: bool, q_len: int, k_len: int,
                  q_offset: int | Tensor, band: int | None) -> tuple[Tensor | None, str | None]:
    """(key_valid (B|1, Lk) bool or None, None) for the engine, or (None, reason) when ``mask`` is not causal
    + key padding (+ ``band``): the reference must run."""
    if mask is None:
        return key_valid, None
    valid, reason = mask_key_validity(mask.to(torch.bool), causal, q_len, k_len, q_offset, band)
    if reason is None and key_valid is not None:
        valid = key_valid if valid is None else valid & key_valid
    return valid, reason


def _masked_reference(query: Tensor, key: Tensor, value: Tensor, mask: Tensor, term: KernelTerm, scale: float,
                      causal: bool, q_offset: int | Tensor, window: int | None, sink: int | None = None,
                      sink_positions: str | None = None) -> Tensor:
    """softmax(scale · q kᵀ + B) v (+ shaw's value term) under an arbitrary bool ``mask`` (B|1, 1, Lq, Lk) and the
    ``window`` with its ``sink`` keys (at their cache positions for ``sink_positions="cache"``), in the compute dtype;
    rows with no visible key are 0. Differentiable in every input."""
    dtype = _compute_dtype(query.dtype)
    b, h, q_len, _ = query.shape
    k_len = key.shape[2]
    groups = h // key.shape[1]
    q = query.to(dtype)
    k = key.to(dtype).repeat_interleave(groups, dim=1)
    v = value.to(dtype).repeat_interleave(groups, dim=1)
    offset = q_offset if isinstance(q_offset, int) else q_offset.to(torch.long)
    bias = term_bias(term, query, q_len, k_len, offset, cache_sinks=_cache_sinks(sink_positions, window, sink, causal))
    scores = q @ k.transpose(-1, -2)
    if term.spec.value_term is not None:  # a term with a value term (shaw): its key term is scaled with the logits
        scores = (scores + bias) * scale
    else:
        scores = scores * scale + (0.0 if bias is None else bias.to(dtype))
    allowed = mask.to(torch.bool)
    q_idx = torch.arange(q_len, device=q.device) + offset
    if causal or window is not None:
        allowed = allowed & band_allowed(q_idx, torch.arange(k_len, device=q.device), causal, window,
                                         sink)[None, None]
    probs = torch.nan_to_num(torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1), nan=0.0)
    out = probs @ v
    if term.spec.value_term is not None:
        out = out + term.spec.value_term(term.tensors, term.ints, probs, q_idx[:, None],
                                         torch.arange(k_len, device=q.device)[None, :]).to(dtype)
    return out


#: every op keeps its inputs' strides exactly (inductor passed a transposed q where the trace saw a contiguous one,
#: and the backward's gradients, empty_like of their inputs, then failed its stride check)
_EXACT = (torch.Tag.needs_exact_strides,)


@torch.library.custom_op("hf_posenc::tiled_attention", mutates_args=(), tags=_EXACT)
def _tiled_attention(
    query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, key_valid: Tensor | None,
    q_offset_tensor: Tensor | None, term: list[Tensor], kind: str, names: str, ints: str, scale: float, causal: bool, q_offset: int, block_q: int, block_k: int,
    window: int | None, sink: int | None, sink_positions: str | None, band: int | None, engine: str,
) -> tuple[Tensor, Tensor]:
    """(out (B, H, Lq, D), lse (B, H, Lq)) in the compute dtype; see the module docstring."""
    offset = q_offset_tensor if q_offset_tensor is not None else q_offset
    valid, reason = _resolve_mask(mask, key_valid, causal, query.shape[2], key.shape[2], offset, band)
    plan = _plan(kind, names, ints, scale, causal, None if q_offset_tensor is not None else q_offset,
                 block_q, block_k, window, sink, sink_positions)
    if reason is not None:
        logger.debug("hf_posenc::tiled_attention runs the full-matrix reference: %s", reason)
        with torch.no_grad():
            out = _masked_reference(query, key, value, mask, plan.term(tuple(term)), scale, causal, offset, window,
                                    sink, sink_positions)
        return out, out.new_zeros(out.shape[:-1])
    if _runs_triton(engine, query, key, value, plan.term(tuple(term))):
        with torch.no_grad():
            out = fused_attention(query, key, value, plan.term(tuple(term)), scale=scale, causal=causal,
                                  q_offset=offset, key_valid=valid, window=window, sink=sink,
                                  sink_positions=sink_positions)
        # the kernels' backward recomputes what it needs (the op's backward runs them again): no lse is kept
        dtype = _compute_dtype(query.dtype)
        return out.to(dtype).contiguous(), out.new_zeros(out.shape[:-1], dtype=dtype)
    saved = _Saved()
    q_off_t = None if q_offset_tensor is None else q_offset_tensor.to(device=query.device, dtype=torch.long).reshape(())
    with torch.no_grad():
        TiledAttentionFunction.forward(saved, query, key, value, valid, q_off_t, plan, *term)
    out, lse = saved.saved_tensors[5], saved.saved_tensors[6]
    return out, lse


@_tiled_attention.register_fake
def _(query, key, value, mask, key_valid, q_offset_tensor, term, kind, names, ints, scale, causal,
      q_offset, block_q, block_k, window, sink, sink_positions, band, engine):
    dtype = _compute_dtype(query.dtype)
    return query.new_empty(query.shape, dtype=dtype), query.new_empty(query.shape[:-1], dtype=dtype)


@torch.library.custom_op("hf_posenc::tiled_attention_backward", mutates_args=(), tags=_EXACT)
def _tiled_attention_backward(
    grad_out: Tensor, out: Tensor, lse: Tensor, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None,
    key_valid: Tensor | None, q_offset_tensor: Tensor | None, term: list[Tensor], need: list[bool], kind: str,
    names: str, ints: str, scale: float, causal: bool, q_offset: int, block_q: int,
    block_k: int, window: int | None, sink: int | None, sink_positions: str | None, band: int | None, engine: str,
) -> list[Tensor]:
    """[dq, dk, dv, *d(term)] (zeros for a term tensor that needs no gradient), in the inputs' dtypes."""
    offset = q_offset_tensor if q_offset_tensor is not None else q_offset
    valid, reason = _resolve_mask(mask, key_valid, causal, query.shape[2], key.shape[2], offset, band)
    plan = _plan(kind, names, ints, scale, causal, None if q_offset_tensor is not None else q_offset,
                 block_q, block_k, window, sink, sink_positions)
    leaves = [t.detach().requires_grad_(t.is_floating_point() and wanted)
              for t, wanted in zip((query, key, value, *term), (True, True, True, *need))]
    if reason is not None:
        grads = _recomputed_grads(lambda q, k, v, *tt: _masked_reference(
            q, k, v, mask, plan.term(tt), scale, causal, offset, window, sink, sink_positions), leaves, grad_out)
    elif _runs_triton(engine, *leaves[:3], plan.term(tuple(leaves[3:]))):  # the kernels' forward, then backward
        grads = _recomputed_grads(lambda q, k, v, *tt: fused_attention(
            q, k, v, plan.term(tt), scale=scale, causal=causal, q_offset=offset, key_valid=valid, window=window,
            sink=sink, sink_positions=sink_positions), leaves, grad_out)
    else:
        if engine == "triton":  # the forward ran the kernels: the engine's backward needs its own out and lse
            out, lse = _tiled_attention(query, key, value, mask, key_valid, q_offset_tensor, term, kind, names, ints,
                                        scale, causal, q_offset, block_q, block_k, window, sink, sink_positions, band,
                                        "torch")
        q_off_t = None if q_offset_tensor is None else q_offset_tensor.to(device=query.device,
                                                                           dtype=torch.long).reshape(())
        saved = _Saved(plan=plan, needs_input_grad=(True, True, True, False, False, False, *need))
        saved.save_for_backward(*(None if t is None else t.detach() for t in (query, key, value, valid, q_off_t, out,
                                                                               lse, *term)))
        with _autograd_inside(), torch.no_grad():
            grads = list(TiledAttentionFunction.backward(saved, grad_out))
        grads = grads[:3] + grads[6:]
    inputs = (query, key, value, *term)
    return [_grad_like(g, t, inputs) for g, t in zip(grads, inputs)]


def _runs_triton(engine: str, query: Tensor, key: Tensor, value: Tensor, term: KernelTerm) -> bool:
    """Whether the ops run the Triton kernels (``engine == "triton"``: the attention backend of the model, chosen
    when the graph was traced) for these inputs, checked here where the tensors are real. Where the kernels cannot
    run them, the tile engine does (logged at debug level), or, with ``HF_POSENC_BACKEND=triton``, a ValueError
    says why, as in eager mode. Gradients: ``term``'s tensors that require one (the backward op's leaves)."""
    if engine != "triton":
        return False
    with torch.enable_grad():
        reason = kernel_unsupported(query, key, value, term)
    if reason is None:
        return True
    if forced_backend() == "triton":
        raise ValueError(f"HF_POSENC_BACKEND=triton, but {reason}")
    logger.debug("hf_posenc::tiled_attention runs the tile engine, not the Triton kernels: %s", reason)
    return False


def _recomputed_grads(run, leaves: list[Tensor], grad_out: Tensor) -> list[Tensor | None]:
    """The gradients of ``run(*leaves)`` (its output's gradient ``grad_out``) for the leaves that require one
    (None for the others), by autograd on a recomputation of the forward."""
    with _autograd_inside(), torch.enable_grad():
        out = run(*leaves)
        wanted = [t for t in leaves if t.requires_grad]
        got = iter(torch.autograd.grad(out, wanted, grad_out.to(out.dtype), allow_unused=True))
    return [next(got) if t.requires_grad else None for t in leaves]


def _grad_like(g: Tensor | None, t: Tensor, inputs: tuple[Tensor, ...]) -> Tensor:
    """The gradient of input ``t`` as a backward op returns it: with ``t``'s strides (``torch.empty_like``, as the
    fake functions promise: a model's q, k and v are transposed views, and inductor checks the strides of a custom
    op's outputs), in ``t``'s dtype, zeros for None, never sharing storage with an input."""
    out = torch.empty_like(t)
    return out.zero_() if g is None else out.copy_(g)


def _aliases(t: Tensor, inputs: tuple[Tensor, ...]) -> bool:
    """Whether ``t`` shares storage with one of ``inputs`` (a custom op's output must not)."""
    ptr = t.untyped_storage().data_ptr()
    return any(x.untyped_storage().data_ptr() == ptr for x in inputs)


@_tiled_attention_backward.register_fake
def _(grad_out, out, lse, query, key, value, mask, key_valid, q_offset_tensor, term, need, kind, names, ints,
      scale, causal, q_offset, block_q, block_k, window, sink, sink_positions, band, engine):
    return [torch.empty_like(t) for t in (query, key, value, *term)]


_SCALARS = ("kind", "names", "ints", "scale", "causal", "q_offset", "block_q", "block_k", "window",
            "sink", "sink_positions", "band", "engine")


def _setup_context(ctx, inputs, output) -> None:
    (query, key, value, mask, key_valid, q_offset_tensor, term, *scalars) = inputs
    out, lse = output
    ctx.scalars = scalars
    ctx.n_term = len(term)
    ctx.save_for_backward(out, lse, query, key, value, mask, key_valid, q_offset_tensor, *term)


def _backward(ctx, grad_out, grad_lse):
    out, lse, query, key, value, mask, key_valid, q_offset_tensor, *term = ctx.saved_tensors
    need = [bool(n) for n in ctx.needs_input_grad[6]] if ctx.n_term else []
    grads = _tiled_attention_backward(grad_out.contiguous(), out, lse, query, key, value, mask, key_valid,
                                      q_offset_tensor, term, need, *ctx.scalars)
    dq, dk, dv, *dterm = grads
    dterm = [g if n else None for g, n in zip(dterm, need)]
    return (dq, dk, dv, None, None, None, dterm) + (None,) * len(_SCALARS)


_tiled_attention.register_autograd(_backward, setup_context=_setup_context)


def tiled_attention_op(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    term: KernelTerm,
    *,
    scale: float,
    causal: bool,
    q_offset: int | Tensor = 0,
    mask: Tensor | None = None,
    key_valid: Tensor | None = None,
    window: int | None = None,
    band: int | None = None,
    engine: str = "torch",
    sink: int | None = None,
    sink_positions: str | None = None,
) -> Tensor:
    """`hf_posenc.kernels.attention.tiled_attention` through the custom op (traceable by ``torch.compile``),
    or with ``engine="triton"`` the Triton kernels (`fused_attention`) where
    they take the inputs.

    Args:
        query: (B, H, Lq, D); key, value: (B, Hkv, Lk, D) (``term.key`` / ``term.value`` replace them when set).
        term: the position term (a kind the tile engine runs: ``terms.tiled_kinds()``).
        scale, causal, window, sink, sink_positions: as for ``tiled_attention``.
        q_offset: key index of the first query: an int or a 0-d integer tensor.
        mask: None, or a bool mask (B|1, 1, Lq, Lk) (True = attend), checked inside the op (module docstring).
        key_valid: (B|1, Lk) bool or None (False on padding keys), when the caller has already checked its mask.
        band: the model's own sliding window that ``mask`` may carry (the engine takes ``window`` for it).
        engine: ``"torch"`` (the tile engine) or ``"triton"`` (the kernels, checked inside the op; the tile engine
            where they cannot run, or a ValueError under ``HF_POSENC_BACKEND=triton``).

    Returns:
        (B, H, Lq, D) in the query's dtype.

    Raises:
        ValueError: the term does not fit the inputs (``tiled_unsupported``), or the sink options
            (``terms.enter_sinks``).
    """
    key = term.key if term.key is not None else key
    value = term.value if term.value is not None else value
    reason = tiled_unsupported(query, key, value, term)
    if reason is not None:
        raise ValueError(reason)
    off_tensor = isinstance(q_offset, Tensor)
    term.check(query, key, q_offset)
    sink, _ = enter_sinks(term, window, sink, sink_positions, causal)
    block_q = BLOCK_Q if window is None else max(64, min(BLOCK_Q, window // 2))
    names = tuple(term.tensors)
    out, _ = _tiled_attention(
        query, key, value, mask, key_valid, q_offset if off_tensor else None, list(term.tensors.values()), term.kind,
        ",".join(names), ",".join(f"{n}={int(v)}" for n, v in term.ints.items()), float(scale), bool(causal),
        0 if off_tensor else q_offset, block_q, BLOCK_K, window, sink, sink_positions, band, engine,
    )
    return out.to(query.dtype)


# -- the other tile engines: CoPE, stick-breaking, CAPE ---------------------------------------------------------
#
# Each engine is an autograd Function (``CopeTiledFunction``, ``SbaTiledFunction``, ``_CapeTiled``) whose forward
# and backward take tensors and plain Python values. One generic pair of ops runs any of them:
#
# * ``hf_posenc::engine`` (name, the present tensors (Tensor[]; which slots they fill: in the spec), spec (the plain values as one string), q_offset (SymInt))
#   -> out, the Function's forward;
# * ``hf_posenc::engine_backward`` (the same, dO, which tensors need a gradient) -> one gradient per tensor (zeros
#   where none is needed, an empty tensor for an absent one): the Function's forward again (its saved tensors:
#   O(L · block) besides q, k, v, never kept between the passes, at the price of a second forward), then its
#   backward.
#
# q_offset stays an op argument of its own (a SymInt under dynamic shapes: one graph for every cache length).

import ast  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Callable  # noqa: E402


@dataclass(frozen=True)
class EngineSpec:
    """How the tensors and the spec of an ``hf_posenc::engine`` call become the Function's forward arguments."""

    function: type
    #: (tensors, spec, q_offset) -> the forward's arguments (without ctx)
    arguments: Callable[[list, dict, int], tuple]
    #: the forward argument index of each entry of ``tensors``
    positions: Callable[[list], list[int]]
    #: (tensors, spec) -> the output's (shape, dtype)
    output: Callable[[list, dict], tuple[tuple, torch.dtype]]
    #: (tensors, spec, q_offset) -> the Triton kernel's autograd Function and its forward arguments (the same
    #: positions as ``function``'s), run instead of the engine when the call prefers it (``spec["triton"]``)
    kernel: Callable[[list, dict, int], tuple[type, tuple]] | None = None
    #: (tensors, spec, q_offset) -> why that kernel cannot run these inputs (a sentence), or None
    kernel_unsupported: Callable[[list, dict, int], str | None] | None = None


def _encode(spec: dict) -> str:
    """``spec`` (str keys; int, float, bool, str, None or list-of-int values) as one string "key=repr;..." (plain
    string formatting, which Dynamo traces; json.dumps it does not)."""
    return ";".join(f"{key}={spec[key]!r}" for key in sorted(spec))


def _decode(text: str) -> dict:
    return {key: ast.literal_eval(value) for key, value in (item.split("=", 1) for item in text.split(";") if item)}


def offset_arg(tensor: Tensor | None, q_offset: int):
    return tensor if tensor is not None else q_offset


def compiled_engine(name: str, kernel_module: str, tensors: list[Tensor | None], spec: dict,
                    q_offset: int | Tensor) -> Tensor:
    """`engine_op` for an attention engine whose tensors end with the offset's slot (CoPE's and SBA's: their
    ``tensors`` without it here): the tensor offset (a StaticCache's) goes there, and ``spec["triton"]`` says
    whether the op runs the Triton kernel of ``kernel_module`` where it takes the inputs (`kernel_preferred`)."""
    spec = {**spec, "triton": kernel_preferred(name, kernel_module, tensors[0].device)}
    return engine_op(name, [*tensors, q_offset if isinstance(q_offset, Tensor) else None], spec, q_offset)


def kernel_operands(tensors: list, q_offset: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(q, k, v, offset) for an engine's Triton kernel (`EngineSpec.kernel`) from the tensors of `compiled_engine`:
    q, k, v with a contiguous last dim, and the offset (the tensor in the last slot, else ``q_offset``) as the
    (1,) int32 tensor the kernels load."""
    from ._triton_tiles import device_offset

    q, k, v = last_dim_contiguous(*tensors[:3])
    return q, k, v, device_offset(offset_arg(tensors[-1], q_offset), q.device)


def attention_output(tensors: list, spec: dict) -> tuple[tuple, torch.dtype]:
    """`EngineSpec.output` of an attention engine whose tensors start with q, k, v: (B, H, Lq, D of v), q's dtype."""
    return (*tensors[0].shape[:3], tensors[2].shape[3]), tensors[0].dtype


_ENGINES: dict[str, EngineSpec] = {}


def register_engine(name: str, engine: "EngineSpec") -> None:
    """Called by each engine's module (kernels/cope/tiled.py, sba/tiled.py, cape/tiled.py) when it is imported, so
    that this module never imports the engines (the arrows go engines -> custom_ops)."""
    _ENGINES[name] = engine


def _engine_spec(name: str) -> "EngineSpec":
    if name not in _ENGINES:
        raise ValueError(f"no engine {name!r} is registered for hf_posenc::engine; registered: {sorted(_ENGINES)}")
    return _ENGINES[name]


def _expand(tensors: list[Tensor], spec: dict) -> list[Tensor | None]:
    """The full slot list of an engine from its present tensors (``spec["slots"]``: the slot of each)."""
    full: list[Tensor | None] = [None] * spec["n_slots"]
    for slot, t in zip(spec["slots"], tensors):
        full[slot] = t
    return full


def _engine_forward(name: str, tensors: list[Tensor], spec: dict, q_offset: int, need: list[bool]):
    """The Function's forward on a stand-in ctx (needs_input_grad from ``need``, one per present tensor):
    (ctx, out)."""
    engine = _engine_spec(name)
    full = _expand([t.detach() for t in tensors], spec)
    function, args = engine.function, engine.arguments(full, spec, q_offset)
    if _kernel_runs(name, engine, full, spec, q_offset):
        function, args = engine.kernel(full, spec, q_offset)
    needs = [False] * len(args)
    positions = engine.positions(full)
    for slot, wanted in zip(spec["slots"], need):
        needs[positions[slot]] = bool(wanted)
    saved = _Saved(needs_input_grad=tuple(needs), function=function)
    with torch.no_grad():
        out = function.forward(saved, *args)
    return saved, out


def _kernel_runs(name: str, engine: "EngineSpec", full: list, spec: dict, q_offset: int) -> bool:
    """Whether this call runs the engine's Triton kernel: preferred (``spec["triton"]``: the backend the model would
    pick in eager mode, decided when the graph was traced) and able to take the inputs, checked here where the
    tensors are real. Otherwise the tile engine runs (logged at debug level), or, with
    ``HF_POSENC_BACKEND=triton``, a ValueError says why, as in eager mode."""
    if not spec.get("triton") or engine.kernel is None:
        return False
    reason = engine.kernel_unsupported(full, spec, q_offset)
    if reason is None or reason == "empty tensors":
        return reason is None
    if forced_backend() == "triton":
        raise ValueError(f"HF_POSENC_BACKEND=triton, but {reason}")
    logger.debug("hf_posenc::engine runs the %s tile engine, not its Triton kernel: %s", name, reason)
    return False


@torch.library.custom_op("hf_posenc::engine", mutates_args=(), tags=_EXACT)
def _engine(name: str, tensors: list[Tensor], spec: str, q_offset: int) -> Tensor:
    """out of the engine ``name`` (``cope``, ``sba`` or ``cape``); see the comment above."""
    _, out = _engine_forward(name, tensors, _decode(spec), q_offset, [False] * len(tensors))
    out = out.contiguous()  # the fake's layout (the kernels return a transposed view)
    return out.clone() if _aliases(out, tuple(tensors)) else out


@_engine.register_fake
def _(name, tensors, spec, q_offset):
    spec = _decode(spec)
    shape, dtype = _engine_spec(name).output(_expand(tensors, spec), spec)
    return tensors[0].new_empty(shape, dtype=dtype)


@torch.library.custom_op("hf_posenc::engine_backward", mutates_args=(), tags=_EXACT)
def _engine_backward(grad_out: Tensor, name: str, tensors: list[Tensor], need: list[bool], spec: str,
                     q_offset: int) -> list[Tensor]:
    """One gradient per entry of ``tensors`` (zeros where ``need`` is False)."""
    spec_d = _decode(spec)
    saved, _ = _engine_forward(name, tensors, spec_d, q_offset, need)
    engine = _engine_spec(name)
    with _autograd_inside(), torch.no_grad():
        grads = saved.function.backward(saved, grad_out)
    positions = engine.positions(_expand(tensors, spec_d))
    out = []
    for t, slot, wanted in zip(tensors, spec_d["slots"], need):
        pos = positions[slot]
        g = grads[pos] if pos < len(grads) and wanted else None
        out.append(_grad_like(g, t, tuple(tensors)))
    return out


@_engine_backward.register_fake
def _(grad_out, name, tensors, need, spec, q_offset):
    return [torch.empty_like(t) for t in tensors]


def _engine_setup(ctx, inputs, output) -> None:
    name, tensors, spec, q_offset = inputs
    ctx.name, ctx.spec, ctx.q_offset = name, spec, q_offset
    ctx.save_for_backward(*tensors)


def _engine_autograd(ctx, grad_out):
    tensors = list(ctx.saved_tensors)
    need = [bool(n) and t.is_floating_point() for n, t in zip(ctx.needs_input_grad[1], tensors)]
    grads = _engine_backward(grad_out.contiguous(), ctx.name, tensors, need, ctx.spec, ctx.q_offset)
    return None, [g if n else None for g, n in zip(grads, need)], None, None


_engine.register_autograd(_engine_autograd, setup_context=_engine_setup)


def engine_op(name: str, tensors: list[Tensor | None], spec: dict, q_offset: int | Tensor) -> Tensor:
    """The engine ``name`` (``cope``, ``sba``, ``cape``) through the custom op: ``tensors`` in the slot order of
    the comment above (None for an absent one; the tensor offset, if any, in its slot), ``spec`` the plain values
    (ints, floats, bools, strings, None), ``q_offset`` the int offset (ignored when the offset slot holds a tensor)."""
    spec = {**spec, "n_slots": len(tensors), "slots": [i for i, t in enumerate(tensors) if t is not None]}
    return _engine(name, [t for t in tensors if t is not None], _encode(spec),
                   0 if isinstance(q_offset, Tensor) else q_offset)
