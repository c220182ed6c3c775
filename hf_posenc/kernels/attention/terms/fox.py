"""``fox`` (Lin et al., https://arxiv.org/abs/2503.02130; the encodings: ``hf_posenc.encodings.fox`` and
``fox_pro``), c (B, H, Lk) the cumulative log forget gates (padding's gates already zeroed):

    B_h(i, j) = c[b, h, qi] − c[b, h, j]

A gate term: the tile engine carries c as a key channel; the Triton kernel reduces dc_j = −Σ_i dS_ij in its dK/dV
programs (per key) and Σ_j dS_ij in its dQ programs (one row plane, per query; zero up to rounding).
"""

from __future__ import annotations

import torch

from ....ops import eager_value_checks
from ..term_spec import KernelTerm, TensorSpec, TermExample, TermSpec, TritonHooks, leaf, register_term


def _pair(t, ints, b, h, i, qi, j):
    c = t["c"]
    return c[b, h, qi] - c[b, h, j]


def _check(term, query, key, q_offset) -> None:
    b, h, q_len, _ = query.shape
    k_len = key.shape[2]
    c = term.tensors["c"]
    if tuple(c.shape) != (b, h, k_len):
        raise ValueError(f"fox c must be (B, H, Lk) = {(b, h, k_len)}, got {tuple(c.shape)}")
    # A tensor offset (a StaticCache's) is read only in eager mode on CPU: elsewhere that is a device sync (and a
    # graph break under torch.compile), and a StaticCache keeps its queries among its keys anyway.
    if isinstance(q_offset, torch.Tensor) and not eager_value_checks(q_offset):
        return
    offset = int(q_offset)
    if offset + q_len > k_len:
        raise ValueError(f"fox needs the queries among the keys: q_offset + Lq <= Lk, got {offset} + {q_len} > {k_len}")


def _example(shape, q_offset, g, device, realistic=False) -> TermExample:
    b, h, lk = shape[0], shape[1], shape[4]
    log_f = leaf(torch.nn.functional.logsigmoid(torch.randn(b, h, lk, generator=g) + 2.0), device)
    return TermExample({"log_f": log_f}, {}, lambda t: KernelTerm.fox(t["log_f"].cumsum(-1)))


def _grads(launch, tensors, rowg, hist, dqa, dck) -> list:
    dc = dck.clone()
    rows = launch.q_offset.long() + torch.arange(launch.lq, device=dc.device)  # the queries' key indices
    dc.index_add_(2, rows, rowg[0])
    return [dc]


SPEC = register_term(TermSpec(
    "fox", "gate", "c[b, h, qi] − c[b, h, j]",
    tensors=(TensorSpec("c", ("B", "H", "Lk")),),
    pair=_pair, check=_check, example=_example, triton="fox",
    kernel=TritonHooks(tensors=lambda term, q: [term.tensors["c"].float().contiguous()], key_grad=True, row_planes=1,
                       grads=_grads),
))
