"""The errors a new user meets first: a misspelt encoding name says which one was meant, an unsupported model
family points to how a family is added, and ``hf-posenc doctor --out`` takes a directory as well as a file."""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, OPTConfig, OPTModel

import hf_posenc
from hf_posenc.registry import FAMILIES, did_you_mean, get_encoding


def _llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2)).eval()


@pytest.mark.parametrize("given, meant", [
    ("allibi", "alibi"),      # one letter too many
    ("ALiBi", "alibi"),       # case only
    ("Rope", "rope"),
    ("kerpel", "kerple"),     # transposed letters
    ("fox-pro", "fox_pro"),
    ("sinusoid", "sinusoidal"),
])
def test_a_misspelt_name_says_which_was_meant(given, meant):
    with pytest.raises(ValueError, match=rf"unknown position encoding '{given}' \(did you mean '{meant}'\?\); known "
                                         rf"encodings: .*{meant}"):
        hf_posenc.patch_model(_llama(), given)


def test_a_misspelt_part_of_a_composition_says_which_was_meant():
    with pytest.raises(ValueError, match=r"unknown position encoding 'allibi' \(did you mean 'alibi'\?\)"):
        hf_posenc.patch_model(_llama(), "rope+allibi")


def test_no_suggestion_for_a_name_far_from_every_encoding():
    with pytest.raises(ValueError) as info:
        get_encoding("transformer")
    assert "did you mean" not in str(info.value)
    assert did_you_mean("xyz", hf_posenc.list_encodings()) == ""


def test_did_you_mean_prefers_the_case_insensitive_match_then_the_closest():
    assert did_you_mean("T5", ["t5", "tape"]) == " (did you mean 't5'?)"
    assert did_you_mean("cop", ["cope", "cape", "rope"]).startswith(" (did you mean 'cope'")


def test_an_unsupported_family_points_to_adding_a_family():
    opt = OPTModel(OPTConfig(vocab_size=30, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, ffn_dim=64,
                             word_embed_proj_dim=32))
    with pytest.raises(ValueError) as info:
        hf_posenc.patch_model(opt, "alibi")
    message = str(info.value)
    assert f"unsupported model type 'opt'; hf_posenc patches these families: {', '.join(FAMILIES)}." in message
    assert "hf_posenc/patches/" in message and "FAMILY_KINDS" in message
    assert "'Adding a family' in docs/families.md" in message
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs/families.md").read_text()
    assert re.search(r"^## Adding a family$", page, re.M), "the error points at a section that must exist"


def test_a_near_miss_of_a_family_says_which_was_meant():
    from hf_posenc.patches import get_family

    with pytest.raises(ValueError, match=r"unsupported model type 'gemma3' \(did you mean 'gemma3_text'\?\)"):
        get_family("gemma3")


@pytest.mark.parametrize("form", ["existing directory", "trailing slash", "file"])
def test_doctor_out_takes_a_directory_or_a_file(tmp_path, capsys, form):
    from hf_posenc.cli import main
    from hf_posenc.diagnostics import REPORT_NAME

    if form == "existing directory":
        out, expected = str(tmp_path), tmp_path / REPORT_NAME
    elif form == "trailing slash":
        out, expected = str(tmp_path / "new") + "/", tmp_path / "new" / REPORT_NAME
    else:
        out, expected = str(tmp_path / "sub" / "r.json"), tmp_path / "sub" / "r.json"
    code = main(["doctor", "--device", "cpu", "--engines", "tiled", "--cases", "alibi", "--no-timing",
                 "--no-progress", "--out", out])
    assert code == 0
    assert json.loads(expected.read_text())["complete"] is True
    assert f"report written to {expected}" in capsys.readouterr().out


def test_doctor_out_under_a_file_is_a_clear_error(tmp_path, capsys):
    from hf_posenc.cli import main

    blocker = tmp_path / "taken"
    blocker.write_text("")
    code = main(["doctor", "--device", "cpu", "--engines", "tiled", "--cases", "alibi", "--no-timing",
                 "--no-progress", "--out", str(blocker / "r.json")])
    assert code == 2
    assert "is a file, not a directory" in capsys.readouterr().err
