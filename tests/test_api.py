"""The public API: config key, registry, bad input, isolation between models, describe, README matrix."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import torch
import transformers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    OPTConfig,
    OPTModel,
    ViTConfig,
    ViTModel,
)
from transformers.models.gpt2 import modeling_gpt2
from transformers.models.llama import modeling_llama
from transformers.models.vit import modeling_vit

import hf_posenc
from hf_posenc import PosEncConfig
from hf_posenc.registry import FAMILIES

ROOT = Path(__file__).resolve().parents[1]


def _llama_config(**kw):
    cfg = dict(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg.update(kw)
    return LlamaConfig(**cfg)


def _llama(**kw):
    torch.manual_seed(0)
    return LlamaForCausalLM(_llama_config(**kw)).eval()


def _gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=61, n_embd=32, n_layer=2, n_head=4, n_positions=16,
                                      bos_token_id=1, eos_token_id=2)).eval()


IDS = torch.tensor([[3, 4, 5, 6, 7, 8]])


def test_list_encodings_has_the_foundation_five():
    assert {"nope", "sinusoidal", "learned", "rope", "alibi"} <= set(hf_posenc.list_encodings())


def test_config_is_written_with_defaults_filled_in():
    m = hf_posenc.patch_model(_gpt2(), "learned")
    assert m.config.position_encoding == {"name": "learned", "max_positions": 16, "init_std": 0.02}
    assert m.config._attn_implementation == "hf_posenc"


@pytest.mark.parametrize("form", ["str", "dict", "config"])
def test_name_forms(form):
    enc = {"str": "rope", "dict": {"name": "rope", "layout": "interleaved"}, "config": PosEncConfig("rope")}[form]
    m = hf_posenc.patch_model(_llama(), enc)
    assert m.config.position_encoding["name"] == "rope"


def test_config_key_drives_the_swap():
    cfg = _llama_config()
    cfg.position_encoding = {"name": "alibi"}
    torch.manual_seed(0)
    m = LlamaForCausalLM(cfg).eval()
    hf_posenc.patch_model(m)
    assert hf_posenc.describe(m)["encoding"] == "alibi"
    reference = hf_posenc.patch_model(_llama(), "alibi")
    with torch.no_grad():
        assert torch.equal(m(IDS).logits, reference(IDS).logits)


def test_describe():
    m = hf_posenc.patch_model(_gpt2(), "learned")
    d = hf_posenc.describe(m)
    assert d["encoding"] == "learned" and d["family"] == "gpt2" and d["kind"] == "absolute"
    assert d["layers"] == ["h.0.attn", "h.1.attn"]
    assert d["backend"] == "torch"
    assert d["parameters"] == 16 * 32


@pytest.mark.parametrize("name", ["cope", "sba", "rope+cope"])
def test_describe_names_the_own_attention_kernels(name, monkeypatch):
    """sba and cope run their own Triton kernel inside ``attend``: describe says so where it runs (forced here;
    unforced, on CUDA), and ``torch`` on the CPU."""
    m = hf_posenc.patch_model(_llama(), name)
    assert hf_posenc.describe(m)["backend"] == "torch"
    monkeypatch.setenv("HF_POSENC_BACKEND", "triton")
    assert hf_posenc.describe(m)["backend"] == "triton (its own attention kernel)"


def test_describe_unpatched_model_is_an_error():
    with pytest.raises(ValueError, match="not patched"):
        hf_posenc.describe(_gpt2())


# -- bad input -------------------------------------------------------------------------------------


def test_unknown_encoding_lists_known_names():
    with pytest.raises(ValueError, match=r"unknown position encoding 'ropee'.*alibi.*rope"):
        hf_posenc.patch_model(_llama(), "ropee")


def test_unknown_parameter_names_allowed_ones():
    with pytest.raises(ValueError, match=r"unknown parameter\(s\) 'thetaa'.*allowed: theta, layout"):
        hf_posenc.patch_model(_llama(), "rope", thetaa=3.0)


@pytest.mark.parametrize(
    "name, params, err, pattern",
    [
        ("rope", {"layout": "zigzag"}, ValueError, r"'layout'.*one of \['half', 'interleaved'\]"),
        ("rope", {"theta": -1.0}, ValueError, r"'theta'.*must be > 1.0"),
        ("rope", {"theta": "big"}, TypeError, r"'theta'.*must be of type float"),
        ("sinusoidal", {"base": float("nan")}, ValueError, r"'base'.*finite"),
        ("learned", {"max_positions": 0}, ValueError, r"'max_positions'.*>= 1"),
        ("learned", {"max_positions": 3.5}, TypeError, r"'max_positions'.*int"),
        ("learned", {"max_positions": True}, TypeError, r"'max_positions'.*bool"),
    ],
)
def test_out_of_range_parameters(name, params, err, pattern):
    with pytest.raises(err, match=pattern):
        hf_posenc.patch_model(_llama(), name, **params)


def test_bad_name_type():
    with pytest.raises(TypeError, match="name"):
        hf_posenc.patch_model(_llama(), 3)


def test_unsupported_model_type_names_families():
    opt = OPTModel(OPTConfig(vocab_size=30, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, ffn_dim=64,
                             word_embed_proj_dim=32))
    every = ", ".join(FAMILIES)
    with pytest.raises(ValueError, match=rf"unsupported model type 'opt'; hf_posenc patches these families: {every}\. To add a family"):
        hf_posenc.patch_model(opt, "alibi")


def test_not_a_model():
    with pytest.raises(TypeError, match="PreTrainedModel"):
        hf_posenc.patch_model(torch.nn.Linear(2, 2), "alibi")


def test_no_name_and_no_config_key():
    with pytest.raises(ValueError, match="position_encoding is not set"):
        hf_posenc.patch_model(_llama())


def test_sequence_longer_than_learned_table_is_a_clear_error():
    m = hf_posenc.patch_model(_gpt2(), "learned")
    with pytest.raises(ValueError, match=r"position 16 is outside the learned table of 16 positions"):
        m(torch.randint(3, 61, (1, 17)))


def test_gpt2_runs_past_n_positions_with_relative_encodings():
    """40 tokens on a GPT-2 of 16 positions: finite, and causal past n_positions (the first 30 positions give the
    30-token input's logits)."""
    m = hf_posenc.patch_model(_gpt2(), "alibi")
    ids = torch.randint(3, 61, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = m(ids).logits
        prefix = m(ids[:, :30]).logits
    assert out.shape == (1, 40, 61) and torch.isfinite(out).all()
    torch.testing.assert_close(out[:, :30], prefix, rtol=0, atol=1e-5)


def test_rope_reproduces_dynamic_ntk_scaling():
    """A Llama with dynamic NTK scaling, patched with rope: the native logits, within and past
    max_position_embeddings (transformers recomputes the frequencies from the length there)."""
    native = _llama(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}).eval()
    patched = copy.deepcopy(native)
    hf_posenc.patch_model(patched, "rope")
    for length in (8, 3 * native.config.max_position_embeddings):
        ids = torch.randint(3, 61, (1, length))
        torch.testing.assert_close(patched(ids).logits, native(ids).logits, rtol=1e-5, atol=1e-5)


def test_learned_on_vit_takes_no_max_positions():
    vit = ViTModel(ViTConfig(image_size=16, patch_size=8, hidden_size=32, num_hidden_layers=1,
                             num_attention_heads=4, intermediate_size=64))
    with pytest.raises(ValueError, match="no max_positions"):
        hf_posenc.patch_model(vit, "learned", max_positions=5)


def test_vit_image_not_multiple_of_patch():
    vit = hf_posenc.patch_model(ViTModel(ViTConfig(image_size=16, patch_size=8, hidden_size=32, num_hidden_layers=1,
                                                   num_attention_heads=4, intermediate_size=64)), "alibi")
    with pytest.raises(ValueError, match="multiple of the patch size"):
        vit(torch.randn(1, 3, 20, 16))


def test_backend_override_is_validated(monkeypatch):
    m = hf_posenc.patch_model(_llama(), "alibi")
    monkeypatch.setenv("HF_POSENC_BACKEND", "cuda-magic")
    with pytest.raises(ValueError, match="allowed: torch, flex, triton"):
        m(IDS)
    # alibi has a Triton kernel: on the CPU it needs the interpreter, and says so
    monkeypatch.setenv("HF_POSENC_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
            m(IDS)
    monkeypatch.delenv("TRITON_INTERPRET")
    # encodings without a kernel (cape), or without a FlexAttention form (shaw's value term), refuse
    cape = hf_posenc.patch_model(_llama(), "cape")
    with pytest.raises(ValueError, match="no triton attention kernel for 'cape'"):
        cape(IDS)
    monkeypatch.setenv("HF_POSENC_BACKEND", "flex")
    with pytest.raises(ValueError, match="no flex attention kernel for 'cape'"):
        cape(IDS)
    with pytest.raises(ValueError, match="no flex attention kernel for 'shaw'"):
        hf_posenc.patch_model(_llama(), "shaw")(IDS)
    monkeypatch.setenv("HF_POSENC_BACKEND", "torch")
    m(IDS)


# -- checkpoints -----------------------------------------------------------------------------------


def _save(tmp_path, name="alibi"):
    m = hf_posenc.patch_model(_llama(), name)
    m.save_pretrained(tmp_path)
    return m


def _edit_config(path, fn):
    f = Path(path) / "config.json"
    data = json.loads(f.read_text())
    fn(data)
    f.write_text(json.dumps(data))


def test_checkpoint_with_unknown_encoding_is_a_clear_error(tmp_path):
    _save(tmp_path)
    _edit_config(tmp_path, lambda d: d.__setitem__("position_encoding", {"name": "from_the_future"}))
    with pytest.raises(ValueError, match=r"cannot be used by this hf_posenc.*unknown position encoding 'from_the_future'"):
        hf_posenc.from_pretrained(tmp_path)


def test_checkpoint_with_unknown_parameter_warns_and_loads(tmp_path):
    """A key in position_encoding that this version does not know (a checkpoint from a newer hf_posenc) warns,
    naming it, and is ignored: the model loads with the known parameters (typed by a user, it is an error:
    tests/test_bad_inputs.py)."""
    m = _save(tmp_path, "rope")
    _edit_config(tmp_path, lambda d: d["position_encoding"].__setitem__("warp", 2))
    with pytest.warns(UserWarning, match=r"does not know: 'warp'"):
        loaded = hf_posenc.from_pretrained(tmp_path)
    assert loaded.config.position_encoding == m.config.position_encoding
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, m(IDS).logits)


def test_checkpoint_without_encoding_is_a_clear_error(tmp_path):
    _llama().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not saved from a model patched by hf_posenc"):
        hf_posenc.from_pretrained(tmp_path)


def test_checkpoint_missing_encoding_weights_fails_loudly(tmp_path):
    from safetensors.torch import load_file, save_file

    _save(tmp_path, "learned")
    f = tmp_path / "model.safetensors"
    state = load_file(f)
    state = {k: v for k, v in state.items() if "posenc" not in k}
    save_file(state, f, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing \['weight'\]"):
        hf_posenc.from_pretrained(tmp_path)


def test_round_trip_learned_llama(tmp_path):
    m = _save(tmp_path, "learned")
    with torch.no_grad():
        torch.nn.init.normal_(hf_posenc.encoding_module(m).weight)  # not the init: must come from disk
    m.save_pretrained(tmp_path)
    r, info = hf_posenc.from_pretrained(tmp_path, output_loading_info=True)
    assert all(not v for v in info.values())
    with torch.no_grad():
        assert torch.equal(r(IDS).logits, m(IDS).logits)


# -- isolation ------------------------------------------------------------------------------------


def test_two_models_patched_differently_do_not_interfere():
    a, b = _llama(), _llama()
    ref_a = hf_posenc.patch_model(_llama(), "alibi")(IDS).logits
    ref_b = hf_posenc.patch_model(_llama(), "sinusoidal")(IDS).logits
    hf_posenc.patch_model(a, "alibi")
    hf_posenc.patch_model(b, "sinusoidal")
    assert torch.equal(a(IDS).logits, ref_a) and torch.equal(b(IDS).logits, ref_b)
    assert a.config.position_encoding["name"] == "alibi" and b.config.position_encoding["name"] == "sinusoidal"


def test_shared_config_object_is_not_changed_by_patching():
    cfg = _llama_config()
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    a = LlamaForCausalLM(cfg).eval()
    torch.manual_seed(0)
    b = LlamaForCausalLM(cfg).eval()
    ref = b(IDS).logits
    hf_posenc.patch_model(a, "alibi")
    assert getattr(cfg, "position_encoding", None) is None and cfg._attn_implementation == "sdpa"
    assert b.config._attn_implementation == "sdpa"
    assert torch.equal(b(IDS).logits, ref)


def test_transformers_globals_untouched():
    before = {
        "llama": (modeling_llama.LlamaAttention.forward, modeling_llama.LlamaModel.forward,
                  modeling_llama.apply_rotary_pos_emb, modeling_llama.LlamaRotaryEmbedding.forward),
        "gpt2": (modeling_gpt2.GPT2Attention.forward, modeling_gpt2.GPT2Model.forward),
        "vit": (modeling_vit.ViTAttention.forward, modeling_vit.ViTEmbeddings.forward, modeling_vit.ViTModel.forward),
        "sdpa": transformers.AttentionInterface._global_mapping["sdpa"],
    }
    m = hf_posenc.patch_model(_llama(), "rope")
    g = hf_posenc.patch_model(_gpt2(), "alibi")
    m(IDS), g(IDS)
    after = {
        "llama": (modeling_llama.LlamaAttention.forward, modeling_llama.LlamaModel.forward,
                  modeling_llama.apply_rotary_pos_emb, modeling_llama.LlamaRotaryEmbedding.forward),
        "gpt2": (modeling_gpt2.GPT2Attention.forward, modeling_gpt2.GPT2Model.forward),
        "vit": (modeling_vit.ViTAttention.forward, modeling_vit.ViTEmbeddings.forward, modeling_vit.ViTModel.forward),
        "sdpa": transformers.AttentionInterface._global_mapping["sdpa"],
    }
    assert before == after
    # An unpatched model built afterwards is plain transformers.
    fresh = _llama()
    assert type(fresh.model) is modeling_llama.LlamaModel
    assert type(fresh.model.layers[0].self_attn) is modeling_llama.LlamaAttention


def test_patching_again_switches_encoding():
    m = hf_posenc.patch_model(_llama(), "alibi")
    hf_posenc.patch_model(m, "rope")
    assert hf_posenc.describe(m)["encoding"] == "rope"
    ref = _llama()
    with torch.no_grad():
        assert torch.equal(m(IDS).logits, ref(IDS).logits)  # rope == the unpatched Llama


# -- README ----------------------------------------------------------------------------------------


def test_readme_support_matrix_matches_registry():
    text = (ROOT / "README.md").read_text()
    found = re.search(r"<!-- support-matrix:start -->\n(.*?)\n<!-- support-matrix:end -->", text, re.S)
    assert found, "README.md lacks the support-matrix markers"
    assert found.group(1).strip() == hf_posenc.support_matrix().strip()


def test_support_matrix_names_the_families_an_encoding_lacks():
    """The compact matrix: ``all`` for an encoding on every family, ``all but ...`` naming the missing ones."""
    from dataclasses import dataclass

    from hf_posenc.encodings.alibi import Alibi
    from hf_posenc.registry import _REGISTRY, FAMILIES, register_encoding

    rows = {line.split("|")[1].strip(): line.split("|")[3].strip() for line in hf_posenc.support_matrix().splitlines()[2:]}
    assert set(rows) == {f"`{n}`" for n in hf_posenc.list_encodings()}
    assert rows.pop("`xpos`") == "all but vit, bert"  # causal only (its decay would grow on later keys)
    assert set(rows.values()) == {"all"}

    @register_encoding("_text_only_alibi", params=dataclass(type("P", (), {})), kind="score bias", summary="test",
                       paper="none", families=("llama",))
    class TextOnly(Alibi):
        pass

    try:
        row = next(line for line in hf_posenc.support_matrix().splitlines() if line.startswith("| `_text_only_alibi`"))
        assert row.split("|")[3].strip() == "all but vit, bert"
        assert all(f" {fam} " in hf_posenc.support_matrix().splitlines()[0] for fam in FAMILIES)
    finally:
        _REGISTRY.pop("_text_only_alibi", None)


def test_cli_lists_encodings(capsys):
    from hf_posenc.cli import main

    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in hf_posenc.list_encodings())


def test_base_model_loads_from_a_causal_lm_checkpoint(tmp_path):
    from transformers import LlamaModel

    m = _save(tmp_path, "alibi")
    base = hf_posenc.from_pretrained(tmp_path, model_class=LlamaModel)
    assert isinstance(base, LlamaModel) and hf_posenc.describe(base)["encoding"] == "alibi"
    with torch.no_grad():
        torch.testing.assert_close(base(IDS).last_hidden_state, m.model(IDS).last_hidden_state, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["rope", "fope"])
def test_forcing_triton_on_an_elementwise_rotation_is_an_error(monkeypatch, name):
    m = hf_posenc.patch_model(_llama(), name)
    monkeypatch.setenv("HF_POSENC_BACKEND", "triton")
    with pytest.raises(ValueError, match="no Triton kernel for its q/k transform"):
        m(IDS)


def test_describe_backend_names_the_rotary_kernel_only_where_it_is_used():
    from hf_posenc.api import _backend_summary
    from hf_posenc.kernels.rotary import _triton_import_error

    cuda = torch.device("cuda")
    rope = hf_posenc.encoding_module(hf_posenc.patch_model(_llama(), "rope"))
    assert _backend_summary(rope, cuda) == "torch"
    if _triton_import_error() is None:
        liere = hf_posenc.encoding_module(hf_posenc.patch_model(_llama(), "liere"))
        assert _backend_summary(liere, cuda) == "torch (attention), triton (rotation)"


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_encoding_follows_the_model_mode(mode):
    """A model patched after ``.eval()`` gets its encoding in eval mode too (and one patched in training mode, in
    training mode): the encodings decide their per-forward memos (shared biases, tables) by their own flag."""
    model = _llama()
    model.train(mode == "train")
    hf_posenc.patch_model(model, "fox_pro")
    assert hf_posenc.encoding_module(model).training == (mode == "train")
