"""Docstrings are Markdown (they render on the MkDocs site through mkdocstrings and in ``hf-posenc ... --help``):
no Sphinx roles such as :func:`x`, which both would show raw."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROLE = re.compile(r":(?:py:)?(?:func|class|mod|meth|attr|data|obj|exc|const|ref|term):`")


def test_no_sphinx_roles_in_the_package_examples_or_benchmarks():
    found = [f"{path.relative_to(ROOT)}:{n}" for folder in ("hf_posenc", "examples", "benchmarks")
             for path in sorted((ROOT / folder).rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if ROLE.search(line)]
    assert found == [], "write `name` (a Markdown code span) instead of a Sphinx role"


@pytest.mark.parametrize("command", [[], ["list"], ["matrix"], ["study"], ["show"], ["doctor"]])
def test_no_sphinx_roles_in_help(command, capsys):
    from hf_posenc.cli import main

    with pytest.raises(SystemExit):
        main([*command, "--help"])
    out = capsys.readouterr().out
    assert "usage: hf-posenc" in out and not ROLE.search(out)
