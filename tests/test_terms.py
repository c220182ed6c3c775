"""Every registered term, the built-ins and examples/custom_term.py's, through every engine that has its form:
the full-matrix reference (finite, a gradient for every tensor that takes one), the tile engine (forward and every
gradient against the reference: causal with left padding and a cache offset, and bidirectional), FlexAttention
(forward on the CPU) where it has a score_mod, the Triton kernel in the interpreter where it has a branch (its
own or another's, ``lower``), and the doctor, whose cases come from the registry. A term added to the registry is
checked here without a line of this file changing.
"""

from __future__ import annotations

import pytest
import torch

import hf_posenc
from hf_posenc import diagnostics
from hf_posenc.kernels.attention import (
    attention_reference,
    flex_attention_term,
    flex_unsupported,
    kernel_unsupported,
    tiled_attention,
)
from hf_posenc.kernels.attention.terms import TERMS, KernelTerm, term_kinds, term_spec
from conftest import example_registered, tiered

with example_registered("custom_term") as (_module, EXAMPLE_KINDS, _encodings):
    pass  # the example's kinds, for the parametrisation; registered again for this module's tests below
KINDS = [k for k in term_kinds() if k != "none"] + EXAMPLE_KINDS
#: (B, H, Hkv, Lq, Lk, D): GQA 2:1, odd lengths, a chunk of queries after 8 cached keys, head_dim 24.
SHAPE = (2, 4, 2, 29, 37, 24)


@pytest.fixture(scope="module", autouse=True)
def example():
    with example_registered("custom_term") as found:
        yield found


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _case(kind: str, causal: bool, seed: int = 0, shape=SHAPE):
    """Inputs (q, k, v, the incoming gradient, key validity), the term's registry example and the call's keywords."""
    b, h, hkv, lq, lk, d = shape
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, n, length, d, generator=g) for n, length in ((h, lq), (hkv, lk), (hkv, lk)))
    gout = torch.randn(b, h, lq, d, generator=g)
    valid = torch.ones(b, lk, dtype=torch.bool)
    valid[1, :5] = False  # left padding
    offset = lk - lq
    example = term_spec(kind).make_example(shape, offset, g)
    kw = dict(scale=d**-0.5, causal=causal, q_offset=offset, key_valid=valid)
    return q, k, v, gout, example, kw


def _run(fn, q, k, v, gout, example, **kw):
    leaves = list(example.leaves.values())
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v, example.term, **kw)
    return out, torch.autograd.grad(out, [q, k, v, *leaves], gout)


def test_every_term_is_checked_here_and_by_the_doctor():
    """The parametrisation and the doctor's cases cover every registered term (the example's included), and each
    has its derived constructor."""
    assert set(KINDS) == set(TERMS) - {"none"} and "log_distance" in KINDS and "dpb" in KINDS
    cases = {c.name: c for c in diagnostics.cases()}
    for kind in KINDS:
        assert cases[kind].family == "attention" and cases[kind].variant == kind
        assert callable(getattr(KernelTerm, kind))


#: the masks each term runs under: causal, bidirectional, and causal with a window of 9 keys and 3 attention sinks
#: (key positions 0..2, apart from the window for the later queries: the engines' sink paths)
MASKS = {"causal": (True, {}), "bidirectional": (False, {}), "window_sink": (True, {"window": 9, "sink": 3})}


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("kind", KINDS)
def test_reference_and_tile_engine(kind, mask):
    """The reference's output and gradients are finite and reach every tensor that takes one; the tile engine (small
    tiles: several along each length) gives the same output and gradients."""
    spec = term_spec(kind)
    causal, extra = MASKS[mask]
    q, k, v, gout, example, kw = _case(kind, causal)
    kw.update(extra)
    ref, ref_grads = _run(attention_reference, q, k, v, gout, example, **kw)
    assert torch.isfinite(ref).all() and all(torch.isfinite(g).all() for g in ref_grads)
    for name, grad in zip(example.leaves, ref_grads[3:]):
        assert grad.abs().max() > 0, f"the reference gives {kind}'s {name} no gradient"
    assert spec.tiled
    out, grads = _run(tiled_attention, q, k, v, gout, example, block_q=8, block_k=16, **kw)
    assert _rel(out, ref) < 2e-5
    for name, got, want in zip(["q", "k", "v", *example.leaves], grads, ref_grads):
        assert _rel(got, want) < 1e-4, (kind, name)


@pytest.mark.parametrize("mask", ["causal", "window_sink"])
@pytest.mark.parametrize("kind", KINDS)
def test_flex_forward(kind, mask):
    """FlexAttention (forward: the CPU has no backward) where the term has a score_mod; a term with a value term
    has none, and says so."""
    q, k, v, gout, example, kw = _case(kind, True, seed=1)
    kw.update(MASKS[mask][1])
    if not term_spec(kind).flex:
        assert "no FlexAttention form" in flex_unsupported(q, k, v, example.term)
        return
    with torch.no_grad():
        ref = attention_reference(q, k, v, example.term, **kw)
        out = flex_attention_term(q, k, v, example.term, **kw)
    assert _rel(out, ref) < 1e-5


@pytest.mark.parametrize("kind", tiered(KINDS, fast=["dpb", "log_distance"]))
def test_triton_where_it_has_a_branch(kind):
    """The Triton kernel in the interpreter (tiny shapes) for a term with a branch, its own or another's; a term
    without one says so."""
    pytest.importorskip("triton")
    from hf_posenc.kernels.attention import triton_attention

    shape = (2, 2, 1, 9, 17, 16)
    q, k, v, gout, example, kw = _case(kind, True, seed=2, shape=shape)
    reason = kernel_unsupported(q, k, v, example.term)
    if term_spec(kind).triton is None:
        assert reason == f"the {kind} term has no Triton branch"
        return
    if reason is not None and ("interpret" in reason or "TRITON_INTERPRET" in reason):
        pytest.skip(reason)
    assert reason is None
    ref, ref_grads = _run(attention_reference, q, k, v, gout, example, **kw)
    out, grads = _run(triton_attention.fused_attention, q, k, v, gout, example, **kw)
    assert _rel(out, ref) < 2e-5
    for got, want in zip(grads, ref_grads):
        assert _rel(got, want) < 1e-4


@pytest.mark.parametrize("kind", KINDS)
def test_the_doctor_checks_it(kind):
    """The doctor's row of the term on the tile engine passes (forward and every gradient, against float64) and its
    FlexAttention row passes forward only or says why it is skipped."""
    report = hf_posenc.doctor(device="cpu", engines="tiled,flex", cases=kind, timing=False, verbose=False)
    rows = {r["engine"]: r for r in report["rows"]}
    leaves = list(term_spec(kind).make_example((2, 4, 2, 8, 8, 8), 0, torch.Generator().manual_seed(0)).leaves)
    assert rows["tiled"]["status"] == "pass", rows["tiled"]
    assert rows["tiled"]["checked"] == ["out", "dq", "dk", "dv", *(f"d{n}" for n in leaves)]
    assert rows["flex"]["status"] == ("pass" if term_spec(kind).flex else "skip"), rows["flex"]
    assert report["ok"]


def test_register_term_refuses_what_no_engine_can_run():
    """Clear errors at registration: a taken kind, a form without its value, a Triton branch that does not exist
    or that another term owns without a lower function, tiles for a term that is not a pair term."""
    from hf_posenc import TensorSpec, TermSpec, register_term

    def dist(t, h, delta):
        return delta.abs().float()

    with pytest.raises(ValueError, match="already registered"):
        register_term(TermSpec("alibi", "toeplitz", "x", distance=dist))
    with pytest.raises(ValueError, match="needs its distance function"):
        TermSpec("no_value", "toeplitz", "x")
    with pytest.raises(ValueError, match="must be an identifier"):
        TermSpec("not a name", "toeplitz", "x", distance=dist)
    with pytest.raises(ValueError, match="no branch 'mine'"):
        register_term(TermSpec("mine", "toeplitz", "x", distance=dist, triton="mine"))
    with pytest.raises(ValueError, match="register that first, with a lower function"):
        register_term(TermSpec("mine", "toeplitz", "x", distance=dist, triton="t5"))
    with pytest.raises(ValueError, match="would hide KernelTerm.build"):
        register_term(TermSpec("build", "toeplitz", "x", distance=dist))
    with pytest.raises(TypeError, match="tile class"):
        TermSpec("mine", "toeplitz", "x", distance=dist, tiles=object)
    with pytest.raises(ValueError, match="a gate term has one tensor"):
        TermSpec("mine", "gate", "x", pair=dist, tensors=(TensorSpec("a", ("B", "H", "Lk")),
                                                           TensorSpec("b", ("B", "H", "Lk"))))
    assert "mine" not in TERMS and not hasattr(KernelTerm, "mine")
    with pytest.raises(TypeError, match="takes the tensors"):
        KernelTerm.alibi(torch.ones(4), torch.ones(4))
    with pytest.raises(ValueError, match=r"alibi slopes must be \(H,\)"):
        KernelTerm.alibi(torch.ones(4, 2))
