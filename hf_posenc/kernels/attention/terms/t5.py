"""``t5`` (Raffel et al., https://arxiv.org/abs/1910.10683; the encoding: ``hf_posenc.encodings.t5``, which
computes the buckets):

    B_h(i, j) = table[buckets[clip(j − qi, −M, M) + M], h],    table (NB, H), buckets (2M + 1,) integer

The Triton kernel's dQ programs accumulate a histogram Σ dS per bucket in registers (at most
``T5_BRANCH_MAX_ROWS`` rows), summed here into the table's gradient.
"""

from __future__ import annotations

import torch

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

#: the largest t5 table the Triton t5 branch's backward takes: its dQ programs hold a histogram of
#: next_power_of_2(rows) float32 cells in registers and loop over the rows present in each tile.
T5_BRANCH_MAX_ROWS = 256


def _distance(t: dict, h: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    table, buckets = t["table"], t["buckets"].long()
    m = (buckets.shape[0] - 1) // 2
    return table[buckets[(-delta.long()).clamp(-m, m) + m], h]


def _validate(t: dict) -> None:
    b = t["buckets"]
    if b.dim() != 1 or b.shape[0] % 2 == 0 or b.is_floating_point():
        raise ValueError(f"t5 buckets must be an integer vector of odd length 2M + 1, got {tuple(b.shape)}")


def _example(shape, q_offset, g, device, realistic=False) -> TermExample:
    nb, m = (32, 128) if realistic else (8, 20)  # T5's 32 buckets over ±128, or a small table
    table = leaf(torch.randn(nb, shape[1], generator=g), device)
    # causal buckets of j − qi = −M .. M: the distance max(qi − j, 0) itself up to NB − 1, then the last bucket
    buckets = (-torch.arange(-m, m + 1)).clamp(0, nb - 1).to(device)
    return TermExample({"table": table}, {"buckets": buckets}, lambda t: KernelTerm.t5(t["table"], t["buckets"]))


def _sizes(term: KernelTerm) -> dict[str, int]:
    rows = term.tensors["table"].shape[0]
    return {"ti0": (term.tensors["buckets"].shape[0] - 1) // 2, "ti1": rows, "nhp": max(16, next_power_of_2(rows))}


def _grads(launch, tensors, rowg, hist, dqa, dck) -> list:
    return [hist.sum((0, 2))[:, : launch.ti1], None]  # the (H, NB) kernel table's, the buckets' none


SPEC = register_term(TermSpec(
    "t5", "toeplitz", "table[buckets[clip(j − qi, −M, M) + M], h]",
    tensors=(TensorSpec("table", ("NB", "H")), TensorSpec("buckets", ("2M + 1",), grad=False)),
    distance=_distance, validate=_validate, example=_example, triton="t5",
    kernel=TritonHooks(
        tensors=lambda term, q: [term.tensors["table"].float().transpose(0, 1).contiguous(),
                                 term.tensors["buckets"].to(torch.int32).contiguous()],
        group="t5", sizes=_sizes, histogram=True, grads=_grads),
))
