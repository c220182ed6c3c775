"""A catalogue of bad inputs: each gives a ValueError or TypeError (or the error type users of transformers
expect) whose message names what was wrong and what is allowed -- never an IndexError, KeyError or
AttributeError from deep inside.

Sections: names and parameters (generated from every encoding's registry schema: every bound, every
choice, every type); models and families; head dimensions and head counts; lengths past a table;
tensors of the wrong dtype or shape; checkpoints (pickled weights, missing / misshapen / extra weights of
the model or of the encoding, configs naming unknown encodings or parameters, a half-loaded model never
leaking); PEFT in the wrong order; the memory budget of the O(L^2) references.
"""

from __future__ import annotations

import gc
import json
import pickle
import re
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    GPT2LMHeadModel,
    LlamaForCausalLM,
    OPTConfig,
    OPTModel,
    ViTForImageClassification,
)

import hf_posenc
from hf_posenc import PosEncConfig
from hf_posenc.memory import ReferenceMemoryError, parse_size
from hf_posenc.registry import FAMILIES, get_encoding
from conftest import ENCODINGS, make_config, make_ids, make_model, make_pixels, with_cache

DEEP = (IndexError, KeyError, AttributeError)


def llama(**overrides):
    torch.manual_seed(0)
    return LlamaForCausalLM(make_config("llama", **overrides)).eval()


def gpt2(**overrides):
    torch.manual_seed(0)
    return GPT2LMHeadModel(make_config("gpt2", **overrides)).eval()


def vit(**overrides):
    torch.manual_seed(0)
    return ViTForImageClassification(make_config("vit", **overrides)).eval()


def check_error(excinfo) -> None:
    assert not isinstance(excinfo.value, DEEP), f"a deep error: {excinfo.value!r}"


# ---------------------------------------------------------------------------------------------------
# names and parameters
# ---------------------------------------------------------------------------------------------------


def test_unknown_encoding_names_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown position encoding 'alibii' \(did you mean 'alibi'\?\); known encodings: alibi, cape"):
        hf_posenc.patch_model(llama(), "alibii")


@pytest.mark.parametrize("how", ["kwargs", "dict", "config"])
def test_unknown_parameter_typed_by_a_user_is_an_error(how):
    """Keys a user types are checked strictly (only a stored config from a newer version warns)."""
    with pytest.raises(ValueError, match=r"unknown parameter\(s\) 'warp' for encoding 'rope'; allowed: theta, layout"):
        if how == "kwargs":
            hf_posenc.patch_model(llama(), "rope", warp=2)
        elif how == "dict":
            hf_posenc.patch_model(llama(), {"name": "rope", "warp": 2})
        else:
            PosEncConfig("rope", {"warp": 2})


@pytest.mark.parametrize(
    "name, exc, pattern",
    [
        (3, TypeError, r"a name \(str\), a dict with a 'name' key, or a PosEncConfig; got int"),
        ([], ValueError, r"a plan needs at least one encoding"),
        ([3], TypeError, r"plan entry 0 \(3\): encoding must be a name"),
        ({"theta": 2.0}, ValueError, r"must have a 'name' key, got keys \['theta'\]"),
        ({"name": 5}, TypeError, r"encoding name must be a str, got int"),
    ],
    ids=["int", "empty-plan", "plan-of-int", "dict-without-name", "dict-with-int-name"],
)
def test_encoding_of_the_wrong_type(name, exc, pattern):
    with pytest.raises(exc, match=pattern):
        hf_posenc.patch_model(llama(), name)


def test_params_must_be_a_mapping():
    with pytest.raises(TypeError, match="params must be a mapping, got list"):
        PosEncConfig("rope", [("theta", 2.0)])


def test_parameters_without_a_name():
    model = llama()
    with pytest.raises(ValueError, match=r"no encoding given and model.config.position_encoding is not set; pass one of: alibi"):
        hf_posenc.patch_model(model)
    model.config.position_encoding = {"name": "alibi"}
    with pytest.raises(ValueError, match="parameters were given without an encoding name"):
        hf_posenc.patch_model(model, theta=2.0)


def schema_cases():
    """One bad value per bound, choice and type of every parameter of every registered encoding."""
    cases = []
    for enc in ENCODINGS:
        for f in get_encoding(enc).param_fields():
            meta = f.metadata
            types = meta["type"] if isinstance(meta["type"], tuple) else (meta["type"],)
            tag = f"{enc}-{f.name}"
            for bound, delta in (("gt", 0), ("ge", -1), ("le", 1)):
                b = meta.get(bound)
                if b is None:
                    continue
                bad = b + delta if int in types and float not in types else (b - 0.5 if bound != "le" else b + 0.5)
                if bound == "gt":
                    bad = b if int in types and float not in types else float(b)
                words = {"gt": ">", "ge": ">=", "le": "<="}[bound]
                cases.append(pytest.param(enc, f.name, bad, ValueError, rf"'{f.name}'.*must be {words} ", id=f"{tag}-{bound}"))
            if meta.get("choices"):
                cases.append(pytest.param(enc, f.name, "no-such-choice", ValueError, rf"'{f.name}'.*must be one of \[",
                                          id=f"{tag}-choice"))
            else:
                wrong = "a string" if str not in types else 3
                cases.append(pytest.param(enc, f.name, wrong, TypeError, rf"'{f.name}'.*must be of type", id=f"{tag}-type"))
            if float in types:
                cases.append(pytest.param(enc, f.name, float("nan"), ValueError, rf"'{f.name}'.*must be finite",
                                          id=f"{tag}-nan"))
            if bool not in types:
                cases.append(pytest.param(enc, f.name, True, TypeError, rf"'{f.name}'.*got bool", id=f"{tag}-bool"))
            if not meta.get("optional"):
                cases.append(pytest.param(enc, f.name, None, ValueError, rf"'{f.name}'.*may not be None", id=f"{tag}-none"))
    return cases


@pytest.mark.parametrize("encoding, param, value, exc, pattern", schema_cases())
def test_every_parameter_is_validated(encoding, param, value, exc, pattern):
    """Generated from the registry: every bound, choice and type of every parameter of every encoding gives
    the error that names the parameter, the encoding and what is allowed."""
    with pytest.raises(exc, match=pattern) as info:
        PosEncConfig(encoding, {param: value})
    assert repr(encoding) in str(info.value)


def test_numpy_scalars_are_accepted_as_plain_numbers():
    """A numpy scalar is the number it holds (the config must stay JSON): stored as a Python int/float."""
    model = hf_posenc.patch_model(gpt2(), "learned", max_positions=np.int64(64), init_std=np.float32(0.5))
    stored = model.config.position_encoding
    assert type(stored["max_positions"]) is int and type(stored["init_std"]) is float
    json.dumps(stored)


# ---------------------------------------------------------------------------------------------------
# models and families
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("obj", [torch.nn.Linear(2, 2), LlamaForCausalLM, None], ids=["module", "class", "none"])
def test_not_a_transformers_model(obj):
    with pytest.raises(TypeError, match="patch_model expects a transformers PreTrainedModel"):
        hf_posenc.patch_model(obj, "alibi")


def test_unsupported_model_family():
    opt = OPTModel(OPTConfig(vocab_size=30, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, ffn_dim=64,
                             word_embed_proj_dim=32))
    with pytest.raises(ValueError, match=rf"unsupported model type 'opt'; hf_posenc patches these families: {', '.join(FAMILIES)}\. "
                       r"To add a family: .*'Adding a family' in docs/families\.md$"):
        hf_posenc.patch_model(opt, "alibi")


UNSUPPORTED = [
    pytest.param(enc, fam, id=f"{fam}-{enc}")
    for enc in ENCODINGS
    for fam in FAMILIES
    if fam not in get_encoding(enc).families
]


@pytest.mark.parametrize("encoding, family", UNSUPPORTED or [pytest.param(None, None, marks=pytest.mark.skip)])
def test_encoding_that_does_not_support_the_family(encoding, family):
    model = make_model(family)
    allowed = ", ".join(get_encoding(encoding).families)
    with pytest.raises(ValueError, match=rf"encoding '{encoding}' does not support {family}; it supports: {allowed}"):
        hf_posenc.patch_model(model, encoding)


def test_unpatched_model_in_describe_and_encoding_module():
    with pytest.raises(ValueError, match="is not patched by hf_posenc; call hf_posenc.patch_model first"):
        hf_posenc.describe(llama())
    with pytest.raises(TypeError, match="PreTrainedModel"):
        hf_posenc.encoding_module(torch.nn.Linear(2, 2))


# ---------------------------------------------------------------------------------------------------
# head dimensions and head counts
# ---------------------------------------------------------------------------------------------------

# GPT-2 with n_embd 20 and 4 heads: head_dim 5 (Llama refuses an odd head_dim in its own config already).
ODD_HEAD_DIM = [
    ("rope", {}, r"rope needs an even head_dim, got 5"),
    ("xpos", {}, r"xpos needs an even head_dim, got 5"),
    ("rope2d", {}, r"rope2d needs head_dim divisible by 2 on text, got head_dim=5"),
    ("comrope", {}, r"comrope-ap finds no block size in \[8, 4, 2\] for head_dim=5"),
    ("fope", {}, r"fope needs head_dim divisible by 2 on gpt2 \(coordinate pairs\), got 5"),
    ("tape", {}, r"tape needs an even head_dim \(rotary states\), got 5"),
    ("fox", {"rope": True}, r"fox with rope=True needs an even head_dim, got 5"),
    ("sandwich", {}, r"sandwich needs an even dim \(d-bar\), got 5"),
]


@pytest.mark.parametrize("encoding, params, pattern", ODD_HEAD_DIM, ids=[c[0] for c in ODD_HEAD_DIM])
def test_odd_head_dim(encoding, params, pattern):
    with pytest.raises(ValueError, match=pattern):
        hf_posenc.patch_model(gpt2(n_embd=20, n_head=4), encoding, **params)


# ViT with hidden 24 and 4 heads: head_dim 6, not a multiple of 4 (two grid axes need pairs for each).
VIT_HEAD_DIM_6 = [
    ("rope2d", r"rope2d needs head_dim divisible by 4 on the ViT patch grid"),
    ("fope", r"fope needs head_dim divisible by 4 on vit"),
    ("comrope", r"comrope-ap finds no block size in \[8, 4, 2\] for head_dim=6 with 2 position axis"),
]


@pytest.mark.parametrize("encoding, pattern", VIT_HEAD_DIM_6, ids=[c[0] for c in VIT_HEAD_DIM_6])
def test_vit_head_dim_not_a_multiple_of_four(encoding, pattern):
    with pytest.raises(ValueError, match=pattern):
        hf_posenc.patch_model(vit(hidden_size=24, num_attention_heads=4), encoding)


@pytest.mark.parametrize(
    "family, overrides, encoding, params, pattern",
    [
        ("gpt2", {"n_embd": 15, "n_head": 3}, "sinusoidal", {}, r"sinusoidal needs hidden_size divisible by 2 on gpt2, got 15"),
        ("vit", {"hidden_size": 18, "num_attention_heads": 3}, "sinusoidal", {}, r"divisible by 4 on vit, got 18"),
        ("llama", {}, "comrope", {"block_size": 3}, r"comrope-ap: head_dim=8 is not divisible by block_size=3"),
        ("llama", {}, "liere", {"block_size": 3}, r"block_size must divide head_dim.*allowed here: \[2, 4, 8\]"),
        ("llama", {}, "fope", {"num_frequencies": 3}, r"num_frequencies must be a multiple of head_dim/2 = 4"),
        ("vit", {}, "t5", {"num_buckets": 2}, r"t5 on vit \(bidirectional bucketing\) needs num_buckets >= 4"),
        ("llama", {}, "t5", {"max_distance": 4}, r"needs max_distance > 16"),
        ("vit", {}, "learned", {"max_positions": 5}, r"learned on ViT takes no max_positions"),
        ("llama", {"max_position_embeddings": 1}, "liere", {}, r"pass position_scale"),
        ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "fope", {},
         r"rope_type='dynamic'.*pass an explicit theta"),
    ],
    ids=["gpt2-sinusoidal-odd-hidden", "vit-sinusoidal-hidden-18", "comrope-block-3", "liere-block-3",
         "fope-frequencies", "vit-t5-buckets", "t5-max-distance", "vit-learned-max-positions",
         "liere-no-max-positions", "fope-dynamic-rope"],
)
def test_model_shape_an_encoding_cannot_take(family, overrides, encoding, params, pattern):
    model = {"llama": llama, "gpt2": gpt2, "vit": vit}[family](**overrides)
    with pytest.raises(ValueError, match=pattern):
        hf_posenc.patch_model(model, encoding, **params)


@pytest.mark.parametrize("encoding", ["alibi", "rope", "fox"])
def test_query_heads_not_a_multiple_of_key_value_heads(encoding):
    """Checked when patching (the unpatched Llama fails later, inside its attention, with a shape error)."""
    with pytest.raises(ValueError, match=r"4 query heads and 3 key/value heads; grouped-query attention needs"):
        hf_posenc.patch_model(llama(num_attention_heads=4, num_key_value_heads=3), encoding)


# ---------------------------------------------------------------------------------------------------
# lengths past a table
# ---------------------------------------------------------------------------------------------------


def test_learned_table_past_its_end():
    model = hf_posenc.patch_model(gpt2(), "learned")
    with pytest.raises(ValueError, match=r"position 64 is outside the learned table of 64 positions \(0 .. 63"):
        model(make_ids(1, 65))
    with pytest.raises(ValueError, match=r"position -2 is outside the learned table"):
        model(make_ids(1, 4), position_ids=torch.arange(4)[None] - 2)


def test_learned_table_past_its_end_during_decoding():
    from transformers import DynamicCache

    model = hf_posenc.patch_model(llama(), "learned", max_positions=8)
    past = DynamicCache(config=model.config)
    ids = make_ids(1, 9)
    with torch.no_grad():
        model(ids[:, :8], **with_cache(past))
        with pytest.raises(ValueError, match=r"position 8 is outside the learned table of 8 positions"):
            model(ids[:, 8:], **with_cache(past))


def test_learned_on_vit_at_another_image_size():
    model = hf_posenc.patch_model(vit(), "learned")
    with pytest.raises(ValueError, match=r"doesn't match model.*only with interpolate_pos_encoding=True"):
        model(pixel_values=make_pixels(1, 48, 32))


@pytest.mark.parametrize(
    "encoding, params",
    [("t5", {"num_buckets": 8, "max_distance": 16}), ("shaw", {"max_relative_position": 2}), ("cope", {"npos_max": 4}),
     ("fope", {"train_length": 8}), ("liere", {})],
    ids=["t5", "shaw", "cope", "fope", "liere"],
)
def test_tables_that_clip_run_past_their_size(encoding, params):
    """Bucketed, clipped or normalised tables are not bounded by their size: 80 tokens (past t5's max_distance,
    shaw's clip, cope's npos_max, fope's L_train, liere's maximum position) run, finite, and causally: the first 60
    positions (past every table's size too) give the logits of the 60-token input."""
    model = hf_posenc.patch_model(llama(), encoding, **params)
    ids = make_ids(2, 80)
    with torch.no_grad():
        out = model(ids).logits
        prefix = model(ids[:, :60]).logits
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[:, :60], prefix, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------------
# tensors of the wrong dtype or shape
# ---------------------------------------------------------------------------------------------------


TEXT_INPUTS = [
    ("input_ids-float", lambda: dict(input_ids=make_ids(1, 5).float()), TypeError,
     r"input_ids must hold integer token ids \(torch.long or torch.int\), got torch.float32"),
    ("input_ids-bool", lambda: dict(input_ids=make_ids(1, 5) > 50), TypeError, r"integer token ids.*got torch.bool"),
    ("input_ids-out-of-vocab", lambda: dict(input_ids=make_ids(1, 5) + 1000), ValueError,
     r"input_ids hold the token id 10\d\d, outside the embedding table \(ids 0 .. 96\)"),
    ("input_ids-negative", lambda: dict(input_ids=make_ids(1, 5) - 50), ValueError, r"token id -\d+, outside"),
    ("position_ids-float", lambda: dict(input_ids=make_ids(1, 5), position_ids=torch.arange(5.0)[None]), TypeError,
     r"position_ids must be an integer tensor \(torch.long\) of logical positions, got torch.float32"),
    ("position_ids-too-long", lambda: dict(input_ids=make_ids(1, 5), position_ids=torch.arange(6)[None]), ValueError,
     r"position_ids must have shape \(1, 5\) for 5 new tokens, got \(1, 6\)"),
    ("position_ids-wrong-batch", lambda: dict(input_ids=make_ids(2, 5), position_ids=torch.arange(5).repeat(3, 1)),
     ValueError, r"position_ids must have shape \(1 or 2, 5\).*got \(3, 5\)"),
    ("inputs_embeds-int", lambda: dict(inputs_embeds=torch.ones(1, 5, 32, dtype=torch.long)), TypeError,
     r"inputs_embeds must be a floating-point tensor, got torch.int64"),
    ("inputs_embeds-width", lambda: dict(inputs_embeds=torch.randn(1, 5, 31)), ValueError,
     r"inputs_embeds must have shape \(batch, length, hidden_size=32\), got \(1, 5, 31\)"),
    ("inputs_embeds-dtype", lambda: dict(inputs_embeds=torch.randn(1, 5, 32, dtype=torch.float64)), TypeError,
     r"inputs_embeds are torch.float64 but the model is torch.float32; cast them"),
]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("case, inputs, exc, pattern", TEXT_INPUTS, ids=[c[0] for c in TEXT_INPUTS])
def test_text_inputs_of_the_wrong_dtype_or_shape(family, case, inputs, exc, pattern):
    model = hf_posenc.patch_model(llama() if family == "llama" else gpt2(), "alibi")
    with pytest.raises(exc, match=pattern) as info:
        model(**inputs())
    check_error(info)


@pytest.mark.parametrize("shape", [(5,), (1, 1, 5)], ids=["1d", "3d"])
def test_llama_input_ids_must_be_two_dimensional(shape):
    """(GPT-2 flattens the leading dims of its input_ids itself, as transformers does.)"""
    model = hf_posenc.patch_model(llama(), "rope")
    with pytest.raises(ValueError, match=r"input_ids must have shape \(batch, length\), got " + re.escape(str(shape))):
        model(make_ids(1, 5).reshape(shape))


def test_bf16_model_with_autocast_accepts_float32_embeds():
    """The dtype check stands aside under autocast (mixed precision), and the float32 embeddings give what the
    same embeddings rounded to bfloat16 give without autocast."""
    model = hf_posenc.patch_model(llama(), "alibi").to(torch.bfloat16)
    embeds = torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(inputs_embeds=embeds).logits
        want = model(inputs_embeds=embeds.bfloat16()).logits
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), want.float(), rtol=0, atol=2e-2 * want.abs().max().item())


@pytest.mark.parametrize(
    "pixels, pattern",
    [
        (lambda: make_pixels(1)[0], r"pixel_values must have shape \(batch, channels, height, width\), got \(3, 32, 32\)"),
        (lambda: torch.randn(1, 3, 36, 32), r"image size 36x32 is not a multiple of the patch size 8x8"),
        (lambda: torch.randn(1, 3, 4, 4), r"image size 4x4 is not a multiple of the patch size 8x8"),
        (lambda: torch.randn(1, 1, 32, 32), r"channel dimension of the pixel values match.*Expected 3 but got 1"),
    ],
    ids=["3d", "not-a-multiple", "smaller-than-a-patch", "channels"],
)
def test_vit_pixel_values_of_the_wrong_shape(pixels, pattern):
    model = hf_posenc.patch_model(vit(), "alibi")
    with pytest.raises(ValueError, match=pattern):
        model(pixel_values=pixels())


def test_vit_integer_pixel_values_are_cast_as_transformers_does():
    """Not an error: transformers casts pixel_values to the patch embedding's dtype, and so does the patch."""
    model = hf_posenc.patch_model(vit(), "alibi")
    pixels = (make_pixels(1) * 10).round()
    with torch.no_grad():
        assert torch.equal(model(pixel_values=pixels.long()).logits, model(pixel_values=pixels).logits)


# ---------------------------------------------------------------------------------------------------
# checkpoints
# ---------------------------------------------------------------------------------------------------


def save(tmp_path: Path, encoding: str = "t5", family: str = "llama", **params) -> torch.nn.Module:
    model = hf_posenc.patch_model({"llama": llama, "gpt2": gpt2, "vit": vit}[family](), encoding, **params)
    model.save_pretrained(tmp_path)
    return model


def edit_weights(path: Path, fn) -> None:
    f = path / "model.safetensors"
    save_file(fn(load_file(f)), f, metadata={"format": "pt"})


def edit_config(path: Path, fn) -> None:
    f = path / "config.json"
    data = json.loads(f.read_text())
    fn(data)
    f.write_text(json.dumps(data))


@pytest.fixture
def no_unpickling(monkeypatch):
    """torch.load and pickle.load raise: nothing may unpickle a checkpoint."""

    def refuse(*args, **kwargs):
        raise AssertionError("a checkpoint was unpickled")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)


def test_only_pickled_weights_are_refused(tmp_path, no_unpickling):
    save(tmp_path, "alibi")
    state = load_file(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors").unlink()
    with open(tmp_path / "pytorch_model.bin", "wb") as f:
        pickle.dump({k: v.numpy() for k, v in state.items()}, f)
    with pytest.raises(ValueError, match=r"holds no model.safetensors.*safetensors checkpoints only; found pytorch_model.bin, "
                                         r"which hf_posenc never loads"):
        hf_posenc.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"use_safetensors=False: hf_posenc loads safetensors checkpoints only"):
        hf_posenc.from_pretrained(tmp_path, use_safetensors=False)


def test_use_safetensors_false_is_refused_even_with_safetensors(tmp_path, no_unpickling):
    save(tmp_path, "alibi")
    with pytest.raises(ValueError, match=r"use_safetensors=False"):
        hf_posenc.from_pretrained(tmp_path, use_safetensors=False)


def test_safetensors_and_a_pickle_side_by_side_load_the_safetensors(tmp_path, no_unpickling):
    model = save(tmp_path, "alibi")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not even a pickle")
    loaded = hf_posenc.from_pretrained(tmp_path)
    with torch.no_grad():
        assert torch.equal(loaded(make_ids(1, 5)).logits, model(make_ids(1, 5)).logits)


def test_missing_shard_is_named(tmp_path):
    model = hf_posenc.patch_model(llama(), "t5")
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(ValueError, match=rf"shards named in model.safetensors.index.json are missing: \['{shard.name}'\]"):
        hf_posenc.from_pretrained(tmp_path)


ENCODING_WEIGHTS = [
    ("missing", lambda s: {k: v for k, v in s.items() if "posenc" not in k}, r"missing \['table'\], unexpected \[\]"),
    ("misshapen", lambda s: {k: (v[:5] if "posenc" in k else v) for k, v in s.items()},
     r"'table' has shape \(5, 4\) in the checkpoint, \(32, 4\) expected"),
    ("extra", lambda s: {**s, "model.posenc.from_the_future": torch.zeros(3)}, r"missing \[\], unexpected \['from_the_future'\]"),
    ("integer", lambda s: {k: (v.to(torch.int32) if "posenc" in k else v) for k, v in s.items()},
     r"'table' is torch.int32 in the checkpoint, a floating-point tensor expected"),
]


@pytest.mark.parametrize("case, edit, pattern", ENCODING_WEIGHTS, ids=[c[0] for c in ENCODING_WEIGHTS])
def test_encoding_weights_that_do_not_match_the_config(tmp_path, case, edit, pattern):
    save(tmp_path, "t5")
    edit_weights(tmp_path, edit)
    with pytest.raises(ValueError, match=r"the encoding weights do not match 't5' as its config describes it.*" + pattern):
        hf_posenc.from_pretrained(tmp_path)


MODEL_WEIGHTS = [
    ("missing", lambda s: {k: v for k, v in s.items() if k != "model.layers.0.self_attn.q_proj.weight"},
     r"missing \['model.layers.0.self_attn.q_proj.weight'\]$"),
    ("misshapen", lambda s: {k: (v[:4] if k == "model.layers.0.self_attn.q_proj.weight" else v) for k, v in s.items()},
     r"mismatched \['model.layers.0.self_attn.q_proj.weight': \(4, 32\) in the checkpoint, \(32, 32\) in the model\]"),
]


@pytest.mark.parametrize("case, edit, pattern", MODEL_WEIGHTS, ids=[c[0] for c in MODEL_WEIGHTS])
def test_model_weights_that_do_not_match_the_config(tmp_path, case, edit, pattern):
    """transformers' own mismatch error points at a report that hf_posenc's quiet loading hides: the keys and
    shapes are in the ValueError instead."""
    save(tmp_path, "t5")
    edit_weights(tmp_path, edit)
    with pytest.raises(ValueError, match=r"the checkpoint does not match LlamaForCausalLM as its config describes it: " + pattern):
        hf_posenc.from_pretrained(tmp_path)


def test_a_failed_load_leaks_no_half_loaded_model(tmp_path, monkeypatch):
    """from_pretrained raises before returning anything, and the model it had built and patched is gone: no
    frame of the traceback (which pytest keeps, as an interactive session keeps sys.last_traceback) holds it."""
    import hf_posenc.api as api

    built = []
    original = api.patch_model

    def spy(model, *args, **kwargs):
        built.append(weakref.ref(model))
        return original(model, *args, **kwargs)

    monkeypatch.setattr(api, "patch_model", spy)
    save(tmp_path, "t5")
    edit_weights(tmp_path, lambda s: {k: (v[:5] if "posenc" in k else v) for k, v in s.items()})
    with pytest.raises(ValueError, match="has shape") as info:
        hf_posenc.from_pretrained(tmp_path)
    assert built, "the model was never patched: the failure came too early to test the leak"
    gc.collect()
    assert built[0]() is None, "the half-loaded model is still alive after from_pretrained raised"
    assert info.value is not None


CONFIGS = [
    ("unknown-encoding", lambda d: d.__setitem__("position_encoding", {"name": "from_the_future"}), ValueError,
     r"cannot be used by this hf_posenc: unknown position encoding 'from_the_future'; known encodings: alibi"),
    ("not-a-dict", lambda d: d.__setitem__("position_encoding", "t5"), TypeError,
     r"cannot be used by this hf_posenc: position_encoding must be a dict with a 'name' key, got str"),
    ("no-name", lambda d: d.__setitem__("position_encoding", {"num_buckets": 8}), ValueError,
     r"must have a 'name' key"),
    ("bad-value", lambda d: d["position_encoding"].__setitem__("num_buckets", "many"), TypeError,
     r"parameter 'num_buckets' of encoding 't5' must be of type int, got str"),
    ("out-of-range", lambda d: d["position_encoding"].__setitem__("num_buckets", 1), ValueError,
     r"parameter 'num_buckets' of encoding 't5' must be >= 2"),
    ("no-key", lambda d: d.pop("position_encoding"), ValueError, r"not saved from a model patched by hf_posenc"),
    ("unknown-architecture", lambda d: d.__setitem__("architectures", ["FooForBar"]), ValueError,
     r"names architecture 'FooForBar', which transformers does not have"),
    ("unsupported-family", lambda d: d.__setitem__("model_type", "opt"), ValueError, r"unsupported model type"),
]


@pytest.mark.parametrize("case, edit, exc, pattern", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_checkpoint_configs_that_cannot_be_used(tmp_path, case, edit, exc, pattern):
    save(tmp_path, "t5")
    edit_config(tmp_path, edit)
    with pytest.raises(exc, match=pattern) as info:
        hf_posenc.from_pretrained(tmp_path)
    check_error(info)


def test_checkpoint_of_an_encoding_its_family_does_not_support(tmp_path, monkeypatch):
    """Every built-in encoding supports every family; a registered one restricted to text is refused on ViT."""
    import dataclasses

    from hf_posenc import registry

    spec = registry.get_encoding("alibi")
    monkeypatch.setitem(registry._REGISTRY, "alibi", dataclasses.replace(spec, families=("llama", "gpt2")))
    save(tmp_path, "nope", family="vit")
    edit_config(tmp_path, lambda d: d.__setitem__("position_encoding", {"name": "alibi"}))
    with pytest.raises(ValueError, match=r"encoding 'alibi' does not support vit; it supports: llama, gpt2"):
        hf_posenc.from_pretrained(tmp_path)


def test_config_key_naming_an_unknown_encoding_when_patching():
    model = llama()
    model.config.position_encoding = {"name": "from_the_future"}
    with pytest.raises(ValueError, match=r"unknown position encoding 'from_the_future'"):
        hf_posenc.patch_model(model)


def test_config_key_with_unknown_parameters_warns_when_patching():
    """The config key read by patch_model(model) is a stored config: keys from a newer version warn and are
    dropped (typed by a user into patch_model they raise: test_unknown_parameter_typed_by_a_user_is_an_error)."""
    model = llama()
    model.config.position_encoding = {"name": "t5", "num_buckets": 8, "warp": 2, "zeta": 1}
    with pytest.warns(UserWarning, match=r"parameter\(s\) this version of hf_posenc does not know: 'warp', 'zeta'"):
        hf_posenc.patch_model(model)
    assert model.config.position_encoding == {"name": "t5", "num_buckets": 8, "max_distance": 128, "per_layer": False}


@pytest.mark.parametrize(
    "path, exc, pattern",
    [
        (lambda tmp: tmp / "nowhere", ValueError, r"is not a directory saved by save_pretrained"),
        (lambda tmp: tmp / "config.json", ValueError, r"is not a directory saved by save_pretrained"),
        (lambda tmp: 42, TypeError, r"path must be a local directory \(str or os.PathLike\), got int"),
    ],
    ids=["missing", "a-file", "an-int"],
)
def test_checkpoint_paths(tmp_path, path, exc, pattern):
    save(tmp_path, "alibi")
    with pytest.raises(exc, match=pattern):
        hf_posenc.from_pretrained(path(tmp_path))


def test_checkpoint_without_config(tmp_path):
    save(tmp_path, "alibi")
    (tmp_path / "config.json").unlink()
    with pytest.raises(ValueError, match=r"holds no config.json"):
        hf_posenc.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "cls, exc, pattern",
    [
        (ViTForImageClassification, ValueError, r"model_class ViTForImageClassification takes a ViTConfig, but the "
                                                r"checkpoint's config is a LlamaConfig"),
        ("LlamaForCausalLM", TypeError, r"model_class must be a transformers model class"),
    ],
    ids=["other-family", "a-string"],
)
def test_checkpoint_model_class(tmp_path, cls, exc, pattern):
    save(tmp_path, "alibi")
    with pytest.raises(exc, match=pattern) as info:
        hf_posenc.from_pretrained(tmp_path, model_class=cls)
    check_error(info)


# ---------------------------------------------------------------------------------------------------
# PEFT in the wrong order (the PEFT integration itself is tested in tests/test_ecosystem.py)
# ---------------------------------------------------------------------------------------------------


def test_patching_a_peft_model_names_the_right_order():
    peft = pytest.importorskip("peft")
    wrapped = peft.get_peft_model(llama(), peft.LoraConfig(target_modules=["q_proj"], r=2))
    with pytest.raises(TypeError, match=r"patch_model got a PEFT model.*patch the base model first, then wrap it"):
        hf_posenc.patch_model(wrapped, "alibi")
    with pytest.raises(ValueError, match=r"already holds PEFT layers.*patch the base model first"):
        hf_posenc.patch_model(wrapped.get_base_model(), "alibi")


# ---------------------------------------------------------------------------------------------------
# the memory budget of the O(L^2) references (hf_posenc.memory)
# ---------------------------------------------------------------------------------------------------


def test_reference_over_the_memory_budget_names_what_it_needs(monkeypatch):
    monkeypatch.setenv("HF_POSENC_MEMORY_BUDGET", "100MiB")
    model = hf_posenc.patch_model(llama(max_position_embeddings=4096), "cope")
    with pytest.raises(ReferenceMemoryError, match=r"cope: the PyTorch reference \(attention at B=1, H=4, Lq=2048, "
                                                   r"Lk=2048\) would need about \d+\.\d GiB.*over the memory budget of 100 MiB "
                                                   r"\(HF_POSENC_MEMORY_BUDGET=100MiB\)"):
        with torch.no_grad():  # the probabilities: cope's full-matrix reference (not the tile-wise engine)
            model(make_ids(1, 2048), output_attentions=True)
    monkeypatch.setenv("HF_POSENC_MEMORY_BUDGET", "none")
    with torch.no_grad():
        assert torch.isfinite(model(make_ids(1, 300)).logits).all()


@pytest.mark.parametrize("text", ["lots", "12 parsecs", "-1GiB"])
def test_memory_budget_that_is_not_a_size(monkeypatch, text):
    monkeypatch.setenv("HF_POSENC_MEMORY_BUDGET", text)
    model = hf_posenc.patch_model(llama(max_position_embeddings=4096), "cope")
    with pytest.raises(ValueError, match=r"HF_POSENC_MEMORY_BUDGET=.* is not a size; use e.g. 24GiB"):
        with torch.no_grad():
            model(make_ids(1, 1024), output_attentions=True)


def test_parse_size():
    assert parse_size("24GiB") == 24 * 2**30
    assert parse_size("512 MiB") == 512 * 2**20
    assert parse_size("8e9") == 8 * 10**9
    assert parse_size("16g") == 16 * 10**9
    assert parse_size("none") is None and parse_size("off") is None and parse_size("0") is None


# ---------------------------------------------------------------------------------------------------
# the hf-posenc command and the study's options
# ---------------------------------------------------------------------------------------------------

CLI_CASES = [
    # (argv, pattern of the message on stderr); argparse's own errors name the choices / the expected type
    ([], "the following arguments are required: command"),
    (["train"], r"invalid choice: 'train' \(choose from .*list.*matrix.*study"),
    (["list", "--bogus"], "unrecognized arguments: --bogus"),
    (["study", "--family", "bert"], r"invalid choice: 'bert' \(choose from .*llama.*gpt2.*vit"),
    (["study", "--task", "sorting"], r"invalid choice: 'sorting' \(choose from .*text.*flip-flop"),
    (["study", "--steps", "ten"], "argument --steps: invalid int value: 'ten'"),
    (["study", "--lr", "fast"], "argument --lr: invalid float value: 'fast'"),
    (["study", "--factors"], "argument --factors: expected at least one argument"),
    (["study", "--encodings"], "argument --encodings: expected at least one argument"),
    # the study's own validation: exit status 2, one line naming what is allowed
    (["study", "--steps", "0"], r"--steps must be an integer >= 1, got 0"),
    (["study", "--threads", "0"], r"--threads must be an integer >= 1"),
    (["study", "--eval-tokens", "-5"], r"--eval-tokens must be an integer >= 1"),
    (["study", "--lr", "0"], r"--lr must be > 0"),
    (["study", "--factors", "0.5", "2"], r"--factors must be numbers >= 1"),
    (["study", "--train-len", "3"], r"--train-len must be >= 4 tokens"),
    (["study", "--family", "vit", "--train-len", "10"], r"multiple of the patch size 4"),
    (["study", "--hidden", "64", "--heads", "3"], r"--hidden 64 must be divisible by --heads 3"),
    (["study", "--family", "vit", "--task", "counting"], r"does not fit --family vit; allowed: digits"),
    (["study", "--task", "counting", "--data", "x.txt"], r"--data is the text corpus"),
    (["study", "--encodings", "nosuch"], r"unknown position encoding 'nosuch'.*alibi"),
    (["study", "--encodings", "rope,,alibi"], r"empty name between commas"),
    (["study", "--encodings", "theta=5,rope"], r"has no encoding before it; write name:key=value"),
    (["study", "--encodings", "rope:theta"], r"key=value pairs separated by commas"),
    (["study", "--encodings", "kerple:variant=cubic"], r"variant.*(power|log)"),
    (["study", "--encodings", "rope:nosuch=1"], r"unknown parameter\(s\) 'nosuch' for encoding 'rope'; allowed"),
    (["study", "--encodings", "sba", "--family", "vit", "--device", "tpu"], r"--device 'tpu'.*use auto, cpu, cuda"),
]


@pytest.mark.parametrize("argv,pattern", CLI_CASES, ids=[" ".join(a) or "no-command" for a, _ in CLI_CASES])
def test_cli_flags(argv, pattern, capsys, monkeypatch):
    """Each bad flag: exit status 2 and one message naming what is allowed, no traceback, nothing trained."""
    from hf_posenc.cli import main as cli_main
    from hf_posenc.study import train as T

    monkeypatch.setattr(T, "_train_and_eval", lambda *a, **k: pytest.fail("trained despite a bad option"))
    try:
        rc = cli_main(argv)
    except SystemExit as e:  # argparse
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2, err
    assert re.search(pattern, err), err
    assert "Traceback" not in err


def test_cli_resume_errors(tmp_path, capsys, monkeypatch):
    """--resume without a results.json, with an unreadable one, or with one of another version."""
    from hf_posenc.cli import main as cli_main
    from hf_posenc.study import train as T

    monkeypatch.setattr(T, "_train_and_eval", lambda *a, **k: pytest.fail("trained despite a bad --resume"))
    base = ["study", "--encodings", "nope", "--no-progress", "--resume", "--out"]
    assert cli_main([*base, str(tmp_path / "none")]) == 2
    assert "there is no" in capsys.readouterr().err
    (tmp_path / "results.json").write_text("{not json")
    assert cli_main([*base, str(tmp_path)]) == 2
    assert "cannot read" in capsys.readouterr().err
    (tmp_path / "results.json").write_text(json.dumps({"schema_version": 0}))
    assert cli_main([*base, str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "is not a results.json of this hf_posenc version" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "kwargs,exc,pattern",
    [
        (dict(encodings=5), TypeError, "encodings must be a list of strings"),
        (dict(encodings=["rope", 3]), TypeError, "encodings must be a list of strings"),
        (dict(encodings=[]), ValueError, "give at least one encoding"),
        (dict(resume="yes"), TypeError, "resume must be True or False"),
        (dict(resume=True, out=None), ValueError, "--resume continues the results.json in --out"),
        (dict(steps=2.5), ValueError, "--steps must be an integer >= 1"),
        (dict(family="Llama"), ValueError, "--family must be one of llama, gpt2, vit"),
        (dict(factors=[]), ValueError, "--factors must be numbers >= 1"),
    ],
)
def test_study_config_from_python(kwargs, exc, pattern):
    from hf_posenc.study import StudyConfig

    with pytest.raises(exc, match=pattern) as e:
        StudyConfig(**kwargs).resolved()
    check_error(e)
