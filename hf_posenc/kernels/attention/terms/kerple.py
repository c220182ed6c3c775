"""``kerple_log`` and ``kerple_pow`` (Chi et al., https://arxiv.org/abs/2205.09921; the encoding:
``hf_posenc.encodings.kerple``), r1, r2 (H,) inside their constraints (the encoding's reparametrisation):

    kerple_log:  B_h(i, j) = −r1[h] · log(1 + r2[h] · |δ|)
    kerple_pow:  B_h(i, j) = −r1[h] · |δ|^r2[h]            (0 at δ = 0, with a zero gradient there)

The Triton kernel's dQ programs reduce each row's Σ_j dS ∂B/∂r1 and Σ_j dS ∂B/∂r2 (two row planes), summed here.
"""

from __future__ import annotations

import torch

from ..term_spec import KernelTerm, TensorSpec, TermExample, TermSpec, TritonHooks, _dist, leaf, register_term


def _log(t: dict, h: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    return -t["r1"][h] * torch.log1p(t["r2"][h] * _dist(delta, t["r1"]))


def _pow(t: dict, h: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    r1, r2 = t["r1"][h], t["r2"][h]
    dist = _dist(delta, t["r1"])
    # d^r2 has an infinite derivative in r2 at d = 0: 0 there, with a zero gradient
    safe = torch.where(dist > 0, dist, torch.ones_like(dist))
    return torch.where(dist > 0, -r1 * safe.pow(r2), torch.zeros_like(r1 * dist))


def _validate(t: dict) -> None:
    if t["r2"].shape != t["r1"].shape:
        raise ValueError(f"r2 must be a vector of {t['r1'].shape[0]}, got shape {tuple(t['r2'].shape)}")


def _example(kind: str):
    def make(shape, q_offset, g, device, realistic=False) -> TermExample:
        h = shape[1]
        r1 = leaf(torch.rand(h, generator=g) * 2 + 0.05, device)
        r2 = leaf(torch.rand(h, generator=g) * (1.9 if kind == "kerple_pow" else 1.0) + 0.05, device)
        return TermExample({"r1": r1, "r2": r2}, {}, lambda t: KernelTerm.build(kind, r1=t["r1"], r2=t["r2"]))
    return make


def _row_grads(launch, tensors, rowg, hist, dqa, dck) -> list:
    return [rowg[0].sum((0, 2)), rowg[1].sum((0, 2))]


_HOOKS = TritonHooks(tensors=lambda term, q: [term.tensors[n].float().contiguous() for n in ("r1", "r2")],
                     row_planes=2, grads=_row_grads)

for _kind, _fn, _formula in (("kerple_log", _log, "−r1[h] · log(1 + r2[h] · |δ|)"),
                             ("kerple_pow", _pow, "−r1[h] · |δ|^r2[h]")):
    register_term(TermSpec(
        _kind, "toeplitz", _formula,
        tensors=(TensorSpec("r1", ("H",)), TensorSpec("r2", ("H",))),
        distance=_fn, validate=_validate, example=_example(_kind), triton=_kind, kernel=_HOOKS,
    ))
