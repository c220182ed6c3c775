"""The fused attention kernels (Triton) against their PyTorch reference, the reference against the encodings,
patched models on the kernel against the same models on PyTorch, and the dispatch in ``posenc_attention``.

Kernel tests compare the forward output and every gradient (q, k, v and the term's learned tensors) on
fresh random inputs with odd shapes (L = 77, head_dim = 40, GQA 4:1, left padding with fully masked query
rows, queries shorter than keys), in float32 and bfloat16, the reference in float32 on the same (rounded)
inputs, by relative error ||kernel − reference|| / ||reference||. On the CPU the kernels run in Triton's
interpreter: tests/conftest.py sets ``TRITON_INTERPRET=1`` before anything imports triton (see there why it
must come first); shapes stay small there (one program per (b, h) costs Python time). With a CUDA device the
same tests run compiled, and ``@pytest.mark.gpu`` tests add full sizes.
"""

from __future__ import annotations

import math

import pytest
import torch

from hf_posenc import attention as attention_module
from hf_posenc.encodings.base import PosContext
from hf_posenc.encodings.fire import Fire
from hf_posenc.kernels.attention import FLEX_KINDS, KERNEL_KINDS, KernelTerm, attention_reference, term_bias
from hf_posenc.kernels.attention.terms import example_term

from conftest import import_kernel_modules, left_pad, make_ids, make_model, tiered

# Skips only without Triton itself: an ImportError inside hf_posenc's kernel module fails the file (conftest).
(triton_attention,), _TRITON_MISSING = import_kernel_modules("hf_posenc.kernels.attention.triton_attention")

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
needs_gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")

#: (B, H, Hkv, Lq, Lk, D): GQA 4:1, odd L, a head_dim that is not a power of two.
SHAPE = (2, 4, 1, 77, 77, 40)
#: the same keys with a chunk of 21 queries (chunked prefill: query i is key 56 + i).
SHAPE_CHUNK = (2, 4, 1, 21, 77, 40)
#: relative error allowed against the float32 reference.
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}
#: the term tensors' gradients are sums over all pairs: allow float32 summation-order noise.
TOL_TERM = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}


@pytest.fixture
def interpret(monkeypatch):
    """Run the kernels (compiled on a GPU, interpreted on the CPU), with no backend forced."""
    if _TRITON_MISSING is not None:
        pytest.skip(_TRITON_MISSING)
    if not CUDA and not (triton_attention.interpreting() and triton_attention.stdlib_matches_mode()):
        pytest.skip("TRITON_INTERPRET=1 was not set before triton was imported (see tests/conftest.py)")
    monkeypatch.delenv("HF_POSENC_BACKEND", raising=False)


def rel_err(out: torch.Tensor, ref: torch.Tensor, floor: float = 1e-30) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(floor)).item()


# -- inputs --------------------------------------------------------------------------------------------


def make_term(kind: str, shape, q_offset: int, g: torch.Generator, device=DEVICE) -> tuple[KernelTerm, list]:
    """A term of ``kind`` for ``shape`` with fresh random tensors (its registry entry's example); returns it and
    the leaf tensors whose gradients the tests compare (float32, on ``device``)."""
    return example_term(kind, shape, q_offset, g, device)


def make_inputs(shape, dtype, seed, padding=True, device=DEVICE):
    """q (B, H, Lq, D) as transformers lays it out (a transposed view), k, v, the incoming gradient and the
    key-valid vector (row 1 left-padded by 5 keys: its first query rows see no key at all when Lq = Lk)."""
    b, h, hkv, lq, lk, d = shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, lq, h, d, generator=g).transpose(1, 2)
    k = torch.randn(b, hkv, lk, d, generator=g)
    v = torch.randn(b, hkv, lk, d, generator=g)
    gout = torch.randn(b, h, lq, d, generator=g)
    valid = None
    if padding:
        valid = torch.ones(b, lk, dtype=torch.bool)
        valid[1, :5] = False
        valid = valid.to(device)
    to = dict(device=device, dtype=dtype)
    return q.to(**to), k.to(**to), v.to(**to), gout.to(**to), valid, g


def run(fn, q, k, v, term, leaves, gout, **kw):
    """Forward and backward of ``fn``; returns (out, [dq, dk, dv, *d leaves])."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v, term, **kw)
    grads = torch.autograd.grad(out, [q, k, v, *leaves], gout)
    return out, list(grads)


def check(kind, shape, dtype, causal, seed=0, padding=True, q_offset=None):
    """The kernel against the float32 reference on the same inputs; returns the errors (for messages)."""
    b, h, hkv, lq, lk, d = shape
    q_offset = lk - lq if q_offset is None else q_offset
    q, k, v, gout, valid, g = make_inputs(shape, dtype, seed, padding)
    term, leaves = make_term(kind, shape, q_offset, g)
    kw = dict(scale=d**-0.5, causal=causal, q_offset=q_offset, key_valid=valid)
    out, grads = run(triton_attention.fused_attention, q, k, v, term, leaves, gout, **kw)
    ref, ref_grads = run(attention_reference, q.float(), k.float(), v.float(), term, leaves, gout.float(), **kw)
    assert out.dtype == dtype and out.shape == (b, h, lq, d)
    assert torch.isfinite(out).all() and all(torch.isfinite(x).all() for x in grads)
    errors = {"out": rel_err(out, ref)}
    names = ["dq", "dk", "dv"] + [f"d{i}" for i in range(len(leaves))]
    for name, got, want in zip(names, grads, ref_grads):
        errors[name] = rel_err(got, want)
    tol = TOL[dtype]
    for name, err in errors.items():
        limit = TOL_TERM[dtype] if name.startswith("d") and name not in ("dq", "dk", "dv") else tol * (1 if name == "out" else 2)
        assert err <= limit, f"{kind} {dtype} causal={causal}: {name} rel err {err:.2e} > {limit:.0e} ({errors})"
    return errors


# -- the kernels against the reference -----------------------------------------------------------------


@pytest.mark.parametrize("kind", tiered(KERNEL_KINDS, fast=["alibi"]))
def test_kernel_matches_reference(interpret, kind):
    """Causal, GQA 4:1, padding (fully masked rows), head_dim 40: L = 77 in float32, and a 21-query chunk at
    key offset 56 in bfloat16."""
    check(kind, SHAPE, torch.float32, causal=True, seed=1)
    check(kind, SHAPE_CHUNK, torch.bfloat16, causal=True, seed=2)


@pytest.mark.parametrize("kind", tiered(["t5", "shaw", "fox"], fast=["fox"]))
def test_kernel_bidirectional(interpret, kind):
    """Every query sees every valid key (ViT-style), terms that tell the sign of j − i apart (the others
    see |j − i| or max(i − j, 0), computed as in the causal tests)."""
    check(kind, (2, 4, 2, 45, 77, 40), torch.float32, causal=False, seed=3)


@pytest.mark.parametrize("offset", ["int", "tensor"])
@pytest.mark.parametrize("kind", tiered(["kerple_pow", "t5", "shaw", "fox"], fast=["kerple_pow"]))
def test_kernel_decode_with_empty_cache_slots(interpret, kind, offset):
    """One query at key 30 of 50 (a StaticCache with empty slots after it: causality hides them). A StaticCache
    gives the offset as a tensor: the kernels load it on the device (the host never reads it)."""
    q_offset = 30 if offset == "int" else torch.tensor(30)
    check(kind, (2, 4, 1, 1, 50, 40), torch.float32, causal=True, seed=4, padding=True, q_offset=q_offset)


@pytest.mark.parametrize("kind", tiered(["alibi", "fire", "fox"], fast=["alibi"]))
def test_kernel_tensor_offset_chunk(interpret, kind):
    """A 21-query chunk at key offset 56 given as a tensor: forward and every gradient (fox's gate gradient
    lands on the queries' key indices, placed by the tensor offset) as with the int offset."""
    check(kind, SHAPE_CHUNK, torch.float32, causal=True, seed=5, q_offset=torch.tensor(SHAPE_CHUNK[4] - SHAPE_CHUNK[3]))


@pytest.mark.parametrize("d", [64, 80, 96, 128])
def test_kernel_head_dims(interpret, d):
    check("kerple_log", (1, 2, 1, 19, 19, d), torch.float32, causal=True, seed=d, padding=False)


def test_kernel_float16(interpret):
    check("fox", (2, 4, 1, 33, 33, 40), torch.float16, causal=True, seed=6)


def test_kernel_without_term_gradients_saves_nothing_extra(interpret):
    """Fixed terms (alibi, sandwich) and frozen learned ones: only q, k, v get gradients."""
    q, k, v, gout, valid, g = make_inputs((1, 2, 2, 20, 20, 16), torch.float32, 7, padding=False)
    term, leaves = make_term("kerple_log", (1, 2, 2, 20, 20, 16), 0, g)
    for t in leaves:
        t.requires_grad_(False)
    out, grads = run(triton_attention.fused_attention, q, k, v, term, [], gout, scale=0.25, causal=True)
    ref, ref_grads = run(attention_reference, q, k, v, term, [], gout, scale=0.25, causal=True)
    assert all(rel_err(a, b) < 1e-4 for a, b in zip(grads, ref_grads))


def test_term_shapes_are_checked(interpret):
    q, k, v, _, _, g = make_inputs((2, 4, 1, 5, 9, 16), torch.float32, 0, padding=False)
    with pytest.raises(ValueError, match="built for 3 heads"):
        triton_attention.fused_attention(q, k, v, KernelTerm.alibi(torch.ones(3)), scale=1.0, causal=True)
    bad = KernelTerm.fire(torch.zeros(4, 8), torch.tensor(0.1), torch.ones(1, 9), torch.tensor(1.0))
    with pytest.raises(ValueError, match="inv_norm"):
        attention_reference(q, k, v, bad, scale=1.0, causal=True)
    with pytest.raises(ValueError, match="unknown kernel term"):
        KernelTerm("rope")


# -- the reference against the encodings' own math --------------------------------------------------------


def _encoding_and_ctx(name, batch=2, q_offset=7, q_len=5, **params):
    model = make_model("llama", encoding=name, **params)
    enc = model.model.posenc
    positions = torch.arange(q_len)[None] + q_offset - torch.tensor([[0], [3]])[:batch]  # row 1: 3 pads on the left
    ctx = PosContext(encoding=enc, info=enc.info, position_ids=positions.clamp_min(0), q_offset=q_offset)
    return model, enc, ctx


@pytest.mark.parametrize(
    "name, params",
    [("alibi", {}), ("kerple", {}), ("kerple", {"variant": "power"}), ("sandwich", {}), ("t5", {}),
     ("t5", {"per_layer": True}), ("fire", {})],
    ids=["alibi", "kerple-log", "kerple-power", "sandwich", "t5", "t5-per-layer", "fire"],
)
def test_reference_bias_matches_encoding(name, params):
    """term_bias(enc.kernel_term(...)) == enc.score_bias(...) for a decode-like chunk (Lq = 5 of Lk = 12);
    fire within the interpolation error of its tabulated MLP."""
    _, enc, ctx = _encoding_and_ctx(name, **params)
    q_len, k_len = 5, 12
    q = torch.randn(2, enc.info.num_heads, q_len, enc.info.head_dim)
    k = torch.randn(2, enc.info.num_kv_heads, k_len, enc.info.head_dim)
    for layer in (0, 1):
        want = enc.score_bias(ctx, q_len, k_len, q.device, layer)
        term = enc.kernel_term(ctx, layer, q, k, k, None)
        got = term_bias(term, q, q_len, k_len, ctx.q_offset)
        causal = torch.arange(q_len)[:, None] + ctx.q_offset >= torch.arange(k_len)[None]
        got, want = torch.broadcast_tensors(got, want)
        if name == "fire":  # tabulated at Fire.KERNEL_GRID points: exact away from the ReLU kinks
            assert (got - want)[..., causal].abs().max() < 2e-3 * want.abs().max()
        else:
            torch.testing.assert_close(got[..., causal], want[..., causal], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["shaw", "fox", "fox_pro"])
def test_reference_attention_matches_encoding(name):
    """attention_reference with enc.kernel_term == enc.attend (the encodings' own attention), on cached
    keys with state channels, left padding and a chunk of queries."""
    model, enc, ctx = _encoding_and_ctx(name)
    info = enc.info
    b, q_len, k_len = 2, 5, 12
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(b, k_len, info.hidden_size, generator=g)
    q = torch.randn(b, info.num_heads, k_len, info.head_dim, generator=g)
    k = torch.randn(b, info.num_kv_heads, k_len, info.head_dim, generator=g)
    v = torch.randn(b, info.num_kv_heads, k_len, info.head_dim, generator=g)
    full = PosContext(encoding=enc, info=info, position_ids=torch.arange(k_len)[None], q_offset=0)
    q, k, v = full.prepare(0, hidden, q, k, v)  # state channels appended to k (and v) as the cache holds them
    q = q[:, :, -q_len:]
    valid = torch.ones(b, k_len, dtype=torch.bool)
    valid[1, :3] = False
    causal = torch.arange(q_len)[:, None] + ctx.q_offset >= torch.arange(k_len)[None]
    mask = (valid[:, None, None, :] & causal)
    for layer in (0, 1):
        want, _ = enc.attend(ctx, layer, q, k, v, mask, 0.3, 0.0, False)
        term = enc.kernel_term(ctx, layer, q, k, v, mask)
        got = attention_reference(q, k, v, term, scale=0.3, causal=True, q_offset=ctx.q_offset, key_valid=valid)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# -- FlexAttention ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", tiered(FLEX_KINDS, fast=FLEX_KINDS[:2]))
def test_flex_forward_matches_reference(kind):
    """FlexAttention with the term's score_mod (forward only on the CPU: flex has no CPU backward)."""
    from hf_posenc.kernels.attention.flex import flex_attention_term

    shape = (2, 4, 1, 21, 77, 40)
    q, k, v, _, valid, g = make_inputs(shape, torch.float32, 8, device="cpu")
    term, _ = make_term(kind, shape, 56, g, device="cpu")
    kw = dict(scale=40**-0.5, causal=True, q_offset=56, key_valid=valid)
    with torch.no_grad():
        out = flex_attention_term(q, k, v, term, **kw)
        ref = attention_reference(q, k, v, term, **kw)
    assert rel_err(out, ref) < 1e-5


def test_flex_refuses_shaw():
    from hf_posenc.kernels.attention.flex import score_mod_for

    term = KernelTerm.shaw(torch.zeros(3, 8), torch.zeros(3, 8))
    with pytest.raises(ValueError, match="no FlexAttention form"):
        score_mod_for(term, 0)


# -- dispatch in posenc_attention ------------------------------------------------------------------------


def _spy(monkeypatch, name):
    calls = []
    real = getattr(attention_module, name)
    monkeypatch.setattr(attention_module, name, lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


def _padded_batch():
    return left_pad([make_ids(1, 9, seed=1)[0], make_ids(1, 6, seed=2)[0]])


def test_triton_setup_for_the_suite():
    """tests/conftest.py set TRITON_INTERPRET=1 before triton's first import (CPU), so Triton's own library
    functions are interpreted too and the kernels may call tl.sum / tl.max."""
    if _TRITON_MISSING is not None:
        pytest.skip(_TRITON_MISSING)
    if not CUDA:
        assert triton_attention.interpreting()
    assert triton_attention.stdlib_matches_mode()


def test_dispatch_cpu_unforced_uses_reference_forced_uses_kernel(interpret, monkeypatch):
    calls = _spy(monkeypatch, "fused_attention")
    model = make_model("llama", encoding="alibi")
    ids = make_ids(2, 8)
    with torch.no_grad():
        ref = model(ids).logits
        assert calls == [] or CUDA
        monkeypatch.setenv("HF_POSENC_BACKEND", "triton")
        out = model(ids).logits
    assert len(calls) >= 2  # one per layer
    assert rel_err(out, ref) < 1e-5
    assert attention_module.attention_backend(model.model.posenc, "cpu") == "triton"
    monkeypatch.setenv("HF_POSENC_BACKEND", "torch")
    assert attention_module.attention_backend(model.model.posenc, "cuda") == "torch"
    monkeypatch.delenv("HF_POSENC_BACKEND")
    assert attention_module.attention_backend(model.model.posenc, "cpu") == "torch"
    assert attention_module.attention_backend(make_model("llama", encoding="rope").model.posenc, "cuda") == "torch"


def test_forced_triton_on_cpu_without_interpreter_raises(monkeypatch):
    if _TRITON_MISSING is not None:
        pytest.skip(_TRITON_MISSING)
    if CUDA:
        pytest.skip("the tensors would be on CUDA")
    model = make_model("llama", encoding="t5")
    monkeypatch.setenv("HF_POSENC_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="HF_POSENC_BACKEND=triton, but the tensors are on cpu.*TRITON_INTERPRET=1"):
        model(make_ids(1, 5))


def test_forced_triton_refusals(interpret, monkeypatch):
    """Each thing the kernels do not take raises under HF_POSENC_BACKEND=triton, and falls back unforced."""
    monkeypatch.setenv("HF_POSENC_BACKEND", "triton")
    # ViT: 2D grid distances have no kernel term
    vit = make_model("vit", encoding="alibi")
    with pytest.raises(ValueError, match="no triton attention term on the 2D patch grid"):
        vit(pixel_values=torch.randn(1, 3, 32, 32))
    # attention dropout while training
    model = make_model("llama", encoding="kerple", train=True, config_overrides={"attention_dropout": 0.1})
    with pytest.raises(ValueError, match="attention dropout"):
        model(make_ids(1, 5))
    # a 4D mask that is not causal + key padding (two packed documents; checked in chunks of 2 rows)
    monkeypatch.setattr(attention_module, "_MASK_CHECK_ROWS", 2)
    model = make_model("llama", encoding="alibi")
    doc = torch.tensor([0, 0, 0, 1, 1, 1])
    mask = ((doc[:, None] == doc[None, :]) & torch.ones(6, 6, dtype=torch.bool).tril())[None, None]
    ids = make_ids(1, 6)
    with pytest.raises(ValueError, match="not causal \\+ key padding"):
        model(ids, attention_mask=mask)
    monkeypatch.delenv("HF_POSENC_BACKEND")  # unforced: every one of them runs the reference
    with torch.no_grad():
        vit(pixel_values=torch.randn(1, 3, 32, 32))
        model(ids, attention_mask=mask)


def test_forced_flex(monkeypatch, engine_calls):
    """HF_POSENC_BACKEND=flex: the score_mod path (forward under no_grad on the CPU; with gradients on the
    CPU it says why it cannot), seen to run once per layer."""
    model = make_model("llama", encoding="t5")
    ids, mask = _padded_batch()
    monkeypatch.setattr(attention_module, "_MASK_CHECK_ROWS", 4)  # the padding mask is recognised chunk by chunk
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
        assert engine_calls["flex"] == 0
        monkeypatch.setenv("HF_POSENC_BACKEND", "flex")
        out = model(ids, attention_mask=mask).logits
    assert engine_calls["flex"] == model.config.num_hidden_layers
    assert rel_err(out, ref) < 1e-5
    if not CUDA:
        with pytest.raises(ValueError, match="FlexAttention has no backward on cpu"):
            model(ids, attention_mask=mask)
    with pytest.raises(ValueError, match="no flex attention kernel for 'shaw'"):
        make_model("llama", encoding="shaw")(ids)


def test_output_attentions_use_the_eager_path(interpret, monkeypatch):
    calls = _spy(monkeypatch, "fused_attention")
    monkeypatch.setenv("HF_POSENC_BACKEND", "triton")
    model = make_model("llama", encoding="fox")
    with torch.no_grad():
        out = model(make_ids(1, 6), output_attentions=True)
    assert calls == [] and out.attentions[0].shape == (1, 4, 6, 6)


# -- patched models: kernel == reference -----------------------------------------------------------------

def _kink_free(model):
    """Make fire's MLP kink-free for x >= 0 (every hidden unit active: w1, b1 > 0), so that its table is
    interpolated exactly and the kernel path equals the reference up to rounding. With kinks, the tabulated
    MLP differs inside the grid cells that hold one (see Fire.kernel_term); its forward against score_bias
    is tested in test_reference_bias_matches_encoding, the kernel against the tabulated reference above."""
    enc = model.model.posenc
    if isinstance(enc, Fire):
        with torch.no_grad():
            enc.fc1_weight.abs_()
            enc.fc1_bias.abs_().add_(0.01)
    return model


MODEL_CASES = [("alibi", {}), ("kerple", {}), ("kerple", {"variant": "power"}), ("sandwich", {}), ("t5", {}),
               ("fire", {}), ("shaw", {}), ("fox", {}), ("fox_pro", {})]
MODEL_IDS = ["alibi", "kerple-log", "kerple-power", "sandwich", "t5", "fire", "shaw", "fox", "fox_pro"]


@pytest.mark.parametrize(
    "name, params", tiered([pytest.param(*c, id=i) for c, i in zip(MODEL_CASES, MODEL_IDS)], fast=["alibi", "fox"])
)
def test_model_triton_matches_torch(interpret, monkeypatch, engine_calls, name, params):
    """A patched tiny Llama (one layer, GQA 2:1, left-padded batch, train mode) gives the same logits, loss
    and gradients of every parameter (the encoding's included) on HF_POSENC_BACKEND=triton as on torch
    (per-layer parameter selection: test_reference_*_matches_encoding, layers 0 and 1).

    Every gradient is compared relative to the model's largest gradient norm, not its own: fire's fc2_bias
    adds one constant per head to every score of a row, which the softmax cancels, so its exact gradient is
    0 and its own relative error would measure rounding noise only (it reached 2.5e-5 on a fresh venv).
    fire: a kink-free (hence affine) MLP (``_kink_free``); c and L get their gradients through differences of
    neighbouring table entries (float32 cancellation), hence their looser bound."""
    ids, mask = _padded_batch()
    results = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("HF_POSENC_BACKEND", backend)
        model = _kink_free(make_model("llama", encoding=name, train=True, config_overrides={"num_hidden_layers": 1},
                                      **params))
        engine_calls.clear()
        out = model(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False)
        out.loss.backward()
        assert engine_calls["triton"] == (backend == "triton"), f"{backend}: {dict(engine_calls)}"  # the one layer
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        results[backend] = (out.logits.detach(), out.loss.detach(), grads)
    (ref, ref_loss, ref_grads), (got, loss, grads) = results["torch"], results["triton"]
    assert rel_err(got, ref) < 1e-5 and abs(loss - ref_loss) < 1e-5
    assert grads.keys() == ref_grads.keys()
    scale = max(g.norm() for g in ref_grads.values())
    for n, g in grads.items():
        tol = 1e-3 if n.endswith(("log_c", "log_threshold")) else 2e-5
        err = ((g.double() - ref_grads[n].double()).norm() / scale.double()).item()
        assert err < tol, f"{name}: gradient of {n} rel err {err:.1e}"


@pytest.mark.parametrize("name", ["fire", "fox"])
def test_model_generate_triton_matches_torch(interpret, monkeypatch, engine_calls, name):
    """Greedy decoding with a KV cache (left padding: position ids differ from cache indices; fire's
    normaliser follows the position ids, fox's gates ride in the cache); the kernels seen to run at every step
    (the prefill and the 2 decoding steps of the one layer) when forced, and not otherwise."""
    ids, mask = _padded_batch()
    outs = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("HF_POSENC_BACKEND", backend)
        model = _kink_free(make_model("llama", encoding=name, config_overrides={"num_hidden_layers": 1}))
        engine_calls.clear()
        with torch.no_grad():
            outs[backend] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                                           output_scores=True, return_dict_in_generate=True)
        assert engine_calls["triton"] == (3 if backend == "triton" else 0), f"{backend}: {dict(engine_calls)}"
    assert torch.equal(outs["torch"].sequences, outs["triton"].sequences)
    for a, b in zip(outs["torch"].scores, outs["triton"].scores):
        assert rel_err(b, a) < 1e-5


# -- full sizes on a GPU ------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("kind", KERNEL_KINDS)
def test_gpu_full_size(kind, dtype):
    pytest.importorskip("triton")
    for d in (64, 80, 128):
        check(kind, (2, 16, 4, 1031, 1031, d), dtype, causal=True, seed=d)
    check(kind, (2, 16, 4, 517, 1031, 128), dtype, causal=True, seed=1)
    check(kind, (2, 16, 4, 1, 1031, 128), dtype, causal=True, seed=2)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("name, params", MODEL_CASES, ids=MODEL_IDS)
def test_gpu_auto_dispatch_uses_kernel(monkeypatch, name, params):
    """Unforced, a patched model on CUDA runs the kernel (and agrees with the reference)."""
    pytest.importorskip("triton")
    monkeypatch.delenv("HF_POSENC_BACKEND", raising=False)
    calls = _spy(monkeypatch, "fused_attention")
    model = make_model("llama", encoding=name, **params).to("cuda")
    ids = make_ids(2, 300).to("cuda")
    with torch.no_grad():
        out = model(ids).logits
        assert len(calls) == 2
        monkeypatch.setenv("HF_POSENC_BACKEND", "torch")
        ref = model(ids).logits
    assert rel_err(out, ref) < 1e-4
    assert math.isfinite(out.float().sum().item())


@pytest.fixture
def no_tf32(monkeypatch):
    """float32 means float32 on the GPU: no TF32 in torch's matmuls (the reference) either."""
    if CUDA:
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("kind", KERNEL_KINDS)
def test_gpu_odd_shapes(interpret, no_tf32, kind, dtype):
    """Compiled kernels at the interpreter tests' odd shapes: L = 77, head_dim 40, GQA 4:1, left padding with
    fully masked rows, a 21-query chunk (Lq < Lk), bidirectional, decode with empty cache slots."""
    check(kind, SHAPE, dtype, causal=True, seed=11)
    check(kind, SHAPE_CHUNK, dtype, causal=True, seed=12)
    check(kind, (2, 4, 2, 45, 77, 40), dtype, causal=False, seed=13)
    check(kind, (2, 4, 1, 1, 50, 40), dtype, causal=True, seed=14, q_offset=30)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("kind", ["none", "alibi", "kerple_log", "t5", "fire", "shaw", "fox"])
def test_gpu_long_sequence_16k(interpret, kind):
    """L = 16384 in bfloat16 (B = 1, H = 4, Hkv = 1, D = 128), padding; and one decode query over 16k keys.
    The float32 reference holds a few (H, L, L) float32 tensors (~4 GiB each) on the GPU."""
    check(kind, (1, 4, 1, 16384, 16384, 128), torch.bfloat16, causal=True, seed=15)
    check(kind, (1, 4, 1, 1, 16384, 128), torch.bfloat16, causal=True, seed=16)
