"""``shaw`` (Shaw et al., https://arxiv.org/abs/1803.02155; the encoding: ``hf_posenc.encodings.shaw``), tables
a^K, a^V (2K + 1, D) shared by the heads, r = clip(j − qi, −K, K) + K:

    s_ij = scale · q_i · (k_j + a^K_r)        (the key term: scale · q_i · a^K_r)
    o_i  = Σ_j P_ij (v_j + a^V_r)             (the value term: Σ_j P_ij a^V_r)

A pair term with a value term: no FlexAttention form. The tile engine gathers q · a^K per tile and sums P per
bucket for the value term (``ShawTiles``); causal on the CPU in float32 it runs the fused kernel with only a
band of K keys per row carrying a term (``_tiled_fused._ShawBand``). The Triton kernel gathers q · a^K, forms the
per-row histogram W of P (forward) and the histogram of dS (backward).
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
    at_least_float32,
    leaf,
    next_power_of_2,
    register_term,
)


def _pair(t, ints, b, h, i, qi, j):
    k = ints["max_relative_position"]
    return t["qa"][b, h, i, (j - qi).clamp(-k, k) + k]


def _values(t, ints, probs, qi, j):
    """Σ_j P_ij value_table[clip(j − qi, −K, K) + K]: the probabilities summed per relative bucket, times the table."""
    k = ints["max_relative_position"]
    b, h, q_len, k_len = probs.shape
    rel = (j - qi).clamp(-k, k) + k
    buckets = probs.new_zeros(b, h, q_len, 2 * k + 1).scatter_add(-1, rel.expand(b, h, q_len, k_len), probs)
    return buckets @ t["value_table"].to(buckets.dtype)


def _check(term, query, key, q_offset) -> None:
    if term.tensors["key_table"].shape[1] != query.shape[-1]:
        raise ValueError(
            f"shaw tables must have head_dim {query.shape[-1]} columns, got {tuple(term.tensors['key_table'].shape)}"
        )


def _validate(t: dict) -> None:
    a, v = t["key_table"], t["value_table"]
    if a.shape != v.shape or a.shape[0] % 2 == 0:
        raise ValueError(f"shaw tables must both be (2K + 1, D), got {tuple(a.shape)} and {tuple(v.shape)}")


def _example(shape, q_offset, g, device, realistic=False) -> TermExample:
    d, rows = shape[5], 33 if realistic else 11  # K = 16 (Shaw et al.'s largest clip) or 5
    a_k = leaf(torch.randn(rows, d, generator=g) * 0.3, device)
    a_v = leaf(torch.randn(rows, d, generator=g) * 0.3, device)
    return TermExample({"key_table": a_k, "value_table": a_v}, {},
                       lambda t: KernelTerm.shaw(t["key_table"], t["value_table"]))


class ShawTiles(PairTiles):
    """Shaw's terms on the tile engine. Online passes: the key term gathers q · a^K (B, H, n, 2K + 1) at each pair's
    relative bucket; its gradient and the value term's bucket sums of P are scatter-added per tile into
    (B, H, n, 2K + 1). Fused CPU path (causal only): ``_tiled_fused._ShawBand``."""

    def __init__(self, plan, t: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        super().__init__(plan, t, dtype)
        self.kmax = plan.ints["max_relative_position"]
        self.a_key = t["key_table"].detach().to(dtype)
        self.a_value = t["value_table"].detach().to(dtype)
        self.d_key = self.d_value = None

    @classmethod
    def fused(cls, plan) -> bool:
        """The fused path recomputes the value term from a causal band only."""
        return plan.causal

    def fused_forward(self, plan, tile, q, k, v, valid, q_off, b, h, d, out, lse) -> None:
        from .._tiled_fused import _expand_heads, _shaw_fused_forward

        _shaw_fused_forward(plan, self, q, _expand_heads(k, h), _expand_heads(v, h), valid, q_off, b, h, d, out, lse)

    def fused_backward(self, plan, tile, q, k, v, out, lse, do, valid, q_off, b, h, hkv, d):
        from .._tiled_fused import _shaw_fused_backward

        dq, dk, dv, d_key, d_value = _shaw_fused_backward(plan, self, q, k, v, out, lse, do, valid, q_off, b, h, hkv, d)
        return dq, dk, dv, {"key_table": d_key, "value_table": d_value}

    def index(self, qi: torch.Tensor, k0: int, k1: int, bh: torch.Size) -> torch.Tensor:
        """The relative bucket clip(j − qi, −K, K) + K of each pair, broadcast to (*bh, n, m)."""
        rel = torch.arange(k0, k1, device=qi.device)[None, :] - qi[:, None]
        idx = rel.clamp(-self.kmax, self.kmax) + self.kmax
        return idx.expand(*bh, *idx.shape)

    def buckets(self, p: torch.Tensor, qi: torch.Tensor, k0: int, k1: int) -> torch.Tensor:
        """Σ_j P_ij over the keys of each relative bucket: (B, H, n, 2K + 1)."""
        idx = self.index(qi, k0, k1, p.shape[:2])
        return p.new_zeros(*p.shape[:3], 2 * self.kmax + 1).scatter_add_(-1, idx, p)

    def block(self, qb: torch.Tensor) -> torch.Tensor:
        return qb @ self.a_key.T  # scale · q · a^K (B, H, n, 2K + 1)

    def bias(self, qi, q0, q1, k0, k1, ctx):
        return ctx.gather(-1, self.index(qi, k0, k1, ctx.shape[:2]))

    def add_values(self, acc, p, qi, k0, k1) -> None:
        acc.add_(self.buckets(p, qi, k0, k1) @ self.a_value)

    def start_backward(self, need: dict[str, bool]) -> None:
        self.d_key, self.d_value = torch.zeros_like(self.a_key), torch.zeros_like(self.a_value)

    def backward_block(self, qb, dob, ctx):
        # (dO · a^V (B, H, n, 2K + 1), the output gradient, the gradient of qa = scale · q a^Kᵀ)
        return dob @ self.a_value.T, dob, torch.zeros_like(ctx)

    def grad_dp(self, state, dp, p, qi, k0, k1) -> None:
        dv_table, dob, _ = state
        dp.add_(dv_table.gather(-1, self.index(qi, k0, k1, dp.shape[:2])))
        self.d_value += (self.buckets(p, qi, k0, k1).transpose(-1, -2) @ dob).sum((0, 1))

    def grad_tile(self, state, ds, qi, q0, q1, k0, k1) -> None:
        state[2].scatter_add_(-1, self.index(qi, k0, k1, ds.shape[:2]), ds)

    def end_block(self, state, qb):
        # qa = scale · q a^Kᵀ: dq += scale · dqa a^K (× scale by the engine), da^K += dqaᵀ (scale q)
        dqa = state[2]
        self.d_key += (dqa.transpose(-1, -2) @ qb).sum((0, 1))
        return dqa @ self.a_key

    def grads(self) -> dict[str, torch.Tensor]:
        return {"key_table": self.d_key, "value_table": self.d_value}


def _kernel_tensors(term: KernelTerm, q: torch.Tensor) -> list[torch.Tensor]:
    qa = q.float() @ term.tensors["key_table"].float().T  # (B, H, Lq, 2K + 1): q · a^K, gathered in the kernel
    return [qa.contiguous()]


def _sizes(term: KernelTerm) -> dict[str, int]:
    k = term.ints["max_relative_position"]
    return {"ti0": k, "rp": max(16, next_power_of_2(2 * k + 1))}


SPEC = register_term(TermSpec(
    "shaw", "pair", "scale · q_i . key_table[clip(j − qi, −K, K) + K] (+ the value term)",
    tensors=(TensorSpec("key_table", ("2K + 1", "D")), TensorSpec("value_table", ("2K + 1", "D"))),
    # the key term is scale-free here: the reference scales q . a^K with the logits
    prepare=lambda term, query: {"qa": at_least_float32(query) @ at_least_float32(term.tensors["key_table"]).T},
    pair=_pair, value_term=_values, ints=("max_relative_position",),
    ints_of=lambda t: {"max_relative_position": (t["key_table"].shape[0] - 1) // 2},
    check=_check, validate=_validate, example=_example, tiles=ShawTiles, triton="shaw",
    kernel=TritonHooks(tensors=_kernel_tensors, group="shaw", sizes=_sizes,
                       values=lambda term, w: w @ term.tensors["value_table"].float(),
                       grads=lambda launch, tensors, rowg, hist, dqa, dck: [dqa]),
))
