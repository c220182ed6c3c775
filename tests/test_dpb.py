"""``dpb`` (Dynamic Position Bias): its bias against hand computations (text, log-distance, ViT's 2D offsets), its
term in every engine (reference, tile engine, FlexAttention, Triton through t5's branch) and in patched models.

The common tests (forward/backward on every family, cache == full forward, save and reload, generate, padding,
gradient checkpointing) pick ``dpb`` up from the registry (tests/conftest.py's ``ENCODINGS``); the tile-engine
and FlexAttention tests of tests/test_tiled_attention.py and tests/test_kernel_attention.py take its term from
the term registry (``TILED_KINDS``, ``FLEX_KINDS``).
"""

from __future__ import annotations

import math

import pytest
import torch

import hf_posenc
from hf_posenc import attention as attention_module
from hf_posenc.encodings.base import PosContext
from hf_posenc.kernels.attention import KernelTerm, attention_reference, kernel_unsupported, term_bias
from hf_posenc.kernels.attention.terms import T5_BRANCH_MAX_ROWS, TERMS, example_term

from conftest import make_model
from test_kernel_attention import SHAPE, _padded_batch, interpret, make_inputs, rel_err, run  # noqa: F401


def _silu(x: float) -> float:
    return x / (1.0 + math.exp(-x))


def _set(enc, **values) -> None:
    with torch.no_grad():
        for name, value in values.items():
            getattr(enc, name).copy_(torch.tensor(value, dtype=torch.float32))


def _hand_model(family: str = "llama", **params):
    """A model whose DPB is depth 1, hidden 2, with hand-set weights: MLP(x)_h = Σ_u w_out[h, u] silu(w_in[u] x + b_in[u])
    + b_out[h] (H = 4 heads)."""
    model = make_model(family, encoding="dpb", hidden=2, depth=1, **params)
    enc = hf_posenc.encoding_module(model)
    d_in = 2 if family == "vit" else 1
    w_in = [[0.5] * d_in, [-0.25, 0.75][:d_in]]
    _set(enc, w_in=[w_in], b_in=[[0.1, -0.2]], w_out=[[[1.0, 0.0], [0.0, 1.0], [0.5, -0.5], [-1.0, 2.0]]],
         b_out=[[0.0, 0.3, -0.1, 0.2]])
    return model, enc


W_OUT = [[1.0, 0.0], [0.0, 1.0], [0.5, -0.5], [-1.0, 2.0]]
B_OUT = [0.0, 0.3, -0.1, 0.2]


def _hand(h: int, x: float) -> float:
    """The hand model's MLP at a scalar input x (text)."""
    hidden = [_silu(0.5 * x + 0.1), _silu(-0.25 * x - 0.2)]
    return sum(w * u for w, u in zip(W_OUT[h], hidden)) + B_OUT[h]


def _ctx(enc, q_len: int, k_len: int, grid=None) -> PosContext:
    return PosContext(encoding=enc, info=enc.info, q_offset=k_len - q_len, grid=grid)


@pytest.mark.parametrize("log_distance", [False, True], ids=["distance", "log-distance"])
def test_text_bias_matches_hand_computation(log_distance):
    """B_h(i, j) = MLP(x)_h with x = i − j (or sign(i − j) log(1 + |i − j|)), for 3 queries after 2 cached keys:
    every (query, key) pair against the formula computed with Python's math."""
    _, enc = _hand_model(log_distance=log_distance)
    bias = enc.score_bias(_ctx(enc, 3, 5), 3, 5, torch.device("cpu"))
    assert bias.shape == (1, 4, 3, 5)
    for h in range(4):
        for i in range(3):
            for j in range(5):
                delta = (2 + i) - j
                x = math.copysign(math.log1p(abs(delta)), delta) if log_distance else float(delta)
                assert bias[0, h, i, j].item() == pytest.approx(_hand(h, x), abs=1e-6), (h, i, j)


def test_vit_bias_is_the_mlp_of_the_2d_offset():
    """ViT: B_h(i, j) = MLP(Δrow, Δcol)_h with Δ = query − key on the patch grid (CrossFormer's form); 0 on every
    pair with the CLS token. Against a pair-by-pair evaluation in Python."""
    model, enc = _hand_model("vit")
    rows, cols = enc.info.grid
    n = rows * cols + 1
    bias = enc.score_bias(PosContext(encoding=enc, info=enc.info, grid=(rows, cols)), n, n, torch.device("cpu"))
    w_in = [[0.5, 0.5], [-0.25, 0.75]]
    b_in = [0.1, -0.2]
    for h in range(4):
        for i in range(n):
            for j in range(n):
                if i == 0 or j == 0:
                    assert bias[0, h, i, j].item() == 0.0
                    continue
                dr = (i - 1) // cols - (j - 1) // cols
                dc = (i - 1) % cols - (j - 1) % cols
                hidden = [_silu(w[0] * dr + w[1] * dc + b) for w, b in zip(w_in, b_in)]
                want = sum(w * u for w, u in zip(W_OUT[h], hidden)) + B_OUT[h]
                assert bias[0, h, i, j].item() == pytest.approx(want, abs=1e-6), (h, i, j)
    assert enc.kernel_term(PosContext(encoding=enc, info=enc.info, grid=(rows, cols)), 0,
                           torch.zeros(1, 4, n, 8), torch.zeros(1, 2, n, 8), None, None) is None


@pytest.mark.parametrize("family", ["llama", "bert"])
def test_kernel_term_is_score_bias(family):
    """The fused term's reference bias (the term registry's value of the table) equals ``score_bias``, bit for
    bit, causal and bidirectional, a chunk after a cache, per layer."""
    model = make_model(family, encoding="dpb", per_layer=True, depth=3, norm=True, log_distance=True)
    enc = hf_posenc.encoding_module(model)
    q = torch.zeros(1, enc.info.num_heads, 4, enc.info.head_dim)
    k = torch.zeros(1, enc.info.num_kv_heads, 11, enc.info.head_dim)
    for layer in (0, 1):
        ctx = _ctx(enc, 4, 11)
        term = enc.kernel_term(ctx, layer, q, k, k, None)
        assert term.kind == "dpb" and term.tensors["table"].shape == (enc.info.num_heads, 2 * 10 + 1)
        assert torch.equal(term_bias(term, q, 4, 11, 7), enc.score_bias(_ctx(enc, 4, 11), 4, 11, q.device, layer))


def test_table_is_built_once_per_forward_and_shared():
    """One MLP shared by the layers: without autograd one table per forward (memoised), read by every layer's term;
    with autograd one per layer (activation checkpointing recomputes a layer's table with the layer)."""
    model = make_model("llama", encoding="dpb")
    enc = hf_posenc.encoding_module(model)
    q = torch.zeros(1, 4, 6, 8)
    ctx = _ctx(enc, 6, 6)
    with torch.no_grad():
        first = enc.kernel_term(ctx, 0, q, q[:, :2], q[:, :2], None).tensors["table"]
        assert enc.kernel_term(ctx, 1, q, q[:, :2], q[:, :2], None).tensors["table"] is first
    first = enc.kernel_term(ctx, 0, q, q[:, :2], q[:, :2], None).tensors["table"]
    second = enc.kernel_term(ctx, 1, q, q[:, :2], q[:, :2], None).tensors["table"]
    assert first is not second and first.requires_grad and torch.equal(first, second)


def test_term_registry_entry():
    """dpb is a Toeplitz term with one learned table, on Triton's t5 branch (through ``lower``), with a Flex form."""
    spec = TERMS["dpb"]
    assert spec.form == "toeplitz" and spec.flex and spec.triton == "t5"
    assert [t.name for t in spec.tensors] == ["table"] and spec.tensors[0].grad
    with pytest.raises(ValueError, match="2M \\+ 1"):
        KernelTerm.build("dpb", table=torch.zeros(4, 6))
    with pytest.raises(ValueError, match="takes the tensors"):
        KernelTerm.build("dpb", slopes=torch.zeros(4))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_triton_kernel_matches_reference(interpret, causal):
    """The Triton kernel runs dpb on t5's branch (table rows flipped, identity buckets): output and every gradient
    (q, k, v, the table) against the reference, GQA 4:1, left padding, L = 77."""
    from hf_posenc.kernels.attention import triton_attention

    q, k, v, gout, valid, g = make_inputs(SHAPE, torch.float32, 0)
    term, leaves = example_term("dpb", SHAPE, 0, g, q.device)
    kw = dict(scale=0.3, causal=causal, q_offset=0, key_valid=valid)
    assert kernel_unsupported(q.requires_grad_(), k, v, term) is None
    out, grads = run(triton_attention.fused_attention, q, k, v, term, leaves, gout, **kw)
    ref, ref_grads = run(attention_reference, q, k, v, term, leaves, gout, **kw)
    assert rel_err(out, ref) < 2e-5
    for got, want in zip(grads, ref_grads):
        assert rel_err(got, want) < 1e-4


def test_triton_refuses_a_long_table_with_a_gradient_only(interpret):
    """Past T5_BRANCH_MAX_ROWS relative positions the t5 branch's backward histogram does not fit: the kernel
    refuses the term when a gradient is wanted (the dispatcher then runs the tile engine), and runs its forward
    without one, against the reference."""
    from hf_posenc.kernels.attention import triton_attention

    shape = (1, 4, 2, 9, 9, 16)
    q, k, v, _, _, g = make_inputs(shape, torch.float32, 1, padding=False)
    table = torch.randn(4, T5_BRANCH_MAX_ROWS + 2, generator=g)[:, :-1].contiguous()  # 2M + 1 > the limit
    term = KernelTerm.build("dpb", table=table.requires_grad_())
    assert "histogram" in kernel_unsupported(q, k, v, term)
    with torch.no_grad():
        assert kernel_unsupported(q, k, v, term) is None
        out = triton_attention.fused_attention(q, k, v, term, scale=0.25, causal=True)
        ref = attention_reference(q, k, v, term, scale=0.25, causal=True)
    assert rel_err(out, ref) < 2e-5


def test_model_engines_match_reference(interpret, engine_calls):
    """A patched tiny Llama (left-padded batch, train mode) gives the same logits, loss and gradients of every
    parameter (the MLP's included, through the table) on the tile engine and on the Triton kernel (interpreted on
    the CPU) as on the full-matrix reference; each engine seen to run (and only it)."""
    ids, mask = _padded_batch()
    results = {}
    for engine in ("reference", "tiled", "triton"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("HF_POSENC_BACKEND", "triton" if engine == "triton" else "torch")
            if engine == "reference":
                mp.setattr(attention_module, "_tiled_torch_attention", lambda *a, **k: None)
            calls = []
            real = attention_module.tiled_attention
            mp.setattr(attention_module, "tiled_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
            model = make_model("llama", encoding="dpb", train=True, config_overrides={"num_hidden_layers": 1},
                               log_distance=True)
            engine_calls.clear()
            out = model(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False)
            out.loss.backward()
        assert bool(calls) == (engine == "tiled")
        assert engine_calls["triton"] == (engine == "triton"), f"{engine}: {dict(engine_calls)}"  # the one layer
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        results[engine] = (out.logits.detach(), out.loss.detach(), grads)
    ref, ref_loss, ref_grads = results.pop("reference")
    assert any("w_in" in n for n in ref_grads)
    scale = max(g.norm() for g in ref_grads.values())
    for engine, (got, loss, grads) in results.items():
        assert rel_err(got, ref) < 1e-5 and abs(loss - ref_loss) < 1e-5, engine
        assert grads.keys() == ref_grads.keys()
        for n, gr in grads.items():
            err = ((gr.double() - ref_grads[n].double()).norm() / scale.double()).item()
            assert err < 2e-5, f"{engine}: gradient of {n} rel err {err:.1e}"


def test_defaults_follow_x_transformers():
    """hidden = the model's hidden size // 4, depth 2, no log distance, no norm, one MLP for all layers."""
    model = make_model("llama", encoding="dpb")
    enc = hf_posenc.encoding_module(model)
    p = enc.posenc_config.params
    assert (p["hidden"], p["depth"], p["log_distance"], p["norm"], p["per_layer"]) == (
        enc.info.hidden_size // 4, 2, False, False, False)
    assert enc.w_in.shape == (1, p["hidden"], 1) and enc.w_mid.shape == (1, 1, p["hidden"], p["hidden"])
    with pytest.raises(ValueError):
        make_model("llama", encoding="dpb", depth=0)
