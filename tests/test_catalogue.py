"""The encoding catalogue of the documentation site (docs/hooks/catalogue.py adds it as encodings.md at every
build): generated from the registry, so every encoding, parameter, family, engine, inert start and composition it
states is what the code does; grouped by kind, alphabetical within each kind."""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import hf_posenc
from hf_posenc.catalogue import KIND_ORDER, encoding_catalogue, encoding_facts
from hf_posenc.registry import FAMILIES, get_encoding

ROOT = Path(__file__).resolve().parents[1]
ROLE = re.compile(r":(?:func|class|mod|meth|attr|data|obj|exc|ref):`")


@pytest.fixture(scope="module")
def page() -> str:
    return encoding_catalogue()


def _entries(page: str) -> list[tuple[str, str]]:
    """(kind, encoding) of every entry, in page order."""
    out, kind = [], None
    for line in page.splitlines():
        if m := re.match(r"## (.+?) \{#", line):
            kind = m.group(1)
        elif m := re.match(r"### `([^`]+)`", line):
            out.append((kind, m.group(1)))
    return out


def test_every_encoding_once_under_its_kind_alphabetical_within_each_kind(page):
    entries = _entries(page)
    assert sorted(name for _, name in entries) == hf_posenc.list_encodings()
    assert all(get_encoding(name).kind == kind for kind, name in entries)
    kinds = list(dict.fromkeys(kind for kind, _ in entries))
    assert kinds == [k for k in KIND_ORDER if k in kinds] + sorted(set(kinds) - set(KIND_ORDER))
    for kind in kinds:
        names = [name for k, name in entries if k == kind]
        assert names == sorted(names), kind
    assert f"{len(hf_posenc.list_encodings())} of them" in page


def test_every_parameter_with_its_default_and_help(page):
    for name in hf_posenc.list_encodings():
        section = page.split(f"### `{name}`", 1)[1].split("\n### ", 1)[0]
        for field in dataclasses.fields(get_encoding(name).params):
            row = next(line for line in section.splitlines() if line.startswith(f"| `{field.name}` |"))
            assert f"`{field.default!r}`" in row
            assert " ".join(field.metadata["help"].split()).replace("|", "\\|") in row
        assert "paper | <" + get_encoding(name).paper in section
        assert "From the docstring of" in section or "the docstring of" in section


def test_families_engines_inert_start_and_composition_are_what_the_code_does():
    facts = {name: encoding_facts(name) for name in ("alibi", "fire", "fox", "fox_pro", "rope", "xpos", "nope")}
    assert facts["alibi"]["families_text"].startswith(f"all {len(FAMILIES)}")
    assert "not vit, bert" in facts["xpos"]["families_text"]
    assert facts["alibi"]["engines"]["cpu"].startswith("the tile-wise PyTorch engine")
    assert "Triton kernel" in facts["alibi"]["engines"]["cuda"]
    assert facts["rope"]["engines"]["cpu"].startswith("transformers' SDPA")
    assert facts["fire"]["inert"].startswith('`init="identity"`: exact')
    assert "4.54e-05 per token" in facts["fox"]["inert"]
    assert facts["alibi"]["inert"].startswith("none: 'alibi' has no inert start")
    assert facts["fox_pro"]["composes"].startswith("no: 'rope+fox_pro': 'fox_pro' cannot be composed")
    assert facts["rope"]["composes"].startswith("yes, as the first part")
    assert facts["fire"]["composes"] == "yes, as the term: `rope+fire`"
    assert "B_h(i, j) = -m_h * |i - j|" in facts["alibi"]["formula"]


def test_a_newly_registered_encoding_appears_with_its_parameters():
    from hf_posenc.encodings.alibi import Alibi
    from hf_posenc.registry import _REGISTRY, param, register_encoding

    @dataclasses.dataclass(frozen=True)
    class Params:
        reach: int = param(7, "how far the new bias reaches", type=int, ge=1)

    @register_encoding("zz_new_bias", params=Params, kind="score bias", summary="a test bias", paper="none",
                       families=("llama",))
    class NewBias(Alibi):
        pass

    try:
        page = encoding_catalogue()
        section = page.split("### `zz_new_bias`", 1)[1]
        assert "| `reach` | int | `7` | >= 1 | how far the new bias reaches |" in section
        assert _entries(page)[-1] != ("score bias", "zz_new_bias")  # sorted into its kind, not appended
    finally:
        _REGISTRY.pop("zz_new_bias", None)


def test_no_sphinx_roles_and_no_setext_headings_from_docstrings(page):
    assert not ROLE.search(page)
    assert not re.search(r"^[-=]{3,}\s*$", page, re.M)  # an RST underline would make a heading of the page


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("mkdocs") is None and subprocess.run(
    [sys.executable, "-c", "import mkdocs"], capture_output=True).returncode != 0, reason="needs the docs extra")
def test_mkdocs_build_strict_with_the_generated_catalogue(tmp_path):
    env = {"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    html = (tmp_path / "encodings" / "index.html").read_text()
    assert all(f'id="{name}"' in html for name in hf_posenc.list_encodings())
    assert not any(ROLE.search(p.read_text()) for p in tmp_path.rglob("*.html"))


def test_the_layer_options_are_listed_once_from_the_config_module(page, monkeypatch):
    from hf_posenc import config
    from hf_posenc.catalogue import layer_options

    assert list(layer_options()) == list(config.LAYER_OPTIONS) == ["window", "sink", "length_scale", "sink_positions"]
    for option, text in config.LAYER_OPTIONS.items():
        assert f"- `{option}`: {' '.join(text.split())}" in page
    monkeypatch.setitem(config.LAYER_OPTIONS, "new_option", "a new option's help")
    assert layer_options()["new_option"] == "a new option's help"  # a new option appears with its help