"""The Triton kernels of stick-breaking attention (sba) and CoPE against their PyTorch references.

Forward outputs and every gradient (q, k, v, the sba remainder bias and CoPE's position table) are compared
on fresh random inputs with odd shapes (L = 77, head_dim = 40, GQA 4:1, left padding, fewer queries than
keys), in float32 and bfloat16, the reference in float32 on the same (rounded) inputs, by relative error
||kernel - reference|| / ||reference||. On the CPU the kernels run in Triton's interpreter (the
``interpret`` fixture; small tiles, so that every cross-tile carry and the carry checkpoints are exercised);
with a CUDA device the same tests run compiled, and ``@pytest.mark.gpu`` tests add full sizes. Every kernel
call forces ``HF_POSENC_BACKEND=triton``, so a test can never pass on a silent fallback to the reference.

``test_kernels_compile_for_sm90`` (opt-in: ``HF_POSENC_SM90_COMPILE=1 TRITON_INTERPRET=0``) compiles the six
kernels for sm_90 through Triton's GPU pipeline and ptxas on a machine without a GPU.

Tolerances: float32 2e-5 (the kernels sum in another order; on a GPU 3xTF32 dots). bfloat16 2e-2: the
probabilities and logit gradients enter the tensor-core dots rounded to bf16, as in FlashAttention,
outputs and gradients are rounded to bf16 (2^-9 each), and the interpreter does not round float32 -> bf16
to nearest (about twice the error of the GPU's conversion).
"""

from __future__ import annotations

import contextlib
import warnings
from unittest import mock

import pytest
import torch

import hf_posenc
from hf_posenc.kernels import cope as cope_pkg
from hf_posenc.kernels import sba as sba_pkg
from hf_posenc.kernels.cope import cope, cope_backend, cope_reference
from hf_posenc.kernels.sba import sba_backend, sba_reference, stick_breaking

from conftest import import_kernel_modules, make_ids, make_model, tiered

# Skips only without Triton itself: an ImportError inside hf_posenc's kernel modules fails the file (conftest).
(triton_cope, triton_sba), _TRITON_MISSING = import_kernel_modules(
    "hf_posenc.kernels.cope.triton_cope", "hf_posenc.kernels.sba.triton_sba"
)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
needs_gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")

#: (B, H, Hkv, Lq, Lk, D): GQA 4:1, odd L, a head_dim that is not a power of two.
SHAPE = (2, 4, 1, 77, 77, 40)
#: fewer queries than keys (query i is key 44 + i), GQA 2:1.
SHAPE_OFFSET = (2, 4, 2, 33, 77, 40)
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 1e-2}
DTYPES = pytest.mark.parametrize(
    "dtype", tiered([pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")], fast=["fp32"])
)


@pytest.fixture
def interpret(monkeypatch):
    """Run the kernels in Triton's interpreter on the CPU (compiled on a GPU), forcing the triton backend."""
    if _TRITON_MISSING is not None:
        pytest.skip(_TRITON_MISSING)
    if not CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("HF_POSENC_BACKEND", "triton")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def make_qkv(shape, dtype, seed=0, q_scale=1.0, device=DEVICE, key_mean=0.0):
    """q (B, H, Lq, D) as transformers lays it out (a transposed view), k, v (B, Hkv, Lk, D), the incoming
    gradient, all fresh from ``seed`` and rounded to ``dtype``."""
    b, h, hkv, lq, lk, d = shape
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, lq, h, d, generator=g) * q_scale).transpose(1, 2)
    k = torch.randn(b, hkv, lk, d, generator=g) + key_mean
    v = torch.randn(b, hkv, lk, d, generator=g)
    do = torch.randn(b, h, lq, d, generator=g)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v, do)]


def padding_mask(shape, pad: int = 6, device=DEVICE) -> torch.Tensor:
    """(B, 1, Lq, Lk) bool: the last batch row left-padded by ``pad`` keys (causality is the kernels' own)."""
    b, _, _, lq, lk, _ = shape
    mask = torch.ones(b, 1, lq, lk, dtype=torch.bool, device=device)
    mask[-1, :, :, :pad] = False
    return mask


def run_both(kernel_fn, reference_fn, tensors, extra, do):
    """Forward + backward of the kernel (inputs as given) and of the reference (same values in float32).

    ``tensors``: inputs that get gradients; ``extra``: leaf parameters (bias, table) cloned for each side.
    Returns [(kernel, reference)] for the output and every gradient. The kernel side is seen to reach a Triton
    kernel (``sba_triton`` or ``cope_triton``): a dispatcher that fell back to the tile engine would otherwise
    compare two PyTorch implementations."""
    ins = [t.detach().clone().requires_grad_() for t in tensors]
    params = [p.detach().clone().requires_grad_() for p in extra]
    ran = []
    with contextlib.ExitStack() as stack:
        for module, name in ((triton_sba, "sba_triton"), (triton_cope, "cope_triton")):
            real = getattr(module, name)
            spy = lambda *a, _r=real, **kw: ran.append(1) or _r(*a, **kw)  # noqa: E731
            stack.enter_context(mock.patch.object(module, name, spy))
        out = kernel_fn(*ins, *params)
    assert ran, "the Triton kernel did not run"
    out.backward(do)
    refs = [t.detach().float().clone().requires_grad_() for t in tensors]
    rparams = [p.detach().clone().requires_grad_() for p in extra]
    rout = reference_fn(*refs, *rparams)
    rout.backward(do.float())
    pairs = [(out, rout)] + [(a.grad, b.grad) for a, b in zip(ins + params, refs + rparams)]
    return pairs


def check(pairs, tol, names):
    for (got, want), name in zip(pairs, names):
        assert got is not None and want is not None, name
        assert torch.isfinite(got).all(), f"{name}: not finite"
        err = rel_err(got, want)
        assert err < tol, f"{name}: relative error {err:.2e} >= {tol:.0e}"


# ---------------------------------------------------------------------------------------------- sba


def _sba(mask, scale, offset, attend_current, remainder):
    def fn(q, k, v, *bias):
        return stick_breaking(q, k, v, mask, scale, offset, attend_current, remainder, bias[0] if bias else None)

    def ref(q, k, v, *bias):
        return sba_reference(q, k, v, mask, scale, offset, attend_current, remainder, bias[0] if bias else None)

    return fn, ref


@DTYPES
def test_sba_matches_reference(interpret, dtype):
    q, k, v, do = make_qkv(SHAPE, dtype, seed=1)
    fn, ref = _sba(None, SHAPE[-1] ** -0.5, 0, False, "discard")
    check(run_both(fn, ref, (q, k, v), (), do), TOL[dtype], ["out", "dq", "dk", "dv"])


@pytest.mark.parametrize("offset", tiered(["int", "tensor"], fast=["tensor"]))
@pytest.mark.parametrize("remainder", ["current", "bias"])
def test_sba_padding_offset_options(interpret, remainder, offset):
    """Left padding, Lq < Lk, the diagonal as a breakpoint, and the remainder options (with the bias's gradient).
    A tensor offset (a StaticCache's) is loaded by the kernels on the device, never read on the host."""
    q, k, v, do = make_qkv(SHAPE_OFFSET, torch.float32, seed=2)
    b, h, _, lq, lk, d = SHAPE_OFFSET
    bias = torch.randn(h, d, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    q_offset = lk - lq if offset == "int" else torch.tensor(lk - lq, device=DEVICE)
    fn, ref = _sba(padding_mask(SHAPE_OFFSET), d**-0.5, q_offset, True, remainder)
    extra = (bias,) if remainder == "bias" else ()
    names = ["out", "dq", "dk", "dv", "dbias"]
    check(run_both(fn, ref, (q, k, v), extra, do), TOL[torch.float32], names)


def test_sba_keys_with_a_common_direction_bf16(interpret, monkeypatch):
    """Keys sharing a mean direction: an inconsistency between the row total T = do·o and the backward's
    own Σ g would be multiplied by every live key of the row (13% error in dq before it was fixed)."""
    shape = (1, 2, 1, 96, 96, 64)
    q, k, v, do = make_qkv(shape, torch.bfloat16, seed=4, key_mean=0.5)
    fn, ref = _sba(None, 64**-0.5, 0, False, "discard")
    check(run_both(fn, ref, (q, k, v), (), do), TOL[torch.bfloat16], ["out", "dq", "dk", "dv"])


def test_sba_carry_checkpoints(interpret, monkeypatch):
    """One checkpoint per row: the key-major backward recomputes the carries over the tiles in between."""
    monkeypatch.setattr(triton_sba, "CARRY_SLOTS", 1)
    if not CUDA:
        monkeypatch.setattr(triton_sba, "INTERPRETER_BLOCKS", (16, 16))
    shape = (1, 2, 1, 30, 53, 24)
    q, k, v, do = make_qkv(shape, torch.float32, seed=5)
    fn, ref = _sba(padding_mask(shape, pad=4), 24**-0.5, 23, False, "current")
    check(run_both(fn, ref, (q, k, v), (), do), TOL[torch.float32], ["out", "dq", "dk", "dv"])


def test_sba_extreme_logits(interpret):
    """Logits of +-1e4: a key takes the whole stick or none of it; the walk stops once the stick is gone."""
    shape = (1, 2, 1, 40, 40, 32)
    q, k, v, do = make_qkv(shape, torch.float32, seed=6, q_scale=2000.0)
    fn, ref = _sba(None, 32**-0.5, 0, False, "current")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # numpy overflow in the interpreter's exp (to inf)
        pairs = run_both(fn, ref, (q, k, v), (), do)
    assert pairs[0][1].abs().max() > 0
    check(pairs, 1e-4, ["out", "dq", "dk", "dv"])


# --------------------------------------------------------------------------------------------- cope


def _cope(mask, scale, offset):
    def fn(q, k, v, table):
        return cope(q, k, v, table, mask, scale, offset)

    def ref(q, k, v, table):
        return cope_reference(q, k, v, table, mask, scale, offset)

    return fn, ref


def _table(d, npos, seed=7):
    return (torch.randn(d, npos, generator=torch.Generator().manual_seed(seed)) * 0.5).to(DEVICE)


@DTYPES
def test_cope_matches_reference(interpret, dtype):
    """npos_max = 16: the counts clamp inside the rows (window and clamped tiles both run)."""
    q, k, v, do = make_qkv(SHAPE, dtype, seed=8)
    fn, ref = _cope(None, SHAPE[-1] ** -0.5, 0)
    names = ["out", "dq", "dk", "dv", "dtable"]
    check(run_both(fn, ref, (q, k, v), (_table(SHAPE[-1], 16),), do), TOL[dtype], names)


@pytest.mark.parametrize("npos,offset", tiered([(1, "int"), (64, "int"), (64, "tensor")], fast=[(1, "int")]))
def test_cope_padding_offset_npos(interpret, npos, offset):
    """Left padding, Lq < Lk; npos 1 (always clamped), 64 (never clamped here); the offset as an int or as a
    tensor (a StaticCache's: the kernels load it on the device).

    With npos = 1 the position logit q_i·e[0] is the same for every key of a row and cancels in the softmax:
    the table's gradient is zero up to rounding, and is checked as such."""
    q, k, v, do = make_qkv(SHAPE_OFFSET, torch.float32, seed=9)
    b, h, _, lq, lk, d = SHAPE_OFFSET
    q_offset = lk - lq if offset == "int" else torch.tensor(lk - lq, device=DEVICE)
    fn, ref = _cope(padding_mask(SHAPE_OFFSET), d**-0.5, q_offset)
    names = ["out", "dq", "dk", "dv", "dtable"]
    pairs = run_both(fn, ref, (q, k, v), (_table(d, npos),), do)
    if npos == 1:
        (dtable, dtable_ref), pairs, names = pairs[-1], pairs[:-1], names[:-1]
        assert dtable.abs().max() < 1e-4 and dtable_ref.abs().max() < 1e-4
    check(pairs, TOL[torch.float32], names)


def test_cope_carry_checkpoints(interpret, monkeypatch):
    monkeypatch.setattr(triton_cope, "CARRY_SLOTS", 1)
    if not CUDA:
        monkeypatch.setattr(triton_cope, "INTERPRETER_BLOCKS", (16, 16))
    shape = (1, 2, 1, 30, 53, 24)
    q, k, v, do = make_qkv(shape, torch.float32, seed=10)
    fn, ref = _cope(padding_mask(shape, pad=4), 24**-0.5, 23)
    names = ["out", "dq", "dk", "dv", "dtable"]
    check(run_both(fn, ref, (q, k, v), (_table(24, 5),), do), TOL[torch.float32], names)  # npos not a power of 2


def test_cope_extreme_logits(interpret):
    """Logits of +-1e4: gates are 0 or 1 and everything stays finite. The gradients are only checked for
    finiteness: with exact 0/1 gates most positions sit on integers, where the reference's gradient itself
    jumps (d/dp of the interpolation is 0 at an integer, z[p+1] - z[p] just above it)."""
    shape = (1, 2, 1, 40, 40, 32)
    q, k, v, do = make_qkv(shape, torch.float32, seed=11, q_scale=2000.0)
    fn, ref = _cope(None, 32**-0.5, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        pairs = run_both(fn, ref, (q, k, v), (_table(32, 8),), do)
    for got, _ in pairs:
        assert torch.isfinite(got).all()
    assert rel_err(*pairs[0]) < 1e-4


# ---------------------------------------------------------------------------------- both: head dims


@pytest.mark.parametrize("d", [64, 80, 96, 128])
def test_head_dims(interpret, d):
    shape = (1, 2, 1, 21, 21, d)
    q, k, v, do = make_qkv(shape, torch.float32, seed=12)
    fn, ref = _sba(None, d**-0.5, 0, False, "discard")
    check(run_both(fn, ref, (q, k, v), (), do), TOL[torch.float32], ["sba out", "dq", "dk", "dv"])
    fn, ref = _cope(None, d**-0.5, 0)
    check(run_both(fn, ref, (q, k, v), (_table(d, 8),), do), TOL[torch.float32],
          ["cope out", "dq", "dk", "dv", "dtable"])


# --------------------------------------------------------------------------------------------- dispatch


def _small(device="cpu", dtype=torch.float32):
    q, k, v, _ = make_qkv((1, 2, 1, 5, 5, 8), dtype, device=device)
    return q, k, v


def test_forced_triton_on_cpu_without_interpreter_raises(monkeypatch):
    if _TRITON_MISSING is not None:
        pytest.skip(_TRITON_MISSING)
    monkeypatch.setenv("HF_POSENC_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v = _small()
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        stick_breaking(q, k, v, None, 0.3, 0)
    with pytest.raises(ValueError, match="CUDA"):
        cope(q, k, v, torch.zeros(8, 4), None, 0.3, 0)


def test_forced_torch_and_cpu_default_use_the_reference(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("the Triton kernel must not run")

    if triton_sba is not None:
        monkeypatch.setattr(triton_sba, "sba_triton", boom)
        monkeypatch.setattr(triton_cope, "cope_triton", boom)
    q, k, v = _small()
    table = torch.randn(8, 4)
    for forced in ("torch", "flex", None):
        if forced is None:
            monkeypatch.delenv("HF_POSENC_BACKEND", raising=False)
        else:
            monkeypatch.setenv("HF_POSENC_BACKEND", forced)
        assert sba_backend(q, k, v) == "torch" and cope_backend(q, k, v) == "torch"
        torch.testing.assert_close(stick_breaking(q, k, v, None, 0.3, 0), sba_reference(q, k, v, None, 0.3, 0))
        torch.testing.assert_close(cope(q, k, v, table, None, 0.3, 0), cope_reference(q, k, v, table, None, 0.3, 0))


def test_forced_triton_unsupported_inputs_raise(interpret):
    q, k, v = _small()
    with pytest.raises(ValueError, match="float64"):
        stick_breaking(q.double(), k.double(), v.double(), None, 0.3, 0)
    with pytest.raises(ValueError, match="output_attentions"):
        sba_backend(q, k, v, need_weights=True)
    with pytest.raises(ValueError, match="dropout"):
        cope_backend(q, k, v, dropout=0.1, training=True)
    with pytest.raises(ValueError, match="bidirectional"):
        cope_backend(q, k, v, causal=False)
    big = torch.zeros(1, 1, 4, 160)
    with pytest.raises(ValueError, match="head_dim up to 128"):
        sba_backend(big, big, big)


def test_bad_shapes_raise(monkeypatch):
    monkeypatch.setenv("HF_POSENC_BACKEND", "torch")
    q, k, v = _small()
    with pytest.raises(ValueError, match="q_offset"):
        stick_breaking(q, k, v, None, 0.3, 3)
    with pytest.raises(ValueError, match="mask"):
        stick_breaking(q, k, v, torch.ones(1, 1, 5, 4, dtype=torch.bool), 0.3, 0)
    with pytest.raises(ValueError, match="bias"):
        stick_breaking(q, k, v, None, 0.3, 0, remainder="bias")
    with pytest.raises(ValueError, match="remainder"):
        stick_breaking(q, k, v, None, 0.3, 0, remainder="keep")
    with pytest.raises(ValueError, match="table"):
        cope(q, k, v, torch.zeros(7, 4), None, 0.3, 0)
    with pytest.raises(ValueError, match="multiple"):
        kv = torch.zeros(1, 2, 5, 8)
        cope(q[:, :1].expand(1, 3, 5, 8), kv, kv, torch.zeros(8, 4), None, 0.3, 0)


# ------------------------------------------------------------------------------------------ model level


@pytest.mark.parametrize(
    "encoding,params",
    [("sba", {}), ("sba", {"remainder": "bias", "attend_current": True}), ("cope", {"npos_max": 4})],
    ids=["sba", "sba-bias-current", "cope"],
)
@pytest.mark.slow  # the kernels' own tests above run in the fast tier
def test_llama_triton_matches_torch(interpret, monkeypatch, engine_calls, encoding, params):
    """A patched tiny Llama (GQA, left padding): same logits and parameter gradients with the kernels
    (forced, interpreted on the CPU; seen to run in each layer) and with the references (no kernel runs). The
    attention function itself routes a forced ``triton`` to the encoding's own ``attend`` (``attention_kernels``),
    whose dispatcher runs the kernel: nothing here stands in for that routing."""
    ids = make_ids(batch=2, length=11, seed=3)
    attn = torch.ones_like(ids)
    attn[1, :3] = 0  # left padding
    results = {}
    for backend in ("triton", "torch"):
        monkeypatch.setenv("HF_POSENC_BACKEND", backend)
        model = make_model("llama", encoding=encoding, seed=0, train=True, **params).to(DEVICE)
        enc = hf_posenc.encoding_module(model)
        if encoding == "sba" and "remainder" in params:
            with torch.no_grad():  # a non-zero remainder bias, so that its gradient matters
                torch.manual_seed(1)
                enc.remainder_bias.normal_(0.0, 0.5)
        enc_names = {id(p) for p in enc.parameters()}
        engine_calls.clear()
        out = model(input_ids=ids.to(DEVICE), attention_mask=attn.to(DEVICE), labels=ids.to(DEVICE), use_cache=False)
        out.loss.backward()
        layers = model.config.num_hidden_layers
        assert engine_calls["triton"] == (layers if backend == "triton" else 0), f"{backend}: {dict(engine_calls)}"
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        own = [n for n, p in model.named_parameters() if id(p) in enc_names and p.grad is not None]
        results[backend] = (out.logits.detach(), grads, own)
    logits_t, grads_t, own_t = results["triton"]
    logits_r, grads_r, own_r = results["torch"]
    assert rel_err(logits_t[1, 3:], logits_r[1, 3:]) < 1e-5 and rel_err(logits_t[0], logits_r[0]) < 1e-5
    assert grads_t.keys() == grads_r.keys() and own_t == own_r
    assert own_r or (encoding == "sba" and not params), "the encoding's own parameters must get gradients"
    for name in grads_r:
        assert rel_err(grads_t[name], grads_r[name]) < 1e-4, name


# ------------------------------------------------------------------------------------------------- GPU

#: CoPE's float32 kernel on an H100 (torch 2.11, Triton 3.6): hf_posenc.kernels.cope.FLOAT32_ON_CUDA. Not strict:
#: a run where it passes shows XPASS, and the dispatch's float32 rule can go.
COPE_FP32_XFAIL = pytest.mark.xfail(reason="CoPE's float32 Triton kernel failed on an H100 (FLOAT32_ON_CUDA)",
                                    strict=False)


def _gpu_cases(dtypes: list[tuple[torch.dtype, str]]) -> list:
    """(kind, dtype) params for the GPU tests, CoPE float32 marked as the known failure."""
    return [pytest.param(kind, dtype, id=f"{kind}-{name}",
                         marks=[COPE_FP32_XFAIL] if (kind, dtype) == ("cope", torch.float32) else [])
            for kind in ("sba", "cope") for dtype, name in dtypes]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("kind, dtype", _gpu_cases([(torch.bfloat16, "bf16"), (torch.float16, "fp16"),
                                                    (torch.float32, "fp32")]))
def test_gpu_full_size(interpret, monkeypatch, kind, d, dtype):
    """B = 2, H = 8, Hkv = 2, L = 1024 (and 2048 keys with 1024 queries), padding; float32 reference."""
    tol = {torch.bfloat16: 2e-2, torch.float16: 1e-2, torch.float32: 2e-5}[dtype]
    for shape in [(2, 8, 2, 1024, 1024, d), (2, 8, 2, 1024, 2048, d)]:
        q, k, v, do = make_qkv(shape, dtype, seed=13)
        mask = padding_mask(shape, pad=100)
        offset = shape[4] - shape[3]
        if kind == "sba":
            fn, ref = _sba(mask, d**-0.5, offset, False, "discard")
            check(run_both(fn, ref, (q, k, v), (), do), tol, ["out", "dq", "dk", "dv"])
        else:
            fn, ref = _cope(mask, d**-0.5, offset)
            check(run_both(fn, ref, (q, k, v), (_table(d, 64),), do), tol, ["out", "dq", "dk", "dv", "dtable"])


@pytest.mark.gpu
@needs_gpu
def test_gpu_long_carry_checkpoints(interpret):
    """L = 8192 with the default CARRY_SLOTS (64): a checkpoint every L / (64 BLOCK_N) key tiles, the carries
    recomputed in between (the CPU tests force one checkpoint per row instead)."""
    shape = (1, 4, 1, 8192, 8192, 64)
    q, k, v, do = make_qkv(shape, torch.bfloat16, seed=14)
    fn, ref = _sba(None, 0.125, 0, False, "discard")
    check(run_both(fn, ref, (q, k, v), (), do), 2e-2, ["out", "dq", "dk", "dv"])
    fn, ref = _cope(None, 0.125, 0)
    check(run_both(fn, ref, (q, k, v), (_table(64, 64),), do), 2e-2, ["out", "dq", "dk", "dv", "dtable"])


@pytest.mark.gpu
@needs_gpu
def test_gpu_auto_dispatch_uses_kernel(monkeypatch):
    monkeypatch.delenv("HF_POSENC_BACKEND", raising=False)
    q, k, v = _small(device="cuda", dtype=torch.bfloat16)
    assert sba_backend(q, k, v) == "triton" and cope_backend(q, k, v) == "triton"
    assert sba_backend(q.double(), k.double(), v.double()) == "torch"
    assert sba_pkg.sba_backend(q, k, v, need_weights=True) == "torch"
    assert cope_pkg.cope_backend(q, k, v, causal=False) == "torch"


# ------------------------------------------------------------------------------ sm_90 compile, no GPU


def _compile_for_sm90(module, kernel_names, call):
    """Capture the launches ``call`` makes, then compile each kernel for sm_90 (ptxas included) without a
    GPU; returns {kernel name: bytes of local-memory stack per thread} (spills)."""
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    captured = []
    original = module._JIT.bind

    class Capture:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            return lambda *args, **kwargs: captured.append((self.fn, args, kwargs))

    def bind():
        table = original()
        for name in kernel_names:
            module.__dict__[name] = Capture(table[name])
        return table

    module._JIT.bind = bind
    try:
        call()
    finally:
        module._JIT.bind = original
    dtypes = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.uint8: "u8"}
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    stacks = {}
    for fn, args, kwargs in captured:
        kwargs = dict(kwargs)
        warps = kwargs.pop("num_warps")
        stages = kwargs.pop("num_stages", 3)  # the launchers pick them per dtype (Triton's default: 3)
        signature, constexprs = {}, {}
        for i, name in enumerate(fn.arg_names):
            if i < len(args):
                a = args[i]
                signature[name] = ("*" + dtypes[a.dtype] if isinstance(a, torch.Tensor) else
                                   "fp32" if isinstance(a, float) else "i64" if abs(a) >= 2**31 else "i32")
            else:
                signature[name] = "constexpr"
                constexprs[(i,)] = kwargs[name]
        compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": warps, "num_stages": stages})
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.asm["cubin"])
            f.flush()
            usage = subprocess.run([str(cuobjdump), "-res-usage", f.name], capture_output=True, text=True).stdout
        match = re.search(r"STACK:(\d+)", usage)
        stacks[fn.__name__] = int(match.group(1)) if match else None
    return stacks


def _triton_library_compiled() -> bool:
    """Whether triton was imported in compiled mode (conftest sets TRITON_INTERPRET=1 on CPU machines first,
    unless the environment sets it; compiling then fails inside triton)."""
    try:
        import triton.language as tl
        from triton.runtime.jit import JITFunction

        return isinstance(tl.standard.cdiv, JITFunction)
    except (ImportError, AttributeError):
        return False


@pytest.mark.slow
@pytest.mark.skipif(CUDA, reason="on a GPU the other tests compile the kernels")
@pytest.mark.skipif(
    __import__("os").environ.get("HF_POSENC_SM90_COMPILE") != "1",
    reason="opt-in (minutes): HF_POSENC_SM90_COMPILE=1 TRITON_INTERPRET=0 pytest -k compile_for_sm90",
)
def test_kernels_compile_for_sm90(monkeypatch):
    """The compiled (not interpreted) kernels pass Triton's GPU pipeline and ptxas: bf16, D = 128, padding
    mask, GQA, every sba option that changes the code; float32 (3xTF32 dots) for CoPE with a mask."""
    if _TRITON_MISSING is not None:
        pytest.skip(_TRITON_MISSING)
    if not _triton_library_compiled():
        pytest.skip("triton was imported under TRITON_INTERPRET=1; run with TRITON_INTERPRET=0 in the environment")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    for dtype, d in ((torch.bfloat16, 128), (torch.float32, 40)):
        q = torch.zeros(2, 4, 300, d, dtype=dtype).transpose(1, 2).contiguous().transpose(1, 2)
        k = torch.zeros(2, 2, 300, d, dtype=dtype)
        v = torch.zeros_like(k)
        mask = torch.ones(2, 1, 300, 300, dtype=torch.bool)

        def sba_calls():
            o, res = triton_sba._forward(q, k, v, mask, None, 0.1, 0, True, "current", dtype != torch.float32)
            triton_sba._backward(q, k, v, o, res, torch.zeros_like(o), mask, 0.1, 0, True, "current")

        def cope_calls():
            table = torch.zeros(d, 5)
            o, lse = triton_cope._forward(q, k, v, table, mask, 0.1, 0)
            triton_cope._backward(q, k, v, table, o, lse, torch.zeros_like(o), mask, 0.1, 0)

        stacks = _compile_for_sm90(triton_sba, ["_sba_fwd", "_sba_bwd_q", "_sba_bwd_kv"], sba_calls)
        stacks.update(_compile_for_sm90(triton_cope, ["_cope_fwd", "_cope_bwd_q", "_cope_bwd_kv"], cope_calls))
        assert len(stacks) == 6, stacks
        print(dtype, d, "local-memory stack per thread (spills):", stacks)


@pytest.fixture
def no_tf32(monkeypatch):
    """float32 means float32 on the GPU: the kernels' float32 dots use 3xTF32, the reference no TF32."""
    if CUDA:
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("kind, dtype", _gpu_cases([(torch.float32, "fp32"), (torch.bfloat16, "bf16"),
                                                    (torch.float16, "fp16")]))
def test_gpu_odd_shapes(interpret, no_tf32, kind, dtype):
    """Compiled kernels at L = 77, head_dim 40, GQA 4:1 and 2:1, left padding, Lq < Lk, one decode query,
    with every gradient (the remainder bias of sba, the table of cope)."""
    tol = TOL[dtype] * (2 if dtype != torch.float32 else 1)
    for shape, seed in ((SHAPE, 21), (SHAPE_OFFSET, 22), ((2, 4, 2, 1, 77, 40), 23)):
        q, k, v, do = make_qkv(shape, dtype, seed=seed)
        mask = padding_mask(shape)
        offset = shape[4] - shape[3]
        d = shape[-1]
        if kind == "sba":
            bias = torch.randn(shape[1], d, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)
            fn, ref = _sba(mask, d**-0.5, offset, True, "bias")
            check(run_both(fn, ref, (q, k, v), (bias,), do), tol, ["out", "dq", "dk", "dv", "dbias"])
        else:
            fn, ref = _cope(mask, d**-0.5, offset)
            check(run_both(fn, ref, (q, k, v), (_table(d, 16),), do), tol, ["out", "dq", "dk", "dv", "dtable"])


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("kind", ["sba", "cope"])
def test_gpu_long_sequence_16k(interpret, kind):
    """L = 16384 in bfloat16 (B = 1, H = 2, Hkv = 1, D = 128); the float32 reference holds a few (H, L, L)
    float32 tensors (2 GiB each) on the GPU."""
    shape = (1, 2, 1, 16384, 16384, 128)
    q, k, v, do = make_qkv(shape, torch.bfloat16, seed=24)
    if kind == "sba":
        fn, ref = _sba(None, 128**-0.5, 0, False, "discard")
        check(run_both(fn, ref, (q, k, v), (), do), 2e-2, ["out", "dq", "dk", "dv"])
    else:
        fn, ref = _cope(None, 128**-0.5, 0)
        check(run_both(fn, ref, (q, k, v), (_table(128, 64),), do), 2e-2, ["out", "dq", "dk", "dv", "dtable"])
