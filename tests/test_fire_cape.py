"""``fire`` and ``cape``: hand-computed values, the normaliser across a KV cache and left padding, the
CAPE identities (zero MLP == base bias; the MLP runs across heads on the scaled pre-mask logits), and
every learned parameter's gradient against finite differences in float64."""

from __future__ import annotations

import math

import pytest
import torch
from torch.func import functional_call
from transformers import DynamicCache

import hf_posenc
from hf_posenc.config import PosEncConfig
from hf_posenc.encodings.base import ModelInfo, PosContext
from hf_posenc.encodings.cape import Cape
from hf_posenc.encodings.fire import FIRE_EPS, Fire
from hf_posenc.kernels.attention.naive import term_bias
from conftest import (
    enable_checkpointing,
    forward_and_loss,
    left_pad,
    make_ids,
    make_model,
    model_inputs,
    positions_from_mask,
    with_cache,
)

CPU = torch.device("cpu")
TEXT = ModelInfo("llama", 32, 2, 2, 16, 1, True, 64)
VIT = ModelInfo("vit", 32, 2, 2, 16, 1, False, 5, grid=(2, 2), patch_size=(8, 8))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, f"{tuple(a.shape)} vs {tuple(b.shape)}"
    return (a.float() - b.float()).abs().max().item()


# ---------------------------------------------------------------------------------------------------
# fire: closed form
# ---------------------------------------------------------------------------------------------------


def hand_fire(info: ModelInfo, c: float, threshold: float) -> Fire:
    """A one-layer FIRE with 2 heads, hidden width 2 and chosen weights:
    h = relu([x, 0.5 - x]); f(x) = (h0 + 2 h1 + 0.1, -h0 + 0.5 h1 - 0.2)."""
    cfg = PosEncConfig("fire", {"mlp_hidden": 2, "init_c": c, "init_threshold": threshold})
    enc = Fire(cfg, info)
    with torch.no_grad():
        enc.fc1_weight.copy_(torch.tensor([[1.0, -1.0]]))
        enc.fc1_bias.copy_(torch.tensor([[0.0, 0.5]]))
        enc.fc2_weight.copy_(torch.tensor([[[1.0, 2.0], [-1.0, 0.5]]]))
        enc.fc2_bias.copy_(torch.tensor([[0.1, -0.2]]))
    return enc


def hand_f(x: float) -> tuple[float, float]:
    h0, h1 = max(x, 0.0), max(0.5 - x, 0.0)
    return h0 + 2 * h1 + 0.1, -h0 + 0.5 * h1 - 0.2


def test_fire_text_equals_closed_form():
    c, L = 1.0, 2.0
    enc = hand_fire(TEXT, c, L)
    ctx = PosContext(encoding=enc, info=TEXT, position_ids=torch.arange(4)[None])
    bias = enc.score_bias(ctx, 4, 4, CPU)
    assert bias.shape == (1, 2, 4, 4) and bias.dtype == torch.float32
    for i in range(4):
        for j in range(i + 1):
            x = math.log(c * (i - j) + 1) / (math.log(c * max(L, i) + 1) + FIRE_EPS)
            torch.testing.assert_close(bias[0, :, i, j], torch.tensor(hand_f(x)), atol=1e-6, rtol=0)
    # by hand: i = 3 > L: x = log 4 / log 4 = 1 -> h = (1, 0) -> (1.1, -1.2)
    torch.testing.assert_close(bias[0, :, 3, 0], torch.tensor([1.1, -1.2]), atol=1e-5, rtol=0)
    # i = 1 < L = 2: the normaliser is psi(L): x = log 2 / log 3 = 0.63093 -> (0.73093, -0.83093)
    torch.testing.assert_close(bias[0, :, 1, 0], torch.tensor([0.73093, -0.83093]), atol=1e-5, rtol=0)
    # i = j: x = 0 -> h = (0, 0.5) -> (1.1, 0.05); future keys use distance 0 and stay finite
    torch.testing.assert_close(bias[0, :, 2, 2], torch.tensor([1.1, 0.05]), atol=1e-6, rtol=0)
    assert torch.isfinite(bias).all()
    torch.testing.assert_close(bias[0, :, 0, 3], bias[0, :, 0, 0])


@pytest.mark.parametrize("threshold", [1.0, 4.0], ids=["L-below-r", "L-above-r"])
def test_fire_vit_equals_closed_form(threshold):
    # 2x2 grid: the largest patch distance is r = sqrt(2); the normaliser is psi(max(L, r))
    c = 1.0
    enc = hand_fire(VIT, c, threshold)
    ctx = PosContext(encoding=enc, info=VIT, grid=(2, 2))
    bias = enc.score_bias(ctx, 5, 5, CPU)
    assert bias.shape == (1, 2, 5, 5)
    assert torch.all(bias[0, :, 0, :] == 0) and torch.all(bias[0, :, :, 0] == 0), "CLS pairs get a positional term"
    coords = [(0, 0), (0, 1), (1, 0), (1, 1)]
    norm = math.log(c * max(threshold, math.sqrt(2)) + 1) + FIRE_EPS
    for a, (ra, ca) in enumerate(coords):
        for b, (rb, cb) in enumerate(coords):
            x = math.log(c * math.hypot(ra - rb, ca - cb) + 1) / norm
            torch.testing.assert_close(bias[0, :, a + 1, b + 1], torch.tensor(hand_f(x)), atol=1e-6, rtol=0)
    if threshold == 1.0:  # the diagonal pair sits at r: x = 1 -> (1.1, -1.2); distance 1: x = log 2 / log(1 + sqrt 2)
        torch.testing.assert_close(bias[0, :, 1, 4], torch.tensor([1.1, -1.2]), atol=1e-5, rtol=0)
        torch.testing.assert_close(bias[0, :, 1, 2], torch.tensor([0.886440, -0.986440]), atol=1e-5, rtol=0)


def test_fire_parameters_are_reparametrised_positive():
    enc = Fire(PosEncConfig("fire", {"init_c": 0.3, "init_threshold": 100.0}), TEXT)
    fn = enc.function(0)
    torch.testing.assert_close(fn.c, torch.tensor(0.3))
    torch.testing.assert_close(fn.threshold, torch.tensor(100.0))
    with torch.no_grad():
        enc.log_c.fill_(-50.0)  # any real value is a valid c > 0 and L > 0
        enc.log_threshold.fill_(-50.0)
    fn = enc.function(0)
    assert fn.c > 0 and fn.threshold > 0


def test_fire_defaults_follow_the_paper():
    model = make_model("llama", encoding="fire")
    assert model.config.position_encoding == {
        "name": "fire", "mlp_hidden": 32, "init_c": 0.1, "init_threshold": 512.0, "per_layer": True
    }
    enc = hf_posenc.encoding_module(model)
    assert enc.bias_per_layer and enc.fc2_weight.shape == (2, 4, 32)  # one FIRE per layer, 4 heads
    torch.testing.assert_close(torch.exp(enc.log_c), torch.full((2,), 0.1))
    torch.testing.assert_close(torch.exp(enc.log_threshold), torch.full((2,), 512.0))
    shared = hf_posenc.encoding_module(make_model("llama", encoding="fire", per_layer=False))
    assert not shared.bias_per_layer and shared.fc2_weight.shape == (1, 4, 32)


@pytest.mark.parametrize(
    "params,err",
    [({"mlp_hidden": 0}, ValueError), ({"init_c": 0.0}, ValueError), ({"init_threshold": -1.0}, ValueError),
     ({"per_layer": "yes"}, TypeError), ({"mlp_hidden": 2.5}, TypeError)],
)
def test_fire_parameters_are_validated(params, err):
    with pytest.raises(err):
        PosEncConfig("fire", params)


# ---------------------------------------------------------------------------------------------------
# fire: the normaliser follows the query's absolute position (KV cache, left padding)
# ---------------------------------------------------------------------------------------------------


def test_fire_decode_bias_is_the_row_of_the_full_bias():
    torch.manual_seed(0)
    enc = Fire(PosEncConfig("fire", {"init_threshold": 3.0, "init_c": 0.5}), TEXT)
    n = 12
    full = enc.score_bias(PosContext(encoding=enc, info=TEXT, position_ids=torch.arange(n)[None]), n, n, CPU)
    for t in range(n):
        ctx = PosContext(encoding=enc, info=TEXT, position_ids=torch.tensor([[t]]), q_offset=t)
        step = enc.score_bias(ctx, 1, t + 1, CPU)
        assert max_diff(step, full[:, :, t : t + 1, : t + 1]) < 1e-6, f"decode step at position {t}"
    # a chunk of 3 queries after 5 cached keys, and a StaticCache's offset (a 0-d tensor) with empty slots
    ctx = PosContext(encoding=enc, info=TEXT, position_ids=torch.arange(5, 8)[None], q_offset=torch.tensor(5))
    chunk = enc.score_bias(ctx, 3, 16, CPU)
    assert max_diff(chunk[..., :n], full[:, :, 5:8, :n]) < 1e-6
    # the normaliser really depends on i here: rows past L differ from a normaliser fixed at psi(L)
    fn = enc.function(0)
    fixed = fn.mlp(fn.psi(torch.tensor(9.0)) / (fn.psi(fn.threshold) + FIRE_EPS))
    assert (full[0, :, 11, 2] - fixed).abs().max() > 1e-3


def test_fire_term_of_every_layer_at_once_equals_each_layers():
    """Without gradients the fused-attention term of every layer is built at once per forward (kept in its
    memo); each layer's tensors are those that layer builds alone (with gradients on, as in training)."""
    info = ModelInfo("llama", 32, 2, 2, 16, 3, True, 64)
    torch.manual_seed(0)
    enc = Fire(PosEncConfig("fire", {"init_threshold": 3.0, "init_c": 0.5}), info)
    with torch.no_grad():
        for p in enc.parameters():
            p.add_(0.2 * torch.randn_like(p))
    q = torch.randn(2, 2, 3, 16)
    for pos in (torch.arange(4, 7)[None], torch.tensor([[4, 5, 6], [1, 2, 3]])):  # one row, or per sequence
        ctx = PosContext(encoding=enc, info=info, position_ids=pos, q_offset=4)
        with torch.no_grad():
            shared = [enc.kernel_term(ctx, layer, q, q, q, None) for layer in range(3)]
        assert any(k[0] == "fire_every_layer_term" for k in ctx.memo if isinstance(k, tuple))
        own_ctx = PosContext(encoding=enc, info=info, position_ids=pos, q_offset=4)
        alone = [enc.kernel_term(own_ctx, layer, q, q, q, None) for layer in range(3)]  # gradients on
        assert not any(k[0] == "fire_every_layer_term" for k in own_ctx.memo if isinstance(k, tuple))
        for a, b in zip(shared, alone):
            for name in ("table", "c", "inv_norm", "x_max"):
                assert a.tensors[name].shape == b.tensors[name].shape, name
                assert max_diff(a.tensors[name], b.tensors[name].detach()) < 1e-6, name


def test_fire_decoding_bias_of_every_layer_at_once_equals_each_layers(monkeypatch):
    """A few queries without gradients build the exact bias of every layer at once per forward (kept in its memo);
    each layer's equals the bias that layer builds alone (gradients on), for one query or a chunk of three, one
    position row or one per sequence, in float32 and float64. Beyond ``EVERY_LAYER_BIAS_ELEMENTS`` each layer
    builds its own."""
    info = ModelInfo("llama", 32, 2, 2, 16, 3, True, 64)
    torch.manual_seed(0)
    enc = Fire(PosEncConfig("fire", {"init_threshold": 3.0, "init_c": 0.5}), info).eval()
    with torch.no_grad():
        for p in enc.parameters():
            p.add_(0.2 * torch.randn_like(p))

    def memoised(ctx):
        return any(k[0] == "fire_every_layer_bias" for k in ctx.memo if isinstance(k, tuple))

    for dtype, tol in ((torch.float32, 1e-6), (torch.float64, 1e-13)):
        enc = enc.to(dtype)
        for pos in (torch.tensor([[6]]), torch.tensor([[4, 5, 6], [1, 2, 3]])):
            q_len = pos.shape[1]
            ctx = PosContext(encoding=enc, info=info, position_ids=pos, q_offset=7 - q_len)
            with torch.no_grad():
                shared = [enc.score_bias(ctx, q_len, 7, CPU, layer) for layer in range(3)]
            assert memoised(ctx)
            own = PosContext(encoding=enc, info=info, position_ids=pos, q_offset=7 - q_len)
            alone = [enc.score_bias(own, q_len, 7, CPU, layer) for layer in range(3)]  # gradients on
            assert not memoised(own)
            for a, b in zip(shared, alone):
                assert a.dtype == b.dtype == dtype
                assert max_diff(a, b.detach()) < tol
    ctx = PosContext(encoding=enc, info=info, position_ids=torch.tensor([[6]]), q_offset=6)
    with torch.no_grad():
        enc.train()  # train mode: each layer builds its own (see Fire._every_layer_bias)
        enc.score_bias(ctx, 1, 7, CPU, 0)
        enc.eval()
        assert not memoised(ctx)
        monkeypatch.setattr(Fire, "EVERY_LAYER_BIAS_ELEMENTS", 3 * 32 * 7 - 1)  # layers x hidden x keys, one query
        enc.score_bias(ctx, 1, 7, CPU, 0)
        assert not memoised(ctx)


@pytest.mark.parametrize("padded", [False, True])
def test_fire_decoding_steps_skip_the_engines_on_the_cpu(padded, monkeypatch):
    """A decoding step on the CPU without gradients takes every layer's exact bias as SDPA's float mask instead of
    the tile engine (which would evaluate each layer's interpolated term): no engine call, and greedy decoding's
    logits equal those of one forward over the whole sequence (the fused term's), with left padding too."""
    import hf_posenc.attention as attention_mod

    model = make_model("llama", encoding="fire")
    enc = next(m for m in model.modules() if isinstance(m, Fire))
    with torch.no_grad():
        for p in enc.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))
    ids = make_ids(2, 20)  # a prompt of more than FEW_QUERIES tokens runs the engine
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :3] = 0
    calls = []  # the query lengths the tile engine ran
    original = attention_mod.tiled_attention
    monkeypatch.setattr(attention_mod, "tiled_attention", lambda *a, **k: calls.append(a[0].shape[2]) or original(*a, **k))
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
        full_mask = torch.cat([mask, torch.ones(2, 4, dtype=mask.dtype)], dim=1)
        ref = model(out.sequences, attention_mask=full_mask).logits
    assert 20 in calls and 24 in calls and 1 not in calls, calls  # the prompt and the reference ran the engine
    steps = torch.stack(out.logits, dim=1)[:, 1:]  # the logits of the decoding steps (the first is the prompt's)
    torch.testing.assert_close(steps, ref[:, 20:23], rtol=1e-4, atol=1e-4)
    ctx = PosContext(encoding=enc, info=enc.info, q_offset=0)
    with torch.no_grad():
        assert enc.skips_engines(ctx, torch.zeros(2, 2, 16, 16), torch.zeros(2, 2, 16, 16))
        assert not enc.skips_engines(ctx, torch.zeros(2, 2, 17, 16), torch.zeros(2, 2, 17, 16))  # not a decoding step
        assert not enc.skips_engines(ctx, torch.zeros(2, 2, 1, 16).bfloat16(), torch.zeros(2, 2, 1, 16).bfloat16())
        enc.train()  # (reentrant checkpointing's first pass runs without gradients)
        assert not enc.skips_engines(ctx, torch.zeros(2, 2, 16, 16), torch.zeros(2, 2, 16, 16))
        enc.eval()
    assert not enc.skips_engines(ctx, torch.zeros(2, 2, 1, 16), torch.zeros(2, 2, 1, 16))  # gradients to FIRE


def test_fire_left_padding_shifts_the_normaliser_position():
    torch.manual_seed(0)
    enc = Fire(PosEncConfig("fire", {"init_threshold": 2.0}), TEXT)
    pad = 3
    pos = positions_from_mask(torch.tensor([[0] * pad + [1] * 6, [1] * 9]))
    padded = enc.score_bias(PosContext(encoding=enc, info=TEXT, position_ids=pos), 9, 9, CPU)
    alone = enc.score_bias(PosContext(encoding=enc, info=TEXT, position_ids=torch.arange(6)[None]), 6, 6, CPU)
    assert padded.shape == (2, 2, 9, 9)
    real = torch.ones(6, 6, dtype=torch.bool).tril()
    assert max_diff(padded[0, :, pad:, pad:][:, real], alone[0][:, real]) < 1e-6
    assert max_diff(padded[1, :, :6, :6][:, real], alone[0][:, real]) < 1e-6


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_fire_small_threshold_cache_and_padding(family):
    """With L = 2 the normaliser moves with every position: decoding through a cache still gives the full
    forward's logits, and a left-padded row those of the row alone (the common tests run L = 512)."""
    model = make_model(family, encoding="fire", init_threshold=2.0)
    ids = make_ids(2, 9)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        past = DynamicCache(config=model.config)
        steps = [model(ids[:, :5], **with_cache(past)).logits]
        steps += [model(ids[:, t : t + 1], **with_cache(past)).logits for t in range(5, 9)]
        assert max_diff(torch.cat(steps, dim=1), full) < 1e-4

        short, long = make_ids(1, 5, seed=2)[0], make_ids(1, 8, seed=3)[0]
        pids, mask = left_pad([short, long])
        out = model(pids, attention_mask=mask, position_ids=positions_from_mask(mask), use_cache=False).logits
        alone = model(short[None], use_cache=False).logits
        assert max_diff(out[0, 3:], alone[0]) < 1e-5


# ---------------------------------------------------------------------------------------------------
# fire: gradients against finite differences (float64)
# ---------------------------------------------------------------------------------------------------


def gradcheck_params(module: torch.nn.Module, fn) -> None:
    """gradcheck of ``fn(module)`` with respect to every parameter of ``module`` (float64)."""
    module = module.double()
    names = [n for n, _ in module.named_parameters()]
    params = tuple(p.detach().clone().requires_grad_(True) for _, p in module.named_parameters())

    def run(*ps):
        return fn(lambda *a, **k: functional_call(module, dict(zip(names, ps)), a, k))

    assert torch.autograd.gradcheck(run, params, eps=1e-6, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("family", ["text", "vit"])
def test_fire_gradcheck(family):
    torch.manual_seed(0)
    info = TEXT if family == "text" else VIT
    # L = 4.5 sits between the query positions 3..7, so both sides of max(L, i) are checked
    enc = Fire(PosEncConfig("fire", {"mlp_hidden": 3, "init_threshold": 4.5, "init_c": 0.7}), info)
    if family == "text":
        ctx = PosContext(encoding=enc, info=info, position_ids=torch.arange(3, 8)[None], q_offset=3)
        shape = (5, 8)
    else:
        ctx = PosContext(encoding=enc, info=info, grid=(2, 2))
        shape = (5, 5)
    gradcheck_params(enc, lambda call: call("bias", ctx, *shape, CPU))


# ---------------------------------------------------------------------------------------------------
# cape
# ---------------------------------------------------------------------------------------------------

GQA = ModelInfo("llama", 32, 2, 1, 4, 2, True, 64)  # 2 query heads sharing 1 key/value head, 2 layers


def zero_mlps(enc: Cape) -> None:
    with torch.no_grad():
        for mlp in enc.mlps:
            mlp.fc2.weight.zero_()
            mlp.fc2.bias.zero_()


def test_cape_defaults_follow_the_paper():
    model = make_model("llama", encoding="cape")
    assert model.config.position_encoding == {"name": "cape", "base": "alibi", "mlp_hidden": 32}
    enc = hf_posenc.encoding_module(model)
    assert len(enc.mlps) == 2, "one MLP per layer"
    assert enc.mlps[0].fc1.weight.shape == (32, 8) and enc.mlps[0].fc2.weight.shape == (4, 32)  # 2H -> 32 -> H
    with pytest.raises(ValueError):
        PosEncConfig("cape", {"base": "t5"})
    with pytest.raises(ValueError):
        PosEncConfig("cape", {"mlp_hidden": 0})


@pytest.mark.parametrize("base", ["alibi", "kerple", "fire"])
def test_cape_scores_closed_form(base):
    """A = L + B + f([L, B]) at each (i, j), across heads, with L the scaled logits before any mask, B the base's
    registered term on text (its reference bias: the base's score_bias for alibi and kerple; FIRE's tabulated f_θ,
    within its interpolation error of FIRE's exact score_bias)."""
    torch.manual_seed(0)
    enc = Cape(PosEncConfig("cape", {"base": base, "mlp_hidden": 5}), GQA)
    q, k = torch.randn(2, 2, 3, 4), torch.randn(2, 1, 6, 4)
    ctx = PosContext(encoding=enc, info=GQA, position_ids=torch.arange(3, 6)[None], q_offset=3)
    layer, scaling = 1, 0.5
    got = enc.scores(ctx, layer, q, k, scaling)
    bias = term_bias(enc.base.term(ctx, layer, 3, 6, CPU), None, 3, 6, 3).expand(2, -1, -1, -1)
    exact = enc.base.score_bias(ctx, 3, 6, CPU, layer).expand(2, -1, -1, -1)
    torch.testing.assert_close(bias, exact, atol=1e-5 if base != "fire" else 1e-3, rtol=1e-5)
    mlp = enc.mlps[layer]
    want = torch.empty(2, 2, 3, 6)
    for b in range(2):
        for i in range(3):
            for j in range(6):
                logits = torch.stack([q[b, h, i] @ k[b, 0, j] for h in range(2)]) * scaling
                x = torch.cat([logits, bias[b, :, i, j]])
                hidden = torch.nn.functional.leaky_relu(mlp.fc1.weight @ x + mlp.fc1.bias, 0.01)
                want[b, :, i, j] = logits + bias[b, :, i, j] + mlp.fc2.weight @ hidden + mlp.fc2.bias
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)

    # the mask is applied after the MLP: attend == softmax(masked A) @ v, masked keys get exactly 0
    v = torch.randn(2, 1, 6, 4)
    mask = torch.ones(2, 1, 3, 6, dtype=torch.bool).tril(diagonal=3)
    mask[0, :, :, :2] = False  # left padding in row 0
    ctx.need_weights = True  # probabilities requested: the full-matrix reference
    out, probs = enc.attend(ctx, layer, q, k, v, mask, scaling, 0.0, False)
    ref = torch.softmax(want.masked_fill(~mask, float("-inf")), dim=-1)
    torch.testing.assert_close(probs, ref, atol=1e-6, rtol=1e-5)
    assert torch.all(probs.masked_fill(mask, 0) == 0)
    torch.testing.assert_close(out, ref @ v.expand(2, 2, 6, 4), atol=1e-5, rtol=1e-5)
    ctx.need_weights = False  # the tile-wise path: the same output, no probabilities
    tiled, none = enc.attend(ctx, layer, q, k, v, mask, scaling, 0.0, False)
    assert none is None
    torch.testing.assert_close(tiled, ref @ v.expand(2, 2, 6, 4), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("base", ["alibi", "kerple", "fire"])
@pytest.mark.parametrize("family", ["llama", "gpt2", "vit"])
def test_cape_with_zero_mlp_is_its_base_bias(family, base):
    """Zeroing the last layer of every MLP gives exactly attention with the base bias (the base encoding
    patched on its own, with the same base parameters)."""
    model = make_model(family, encoding="cape", base=base)
    ref = make_model(family, encoding=base)
    enc = hf_posenc.encoding_module(model)
    zero_mlps(enc)
    hf_posenc.encoding_module(ref).load_state_dict(enc.base.state_dict())
    with torch.no_grad():
        if family == "vit":
            inputs = model_inputs("vit")
            got, want = model(**inputs).logits, ref(**inputs).logits
        else:
            ids, mask = left_pad([make_ids(1, 6, seed=2)[0], make_ids(1, 9, seed=3)[0]])
            kw = dict(attention_mask=mask, position_ids=positions_from_mask(mask), use_cache=False)
            got, want = model(ids, **kw).logits[mask.bool()], ref(ids, **kw).logits[mask.bool()]
    assert max_diff(got, want) < 1e-5


def test_cape_mlp_changes_the_model_and_is_per_layer():
    model = make_model("llama", encoding="cape")
    ids = make_ids(2, 8)
    with torch.no_grad():
        before = model(ids).logits
        enc = hf_posenc.encoding_module(model)
        enc.mlps[1].fc2.weight.add_(0.5)  # only layer 1's MLP (a bias shared by all keys would cancel)
        after = model(ids).logits
    assert max_diff(before, after) > 1e-3


@pytest.mark.parametrize("base", ["alibi", "kerple", "fire"])
def test_cape_gradcheck(base):
    """Every parameter of CAPE (its MLPs and its base's learned parameters), and q and k, against finite
    differences on the pre-mask scores (the softmax after them has no parameter of the encoding)."""
    torch.manual_seed(0)
    enc = Cape(PosEncConfig("cape", {"base": base, "mlp_hidden": 3}), GQA).double()
    q = torch.randn(1, 2, 2, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 4, 4, dtype=torch.float64, requires_grad=True)
    ctx = PosContext(encoding=enc, info=GQA, position_ids=torch.tensor([[2, 3]]), q_offset=2)
    wrapper = _Scores(enc)
    names = [n for n, _ in wrapper.named_parameters()]
    params = tuple(p.detach().clone().requires_grad_(True) for _, p in wrapper.named_parameters())
    assert len(params) > (0 if base == "alibi" else 4), "the base's parameters are not part of cape"

    def run(q, k, *ps):
        ctx.memo.clear()
        return tuple(functional_call(wrapper, dict(zip(names, ps)), (ctx, layer, q, k)) for layer in (0, 1))

    assert torch.autograd.gradcheck(run, (q, k, *params), eps=1e-6, atol=1e-6, rtol=1e-4)


class _Scores(torch.nn.Module):
    """Calls ``Cape.scores`` as a module forward, for functional_call."""

    def __init__(self, enc: Cape) -> None:
        super().__init__()
        self.enc = enc

    def forward(self, ctx: PosContext, layer: int, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return self.enc.scores(ctx, layer, q, k, 0.5)


def test_cape_base_parameters_train_under_reentrant_checkpointing():
    """The base's learned parameters (FIRE here) get the same gradients with reentrant checkpointing."""
    inputs = model_inputs("llama")
    grads = []
    for ckpt in (False, True):
        model = make_model("llama", encoding="cape", base="fire", train=True)
        if ckpt:
            enable_checkpointing(model, {"use_reentrant": True})
        _, loss = forward_and_loss("llama", model, inputs)
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in hf_posenc.encoding_module(model).named_parameters()})
    assert sorted(grads[0]) == sorted(grads[1])
    for name, g in grads[0].items():
        assert g.abs().sum() > 0, f"{name} got no gradient"
        torch.testing.assert_close(grads[1][name], g, atol=1e-6, rtol=1e-5, msg=name)


def test_cape_bf16_computes_in_float32():
    model = make_model("gpt2", encoding="cape", base="fire", dtype=torch.bfloat16)
    enc = hf_posenc.encoding_module(model)
    assert all(p.dtype == torch.bfloat16 for p in enc.parameters())
    q = torch.randn(1, 4, 3, 8, dtype=torch.bfloat16)
    ctx = PosContext(encoding=enc, info=enc.info, position_ids=torch.arange(3)[None])
    scores = enc.scores(ctx, 0, q, q, 0.35)
    assert scores.dtype == torch.float32
    out, probs = enc.attend(ctx, 0, q, q, q, None, 0.35, 0.0, False)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


# ---------------------------------------------------------------------------------------------------
# fire: float64 stays float64
# ---------------------------------------------------------------------------------------------------


def fire_formula(enc: Fire, layer: int, distance: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """The paper's B_h = f_θ(ψ(δ) / (ψ(max(L, i)) + eps)) written out in float64: distance (..., Lq, Lk),
    position broadcastable to (..., Lq, 1) -> (..., H, Lq, Lk)."""
    w1, b1 = enc.fc1_weight[layer].double(), enc.fc1_bias[layer].double()
    w2, b2 = enc.fc2_weight[layer].double(), enc.fc2_bias[layer].double()
    c, threshold = enc.log_c[layer].double().exp(), enc.log_threshold[layer].double().exp()
    x = torch.log1p(c * distance.double()) / (torch.log1p(c * torch.maximum(threshold, position.double())) + FIRE_EPS)
    hidden = torch.relu(x[..., None] * w1 + b1)  # (..., Lq, Lk, hidden)
    return (hidden @ w2.T + b2).movedim(-1, -3)


def test_fire_float64_attention_is_the_papers_formula():
    """A float64 FIRE computes in float64 end to end: the attention of posenc_attention (the path a model
    takes) equals softmax(q k^T s + B) v with B from the paper's formula in float64, to 1e-12, with queries past
    the threshold L (the normaliser moves) after cached keys; and the ViT bias (normaliser at the grid's largest
    distance r = sqrt(8), irrational) equals the formula to 1e-12. In float32 the positions (and r) were
    float32 and the fused term tabulates f_θ: 1e-5 off."""
    from types import SimpleNamespace

    from hf_posenc.attention import posenc_attention

    torch.manual_seed(0)
    enc = Fire(PosEncConfig("fire", {"init_threshold": 4.0, "init_c": 0.7}), TEXT).double()
    q_len, off = 40, 3
    ctx = PosContext(encoding=enc, info=TEXT, position_ids=torch.arange(off, off + q_len)[None], q_offset=off)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, q_len, 16, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, q_len + off, 16, generator=g, dtype=torch.float64)
    v = torch.randn(1, 2, q_len + off, 16, generator=g, dtype=torch.float64)
    module = SimpleNamespace(is_causal=True, training=False, posenc_layer=0)
    out, _ = posenc_attention(module, q, k, v, None, scaling=0.25, posenc_ctx=ctx)
    assert out.dtype == torch.float64
    i = torch.arange(off, off + q_len, dtype=torch.float64)[:, None]
    j = torch.arange(q_len + off, dtype=torch.float64)[None]
    bias = fire_formula(enc, 0, (i - j).clamp_min(0), i)[None]  # (1, H, Lq, Lk)
    scores = (q @ k.transpose(-1, -2) * 0.25 + bias).masked_fill(j > i, -math.inf)
    want = (scores.softmax(-1) @ v).transpose(1, 2)
    assert (out - want).abs().max() < 1e-12

    vit = ModelInfo("vit", 32, 2, 2, 16, 1, False, 10, grid=(3, 3), patch_size=(8, 8))
    enc = Fire(PosEncConfig("fire", {"init_threshold": 1.0, "init_c": 0.7}), vit).double()
    bias = enc.score_bias(PosContext(encoding=enc, info=vit, grid=(3, 3)), 10, 10, CPU)
    assert bias.dtype == torch.float64
    rc = torch.tensor([(r, c) for r in range(3) for c in range(3)], dtype=torch.float64)
    dist = (rc[:, None] - rc[None]).pow(2).sum(-1).sqrt()
    want = fire_formula(enc, 0, dist, torch.tensor(math.hypot(2, 2), dtype=torch.float64))
    assert (bias[0, :, 1:, 1:] - want).abs().max() < 1e-12
