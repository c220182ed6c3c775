"""Tile-wise PyTorch attention with a position term: the engine wherever the Triton kernels do not run.

Same contract and math as the Triton kernels (``triton_attention.py``) and the reference (``naive.py``),
in plain PyTorch, on any device (CPU, MPS, CUDA without Triton). Query i is key qi = q_offset + i::

    s_ij  = scale · q_i · k_j + B_h(i, j)          (shaw: scale · q_i · (k_j + a^K_ij))
    s_ij  = −inf where masked (causal j > qi, outside the window, key j invalid)
    P     = softmax_j(s);  o_i = Σ_j P_ij v_j      (shaw: + Σ_j P_ij a^V_ij)
    backward: dS_ij = P_ij (dP_ij − Δ_i), Δ_i = dO_i · o_i; dq = scale dS k, dk = scale dSᵀ q, dv = Pᵀ dO

Tiling. The queries are split into blocks of ``block_q`` rows; each block runs against the keys it can
see (causal with an int ``q_offset``: keys up to its last query; the tiles right of the diagonal are never
built; with a sliding ``window`` and an int offset the keys from its first query's window edge on: the key
tiles left of the band are never built either, so the cost is O(Lq · (window + block_q)) per head). On the CPU in float32 (every term; Shaw when causal) each block is one call of torch's fused CPU attention
kernel (``aten::_scaled_dot_product_flash_attention_for_cpu``, which returns the log-sum-exp) with the
block's term as an additive float mask (B, H, block_q, keys seen), built from the term's small tensors:
few large products win on the CPU. Causal with an int offset and no padding or window, a block's keys split
at its diagonal square (``_block_parts``): the keys before it carry the term alone, the square the term and the
kernel's own causal mask, two calls merged by their log-sum-exp; no mask is filled with −inf (the kernel reads
a mask by its strides, so a view serves). Elsewhere (other devices, float64, shaw) the block loops over key tiles
of ``block_k`` with an online softmax (running max and sum). Every tile is computed in float32 (float64
inputs stay float64), whatever the input dtype; the output is cast back. Memory: O(block_q · Lk) per head
for the tile, plus O(L · D) for q, k, v (k, v expanded to the query heads on the fused-kernel path, which
takes no GQA), the output and the log-sum-exp; never (B, H, Lq, Lk).

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
* ``fox``: B = c[qi] − c[j]; dc_j = −Σ_i dS_ij (per key), dc_qi = Σ_j dS_ij (per query). On the CPU in
  float32 FoX runs the fused kernel both ways: a softmax row ignores its constant c[qi], so the bias is a
  per-key term c[ref] − c[j] (ref: the block's middle query) carried as one more key channel (queries carry a
  1, values a 0); the kernel's gradient of that channel is −dc_j, and Σ_j dS_ij = 0 (a row's dS sums to 0).
  Split at the diagonal, FoX needs no float mask at all. Causal ALiBi with padding or a window (int offset) is
  the same term with c[j] = −slope · j (a constant log forget gate; its channel is slope · (j − ref)), its slopes'
  gradient −Σ_j j dc_j (``_alibi_channel`` says why only there). Measured (AMD EPYC, 2 threads, the L = 2048
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
* ``fire``: each tile's bias is rebuilt from the table, c and inv_norm (one gather of values and slopes for
  every head at the tile's shared cells); the table's gradient is a scatter of dS over the cells, c's and
  inv_norm's come through du = Σ_h dS_h · slope_h (``_FireTiles``; the tile, never the full matrix).
* ``shaw``: the key term gathers q · a^K (B, H, n, 2K + 1) at each pair's relative bucket; its gradient
  and the value term's bucket sums of P are scatter-added per tile into (B, H, n, 2K + 1). Causal on the CPU
  in float32, Shaw runs the fused kernel both ways instead: the keys K or more back share one bucket, whose
  q · a^K is a row constant, so only a band of K keys per row carries a mask term, and the value term and the
  corrections to the kernel's gradients come from that band's probabilities (``_ShawBand``).

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

from typing import NamedTuple

import torch

from .._cpu_flash import FLASH_BACKWARD as _flash_bwd, FLASH_FORWARD as _flash_fwd
from .._subnormal import EXP_FLOOR, exp_flushed
from .naive import check_window
from .terms import TILED_KINDS, TOEPLITZ_KINDS, KernelTerm, fire_cell, fire_psi, term_spec

__all__ = ["TILED_KINDS", "TiledAttentionFunction", "tiled_attention", "tiled_unsupported"]

#: default query rows per block, and keys per tile of the online-softmax passes (512: the tile of 8 heads x 256
#: rows stays in the CPU caches; kerple's training step at L = 2048 ran 1.9x SDPA's against 2.5x with 4096 keys).
BLOCK_Q = 256
BLOCK_K = 512


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def distance_values(term: KernelTerm, delta: torch.Tensor) -> torch.Tensor:
    """The Toeplitz term at distances ``delta`` (N,) (δ = qi − j, integer-valued) -> (H, N), from its registry
    entry's ``distance``, in the term's compute dtype (float32, float64 for float64 tensors), differentiable in
    the term's tensors."""
    spec = term.spec
    if spec.form != "toeplitz":
        raise ValueError(f"{term.kind!r} is not a Toeplitz term")
    heads = torch.arange(term.num_heads, device=delta.device)[:, None]
    return spec.distance(term.tensors, heads, delta[None])


class _FireTiles:
    """FIRE's term tile by tile, by hand in both directions (autograd's gather backward, an index_put with
    accumulation, took 30 % of a training step). b_hij = table_h(u_ij) interpolated linearly,
    u_ij = ψ(δ_ij) · inv_norm_i · (N − 1) / x_max, ψ(δ) = log(1 + c δ), δ = max(qi − j, 0); u is the same for every
    head, so the cells and weights are computed once per tile.

    Forward: each head's value and slope at a pair's cell come from one gather of a (2H, N) table (a complex
    (H, N) table of value + i slope gathers half as many elements, but the interpolation then reads strided
    halves: no faster, measured). Backward: the table's gradient is a scatter of dS and dS · w over the cells;
    consecutive keys of a row share their cell, so the scatter's adds to one address chain one after another: the
    keys are dealt to ``SPLIT`` copies of the table (key p to copy p mod SPLIT), summed after (the scatter took
    1.0 ms -> 0.4-0.9 ms on a (8, 256, 512) tile, measured). c's and inv_norm's gradients come through
    du = Σ_h dS_h · slope_h."""

    #: copies of the table the backward's scatter deals consecutive keys to (see the class docstring).
    SPLIT = 4

    def __init__(self, t: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        table = t["table"].detach().to(dtype)
        self.heads, self.n = table.shape
        slope = torch.cat([table.diff(dim=1), table.new_zeros(self.heads, 1)], dim=1)
        self.values = torch.cat([table, slope], dim=0)  # (2H, N): f at cell k, f[k + 1] − f[k]
        self.c = t["c"].detach().to(dtype)
        self.inv_norm = t["inv_norm"].detach().to(dtype)  # (B|1, Lq)
        self.scale = (self.n - 1) / t["x_max"].detach().to(dtype)
        self.last = None  # the parts of the last tile built, for its gradient (kept when ``keep``: the backward)
        self.keep = False
        self._lanes = torch.empty(0, dtype=torch.long, device=table.device)

    def bias(self, qi: torch.Tensor, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
        """(B|1, H, n, m) for queries at key indices ``qi`` (rows q0:q1 of inv_norm) and keys k0 .. k1 − 1."""
        delta = (qi[:, None] - torch.arange(k0, k1, device=qi.device)[None, :]).clamp_(min=0).to(self.c.dtype)
        psi = fire_psi(self.c, delta)  # (n, m)
        raw = psi[None] * (self.inv_norm[:, q0:q1, None] * self.scale)  # (B|1, n, m)
        cell, w = fire_cell(raw, self.n)  # w: the weight of cell + 1
        idx = cell.long().reshape(-1)
        # gather along a broadcast index: 4x faster than index_select on dim 1 here (measured, 2 threads)
        got = self.values.gather(1, idx[None].expand(2 * self.heads, -1)).view(2, self.heads, *raw.shape)
        out = torch.addcmul(got[0], got[1], w[None]).movedim(1, 0)  # (B|1, H, n, m)
        if self.keep:  # for grads(); else freed now (held, a block's 50 MB made every next tile fault in fresh pages)
            self.last = (delta, psi, raw, w, idx, got[1])
        return out

    def _dealt(self, idx: torch.Tensor) -> torch.Tensor:
        """The cells ``idx`` (P,) moved to copy p mod SPLIT of a (SPLIT · N) table."""
        p = idx.numel()
        if self._lanes.numel() < p:
            self._lanes = torch.arange(p, device=idx.device) % self.SPLIT * self.n
        return idx + self._lanes[:p]

    def grads(self, ds: torch.Tensor, q0: int, q1: int, need: dict[str, bool], acc: dict[str, torch.Tensor]) -> None:
        """Add the gradients of the last tile (dS ``ds`` (B, H, n, m)) to ``acc``: the table's by a scatter over
        the cells, c's and inv_norm's through du = Σ_h dS_h · slope_h(cell)."""
        delta, psi, raw, w, idx, slope = self.last
        nb = raw.shape[0]
        dsh = ds.movedim(1, 0)  # (H, B, n, m)
        if nb != dsh.shape[1]:  # one inv_norm row for every batch: the cells are shared, sum dS over the batch
            dsh = dsh.sum(1, keepdim=True)
        if need["table"]:
            flat = dsh.reshape(self.heads, -1)
            cells = self._dealt(idx)[None].expand(self.heads, -1)
            copies = self.values.new_zeros(self.heads, self.SPLIT * self.n)
            whole = copies.scatter_add(1, cells, flat).view(self.heads, self.SPLIT, self.n).sum(1)  # Σ dS per cell
            upper = copies.scatter_add_(1, cells, flat * w.reshape(1, -1)).view(self.heads, self.SPLIT, self.n).sum(1)
            grad = whole - upper  # dS (1 − w) at the cell
            grad[:, 1:] += upper[:, :-1]  # dS w at the cell above
            acc["table"] = grad if "table" not in acc else acc["table"].add_(grad)
        if need["c"] or need["inv_norm"]:
            inside = (raw >= 0) & (raw <= self.n - 1)  # clamp passes no gradient outside [0, N − 1]
            du = (dsh * slope).sum(0).masked_fill_(~inside, 0.0)  # (B|1, n, m)
            if need["inv_norm"]:
                d_inv = self.scale * (du * psi[None]).sum(-1)  # (B|1, n)
                if "inv_norm" not in acc:
                    acc["inv_norm"] = torch.zeros_like(self.inv_norm)
                acc["inv_norm"][:, q0:q1] += d_inv
            if need["c"]:
                dpsi = du * (self.inv_norm[:, q0:q1, None] * self.scale)
                dc = (dpsi * (delta / (1 + self.c * delta))[None]).sum()
                acc["c"] = dc if "c" not in acc else acc["c"] + dc
        self.last = None  # freed before the next tile is built


# EXP_FLOOR (hf_posenc.kernels._subnormal): a probability exp(s − lse) below e^EXP_FLOOR is subnormal. The fused
# CPU backward recomputes such probabilities wherever a bias decays far (ALiBi: the backward of a 2048-key
# causal step took 115 ms with them, 47 ms without, measured with flush-to-zero set before torch's threads
# started; see :func:`_subnormal_free`).
#: the largest shift (nats) by which :func:`_subnormal_free` scales the probabilities and every gradient of a
#: block: e^40 ≈ 2e17 keeps the kernel's sums far from float32's overflow (3e38).
MAX_SHIFT = 40.0
#: the shift above 2β + 1 (nats): the gradient of the logits, P (dP − Δ), stays normal for |dP − Δ| down to
#: e^−20 ≈ 2e-9 of the row's scale.
SHIFT_MARGIN = 20.0


def _may_underflow(tile: "_Tile", q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether some probability of this call could be subnormal: the term's spread (largest minus smallest
    value, per head) plus the logits' 2 max|q| max|k| reaches −EXP_FLOOR. True when the term's spread is not
    known cheaply."""
    spread = tile.spread()
    if spread is None:
        return True
    beta = float(q.norm(dim=-1).amax()) * float(k.norm(dim=-1).amax()) if q.numel() and k.numel() else 0.0
    return spread + 2 * beta >= -EXP_FLOOR


def _subnormal_free(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, b: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mask, lse, the scale e^−C (B, H, 1, 1) of the gradients) for the fused CPU backward of one query block:
    the same gradients with no subnormal number in the kernel's products where the block's logits allow it;
    a GPU's flush-to-zero, stated exactly.

    With β_i = |q_i|·max_j |k_j| (q already scaled), |s_ij| ≤ β_i. (1) Where mask_ij < lse_i − β_i + EXP_FLOOR
    the probability is below e^EXP_FLOOR for any q, k: the mask entry becomes −inf, so it is 0 (flush-to-zero
    gives 0 too). (2) Every other probability is at least e^(EXP_FLOOR − 2β_i): the kernel gets lse − C with one
    C per (batch, head), C = min(2 max_i β_i + 1 + SHIFT_MARGIN, MAX_SHIFT), so it forms e^C P, e^C dS = e^C P (dP
    − Δ) (dP and Δ = dO·o unchanged) and returns e^C times dq, dk and dv, which the caller scales back.
    mask (1|B, H, n, m), q (B, H, n, D), k (B, H, m, D), lse (B, H, n)."""
    beta = q.norm(dim=-1) * k.norm(dim=-1).amax(-1, keepdim=True)  # (B, H, n)
    finite = torch.isfinite(lse)  # rows that see no key keep lse = +inf
    threshold = torch.where(finite, lse - beta + EXP_FLOOR, torch.full_like(lse, float("-inf")))
    mask = mask.expand(b, *mask.shape[1:]).masked_fill(mask < threshold[..., None], float("-inf"))
    shift = (2 * beta.amax(-1, keepdim=True) + 1 + SHIFT_MARGIN).clamp_(max=MAX_SHIFT)  # (B, H, 1)
    return mask, lse - shift, torch.exp(-shift)[..., None]


def _skew_buffer(like: torch.Tensor, m: int) -> torch.Tensor:
    """An uninitialised (..., n, m + n) buffer for a tile (..., n, m) whose anti-diagonals
    :func:`_antidiagonal_sums` will sum: the tile is written into its first m columns, the n others are zero."""
    n = like.shape[-2]
    buf = like.new_empty(*like.shape[:-1], m + n)
    buf[..., m:].zero_()
    return buf


def _antidiagonal_sums(buf: torch.Tensor, m: int) -> torch.Tensor:
    """buf (B, H, n, m + n) from :func:`_skew_buffer`, the tile ds in its first m columns -> (H, n + m − 1):
    entry c = Σ_{b, i + j = c} ds[b, :, i, j].

    The Toeplitz tiles run with their query rows reversed (row i' is query q1 − 1 − i'), so the diagonals
    of constant δ = qi − j are these anti-diagonals. Skew trick: rows of length m + n read back with row length
    m + n − 1: row i is shifted right by i (the zero columns fill the gaps)."""
    b, h, n, _ = buf.shape
    skew = buf.view(b, h, n * (m + n))[..., : n * (m + n - 1)].view(b, h, n, m + n - 1)
    return skew.sum((0, 2))


class _Plan:
    """What one call needs besides q, k, v: shapes, the term's detached precomputation, tile geometry."""

    def __init__(
        self,
        kind: str,
        names: tuple[str, ...],
        ints: dict[str, int],
        scale: float,
        causal: bool,
        q_offset: int | None,
        block_q: int,
        block_k: int,
        window: int | None = None,
    ) -> None:
        self.kind, self.names, self.ints = kind, names, ints
        self.form = term_spec(kind).form
        self.scale, self.causal, self.q_offset = scale, causal, q_offset
        self.block_q, self.block_k = block_q, block_k
        self.window = window

    def term(self, tensors: tuple[torch.Tensor, ...]) -> KernelTerm:
        return KernelTerm(self.kind, dict(zip(self.names, tensors)), dict(self.ints))

    def key_stop(self, q1: int, k_len: int) -> int:
        """End of the keys the queries before ``q1`` may see: all of them unless causal or windowed with an int
        offset (the last query q1 − 1 sees keys up to its own index, or up to index + window − 1 bidirectionally)."""
        if self.q_offset is None:
            return k_len
        if self.causal:
            return max(0, min(k_len, self.q_offset + q1))
        if self.window is not None:
            return max(0, min(k_len, self.q_offset + q1 - 1 + self.window))
        return k_len

    def key_start(self, q0: int, k_len: int) -> int:
        """First key the queries from ``q0`` on may see: 0 unless windowed with an int offset (the first query
        q0 sees keys from its index − window + 1); the key tiles before it are never built."""
        if self.window is None or self.q_offset is None:
            return 0
        return max(0, min(k_len, self.q_offset + q0 - self.window + 1))


def _rows(x: torch.Tensor, reverse: bool, dim: int = -2) -> torch.Tensor:
    """``x`` with its query rows (dimension ``dim``) reversed when ``reverse`` (the Toeplitz tiles' order)."""
    return x.flip(dim) if reverse else x


def _query_index(q_off: int | torch.Tensor, q0: int, q1: int, device: torch.device) -> torch.Tensor:
    """Key index (n,) int64 of the queries q0 .. q1 − 1."""
    return torch.arange(q0, q1, device=device) + q_off


def _query_blocks(plan: "_Plan", q_len: int, k_len: int, q_off, device: torch.device):
    """(q0, q1, key index of the queries q0 .. q1 − 1, first and end key they may see) per query block."""
    for q0 in range(0, q_len, plan.block_q):
        q1 = min(q0 + plan.block_q, q_len)
        yield q0, q1, _query_index(q_off, q0, q1, device), plan.key_start(q0, k_len), plan.key_stop(q1, k_len)


def _apply_mask(
    s: torch.Tensor, plan: _Plan, qi: torch.Tensor, q0: int, k0: int, k1: int, valid: torch.Tensor | None
) -> torch.Tensor:
    """Fill the masked logits of a tile s (B|1, H, n, m) (keys k0 .. k1 − 1, queries at key indices ``qi``,
    in any row order) with −inf, in place (made B wide first when the padding differs per batch).
    With an int offset only the columns right of the block's first query are compared (the causal window)."""
    if valid is not None and valid.shape[0] > s.shape[0]:
        s = s.expand(valid.shape[0], *s.shape[1:]).contiguous()
    w = plan.window
    if plan.causal or w is not None:  # upper edge: j <= qi (causal), j < qi + window (bidirectional window)
        reach = 1 if plan.causal else w
        c0 = k0 if plan.q_offset is None else max(k0, plan.q_offset + q0 + reach)
        if c0 < k1:
            cols = torch.arange(c0, k1, device=s.device)
            s[..., c0 - k0 :].masked_fill_(cols[None, :] >= qi[:, None] + reach, float("-inf"))
    if w is not None:  # lower edge of the window: j > qi − window; only columns left of the last query's edge
        c1 = k1 if plan.q_offset is None else min(k1, plan.q_offset + q0 + qi.shape[0] - w)
        if c1 > k0:
            cols = torch.arange(k0, c1, device=s.device)
            s[..., : c1 - k0].masked_fill_(cols[None, :] <= qi[:, None] - w, float("-inf"))
    if valid is not None:
        s.masked_fill_(~valid[:, None, None, k0:k1], float("-inf"))
    return s


class _Tile:
    """The term's contribution to one (query block, key block) tile, and the reduction of its gradient."""

    def __init__(self, plan: _Plan, tensors: tuple[torch.Tensor, ...], q_off: int | torch.Tensor,
                 q_len: int, k_len: int, dtype: torch.dtype, device: torch.device) -> None:
        self.plan, self.kind, self.form = plan, plan.kind, plan.form
        self.t = dict(zip(plan.names, tensors))
        self.q_off, self.q_len, self.k_len = q_off, q_len, k_len
        self.dtype, self.device = dtype, device
        if self.kind in TOEPLITZ_KINDS:
            # δ = q_offset + r for r = i − j = −(Lk − 1) .. Lq − 1, indexed by e = r + Lk − 1
            self.delta = torch.arange(-(k_len - 1), q_len, device=device) + q_off
            with torch.no_grad():
                values = distance_values(plan.term(tensors), self.delta).to(dtype)
            self.rev = values.flip(-1).contiguous()  # rev[t] = F[N − 1 − t]
            self.squares: dict[int, torch.Tensor] = {}  # the diagonal square's term per size (see square)
        if self.form == "gate":
            self.c = tensors[0].detach().to(dtype)  # a gate's per-token vector c (B, H, Lk)
        elif self.kind == "alibi" and plan.causal and plan.q_offset is not None:  # for the key channel
            # FoX's c with a constant log-gate −slope (see key_channel and _alibi_channel)
            self.slopes = self.t["slopes"].detach().to(dtype)
            self.c = -(self.slopes[:, None] * torch.arange(k_len, device=device, dtype=dtype))[None]  # (1, H, Lk)
        elif self.kind == "fire":
            self.fire = _FireTiles(self.t, dtype)
        elif self.kind == "shaw":
            self.kmax = plan.ints["max_relative_position"]
            self.a_key = self.t["key_table"].detach().to(dtype)
            self.a_value = self.t["value_table"].detach().to(dtype)

    def spread(self) -> float | None:
        """The largest gap between two of the term's values within a head (an upper bound), or None where it is
        not cheap to know (data-dependent terms)."""
        if self.kind in TOEPLITZ_KINDS:
            return float((self.rev.amax(-1) - self.rev.amin(-1)).max()) if self.rev.numel() else 0.0
        if self.kind == "fire":  # interpolated values lie between the table's
            values = self.fire.values[: self.fire.heads]
            return float((values.amax(-1) - values.amin(-1)).max())
        if self.form == "none":
            return 0.0
        return None

    def square(self, qi: torch.Tensor, q0: int, q1: int, k0: int, b: int, h: int) -> torch.Tensor | None:
        """The term on a block's diagonal square (queries at key indices ``qi`` = k0 .. k0 + n − 1, rows in order,
        keys k0 .. k0 + n − 1): (B, H, n, n), or None without a term. A Toeplitz term's square is the same on
        every block (δ = i − j): one copy per size for the call."""
        n = q1 - q0
        if self.kind in TOEPLITZ_KINDS:
            if n not in self.squares:
                self.squares[n] = self.bias(None, q0, q1, k0, k0 + n, None).flip(-2)  # rows back in order
            sq = self.squares[n]
        else:
            sq = self.bias(qi, q0, q1, k0, k0 + n, None)
        return None if sq is None else sq.expand(b, h, n, n)

    def key_channel(self, qi: torch.Tensor, k0: int, k1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """FoX's (and causal ALiBi's) term as one more key channel, for the queries at key indices ``qi``:
        (c[r] − c[j] for the keys k0 .. k1 − 1 (B|1, H, m), c[r] (B|1, H, 1)), r the block's middle query.

        The bias c[qi] − c[j] is the row constant c[qi] − c[r] (which a softmax row ignores) plus c[r] − c[j]:
        small near the diagonal, where the weight is (at most half a block of log-gates, which float32 rounds to
        ~1e-7 of it); the row's log-sum-exp is kept in that frame, in forward and backward alike. ALiBi's
        channel is slope · (j − r), rounded once (c[r] − c[j] would carry the rounding of two large values)."""
        r = qi[qi.shape[0] // 2 :][:1]
        ref = self.c.index_select(-1, r)
        if self.form == "gate":
            return ref - self.c[..., k0:k1], ref
        dist = (torch.arange(k0, k1, device=qi.device) - r).to(self.dtype)
        return (self.slopes[:, None] * dist[None])[None], ref

    def bias(self, qi: torch.Tensor, q0: int, q1: int, k0: int, k1: int, ctx_q: torch.Tensor | None):
        """The additive term of the tile, broadcastable to (B, H, n, m), or None."""
        n, m = q1 - q0, k1 - k0
        if self.kind in TOEPLITZ_KINDS:  # rows reversed: row i' is query q1 − 1 − i', T[i', j] = rev[t0 + i' + j]
            t0 = self.q_len - q1 + k0
            return self.rev.unfold(-1, m, 1)[None, :, t0 : t0 + n]  # (1, H, n, m), a strided view
        if self.form == "gate":
            if isinstance(self.q_off, torch.Tensor):
                cq = self.c.index_select(-1, qi)
            else:
                cq = self.c[..., self.q_off + q0 : self.q_off + q1]
            return cq[..., :, None] - self.c[..., None, k0:k1]
        if self.kind == "fire":
            return self.fire.bias(qi, q0, q1, k0, k1)
        if self.kind == "shaw":
            return ctx_q.gather(-1, self._shaw_index(qi, k0, k1, ctx_q.shape[:2]))  # scale · q · a^K
        return None

    def _shaw_index(self, qi: torch.Tensor, k0: int, k1: int, bh: torch.Size) -> torch.Tensor:
        rel = torch.arange(k0, k1, device=self.device)[None, :] - qi[:, None]
        idx = rel.clamp(-self.kmax, self.kmax) + self.kmax
        return idx.expand(*bh, *idx.shape)


def _prepare(query, key, value, plan: _Plan, tensors):
    dtype = _compute_dtype(query.dtype)
    b, h, q_len, d = query.shape
    hkv, k_len = key.shape[1], key.shape[2]
    q = query.to(dtype) * plan.scale
    k = key.to(dtype)
    v = value.to(dtype)
    return dtype, b, h, hkv, q_len, k_len, d, q, k, v


def _group(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """(B, H, n, X) -> (B, Hkv, G·n, X): the G query heads of each key/value head stacked (h = kv·G + g)."""
    b, h, n, e = x.shape
    if h == hkv:
        return x
    return x.reshape(b, hkv, (h // hkv) * n, e)


def _ungroup(x: torch.Tensor, h: int) -> torch.Tensor:
    b, hkv, gn, e = x.shape
    return x if h == hkv else x.reshape(b, h, gn * hkv // h, e)


def _flash_available(plan: _Plan, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the tiles can go through torch's fused CPU attention kernel (additive float mask per tile):
    CPU float32 compute; Shaw (whose value term needs the probabilities) only when causal (``_ShawBand``)."""
    return (device.type == "cpu" and dtype == torch.float32 and (plan.kind != "shaw" or plan.causal)
            and _flash_fwd is not None and _flash_bwd is not None)


class _ShawBand:
    """Shaw's terms through the fused kernel, causal: with a^K_r, a^V_r at r = clip(j − i, −K, K), every key
    at least K positions back shares bucket −K, so q_i · a^K_−K is a row constant (a softmax row ignores it)
    and the fused kernel needs only the band r = −K + 1 .. 0 as a mask term, q_i · (a^K_r − a^K_−K). The value
    term is a^V_−K + Σ_band P_ir (a^V_r − a^V_−K) (a row's probabilities sum to 1), from the band's
    probabilities, recomputed from K dot products per row; the row's log-sum-exp stays in that frame. In
    backward the kernel gets the output less a^V_−K (so its Δ_i = dO_i · o_i carries −dO_i · a^V_−K and its dS is
    exact off the band); the band's share is added by hand: dS_ir gains P_ir dO_i · (a^V_r − a^V_−K), and the
    tables' gradients are the band's sums (bucket −K: minus the band's, and the rest of each row's mass)."""

    def __init__(self, tile: "_Tile", plan: _Plan, device: torch.device) -> None:
        kmax = tile.kmax
        self.kmax = kmax
        self.base_key, self.base_value = tile.a_key[0], tile.a_value[0]  # bucket −K
        self.d_key = tile.a_key[1 : kmax + 1] - self.base_key  # (K, D): r = −K + 1 .. 0
        self.d_value = tile.a_value[1 : kmax + 1] - self.base_value
        self.offsets = torch.arange(-kmax + 1, 1, device=device)  # r of band column t
        self.plan = plan

    def columns(self, qi: torch.Tensor, k_len: int, valid: torch.Tensor | None):
        """(key index (n, K) clamped into range, visible (B|1, n, K) bool) of each row's band."""
        j = qi[:, None] + self.offsets[None, :]
        ok = (j >= 0) & (j < k_len)
        if self.plan.window is not None:
            ok = ok & (j > qi[:, None] - self.plan.window)
        jc = j.clamp(0, max(k_len - 1, 0))
        ok = ok[None]
        if valid is not None:
            ok = ok & valid[:, jc]
        return jc, ok

    def split(self, q0: int, k_start: int, k_stop: int, valid: torch.Tensor | None) -> int:
        """The first key of the block's band strip (its first query's band start) where the keys before it need
        no mask at all (an int offset, no padding, no window: they are visible to every row of the block and in
        bucket −K, the row's frame), else ``k_start``. The fused kernel then runs twice, unmasked on the far
        keys and with the band's small mask on the rest, and the two parts merge by their log-sum-exp (no
        (B, H, n, Lk) float mask per block to fill and read: Shaw's CPU training step measured 1.81x SDPA's with
        it, 1.66x without)."""
        if valid is not None or self.plan.window is not None or self.plan.q_offset is None:
            return k_start
        return min(max(k_start, self.plan.q_offset + q0 - self.kmax + 1), k_stop)

    def parts(self, qi, q0, q1, k_start, k_stop, valid, b, h, qa, jc, ok) -> list[_Part]:
        """The block's keys k_start .. k_stop − 1 as fused-kernel parts (:func:`_flash_parts_fwd`): the keys before
        the band strip unmasked (see :meth:`split`), then the strip with its mask."""
        split = self.split(q0, k_start, k_stop, valid)
        strip = _Part(split - k_start, k_stop - k_start, self.mask(qi, q0, q1, split, k_stop, valid, b, h, qa, jc, ok))
        return ([_Part(0, split - k_start)] if split > k_start else []) + [strip]

    def mask(self, qi, q0, q1, k_start, k_stop, valid, b, h, qa, jc, ok):
        """The block's float mask (B, H, n, k_stop − k_start): the band term qa (B, H, n, K) at its keys, −inf
        where masked."""
        n, m = q1 - q0, k_stop - k_start
        mask = qa.new_zeros(b, h, n, m)
        inside = ok & (jc >= k_start) & (jc < k_stop)  # (B|1, n, K)
        col = (jc - k_start).clamp(0, max(m - 1, 0))
        values = qa.masked_fill(~inside[:, None], 0.0)
        mask.scatter_add_(-1, col.expand(b, h, n, col.shape[-1]).contiguous(), values)
        return _apply_mask(mask, self.plan, qi, q0, k_start, k_stop, valid)

    def probabilities(self, qb, kx, jc, ok, qa, lse_b):
        """P (B, H, n, K) of the band's keys, and the gathered keys (B, H, n, K, D)."""
        kb = kx[:, :, jc]  # (B, H, n, K, D)
        s = torch.einsum("bhnd,bhnkd->bhnk", qb, kb) + qa
        s = s.masked_fill(~ok[:, None], float("-inf"))
        return torch.exp(s - lse_b[..., None]), kb


def _shaw_fused_forward(plan, tile, q, kx, vx, valid, q_off, b, h, d, out, lse) -> None:
    """Fill ``out`` and ``lse`` (Shaw's frame, see ``_ShawBand``) block by block through the fused kernel."""
    q_len, k_len = q.shape[2], kx.shape[2]
    band = _ShawBand(tile, plan, q.device)
    for q0, q1, qi, k_start, k_stop in _query_blocks(plan, q_len, k_len, q_off, q.device):
        if k_stop <= k_start:
            out[:, :, q0:q1] = 0.0
            lse[:, :, q0:q1] = float("inf")
            continue
        qb = q[:, :, q0:q1]
        qa = qb @ band.d_key.T  # (B, H, n, K): q_i · (a^K_r − a^K_−K), q already scaled
        jc, ok = band.columns(qi, k_len, valid)
        parts = band.parts(qi, q0, q1, k_start, k_stop, valid, b, h, qa, jc, ok)
        o, lb = _flash_parts_fwd(qb, kx[:, :, k_start:k_stop], vx[:, :, k_start:k_stop], parts)
        empty = _empty_rows(plan, qi, valid, k_start, k_stop)
        if empty is not None:
            o = o.masked_fill(empty, 0.0)
            lb = lb.masked_fill(empty[..., 0], float("inf"))
        p, _ = band.probabilities(qb, kx, jc, ok, qa, lb)
        has = torch.isfinite(lb)[..., None]
        out[:, :, q0:q1] = o + has * band.base_value + p @ band.d_value
        lse[:, :, q0:q1] = lb


def _shaw_fused_backward(plan, tile, q, k, v, out, lse, do, valid, q_off, b, h, hkv, d):
    """(dq (scaled q), dk, dv, d a^K, d a^V) of Shaw's fused path (``_ShawBand``)."""
    q_len, k_len = q.shape[2], k.shape[2]
    kx, vx = _expand_heads(k, h), _expand_heads(v, h)
    band = _ShawBand(tile, plan, q.device)
    dq = torch.zeros_like(q)
    dkx, dvx = torch.zeros_like(kx), torch.zeros_like(vx)
    d_key, d_value = torch.zeros_like(tile.a_key), torch.zeros_like(tile.a_value)
    for q0, q1, qi, k_start, k_stop in _query_blocks(plan, q_len, k_len, q_off, q.device):
        if k_stop <= k_start:
            continue
        n = q1 - q0
        qb, dob, ob, lb = q[:, :, q0:q1], do[:, :, q0:q1], out[:, :, q0:q1], lse[:, :, q0:q1]
        qa = qb @ band.d_key.T
        jc, ok = band.columns(qi, k_len, valid)
        parts = band.parts(qi, q0, q1, k_start, k_stop, valid, b, h, qa, jc, ok)
        has = torch.isfinite(lb)[..., None]
        o_frame = ob - has * band.base_value
        gq, gk, gv = _flash_parts_bwd(dob, qb, kx[:, :, k_start:k_stop], vx[:, :, k_start:k_stop], o_frame, lb,
                                      parts)
        dq[:, :, q0:q1] = gq
        dkx[:, :, k_start:k_stop] += gk
        dvx[:, :, k_start:k_stop] += gv
        # the band's share
        p, kb = band.probabilities(qb, kx, jc, ok, qa, lb)  # (B, H, n, K), (B, H, n, K, D)
        vb = vx[:, :, jc]
        dov = torch.einsum("bhnd,bhnkd->bhnk", dob, vb)
        doa = dob @ band.d_value.T  # dO_i · (a^V_r − a^V_−K)
        delta = (dob * ob).sum(-1, keepdim=True)  # Δ_i of the true output
        ds = p * (dov + doa + (dob @ band.base_value)[..., None] - delta)  # the band's true dS
        extra = p * doa  # what the kernel's dS lacks on the band
        dq[:, :, q0:q1] += torch.einsum("bhnk,bhnkd->bhnd", extra, kb) + ds @ band.d_key
        contrib = (extra[..., None] * qb[:, :, :, None, :]).masked_fill(~ok[:, None, :, :, None], 0.0)
        dkx.index_add_(2, jc.reshape(-1), contrib.reshape(b, h, n * band.kmax, d))
        q_sum = torch.einsum("bhnk,bhnd->kd", ds, qb)  # Σ dS_ir q_i per band column
        d_key[1 : band.kmax + 1] += q_sum
        d_key[0] -= q_sum.sum(0)
        d_value[1 : band.kmax + 1] += torch.einsum("bhnk,bhnd->kd", p, dob)
        rest = (has[..., 0] * (1 - p.sum(-1)))  # each row's mass on bucket −K
        d_value[0] += torch.einsum("bhn,bhnd->d", rest, dob)
    if h != hkv:
        dk = dkx.view(b, hkv, h // hkv, k_len, d).sum(2)
        dv = dvx.view(b, hkv, h // hkv, k_len, d).sum(2)
    else:
        dk, dv = dkx, dvx
    return dq, dk, dv, d_key, d_value


def _flash_mask(tile: "_Tile", plan: _Plan, qi: torch.Tensor, q0: int, q1: int, k_start: int, k_stop: int,
                valid: torch.Tensor | None, b: int, h: int, term: bool = True) -> torch.Tensor:
    """The tile's additive float mask (B, H, n, k_stop − k_start) over keys k_start .. k_stop − 1: the term (unless
    ``term`` is False: FoX's, which rides in an extra key channel) plus −inf where masked (for the fused kernel)."""
    n, m = q1 - q0, k_stop - k_start
    bias = tile.bias(qi, q0, q1, k_start, k_stop, None) if term else None
    if bias is None:
        mask = torch.zeros(1, 1, n, m, dtype=tile.dtype, device=tile.device)
    else:
        mask = bias.contiguous()  # Toeplitz: a copy of the strided view; fox, fire: a fresh tensor
    return _apply_mask(mask, plan, qi, q0, k_start, k_stop, valid).expand(b, h, n, m)


def _empty_rows(plan: _Plan, qi: torch.Tensor, valid: torch.Tensor | None, k_start: int,
                k_stop: int) -> torch.Tensor | None:
    """(B|1, 1, n, 1) bool: query rows that see no key (left padding, a window past the keys), or None when
    every row sees one (keys k_start .. k_stop − 1 are the block's; the others are outside every row's view)."""
    if plan.window is not None:
        w = plan.window
        lo = (qi - w + 1).clamp(k_start, k_stop)  # each row's visible key range [lo, hi) by position
        hi = (qi + (1 if plan.causal else w)).clamp(k_start, k_stop)
        hi = torch.maximum(hi, lo)
        if valid is None:
            return (hi == lo)[None, None, :, None]
        count = torch.cat([valid.new_zeros(valid.shape[0], 1, dtype=torch.long),
                           valid[:, k_start:k_stop].long().cumsum(-1)], dim=-1)  # [b, t]: valid keys < k_start + t
        seen = count.index_select(-1, hi - k_start) - count.index_select(-1, lo - k_start)
        return (seen == 0)[:, None, :, None]
    if valid is None:
        return None
    v = valid[:, :k_stop]
    if plan.causal:
        seen_any = torch.cat([v.new_zeros(v.shape[0], 1), v.cumsum(-1) > 0], dim=-1)  # [b, t]: a valid key < t
        idx = (qi + 1).clamp(0, k_stop)
        return ~seen_any.index_select(-1, idx)[:, None, :, None]
    return ~v.any(-1)[:, None, None, None].expand(-1, 1, qi.shape[0], 1)


def _expand_heads(x: torch.Tensor, h: int) -> torch.Tensor:
    """(B, Hkv, L, D) -> (B, H, L, D) (a broadcast view made contiguous: the fused kernel takes no GQA)."""
    b, hkv, n, d = x.shape
    return x if hkv == h else x[:, :, None].expand(b, hkv, h // hkv, n, d).reshape(b, h, n, d)


def _channel_keys(kx: torch.Tensor, channel: torch.Tensor) -> torch.Tensor:
    """Keys (B, H, m, D) with the term's per-key channel (B|1, H, m) as one more channel (B, H, m, D + 1); the
    queries carry a 1 there (:func:`_with_one`), so the fused kernel adds the term to q · k itself."""
    return torch.cat([kx, channel[..., None].expand(kx.shape[0], *channel.shape[1:], 1)], dim=-1)


def _with_one(q: torch.Tensor) -> torch.Tensor:
    """(B, H, L, D) -> (B, H, L, D + 1): a channel of ones, FoX's bias weight."""
    return torch.cat([q, q.new_ones(*q.shape[:-1], 1)], dim=-1)


def _with_zero(x: torch.Tensor) -> torch.Tensor:
    """(B, H, L, D) -> (B, H, L, D + 1): a channel of zeros (the fused kernel takes one head size for q, k, v)."""
    return torch.cat([x, x.new_zeros(*x.shape[:-1], 1)], dim=-1)


def _alibi_channel(plan: _Plan, valid: torch.Tensor | None) -> bool:
    """Whether ALiBi runs as a key channel (:meth:`_Tile.key_channel`): causal with an int offset, where its
    bias −slope (qi − j) is FoX's c[qi] − c[j] with c[j] = −slope · j (a constant log forget gate), and with padding
    or a window (the blocks do not split at their diagonal). Measured at L = 2048, H = 8, D = 32 (AMD EPYC, 2
    threads, forward + backward against SDPA's): unsplit (B = 2, left padding, L = 1024) the channel took 124 ms
    against 185 ms for the per-block float mask with ``_subnormal_free`` (SDPA with a bool mask: 96-110 ms); split,
    ALiBi's far keys as a strided view of its Toeplitz values took 133 ms against the channel's 145 ms (SDPA
    108 ms): the kernel is about 17 % slower at head_dim 33 than 32, and reading a view costs it less."""
    return plan.kind == "alibi" and plan.causal and plan.q_offset is not None and not _splits_at_diagonal(plan, valid)


def _splits_at_diagonal(plan: _Plan, valid: torch.Tensor | None) -> bool:
    """Whether the query blocks split at their diagonal square (:func:`_diagonal_start`): causal with an int
    offset, no padding and no window."""
    return valid is None and plan.window is None and plan.causal and plan.q_offset is not None


def _block_parts(tile: "_Tile", plan: _Plan, qi: torch.Tensor, q0: int, q1: int, k_start: int, k_stop: int,
                 valid: torch.Tensor | None, b: int, h: int, channel: bool) -> list[_Part]:
    """The fused-kernel parts of one query block (queries at key indices ``qi``, in order) over its keys
    k_start .. k_stop − 1, with the term's float masks (none where the term rides in a key channel).

    Split at the diagonal square (:func:`_diagonal_start`): the keys before it carry the term alone, the square the
    term and the kernel's own causal mask; nothing is filled with −inf. A Toeplitz term's far part is a strided
    view of its per-distance values (rows reversed: no copy; the kernel reads masks by their strides) and its
    square one mask per size for the whole call (δ = i − j on every block's square). Otherwise (padding, a
    window, a tensor offset, bidirectional) one part: the term with −inf where masked, rows reversed for a
    Toeplitz term (a copy of the view)."""
    m = k_stop - k_start
    rev = tile.kind in TOEPLITZ_KINDS and not channel
    diag = _diagonal_start(plan, q0, q1, k_start, k_stop, valid)
    if diag is None:
        mask = _flash_mask(tile, plan, _rows(qi, rev, 0), q0, q1, k_start, k_stop, valid, b, 1 if channel else h,
                           term=not channel)
        return [_Part(0, m, mask, False, rev)]
    if channel:
        return _causal_parts(m, diag - k_start)
    far, far_mask = diag - k_start, None
    if far:
        bias = tile.bias(_rows(qi, rev, 0), q0, q1, k_start, diag, None)
        far_mask = None if bias is None else bias.expand(b, h, *bias.shape[2:])
    return _causal_parts(m, far, far_mask, tile.square(qi, q0, q1, diag, b, h), rev)


def _diagonal_start(plan: _Plan, q0: int, q1: int, k_start: int, k_stop: int, valid: torch.Tensor | None
                    ) -> int | None:
    """The key index of the block's diagonal square when its keys k_start .. k_stop − 1 split into keys every row
    sees (before it) and the n x n square in which row r sees keys up to its own (the fused kernel's own causal
    mask, no float mask): causal with an int offset, no padding and no window. None otherwise."""
    if not _splits_at_diagonal(plan, valid):
        return None
    diag = plan.q_offset + q0
    return diag if k_start <= diag and k_stop - diag == q1 - q0 else None


class _Part(NamedTuple):
    """Keys lo .. hi − 1 of a block, run through the fused kernel with ``mask`` (or None) and its own causal mask
    (``causal``: the part is the block's diagonal square), with the block's query rows reversed (``rev``: a
    Toeplitz mask that is a strided view in that order)."""

    lo: int
    hi: int
    mask: torch.Tensor | None = None
    causal: bool = False
    rev: bool = False


def _causal_parts(m: int, far: int, far_mask: torch.Tensor | None = None, square_mask: torch.Tensor | None = None,
                  far_rev: bool = False) -> list[_Part]:
    """The parts of m keys whose first ``far`` every row sees and whose last m − far form the diagonal square
    (:func:`_diagonal_start`), with the term's masks of each (None: no term)."""
    return ([_Part(0, far, far_mask, False, far_rev)] if far > 0 else []) + [_Part(far, m, square_mask, True)]


def _flash_parts_fwd(qb: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, parts: list[_Part]
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, log-sum-exp) of the block qb (B, H, n, E) over the keys kb, vb (B, H, m, E): one fused-kernel call
    per part of the keys, merged by their log-sum-exp."""
    out = lse = None
    for part in parts:
        o, l = _flash_fwd(_rows(qb, part.rev), kb[:, :, part.lo : part.hi], vb[:, :, part.lo : part.hi], 0.0,
                          part.causal, attn_mask=part.mask, scale=1.0)
        o, l = _rows(o, part.rev), _rows(l, part.rev, -1)
        if out is None:
            out, lse = o, l
            continue
        merged = torch.logaddexp(lse, l)
        out = out * torch.exp(lse - merged)[..., None] + o * torch.exp(l - merged)[..., None]
        lse = merged
    return out, lse


def _flash_parts_bwd(dob, qb, kb, vb, ob, lb, parts: list[_Part]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of :func:`_flash_parts_fwd` from the merged output ``ob`` and log-sum-exp ``lb``: each part's
    fused backward gives the exact gradients of its keys (Δ_i = dO_i · o_i is the whole row's)."""
    dq, dks, dvs = None, [], []
    for part in parts:
        r = part.rev
        gq, gk, gv = _flash_bwd(_rows(dob, r), _rows(qb, r), kb[:, :, part.lo : part.hi], vb[:, :, part.lo : part.hi],
                                _rows(ob, r), _rows(lb, r, -1), 0.0, part.causal, attn_mask=part.mask, scale=1.0)
        gq = _rows(gq, r)
        dq = gq if dq is None else dq.add_(gq)
        dks.append(gk)
        dvs.append(gv)
    if len(parts) == 1:
        return dq, dks[0], dvs[0]
    return dq, torch.cat(dks, dim=2), torch.cat(dvs, dim=2)


def _flush_start(c: torch.Tensor, ref: torch.Tensor, lse: torch.Tensor, beta: torch.Tensor, k0: int, k1: int
                 ) -> list[int]:
    """Per head, the first key any row of the block needs (>= k0) on the key-channel path: c is non-increasing
    (FoX: a sum of log-gates <= 0; ALiBi: −slope · j), so c[ref] − c[j] falls as j goes back, and the keys before
    row i's first j with c[ref] − c[j] >= lse_i − β_i + EXP_FLOOR have probabilities below e^EXP_FLOOR for any q, k
    (|q · k| <= β_i): flushed to 0 (as GPUs do) by leaving them out. k0 for every head where c is not monotone.
    c (B|1, H, Lk), ref (B|1, H, 1), lse and β (B, H, n)."""
    seg = c[..., k0:k1].detach()
    if seg.shape[-1] < 2 or not bool((seg[..., 1:] <= seg[..., :-1]).all()):
        return [k0] * lse.shape[1]
    finite = torch.isfinite(lse)
    need = torch.where(finite, lse - beta + EXP_FLOOR, torch.full_like(lse, float("inf")))  # (B, H, n)
    # first j with −c[j] >= need − c[ref]: −c is non-decreasing, so a sorted search per (batch, head)
    target = need - ref
    neg = (-seg).expand(target.shape[0], *seg.shape[1:]).contiguous()
    first = torch.searchsorted(neg, target.contiguous(), side="left")  # (B, H, n)
    first = first.amin(dim=-1).amin(dim=0)  # per head: the earliest any row needs
    return [k0 + int(x) for x in first.clamp(max=k1 - k0).tolist()]


def _head_runs(starts: list[int], k_stop: int):
    """(h0, h1, s0) for each run of consecutive heads h0 .. h1 − 1 that share the first key s0 < k_stop."""
    h0 = 0
    for h1 in range(1, len(starts) + 1):
        if h1 == len(starts) or starts[h1] != starts[h0]:
            if starts[h0] < k_stop:
                yield h0, h1, starts[h0]
            h0 = h1


def _channel_fused_backward(plan: _Plan, tile: "_Tile", q, k, v, out, lse, do, valid, q_off, b, h, hkv, d,
                            want_c: bool):
    """The backward of the key-channel path (FoX, causal ALiBi: see :meth:`_Tile.key_channel`) through the fused
    CPU kernel, per query block and run of heads that share a first key, with c's gradient read from the channel
    that carries it: dc[j] = −Σ_i dS_ij (the per-row constant's gradient Σ_j dS_ij is 0: a softmax row's dS sums
    to 0). Subnormal probabilities are avoided as in :func:`_subnormal_free`: per head, the keys no logit can lift
    are left out (:func:`_flush_start`), and one shift per head lifts the rest. Where the forward split the
    block's keys (:func:`_diagonal_start`), so does the backward: no mask; else the block's causal/padding mask,
    in which each row's own flush rides too. Returns dq (of the scaled q), dk, dv and dc (B, H, Lk) or None."""
    q_len, k_len = q.shape[2], k.shape[2]
    kx, vx = _expand_heads(k, h), _expand_heads(v, h)
    qa, va, oa, doa = _with_one(q), _with_zero(vx), _with_zero(out), _with_zero(do)
    knorm = kx.norm(dim=-1)  # (B, H, Lk)
    dq = torch.zeros_like(q)
    dkx, dvx = torch.zeros_like(kx), torch.zeros_like(vx)
    dc = q.new_zeros(b, h, k_len) if want_c else None
    for q0, q1, qi, k_start, k_stop in _query_blocks(plan, q_len, k_len, q_off, q.device):
        if k_stop <= k_start:
            continue
        channel, ref = tile.key_channel(qi, k_start, k_stop)
        keys = _channel_keys(kx[:, :, k_start:k_stop], channel)  # (B, H, m, D + 1)
        lse_b = lse[:, :, q0:q1]
        beta = q[:, :, q0:q1].norm(dim=-1) * knorm[:, :, k_start:k_stop].amax(-1, keepdim=True)  # (B, H, n)
        starts = _flush_start(tile.c, ref, lse_b, beta, k_start, k_stop)
        shift = (2 * beta.amax(-1, keepdim=True) + 1 + SHIFT_MARGIN).clamp_(max=MAX_SHIFT)  # (B, H, 1)
        unscale = torch.exp(-shift)[..., None]
        diag = _diagonal_start(plan, q0, q1, k_start, k_stop, valid)
        mask = None if diag is not None else _flash_mask(tile, plan, qi, q0, q1, k_start, k_stop, valid, b, 1,
                                                          term=False)
        for h0, h1, s0 in _head_runs(starts, k_stop):
            hs, m = slice(h0, h1), k_stop - s0
            kb = keys[:, hs, s0 - k_start :]
            if diag is not None:
                parts = _causal_parts(m, diag - s0)
            else:  # the rows' own flush (keys after the run's start that a row's logits still cannot lift)
                floor = torch.where(torch.isfinite(lse_b[:, hs]), lse_b[:, hs] - beta[:, hs] + EXP_FLOOR,
                                    torch.full_like(beta[:, hs], float("-inf")))  # (B, h1 − h0, n)
                flushed = kb[..., d][:, :, None, :] < floor[..., None]  # (B, h1 − h0, n, m)
                mask_h = mask[..., s0 - k_start :].expand(b, h1 - h0, q1 - q0, m).masked_fill(flushed, float("-inf"))
                parts = [_Part(0, m, mask_h)]
            gq, gk, gv = _flash_parts_bwd(doa[:, hs, q0:q1], qa[:, hs, q0:q1], kb, va[:, hs, s0:k_stop],
                                          oa[:, hs, q0:q1], lse_b[:, hs] - shift[:, hs], parts)
            u = unscale[:, hs]
            dq[:, hs, q0:q1] += gq[..., :d].mul_(u)
            dkx[:, hs, s0:k_stop] += gk[..., :d].mul_(u)
            dvx[:, hs, s0:k_stop] += gv[..., :d].mul_(u)
            if dc is not None:
                dc[:, hs, s0:k_stop] -= gk[..., d].mul_(u[..., 0])
    if h != hkv:
        dk = dkx.view(b, hkv, h // hkv, k_len, d).sum(2)
        dv = dvx.view(b, hkv, h // hkv, k_len, d).sum(2)
    else:
        dk, dv = dkx, dvx
    return dq, dk, dv, dc


class TiledAttentionFunction(torch.autograd.Function):
    """Forward: online softmax over key tiles per query block. Backward: tiles recomputed from the saved
    log-sum-exp; gradients of q, k, v and every term tensor (see the module docstring)."""

    @staticmethod
    def forward(ctx, query, key, value, valid, q_off_tensor, plan: _Plan, *tensors):
        dtype, b, h, hkv, q_len, k_len, d, q, k, v = _prepare(query, key, value, plan, tensors)
        q_off = plan.q_offset if plan.q_offset is not None else q_off_tensor
        tile = _Tile(plan, tensors, q_off, q_len, k_len, dtype, query.device)
        out = q.new_empty(b, h, q_len, d)
        lse = q.new_empty(b, h, q_len)
        flash = _flash_available(plan, query.device, dtype)
        # FoX's bias (and causal ALiBi's) rides in a key channel, the lse in the block's frame (Tile.key_channel)
        channel = flash and (plan.form == "gate" or _alibi_channel(plan, valid))
        rev = plan.kind in TOEPLITZ_KINDS  # the online passes' row order (the fused path's parts choose their own)
        online = not flash  # the online-softmax passes below, else the fused kernel per block
        if flash and plan.kind == "shaw":  # the value term from the band (see _ShawBand)
            _shaw_fused_forward(plan, tile, q, _expand_heads(k, h), _expand_heads(v, h), valid, q_off, b, h, d,
                                out, lse)
            flash = False
        if flash:
            kx, vx = _expand_heads(k, h), _expand_heads(v, h)
            qf = _with_one(q) if channel else q
            vf = _with_zero(vx) if channel else vx
        for q0 in range(0, q_len, plan.block_q):
            if not flash:
                break
            q1 = min(q0 + plan.block_q, q_len)
            qi = _query_index(q_off, q0, q1, query.device)
            k_start, k_stop = plan.key_start(q0, k_len), plan.key_stop(q1, k_len)
            if k_stop <= k_start:
                out[:, :, q0:q1] = 0.0
                lse[:, :, q0:q1] = float("inf")
                continue
            kb = kx[:, :, k_start:k_stop]
            if channel:
                kb = _channel_keys(kb, tile.key_channel(qi, k_start, k_stop)[0])
            parts = _block_parts(tile, plan, qi, q0, q1, k_start, k_stop, valid, b, h, channel)
            o, l = _flash_parts_fwd(qf[:, :, q0:q1], kb, vf[:, :, k_start:k_stop], parts)
            o = o[..., :d]
            empty = _empty_rows(plan, qi, valid, k_start, k_stop)
            if empty is not None:
                o = o.masked_fill(empty, 0.0)
                l = l.masked_fill(empty[..., 0], float("inf"))
            out[:, :, q0:q1] = o
            lse[:, :, q0:q1] = l
        for q0 in range(0, q_len if online else 0, plan.block_q):
            q1 = min(q0 + plan.block_q, q_len)
            n = q1 - q0
            qi = _rows(_query_index(q_off, q0, q1, query.device), rev, 0)
            qb = _rows(q[:, :, q0:q1], rev)
            qg = _group(qb, hkv)
            qa = qb @ tile.a_key.T if plan.kind == "shaw" else None  # scale · q · a^K (B, H, n, 2K + 1)
            k_start, k_stop = plan.key_start(q0, k_len), plan.key_stop(q1, k_len)
            row_max = q.new_full((b, h, n, 1), float("-inf"))
            row_sum = q.new_zeros(b, h, n, 1)
            acc = q.new_zeros(b, h, n, d)
            for k0 in range(k_start, k_stop, plan.block_k):
                k1 = min(k0 + plan.block_k, k_stop)
                s = _ungroup(qg @ k[:, :, k0:k1].transpose(-1, -2), h)  # (B, H, n, m)
                bias = tile.bias(qi, q0, q1, k0, k1, qa)
                if bias is not None:
                    s = s + bias if s.shape != torch.broadcast_shapes(s.shape, bias.shape) else s.add_(bias)
                s = _apply_mask(s, plan, qi, q0, k0, k1, valid)
                new_max = torch.maximum(row_max, s.amax(-1, keepdim=True))
                safe = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
                p = exp_flushed(s.sub_(safe))  # no subnormal weights, no exp of -inf (kernels._subnormal)
                if k0 > k_start:
                    alpha = torch.exp(row_max - safe)
                    row_sum.mul_(alpha)
                    acc.mul_(alpha)
                row_sum.add_(p.sum(-1, keepdim=True))
                acc.add_(_ungroup(_group(p, hkv) @ v[:, :, k0:k1] if h != hkv else p @ v[:, :, k0:k1], h))
                if plan.kind == "shaw":
                    acc.add_(_shaw_buckets(tile, p, qi, k0, k1) @ tile.a_value)
                row_max = new_max
            empty = row_sum == 0
            out[:, :, q0:q1] = _rows(acc / torch.where(empty, torch.ones_like(row_sum), row_sum), rev)
            safe_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
            lse_rows = torch.where(empty, torch.full_like(row_sum, float("inf")), safe_max + row_sum.log())[..., 0]
            lse[:, :, q0:q1] = _rows(lse_rows, rev, -1)
        ctx.plan = plan
        ctx.save_for_backward(query, key, value, valid, q_off_tensor, out, lse, *tensors)
        return out.to(query.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, valid, q_off_tensor, out, lse, *tensors = ctx.saved_tensors
        plan: _Plan = ctx.plan
        dtype, b, h, hkv, q_len, k_len, d, q, k, v = _prepare(query, key, value, plan, tensors)
        q_off = plan.q_offset if plan.q_offset is not None else q_off_tensor
        tile = _Tile(plan, tensors, q_off, q_len, k_len, dtype, query.device)
        do = grad_out.to(dtype)
        delta = (do * out).sum(-1, keepdim=True)  # (B, H, Lq, 1)
        dq = torch.zeros_like(q)
        dk = torch.zeros_like(k)
        dv = torch.zeros_like(v)
        need = ctx.needs_input_grad[6:]
        want_term = any(need)
        g_dist = q.new_zeros(tile.rev.shape) if plan.kind in TOEPLITZ_KINDS and want_term else None
        dc = torch.zeros_like(tile.c) if plan.form == "gate" and want_term else None
        fire_grads: dict[str, torch.Tensor] = {}
        fire_need = dict(zip(plan.names, need))
        if plan.kind == "fire":
            tile.fire.keep = want_term
        d_akey = torch.zeros_like(tile.a_key) if plan.kind == "shaw" else None
        d_avalue = torch.zeros_like(tile.a_value) if plan.kind == "shaw" else None
        if plan.kind == "shaw" and _flash_available(plan, query.device, dtype):  # the forward's frame: _ShawBand
            dq, dk, dv, d_akey, d_avalue = _shaw_fused_backward(plan, tile, q, k, v, out, lse, do, valid, q_off, b,
                                                                h, hkv, d)
            grads = _term_grads(plan, tensors, need, tile, None, None, fire_grads, d_akey, d_avalue)
            return (dq.mul_(plan.scale).to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), None, None, None,
                    *grads)
        if _flash_available(plan, query.device, dtype) and (plan.form == "gate" or _alibi_channel(plan, valid)):
            # the forward's frame: the key channel (see Tile.key_channel)
            dq, dk, dv, dc = _channel_fused_backward(plan, tile, q, k, v, out, lse, do, valid, q_off, b, h, hkv, d,
                                                     want_term)
            grads = _term_grads(plan, tensors, need, tile, None, dc if want_term else None, fire_grads, None, None)
            return (dq.mul_(plan.scale).to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), None, None, None,
                    *grads)
        # No term gradient: the fused kernel's backward per query block where the blocks split at their diagonal
        # (the forward's parts, no mask to fill: sandwich's CPU training step 1.28x -> 1.01-1.12x SDPA, ALiBi's
        # 1.46x -> 1.10x, measured on an AMD EPYC, whose fused kernel showed no slowdown on subnormal probabilities:
        # a steep ALiBi head's backward took the time of a mild one's; see _block_parts), or where some probability
        # could be subnormal (a steep decay: ALiBi bidirectional or after a StaticCache), there with
        # ``_subnormal_free`` (ALiBi: 2.8x against 5.6x the SDPA attention step, measured on an Intel Xeon).
        # Otherwise (a mild term with padding or a window) the online passes below beat the fused backward with
        # its per-tile float mask (sandwich's step: 1.32x against 1.71x, measured), and they flush subnormal
        # probabilities themselves (``exp_flushed``).
        underflow = plan.form != "none" and _may_underflow(tile, q, k)
        flash = not want_term and _flash_available(plan, query.device, dtype) and (
            plan.form == "none" or underflow or _splits_at_diagonal(plan, valid))
        rev = plan.kind in TOEPLITZ_KINDS
        if flash:  # no term gradient: the fused kernel's backward per query block
            kx, vx = _expand_heads(k, h), _expand_heads(v, h)
            dkx = torch.zeros_like(kx) if h != hkv else dk
            dvx = torch.zeros_like(vx) if h != hkv else dv
            for q0 in range(0, q_len, plan.block_q):
                q1 = min(q0 + plan.block_q, q_len)
                k_start, k_stop = plan.key_start(q0, k_len), plan.key_stop(q1, k_len)
                if k_stop <= k_start:
                    continue
                if not underflow or _splits_at_diagonal(plan, valid):  # the forward's parts
                    parts = _block_parts(tile, plan, _query_index(q_off, q0, q1, query.device), q0, q1, k_start,
                                         k_stop, valid, b, h, False)
                    gq, gk, gv = _flash_parts_bwd(do[:, :, q0:q1], q[:, :, q0:q1], kx[:, :, k_start:k_stop],
                                                  vx[:, :, k_start:k_stop], out[:, :, q0:q1], lse[:, :, q0:q1], parts)
                    dq[:, :, q0:q1] = gq
                    dkx[:, :, k_start:k_stop] += gk
                    dvx[:, :, k_start:k_stop] += gv
                    continue
                qi = _rows(_query_index(q_off, q0, q1, query.device), rev, 0)
                mask = _flash_mask(tile, plan, qi, q0, q1, k_start, k_stop, valid, b, h)
                qb, kb, vb = _rows(q[:, :, q0:q1], rev), kx[:, :, k_start:k_stop], vx[:, :, k_start:k_stop]
                mask, lse_b, unscale = _subnormal_free(mask, qb, kb, _rows(lse[:, :, q0:q1], rev, -1), b)
                gq, gk, gv = _flash_bwd(_rows(do[:, :, q0:q1], rev), qb, kb, vb, _rows(out[:, :, q0:q1], rev), lse_b,
                                        0.0, False, attn_mask=mask, scale=1.0)
                dq[:, :, q0:q1] = _rows(gq.mul_(unscale), rev)
                dkx[:, :, k_start:k_stop] += gk.mul_(unscale)
                dvx[:, :, k_start:k_stop] += gv.mul_(unscale)
            if h != hkv:
                dk = dkx.view(b, hkv, h // hkv, k_len, d).sum(2)
                dv = dvx.view(b, hkv, h // hkv, k_len, d).sum(2)
        for q0 in range(0, q_len if not flash else 0, plan.block_q):
            q1 = min(q0 + plan.block_q, q_len)
            n = q1 - q0
            qi = _rows(_query_index(q_off, q0, q1, query.device), rev, 0)
            qb = _rows(q[:, :, q0:q1], rev)
            qg = _group(qb, hkv)
            dob = _rows(do[:, :, q0:q1], rev)
            dog = _group(dob, hkv)
            lse_b = _rows(lse[:, :, q0:q1, None], rev)
            delta_b = _rows(delta[:, :, q0:q1], rev)
            qa = qb @ tile.a_key.T if plan.kind == "shaw" else None
            dv_table = dob @ tile.a_value.T if plan.kind == "shaw" else None  # dO · a^V (B, H, n, 2K + 1)
            dqa = torch.zeros_like(qa) if plan.kind == "shaw" else None
            dq_b = q.new_zeros(b, hkv, qg.shape[2], d)
            k_stop = plan.key_stop(q1, k_len)
            for k0 in range(plan.key_start(q0, k_len), k_stop, plan.block_k):
                k1 = min(k0 + plan.block_k, k_stop)
                kb, vb = k[:, :, k0:k1], v[:, :, k0:k1]
                s = _logits(qg, kb, tile.bias(qi, q0, q1, k0, k1, qa), h, plan.kind == "fire")
                s = _apply_mask(s, plan, qi, q0, k0, k1, valid)
                s = s.sub_(lse_b)  # rows that see no key have lse = +inf -> p = 0
                p = exp_flushed(s)  # (B, H, n, m)
                pg = _group(p, hkv)
                dv[:, :, k0:k1] += pg.transpose(-1, -2) @ dog
                dp = _ungroup(dog @ vb.transpose(-1, -2), h)
                if plan.kind == "shaw":
                    idx = tile._shaw_index(qi, k0, k1, dp.shape[:2])
                    dp.add_(dv_table.gather(-1, idx))
                    d_avalue += (_shaw_buckets(tile, p, qi, k0, k1).transpose(-1, -2) @ dob).sum((0, 1))
                if g_dist is not None:  # dS straight into the buffer its anti-diagonal sums read (no copy)
                    buf = _skew_buffer(p, k1 - k0)
                    ds = torch.mul(dp.sub_(delta_b), p, out=buf[..., : k1 - k0])
                else:
                    ds = dp.sub_(delta_b).mul_(p)  # dS: the gradient of the logits
                dsg = _group(ds, hkv)
                dq_b += dsg @ kb
                dk[:, :, k0:k1] += dsg.transpose(-1, -2) @ qg
                if g_dist is not None:  # rows reversed: anti-diagonal c is rev index t0 + c (see Tile.bias)
                    t0 = q_len - q1 + k0
                    g_dist[:, t0 : t0 + n + (k1 - k0) - 1] += _antidiagonal_sums(buf, k1 - k0)
                elif dc is not None:
                    dc[..., k0:k1] -= ds.sum(-2)
                    rows = ds.sum(-1)
                    if isinstance(q_off, torch.Tensor):
                        dc.index_add_(-1, qi, rows)
                    else:
                        dc[..., q_off + q0 : q_off + q1] += rows
                elif plan.kind == "fire" and want_term:
                    tile.fire.grads(ds, q0, q1, fire_need, fire_grads)
                elif plan.kind == "shaw":
                    dqa.scatter_add_(-1, tile._shaw_index(qi, k0, k1, ds.shape[:2]), ds)
            dq[:, :, q0:q1] = _rows(_ungroup(dq_b, h), rev)
            if plan.kind == "shaw":  # qa = scale · q a^Kᵀ: dq += scale · dqa a^K (× scale below), da^K += dqaᵀ (scale q)
                dq[:, :, q0:q1] += dqa @ tile.a_key
                d_akey += (dqa.transpose(-1, -2) @ qb).sum((0, 1))
        dq = dq * plan.scale
        grads = _term_grads(plan, tensors, need, tile, g_dist, dc, fire_grads, d_akey, d_avalue)
        return (dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), None, None, None, *grads)


def _logits(qg: torch.Tensor, kb: torch.Tensor, bias: torch.Tensor | None, h: int, fresh: bool) -> torch.Tensor:
    """q · k + bias of a tile (B, H, n, m), from the grouped queries qg (B, Hkv, G·n, D) and keys kb (B, Hkv, m, D).
    A ``fresh`` bias of the full shape (FIRE's, built for this tile) takes the product in place (``baddbmm_``: one
    pass over the tile less than a product and an add)."""
    b, hkv, gn, d = qg.shape
    m = kb.shape[2]
    if bias is not None and fresh and bias.shape == (b, h, gn * hkv // h, m) and bias.is_contiguous():
        bias.view(b * hkv, gn, m).baddbmm_(qg.reshape(b * hkv, gn, d), kb.reshape(b * hkv, m, d).transpose(1, 2))
        return bias
    s = _ungroup(qg @ kb.transpose(-1, -2), h)
    if bias is None:
        return s
    return s + bias if s.shape != torch.broadcast_shapes(s.shape, bias.shape) else s.add_(bias)


def _shaw_buckets(tile: _Tile, p: torch.Tensor, qi: torch.Tensor, k0: int, k1: int) -> torch.Tensor:
    """Σ_j P_ij over the keys of each relative bucket: (B, H, n, 2K + 1)."""
    idx = tile._shaw_index(qi, k0, k1, p.shape[:2])
    return p.new_zeros(*p.shape[:3], 2 * tile.kmax + 1).scatter_add_(-1, idx, p)


def _term_grads(plan, tensors, need, tile, g_dist, dc, fire_grads, d_akey, d_avalue) -> list:
    """The gradients of the term tensors, in ``plan.names`` order."""
    grads: list = [None] * len(tensors)
    if plan.kind in TOEPLITZ_KINDS and g_dist is not None:
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(bool(w)) for t, w in zip(tensors, need)]
            values = distance_values(plan.term(tuple(leaves)), tile.delta)
            wanted = [x for x, w in zip(leaves, need) if w]
            got = torch.autograd.grad(values, wanted, g_dist.flip(-1).to(values.dtype), allow_unused=True)
        it = iter(got)
        for i, w in enumerate(need):
            if w:
                grads[i] = next(it)
    elif plan.form == "gate" and dc is not None:
        grads[0] = dc
    elif plan.kind == "alibi" and dc is not None:  # c[j] = −slope · j (the key channel)
        j = torch.arange(dc.shape[-1], device=dc.device, dtype=dc.dtype)
        grads[plan.names.index("slopes")] = -(dc * j).sum((0, 2))
    elif plan.kind == "fire":
        grads = [fire_grads.get(name) for name in plan.names]
    elif plan.kind == "shaw":
        grads[plan.names.index("key_table")] = d_akey
        grads[plan.names.index("value_table")] = d_avalue
    return [None if g is None else g.to(t.dtype) for g, t in zip(grads, tensors)]


def tiled_unsupported(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, term: KernelTerm) -> str | None:
    """None when :func:`tiled_attention` takes these inputs, else the reason (a sentence)."""
    key = term.key if term.key is not None else key
    value = term.value if term.value is not None else value
    if term.kind not in TILED_KINDS:
        return f"the tile-wise attention has no {term.kind!r} term"
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

    Returns:
        (B, H, Lq, D) in the query's dtype; rows without any visible key are 0.

    Raises:
        ValueError: the term does not fit the inputs (see :func:`tiled_unsupported`), bad block sizes, or a
            window below 1.
        TypeError: ``window`` is not an int (or None), or ``q_offset`` is neither an int nor a tensor.
    """
    window = check_window(window)
    if block_q is None:
        block_q = BLOCK_Q if window is None else max(64, min(BLOCK_Q, window // 2))
    if not (isinstance(block_q, int) and isinstance(block_k, int) and block_q >= 1 and block_k >= 1):
        raise ValueError(f"block_q and block_k must be positive ints, got {block_q!r}, {block_k!r}")
    key = term.key if term.key is not None else key
    value = term.value if term.value is not None else value
    reason = tiled_unsupported(query, key, value, term)
    if reason is not None:
        raise ValueError(reason)
    off_tensor = isinstance(q_offset, torch.Tensor)
    term.check(query, key, 0 if off_tensor else q_offset)
    if not off_tensor and not isinstance(q_offset, int):
        raise TypeError(f"q_offset must be an int or a 0-d tensor, got {type(q_offset).__name__}")
    names = tuple(term.tensors)
    plan = _Plan(term.kind, names, dict(term.ints), float(scale), bool(causal),
                 None if off_tensor else q_offset, block_q, block_k, window)
    valid = None if key_valid is None else key_valid.to(device=query.device, dtype=torch.bool)
    q_off_t = q_offset.to(device=query.device, dtype=torch.long).reshape(()) if off_tensor else None
    return TiledAttentionFunction.apply(query, key, value, valid, q_off_t, plan, *term.tensors.values())
