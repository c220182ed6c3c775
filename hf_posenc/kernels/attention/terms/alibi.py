"""``alibi`` (Press et al., https://arxiv.org/abs/2108.12409; the encoding: ``hf_posenc.encodings.alibi``):

    B_h(i, j) = −slopes[h] · |δ|,    δ = qi − j,    slopes (H,), fixed

Its ``slope`` form (−s[h] · |δ|) lets the tile engine carry it causally as a key channel and CAPE as one column.
"""

from __future__ import annotations

import torch

from ..term_spec import (
    KernelTerm,
    TensorSpec,
    TermExample,
    TermSpec,
    TritonHooks,
    _dist,
    at_least_float32,
    register_term,
)


def _distance(t: dict, h: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    return -t["slopes"][h] * _dist(delta, t["slopes"])


def _example(shape, q_offset, g, device, realistic=False) -> TermExample:
    h = shape[1]  # ALiBi's slopes for a power of two heads (Press et al.): 2^(−8k/H), k = 1 .. H
    slopes = (2.0 ** (-8.0 * torch.arange(1, h + 1) / h)).to(device)
    return TermExample({}, {"slopes": slopes}, lambda t: KernelTerm.alibi(t["slopes"]))


SPEC = register_term(TermSpec(
    "alibi", "toeplitz", "−slopes[h] · |δ|",
    tensors=(TensorSpec("slopes", ("H",), grad=False),),
    distance=_distance,
    example=_example,
    slope=lambda t: at_least_float32(t["slopes"]),
    triton="alibi",
    kernel=TritonHooks(tensors=lambda term, q: [term.tensors["slopes"].float().contiguous()]),
))
