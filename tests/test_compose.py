"""Compositions (``"rope+fox"``: an absolute or rotary encoding and a term in one layer) and the inert start
(``init="identity"``); see :mod:`hf_posenc.encodings.compose`.

Oracles:
* a score bias composed with ``rope`` equals the *unpatched* model (its own rotary, transformers' eager
  attention) with the term's bias added through a 4D float attention mask;
* ``rope+fox`` equals ``fox`` with its own ``rope=True`` at the model's base, with the same gate weights;
* every engine (the tile-wise PyTorch engine, FlexAttention's forward, the Triton kernels in the interpreter)
  against the full-matrix reference path (``output_attentions=True``), forward and gradients;
* ``init="identity"``: the unpatched model's logits (exactly where a zero gives exactly nothing).
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import hf_posenc
from hf_posenc.encodings.base import PosContext
from hf_posenc.encodings.fox import INERT_GATE_BIAS

from conftest import make_ids, make_model, returned_cache, with_cache

IDS = make_ids(2, 12)


def _llama(eager: bool = False, layers: int = 2):
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rope_theta=10000.0, initializer_range=0.2,
        attn_implementation="eager" if eager else "sdpa",
    )
    return AutoModelForCausalLM.from_config(cfg).eval()


# -- names and parameters --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, match",
    [
        ("alibi+t5", "both terms"),
        ("rope+liere", "both absolute or rotary"),
        ("t5+rope", "comes first; use 'rope\\+t5'"),
        ("rope+fox_pro", "cannot be composed"),
        ("rope+tape", "fits neither slot"),
        ("rope+fox+t5", "one absolute or rotary encoding"),
        ("rope+", "one absolute or rotary encoding"),
        ("rope+nosuch", "unknown position encoding 'nosuch'"),
    ],
)
def test_invalid_compositions_name_the_slots(name, match):
    with pytest.raises(ValueError, match=match):
        hf_posenc.patch_model(_llama(), name)


def test_parameters_route_to_their_part():
    m = hf_posenc.patch_model(_llama(), "rope+fire", mlp_hidden=8, theta=500.0, window=6)
    stored = m.config.position_encoding
    assert stored["fire"]["mlp_hidden"] == 8 and stored["rope"]["theta"] == 500.0
    assert stored["window"] == 6 and stored["init"] == "default"
    m = hf_posenc.patch_model(_llama(), "liere+t5", t5={"per_layer": True}, liere={"per_layer": False})
    assert m.config.position_encoding["t5"]["per_layer"] is True
    assert m.config.position_encoding["liere"]["per_layer"] is False
    with pytest.raises(ValueError, match="belongs to both 'liere' and 't5'"):
        hf_posenc.patch_model(_llama(), "liere+t5", per_layer=True)
    with pytest.raises(ValueError, match="unknown parameter 'npos_max'"):
        hf_posenc.patch_model(_llama(), "rope+fire", npos_max=3)
    with pytest.raises(ValueError, match="part 'fire'.*mlp_hidden"):
        hf_posenc.patch_model(_llama(), "rope+fire", fire={"mlp_hidden": -1})
    with pytest.raises(ValueError, match="second rotary"):
        hf_posenc.patch_model(_llama(), "rope+fox", fox={"rope": True})
    with pytest.raises(ValueError, match="init of 'rope\\+t5' must be one of"):
        hf_posenc.patch_model(_llama(), "rope+t5", init="zeros")


def test_init_on_a_single_encoding_points_to_compositions():
    with pytest.raises(ValueError, match="use a composition such as 'rope\\+fire'"):
        hf_posenc.patch_model(_llama(), "fire", init="identity")
    with pytest.raises(ValueError, match="use a composition such as 'rope\\+fire'"):
        hf_posenc.patch_model(_llama(), "rope", init="identity")


# -- oracles -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("term, params", [("alibi", {}), ("t5", {}), ("kerple", {}), ("sandwich", {}),
                                          ("fire", {"per_layer": False})])
def test_score_bias_on_the_models_own_rotary(term, params):
    """rope+<bias> = the unpatched model (native rotary, transformers' eager attention) + the bias as a 4D mask."""
    base = _llama(eager=True)
    model = hf_posenc.patch_model(copy.deepcopy(base), "rope+" + term, **params)
    enc = hf_posenc.encoding_module(model)
    n = IDS.shape[1]
    ctx = PosContext(encoding=enc.term, info=enc.info, position_ids=torch.arange(n)[None])
    with torch.no_grad():
        bias = enc.term("bias", ctx, n, n, torch.device("cpu"), 0)
        mask = bias + torch.full((n, n), float("-inf")).triu(1)
        expected = base(IDS, attention_mask=mask).logits
        got = model(IDS).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


def test_rope_fox_equals_fox_with_its_own_rope():
    base = _llama()
    composed = hf_posenc.patch_model(copy.deepcopy(base), "rope+fox")
    alone = hf_posenc.patch_model(copy.deepcopy(base), "fox", rope=True, rope_theta=10000.0)
    alone_enc, term = hf_posenc.encoding_module(alone), hf_posenc.encoding_module(composed).term
    alone_enc.load_state_dict(term.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(composed(IDS).logits, alone(IDS).logits, rtol=0, atol=1e-6)


TERMS = ("alibi", "t5", "kerple", "sandwich", "fire", "dpb", "shaw", "fox", "cope", "sba", "cape")


def _loss_and_grads(model, **kw):
    model.zero_grad()
    logits = model(IDS, **kw).logits
    loss = logits.float().pow(2).mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


@pytest.mark.parametrize("term", TERMS)
def test_engines_carry_both_the_rotary_and_the_term(term, monkeypatch, engine_calls):
    """The default engine (tile-wise PyTorch, or the term's own) against the full-matrix reference path
    (output_attentions=True), forward and every gradient; FlexAttention's forward and the Triton kernels
    (interpreter) where the term has them, each seen to run (``engine_calls``: once per layer at least)."""
    model = hf_posenc.patch_model(_llama(), "rope+" + term)
    with torch.no_grad():  # move the term off its initialisation so every parameter matters
        g = torch.Generator().manual_seed(3)
        for p in hf_posenc.encoding_module(model).parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    ref, ref_grads = _loss_and_grads(model, output_attentions=True)
    got, grads = _loss_and_grads(model)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert sorted(grads) == sorted(ref_grads)
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-3, atol=1e-4, msg=name)
    assert not engine_calls, f"unforced on the CPU, no accelerated engine runs: {dict(engine_calls)}"
    enc = hf_posenc.encoding_module(model)
    kinds = enc.kernel_kinds
    if not kinds and not getattr(enc, "attention_kernels", ()):
        return
    from hf_posenc.kernels.attention import FLEX_KINDS

    layers = model.config.num_hidden_layers
    if any(k in FLEX_KINDS for k in kinds):
        monkeypatch.setenv("HF_POSENC_BACKEND", "flex")
        with torch.no_grad():  # flex_attention has no backward on the CPU
            torch.testing.assert_close(model(IDS).logits, ref, rtol=1e-4, atol=1e-4)
        assert engine_calls["flex"] >= layers, f"FlexAttention ran {engine_calls['flex']} times"
    pytest.importorskip("triton")
    monkeypatch.setenv("HF_POSENC_BACKEND", "triton")
    engine_calls.clear()
    got, grads = _loss_and_grads(model)
    assert engine_calls["triton"] >= layers, f"the Triton kernels ran {engine_calls['triton']} times"
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-3, atol=1e-4, msg=name)


# -- the inert start ---------------------------------------------------------------------------------------
#: The term adds exactly zero, but the attention then runs with the term's (zero) bias or its own kernel rather
#: than the unpatched model's is_causal SDPA: the sums are ordered differently, so "exact" means to float32
#: rounding (measured: at most 3e-6 on these logits).
ROUNDING = 1e-5


@pytest.mark.parametrize(
    "family, name, params",
    [
        ("llama", "rope+t5", {}),
        ("llama", "rope+fire", {}),
        ("llama", "rope+shaw", {}),
        ("llama", "rope+dpb", {}),
        ("llama", "rope+cope", {}),
        ("llama", "rope+cape", {"base": "fire"}),
        ("gpt2", "learned+t5", {}),  # GPT-2's own table is adopted by `learned`
        ("phi3", "rope+fire", {}),  # partial rotary
        # a sliding layer (RoPE base 10^4, a 6-key window) and a full one (10^6), 16 tokens: each layer's own base
        ("gemma3_text", "rope+t5", {}),
        ("gemma3_text", "rope+fire", {}),
        ("gemma3_text", "rope+cope", {}),
    ],
)
def test_identity_start_gives_the_unpatched_logits(family, name, params):
    base = make_model(family)
    ids = make_ids(2, 16)
    with torch.no_grad():
        expected = base(ids).logits
        model = hf_posenc.patch_model(copy.deepcopy(base), name, init="identity", **params)
        got = model(ids).logits
        default = hf_posenc.patch_model(copy.deepcopy(base), name, **params)(ids).logits
    assert hf_posenc.encoding_module(model).inert == "exact"
    torch.testing.assert_close(got, expected, rtol=0, atol=ROUNDING)
    assert (default - expected).abs().max() > 100 * ROUNDING  # without init="identity" the term acts


def test_fox_identity_start_is_within_its_stated_tolerance():
    """FoX's identity start moves each attention logit by at most ``per_token`` per token of distance (what its
    ``inert`` says): at most (n - 1) * per_token = 1.4e-3 here. Through the two layers the output logits moved
    2.6e-3 (1.9 times that, measured); they may move 4 times that. (The old bound, 0.1, let gates of sigma(7)
    instead of sigma(10) pass: 0.053.)"""
    base = make_model("llama")
    n = 32
    ids = make_ids(2, n)
    model = hf_posenc.patch_model(copy.deepcopy(base), "rope+fox", init="identity")
    per_token = -torch.nn.functional.logsigmoid(torch.tensor(INERT_GATE_BIAS, dtype=torch.float64)).item()
    assert hf_posenc.encoding_module(model).inert.startswith(f"within {per_token:.3g} per token of distance")
    with torch.no_grad():
        diff = (model(ids).logits - base(ids).logits).abs().max().item()
    assert per_token < 5e-5 and 0 < diff < 4 * (n - 1) * per_token, (diff, per_token)
    # the gates train from there: every gate parameter gets a gradient
    model.train()
    model(ids).logits.pow(2).mean().backward()
    term = hf_posenc.encoding_module(model).term
    assert term.gate_weight.grad.abs().sum() > 0 and term.gate_bias.grad.abs().sum() > 0


@pytest.mark.parametrize("family, first, params", [
    ("llama", "comrope", {}),  # P per layer
    ("llama", "liere", {"per_layer": True}),
    ("llama", "rope2d", {"variant": "mixed"}),  # frequencies per layer
    ("gemma3_text", "rope", {}),  # a RoPE base per layer type
])
def test_a_composition_rotates_each_layer_with_its_own_rotation(family, first, params):
    """``<first>+t5`` started inert equals ``<first>`` alone with the same weights, in the cache too: the
    composition hands each layer's index to its rotary part (it rotated every layer with layer 0's rotation: on
    the tiny Gemma 3, ``rope+t5`` at ``init="identity"`` was 0.36 off the unpatched model on 16 tokens)."""
    base = make_model(family)
    alone = hf_posenc.patch_model(copy.deepcopy(base), first, **params)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # every layer its own weights (rope2d-mixed starts with the same frequencies in each)
        for p in hf_posenc.encoding_module(alone).parameters():
            p.mul_(1 + 0.5 * torch.rand(p.shape, generator=g))
    composed = hf_posenc.patch_model(copy.deepcopy(base), f"{first}+t5", init="identity", **{first: params})
    hf_posenc.encoding_module(composed).first.load_state_dict(hf_posenc.encoding_module(alone).state_dict())
    ids = make_ids(2, 16)
    with torch.no_grad():
        torch.testing.assert_close(composed(ids).logits, alone(ids).logits, rtol=0, atol=ROUNDING)
        kw = dict(max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)
        got, want = composed.generate(ids[:1, :10], **kw), alone.generate(ids[:1, :10], **kw)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), rtol=0, atol=ROUNDING)


@pytest.mark.parametrize("name, params, match", [
    ("rope+alibi", {}, "slopes are fixed"),
    ("rope+sandwich", {}, "fixed"),
    ("rope+kerple", {}, "0.01"),
    ("rope+sba", {}, "replaces the softmax"),
    ("rope+cape", {}, "use base='fire'"),
])
def test_terms_without_an_inert_start_say_so(name, params, match):
    with pytest.raises(ValueError, match=match):
        hf_posenc.patch_model(_llama(), name, init="identity", **params)


# -- what a model does with it -----------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["rope+fox", "rope+alibi", "rope+cope", "learned+t5"])
def test_cache_equals_full_forward(name):
    family = "gpt2" if name.startswith("learned") else "llama"
    model = make_model(family, encoding=name)
    ids = make_ids(2, 14)
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :9], use_cache=True)
        past, pieces = returned_cache(out), [out.logits]
        for t in range(9, 14):
            out = model(ids[:, t : t + 1], **with_cache(past), use_cache=True)
            past = returned_cache(out)
            pieces.append(out.logits)
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-4, atol=1e-5)


def test_save_and_load_through_the_auto_classes(tmp_path):
    model = hf_posenc.patch_model(_llama(), "rope+fire", init="identity")
    with torch.no_grad():
        for p in hf_posenc.encoding_module(model).parameters():
            p.add_(0.1)
        expected = model(IDS).logits
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.position_encoding == model.config.position_encoding
    assert hf_posenc.describe(loaded)["encoding"] == "rope+fire"
    with torch.no_grad():
        torch.testing.assert_close(loaded(IDS).logits, expected, rtol=0, atol=0)


def test_config_key_and_plans():
    model = _llama(layers=4)
    model.config.position_encoding = {"name": "rope+t5", "init": "identity"}
    hf_posenc.patch_model(model)
    assert model.config.position_encoding["t5"]["num_buckets"] == 32
    plan = hf_posenc.patch_model(_llama(layers=4), ["rope+fox", "nope"])
    assert [c["name"] for c in plan.config.position_encoding] == ["rope+fox", "nope"] * 2
    with torch.no_grad():
        plan(IDS)


def test_peft_trains_the_term_beside_lora(tmp_path):
    peft = pytest.importorskip("peft")
    model = hf_posenc.patch_model(_llama(), "rope+t5", init="identity")
    modules = hf_posenc.trainable_modules(model)
    wrapped = peft.get_peft_model(
        model, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], modules_to_save=modules)
    )
    opt = torch.optim.SGD([p for p in wrapped.parameters() if p.requires_grad], lr=0.5)
    wrapped.train()
    for _ in range(2):
        opt.zero_grad()
        wrapped(input_ids=IDS, labels=IDS).loss.backward()
        opt.step()
    wrapped.eval()
    with torch.no_grad():
        expected = wrapped(input_ids=IDS).logits
    trained = [n for n, p in wrapped.named_parameters() if "posenc" in n and p.requires_grad]
    assert trained and all("term" in n for n in trained)
    wrapped.save_pretrained(tmp_path)
    fresh = hf_posenc.patch_model(_llama(), "rope+t5", init="identity")
    reloaded = peft.PeftModel.from_pretrained(fresh, tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=IDS).logits, expected, rtol=0, atol=1e-6)


def test_compiles_to_one_graph():
    model = hf_posenc.patch_model(_llama(), "rope+alibi")
    with torch.no_grad():
        expected = model(IDS).logits
        compiled = torch.compile(model, fullgraph=True, backend="eager")
        torch.testing.assert_close(compiled(IDS).logits, expected, rtol=1e-5, atol=1e-5)
