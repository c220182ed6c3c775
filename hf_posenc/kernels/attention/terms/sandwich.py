"""``sandwich`` (Chi et al., https://arxiv.org/abs/2212.10356; the encoding: ``hf_posenc.encodings.sandwich``,
which builds the table from the cosine sum):

    B_h(i, j) = table[h, min(|δ|, T − 1)],    table (H, T): the bias per distance, fixed
"""

from __future__ import annotations

import torch

from ..term_spec import KernelTerm, TensorSpec, TermExample, TermSpec, TritonHooks, register_term


def _distance(t: dict, h: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    table = t["table"]
    return table[h, delta.abs().long().clamp(max=table.shape[1] - 1)]


def _validate(t: dict) -> None:
    if t["table"].shape[1] < 1:
        raise ValueError(f"sandwich table must be (H, T) with T >= 1, got shape {tuple(t['table'].shape)}")


def _example(shape, q_offset, g, device, realistic=False) -> TermExample:
    # a table shorter than the distances: the last column is reused
    table = torch.randn(shape[1], max(2, shape[4] // 2), generator=g).to(device)
    return TermExample({}, {"table": table}, lambda t: KernelTerm.sandwich(t["table"]))


SPEC = register_term(TermSpec(
    "sandwich", "toeplitz", "table[h, min(|δ|, T − 1)]",
    tensors=(TensorSpec("table", ("H", "T"), grad=False),),
    distance=_distance, validate=_validate, example=_example, triton="sandwich",
    kernel=TritonHooks(tensors=lambda term, q: [term.tensors["table"].float().contiguous()], group="t5",
                       sizes=lambda term: {"ti0": term.tensors["table"].shape[1]}),
))
