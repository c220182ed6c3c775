"""MkDocs hook (mkdocs.yml, ``hooks:``): adds the encoding catalogue, ``encodings.md``, generated from the registry
by `hf_posenc.catalogue.encoding_catalogue` at every build, so that it cannot go stale. The page exists only in the
built site; the navigation names it like any other page."""

from __future__ import annotations

import sys
from pathlib import Path

from mkdocs.structure.files import File, Files

PAGE = "encodings.md"


def on_files(files: Files, config) -> Files:
    """Add the generated catalogue page to the site's files."""
    root = str(Path(config["config_file_path"]).resolve().parent)
    if root not in sys.path:  # the checkout's hf_posenc, also where it is not installed in editable mode
        sys.path.insert(0, root)
    from hf_posenc.catalogue import encoding_catalogue

    files.append(File.generated(config, PAGE, content=encoding_catalogue()))
    return files
