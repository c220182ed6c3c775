"""Remapped rotary distances (rope's ``remap``: rerope, leaky_rerope, self_extend, dca) and a window's sinks at
their cache positions (``sink_positions="cache"``): the definitions by hand, the pieces against the definitions,
the engine against the full-matrix oracle (forward and every gradient), the cache, every rotary family, save/load,
plans, and the refusals."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_posenc
from hf_posenc.kernels.remap import Remap, dca_logit_scale, remap_attention, remap_reference
from hf_posenc.kernels.remap.naive import rotation_tables
from hf_posenc.kernels.rotary.naive import rotate_leading

from conftest import DECODERS, MAX_POSITIONS, VOCAB, make_model, returned_cache, tiered, with_cache

REMAPS = {
    "rerope": Remap("rerope", 5),
    "leaky_rerope": Remap("leaky_rerope", 5, group=3),
    "self_extend": Remap("self_extend", 6, group=4),
    "dca": Remap("dca", 3, chunk=10),
    "window": Remap(None, 7),
    "window_sink_text": Remap(None, 7, sink=2),
    "window_sink_cache": Remap(None, 7, sink=2, sink_positions="cache"),
}


# -- the definitions, by hand --------------------------------------------------------------------------------

@pytest.mark.parametrize("remap, i, j, expected", [
    # ReRoPE (rerope_patch.py): min(i − j, w)
    (Remap("rerope", 4), 5, 3, 2), (Remap("rerope", 4), 10, 3, 4), (Remap("rerope", 4), 7, 3, 4),
    # leaky ReRoPE (leaky_rerope_patch.py): w + (i − j − w) / g past w
    (Remap("leaky_rerope", 4, group=2), 10, 3, 4 + 3 / 2), (Remap("leaky_rerope", 4, group=2), 6, 3, 3),
    # Self-Extend (LongLM): ⌊i/g⌋ − ⌊j/g⌋ + w − ⌊w/g⌋ past the neighbour window
    (Remap("self_extend", 4, group=2), 10, 3, 5 - 1 + 4 - 2), (Remap("self_extend", 4, group=2), 11, 2, 5 - 1 + 2),
    (Remap("self_extend", 4, group=2), 5, 3, 2), (Remap("self_extend", 5, group=2), 20, 1, 10 - 0 + 5 - 2),
    # DCA (ChunkLlama), s = 6, w = 2, c = 4: intra (i mod c) − (j mod c), successive min(i mod c + c, s) − (j mod
    # c), inter min(2c − 1, s) − (j mod c)
    (Remap("dca", 2, chunk=6), 9, 8, 1), (Remap("dca", 2, chunk=6), 9, 6, 5 - 2),
    (Remap("dca", 2, chunk=6), 7, 2, 6 - 2), (Remap("dca", 2, chunk=6), 9, 1, 6 - 1),
    (Remap("dca", 3, chunk=13), 25, 1, 13 - 1),  # c = 10, i in chunk 2, j in chunk 0: inter at min(19, 13)
    (Remap("dca", 3, chunk=13), 12, 5, 12 - 5),  # successive: min(2 + 10, 13) − 5
    # StreamingLLM's sinks at cache positions: W + k − 1 − j for a sink the window no longer covers
    (Remap(None, 5, sink=2, sink_positions="cache"), 10, 1, 5),
    (Remap(None, 5, sink=2, sink_positions="cache"), 10, 0, 6),
    (Remap(None, 5, sink=2, sink_positions="cache"), 10, 7, 3),
    (Remap(None, 5, sink=2, sink_positions="text"), 10, 0, 10),
])
def test_distance_by_hand(remap, i, j, expected):
    got = remap.distance(torch.tensor(i), torch.tensor(j)).item()
    assert got == pytest.approx(expected)


def test_dca_logit_scale_by_hand():
    """ChunkLlama's get_mscale: m = 0.05 ln(L/P) + 1 past P, the logits scaled by m²."""
    got = dca_logit_scale(torch.tensor([0, 63, 127, 255]), 64)
    m = [1.0, 1.0, 0.05 * torch.log(torch.tensor(2.0)).item() + 1, 0.05 * torch.log(torch.tensor(4.0)).item() + 1]
    assert got.tolist() == pytest.approx([x * x for x in m])


@pytest.mark.parametrize("name", sorted(REMAPS))
@pytest.mark.parametrize("shift, q_offset", [(0, 0), (3, 0), (0, 17)])
def test_pieces_cover_each_pair_once_with_the_distance(name, shift, q_offset):
    """The engine's pieces (`Remap.cases`) hold on every allowed pair exactly once, and rotate it by f(i, j)."""
    remap = REMAPS[name]
    lq = 40
    qi = torch.arange(lq) + q_offset
    kj = torch.arange(q_offset + lq)
    pi, pj = qi - shift, kj - shift
    allowed = remap.allowed(qi[:, None], kj[None, :])
    covered = torch.zeros_like(allowed, dtype=torch.long)
    f = remap.distance(pi[:, None], pj[None, :], kj[None, :])
    for case in remap.cases():
        lo, hi = case.span(pi, qi)
        holds = (kj[None, :] >= lo[:, None]) & (kj[None, :] < hi[:, None]) & (kj[None, :] <= qi[:, None])
        covered += holds.long()
        a = (case.q_pos(pi) if case.q_pos else pi).double()[:, None]
        b = (case.k_pos(pj) if case.k_pos else pj).double()[None, :]
        assert torch.allclose((a - b)[holds], f[holds], rtol=0, atol=1e-12), case.name  # leaky: thirds
    assert torch.equal(covered, allowed.long())


# -- the oracle against plain rotary --------------------------------------------------------------------------

def _inputs(b=2, h=4, hkv=2, lq=37, d=16, r=12, q_offset=0, dtype=torch.float64, shift=None, layout="half", seed=0):
    g = torch.Generator().manual_seed(seed)
    lk = lq + q_offset
    inv_freq = 1.0 / (10000 ** (torch.arange(0, r, 2).float() / r))
    q = torch.randn(b, h, lq, d, generator=g, dtype=dtype)
    k = torch.randn(b, hkv, lk, d, generator=g, dtype=dtype)
    v = torch.randn(b, hkv, lk, d, generator=g, dtype=dtype)
    shift = torch.zeros(b, 1, dtype=torch.long) if shift is None else torch.tensor(shift)[:, None]
    pos_q = torch.arange(lq)[None] + q_offset - shift
    pos_k = torch.arange(lk)[None] - shift
    qr = rotate_leading(q, *rotation_tables(pos_q[:, None], inv_freq, dtype), r, layout)
    kr = rotate_leading(k, *rotation_tables(pos_k[:, None], inv_freq, dtype), r, layout)
    return qr, kr, v, dict(scale=0.3, pos_q=pos_q, inv_freq=inv_freq, rotary_dim=r, layout=layout, q_offset=q_offset), \
        pos_k, shift


def test_oracle_is_plain_rotary_where_nothing_is_remapped():
    """ReRoPE with a window past every distance, and a window past every distance, are causal rotary attention."""
    q, k, v, args, pos_k, _ = _inputs()
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=True)
    for remap in (Remap("rerope", 100), Remap(None, 100), Remap("self_extend", 100, group=3)):
        got = remap_reference(q, k, v, remap, pos_k=pos_k, **args)
        assert (got - expected).abs().max() < 1e-12


def test_oracle_far_pairs_use_the_capped_distance():
    """ReRoPE's oracle, one pair at a time: a far pair's logit is the rotary logit at distance w."""
    q, k, v, args, pos_k, _ = _inputs(b=1, h=1, hkv=1, lq=12)
    w = 4
    out = remap_reference(q, k, v, Remap("rerope", w), pos_k=pos_k, **args)
    i = 11  # its keys 0 .. 7 are far: rotated as at distance 4
    q0 = rotate_leading(q, *rotation_tables(-args["pos_q"][:, None], args["inv_freq"], q.dtype), 12, "half")
    k0 = rotate_leading(k, *rotation_tables(-pos_k[:, None], args["inv_freq"], q.dtype), 12, "half")
    d = torch.tensor([min(i - j, w) for j in range(i + 1)], dtype=torch.float64)
    cos, sin = rotation_tables(d, args["inv_freq"], q.dtype)
    logits = (rotate_leading(q0[0, 0, i].expand(i + 1, -1), cos, sin, 12, "half") * k0[0, 0, : i + 1]).sum(-1) * 0.3
    expected = torch.softmax(logits, -1) @ v[0, 0, : i + 1]
    assert (out[0, 0, i] - expected).abs().max() < 1e-12


# -- the engine against the oracle ----------------------------------------------------------------------------

def _check_against_oracle(q, k, v, remap, args, pos_k, key_valid=None, band=None, block=8, tol=1e-10):
    """The engine against the oracle: forward and the gradients of q, k and v (float64, absolute ``tol``)."""
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    expected = remap_reference(q, k, v, remap, pos_k=pos_k, key_valid=key_valid, band=band, **args)
    got = remap_attention(q, k, v, remap, key_valid=key_valid, band=band, block=block, **args)
    assert (got - expected).abs().max() < tol
    grad = torch.randn_like(expected)
    for a, b in zip(torch.autograd.grad(expected, (q, k, v), grad), torch.autograd.grad(got, (q, k, v), grad)):
        assert (a - b).abs().max() < tol


CASES = [dict(), dict(q_offset=5), dict(shift=[0, 4]), dict(band=9), dict(lq=1, q_offset=30),
         dict(layout="interleaved", r=16), dict(h=4, hkv=4, d=8, r=8)]


@pytest.mark.parametrize("name", sorted(REMAPS))
@pytest.mark.parametrize("case", range(len(CASES)))
def test_engine_matches_oracle(name, case):
    kw = dict(CASES[case])
    band = kw.pop("band", None)
    q, k, v, args, pos_k, shift = _inputs(**kw)
    key_valid = None
    if kw.get("shift"):
        key_valid = torch.arange(k.shape[2])[None] >= shift
    _check_against_oracle(q, k, v, REMAPS[name], args, pos_k, key_valid, band)


@pytest.mark.parametrize("name", ["dca", "self_extend", "window_sink_cache"])
def test_engine_float32_relative_error(name):
    q, k, v, args, pos_k, _ = _inputs(dtype=torch.float32, lq=70)
    remap = REMAPS[name]
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    expected = remap_reference(q.double(), k.double(), v.double(), remap, pos_k=pos_k, **args)
    got = remap_attention(q, k, v, remap, block=16, **args)
    assert ((got - expected).norm() / expected.norm()) < 1e-5
    grad = torch.randn_like(got)
    ge = torch.autograd.grad(expected, (q, k, v), grad.double())
    gg = torch.autograd.grad(got, (q, k, v), grad)
    for a, b in zip(ge, gg):
        assert ((a - b).norm() / a.norm()) < 1e-5


@pytest.mark.parametrize("name", ["dca", "window_sink_cache"])
def test_engine_without_the_fused_kernel(name, monkeypatch):
    """The path other devices take (each call from its block's logits in PyTorch) against the oracle too."""
    import hf_posenc.kernels.remap.engine as engine

    monkeypatch.setattr(engine, "_fused", lambda device, dtype: False)
    q, k, v, args, pos_k, shift = _inputs(q_offset=3, shift=[0, 2])
    key_valid = torch.arange(k.shape[2])[None] >= shift
    _check_against_oracle(q, k, v, REMAPS[name], args, pos_k, key_valid)


@pytest.mark.parametrize("name", ["dca", "self_extend", "window_sink_cache"])
def test_engine_takes_padding_on_either_side(name):
    """Right padding (training) and a static cache's empty slots: an interval of valid keys per row."""
    q, k, v, args, pos_k, _ = _inputs(lq=30)
    key_valid = torch.ones(2, k.shape[2], dtype=torch.bool)
    key_valid[0, -7:] = False  # right padding
    key_valid[1, :3] = False  # left padding, and empty slots after the last query
    key_valid[1, -2:] = False
    args["pos_q"] = torch.stack([torch.arange(30), torch.arange(30) - 3])
    pos_k = torch.stack([torch.arange(30), torch.arange(30) - 3])
    _check_against_oracle(q, k, v, REMAPS[name], args, pos_k, key_valid)


def test_engine_refuses_holes_and_position_resets():
    q, k, v, args, _, _ = _inputs()
    holes = torch.ones(1, k.shape[2], dtype=torch.bool)
    holes[:, 5:8] = False
    with pytest.raises(ValueError, match="one interval"):
        remap_attention(q, k, v, REMAPS["dca"], key_valid=holes, **args)
    args = dict(args, pos_q=args["pos_q"] % 10)
    with pytest.raises(ValueError, match="run on"):
        remap_attention(q, k, v, REMAPS["dca"], **args)


# -- on the models --------------------------------------------------------------------------------------------

ROTARY_FAMILIES = tuple(f for f in DECODERS)
MODEL_REMAPS = [dict(remap="rerope"), dict(remap="leaky_rerope"), dict(remap="self_extend"), dict(remap="dca"),
                dict(window=24, sink=4, sink_positions="cache")]


@pytest.fixture
def remap_calls(monkeypatch):
    """How many attention calls reached the remap engine (no silent fall-back to the full matrix)."""
    import hf_posenc.attention as attention

    calls = []
    real = attention.remap_attention

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(attention, "remap_attention", spy)
    return calls


def _decode_all(model, ids, prefix):
    """Logits of ``ids`` from a prefill of ``prefix`` tokens, then one token at a time through the cache."""
    out = model(ids[:, :prefix], use_cache=True)
    cache, steps = returned_cache(out), [out.logits]
    for t in range(prefix, ids.shape[1]):
        out = model(ids[:, t : t + 1], **with_cache(cache), use_cache=True)
        cache = returned_cache(out)
        steps.append(out.logits)
    return torch.cat(steps, 1)


#: the fast tier's families for the model tests: GQA (llama), each layer's own rotary and a model window (Gemma 3),
#: partial rotary (GPT-NeoX); the other decoders run in the slow tier.
FAST_FAMILIES = ("llama", "gemma3_text", "gpt_neox")


@pytest.mark.parametrize("family", tiered(ROTARY_FAMILIES, FAST_FAMILIES))
@pytest.mark.parametrize("params", MODEL_REMAPS, ids=lambda p: p.get("remap") or "sinks_cache")
def test_cache_equals_full_forward_past_p(family, params, remap_calls):
    """Past the pretrained context (P = 64 positions), prefill + one token at a time through the KV cache gives
    the full forward's logits, with the engine running every attention call."""
    overrides = None
    if "sink" in params and family in ("mistral", "gemma3_text"):  # sinks need the model's own window off
        overrides = {"sliding_window": None} if family == "mistral" else {"layer_types": ["full_attention"] * 2}
    model = make_model(family, encoding="rope", dtype=torch.float64, config_overrides=overrides, **params)
    ids = torch.randint(0, VOCAB, (2, 2 * MAX_POSITIONS + 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(ids).logits
        steps = _decode_all(model, ids, MAX_POSITIONS + 3)
    assert (full - steps).abs().max() < 1e-9
    assert len(remap_calls) > 0


@pytest.mark.parametrize("family", tiered(ROTARY_FAMILIES, FAST_FAMILIES))
def test_remap_leaves_the_model_unchanged_below_its_window(family):
    """Pairs closer than w keep their distance: the first w tokens give the unpatched model's logits (the
    rope-native families; on GPT-2 the patched rope itself)."""
    base = make_model(family, dtype=torch.float64)
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    ref = base if family != "gpt2" else hf_posenc.patch_model(copy.deepcopy(base), "rope")
    for params in MODEL_REMAPS[:4]:
        model = hf_posenc.patch_model(copy.deepcopy(base), "rope", **params)
        with torch.no_grad():
            assert (model(ids).logits - ref(ids).logits).abs().max() < 1e-12, params


def test_generate_past_p():
    model = make_model("llama", encoding="rope", remap="dca")
    prompt = torch.randint(3, VOCAB, (1, MAX_POSITIONS + 20), generator=torch.Generator().manual_seed(2))
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=2 * MAX_POSITIONS,
                         do_sample=False, min_new_tokens=2 * MAX_POSITIONS)
    assert out.shape[1] == 3 * MAX_POSITIONS + 20


def test_left_padded_batch_matches_each_row_alone():
    model = make_model("llama", encoding="rope", remap="self_extend", dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    long, short = torch.randint(3, VOCAB, (1, 90), generator=g), torch.randint(3, VOCAB, (1, 75), generator=g)
    ids = torch.cat([long, torch.cat([torch.zeros(1, 15, dtype=torch.long), short], 1)])
    mask = torch.ones_like(ids)
    mask[1, :15] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        both = model(ids, attention_mask=mask, position_ids=positions).logits
        alone = model(short).logits
    assert (both[1, 15:] - alone[0]).abs().max() < 1e-9


def test_remap_composes_with_yarn_and_partial_rotary():
    """The model's own rope_parameters stay: with a window past every distance the remap is the unpatched YaRN
    model exactly (its frequencies and attention factor), and on Phi-3's partial rotary the same."""
    ids = torch.randint(0, VOCAB, (1, 80), generator=torch.Generator().manual_seed(4))
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0}
    for family, overrides in (("llama", {"rope_parameters": yarn}), ("phi3", {"partial_rotary_factor": 0.5})):
        base = make_model(family, dtype=torch.float64, config_overrides=overrides)
        model = hf_posenc.patch_model(copy.deepcopy(base), "rope", remap="rerope", remap_window=500)
        with torch.no_grad():
            assert (model(ids).logits - base(ids).logits).abs().max() < 1e-12, family
    base = make_model("llama", dtype=torch.float64, config_overrides={"rope_parameters": yarn})
    model = hf_posenc.patch_model(copy.deepcopy(base), "rope", remap="dca")
    assert model.config.position_encoding["remap_chunk"] == 24  # P = original_max_position_embeddings = 32
    with torch.no_grad():
        assert (model(ids).logits - base(ids).logits).abs().max() > 1e-3


def test_training_step_gradients_match_the_oracle(monkeypatch):
    """A training step through the engine gives the gradients of the full-matrix oracle, every weight."""
    import hf_posenc.attention as attention

    model = make_model("qwen3", encoding="rope", remap="dca", dtype=torch.float64, train=True)
    ids = torch.randint(0, VOCAB, (2, 100), generator=torch.Generator().manual_seed(5))
    model(ids, labels=ids).loss.backward()
    engine = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    def oracle(q, k, v, remap, *, pos_q, q_offset, key_valid, band, **kw):
        shift = q_offset - pos_q[:, :1]
        pos_k = torch.arange(k.shape[2])[None] - shift
        return remap_reference(q, k, v, remap, pos_q=pos_q, pos_k=pos_k, q_offset=q_offset, key_valid=key_valid,
                               band=band, **kw)

    monkeypatch.setattr(attention, "remap_attention", oracle)
    model(ids, labels=ids).loss.backward()
    for name, p in model.named_parameters():
        assert (p.grad - engine[name]).abs().max() < 1e-10, name


def test_save_and_load(tmp_path):
    model = make_model("mistral", encoding="rope", remap="self_extend", remap_group=4,
                       config_overrides={"sliding_window": None})
    model.save_pretrained(tmp_path)
    loaded = hf_posenc.from_pretrained(tmp_path)
    assert loaded.config.position_encoding == model.config.position_encoding
    ids = torch.randint(0, VOCAB, (1, 150), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_plan_and_config_key():
    model = make_model("llama", encoding=[{"name": "rope", "remap": "dca"}, "rope"])
    assert model.config.position_encoding[0]["remap"] == "dca"
    ids = torch.randint(0, VOCAB, (1, 150), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        full = model(ids).logits
        steps = _decode_all(model, ids, 100)
    assert (full - steps).abs().max() < 1e-4
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_POSITIONS)
    cfg.position_encoding = {"name": "rope", "remap": "rerope"}
    keyed = hf_posenc.patch_model(LlamaForCausalLM(cfg))
    assert keyed.config.position_encoding["remap_window"] == MAX_POSITIONS // 8


@pytest.mark.slow  # two inductor compilations of a training step: 50-95 s on the loaded 2-core VM
@pytest.mark.parametrize("params", [dict(remap="dca"), dict(window=20, sink=2, sink_positions="cache")])
def test_compiled_step_equals_eager(params):
    """torch.compile(fullgraph=True) keeps the engine (a custom op with its backward): the logits and a training
    step's gradients of the eager model."""
    model = make_model("llama", encoding="rope", train=True, **params)
    ids = torch.randint(0, VOCAB, (1, 100), generator=torch.Generator().manual_seed(8))
    model(ids, labels=ids).loss.backward()
    eager = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    torch.compile(model, fullgraph=True)(ids, labels=ids).loss.backward()
    for name, p in model.named_parameters():
        assert (p.grad - eager[name]).abs().max() < 1e-5, name


# -- refusals -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("encoding, params, match", [
    ("rope", dict(remap="dca", remap_window=48, remap_chunk=48), "remap_window .* < remap_chunk"),
    ("rope", dict(remap="dca", remap_window=50, remap_chunk=48), "remap_window .* < remap_chunk"),
    ("rope", dict(remap="self_extend", remap_group=0), "remap_group"),
    ("rope", dict(remap="nope_such"), "remap"),
    ("rope", dict(remap_window=8), "need remap"),
    ("rope", dict(remap="rerope", remap_group=2), "reads remap_window, not remap_group"),
    ("nope", dict(remap="dca"), "unknown parameter"),
    ("rope", dict(remap="dca", window=16), "remap='dca' with window=16"),
    ("rope", dict(window=16, sink_positions="cache"), "needs attention sinks"),
    ("rope", dict(window=16, sink=2, sink_positions="elsewhere"), "sink_positions"),
    ("fire", dict(window=16, sink=2, sink_positions="cache"), "distance alone"),
    ("rope+fox", dict(remap="dca"), "not composed"),
])
def test_bad_values(encoding, params, match):
    with pytest.raises(ValueError, match=match):
        make_model("llama", encoding=encoding, **params)


def test_refusals_on_models():
    with pytest.raises(ValueError, match="causal"):
        make_model("bert", encoding="rope", remap="rerope")
    with pytest.raises(ValueError, match="dynamic"):
        make_model("llama", encoding="rope", remap="rerope",
                   config_overrides={"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}})
    from hf_posenc.config import PosEncConfig
    from hf_posenc.encodings.base import ModelInfo
    from hf_posenc.encodings.rope import Rope

    info = ModelInfo(family="llama", hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, num_layers=1,
                     causal=True, max_positions=None)
    with pytest.raises(ValueError, match="pretrained context"):
        Rope.resolve(PosEncConfig("rope", {"remap": "dca"}), info)
    assert Rope.resolve(PosEncConfig("rope", {"remap": "dca", "remap_window": 4, "remap_chunk": 12}), info)
    model = make_model("llama", encoding="rope", remap="rerope")
    with pytest.raises(ValueError, match="output_attentions"):
        model(torch.randint(0, VOCAB, (1, 10)), output_attentions=True)
    # the sinks at their cache positions have no full-matrix path either (the band mask keeps their text positions)
    model = make_model("llama", encoding="rope", window=6, sink=2, sink_positions="cache")
    with pytest.raises(ValueError, match="sink_positions='cache': attention probabilities"):
        model(torch.randint(0, VOCAB, (1, 10)), output_attentions=True)
    model = make_model("llama", encoding="rope", window=6, sink=2)  # at their text positions: the band mask runs
    assert model(torch.randint(0, VOCAB, (1, 10)), output_attentions=True).attentions[0].shape[-1] == 10
