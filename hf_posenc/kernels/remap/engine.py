"""The remap engine: causal attention with remapped rotary distances (or a window with sinks) in O(L·block)
memory, forward and backward.

Each piece of the remap (`Case`) is one softmax attention of re-rotated queries over re-rotated keys, restricted
to the keys where the piece holds; the pieces of a query block are merged by their log-sum-exp (as ChunkLlama and
vLLM merge DCA's three flash calls). The keys the engine receives are rotated at their own positions, as the
unpatched model caches them; a piece that needs another key position re-rotates them by the difference
(R(a)R(b) = R(a + b)), O(L·D) per piece and forward, so the KV cache holds what the unpatched model's does and
decoding needs nothing else.

Per piece, the keys it holds on form one interval per query (`Case.span`), so nothing is L × L. The backward
recomputes the pieces and hands each the merged output and log-sum-exp, so the fused backward's probabilities
exp(s − lse) are the merged softmax's: the pieces' gradients add up to the exact one, then turn back through their
rotations (R(δ)ᵀ = R(−δ)).

The engine is a pair of custom ops (``hf_posenc::remap_attention`` and its backward), which ``torch.compile``
keeps as nodes of its graph (``fullgraph=True`` too). Inside, each call of a piece runs:

* on CUDA (and with ``HF_POSENC_BACKEND=triton``, in Triton's interpreter on the CPU), hf_posenc's Triton kernels
  (`hf_posenc.kernels.remap.triton_span`): one launch per piece over every query row's interval of keys, forward
  (out and log-sum-exp, merged here) and backward (dQ, and dK/dV per key tile); the kind ``"remap"`` of
  `hf_posenc.kernels.defaults.CUDA_DEFAULT_BACKEND` (``HF_POSENC_BACKEND=torch`` turns it off);
* on the CPU, torch's fused flash attention (`hf_posenc.kernels._cpu_flash`) per query block, the columns every
  query of the block sees unmasked, the two edges (at most a block wide each) with a small mask;
* elsewhere (float64 on CUDA, a torch without the CPU kernel) the same calls from their (block × keys) logits in
  PyTorch, the same O(L·block) memory.

Rows whose valid keys are one interval (left padding, right padding, a static cache's empty slots) are taken;
padding between real tokens is refused.
"""

from __future__ import annotations

import functools

import torch

from ...ops import eager_value_checks, expand_kv
from .._attn_dispatch import choose, common_unsupported
from .._cpu_flash import FLASH_BACKWARD, FLASH_FORWARD
from ..rotary.naive import rotate_leading
from .cases import Case, Remap
from .naive import rotation_tables

__all__ = ["remap_attention", "DEFAULT_BLOCK"]

#: query rows per block: the fused kernel's calls grow with L / block; the masked edges with block.
DEFAULT_BLOCK = 512


def _fused(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and FLASH_FORWARD is not None and dtype in (torch.float32, torch.bfloat16,
                                                                           torch.float64)


def _rerotate(x: torch.Tensor, delta: torch.Tensor | None, inv_freq: torch.Tensor, rotary_dim: int, layout: str
              ) -> torch.Tensor:
    """x (B, H, L, D) rotated further by the angles of ``delta`` (B|1, L) float (None: x itself)."""
    if delta is None:
        return x
    cos, sin = rotation_tables(delta[:, None], inv_freq, x.dtype)
    return rotate_leading(x, cos, sin, rotary_dim, layout)


def _deltas(case: Case, pos_q: torch.Tensor, pos_k: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    dq = None if case.q_pos is None else case.q_pos(pos_q).to(torch.float64) - pos_q
    dk = None if case.k_pos is None else case.k_pos(pos_k).to(torch.float64) - pos_k
    return dq, dk


class _Plan:
    """The calls of one forward: per query block, per piece, (key start, key stop, mask or None). Every interval's
    bounds are computed on the device and read back at once (one host sync per forward, not one per block)."""

    def __init__(self, remap: Remap, pos_q: torch.Tensor, lq: int, lk: int, q_offset: int, start: torch.Tensor,
                 stop: torch.Tensor | None, block: int, device: torch.device, band: int | None,
                 blocks: bool = True) -> None:
        self.cases = remap.cases()
        qi = torch.arange(lq, device=device) + q_offset  # (Lq,)
        #: per piece, each query row's keys [lo, hi) (B|1, Lq) int64, empty where hi == lo
        self.spans: list[tuple[torch.Tensor, torch.Tensor]] = []
        for case in self.cases:
            lo, hi = case.span(pos_q, qi.expand_as(pos_q))
            lo = torch.maximum(lo, start[:, None])  # the row's valid keys: [start, stop)
            if stop is not None:
                hi = torch.minimum(hi, stop[:, None])
            if band is not None:  # the model's own sliding window
                lo = torch.maximum(lo, qi - band + 1)
            lo = lo.clamp(0, lk)
            hi = torch.minimum(hi, qi + 1).clamp(0, lk)  # causal (a span never passes the query itself)
            lo, hi = torch.broadcast_tensors(lo, hi)
            self.spans.append((torch.where(hi <= lo, hi, lo), hi))
        #: per query block: (first row, stop, per piece its calls (key start, key stop, mask or None)); only for
        #: the engine's PyTorch calls (``blocks``), the Triton kernels take the spans
        self.blocks: list[tuple[int, int, list[list[tuple[int, int, torch.Tensor | None]]]]] = []
        if not blocks:
            return
        starts = list(range(0, lq, block))
        stats = [self._stats(lo[:, q0 : q0 + block], hi[:, q0 : q0 + block], lk)
                 for q0 in starts for lo, hi in self.spans]
        numbers = torch.stack(stats).tolist() if stats else []  # the one read of the bounds
        per_block = len(self.cases)
        for b, q0 in enumerate(starts):
            calls = [self._calls(lo[:, q0 : q0 + block], hi[:, q0 : q0 + block], *numbers[b * per_block + c])
                     for c, (lo, hi) in enumerate(self.spans)]
            self.blocks.append((q0, min(q0 + block, lq), calls))

    @staticmethod
    def _stats(lo: torch.Tensor, hi: torch.Tensor, lk: int) -> torch.Tensor:
        """(smallest and largest lo, smallest and largest hi over the rows that see a key, every row empty, some row
        empty) as one int64 tensor."""
        empty = hi <= lo
        live = ~empty
        big = torch.full_like(lo, lk + 1)
        return torch.stack([torch.where(live, lo, big).amin(), torch.where(live, lo, -1).amax(),
                            torch.where(live, hi, big).amin(), torch.where(live, hi, -1).amax(),
                            empty.all().long(), empty.any().long()])

    @staticmethod
    def _calls(lo: torch.Tensor, hi: torch.Tensor, l0: int, l1: int, h0: int, h1: int, all_empty: int,
               any_empty: int) -> list[tuple[int, int, torch.Tensor | None]]:
        """The calls covering keys lo <= j < hi per row (B|1, n): the columns all rows see unmasked, the rest
        masked (bool (B|1, 1, n, m))."""
        if all_empty:
            return []

        def masked(a: int, b: int) -> tuple[int, int, torch.Tensor]:
            j = torch.arange(a, b, device=lo.device)
            return a, b, ((j >= lo[..., None]) & (j < hi[..., None]))[:, None]

        if not any_empty and l1 < h0:
            out = [(l1, h0, None)]
            if l0 < l1:
                out.append(masked(l0, l1))
            if h0 < h1:
                out.append(masked(h0, h1))
            return out
        return [masked(l0, h1)]


@functools.lru_cache(maxsize=1)
def _fused_takes_gqa() -> bool:
    """Whether torch's fused CPU attention takes fewer key/value heads than query heads (grouped-query), forward
    and backward, with the results of expanded keys: probed once on a tiny case (torch 2.13 does)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 3, 4, generator=g) for h in (4, 2, 2))
    try:
        out, lse = FLASH_FORWARD(q, k, v, 0.0, False, scale=0.5)
        ref, ref_lse = FLASH_FORWARD(q, expand_kv(k, 2), expand_kv(v, 2), 0.0, False, scale=0.5)
        grads = FLASH_BACKWARD(out, q, k, v, out, lse, 0.0, False, scale=0.5)
        ref_grads = FLASH_BACKWARD(ref, q, expand_kv(k, 2), expand_kv(v, 2), ref, ref_lse, 0.0, False, scale=0.5)
    except RuntimeError:
        return False
    reduced = [ref_grads[0]] + [x.view(1, 2, 2, 3, 4).sum(2) for x in ref_grads[1:]]
    return (torch.allclose(out, ref, atol=1e-6) and all(a.shape == b.shape and torch.allclose(a, b, atol=1e-5)
                                                       for a, b in zip(grads, reduced)))


def _float_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def _attend(q, k, v, mask, scale):
    """(out (B, H, n, D), lse (B, H, n) float32 or float64; −inf where a row sees no key) of one call; k, v
    (B, Hkv, m, D) with H a multiple of Hkv."""
    groups = q.shape[1] // k.shape[1]
    if _fused(q.device, q.dtype):
        if groups > 1 and not _fused_takes_gqa():
            k, v = expand_kv(k, groups), expand_kv(v, groups)
        out, lse = FLASH_FORWARD(q, k, v, 0.0, False, attn_mask=_float_mask(mask, q.dtype), scale=scale)
        if mask is not None:  # the kernel gives a row with no key lse 0
            lse = lse.masked_fill(~mask.any(-1), float("-inf"))
        return out, lse
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    s = (q.to(work) @ expand_kv(k, groups).to(work).transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.masked_fill(torch.isinf(lse), 0.0)[..., None])
    return (p @ expand_kv(v, groups).to(work)).to(q.dtype), lse


def _reduce_groups(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """(B, H, m, D) gradients of expanded keys or values -> (B, Hkv, m, D), summed over each group."""
    b, h, m, d = x.shape
    return x if h == hkv else x.view(b, hkv, h // hkv, m, d).sum(2)


def _attend_backward(do, q, k, v, out, lse, mask, scale):
    """(dq, dk, dv) of one call (dk, dv with k's heads), given the merged ``out`` and ``lse`` (+inf where a row
    sees no key at all)."""
    hkv, groups = k.shape[1], q.shape[1] // k.shape[1]
    if _fused(q.device, q.dtype):
        expand = groups > 1 and not _fused_takes_gqa()
        ke, ve = (expand_kv(k, groups), expand_kv(v, groups)) if expand else (k, v)
        lse = lse.to(torch.float32 if q.dtype != torch.float64 else q.dtype)
        dq, dk, dv = FLASH_BACKWARD(do, q, ke, ve, out, lse, 0.0, False, attn_mask=_float_mask(mask, q.dtype),
                                    scale=scale)
        return dq, _reduce_groups(dk, hkv), _reduce_groups(dv, hkv)
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    qw, kw, vw, dow = q.to(work), expand_kv(k, groups).to(work), expand_kv(v, groups).to(work), do.to(work)
    s = (qw @ kw.transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.exp(s - lse[..., None])
    dv = p.transpose(-1, -2) @ dow
    dp = dow @ vw.transpose(-1, -2)
    delta = (dow * out.to(work)).sum(-1, keepdim=True)
    ds = p * (dp - delta) * scale
    return ((ds @ kw).to(q.dtype), _reduce_groups(ds.transpose(-1, -2) @ qw, hkv).to(k.dtype),
            _reduce_groups(dv, hkv).to(v.dtype))


def _pieces(q, k, plan, deltas, inv_freq, rotary_dim, layout):
    """Per piece: its queries (B, H, Lq, D) and keys (B, Hkv, Lk, D) re-rotated."""
    return [(_rerotate(q, dq, inv_freq, rotary_dim, layout), _rerotate(k, dk, inv_freq, rotary_dim, layout))
            for dq, dk in deltas]


def _positions(pos_q: torch.Tensor, key_valid: torch.Tensor | None, q_offset: int, lk: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(query positions (B|1, Lq), key positions (B|1, Lk), the first valid key per row (B|1,), the end of the valid
    keys per row (B|1,) or None) from the queries' positions and the key padding; ``ValueError`` where they are not
    what the engine takes (checked on CPU tensors: reading them is a host sync per layer on CUDA, where the Triton
    path otherwise needs none; `hf_posenc.ops.eager_value_checks`).

    Each row's valid keys must be one interval: padding first (left padding, as transformers pads for generation),
    last (right padding in training, a static cache's empty slots), or both. The row's positions run on with the
    cache index over its real queries; they are read at its last real query (a padding query's position is
    arbitrary: transformers gives them 1)."""
    device = pos_q.device
    lq = pos_q.shape[1]
    check = eager_value_checks(pos_q)  # the checks below read values: on the CPU only (on CUDA, a host sync)
    index = torch.arange(lq, device=device)[None, :] + q_offset
    keys = torch.arange(lk, device=device)[None, :]
    if key_valid is None:
        start, stop = torch.zeros(1, dtype=torch.long, device=device), None
        ref = torch.full((1, 1), lq - 1, device=device)
    else:
        start = (~key_valid).long().cumprod(-1).sum(-1)  # leading invalid keys per row
        stop = lk - (~key_valid).long().flip(-1).cumprod(-1).sum(-1)  # one past the last valid key
        if check and not torch.equal((keys >= start[:, None]) & (keys < stop[:, None]),
                                     key_valid.expand(start.shape[0], lk)):
            raise ValueError("the remap engine takes one interval of valid keys per row (padding first or last), "
                             "not padding between real tokens")
        ref = (stop[:, None] - 1 - q_offset).clamp(0, lq - 1)  # the row's last real query
    rows = max(pos_q.shape[0], ref.shape[0])
    ref = ref.expand(rows, 1)
    shift = ref + q_offset - pos_q.expand(rows, lq).gather(1, ref)  # (B|1, 1): cache index minus position
    real = index >= start[:, None] if stop is None else (index >= start[:, None]) & (index < stop[:, None])
    runs_on, real, index_b = torch.broadcast_tensors(pos_q + shift, real, index)
    if check and not torch.equal(runs_on[real], index_b[real]):
        raise ValueError("the remap engine needs positions that run on with the cache index in each row (no packed "
                         "sequences or position resets)")
    return index - shift, keys - shift, start, stop


def _remap_of(kind: str, window: int, group: int | None, chunk: int | None, sink: int | None,
              sink_positions: str) -> Remap:
    return Remap(kind or None, window, group=group, chunk=chunk, sink=sink, sink_positions=sink_positions)


def _setup(q, k, v, pos_q, key_valid, inv_freq, remap, q_offset, rotary_dim, layout, block, band, triton_path):
    pos_q, pos_k, start, stop = _positions(pos_q.to(torch.long), key_valid, q_offset, k.shape[2])
    plan = _Plan(remap, pos_q, q.shape[2], k.shape[2], q_offset, start, stop, block, q.device, band,
                 blocks=not triton_path)
    deltas = [_deltas(case, pos_q, pos_k) for case in plan.cases]
    return plan, deltas, _pieces(q, k, plan, deltas, inv_freq, rotary_dim, layout)


def _triton_unsupported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """The reason the Triton kernels (`triton_span`) cannot run these inputs, or None."""
    return common_unsupported("remap", "remap.triton_span", q, k, v, None, 0, False, 0.0, False)


def _use_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str) -> bool:
    """Whether this call runs the Triton kernels. ``backend`` ``"triton"`` or ``"torch"`` decides (a ``ValueError``
    naming the reason where the kernels cannot run); ``""`` leaves it to ``HF_POSENC_BACKEND`` (``triton`` likewise
    raises), or with none forced, to the kind's CUDA default (`defaults.CUDA_DEFAULT_BACKEND["remap"]`) for CUDA
    tensors the kernels take. Otherwise the engine's PyTorch calls (torch's fused CPU attention on the CPU)."""
    if backend == "torch":
        return False
    if backend == "triton":
        why = _triton_unsupported(q, k, v)
        if why is not None:
            raise ValueError(f"backend='triton', but {why}")
        return True
    return choose(lambda: _triton_unsupported(q, k, v), q.device.type == "cuda", "remap") == "triton"


def _merge(acc: torch.Tensor | None, lse: torch.Tensor | None, o: torch.Tensor, l: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Two softmax attentions over disjoint keys merged by their log-sum-exp (−inf: no key)."""
    if acc is None:
        return o, l
    merged = torch.logaddexp(lse, l)
    wa = torch.exp(lse - merged).nan_to_num(0.0)[..., None]
    wb = torch.exp(l - merged).nan_to_num(0.0)[..., None]
    return acc * wa + o * wb, merged


def _int32(spans: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(lo.to(torch.int32).contiguous(), hi.to(torch.int32).contiguous()) for lo, hi in spans]


_EXACT = (torch.Tag.needs_exact_strides,)


@torch.library.custom_op("hf_posenc::remap_attention", mutates_args=(), tags=_EXACT)
def _remap_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos_q: torch.Tensor, key_valid: torch.Tensor | None,
    inv_freq: torch.Tensor, kind: str, window: int, group: int | None, chunk: int | None, sink: int | None,
    sink_positions: str, scale: float, q_offset: int, rotary_dim: int, layout: str, block: int, band: int | None,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, H, Lq, D) in q's dtype, lse (B, H, Lq) in the compute dtype, −inf where a row sees no key)."""
    remap = _remap_of(kind, window, group, chunk, sink, sink_positions)
    triton_path = _use_triton(q, k, v, backend)
    plan, _, pieces = _setup(q, k, v, pos_q, key_valid, inv_freq, remap, q_offset, rotary_dim, layout, block,
                             band, triton_path)
    if triton_path:
        from .triton_span import span_forward

        acc, lse = None, None
        for (qc, kc), (lo, hi) in zip(pieces, _int32(plan.spans)):
            acc, lse = _merge(acc, lse, *span_forward(qc, kc, v, lo, hi, scale))
        return acc.to(q.dtype), lse
    b, h, lq, _ = q.shape
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.zeros(b, h, lq, v.shape[-1], dtype=q.dtype, device=q.device)
    lse_all = torch.full((b, h, lq), float("-inf"), dtype=work, device=q.device)
    for q0, q1, per_case in plan.blocks:
        acc, lse = None, None
        for (qc, kc), calls in zip(pieces, per_case):
            for a, z, mask in calls:
                o, l = _attend(qc[:, :, q0:q1], kc[:, :, a:z], v[:, :, a:z], mask, scale)
                acc, lse = _merge(acc, lse, o.to(work), l.to(work))
        if acc is not None:
            out[:, :, q0:q1] = acc.to(q.dtype)
            lse_all[:, :, q0:q1] = lse
    return out, lse_all


@_remap_forward.register_fake
def _(q, k, v, pos_q, key_valid, inv_freq, kind, window, group, chunk, sink, sink_positions, scale, q_offset,
      rotary_dim, layout, block, band, backend):
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty((*q.shape[:-1], v.shape[-1])), q.new_empty(q.shape[:-1], dtype=work)


@torch.library.custom_op("hf_posenc::remap_attention_backward", mutates_args=(), tags=_EXACT)
def _remap_backward(
    do: torch.Tensor, out: torch.Tensor, lse_all: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    pos_q: torch.Tensor, key_valid: torch.Tensor | None, inv_freq: torch.Tensor, kind: str, window: int,
    group: int | None, chunk: int | None, sink: int | None, sink_positions: str, scale: float, q_offset: int,
    rotary_dim: int, layout: str, block: int, band: int | None, backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) in the inputs' dtypes, each piece's gradients from the merged ``out`` and ``lse_all``."""
    remap = _remap_of(kind, window, group, chunk, sink, sink_positions)
    triton_path = _use_triton(q, k, v, backend)
    plan, deltas, pieces = _setup(q, k, v, pos_q, key_valid, inv_freq, remap, q_offset, rotary_dim, layout,
                                  block, band, triton_path)
    do = do.contiguous()
    grad_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse_b = lse_all.masked_fill(torch.isinf(lse_all), float("inf"))  # a row with no key: probabilities 0
    if triton_path:
        from .triton_span import span_backward

        lse_b = lse_b.to(torch.float32).contiguous()
        rows = (do.to(torch.float32) * out.to(torch.float32)).sum(-1).contiguous()  # Δ_i = dO_i · O_i
        grads = [span_backward(do, qc, kc, v, lse_b, rows, lo, hi, scale)
                 for (qc, kc), (lo, hi) in zip(pieces, _int32(plan.spans))]
        dqs, dks = [g[0] for g in grads], [g[1] for g in grads]
        dv_total = sum(g[2] for g in grads)
    else:
        dqs = [torch.zeros_like(qc, dtype=grad_dtype) for qc, _ in pieces]
        dks = [torch.zeros_like(kc, dtype=grad_dtype) for _, kc in pieces]
        dv_total = torch.zeros_like(v, dtype=grad_dtype)
        for q0, q1, per_case in plan.blocks:
            dob, ob, lb = do[:, :, q0:q1], out[:, :, q0:q1], lse_b[:, :, q0:q1]
            for c, ((qc, kc), calls) in enumerate(zip(pieces, per_case)):
                for a, z, mask in calls:
                    dq, dk, dv = _attend_backward(dob, qc[:, :, q0:q1], kc[:, :, a:z], v[:, :, a:z], ob, lb, mask,
                                                  scale)
                    dqs[c][:, :, q0:q1] += dq
                    dks[c][:, :, a:z] += dk
                    dv_total[:, :, a:z] += dv
    dq_total, dk_total = torch.zeros_like(dqs[0]), torch.zeros_like(dks[0])
    for (dq_delta, dk_delta), dqc, dkc in zip(deltas, dqs, dks):
        dq_total += _rerotate(dqc, None if dq_delta is None else -dq_delta, inv_freq, rotary_dim, layout)
        dk_total += _rerotate(dkc, None if dk_delta is None else -dk_delta, inv_freq, rotary_dim, layout)
    return dq_total.to(q.dtype), dk_total.to(k.dtype), dv_total.to(v.dtype)


@_remap_backward.register_fake
def _(do, out, lse_all, q, k, v, pos_q, key_valid, inv_freq, kind, window, group, chunk, sink, sink_positions,
      scale, q_offset, rotary_dim, layout, block, band, backend):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, pos_q, key_valid, inv_freq, *scalars = inputs
    out, lse = output
    ctx.scalars = scalars
    ctx.save_for_backward(out, lse, q, k, v, pos_q, key_valid, inv_freq)


def _backward(ctx, grad_out, grad_lse):
    out, lse, q, k, v, pos_q, key_valid, inv_freq = ctx.saved_tensors
    dq, dk, dv = _remap_backward(grad_out.contiguous(), out, lse, q, k, v, pos_q, key_valid, inv_freq, *ctx.scalars)
    return (dq, dk, dv) + (None,) * (3 + len(ctx.scalars))


_remap_forward.register_autograd(_backward, setup_context=_setup_context)


def remap_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    remap: Remap,
    *,
    scale: float,
    pos_q: torch.Tensor,
    inv_freq: torch.Tensor,
    rotary_dim: int,
    layout: str,
    q_offset: int = 0,
    key_valid: torch.Tensor | None = None,
    band: int | None = None,
    block: int = DEFAULT_BLOCK,
    backend: str | None = None,
) -> torch.Tensor:
    """Causal attention whose pairs are rotated by the remap's f(i, j) (or a window with sinks), in O(L·block)
    memory, with gradients for q, k and v.

    Args:
        q: (B, H, Lq, D) rotated by the model's rotary at ``pos_q``; k, v: (B, Hkv, Lk, D), k rotated at the keys'
            positions (the cache as the unpatched model keeps it). The rotary acts on the first ``rotary_dim`` dims
            in ``layout`` with frequencies ``inv_freq`` (R/2,).
        remap: the remap, or a window with sinks (`Remap`).
        scale: the logit scale.
        pos_q: (B|1, Lq) int positions of the queries. Positions run on with the cache index within a row, padding
            aside (the keys' positions are their indices less the row's offset, read at its last query).
        q_offset: the cache index of the first query.
        key_valid: (B|1, Lk) bool: one interval of valid keys per row (left padding, as transformers pads for
            generation; right padding; a static cache's empty slots); None: all keys valid.
        band: the model's own sliding window (keys each query sees), or None.
        block: query rows per block (the CPU's calls).
        backend: ``"triton"`` (hf_posenc's kernels: CUDA, or the interpreter), ``"torch"`` (the PyTorch calls) or
            None: ``HF_POSENC_BACKEND``, else the CUDA default of the kind ``"remap"``.

    Returns:
        out (B, H, Lq, D) in q's dtype; a query that sees no key gets zeros.

    Raises:
        ValueError: positions that do not run on with the index, padding that is not one interval per row, or a
            backend that cannot run these inputs.
    """
    if backend not in (None, "triton", "torch"):
        raise ValueError(f"backend must be 'triton', 'torch' or None, got {backend!r}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    out, _ = _remap_forward(q.contiguous(), k.contiguous(), v.contiguous(), pos_q.to(device=q.device),
                            key_valid, inv_freq.to(device=q.device, dtype=torch.float32), remap.kind or "",
                            int(remap.window), remap.group, remap.chunk, remap.sink, remap.sink_positions,
                            float(scale), int(q_offset), int(rotary_dim), layout, int(block),
                            None if band is None else int(band), backend or "")
    return out
