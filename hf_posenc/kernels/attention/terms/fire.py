"""``fire`` (Li et al., https://arxiv.org/abs/2310.04418; the encoding: ``hf_posenc.encodings.fire``, which
tabulates its MLP f_θ on a grid of N points over [0, x_max]):

    B_h(i, j) = interp(table[h], u),  u = ψ(max(δ, 0)) · inv_norm[b, i] · (N − 1) / x_max,  ψ(x) = log(1 + c · x)

``interp(t, u)`` is linear interpolation, t[⌊u⌋] (1 − w) + t[⌊u⌋ + 1] w with w = u − ⌊u⌋ (u clamped to
[0, N − 1]). A pair term: the tile engine builds its tiles by hand (``FireTiles``); the Triton kernel's dQ
programs accumulate the table's histogram and two row planes (inv_norm's and c's gradients).
"""

from __future__ import annotations

import torch

from .._tiles import PairTiles
from ..term_spec import (
    KernelTerm,
    TensorSpec,
    TermExample,
    TermSpec,
    TritonHooks,
    leaf,
    next_power_of_2,
    register_term,
)


def fire_psi(c: torch.Tensor, dpos: torch.Tensor) -> torch.Tensor:
    """FIRE's ψ(δ) = log(1 + c δ) at the (clamped, non-negative) distances ``dpos``."""
    return torch.log1p(c * dpos)


def fire_cell(u: torch.Tensor, n: int, inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(cell ⌊u⌋ <= N − 2, weight u − cell of cell + 1) of FIRE's fractional cells ``u`` (clamped to [0, N − 1]),
    for a table of N points. The cell carries no gradient; the weight carries u's (``inplace``: the weight is
    written over the clamped copy of u, one tile less to allocate; for inputs that need no gradient)."""
    u = u.clamp(0.0, n - 1.0)
    if inplace:
        cell = u.floor().clamp_(max=n - 2)
        return cell, u.sub_(cell)
    cell = u.detach().floor().clamp(max=n - 2)
    return cell, u - cell


def _pair(t, ints, b, h, i, qi, j):
    table, c, inv = t["table"], t["c"], t["inv_norm"]
    n = table.shape[1]
    scale = (n - 1) / t["x_max"].detach()
    dpos = (qi - j).clamp(min=0).to(table.dtype)
    u = fire_psi(c, dpos) * (inv[b if inv.shape[0] > 1 else 0, i] * scale)
    cell, w = fire_cell(u, n)
    k0 = cell.long()
    if k0.dim() == 0:  # FlexAttention's 0-d indices
        t0 = table[h, k0]
        return t0 + w * (table[h, k0 + 1] - t0)
    # broadcast index tensors (h constant along the keys): each head's row gathered at the cells; advanced indexing
    # table[h, k0] and its backward (an index_put with accumulation) took 27 % of CAPE's training step with a FIRE
    # base on the CPU (profiled), gather and its backward (scatter_add) take a fraction of that
    shape = torch.broadcast_shapes(h.shape, k0.shape)
    rows = table[h][..., 0, :].expand(*shape[:-1], n)  # (..., N): the row of each query's head
    idx = k0.expand(shape)
    t0 = rows.gather(-1, idx)
    return t0 + w * (rows.gather(-1, idx + 1) - t0)


def _validate(t: dict) -> None:
    if t["table"].shape[1] < 2:
        raise ValueError(f"fire table must be (H, N) with N >= 2, got shape {tuple(t['table'].shape)}")


def _check(term, query, key, q_offset) -> None:
    b, q_len = query.shape[0], query.shape[2]
    inv = term.tensors["inv_norm"]
    if inv.shape[0] not in (1, b) or inv.shape[1] != q_len:
        raise ValueError(f"fire inv_norm must be (1 or B={b}, Lq={q_len}), got {tuple(inv.shape)}")


def _example(shape, q_offset, g, device, realistic=False) -> TermExample:
    b, h, lq = shape[0], shape[1], shape[3]  # a small table (interpreter time)
    table = leaf(torch.randn(h, 64 if realistic else 24, generator=g), device)
    c = leaf(torch.tensor(0.3), device)
    inv_norm = leaf(torch.rand(b, lq, generator=g) * 0.2 + 0.2, device)
    q_idx = torch.arange(lq, dtype=torch.float32, device=device) + q_offset
    # the grid's extent a little past the largest visible pair: no pair sits on the clamp at the grid's end, where
    # float32 and a float64 reference could round to different sides of the kink
    x_max = (torch.log1p(c.detach() * q_idx)[None] * inv_norm.detach()).max().clamp_min(1.0) * 1.05
    return TermExample({"table": table, "c": c, "inv_norm": inv_norm}, {"x_max": x_max},
                       lambda t: KernelTerm.fire(t["table"], t["c"], t["inv_norm"], t["x_max"]))


class FireTiles(PairTiles):
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

    fresh = True  # each tile's bias is built for it: the logits are added into it

    def __init__(self, plan, t: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        super().__init__(plan, t, dtype)
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
        self._need: dict[str, bool] = {}
        self._acc: dict[str, torch.Tensor] = {}

    def spread(self) -> float:
        """Interpolated values lie between the table's: its largest gap per head."""
        values = self.values[: self.heads]
        return float((values.amax(-1) - values.amin(-1)).max())

    def bias(self, qi: torch.Tensor, q0: int, q1: int, k0: int, k1: int, ctx=None) -> torch.Tensor:
        """(B|1, H, n, m) for queries at key indices ``qi`` (rows q0:q1 of inv_norm) and keys k0 .. k1 − 1."""
        delta = (qi[:, None] - torch.arange(k0, k1, device=qi.device)[None, :]).clamp_(min=0).to(self.c.dtype)
        psi = fire_psi(self.c, delta)  # (n, m)
        raw = psi[None] * (self.inv_norm[:, q0:q1, None] * self.scale)  # (B|1, n, m)
        cell, w = fire_cell(raw, self.n, inplace=True)  # w: the weight of cell + 1
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

    def start_backward(self, need: dict[str, bool]) -> None:
        """Keep each tile's parts from its bias to its gradient when some tensor needs one."""
        self._need, self._acc = need, {}
        self.keep = any(need.values())

    def grad_tile(self, state, ds: torch.Tensor, qi: torch.Tensor, q0: int, q1: int, k0: int, k1: int) -> None:
        if self.keep:
            self.add_grads(ds, q0, q1, self._need, self._acc)

    def grads(self) -> dict[str, torch.Tensor]:
        return self._acc

    def add_grads(self, ds: torch.Tensor, q0: int, q1: int, need: dict[str, bool],
                  acc: dict[str, torch.Tensor]) -> None:
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


def _kernel_tensors(term: KernelTerm, q: torch.Tensor) -> list[torch.Tensor]:
    t = term.tensors
    n = t["table"].shape[1]
    x_scale = ((n - 1) / t["x_max"].detach().float()).reshape(1)
    return [t["table"].float().contiguous(), t["inv_norm"].float().contiguous(), t["c"].float().reshape(1), x_scale]


def _sizes(term: KernelTerm) -> dict[str, int]:
    n = term.tensors["table"].shape[1]
    return {"ti0": n, "nhp": max(16, next_power_of_2(n))}


def _grads(launch, tensors, rowg, hist, dqa, dck) -> list:
    d_inv = rowg[0].sum(1)  # (B, Lq): summed over heads
    if tensors[1].shape[0] == 1:
        d_inv = d_inv.sum(0, keepdim=True)
    return [hist.sum((0, 2))[:, : launch.ti0], d_inv, rowg[1].sum().reshape(1), None]


SPEC = register_term(TermSpec(
    "fire", "pair", "interp(table[h], log(1 + c·max(δ, 0)) · inv_norm[b, i] · (N − 1) / x_max)",
    tensors=(TensorSpec("table", ("H", "N")), TensorSpec("c", ()), TensorSpec("inv_norm", ("B", "Lq")),
             TensorSpec("x_max", (), grad=False)),
    pair=_pair, validate=_validate, check=_check, example=_example, tiles=FireTiles, triton="fire",
    kernel=TritonHooks(
        tensors=_kernel_tensors, group="fire", sizes=_sizes,
        batch_stride=lambda tensors: tensors[1].stride(0) if tensors[1].shape[0] > 1 else 0,
        row_planes=2, histogram=True, grads=_grads),
))
