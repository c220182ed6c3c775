"""The layer options past the pretrained context: ``sink`` beside a sliding ``window`` (StreamingLLM),
``length_scale`` ("ssmax", "logn"), and ``nope``'s DroPE options ``qk_norm`` and ``softmax_scale``.

Oracles: a sink is the band mask plus the first ``sink`` columns (an explicit 4D mask on the model without a window);
the length scale and DroPE's norm are checked against the attention written out by hand from the layer's weights
(the explicit formula); every engine against the full-matrix reference path; the cache against the full forward,
save/load and plans on every family.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import hf_posenc
from conftest import (
    DECODERS,
    FAMILIES,
    main_output,
    make_config,
    make_ids,
    make_model,
    model_inputs,
    returned_cache,
    with_cache,
)
from hf_posenc.config import PosEncConfig


def _llama(layers: int = 2, max_positions: int = 16, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=max_positions)
    return LlamaForCausalLM(cfg).eval()


def _patched(encoding, layers: int = 2, **kw) -> LlamaForCausalLM:
    return hf_posenc.patch_model(_llama(layers, **kw), encoding)


def _perturb(model, scale: float = 0.1) -> None:
    """Move the encoding's parameters off their start, so that each one matters."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in hf_posenc.encoding_module(model).parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))


# -- configuration -------------------------------------------------------------------------------------------


def test_layer_options_are_stored_only_when_set_and_round_trip():
    plain = PosEncConfig("alibi")
    assert "sink" not in plain.to_dict() and "length_scale" not in plain.to_dict()
    config = PosEncConfig("rope+fire", {"init": "identity", "window": 8, "sink": 4, "length_scale": "ssmax"})
    stored = config.to_dict()
    assert (stored["window"], stored["sink"], stored["length_scale"]) == (8, 4, "ssmax")
    assert PosEncConfig.from_dict(stored) == config
    assert config.replace(sink=2).sink == 2 and config.replace(sink=2).window == 8


@pytest.mark.parametrize("params, exc, words", [
    ({"sink": 4}, ValueError, "needs a sliding window"),
    ({"window": 8, "sink": 0}, ValueError, ">= 1"),
    ({"window": 8, "sink": 2.0}, TypeError, "int >= 1"),
    ({"length_scale": "log"}, ValueError, "['ssmax', 'logn']"),
    ({"qk_norm": "v"}, ValueError, "['q', 'k', 'qk']"),
    ({"softmax_scale": 0.0}, ValueError, "> 0.0"),
])
def test_bad_layer_options(params, exc, words):
    name = "nope" if {"qk_norm", "softmax_scale"} & set(params) else "alibi"
    with pytest.raises(exc, match=words.replace("[", r"\[").replace("]", r"\]")):
        PosEncConfig(name, params)


def test_sink_refused_on_a_model_with_its_own_sliding_window():
    model = MistralForCausalLM(make_config("mistral", sliding_window=4))
    with pytest.raises(ValueError, match="own sliding window.*sliding_window = None"):
        hf_posenc.patch_model(model, "rope", window=4, sink=2)


def test_length_scale_with_a_window_refused_on_bidirectional_models():
    with pytest.raises(ValueError, match="causal models only"):
        make_model("bert", encoding={"name": "alibi", "window": 3, "length_scale": "logn"})


def test_drope_options_refused_inside_a_composition():
    with pytest.raises(ValueError, match="nope layer alone"):
        PosEncConfig("nope+fox", {"nope": {"qk_norm": "qk"}})


# -- sink: the band mask plus the first columns --------------------------------------------------------------

SINK_ENCODINGS = ("rope", "alibi", "t5", "fire", "shaw", "cape", "fox", "cope", "sba", "tape", "rope+fox")


def _band_and_sink(length: int, window: int, sink: int) -> torch.Tensor:
    i = torch.arange(length)
    band = (i[None, :] <= i[:, None]) & ((i[None, :] > i[:, None] - window) | (i[None, :] < sink))
    return torch.zeros(1, 1, length, length).masked_fill(~band, torch.finfo(torch.float32).min)


@pytest.mark.parametrize("encoding", SINK_ENCODINGS)
def test_sink_is_the_band_mask_plus_the_first_columns(encoding):
    """window=3, sink=2: the logits of the encoding without a window under an explicit 4D mask (band | j < sink),
    differing from the window alone; greedy decoding with the cache gives the full forward's logits."""
    window, sink, length = 3, 2, 13
    sunk = _patched({"name": encoding, "window": window, "sink": sink})
    windowed = _patched({"name": encoding, "window": window})
    plain = _patched(encoding)
    ids = make_ids(1, length, seed=4)[:, :length] % 64
    with torch.no_grad():
        want = plain(ids, attention_mask=_band_and_sink(length, window, sink)).logits
        got = sunk(ids).logits
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert (got[:, -1] - windowed(ids).logits[:, -1]).abs().max() > 1e-5  # (FoX's gates decay the sinks)
        out = sunk.generate(ids[:, :4], max_new_tokens=7, do_sample=False, output_logits=True,
                            return_dict_in_generate=True, pad_token_id=0)
        full = sunk(out.sequences).logits
    for step, logits in enumerate(out.logits):
        torch.testing.assert_close(logits[0], full[0, 3 + step], rtol=1e-4, atol=1e-4)


def test_sink_keys_influence_the_last_token_and_the_middle_does_not():
    """One layer, window 3, sink 2: changing a token between the sinks and the window leaves the last logits as
    they are; changing a sink token changes them."""
    model = _patched({"name": "rope", "window": 3, "sink": 2}, layers=1)
    ids = make_ids(1, 12, seed=2) % 64
    middle, first = ids.clone(), ids.clone()
    middle[0, 3:8] = (middle[0, 3:8] + 5) % 64
    first[0, 0] = (first[0, 0] + 5) % 64
    with torch.no_grad():
        last = model(ids).logits[:, -1]
        torch.testing.assert_close(model(middle).logits[:, -1], last, rtol=0, atol=1e-6)
        assert not torch.allclose(model(first).logits[:, -1], last, atol=1e-4)


# -- the explicit formulas -----------------------------------------------------------------------------------


def _explicit_attention(model, layer_index, hidden, factor_fn, mask_fn=None):
    """Layer ``layer_index``'s attention output (B, L, C) of a rope model written out from its weights: rotary,
    q times factor_fn(n) with n the keys each query sees, softmax over the allowed keys."""
    attn = model.model.layers[layer_index].self_attn
    b, n, _ = hidden.shape
    h, hkv, d = 4, 2, 8
    q = attn.q_proj(hidden)
    k = attn.k_proj(hidden)
    q = q.view(b, n, h, d).transpose(1, 2)
    k = k.view(b, n, hkv, d).transpose(1, 2)
    v = attn.v_proj(hidden).view(b, n, hkv, d).transpose(1, 2)
    rotary = LlamaForCausalLM(model.config.__class__(**model.config.to_dict())).model.rotary_emb  # the patch drops it
    cos, sin = rotary(hidden, torch.arange(n)[None])
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k, v = k.repeat_interleave(h // hkv, 1), v.repeat_interleave(h // hkv, 1)
    i = torch.arange(n)
    allowed = i[None, :] <= i[:, None] if mask_fn is None else mask_fn(i)
    keys_seen = allowed.sum(-1).float()  # n per query
    factor = factor_fn(keys_seen)  # (H|1, L)
    q = q * factor[..., :, None]
    scores = (q @ k.transpose(-1, -2)) * d**-0.5
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return attn.o_proj((probs @ v).transpose(1, 2).reshape(b, n, h * d))


def _captured(model, layer_index, ids):
    """(the attention's input, its output) of layer ``layer_index`` for ``ids``."""
    seen = {}
    attn = model.model.layers[layer_index].self_attn
    def grab(module, args, kwargs):
        seen.setdefault("in", kwargs["hidden_states"] if "hidden_states" in kwargs else args[0])

    pre = attn.register_forward_pre_hook(grab, with_kwargs=True)
    def grab_out(module, args, out):
        seen.setdefault("out", out[0])

    post = attn.register_forward_hook(grab_out)
    try:
        with torch.no_grad():
            model(ids)
    finally:
        pre.remove()
        post.remove()
    return seen["in"], seen["out"]


@pytest.mark.parametrize("options", [
    {"length_scale": "logn"},
    {"length_scale": "ssmax"},
    {"length_scale": "logn", "window": 5, "sink": 2},
])
def test_length_scale_is_the_explicit_formula(options):
    """rope with a length scale, on a model whose context P is 8 and a text of 24 tokens: layer 1's attention is
    softmax(factor_i * q_i.k_j / sqrt(d)) with factor max(1, log n / log P) (logn) or s_h log n (ssmax, s moved
    off its start), n the keys the query sees (window and sinks counted)."""
    model = _patched({"name": "rope", **options}, max_positions=8)
    P = 8
    if options["length_scale"] == "ssmax":
        _perturb(model, 0.05)
        s = hf_posenc.encoding_module(model).ssmax_scale[1].detach()
        factor_fn = lambda n: s[:, None] * n.log()[None]  # noqa: E731
    else:
        factor_fn = lambda n: (n.log() / math.log(P)).clamp_min(1.0)[None]  # noqa: E731
    mask_fn = None
    if "window" in options:
        w, sk = options["window"], options["sink"]
        mask_fn = lambda i: (i[None, :] <= i[:, None]) & ((i[None, :] > i[:, None] - w) | (i[None, :] < sk))  # noqa
    ids = make_ids(2, 24, seed=5) % 64
    hidden, out = _captured(model, 1, ids)
    with torch.no_grad():
        want = _explicit_attention(model, 1, hidden, factor_fn, mask_fn)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_ssmax_starts_at_one_over_log_p_and_logn_leaves_the_context_alone():
    model = _patched({"name": "rope", "length_scale": "ssmax"}, max_positions=16)
    s = hf_posenc.encoding_module(model).ssmax_scale
    assert s.shape == (2, 4) and torch.allclose(s, torch.full_like(s, 1 / math.log(16)))
    ids = make_ids(1, 16, seed=1) % 64
    with torch.no_grad():  # logn changes nothing inside the context P (n <= P)
        torch.testing.assert_close(_patched({"name": "rope", "length_scale": "logn"})(ids).logits,
                                   _patched("rope")(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("qk_norm", ("q", "k", "qk"))
def test_drope_qk_norm_and_softmax_scale_are_the_explicit_formula(qk_norm):
    """nope with DroPE's norm over the whole q/k projection (weights moved off 1) and a softmax scale: layer 1's
    attention written out by hand; the norm's eps is the model's rms_norm_eps."""
    model = _patched({"name": "nope", "qk_norm": qk_norm, "softmax_scale": 0.2})
    enc = hf_posenc.encoding_module(model)
    assert model.config.position_encoding["qk_norm_eps"] == model.config.rms_norm_eps
    _perturb(model)
    qw = enc.q_norm_weight[1].detach() if "q" in qk_norm else None
    kw = enc.k_norm_weight[1].detach() if "k" in qk_norm else None
    ids = make_ids(2, 12, seed=5) % 64
    hidden, out = _captured(model, 1, ids)
    attn = model.model.layers[1].self_attn
    with torch.no_grad():
        eps = model.config.rms_norm_eps
        b, n, _ = hidden.shape
        q, k = attn.q_proj(hidden), attn.k_proj(hidden)
        if qw is not None:
            q = torch.nn.functional.rms_norm(q, (32,), qw, eps)
        if kw is not None:
            k = torch.nn.functional.rms_norm(k, (16,), kw, eps)
        q = q.view(b, n, 4, 8).transpose(1, 2)
        k = k.view(b, n, 2, 8).transpose(1, 2).repeat_interleave(2, 1)
        v = attn.v_proj(hidden).view(b, n, 2, 8).transpose(1, 2).repeat_interleave(2, 1)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        probs = ((q @ k.transpose(-1, -2)) * 0.2).masked_fill(~causal, float("-inf")).softmax(-1)
        want = attn.o_proj((probs @ v).transpose(1, 2).reshape(b, n, 32))
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


# -- every engine against the reference path ----------------------------------------------------------------


def _loss_and_grads(model, ids, **kw):
    model.zero_grad()
    logits = model(ids, **kw).logits
    logits.float().pow(2).mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("encoding", ("alibi", "fire", "fox", "cope", "sba", "rope+fire"))
@pytest.mark.parametrize("options", ({"length_scale": "ssmax"}, {"length_scale": "logn", "window": 6, "sink": 2},
                                     {"name": "nope", "qk_norm": "qk", "length_scale": "ssmax"}))
def test_engines_take_the_options(encoding, options, monkeypatch):
    """The default engine (the tile engine or the term's own) against the full-matrix reference path
    (output_attentions=True), forward and every gradient (SSMax's s and DroPE's weights included), a text past
    the context P = 8; FlexAttention (forward) and the Triton kernels (interpreter) where the term has them."""
    options = dict(options)
    if "name" in options:  # the DroPE row: one nope layer and one of the term
        encoding = [{**options}, {"name": encoding, "length_scale": "ssmax"}]
    else:
        encoding = {"name": encoding, **options}
    model = _patched(encoding, max_positions=8)
    _perturb(model, 0.05)
    ids = make_ids(2, 20, seed=6) % 64
    ref, ref_grads = _loss_and_grads(model, ids, output_attentions=True)
    got, grads = _loss_and_grads(model, ids)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert sorted(grads) == sorted(ref_grads)
    assert any("ssmax_scale" in n for n in grads) == ("ssmax" in str(encoding))
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-3, atol=1e-4, msg=name)
    term = encoding[1]["name"] if isinstance(encoding, list) else encoding["name"]
    kinds = hf_posenc.encoding_module(_patched(term)).kernel_kinds
    if not kinds:
        return
    from hf_posenc.kernels.attention import FLEX_KINDS

    if any(k in FLEX_KINDS for k in kinds):
        monkeypatch.setenv("HF_POSENC_BACKEND", "flex")
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, ref, rtol=1e-4, atol=1e-4)
    pytest.importorskip("triton")
    monkeypatch.setenv("HF_POSENC_BACKEND", "triton")
    got, grads = _loss_and_grads(model, ids)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-3, atol=1e-4, msg=name)


# -- every family: cache, save/load, plans -------------------------------------------------------------------


def _family_options(family):
    term = "rope" if family not in ("gpt2", "bert", "vit") else "alibi"
    out = [{"name": term, "length_scale": "ssmax"}, {"name": "alibi", "length_scale": "logn"},
           {"name": "nope", "qk_norm": "qk", "softmax_scale": 0.3}]
    if family not in ("mistral", "gemma3_text", "vit", "bert"):  # a model's own window refuses sinks (above)
        out.append({"name": term, "window": 3, "sink": 2, "length_scale": "logn"})
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_saves_reloads_and_decodes(family, tmp_path):
    """Each option on each family: the encoding's parameters (s, the norm weights) moved off their start save and
    reload with the same outputs; decoders decode with the cache as the full forward does."""
    for i, encoding in enumerate(_family_options(family)):
        model = make_model(family, seed=0, encoding=encoding)
        _perturb(model, 0.05)
        inputs = model_inputs(family, length=12)
        with torch.no_grad():
            want = main_output(model(**inputs))
        model.save_pretrained(tmp_path / str(i))
        again = hf_posenc.from_pretrained(tmp_path / str(i))
        with torch.no_grad():
            torch.testing.assert_close(main_output(again(**inputs)), want, rtol=0, atol=1e-6)
        if family not in DECODERS:
            continue
        ids = inputs["input_ids"]
        with torch.no_grad():
            out = model(ids[:, :7], use_cache=True)
            cache, steps = returned_cache(out), [out.logits]
            for t in range(7, ids.shape[1]):
                step = model(ids[:, t : t + 1], **with_cache(cache), use_cache=True)
                cache = returned_cache(step)
                steps.append(step.logits)
        torch.testing.assert_close(torch.cat(steps, 1), want, rtol=1e-4, atol=1e-4, msg=str(encoding))


def test_plan_of_drope_and_windowed_sink_layers():
    """A plan mixing a DroPE layer, a windowed layer with sinks and an SSMax layer: each layer is the one-encoding
    model's layer (the first layer's hidden state equals the all-DroPE model's), the plan saves and reloads."""
    plan = [{"name": "nope", "qk_norm": "qk"}, {"name": "rope", "window": 4, "sink": 1},
            {"name": "rope", "length_scale": "ssmax"}, "rope"]
    model = _patched(plan, layers=4)
    alone = _patched({"name": "nope", "qk_norm": "qk"}, layers=4)
    ids = make_ids(2, 14, seed=3) % 64
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states
        torch.testing.assert_close(hs[1], alone(ids, output_hidden_states=True).hidden_states[1], rtol=0, atol=0)
    stored = model.config.position_encoding
    assert stored[1]["sink"] == 1 and stored[2]["length_scale"] == "ssmax" and stored[0]["qk_norm"] == "qk"
