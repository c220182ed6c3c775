"""The tile engine's fused-CPU path (see ``tiled.py``): each query block through torch's fused CPU attention kernel
(``aten::_scaled_dot_product_flash_attention_for_cpu`` and its backward) with the block's term as float masks
split at the diagonal, a gate as one more key channel, Shaw's band, and the flush of subnormal probabilities."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._cpu_flash import FLASH_BACKWARD as _flash_bwd, FLASH_FORWARD as _flash_fwd
from .._subnormal import EXP_FLOOR
from ._tiles import (
    _apply_mask,
    _empty_rows,
    _expand_heads,
    _Plan,
    _query_blocks,
    _rows,
    _Tile,
)


# EXP_FLOOR (hf_posenc.kernels._subnormal): a probability exp(s − lse) below e^EXP_FLOOR is subnormal. The fused
# CPU backward recomputes such probabilities wherever a bias decays far (ALiBi: the backward of a 2048-key
# causal step took 115 ms with them, 47 ms without, measured with flush-to-zero set before torch's threads
# started; see `_subnormal_free`).
#: the largest shift (nats) by which `_subnormal_free` scales the probabilities and every gradient of a
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


def _flash_available(plan: _Plan, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the tiles can go through torch's fused CPU attention kernel (additive float mask per tile):
    CPU float32 compute; a pair term where its tiles say so (Shaw, whose value term needs the probabilities: only
    when causal, ``_ShawBand``)."""
    return (fused_applies(plan, device, dtype) and plan.fused is not False)


def fused_applies(plan: _Plan, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's fused CPU kernel can run this call at all (the autotuner chooses between it and the
    online passes only where it can)."""
    return (device.type == "cpu" and dtype == torch.float32 and (plan.form != "pair" or plan.spec.tiles.fused(plan))
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
        if self.plan.window is not None:  # the band, and the sinks beside it
            ok = ok & ((j > qi[:, None] - self.plan.window) | (j < (self.plan.sink or 0)))
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
        """The block's keys k_start .. k_stop − 1 as fused-kernel parts (`_flash_parts_fwd`): the keys before
        the band strip unmasked (see `split`), then the strip with its mask."""
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
    for q0, q1, qi, ranges in _query_blocks(plan, q_len, k_len, q_off, q.device):
        if not ranges:
            out[:, :, q0:q1] = 0.0
            lse[:, :, q0:q1] = float("inf")
            continue
        qb = q[:, :, q0:q1]
        qa = qb @ band.d_key.T  # (B, H, n, K): q_i · (a^K_r − a^K_−K), q already scaled
        jc, ok = band.columns(qi, k_len, valid)
        o, lb, empty = _merged_ranges(plan, qi, valid, ranges, lambda k0, k1: _flash_parts_fwd(
            qb, kx[:, :, k0:k1], vx[:, :, k0:k1], band.parts(qi, q0, q1, k0, k1, valid, b, h, qa, jc, ok)))
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
    for q0, q1, qi, ranges in _query_blocks(plan, q_len, k_len, q_off, q.device):
        if not ranges:
            continue
        n = q1 - q0
        qb, dob, ob, lb = q[:, :, q0:q1], do[:, :, q0:q1], out[:, :, q0:q1], lse[:, :, q0:q1]
        qa = qb @ band.d_key.T
        jc, ok = band.columns(qi, k_len, valid)
        has = torch.isfinite(lb)[..., None]
        o_frame = ob - has * band.base_value
        for k_start, k_stop in ranges:
            parts = band.parts(qi, q0, q1, k_start, k_stop, valid, b, h, qa, jc, ok)
            gq, gk, gv = _flash_parts_bwd(dob, qb, kx[:, :, k_start:k_stop], vx[:, :, k_start:k_stop], o_frame, lb,
                                          parts)
            dq[:, :, q0:q1] += gq
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


def _channel_keys(kx: torch.Tensor, channel: torch.Tensor) -> torch.Tensor:
    """Keys (B, H, m, D) with the term's per-key channel (B|1, H, m) as one more channel (B, H, m, D + 1); the
    queries carry a 1 there (`_with_one`), so the fused kernel adds the term to q · k itself."""
    return torch.cat([kx, channel[..., None].expand(kx.shape[0], *channel.shape[1:], 1)], dim=-1)


def _with_one(q: torch.Tensor) -> torch.Tensor:
    """(B, H, L, D) -> (B, H, L, D + 1): a channel of ones, FoX's bias weight."""
    return torch.cat([q, q.new_ones(*q.shape[:-1], 1)], dim=-1)


def _with_zero(x: torch.Tensor) -> torch.Tensor:
    """(B, H, L, D) -> (B, H, L, D + 1): a channel of zeros (the fused kernel takes one head size for q, k, v)."""
    return torch.cat([x, x.new_zeros(*x.shape[:-1], 1)], dim=-1)


def _slope_channel(plan: _Plan, valid: torch.Tensor | None) -> bool:
    """Whether a −s[h] · |δ| term (its registry entry's ``slope``: ALiBi) runs as a key channel
    (`_Tile.key_channel`): causal with an int offset, where its bias −s (qi − j) is FoX's c[qi] − c[j] with
    c[j] = −s · j (a constant log forget gate), and with padding or a window (the blocks do not split at their
    diagonal). Measured at L = 2048, H = 8, D = 32 (AMD EPYC, 2
    threads, forward + backward against SDPA's): unsplit (B = 2, left padding, L = 1024) the channel took 124 ms
    against 185 ms for the per-block float mask with ``_subnormal_free`` (SDPA with a bool mask: 96-110 ms); split,
    ALiBi's far keys as a strided view of its Toeplitz values took 133 ms against the channel's 145 ms (SDPA
    108 ms): the kernel is about 17 % slower at head_dim 33 than 32, and reading a view costs it less. Not with the
    sinks at their cache positions: a far sink's −s · (W + sink − 1 − j) is no c[qi] − c[j]."""
    return (plan.spec.slope is not None and plan.causal and plan.q_offset is not None
            and not _splits_at_diagonal(plan, valid) and plan.cache_sinks is None)


def _splits_at_diagonal(plan: _Plan, valid: torch.Tensor | None) -> bool:
    """Whether the query blocks split at their diagonal square (`_diagonal_start`): causal with an int
    offset, no padding and no window."""
    return valid is None and plan.window is None and plan.causal and plan.q_offset is not None


def _block_parts(tile: "_Tile", plan: _Plan, qi: torch.Tensor, q0: int, q1: int, k_start: int, k_stop: int,
                 valid: torch.Tensor | None, b: int, h: int, channel: bool) -> list[_Part]:
    """The fused-kernel parts of one query block (queries at key indices ``qi``, in order) over its keys
    k_start .. k_stop − 1, with the term's float masks (none where the term rides in a key channel).

    Split at the diagonal square (`_diagonal_start`): the keys before it carry the term alone, the square the
    term and the kernel's own causal mask; nothing is filled with −inf. A Toeplitz term's far part is a strided
    view of its per-distance values (rows reversed: no copy; the kernel reads masks by their strides) and its
    square one mask per size for the whole call (δ = i − j on every block's square). Otherwise (padding, a
    window, a tensor offset, bidirectional) one part: the term with −inf where masked, rows reversed for a
    Toeplitz term (a copy of the view)."""
    m = k_stop - k_start
    rev = tile.form == "toeplitz" and not channel
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
    (`_diagonal_start`), with the term's masks of each (None: no term)."""
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
        out, lse = (o, l) if out is None else _merge(out, lse, o, l)
    return out, lse


def _merge(out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, l: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Two softmax attentions of the same rows over disjoint keys, (out (B, H, n, E), lse (B, H, n)) each, as one
    over all of their keys (a row with lse −inf on one side takes the other's)."""
    merged = torch.logaddexp(lse, l)
    return out * torch.exp(lse - merged)[..., None] + o * torch.exp(l - merged)[..., None], merged


def _merged_ranges(plan: _Plan, qi: torch.Tensor, valid: torch.Tensor | None, ranges: list[tuple[int, int]], run
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(out, lse, empty) of one query block over its key ranges (``_Plan.key_ranges``: the sinks apart from the
    window's keys): ``run(k_start, k_stop)`` gives a range's (out, lse) from the fused kernel, merged by
    log-sum-exp. The kernel returns lse 0 (and out 0) for a row that sees none of a range's keys, so with several
    ranges such a row enters the merge with lse −inf. ``empty``: (B|1, 1, n, 1) the rows that see no key at all
    (their out and lse are the caller's to set), or None."""
    out = lse = empty = None
    for i, (k_start, k_stop) in enumerate(ranges):
        o, l = run(k_start, k_stop)
        e = _empty_rows(plan, qi, valid, k_start, k_stop)
        if len(ranges) > 1 and e is not None:
            l = l.masked_fill(e[..., 0], float("-inf"))
        empty = e if i == 0 else (None if e is None or empty is None else empty & e)
        out, lse = (o, l) if out is None else _merge(out, lse, o, l)
    return out, lse, empty


def _flash_parts_bwd(dob, qb, kb, vb, ob, lb, parts: list[_Part]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of `_flash_parts_fwd` from the merged output ``ob`` and log-sum-exp ``lb``: each part's
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
    """The backward of the key-channel path (FoX, causal ALiBi: see `_Tile.key_channel`) through the fused
    CPU kernel, per query block and run of heads that share a first key, with c's gradient read from the channel
    that carries it: dc[j] = −Σ_i dS_ij (the per-row constant's gradient Σ_j dS_ij is 0: a softmax row's dS sums
    to 0). Subnormal probabilities are avoided as in `_subnormal_free`: per head, the keys no logit can lift
    are left out (`_flush_start`), and one shift per head lifts the rest. Where the forward split the
    block's keys (`_diagonal_start`), so does the backward: no mask; else the block's causal/padding mask,
    in which each row's own flush rides too. Returns dq (of the scaled q), dk, dv and dc (B, H, Lk) or None."""
    q_len, k_len = q.shape[2], k.shape[2]
    kx, vx = _expand_heads(k, h), _expand_heads(v, h)
    qa, va, oa, doa = _with_one(q), _with_zero(vx), _with_zero(out), _with_zero(do)
    knorm = kx.norm(dim=-1)  # (B, H, Lk)
    dq = torch.zeros_like(q)
    dkx, dvx = torch.zeros_like(kx), torch.zeros_like(vx)
    dc = q.new_zeros(b, h, k_len) if want_c else None
    for q0, q1, qi, ranges in _query_blocks(plan, q_len, k_len, q_off, q.device):
        for k_start, k_stop in ranges:  # one body per key range (the sinks apart from the window)
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
                    mask_h = mask[..., s0 - k_start :].expand(b, h1 - h0, q1 - q0, m).masked_fill(flushed,
                                                                                                  float("-inf"))
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


def fused_forward(plan: _Plan, tile: _Tile, q, k, v, valid, q_off, b, h, d, out, lse) -> None:
    """Fill ``out`` (B, H, Lq, D) and ``lse`` (B, H, Lq) block by block through torch's fused CPU kernel: a pair
    term's own path (Shaw's band, ``_ShawBand``), a gate's (and causal ALiBi's) key channel with the lse in the
    block's frame (``_Tile.key_channel``), or the term's float masks, split at the diagonal where the blocks allow
    (``_block_parts``). q (B, H, Lq, D) already scaled; k, v (B, Hkv, Lk, D)."""
    q_len, k_len = q.shape[2], k.shape[2]
    if tile.pair is not None and tile.pair.fused_forward is not None:  # the pair term's own path (shaw: _ShawBand)
        tile.pair.fused_forward(plan, tile, q, k, v, valid, q_off, b, h, d, out, lse)
        return
    channel = uses_key_channel(plan, valid)
    kx, vx = _expand_heads(k, h), _expand_heads(v, h)
    qf = _with_one(q) if channel else q
    vf = _with_zero(vx) if channel else vx
    for q0, q1, qi, ranges in _query_blocks(plan, q_len, k_len, q_off, q.device):
        if not ranges:
            out[:, :, q0:q1] = 0.0
            lse[:, :, q0:q1] = float("inf")
            continue

        def run(k_start: int, k_stop: int, q0: int = q0, q1: int = q1, qi: torch.Tensor = qi):
            kb = kx[:, :, k_start:k_stop]
            if channel:
                kb = _channel_keys(kb, tile.key_channel(qi, k_start, k_stop)[0])
            parts = _block_parts(tile, plan, qi, q0, q1, k_start, k_stop, valid, b, h, channel)
            return _flash_parts_fwd(qf[:, :, q0:q1], kb, vf[:, :, k_start:k_stop], parts)

        o, l, empty = _merged_ranges(plan, qi, valid, ranges, run)
        o = o[..., :d]
        if empty is not None:
            o = o.masked_fill(empty, 0.0)
            l = l.masked_fill(empty[..., 0], float("inf"))
        out[:, :, q0:q1] = o
        lse[:, :, q0:q1] = l


def uses_key_channel(plan: _Plan, valid: torch.Tensor | None) -> bool:
    """Whether the term rides in one more key channel on the fused path: a gate (FoX), or causal ALiBi with padding
    or a window (`_slope_channel`)."""
    return plan.form == "gate" or _slope_channel(plan, valid)


def fused_backward_plain(plan: _Plan, tile: _Tile, q, k, v, out, lse, do, valid, q_off, b, h, hkv, d,
                         underflow: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq (of the scaled q), dk, dv) through the fused kernel's backward per query block, for a call whose term
    takes no gradient: on the forward's parts where the blocks split at their diagonal (or no probability can be
    subnormal), else with the block's float mask and ``_subnormal_free``."""
    q_len, k_len = q.shape[2], k.shape[2]
    rev = plan.form == "toeplitz"
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    kx, vx = _expand_heads(k, h), _expand_heads(v, h)
    dkx = torch.zeros_like(kx) if h != hkv else dk
    dvx = torch.zeros_like(vx) if h != hkv else dv
    for q0, q1, qi_in_order, ranges in _query_blocks(plan, q_len, k_len, q_off, q.device):
        for k_start, k_stop in ranges:  # the sinks apart from the window's keys
            if not underflow or _splits_at_diagonal(plan, valid):  # the forward's parts
                parts = _block_parts(tile, plan, qi_in_order, q0, q1, k_start, k_stop, valid, b, h, False)
                gq, gk, gv = _flash_parts_bwd(do[:, :, q0:q1], q[:, :, q0:q1], kx[:, :, k_start:k_stop],
                                              vx[:, :, k_start:k_stop], out[:, :, q0:q1], lse[:, :, q0:q1], parts)
                dq[:, :, q0:q1] += gq
                dkx[:, :, k_start:k_stop] += gk
                dvx[:, :, k_start:k_stop] += gv
                continue
            qi = _rows(qi_in_order, rev, 0)
            mask = _flash_mask(tile, plan, qi, q0, q1, k_start, k_stop, valid, b, h)
            qb, kb, vb = _rows(q[:, :, q0:q1], rev), kx[:, :, k_start:k_stop], vx[:, :, k_start:k_stop]
            mask, lse_b, unscale = _subnormal_free(mask, qb, kb, _rows(lse[:, :, q0:q1], rev, -1), b)
            gq, gk, gv = _flash_bwd(_rows(do[:, :, q0:q1], rev), qb, kb, vb, _rows(out[:, :, q0:q1], rev), lse_b,
                                    0.0, False, attn_mask=mask, scale=1.0)
            dq[:, :, q0:q1] += _rows(gq.mul_(unscale), rev)
            dkx[:, :, k_start:k_stop] += gk.mul_(unscale)
            dvx[:, :, k_start:k_stop] += gv.mul_(unscale)
    if h != hkv:
        dk = dkx.view(b, hkv, h // hkv, k_len, d).sum(2)
        dv = dvx.view(b, hkv, h // hkv, k_len, d).sum(2)
    return dq, dk, dv
