"""The remap engine's Triton kernels (`hf_posenc.kernels.remap.triton_span`): one piece's attention over an interval
of keys per query, against the same attention from its full (Lq × Lk) logits (forward, log-sum-exp and every
gradient, relative error); and the whole engine on that path (``HF_POSENC_BACKEND=triton``) against the full-matrix
oracle for every remap. On a CPU-only machine the kernels run in Triton's interpreter (small shapes); the
``@pytest.mark.gpu`` test runs them compiled, at a real head dim, on CUDA."""

from __future__ import annotations

import pytest
import torch

from hf_posenc.kernels.remap import remap_attention, remap_reference

from conftest import import_kernel_modules, tiered
from test_remap import REMAPS, _inputs

(span,), _NO_TRITON = import_kernel_modules("hf_posenc.kernels.remap.triton_span")
pytestmark = pytest.mark.skipif(_NO_TRITON is not None, reason=str(_NO_TRITON))
CUDA = torch.cuda.is_available()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _intervals(b: int, lq: int, lk: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random intervals per row, some empty, some reaching either end."""
    g = torch.Generator().manual_seed(seed)
    lo = torch.randint(0, lk, (b, lq), generator=g)
    hi = (lo + torch.randint(-4, lk // 2, (b, lq), generator=g)).clamp(0, lk)
    lo[:, 0], hi[:, 0] = 0, lk  # a row that sees every key
    return lo.to(torch.int32), hi.to(torch.int32)


def _dense(q, k, v, lo, hi, scale):
    """The piece from its full logits, with autograd: (out, lse), −inf where a row sees no key."""
    groups = q.shape[1] // k.shape[1]
    j = torch.arange(k.shape[2], device=q.device)
    allowed = ((j >= lo[..., None].long()) & (j < hi[..., None].long()))[:, None]
    s = (q.float() @ k.float().repeat_interleave(groups, 1).transpose(-1, -2)) * scale
    s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return p @ v.float().repeat_interleave(groups, 1), lse


def _check_piece(device, dtype, b, h, hkv, lq, lk, d, tol):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(b, h, lq, d, generator=g).to(device, dtype)
    k = torch.randn(b, hkv, lk, d, generator=g).to(device, dtype)
    v = torch.randn(b, hkv, lk, d, generator=g).to(device, dtype)
    lo, hi = (t.to(device) for t in _intervals(b, lq, lk, 2))
    out, lse = span.span_forward(q, k, v, lo, hi, 0.3)
    qr, kr, vr = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref, ref_lse = _dense(qr, kr, vr, lo, hi, 0.3)
    assert _rel(out, ref) < tol
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    live = ~torch.isinf(ref_lse)
    assert (lse[live] - ref_lse[live]).abs().max().item() < tol * 10
    do = torch.randn(out.shape, generator=g).to(device)
    ref.backward(do)
    delta = (do * out).sum(-1).contiguous()
    lse_b = lse.masked_fill(torch.isinf(lse), float("inf")).contiguous()
    dq, dk, dv = span.span_backward(do.to(dtype).contiguous(), q, k, v, lse_b, delta, lo, hi, 0.3)
    for got, want in ((dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        assert _rel(got, want) < tol


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("shape", [(2, 4, 2, 37, 41, 24), (1, 2, 2, 5, 50, 16)], ids=["gqa", "few-queries"])
def test_piece_matches_its_dense_logits(dtype, tol, shape):
    _check_piece("cpu", dtype, *shape, tol=tol)


def test_block_tables_cover_every_row_interval():
    """`block_bounds` and `key_rows`: every (row, key) pair of the intervals lies in its query block's key range and
    in its key block's row range (the kernels visit nothing else)."""
    lo, hi = _intervals(2, 45, 53, 3)
    bm, bn = 16, 8
    blocks = span.block_bounds(lo, hi, bm)
    rows = span.key_rows(blocks, bm, bn, 45, 53)
    for b in range(2):
        for i in range(45):
            for j in range(int(lo[b, i]), int(hi[b, i])):
                assert blocks[b, i // bm, 0] <= j < blocks[b, i // bm, 1]
                assert rows[b, j // bn, 0] <= i < rows[b, j // bn, 1]


@pytest.mark.parametrize("name", sorted(REMAPS))
def test_engine_on_the_kernels_matches_the_oracle(name, monkeypatch):
    """The engine with ``HF_POSENC_BACKEND=triton`` (every piece through the kernels: counted) against the oracle,
    float32 forward and the gradients of q, k and v, with left padding and a query offset."""
    monkeypatch.setenv("HF_POSENC_BACKEND", "triton")
    calls = []
    for fn in ("span_forward", "span_backward"):
        real = getattr(span, fn)
        monkeypatch.setattr(span, fn, lambda *a, _real=real, _fn=fn, **kw: calls.append(_fn) or _real(*a, **kw))
    q, k, v, args, pos_k, shift = _inputs(dtype=torch.float32, lq=30, q_offset=4, shift=[0, 3])
    key_valid = torch.arange(k.shape[2])[None] >= shift
    remap = REMAPS[name]
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    expected = remap_reference(q.double(), k.double(), v.double(), remap, pos_k=pos_k, key_valid=key_valid, **args)
    got = remap_attention(q, k, v, remap, key_valid=key_valid, **args)
    assert _rel(got, expected) < 1e-5
    grad = torch.randn_like(got)
    for want, have in zip(torch.autograd.grad(expected, (q, k, v), grad.double()),
                          torch.autograd.grad(got, (q, k, v), grad)):
        assert _rel(have, want) < 1e-5
    pieces = len(remap.cases())
    assert calls.count("span_forward") == pieces and calls.count("span_backward") == pieces


def test_forced_triton_names_what_it_cannot_take(monkeypatch):
    monkeypatch.setenv("HF_POSENC_BACKEND", "triton")
    q, k, v, args, _, _ = _inputs()  # float64: not a kernel dtype
    with pytest.raises(ValueError, match="HF_POSENC_BACKEND=triton, but the remap kernel supports float32"):
        remap_attention(q, k, v, REMAPS["dca"], **args)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_piece_on_cuda(dtype, tol):
    _check_piece("cuda", dtype, 2, 8, 2, 1000, 1100, 128, tol)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", sorted(REMAPS))
def test_engine_on_cuda_matches_the_oracle(name):
    q, k, v, args, pos_k, shift = _inputs(dtype=torch.float32, lq=300, q_offset=20, shift=[0, 7], d=64, r=64)
    key_valid = torch.arange(k.shape[2])[None] >= shift
    to = lambda t: t.cuda() if isinstance(t, torch.Tensor) else t  # noqa: E731
    q, k, v = (to(t).requires_grad_() for t in (q, k, v))
    args = {key: to(value) for key, value in args.items()}
    expected = remap_reference(q.double(), k.double(), v.double(), REMAPS[name], pos_k=to(pos_k),
                               key_valid=to(key_valid), **args)
    got = remap_attention(q, k, v, REMAPS[name], key_valid=to(key_valid), **args)
    assert _rel(got, expected) < 1e-4
    grad = torch.randn_like(got)
    for want, have in zip(torch.autograd.grad(expected, (q, k, v), grad.double()),
                          torch.autograd.grad(got, (q, k, v), grad)):
        assert _rel(have, want) < 1e-4


@pytest.mark.parametrize("family", tiered(["llama", "gpt_neox"], fast=["llama"]))
def test_model_on_the_kernels_decodes_like_its_full_forward(family, monkeypatch):
    """A tiny model past its context (P = 64) with DCA, every attention call on the kernels: the full forward
    equals the PyTorch path's, and prefill + decoding through the cache equals the full forward (float32)."""
    from conftest import MAX_POSITIONS, VOCAB, make_model
    from test_remap import _decode_all

    model = make_model(family, encoding="rope", dtype=torch.float32, remap="dca")
    ids = torch.randint(0, VOCAB, (1, 2 * MAX_POSITIONS + 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        monkeypatch.setenv("HF_POSENC_BACKEND", "torch")
        expected = model(ids).logits
        monkeypatch.setenv("HF_POSENC_BACKEND", "triton")
        calls = []
        real = span.span_forward
        monkeypatch.setattr(span, "span_forward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
        full = model(ids).logits
        steps = _decode_all(model, ids, ids.shape[1] - 4)  # the last steps: each a launch per piece and layer
    assert calls
    assert _rel(full, expected) < 1e-5
    assert _rel(steps, full) < 1e-5
