"""The Triton rotary kernel (q and k in one pass) against its PyTorch reference, and its dispatch.

Forward outputs and every gradient (q, k and the rotation) are compared on fresh random inputs with odd
shapes (L = 77, D = 40, GQA 4:1, block sizes 2, 4, 8, rotations shared, per batch, per head, per
(batch, head)), in float32 and bfloat16, the reference in float32, by relative error
||kernel - reference|| / ||reference||. On the CPU the kernel runs in Triton's interpreter: the
``interpret`` fixture sets ``TRITON_INTERPRET=1`` for each test through ``monkeypatch`` (the kernel module
builds its jitted function on first use in the mode then in force, so nothing leaks into other tests).
With a CUDA device the same tests run compiled on the GPU; ``@pytest.mark.gpu`` tests add full sizes.
"""

from __future__ import annotations

import pytest
import torch

from hf_posenc.kernels import rotary
from hf_posenc.kernels.rotary import (
    apply_block_rotation,
    apply_block_rotation_reference,
    apply_qk_rotation,
    apply_qk_rotation_reference,
)

from conftest import import_kernel_modules, tiered

# Skips only without Triton itself: an ImportError inside hf_posenc's kernel module fails the file (conftest).
(triton_rotary,), _TRITON_MISSING = import_kernel_modules("hf_posenc.kernels.rotary.triton_rotary")

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
needs_gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")

# (B, H, Hkv, L, D): GQA 4:1, odd L, a head_dim that is not a power of two.
SHAPE = (2, 8, 2, 77, 40)
#: relative error allowed against the float32 reference, per input dtype (bf16 outputs round at 2^-8).
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
#: dR is accumulated in float32 from the same (rounded) inputs in both implementations.
TOL_ROT = 1e-5
ROT_LAYOUTS = {"shared": (False, False), "batch": (True, False), "heads": (False, True), "batch_heads": (True, True)}


@pytest.fixture
def interpret(monkeypatch):
    """Run Triton kernels in the interpreter on the CPU (nothing to do with a GPU), backend unforced."""
    if _TRITON_MISSING is not None:
        pytest.skip(_TRITON_MISSING)
    if not CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("HF_POSENC_BACKEND", raising=False)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def make_inputs(shape, s, per_batch, per_head, dtype, seed=0, device=DEVICE, hf_layout=True):
    """q (B, H, L, D) as transformers builds it (a transposed view: not contiguous), k, rot, and the
    incoming gradients; every tensor fresh from ``seed``."""
    b, h, hkv, length, d = shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, length, h, d, generator=g)
    q = q.transpose(1, 2) if hf_layout else q.transpose(1, 2).contiguous()
    k = torch.randn(b, hkv, length, d, generator=g)
    rot = torch.randn(b if per_batch else 1, hkv if per_head else 1, length, d // s, s, s, generator=g)
    gq = torch.randn(b, h, length, d, generator=g)
    gk = torch.randn(b, hkv, length, d, generator=g)
    to = dict(device=device)
    return (q.to(dtype=dtype, **to), k.to(dtype=dtype, **to), rot.to(**to), gq.to(dtype=dtype, **to),
            gk.to(dtype=dtype, **to))


def run(fn, q, k, rot, gq, gk, rot_grad=True):
    """Forward and backward of ``fn``; returns (q_out, k_out, dq, dk, drot or None)."""
    q = q.detach().requires_grad_()
    k = k.detach().requires_grad_()
    rot = rot.detach().requires_grad_(rot_grad)
    qo, ko = fn(q, k, rot)
    torch.autograd.backward((qo, ko), (gq, gk))
    return qo, ko, q.grad, k.grad, rot.grad


def check_against_reference(shape, s, per_batch, per_head, dtype, seed=0, rot_grad=True, hf_layout=True):
    q, k, rot, gq, gk = make_inputs(shape, s, per_batch, per_head, dtype, seed=seed, hf_layout=hf_layout)
    got = run(triton_rotary.rotary_qk, q, k, rot, gq, gk, rot_grad)
    # the reference in float32, from the same (rounded) inputs
    want = run(apply_qk_rotation_reference, q.float(), k.float(), rot, gq.float(), gk.float(), rot_grad)
    names = ("q_out", "k_out", "dq", "dk", "drot")
    for name, a, b in zip(names, got, want):
        if name == "drot" and not rot_grad:
            assert a is None and b is None
            continue
        assert a.shape == b.shape, name
        if name != "drot":
            assert a.dtype == dtype, name
        tol = TOL_ROT if name == "drot" else TOL[dtype]
        err = rel_err(a, b)
        assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize(
    "dtype", tiered([pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")], fast=["fp32"])
)
@pytest.mark.parametrize("layout", list(ROT_LAYOUTS))
@pytest.mark.parametrize("s", tiered([2, 4, 8], fast=[4]))
def test_kernel_matches_reference(interpret, s, layout, dtype):
    """Forward, dq, dk and drot on L=77, D=40, GQA 4:1, q non-contiguous (the layout transformers passes)."""
    check_against_reference(SHAPE, s, *ROT_LAYOUTS[layout], dtype, seed=s)


@pytest.mark.parametrize("d", [64, 80, 96, 128])
@pytest.mark.parametrize("s", [2, 8])
def test_head_dims(interpret, s, d):
    """Other head dims (80 and 96 are not powers of two: masked columns), no GQA, contiguous q, fp16 at 80."""
    check_against_reference((1, 2, 2, 5, d), s, False, True, torch.float16 if d == 80 else torch.float32,
                            seed=d, hf_layout=False)


def test_fixed_rotation_has_no_rot_grad(interpret):
    """A rotation that needs no gradient (rope): dq and dk only; q and k are not kept for backward."""
    check_against_reference(SHAPE, 2, False, False, torch.float32, rot_grad=False)
    q, k, rot, _, _ = make_inputs(SHAPE, 2, False, False, torch.float32)
    q.requires_grad_()
    assert len(triton_rotary.rotary_qk(q, k, rot)[0].grad_fn.saved_tensors) == 1  # rot only
    assert len(triton_rotary.rotary_qk(q, k, rot.requires_grad_())[0].grad_fn.saved_tensors) == 3


def test_split_pair_loop(interpret, monkeypatch):
    """Many programs (as on a large GPU at short L): the broadcast pairs are split and dR is reduced from
    per-split partial tiles; also a keys-only call and a last dim with stride != 1."""
    monkeypatch.setattr(triton_rotary, "_target_programs", lambda device: 10_000)
    for layout in ("shared", "batch", "heads"):
        check_against_reference(SHAPE, 4, *ROT_LAYOUTS[layout], torch.float32, seed=3)
    q, k, rot, gq, gk = make_inputs(SHAPE, 2, False, False, torch.float32)
    k_odd = k.transpose(-1, -2).contiguous().transpose(-1, -2)  # stride 1 along L, not D
    assert k_odd.stride(-1) != 1
    out = triton_rotary.rotary_single(k_odd, rot)
    assert rel_err(out, apply_block_rotation_reference(k, rot)) <= TOL[torch.float32]


@pytest.mark.parametrize("s", tiered([2, 8], fast=[2]))
def test_small_tiles(interpret, monkeypatch, s):
    """GPU-sized tiles (4 positions per program, L = 13: a partial last tile) in the interpreter."""
    monkeypatch.setattr(triton_rotary, "INTERPRETER_BLOCK_L", 4)
    for layout in ("shared", "batch_heads"):
        check_against_reference((2, 8, 2, 13, 40), s, *ROT_LAYOUTS[layout], torch.float32, seed=5)


def test_dispatch_forced_triton_runs_the_kernel(interpret, monkeypatch):
    """HF_POSENC_BACKEND=triton runs the kernel (here on the CPU, interpreted); unset on the CPU: reference."""
    calls = []
    real = triton_rotary.rotary_qk
    monkeypatch.setattr(triton_rotary, "rotary_qk", lambda *a: calls.append(1) or real(*a))
    q, k, rot, _, _ = make_inputs(SHAPE, 8, False, True, torch.float32)
    ref_q, ref_k = apply_qk_rotation_reference(q, k, rot)
    monkeypatch.setenv("HF_POSENC_BACKEND", "triton")
    out_q, out_k = apply_qk_rotation(q, k, rot)
    assert calls == [1]
    assert rel_err(out_q, ref_q) <= 1e-6 and rel_err(out_k, ref_k) <= 1e-6
    out = apply_block_rotation(k, rot)  # same kernel, keys only
    assert rel_err(out, ref_k) <= 1e-6
    monkeypatch.delenv("HF_POSENC_BACKEND")
    apply_qk_rotation(q, k, rot)
    assert calls == [1] or CUDA  # on the CPU, unforced: the reference


def test_forced_triton_on_cpu_without_interpreter_raises(monkeypatch):
    if _TRITON_MISSING is not None:
        pytest.skip(_TRITON_MISSING)
    monkeypatch.setenv("HF_POSENC_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, rot, _, _ = make_inputs(SHAPE, 2, False, False, torch.float32, device="cpu")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        apply_qk_rotation(q, k, rot)
    with pytest.raises(ValueError, match="CUDA"):
        apply_block_rotation(k, rot)


def test_forced_triton_without_triton_raises(monkeypatch):
    monkeypatch.setattr(rotary, "_triton_import_error", lambda: "ModuleNotFoundError: No module named 'triton'")
    monkeypatch.setenv("HF_POSENC_BACKEND", "triton")
    q, k, rot, _, _ = make_inputs(SHAPE, 2, False, False, torch.float32, device="cpu")
    with pytest.raises(ValueError, match="Triton is not available"):
        apply_qk_rotation(q, k, rot)
    monkeypatch.delenv("HF_POSENC_BACKEND")
    out_q, out_k = apply_qk_rotation(q, k, rot)  # unforced: the reference, no error
    assert torch.equal(out_k, apply_block_rotation_reference(k, rot))


def test_forced_triton_unsupported_inputs_raise(interpret, monkeypatch):
    monkeypatch.setenv("HF_POSENC_BACKEND", "triton")
    q, k, rot, _, _ = make_inputs((1, 2, 1, 3, 32), 16, False, False, torch.float32)
    with pytest.raises(ValueError, match="block sizes"):
        apply_qk_rotation(q, k, rot)
    q, k, rot, _, _ = make_inputs((1, 2, 1, 3, 32), 2, False, False, torch.float64)
    with pytest.raises(ValueError, match="float32, bfloat16 and float16"):
        apply_qk_rotation(q, k, rot)
    monkeypatch.setenv("HF_POSENC_BACKEND", "torch")  # the reference takes both
    apply_qk_rotation(q, k, rot)


def test_bad_backend_and_shapes_raise(monkeypatch):
    q, k, rot, _, _ = make_inputs(SHAPE, 2, False, False, torch.float32, device="cpu")
    monkeypatch.setenv("HF_POSENC_BACKEND", "cuda")
    with pytest.raises(ValueError, match="allowed: torch, flex, triton"):
        apply_qk_rotation(q, k, rot)
    monkeypatch.delenv("HF_POSENC_BACKEND")
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        apply_qk_rotation(q[:, :3], k, rot)
    with pytest.raises(ValueError, match="does not fit"):
        apply_qk_rotation(q, k, rot[:, :, :5])
    with pytest.raises(ValueError, match="1 or Hkv"):
        apply_qk_rotation(q, k, rot.expand(1, 3, *rot.shape[2:]))


# -- full sizes on a GPU ------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("s", [2, 4, 8])
@pytest.mark.parametrize("d", [64, 80, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("layout", ["shared", "heads", "batch_heads"])
def test_gpu_full_size(s, d, dtype, layout):
    pytest.importorskip("triton")
    check_against_reference((2, 32, 8, 1031, d), s, *ROT_LAYOUTS[layout], dtype, seed=d + s)


@pytest.mark.gpu
@needs_gpu
def test_gpu_auto_dispatch_uses_kernel(monkeypatch):
    """Unforced, CUDA tensors go to the kernel (and agree with the reference)."""
    pytest.importorskip("triton")
    monkeypatch.delenv("HF_POSENC_BACKEND", raising=False)
    calls = []
    real = triton_rotary.rotary_qk
    monkeypatch.setattr(triton_rotary, "rotary_qk", lambda *a: calls.append(1) or real(*a))
    q, k, rot, _, _ = make_inputs((1, 8, 2, 300, 128), 2, False, False, torch.bfloat16)
    out_q, out_k = apply_qk_rotation(q, k, rot)
    assert calls == [1]
    ref_q, ref_k = apply_qk_rotation_reference(q.float(), k.float(), rot)
    assert rel_err(out_q, ref_q) <= 1e-2 and rel_err(out_k, ref_k) <= 1e-2


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("s", [2, 4, 8])
def test_gpu_odd_and_long(monkeypatch, s, dtype):
    """Compiled kernel at L = 77, head_dim 40, GQA 4:1 and at L = 16384, D = 128 (rotation gradient included)."""
    pytest.importorskip("triton")
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    check_against_reference(SHAPE, s, True, True, dtype, seed=30 + s)
    check_against_reference((1, 8, 2, 16384, 128), s, False, False, dtype, seed=40 + s)
