"""Hybrid and long-context recipes: plans (an encoding per layer), sliding windows, partial rotary, RoPE scaling.

Plans are checked against the single encodings they are made of (layer by layer), windows against transformers'
own Mistral ``sliding_window`` and against a band mask, partial rotary against NoPE (with the rotated rows of
q/k zeroed), scaling against a native Llama carrying the same ``rope_parameters`` (every type), and every
recipe runs on every family.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralForCausalLM

import hf_posenc
from conftest import DECODERS, FAMILIES, make_config, make_ids, make_model, model_inputs, main_output
from hf_posenc.config import PosEncConfig

# -- plans ---------------------------------------------------------------------------------------------------


def _model(family="llama", encoding=None, layers=4, seed=0, **params):
    key = "n_layer" if family == "gpt2" else "num_hidden_layers"
    overrides = {key: layers}
    if family == "gemma3_text":
        overrides["layer_types"] = ["sliding_attention", "full_attention"] * (layers // 2)
    return make_model(family, seed=seed, encoding=encoding, config_overrides=overrides, **params)


@pytest.mark.parametrize("family", ("llama", "gpt2", "vit"))
@pytest.mark.parametrize("entry", ("alibi", {"name": "kerple", "variant": "power"}, "rope"))
def test_one_entry_plan_is_the_plain_encoding(family, entry):
    name = entry if isinstance(entry, str) else entry["name"]
    params = {} if isinstance(entry, str) else {k: v for k, v in entry.items() if k != "name"}
    plain = _model(family, name, **params)
    for plan in ([entry], [entry, entry]):
        planned = _model(family, plan)
        assert planned.config.position_encoding == plain.config.position_encoding  # stored as the plain dict
        assert type(hf_posenc.encoding_module(planned)) is type(hf_posenc.encoding_module(plain))
        inputs = model_inputs(family)
        with torch.no_grad():
            assert torch.equal(main_output(planned(**inputs)), main_output(plain(**inputs)))


@pytest.mark.parametrize("family", ("llama", "gpt2"))
def test_plan_layer_order(family):
    """rope, rope, rope, nope: the first three layers' hidden states are the all-rope model's, the fourth differs;
    the mirror (nope, rope, rope, rope): the first layer is the all-nope model's, then it differs from both."""
    ids = make_ids(2, 12)

    def hidden(encoding):
        with torch.no_grad():
            return _model(family, encoding)(ids, output_hidden_states=True).hidden_states

    rope, nope = hidden("rope"), hidden("nope")
    plan = hidden(["rope", "rope", "rope", "nope"])
    for i in (1, 2, 3):
        assert torch.equal(plan[i], rope[i]), i
    assert not torch.allclose(plan[4], rope[4])
    mirror = hidden(["nope", "rope", "rope", "rope"])
    assert torch.equal(mirror[1], nope[1])
    assert not torch.allclose(mirror[2], rope[2]) and not torch.allclose(mirror[2], nope[2])


def test_plan_repeats_over_depth_and_stores_one_entry_per_layer():
    m = _model("llama", ["rope", {"name": "rope", "theta": 1e6, "window": 4}])
    stored = m.config.position_encoding
    assert [e.get("theta") for e in stored] == [10000.0, 1e6, 10000.0, 1e6]
    assert [e.get("window") for e in stored] == [None, 4, None, 4]
    d = hf_posenc.describe(m)
    assert d["encoding"] == "plan" and [e["window"] for e in d["plan"]] == [None, 4, None, 4]
    layers = hf_posenc.api.layer_encodings(m)
    assert [(type(e).__name__, i) for e, i in layers] == [("Rope", 0), ("Rope", 0), ("Rope", 1), ("Rope", 1)]
    fresh = _model("llama")
    fresh.config.position_encoding = stored
    hf_posenc.patch_model(fresh)  # no name: the stored plan
    ids = make_ids(1, 10)
    with torch.no_grad():
        torch.testing.assert_close(fresh(ids).logits, m(ids).logits, rtol=0, atol=0)


def _train_a_little(model, ids, steps=2):
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model.train()
    for _ in range(steps):
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


@pytest.mark.parametrize("family", ("llama", "gpt2"))
def test_mixed_trainable_plan_saves_loads_and_caches(family, tmp_path):
    """kerple, fire, rope, nope: trained a little (the encodings' weights move), saved, loaded back with
    hf_posenc.from_pretrained and with transformers' Auto class; greedy decoding with the KV cache gives the
    logits of full forwards."""
    ids = make_ids(2, 10)
    model = _train_a_little(_model(family, ["kerple", "fire", "rope", "nope"]), ids)
    enc = hf_posenc.encoding_module(model)
    assert len(enc.entries) == 4 and len(enc.state_dict()) > 0
    model.save_pretrained(tmp_path)
    for loaded in (hf_posenc.from_pretrained(tmp_path), AutoModelForCausalLM.from_pretrained(tmp_path)):
        assert loaded.config.position_encoding == model.config.position_encoding
        with torch.no_grad():
            torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        out = model.generate(ids[:1], max_new_tokens=6, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
        full = model(out.sequences).logits
    for step, logits in enumerate(out.logits):
        torch.testing.assert_close(logits[0], full[0, ids.shape[1] - 1 + step], rtol=1e-4, atol=1e-4)


def test_plan_with_state_channels_and_static_cache():
    """fox_pro (state channels in k/v), rope and alibi in one plan: the static cache gives the dynamic cache's
    tokens."""
    model = _model("llama", ["fox_pro", "rope", "alibi", "nope"])
    ids = make_ids(1, 8)
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        dynamic = model.generate(ids, **kw)
        static = model.generate(ids, cache_implementation="static", **kw)
    assert torch.equal(dynamic, static)


@pytest.mark.parametrize(
    "plan, exc, pattern",
    [
        (["rope", "nope", "alibi"], ValueError, r"length must divide the number of layers \(4\); got 3"),
        (["learned", "rope"], ValueError, r"'learned' act\(s\) on the token embeddings.*cannot be mixed"),
        (["rope", "bogus"], ValueError, r"plan entry 1 \('bogus'\): unknown position encoding 'bogus'"),
        (["rope", {"name": "rope", "theta": "x"}], TypeError, r"plan entry 1 .*must be of type float"),
        (["rope", {"name": "alibi", "window": 0}], ValueError, r"plan entry 1 .*window .* must be >= 1"),
    ],
    ids=["length", "embedding-mixed", "unknown", "bad-param", "bad-window"],
)
def test_bad_plans(plan, exc, pattern):
    with pytest.raises(exc, match=pattern):
        hf_posenc.patch_model(_model("llama"), plan)


def test_params_beside_a_plan_are_refused():
    with pytest.raises(ValueError, match="give them in its entries"):
        hf_posenc.patch_model(_model("llama"), ["rope", "nope"], theta=2.0)


# -- sliding windows -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("window", (1, 4, 7))
def test_window_equals_mistral_sliding_window(window):
    """rope with a window == transformers' Mistral with that sliding_window and the same weights, past the
    window's length: full forward, and greedy decoding with the cache (not for window 1: transformers' sliding
    cache layer then keeps no key and its decoding disagrees with its own full forward, 5.24; hf_posenc's decoding
    is checked against its full forward in test_window_matches_a_band_mask)."""
    torch.manual_seed(0)
    native = MistralForCausalLM(make_config("mistral", sliding_window=window)).eval()
    patched = MistralForCausalLM(make_config("mistral", sliding_window=None)).eval()
    patched.load_state_dict(native.state_dict())
    hf_posenc.patch_model(patched, {"name": "rope", "window": window})
    ids = make_ids(2, 3 * window + 5)
    with torch.no_grad():
        torch.testing.assert_close(patched(ids).logits, native(ids).logits, rtol=1e-5, atol=1e-5)
        kw = dict(max_new_tokens=2 * window + 3, do_sample=False, pad_token_id=0)
        if window > 1:
            assert torch.equal(patched.generate(ids[:1, :3], **kw), native.generate(ids[:1, :3], **kw))


@pytest.mark.parametrize("encoding", ("alibi", "t5", "fox", "cope", "sba", "shaw", "fire"))
def test_window_matches_a_band_mask(encoding):
    """Any encoding with a window: the same logits as the encoding without one under an explicit 4D band mask
    (the window's definition: query i sees keys i - window < j <= i), and the cache gives the full forward."""
    window, length = 3, 11
    windowed = _model("llama", {"name": encoding, "window": window}, layers=2)
    plain = _model("llama", encoding, layers=2)
    ids = make_ids(1, length)
    i = torch.arange(length)
    band = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
    mask = torch.zeros(1, 1, length, length).masked_fill(~band, torch.finfo(torch.float32).min)
    with torch.no_grad():
        want = plain(ids, attention_mask=mask).logits
        got = windowed(ids).logits
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        out = windowed.generate(ids[:, :4], max_new_tokens=6, do_sample=False, output_logits=True,
                                return_dict_in_generate=True, pad_token_id=0)
        full = windowed(out.sequences).logits
    for step, logits in enumerate(out.logits):
        torch.testing.assert_close(logits[0], full[0, 3 + step], rtol=1e-4, atol=1e-4)


def test_window_on_bidirectional_models():
    """BERT: a window as wide as the text changes nothing, a narrow one changes the output; ViT: per grid axis
    (the 4x4 grid: a window of 4 is everything), and window 1 leaves each patch its own key and the CLS token."""
    ids = make_ids(2, 9)
    with torch.no_grad():
        outs = {w: _model("bert", {"name": "alibi", "window": w}, layers=2)(ids).logits for w in (9, 2)}
        plain = _model("bert", "alibi", layers=2)(ids).logits
    assert torch.equal(outs[9], plain) and not torch.allclose(outs[2], plain)
    pixels = model_inputs("vit")["pixel_values"]
    vit = {w: _model("vit", {"name": "rope2d", "window": w}, layers=2) for w in (4, 1)}
    plain = _model("vit", "rope2d", layers=2)
    with torch.no_grad():
        assert torch.equal(vit[4](pixel_values=pixels).logits, plain(pixel_values=pixels).logits)
        att = vit[1](pixel_values=pixels, output_attentions=True).attentions[0]  # (B, H, 17, 17)
    seen = att[0, 0] > 0
    assert seen[0].all() and seen[:, 0].all()  # CLS sees and is seen by everything
    assert torch.equal(seen[1:, 1:], torch.eye(16, dtype=torch.bool))


@pytest.mark.parametrize("window", (0, -2, 2.5, "8", True))
def test_bad_window(window):
    exc = ValueError if isinstance(window, int) and not isinstance(window, bool) else TypeError
    with pytest.raises(exc, match="window"):
        hf_posenc.patch_model(_model("llama", layers=2), "rope", window=window)


# -- partial rotary ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ("llama", "gpt2", "mistral"))
@pytest.mark.parametrize("factor", (0.25, 0.5))
def test_partial_rotary_with_rotated_rows_zeroed_is_nope(family, factor):
    """With the rows of q_proj and k_proj that feed the rotated dims set to zero, partial rope == NoPE."""
    model = _model(family, "rope", layers=2, partial_rotary_factor=factor)
    nope = _model(family, "nope", layers=2)
    head_dim, heads = 8, 4
    rotated = int(head_dim * factor)
    with torch.no_grad():
        for m in (model, nope):
            for name, p in m.named_parameters():
                if family == "gpt2" and name.endswith("attn.c_attn.weight"):  # Conv1D: (in, 3 * hidden) q|k|v
                    for part in (0, 1):
                        for h in range(heads):
                            start = part * heads * head_dim + h * head_dim
                            p[:, start : start + rotated] = 0
                elif name.endswith(("q_proj.weight", "k_proj.weight")):
                    for h in range(p.shape[0] // head_dim):
                        p[h * head_dim : h * head_dim + rotated] = 0
        inputs = model_inputs(family)
        a, b = main_output(model(**inputs)), main_output(nope(**inputs))
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    full = _model(family, "rope", layers=2, partial_rotary_factor=factor)
    with torch.no_grad():
        assert not torch.allclose(main_output(full(**inputs)), b)


def test_partial_rotary_follows_the_model_by_default():
    """None: GPT-NeoX's own rotary_pct (0.5 in the tiny config); 1.0 rotates every dim."""
    base = hf_posenc.encoding_module(_model("gpt_neox", "rope", layers=2))
    full = hf_posenc.encoding_module(_model("gpt_neox", "rope", layers=2, partial_rotary_factor=1.0))
    assert (base.rotary_dim, full.rotary_dim) == (4, 8)


@pytest.mark.parametrize("factor, exc, pattern", [
    (0.0, ValueError, r"must be > 0.0"), (1.5, ValueError, r"must be <= 1.0"), ("x", TypeError, r"type float"),
    (0.125, ValueError, r"even number of rotated dims.*got 1"),
])
def test_bad_partial_rotary(factor, exc, pattern):
    with pytest.raises(exc, match=pattern):
        hf_posenc.patch_model(_model("llama", layers=2), "rope", partial_rotary_factor=factor)


# -- RoPE scaling --------------------------------------------------------------------------------------------

SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "longrope": {"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 2.5], "long_factor": [2.0, 3.0, 4.0, 5.0],
                 "original_max_position_embeddings": 16},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
}


@pytest.mark.parametrize("kind", SCALINGS)
def test_scaling_equals_native_llama(kind):
    """Llama rope with ``scaling`` == a native Llama whose config carries those rope_parameters (short and long
    inputs: past max_position_embeddings for dynamic, past the original length for longrope's switch)."""
    scaling = SCALINGS[kind]
    torch.manual_seed(0)
    native = model_class_llama(rope_parameters={"rope_theta": 10000.0, **copy.deepcopy(scaling)})
    patched = model_class_llama()
    patched.load_state_dict(native.state_dict())
    hf_posenc.patch_model(patched, "rope", scaling=scaling)
    for length in (10, 80):
        ids = make_ids(1, length)
        with torch.no_grad():
            torch.testing.assert_close(patched(ids).logits, native(ids).logits, rtol=1e-5, atol=1e-5)


def model_class_llama(**overrides):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(make_config("llama", max_position_embeddings=32, **overrides)).eval()


def test_linear_scaling_on_gpt2_is_position_division():
    """GPT-2: linear scaling by 2 at position ids 2p == no scaling at p."""
    scaled = _model("gpt2", "rope", layers=2, scaling={"rope_type": "linear", "factor": 2.0})
    plain = _model("gpt2", "rope", layers=2)
    ids = make_ids(2, 10)
    p = torch.arange(10)[None]
    with torch.no_grad():
        torch.testing.assert_close(scaled(ids, position_ids=2 * p).logits, plain(ids, position_ids=p).logits,
                                   rtol=1e-5, atol=1e-5)


def test_scaling_on_vit_counts_raster_patches():
    """ViT: linear scaling by 2 on a 4x4 grid halves the raster positions (checked on the rotation itself)."""
    scaled = hf_posenc.encoding_module(_model("vit", "rope", layers=2, scaling={"rope_type": "linear", "factor": 2.0}))
    plain = hf_posenc.encoding_module(_model("vit", "rope", layers=2))
    freq_scaled, _ = scaled._frequencies(torch.arange(4), torch.device("cpu"))
    freq_plain, _ = plain._frequencies(torch.arange(4), torch.device("cpu"))
    torch.testing.assert_close(freq_scaled, freq_plain / 2)


@pytest.mark.parametrize("scaling, exc, pattern", [
    ("yarn", TypeError, r"must be of type dict"),
    ({"factor": 2.0}, ValueError, r"needs 'rope_type', one of transformers'"),
    ({"rope_type": "warp", "factor": 2.0}, ValueError, r"got 'warp'"),
    ({"rope_type": "linear", "factor": torch.tensor(2.0)}, TypeError, r"JSON values"),
    ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}, ValueError, r"rope's own parameter"),
])
def test_bad_scaling(scaling, exc, pattern):
    with pytest.raises(exc, match=pattern):
        hf_posenc.patch_model(_model("llama", layers=2), "rope", scaling=scaling)


def test_window_and_scaling_are_kept_by_the_config():
    c = PosEncConfig.coerce({"name": "rope", "window": 8, "scaling": {"rope_type": "linear", "factor": 2.0}})
    assert c.window == 8 and c.to_dict()["window"] == 8
    assert PosEncConfig.from_dict(c.to_dict()) == c


# -- every family --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_recipes_on_every_family(family):
    """A hybrid plan with a window, partial rotary and YaRN runs on every family; on decoders the cache gives the
    full forward."""
    rope = {"name": "rope", "partial_rotary_factor": 0.5, "window": 3,
            "scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8}}
    if family == "vit":
        rope = {"name": "rope2d", "window": 2}
    model = _model(family, [rope, "alibi"], layers=2)
    inputs = model_inputs(family, length=10)
    with torch.no_grad():
        out = main_output(model(**inputs))
    assert torch.isfinite(out).all()
    if family in DECODERS:
        ids = inputs["input_ids"][:1]
        with torch.no_grad():
            gen = model.generate(ids[:, :4], max_new_tokens=6, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=0)
            full = model(gen.sequences).logits
        for step, logits in enumerate(gen.logits):
            torch.testing.assert_close(logits[0], full[0, 3 + step], rtol=1e-4, atol=1e-4)


# -- the ecosystem: PEFT and torch.compile with a plan -------------------------------------------------------


def test_plan_under_peft_trains_each_entry_and_reloads(tmp_path):
    """LoRA with modules_to_save=trainable_modules: the plan's copy is trained (every entry's parameters get
    gradients, the original's none), and the adapter reproduces the model on a base patched with the plan."""
    from peft import PeftModel

    from test_ecosystem import inputs, lora, logits, loss_of, shifted_encoding

    plan = ["kerple", "fire"]
    model = make_model("llama", encoding=plan, train=True)
    pm = lora(model, "llama", modules_to_save=hf_posenc.trainable_modules(model))
    wrapper = hf_posenc.encoding_module(pm.get_base_model())
    trained, original = wrapper.modules_to_save["default"], wrapper.original_module
    batch = inputs("llama")
    loss_of("llama", pm, batch).backward()
    assert all(p.grad is None for p in original.parameters())
    for entry in trained.entries:
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in entry.parameters())
    torch.optim.SGD([p for p in pm.parameters() if p.requires_grad], lr=0.1).step()
    expected = logits(pm, batch)
    pm.save_pretrained(tmp_path / "adapter")
    base = shifted_encoding(make_model("llama", encoding=plan))
    assert torch.equal(logits(PeftModel.from_pretrained(base, tmp_path / "adapter"), batch), expected)


@pytest.mark.slow  # torch.compile
def test_plan_with_window_compiles_as_one_graph():
    """A plan with a window and a trainable entry: torch.compile(fullgraph=True) gives the eager logits."""
    torch._dynamo.reset()
    model = _model("llama", [{"name": "rope", "window": 3}, "kerple"], layers=2)
    ids = make_ids(2, 9)
    with torch.no_grad():
        want = model(ids).logits
        got = torch.compile(model, fullgraph=True, backend="eager")(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_windowed_layers_run_the_tile_engine_with_the_window(monkeypatch):
    """A windowed alibi layer runs the tile-wise engine with ``window`` (which skips the tiles outside it) and
    builds no band mask; the logits are the reference's (output_attentions runs the reference)."""
    import hf_posenc.attention as attention

    seen = []
    real = attention.tiled_attention

    def spy(*args, **kwargs):
        seen.append(kwargs.get("window"))
        return real(*args, **kwargs)

    monkeypatch.setattr(attention, "tiled_attention", spy)
    monkeypatch.setattr(attention, "_windowed_mask", lambda *a, **k: pytest.fail("band mask built"))
    model = _model("llama", {"name": "alibi", "window": 3}, layers=2)
    ids = make_ids(2, 12)
    with torch.no_grad():
        got = model(ids).logits
    assert seen == [3, 3]
    monkeypatch.undo()
    with torch.no_grad():
        want = model(ids, output_attentions=True).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", (1, 3))
def test_fox_pro_token_shift_ignores_the_window(window):
    """FoX Pro's token shift mixes each key with its predecessor whatever the window lets a query see: the
    reference (output_attentions, a band on the mask) gives the tile engine's logits (the window as a number),
    and decoding with the cache its full forward."""
    model = _model("llama", {"name": "fox_pro", "window": window}, layers=2)
    ids = make_ids(1, 11)
    with torch.no_grad():
        engine = model(ids).logits
        reference = model(ids, output_attentions=True).logits
        out = model.generate(ids[:, :4], max_new_tokens=5, do_sample=False, output_logits=True,
                             output_attentions=True, return_dict_in_generate=True, pad_token_id=0)
        full = model(out.sequences).logits
    torch.testing.assert_close(reference, engine, rtol=1e-4, atol=1e-4)
    for step, logits in enumerate(out.logits):
        torch.testing.assert_close(logits[0], full[0, 3 + step], rtol=1e-4, atol=1e-4)
