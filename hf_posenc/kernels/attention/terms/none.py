"""``none``: no position term (plain attention): B_h(i, j) = 0. Every engine runs it; the Triton kernel's branch 0."""

from __future__ import annotations

from ..term_spec import KernelTerm, TermExample, TermSpec, TritonHooks, register_term


def _example(shape, q_offset, g, device, realistic=False) -> TermExample:
    return TermExample({}, {}, lambda tensors: KernelTerm("none"))


SPEC = register_term(TermSpec(
    "none", "none", "0", example=_example, triton="none", kernel=TritonHooks(tensors=lambda term, q: []),
))
