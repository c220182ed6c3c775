"""``hf_posenc.position_profile`` and ``hf-posenc show``: the profile of every kind against independent
computations (ALiBi's slopes, RoPE's frequencies, the scores a trained model actually uses), its form for
every encoding, the command on a name, a plan and a checkpoint, and its errors."""

from __future__ import annotations

import json

import pytest
import torch

import hf_posenc
from hf_posenc.cli import main as cli_main
from hf_posenc.encodings.alibi import alibi_slopes
from hf_posenc.kernels.attention.terms import TERMS
from hf_posenc.registry import get_encoding
from hf_posenc.show import small_model
from conftest import make_ids, make_model

def _term_biases() -> tuple[str, ...]:
    """The encodings whose fused term is a function of positions alone (the term registry's Toeplitz and pair
    forms without a value term, built from no token state): their profile is a score bias."""
    out = []
    for name in hf_posenc.list_encodings():
        kinds = getattr(get_encoding(name).cls, "kernel_kinds", ())
        specs = [TERMS[kind] for kind in kinds]
        if specs and all(s.form in ("toeplitz", "pair") and s.value_term is None for s in specs):
            out.append(name)
    return tuple(out)


#: The issue's kinds: the score biases derived from the term registry (independently of the profile's own rule,
#: which reads the encodings' registered kind), the others written out.
EXPECTED_KIND = {
    **dict.fromkeys(_term_biases(), "score_bias"),
    **dict.fromkeys(("rope", "rope2d", "liere", "comrope", "fope", "xpos"), "qk_transform"),
    **dict.fromkeys(("sinusoidal", "learned"), "absolute"),
    **dict.fromkeys(("fox", "fox_pro", "cope", "sba", "cape", "tape", "shaw"), "data_dependent"),
    "nope": "none",
}


def test_the_term_biases_are_the_static_biases():
    """The registry-derived score biases: ALiBi, T5, KERPLE, Sandwich, FIRE, DPB (a new one joins by its term)."""
    assert {"alibi", "t5", "kerple", "sandwich", "fire", "dpb"} <= set(_term_biases())
    assert not {"shaw", "fox", "fox_pro"} & set(_term_biases())

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _shape(x) -> tuple[int, ...]:
    return tuple(torch.tensor(x).shape)


def test_every_encoding_has_an_expected_kind():
    assert sorted(EXPECTED_KIND) == hf_posenc.list_encodings()


@pytest.mark.parametrize("encoding", hf_posenc.list_encodings())
def test_profile_form(encoding):
    """Every encoding gives a JSON-ready profile of its kind, with fields of the documented shapes."""
    n = 9
    model = make_model("llama", encoding=encoding)  # 2 layers, 4 heads, 2 key/value heads, head_dim 8
    heads = model.config.num_attention_heads
    profile = hf_posenc.position_profile(model, length=n)
    assert json.loads(json.dumps(profile)) == profile
    assert profile["length"] == n and len(profile["layers"]) == model.config.num_hidden_layers
    for i, entry in enumerate(profile["layers"]):
        assert (entry["layer"], entry["encoding"], entry["kind"]) == (i, encoding, EXPECTED_KIND[encoding])
        kind = entry["kind"]
        for key, value in entry.items():
            if isinstance(value, list):
                assert torch.isfinite(torch.tensor(value, dtype=torch.float64)).all(), key
        if kind == "score_bias":
            assert entry["distance"] == list(range(n)) and _shape(entry["bias"]) == (heads, n)
        elif kind == "qk_transform":
            sim = torch.tensor(entry["similarity"])
            assert sim.shape == ((1, n) if entry["shared"] else (heads, n))
            # d = 0: trace(T^T T) / D = 1 for orthogonal maps; FoPE's are not orthogonal (its Fourier terms)
            if encoding != "fope":
                assert torch.allclose(sim[:, 0], torch.ones(()), atol=1e-5)
        elif kind == "absolute":
            sim = torch.tensor(entry["similarity"])
            assert sim.shape == (n, n)
            assert torch.allclose(sim.diagonal(), torch.ones(n, dtype=sim.dtype), atol=1e-6)
            assert torch.allclose(sim, sim.T)
        elif kind == "data_dependent":
            att = torch.tensor(entry["attention"])
            assert att.shape == (heads, n, n)
            assert (att >= 0).all() and (att.sum(-1) <= 1 + 1e-5).all()
            assert torch.triu(att, diagonal=1).abs().max() == 0  # causal
        else:
            assert set(entry) == {"layer", "encoding", "kind"}
    if EXPECTED_KIND[encoding] == "data_dependent":
        assert len(profile["tokens"]) == n


@pytest.mark.parametrize("encoding", [e for e in hf_posenc.list_encodings() if "vit" in get_encoding(e).families])
def test_profile_form_on_vit(encoding):
    """On ViT: maps over the 4 x 4 patch grid from the centre patch, similarities between the 16 patches,
    attention over CLS + 16 patches."""
    model = make_model("vit", encoding=encoding)
    profile = hf_posenc.position_profile(model)
    assert json.loads(json.dumps(profile)) == profile
    for entry in profile["layers"]:
        assert entry["kind"] == EXPECTED_KIND[encoding]
        if entry["kind"] in ("score_bias", "qk_transform"):
            values = torch.tensor(entry["bias" if entry["kind"] == "score_bias" else "similarity"])
            assert values.shape[-2:] == (4, 4) and entry["centre"] == [2, 2]
            assert torch.isfinite(values).all()
        elif entry["kind"] == "absolute":
            assert _shape(entry["similarity"]) == (16, 16)
        elif entry["kind"] == "data_dependent":
            assert _shape(entry["attention"]) == (4, 17, 17)


def test_alibi_bias_is_minus_slope_times_distance():
    n = 40
    model = make_model("llama", encoding="alibi")
    slopes = alibi_slopes(model.config.num_attention_heads).double()
    expected = -slopes[:, None] * torch.arange(n, dtype=torch.float64)
    for entry in hf_posenc.position_profile(model, length=n)["layers"]:
        assert torch.allclose(torch.tensor(entry["bias"], dtype=torch.float64), expected, atol=1e-5)


def test_alibi_on_vit_is_minus_slope_times_grid_distance():
    model = make_model("vit", encoding="alibi")  # 32 px images in 8 px patches: a 4 x 4 grid
    entry = hf_posenc.position_profile(model)["layers"][0]
    assert entry["grid"] == [4, 4] and entry["centre"] == [2, 2]
    r = torch.arange(4.0)[:, None] - 2
    c = torch.arange(4.0)[None, :] - 2
    dist = torch.sqrt(r**2 + c**2).double()
    slopes = alibi_slopes(model.config.num_attention_heads).double()
    assert torch.allclose(torch.tensor(entry["bias"], dtype=torch.float64), -slopes[:, None, None] * dist, atol=1e-5)


def test_rope_similarity_is_the_mean_cosine_over_its_frequencies():
    n = 50
    model = make_model("llama", encoding="rope")  # GQA, head_dim 8, theta 10000
    dim = model.config.hidden_size // model.config.num_attention_heads
    theta = model.config.rope_parameters["rope_theta"]
    freqs = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    expected = torch.cos(torch.arange(n, dtype=torch.float64)[:, None] * freqs).mean(-1)
    for entry in hf_posenc.position_profile(model, length=n)["layers"]:
        assert entry["shared"] is True
        assert torch.allclose(torch.tensor(entry["similarity"][0], dtype=torch.float64), expected, atol=1e-5)


def test_per_head_transforms_give_one_curve_per_head():
    """LieRE with per-head generators: the heads differ, and the query heads of one key/value head share it."""
    model = make_model("llama", encoding="liere", per_head=True)
    entry = hf_posenc.position_profile(model, length=12)["layers"][0]
    sim = torch.tensor(entry["similarity"])
    assert entry["shared"] is False and sim.shape == (4, 12)
    assert torch.allclose(sim[0], sim[1]) and torch.allclose(sim[2], sim[3])  # 2 query heads per kv head
    assert not torch.allclose(sim[0], sim[2])


@pytest.mark.parametrize("encoding,params", [("t5", {"per_layer": True}), ("kerple", {"per_layer": True}), ("fire", {})])
def test_profile_matches_the_scores_of_a_trained_model(encoding, params):
    """After a few optimizer steps (so the bias parameters move), the profile's bias is the term the model adds:
    with the query and key projections set to zero the logits are the bias alone, so the log-probabilities of
    the last query differ across keys exactly as the profile's bias does."""
    torch.manual_seed(0)
    n = 16
    model = make_model("llama", encoding=encoding, train=True, **params)
    enc = hf_posenc.encoding_module(model)
    before = [p.detach().clone() for p in enc.parameters()]
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    for step in range(3):
        ids = make_ids(2, n, seed=10 + step)
        loss = model(ids, labels=ids, use_cache=False).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert any(not torch.allclose(a, b) for a, b in zip(before, enc.parameters())), "training moved nothing"
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.zero_()
            layer.self_attn.k_proj.weight.zero_()
    model.eval()
    profile = hf_posenc.position_profile(model, length=n)
    with torch.no_grad():
        attentions = model(make_ids(1, n, seed=3), output_attentions=True, use_cache=False).attentions
    biases = [torch.tensor(e["bias"], dtype=torch.float64) for e in profile["layers"]]
    if encoding != "kerple" or params.get("per_layer"):
        assert not torch.allclose(biases[0], biases[1]), "the layers' biases should differ"
    for bias, probs in zip(biases, attentions):
        log_p = probs[0, :, n - 1].double().log().flip(-1)  # (H, N), index d: key N-1-d
        assert torch.allclose(log_p - log_p[:, :1], bias - bias[:, :1], atol=1e-4)


def test_data_dependent_quantities():
    """FoX's gates and decay, CoPE's positions and SBA's breaks against their definitions."""
    n = 11
    fox = hf_posenc.position_profile(make_model("llama", encoding="fox"), length=n)["layers"][0]
    gates, decay = torch.tensor(fox["forget_gates"]), torch.tensor(fox["decay_last_query"])
    assert gates.shape == decay.shape == (4, n) and ((gates > 0) & (gates < 1)).all()
    # F_{N-1,j} = prod_{l=j+1..N-1} f_l
    expected = torch.stack([gates[:, j + 1 :].prod(-1) for j in range(n)], dim=-1)
    assert torch.allclose(decay, expected, atol=1e-6)

    cope = hf_posenc.position_profile(make_model("llama", encoding="cope"), length=n)["layers"][1]
    pos = torch.tensor(cope["positions_last_query"])
    steps = pos[:, :-1] - pos[:, 1:]  # p_ij - p_i,j+1 = g_ij in (0, 1)
    assert pos.shape == (4, n) and ((steps > 0) & (steps < 1)).all() and ((pos[:, -1] > 0) & (pos[:, -1] < 1)).all()
    assert cope["npos_max"] == 64

    sba = hf_posenc.position_profile(make_model("llama", encoding="sba"), length=n)["layers"][0]
    weights, breaks = torch.tensor(sba["stick_weights"]), torch.tensor(sba["breaks_last_query"])
    assert torch.allclose(weights, torch.tensor(sba["attention"]), atol=1e-6)
    # A_ij = beta_ij prod_{j<k<i} (1 - beta_ik) for the last query, no breakpoint at the query itself
    assert breaks[:, -1].abs().max() == 0
    rest = torch.stack([(1 - breaks[:, j + 1 : n - 1]).prod(-1) for j in range(n)], dim=-1)
    assert torch.allclose(weights[:, -1], breaks * rest, atol=1e-6)


def test_profile_takes_input_ids_and_rejects_bad_arguments():
    model = make_model("llama", encoding="cope")
    ids = make_ids(1, 7, seed=4)
    profile = hf_posenc.position_profile(model, length=5, input_ids=ids[0])
    assert profile["tokens"] == ids[0].tolist() and _shape(profile["layers"][0]["attention"]) == (4, 7, 7)
    with pytest.raises(ValueError, match="length must be >= 1"):
        hf_posenc.position_profile(model, length=0)
    with pytest.raises(TypeError, match="length must be an int"):
        hf_posenc.position_profile(model, length=2.5)
    with pytest.raises(ValueError, match="shape"):
        hf_posenc.position_profile(model, input_ids=torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="not patched"):
        hf_posenc.position_profile(small_model("llama", 8))


def _show(args: list[str], capsys) -> tuple[int, str]:
    rc = cli_main(["show", *args])
    return rc, capsys.readouterr().err


def _check_outputs(out, kind: str, layers: int) -> dict:
    profile = json.loads((out / "profile.json").read_text())
    assert len(profile["layers"]) == layers and {e["kind"] for e in profile["layers"]} == {kind}
    assert (out / "profile.png").read_bytes()[:8] == PNG_MAGIC
    return profile


def test_show_on_a_name_and_a_checkpoint(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    rc, err = _show(["kerple", "--out", str(tmp_path / "a"), "--length", "12"], capsys)
    assert rc == 0, err
    profile = _check_outputs(tmp_path / "a", "score_bias", 2)
    assert profile["source"]["family"] == "llama" and len(profile["layers"][0]["bias"][0]) == 12
    # a checkpoint of a data-dependent encoding, with --text (a byte-level model: one token per byte)
    model = hf_posenc.patch_model(small_model("gpt2", 32), "cope")
    model.save_pretrained(tmp_path / "ckpt")
    rc, err = _show([str(tmp_path / "ckpt"), "--out", str(tmp_path / "b"), "--length", "8", "--text", "abcab"], capsys)
    assert rc == 0, err
    profile = _check_outputs(tmp_path / "b", "data_dependent", 2)
    assert profile["tokens"] == list(b"abcab") and profile["token_text"] == list("abcab")
    assert _shape(profile["layers"][0]["positions_last_query"]) == (4, 5)


def test_show_on_vit(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    rc, err = _show(["rope2d", "--family", "vit", "--out", str(tmp_path)], capsys)
    assert rc == 0, err
    entry = _check_outputs(tmp_path, "qk_transform", 2)["layers"][0]
    assert entry["grid"] == [8, 8] and _shape(entry["similarity"])[-2:] == (8, 8)


def test_show_on_a_plan(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    rc, err = _show(["rope,rope,rope,nope", "--out", str(tmp_path), "--length", "10"], capsys)
    assert rc == 0, err
    profile = json.loads((tmp_path / "profile.json").read_text())
    assert [e["encoding"] for e in profile["layers"]] == ["rope", "rope", "rope", "nope"]
    assert [e["kind"] for e in profile["layers"]] == ["qk_transform"] * 3 + ["none"]
    assert (tmp_path / "profile.png").read_bytes()[:8] == PNG_MAGIC


def test_show_bad_inputs(tmp_path, capsys):
    unpatched = small_model("llama", 8)
    unpatched.save_pretrained(tmp_path / "plain")
    capsys.readouterr()  # save_pretrained's progress bar
    cases = [
        (["no_such_encoding"], "unknown position encoding 'no_such_encoding'"),
        (["alibi", "--text", ""], "tokenizes to nothing"),
        ([str(tmp_path / "plain")], "position_encoding"),
        (["alibi", "--length", "0"], "--length must be >= 1"),
        (["alibi", "--family", "nosuch"], "unknown --family 'nosuch'"),
    ]
    for args, message in cases:
        rc, err = _show([*args, "--out", str(tmp_path / "x")], capsys)
        assert rc == 2, (args, err)
        assert message in err and "Traceback" not in err, (args, err)
        assert err.count("\n") == 1
    assert not (tmp_path / "x" / "profile.json").exists()


def test_missing_matplotlib_names_the_extra(monkeypatch, tmp_path):
    import builtins

    from hf_posenc.profile_plot import draw_profile

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.split(".")[0] == "matplotlib":
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    profile = hf_posenc.position_profile(make_model("llama", encoding="nope"), length=3)
    with pytest.raises(ImportError, match=r'pip install "hf_posenc\[study\]"'):
        draw_profile(profile, tmp_path / "p.png")


def test_each_layer_gets_its_own_encoding(monkeypatch):
    """The profile follows ``layer_encodings`` layer by layer (what a plan gives): here layer 0 runs a rope module
    and layer 1 an alibi one, whatever the model itself holds."""
    import hf_posenc.profile as profile_module

    rope = hf_posenc.encoding_module(make_model("llama", encoding="rope"))
    alibi = hf_posenc.encoding_module(make_model("llama", encoding="alibi"))
    monkeypatch.setattr(profile_module, "layer_encodings", lambda model: [(rope, 0), (alibi, 1)])
    profile = hf_posenc.position_profile(make_model("llama", encoding="nope"), length=6)
    assert [(e["encoding"], e["kind"]) for e in profile["layers"]] == [("rope", "qk_transform"), ("alibi", "score_bias")]
    assert "similarity" in profile["layers"][0] and "bias" in profile["layers"][1]
