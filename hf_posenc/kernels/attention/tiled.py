"""Tile-wise PyTorch attention with a position term: the engine wherever the Triton kernels do not run.

Modules, along the engine's paths: this one (the entry, `tiled_attention`); ``_tiles.py`` (the call's plan,
each form's tiles: a Toeplitz term's strided views of its per-distance values from the term registry, a gate's
vector, FIRE's table cells, Shaw's buckets; the masks); ``_tiled_fused.py`` (the fused-CPU path: float masks split
at the diagonal, the key channel, Shaw's band, the subnormal flush); ``_tiled_function.py`` (the autograd
Function, the online-softmax passes, the term's gradients).

Same contract and math as the Triton kernels (``triton_attention.py``) and the reference (``naive.py``),
in plain PyTorch, on any device (CPU, MPS, CUDA without Triton). Query i is key qi = q_offset + i::

    s_ij  = scale · q_i · k_j + B_h(i, j)          (shaw: scale · q_i · (k_j + a^K_ij))
    s_ij  = −inf where masked (causal j > qi, outside the window, key j invalid)
    P     = softmax_j(s);  o_i = Σ_j P_ij v_j      (shaw: + Σ_j P_ij a^V_ij)
    backward: dS_ij = P_ij (dP_ij − Δ_i), Δ_i = dO_i · o_i; dq = scale dS k, dk = scale dSᵀ q, dv = Pᵀ dO

Tiling. The queries are split into blocks of ``block_q`` rows; each block runs against the keys it can
see (causal with an int ``q_offset``: keys up to its last query; the tiles right of the diagonal are never
built; with a sliding ``window`` and an int offset the keys from its first query's window edge on: the key
tiles left of the band are never built either, so the cost is O(Lq · (window + block_q)) per head; with
attention sinks, ``sink``, a block also visits the sink keys [0, sink), as a key range of its own when a gap
separates them from its window (``_Plan.key_ranges``; on the fused path the ranges' results merge by their
log-sum-exp), never the tiles between; at their cache positions, ``sink_positions="cache"`` with a Toeplitz term,
the tiles that hold sinks outside a row's window take the term at the sinks' cache distance instead, see below).
On the CPU in float32 (every term; Shaw when causal) each block is one
call of torch's fused CPU attention kernel (``aten::_scaled_dot_product_flash_attention_for_cpu``, which returns
the log-sum-exp) with the block's term as an additive float mask (B, H, block_q, keys seen), built from the
term's small tensors: few large products win on the CPU. Causal with an int offset and no padding or window, a
block's keys split at its diagonal square (``_block_parts``): the keys before it carry the term alone, the square
the term and the kernel's own causal mask, two calls merged by their log-sum-exp; no mask is filled with −inf
(the kernel reads a mask by its strides, so a view serves). Elsewhere (other devices, float64, shaw) the block
loops over key tiles of ``block_k`` with an online softmax (running max and sum). Every tile is computed in
float32 (float64 inputs stay float64), whatever the input dtype; the output is cast back. Memory:
O(block_q · Lk) per head for the tile, plus O(L · D) for q, k, v (k, v expanded to the query heads on the
fused-kernel path, which takes no GQA), the output and the log-sum-exp; never (B, H, Lq, Lk).

Toeplitz tiles run with their query rows reversed (row i' is query q1 − 1 − i'): the tile is then a plain
strided view of the reversed per-distance vector (``unfold``), and the lines of constant distance are its
anti-diagonals. Split at the diagonal, the far keys' mask is that view itself (no copy) and the square's one
mask per size for the call (δ = i − j on every block's square); unsplit, the view is copied into the mask.

Backward: a ``torch.autograd.Function`` saves q, k, v, the output and the log-sum-exp. FoX, padded ALiBi and
causal Shaw run the fused kernel's backward (below). When no term tensor needs a gradient (alibi, sandwich, a
frozen term): blocks split at their diagonal run the fused kernel's backward on the forward's parts; otherwise,
where some probability could be subnormal (a steep decay: ALiBi), each block runs it with the same mask
(``_subnormal_free``), and a mild term (sandwich) takes the online passes, which are faster there. Otherwise
each tile's probabilities are recomputed and the term's gradient is reduced per tile from dS, never through a
full bias:

* Toeplitz terms (``alibi``, ``kerple_log``, ``kerple_pow``, ``sandwich``, ``t5``: functions of the
  distance δ = qi − j only): forward, the per-distance values F (H, Lq + Lk − 1) are computed once from the
  term's small tensors and each tile is a strided (Toeplitz) view of them; backward, dS of each tile is
  summed along its lines of constant distance into a per-distance gradient (H, Lq + Lk − 1), and one autograd call carries
  that vector to the term's tensors (slopes, r1/r2, the sandwich table, the t5 table).
  With the sinks at their cache positions (``_Plan.cache_sinks``, `hf_posenc.kernels._masks.CacheSinks`), the
  far sinks' values are F at their cache distances W + sink − 1 − j (H, sink), computed once per call too; a tile
  that holds sink keys is its view copied with those values put where a row no longer has the sink in its window
  (``_Tile.bias``), and in backward those pairs' dS leaves the anti-diagonal sums for a per-sink sum
  (``_Tile.far_sink_grads``), carried to the term's tensors by the same autograd call.
* ``fox``: B = c[qi] − c[j]; dc_j = −Σ_i dS_ij (per key), dc_qi = Σ_j dS_ij (per query). On the CPU in
  float32 FoX runs the fused kernel both ways: a softmax row ignores its constant c[qi], so the bias is a
  per-key term c[ref] − c[j] (ref: the block's middle query) carried as one more key channel (queries carry a
  1, values a 0); the kernel's gradient of that channel is −dc_j, and Σ_j dS_ij = 0 (a row's dS sums to 0).
  Split at the diagonal, FoX needs no float mask at all. Causal ALiBi with padding or a window (int offset) is
  the same term with c[j] = −slope · j (a constant log forget gate; its channel is slope · (j − ref)), its slopes'
  gradient −Σ_j j dc_j (``_slope_channel`` says why only there; any term whose registry entry states its −s[h] · |δ|
  form, ``slope``, rides the same way). Measured (AMD EPYC, 2 threads, the L = 2048
  training step of ``benchmarks/bench_train_cpu.py``): FoX 0.89-1.00x SDPA (its last figure before, measured on
  an Intel Xeon: 1.43x), ALiBi (split, the view) 1.46x -> 1.08-1.15x.

Subnormal numbers. Where a term decays far (ALiBi, FoX), many probabilities fall below float32's smallest
normal number, and x86 CPUs compute with such numbers many times slower. The fused CPU backward therefore
never sees them: what no logit can lift above e^−87.3 is masked out (FoX: per head, the keys before the first
one any row needs are left out, c being monotone), and one shift per head lifts the rest (the gradients are
scaled back). This is a GPU's flush-to-zero, stated exactly; see ``_subnormal_free``. The exception: blocks
split at their diagonal with no term gradient (ALiBi, sandwich) run the fused backward on the forward's parts
with no flush (measured: on an AMD EPYC the kernel took no longer for a steep ALiBi head than for a mild one;
see the backward's comment).
* pair terms: their tiles (the registry entry's ``tiles``, a ``_tiles.PairTiles``). ``fire``: each tile's bias is
  rebuilt from the table, c and inv_norm (one gather of values and slopes for every head at the tile's shared
  cells); the table's gradient is a scatter of dS over the cells, c's and inv_norm's come through
  du = Σ_h dS_h · slope_h (``terms/fire.py``'s ``FireTiles``; the tile, never the full matrix).
* ``shaw`` (``terms/shaw.py``'s ``ShawTiles``): the key term gathers q · a^K (B, H, n, 2K + 1) at each pair's
  relative bucket; its gradient and the value term's bucket sums of P are scatter-added per tile into
  (B, H, n, 2K + 1). Causal on the CPU in float32, Shaw runs the fused kernel both ways instead: the keys K or
  more back share one bucket, whose q · a^K is a row constant, so only a band of K keys per row carries a mask
  term, and the value term and the corrections to the kernel's gradients come from that band's probabilities
  (``_ShawBand``).

GQA: on the online-softmax path key/value heads are never expanded (the G query heads of a group are
stacked into one product); the fused-kernel path expands them (O(L · D) per head).
Masks: causal, a sliding window (a band) and a per-batch key-valid vector (padding), the kernels' form; a row
that sees no key gives 0. A ``q_offset`` that is a 0-d tensor (StaticCache) stays a tensor (no host sync): the
causal and band masks are then computed per tile from it and no tile can be skipped (fine for decode, where Lq is small). There is no
attention dropout here: the dispatcher (hf_posenc.attention) runs the full-matrix reference when a model
trains with attention dropout. Known cost: on a CPU shared by many processes, the per-block torch ops wait
on OpenMP thread scheduling (many small parallel regions), which the single fused SDPA call does not.
"""
from __future__ import annotations

import copy

import torch
from torch.nn import functional as F

from .. import autotune
from ._tiled_fused import fused_applies
from ._tiled_function import TiledAttentionFunction
from ._tiles import _Plan
from .._masks import band_allowed
from .naive import check_window, term_bias
from . import terms as _terms
from .terms import KernelTerm, enter, enter_sinks

__all__ = ["TILED_KINDS", "TiledAttentionFunction", "tiled_attention", "tiled_unsupported"]


def __getattr__(name: str):
    """``TILED_KINDS``: the kinds the engine runs, read from the term registry now."""
    if name == "TILED_KINDS":
        return _terms.tiled_kinds()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

#: default query rows per block, and keys per tile of the online-softmax passes (512: the tile of 8 heads x 256
#: rows stays in the CPU caches; kerple's training step at L = 2048 ran 1.9x SDPA's against 2.5x with 4096 keys).
BLOCK_Q = 256
BLOCK_K = 512


def tiled_unsupported(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, term: KernelTerm) -> str | None:
    """None when `tiled_attention` takes these inputs, else the reason (a sentence)."""
    key = term.key if term.key is not None else key
    value = term.value if term.value is not None else value
    if not term.spec.tiled:
        return (f"the tile-wise attention has no {term.kind!r} term (a pair term needs its tiles: TermSpec.tiles, a "
                "_tiles.PairTiles)")
    if not all(t.is_floating_point() for t in (query, key, value)):
        return "q, k and v must be floating point"
    if len({query.device, key.device, value.device}) > 1:
        return "query, key and value are on different devices"
    if key.shape[-1] != query.shape[-1] or value.shape[-1] != query.shape[-1]:
        return "the tile-wise attention needs one head_dim for q, k and v"
    if query.shape[1] % key.shape[1]:
        return f"query heads ({query.shape[1]}) must be a multiple of key/value heads ({key.shape[1]})"
    heads = term.num_heads
    if heads is not None and heads != query.shape[1]:
        return f"the {term.kind} term is built for {heads} heads, the queries have {query.shape[1]}"
    return None


def tiled_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    term: KernelTerm,
    *,
    scale: float,
    causal: bool,
    q_offset: int | torch.Tensor = 0,
    key_valid: torch.Tensor | None = None,
    block_q: int | None = None,
    block_k: int = BLOCK_K,
    window: int | None = None,
    memo: dict | None = None,
    sink: int | None = None,
    sink_positions: str | None = None,
) -> torch.Tensor:
    """Attention with ``term``, tile by tile; same contract as ``naive.attention_reference``.

    Args:
        query: (B, H, Lq, D); key, value: (B, Hkv, Lk, D), H a multiple of Hkv (term.key / term.value
            replace them when set). Any float dtype; computed in float32 (float64 stays float64).
        term: the position term.
        scale: logit scale (applied to q . k, and to q . a^K for shaw; not to the other terms).
        causal: query i sees keys j <= q_offset + i only.
        q_offset: key index of the first query: an int, or a 0-d integer tensor (kept a tensor).
        key_valid: (B|1, Lk) bool, False on keys no query may see (padding), or None.
        block_q, block_k: query rows per block, keys per tile (>= 1). ``block_q`` None: ``BLOCK_Q``, or with a
            window ``max(64, min(BLOCK_Q, window // 2))`` (each block sees window + block_q − 1 keys; measured
            on a 1-thread CPU at L = 2048, window 256: 128 rows beat 256 by 15-30 %, see bench_window_cpu.py).
        window: None, or an int >= 1 (a sliding window): causal, query i sees keys qi − window < j <= qi;
            bidirectional, |qi − j| < window. With an int offset each query block's key loop starts at the first
            key its first query sees (and, bidirectional, stops after the last one its last query sees): the
            tiles outside the band are never built, the band is masked inside the partly covered ones. With a
            tensor offset the band is masked per tile from the tensor (no tile skipped).
        sink: None, or an int >= 1 with a ``window`` (attention sinks, StreamingLLM): the keys j < sink are seen
            besides the band (causal: by the queries at or after them). With an int offset a query block visits
            the sink keys' tiles, then its window's (one range where they touch); the tiles between are never
            built.
        sink_positions: None or ``"text"``, or ``"cache"`` (causal, a Toeplitz term): the sinks outside a row's
            window take the term at their cache distance window + sink − 1 − j (module docstring).
        memo: a per-forward dict (``PosContext.memo``): a decoding step's mask and index tensors are built once
            for all the layers that share them (`FEW_QUERIES`).

    Returns:
        (B, H, Lq, D) in the query's dtype; rows without any visible key are 0.

    Raises:
        ValueError: the term does not fit the inputs (see `tiled_unsupported`), bad block sizes, a
            window or sink below 1, a sink without a window, or ``sink_positions`` the call cannot take
            (``terms.enter_sinks``).
        TypeError: ``window`` or ``sink`` is not an int (or None), or ``q_offset`` is neither an int nor a
            tensor.
    """
    reason = tiled_unsupported(query, key, value, term)
    if reason is not None:
        raise ValueError(reason)
    off_tensor = isinstance(q_offset, torch.Tensor)
    key, value, window = enter(query, key, value, term, 0 if off_tensor else q_offset, window, check_window)
    sink, cache = enter_sinks(term, window, sink, sink_positions, causal)
    if block_q is None:
        block_q = BLOCK_Q if window is None else max(64, min(BLOCK_Q, window // 2))
    if not (isinstance(block_q, int) and isinstance(block_k, int) and block_q >= 1 and block_k >= 1):
        raise ValueError(f"block_q and block_k must be positive ints, got {block_q!r}, {block_k!r}")
    if not off_tensor and not isinstance(q_offset, int):
        raise TypeError(f"q_offset must be an int or a 0-d tensor, got {type(q_offset).__name__}")
    if _few_queries_apply(query, key, value, term, q_offset):
        return _few_queries(query, key, value, term, float(scale), bool(causal), q_offset, key_valid, window, memo,
                            sink, cache)
    names = tuple(term.tensors)
    plan = _Plan(term.kind, names, dict(term.ints), float(scale), bool(causal),
                 None if off_tensor else q_offset, block_q, block_k, window, sink, cache)
    valid = None if key_valid is None else key_valid.to(device=query.device, dtype=torch.bool)
    q_off_t = q_offset.to(device=query.device, dtype=torch.long).reshape(()) if off_tensor else None
    tensors = tuple(term.tensors.values())
    compute = torch.float64 if query.dtype == torch.float64 else torch.float32
    if fused_applies(plan, query.device, compute):
        plan.fused = _choose_path(query, key, value, valid, q_off_t, plan, tensors) == "fused"
    return TiledAttentionFunction.apply(query, key, value, valid, q_off_t, plan, *tensors)


#: At most this many queries (a decoding step, a short chunk after a cache) and no gradient wanted: the term's
#: values for those rows are O(Lq · Lk) only, so one fused SDPA call with them as its float mask replaces the tile
#: machinery (plan, tiles, a split at the diagonal, per-block kernel calls), which cost a decoding step more than the
#: attention itself (30 layers of SmolLM2's shape: 2 fused-kernel calls and 15 copies per layer and token).
FEW_QUERIES = 16


def _few_queries_apply(query, key, value, term, q_offset) -> bool:
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value, *term.tensors.values()))
    return (query.shape[2] <= FEW_QUERIES and not grad and isinstance(q_offset, int)
            and term.spec.value_term is None and term.spec.prepare is None)


def _sees_every_key(q_len: int, k_len: int, q_offset: int, causal: bool, window: int | None) -> bool:
    """Whether each query i (key index q_offset + i) may see every key by position: causal, the first query is at
    or past the last key; with a window, the farthest key is nearer than ``window``."""
    if causal and q_offset < k_len - 1:
        return False
    return window is None or window > max(q_offset + q_len - 1, k_len - 1 - q_offset)


def _few_queries(query, key, value, term, scale, causal, q_offset, key_valid, window, memo=None,
                 sink=None, cache_sinks=None) -> torch.Tensor:
    """A few queries without gradients: softmax(scale · q kᵀ + B) v by one SDPA call (grouped heads not expanded),
    B the term's values for these rows (its registry entry, `naive.term_bias`; ``cache_sinks``: the far sinks at
    their cache distance) plus 0 / −inf where a key
    is visible / masked; rows that see no key are 0, as the tiles give them. Computed in float32 (float64 stays
    float64). With ``memo`` (per forward) the 0 / −inf mask and the index tensors are built once for the layers
    that share sizes, offset, window, sinks and key padding (the same ``key_valid`` tensor)."""
    compute = torch.float64 if query.dtype == torch.float64 else torch.float32
    b, h, q_len, _ = query.shape
    k_len = key.shape[2]
    bias = _layer_shared_bias(term, query, q_len, k_len, q_offset, memo, cache_sinks)
    mkey = ("few_queries_mask", q_len, k_len, q_offset, causal, window, sink, compute, query.device)
    entry = None if memo is None else memo.get(mkey)
    if entry is not None and entry[0] is key_valid:
        neg, empty = entry[1], entry[2]
    elif key_valid is None and _sees_every_key(q_len, k_len, q_offset, causal, window):
        neg = empty = None  # every query sees every key (a decoding step at the end of the keys): no mask at all
        if memo is not None:
            memo[mkey] = (key_valid, neg, empty)
    else:
        q_idx = torch.arange(q_len, device=query.device) + q_offset
        allowed = band_allowed(q_idx, torch.arange(k_len, device=query.device), causal, window, sink)[None, None]
        if key_valid is not None:
            allowed = allowed & key_valid.to(device=query.device, dtype=torch.bool)[:, None, None, :]
        empty = ~allowed.any(-1, keepdim=True)  # (B|1, 1, Lq, 1)
        allowed = allowed | empty  # an empty row attends everywhere (finite), then is zeroed
        neg = torch.zeros(allowed.shape, dtype=compute, device=query.device).masked_fill_(~allowed, float("-inf"))
        if memo is not None:
            memo[mkey] = (key_valid, neg, empty)  # key_valid kept: the identity check above stays sound
    if neg is None:
        mask = None if bias is None else bias.to(compute)
    else:
        mask = neg if bias is None else bias.to(compute) + neg  # x + 0 = x; x + (−inf) = −inf
    out = F.scaled_dot_product_attention(query.to(compute), key.to(compute), value.to(compute), attn_mask=mask,
                                         scale=scale, enable_gqa=key.shape[1] != h)
    out = out if empty is None else out.masked_fill(empty, 0.0)  # no host read of ``empty``
    return out.to(query.dtype)


def _layer_shared_bias(term, query, q_len, k_len, q_offset, memo, cache_sinks=None) -> torch.Tensor | None:
    """`term_bias` of ``term``, reused from the previous layer of this forward when that layer's term held the
    very same tensors (storage, shape, strides and version: a bias shared by the layers, e.g. ALiBi's slopes, a shared
    KERPLE kernel or T5 table, Sandwich's table); a decoding step otherwise evaluates the same term in every layer.
    ``memo`` (per forward) keeps the last such bias only, with the tensors it was built from (so no other tensor can
    take their address meanwhile); terms with a ``prepare`` step (they read the queries) are evaluated afresh."""
    if memo is None or term.spec.prepare is not None:
        return term_bias(term, query, q_len, k_len, q_offset, memo, cache_sinks)
    tensors = tuple(term.tensors.values())
    signature = (term.kind, tuple(sorted(term.ints.items())), q_len, k_len, q_offset, query.shape[1], cache_sinks,
                 tuple((t.data_ptr(), t.shape, t.stride(), t.dtype, t.device, t._version) for t in tensors))
    last = memo.get("few_queries_shared_bias")
    if last is not None and last[0] == signature:
        return last[2]
    bias = term_bias(term, query, q_len, k_len, q_offset, memo, cache_sinks)
    memo["few_queries_shared_bias"] = (signature, tensors, bias)
    return bias


#: The two exact CPU paths of the tile engine: torch's fused attention kernel per query block (with the term as
#: its float mask, split at the diagonal where it can be), or the online-softmax passes over batched-matmul tiles.
#: The fused kernel was the faster on an AMD EPYC VM and, through its backward per tile, the slower on an Intel
#: Xeon with AVX-512/AMX (DESIGN.md): the autotuner times both on first use per CPU and shape class.
autotune.register_site("tiled.engine", ("fused", "online"), default="fused",
                       help="the tile engine on the CPU: torch's fused kernel per block, or the online passes")


def _choose_path(query, key, value, valid, q_off_t, plan, tensors) -> str:
    """``fused`` or ``online`` for this call: `hf_posenc.kernels.autotune.choose`, timing a forward (and,
    when gradients flow, a backward) of each path on detached copies of these very inputs."""
    train = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value, *tensors))
    b, h, q_len, d = query.shape
    keys = ("full" if plan.window is None else "window" if plan.sink is None
            else "sink" if plan.cache_sinks is None else "cache_sink")
    case = (f"{plan.kind}-{'causal' if plan.causal else 'bidir'}-{'masked' if valid is not None else 'dense'}-{keys}-"
            f"{'train' if train else 'infer'}-"
            + autotune.shape_class(B=b, H=h, Hkv=key.shape[1], Lq=q_len, Lk=key.shape[2], D=d))

    def run(path: str) -> None:
        trial = copy.copy(plan)
        trial.fused = path == "fused"
        with torch.enable_grad() if train else torch.no_grad():
            args = [t.detach().requires_grad_(train and t.is_floating_point()) for t in (query, key, value)]
            extra = [t.detach().requires_grad_(t.requires_grad and train) for t in tensors]
            out = TiledAttentionFunction.apply(*args, valid, q_off_t, trial, *extra)
            if train:
                out.backward(torch.ones_like(out))

    return autotune.choose("tiled.engine", case, run, device=query.device, dtype=query.dtype)
