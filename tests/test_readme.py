"""The README is documentation that cannot drift from the code: at most 250 lines; its counts of encodings and
families, the names it lists, and the exceptions it states are checked against the registry; no history, issue
numbers or files that are not in the repository; its Python snippets run; every ``make`` target it names exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import hf_posenc
from hf_posenc.registry import FAMILIES, get_encoding

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
WORDS = {2: "two", 3: "three", 10: "ten", 12: "twelve", 22: "22"}


def _section(title: str) -> str:
    return README.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def _intro() -> str:
    """The text before the first section, its line breaks as spaces."""
    return " ".join(README.split("\n## ", 1)[0].split())


def test_at_most_250_lines():
    assert len(README.splitlines()) <= 250


def test_the_intro_counts_and_names_every_encoding_and_family():
    intro = _intro()
    names = hf_posenc.list_encodings()
    assert f"It has {len(names)} encodings" in intro
    listed = set(re.findall(r"`([a-z0-9_]+)`", intro.split("It patches")[0]))
    assert listed == set(names), "the intro names every registered encoding, and nothing else"
    count = WORDS.get(len(FAMILIES), str(len(FAMILIES)))
    assert f"patches {count} model families" in intro
    model_types = re.search(r"\(`model_type` (.*?)\)", intro, re.S).group(1)
    assert set(re.findall(r"`([a-z0-9_]+)`", model_types)) == set(FAMILIES)


def test_the_family_exceptions_are_the_registry_s():
    """Every encoding that lacks a family is named with the families it lacks, in the intro and the exceptions;
    no claim that every encoding runs everywhere."""
    exceptions = README.split("--8<-- [start:exceptions]", 1)[1].split("--8<-- [end:exceptions]", 1)[0]
    families_line = next(line for line in exceptions.splitlines() if line.startswith("- **Families**"))
    lacking = {n: [f for f in FAMILIES if f not in get_encoding(n).families] for n in hf_posenc.list_encodings()}
    lacking = {n: missing for n, missing in lacking.items() if missing}
    assert set(re.findall(r"`([a-z0-9_]+)`", families_line)) == set(lacking) | {f for m in lacking.values() for f in m}
    intro = _intro()
    for name, missing in lacking.items():
        assert f"except `{name}`" in intro and all(f"`{f}`" in intro.split(f"except `{name}`")[1][:200]
                                                   for f in missing)
    assert "every one on every family" not in README and "Every encoding runs on every family." not in README


def test_the_scaling_exception_names_every_encoding_with_a_scaling_parameter():
    line = next(line for line in README.splitlines() if line.startswith("- **`scaling`**"))
    with_scaling = {n for n in hf_posenc.list_encodings() if "scaling" in get_encoding(n).param_names()}
    assert set(re.findall(r"`([a-z0-9_]+)`", line.split("parameter of", 1)[1])) == with_scaling


def test_no_history_issue_numbers_or_missing_files():
    assert "DESIGN.md" not in README
    assert not re.search(r"\bissues? \d+", README, re.I)
    for phrase in ("an hour earlier", "earlier session", "not yet rerun", "previous default", "fixed since"):
        assert phrase not in README
    for path in re.findall(r"`((?:examples|benchmarks|docs|hf_posenc|tests)/[\w./-]+\.\w+)`", README):
        assert (ROOT / path).exists(), path
    for path in re.findall(r"\]\(((?:docs|examples|benchmarks)/[^)#]+)", README):
        assert (ROOT / path).exists(), path


def test_every_make_target_named_exists():
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][a-z0-9-]*):", makefile, re.M))
    named = set(re.findall(r"`make ([a-z][a-z0-9-]*)", README))
    assert named and named <= targets, named - targets


def test_the_long_context_spot_is_marked_in_the_conversion_section():
    section = _section("Converting a pretrained model")
    assert "<!-- long-context:start" in section and "<!-- long-context:end -->" in section
    assert "| rope+fox / rope+fire, `init=identity` |" in section  # the conversion table stays


def test_the_python_snippets_run(tmp_path, monkeypatch):
    """The README's Python blocks, in order, in one namespace (the later ones use the earlier ones' model)."""
    monkeypatch.chdir(tmp_path)
    blocks = re.findall(r"```python\n(.*?)```", README, re.S)
    assert len(blocks) >= 3
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102 - the README's own examples
    assert namespace["model"].config.position_encoding["name"] == "alibi"
    assert (tmp_path / "out/alibi/config.json").is_file()


@pytest.mark.parametrize("page", ["docs/index.md", "docs/loading.md"])
def test_pages_that_include_the_readme_find_their_sections(page):
    for name in re.findall(r'--8<-- "README\.md:([\w-]+)"', (ROOT / page).read_text()):
        assert f"--8<-- [start:{name}]" in README and f"--8<-- [end:{name}]" in README


def test_the_demo_is_described_as_the_default_study():
    from hf_posenc.study import DEFAULT_ENCODINGS

    section = " ".join(_section("From a fresh clone: two commands").split())
    plain = [e for e in DEFAULT_ENCODINGS if e.isidentifier()]
    assert f"trains {WORDS[len(DEFAULT_ENCODINGS)]} byte-level Llamas" in section
    assert f"one model per encoding (`{' '.join(plain)}`) and {WORDS[len(DEFAULT_ENCODINGS) - len(plain)]} recipes" \
        in section
