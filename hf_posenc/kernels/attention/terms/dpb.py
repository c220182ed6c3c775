"""``dpb``, Dynamic Position Bias (Wang et al., https://arxiv.org/abs/2108.00154; the encoding:
``hf_posenc.encodings.dpb``, which evaluates its MLP once per signed distance):

    B_h(i, j) = table[h, clip(δ, −M, M) + M],    table (H, 2M + 1): the MLP per signed δ = qi − j

No Triton branch of its own: it runs on t5's (``lower``: the table's rows flipped, identity buckets).
"""

from __future__ import annotations

import torch

from ..term_spec import KernelTerm, TensorSpec, TermExample, TermSpec, leaf, register_term
from .t5 import T5_BRANCH_MAX_ROWS


def _distance(t: dict, h: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    table = t["table"]
    m = (table.shape[1] - 1) // 2
    return table[h, delta.long().clamp(-m, m) + m]


def _validate(t: dict) -> None:
    if t["table"].shape[1] % 2 == 0:
        raise ValueError(f"dpb table must be (H, 2M + 1), got shape {tuple(t['table'].shape)}")


def _lower(term: KernelTerm) -> KernelTerm:
    """The same term on Triton's t5 branch: table (2M + 1, H) rows for relative positions j − qi = −M .. M, the
    identity as its buckets (row M − δ holds the value at δ)."""
    table = term.tensors["table"]
    rows = table.shape[1]
    return KernelTerm.t5(table.flip(1).T, torch.arange(rows, device=table.device))


def _triton_limit(term: KernelTerm, grad: bool) -> str | None:
    rows = term.tensors["table"].shape[1]
    if grad and rows > T5_BRANCH_MAX_ROWS:
        return (f"the dpb table spans {rows} relative positions; its gradient in the Triton kernel goes through the "
                f"t5 branch's per-program histogram, which holds at most {T5_BRANCH_MAX_ROWS} (registers)")
    return None


def _example(shape, q_offset, g, device, realistic=False) -> TermExample:
    b, h, hkv, lq, lk, d = shape
    m = max(lk - 1, q_offset + lq - 1)
    table = leaf(torch.randn(h, 2 * m + 1, generator=g) * 0.5, device)
    return TermExample({"table": table}, {}, lambda t: KernelTerm.dpb(t["table"]))


SPEC = register_term(TermSpec(
    "dpb", "toeplitz", "table[h, clip(δ, −M, M) + M]",
    tensors=(TensorSpec("table", ("H", "2M + 1")),),
    distance=_distance, validate=_validate, example=_example, triton="t5", lower=_lower,
    triton_limit=_triton_limit,
))
