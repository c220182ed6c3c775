"""The documentation site (mkdocs.yml, docs/) and the README agree with the files and the package.

``make docs`` (mkdocs build --strict) checks links and anchors inside the site; these tests check, without
mkdocs, what a new file can break: every page of the navigation exists, every encoding module has its API
entry, and every link from the README into docs/ points at a page."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def _nav_pages(nav) -> list[str]:
    pages: list[str] = []
    for item in nav:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


#: pages that the build hooks generate (docs/hooks/): in the navigation, not on disk.
GENERATED = {"encodings.md"}


def test_every_page_in_the_nav_exists_and_every_page_is_in_the_nav():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    pages = _nav_pages(config["nav"])
    docs = ROOT / config["docs_dir"]
    assert [p for p in pages if not (docs / p).is_file() and p not in GENERATED] == []
    assert sorted([str(p.relative_to(docs)) for p in docs.rglob("*.md")] + sorted(GENERATED)) == sorted(pages)


def test_every_encoding_module_has_an_api_entry():
    listed = set(re.findall(r"^::: hf_posenc\.encodings\.(\w+)", (ROOT / "docs/api/encodings.md").read_text(), re.M))
    modules = {p.stem for p in (ROOT / "hf_posenc/encodings").glob("*.py") if p.stem != "__init__"}
    assert modules - listed == set(), "add a '::: hf_posenc.encodings.<module>' entry to docs/api/encodings.md"


def test_readme_links_into_docs_point_at_pages():
    links = re.findall(r"\]\((docs/[^)#]+)(?:#[^)]*)?\)", (ROOT / "README.md").read_text())
    assert links and [link for link in links if not (ROOT / link).is_file()] == []
