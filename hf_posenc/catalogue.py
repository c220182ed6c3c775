"""The encoding catalogue of the documentation site, generated from the registry when the site is built.

`encoding_catalogue` writes one Markdown page: the registered encodings grouped by kind (in the order of
`KIND_ORDER`, then any other kind alphabetically), alphabetical within each kind. For each encoding it gives what
`encoding_facts` finds out, all of it from the registry and the code, never restated by hand:

* the one-line summary and the paper (`register_encoding`'s ``summary`` and ``paper``);
* the formula: the paragraph of the encoding module's docstring that cites the paper, with the formula block that
  follows it, and a link to the whole docstring on the API page;
* every parameter with its type, default, allowed values and help text (the fields of its parameter schema);
* the families it supports (`hf_posenc.registry.supported_families`), and the ones it does not;
* the engines that run it on a CPU and on a CUDA GPU (the encoding class's attention attributes and the table of
  CUDA defaults in ``hf_posenc/kernels/defaults.py``);
* its inert start and whether it composes, found by patching a tiny Llama with the composition
  (``"rope+<term>"`` with ``init="identity"``, or ``"<first>+alibi"``) and reporting what happened.

The options every encoding takes as options of its layers (``window``, ``sink``, ``length_scale``) are listed
once, from `hf_posenc.config.LAYER_OPTIONS` (`layer_options`). The site's build hook (``docs/hooks/catalogue.py``) adds the page
as ``encodings.md``; a new encoding, parameter or option appears there at the next build.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import inspect
import re
from pathlib import Path
from typing import Any

__all__ = ["KIND_ORDER", "encoding_catalogue", "encoding_facts", "formula_excerpt", "layer_options"]

#: The kinds in the order the catalogue shows them (from the outside of the attention to the inside), each with
#: what it changes. A kind not listed here follows, alphabetically, without a description.
KIND_ORDER: dict[str, str] = {
    "absolute": "adds to the token embeddings, once per model, or removes the model's own position signal",
    "q/k transform": "rotates (or otherwise transforms) q and k before the KV cache; the attention is the model's",
    "score bias": "adds a term to the attention logits, a function of the query and key positions",
    "score + value": "adds a term to the logits and one to the values",
    "score mix": "mixes the logits and a position bias across heads with an MLP",
    "data-dependent": "a position signal computed from the tokens themselves (gates, contextual counts)",
    "replaces softmax": "replaces the softmax over the keys",
    "contextual states": "position states carried and updated layer by layer",
}


def _families_text(families: tuple[str, ...]) -> str:
    from .registry import FAMILIES, FAMILY_KINDS

    missing = [f for f in FAMILIES if f not in families]
    if not missing:
        return f"all {len(FAMILIES)}: {', '.join(FAMILIES)}"
    kinds = sorted({FAMILY_KINDS[f] for f in families})
    return (f"{', '.join(families)} (the {' and '.join(kinds)} families); not {', '.join(missing)}"
            if families else "none")


def _engines(cls: type) -> tuple[str, str]:
    """(on a CPU, on a CUDA GPU): which engine runs the encoding by default, from the class's attributes and the
    CUDA defaults table; what ``HF_POSENC_BACKEND`` can force besides."""
    from .encodings.base import PositionEncoding
    from .kernels.attention.terms import FLEX_KINDS
    from .kernels.defaults import cuda_default_backend

    kinds = tuple(getattr(cls, "kernel_kinds", ()))
    own = tuple(getattr(cls, "attention_kernels", ()))
    in_attention = getattr(cls, "has_score_bias", False) or getattr(cls, "custom_attention", False)
    tile = "the tile-wise PyTorch engine (O(L·block) memory)"
    if not in_attention:
        if getattr(cls, "adds_embeddings", False):
            where = "the token embeddings"
        elif cls.rotate is not PositionEncoding.rotate:
            where = "q and k"
        elif getattr(cls, "prepare", None) is not PositionEncoding.prepare:
            where = "q and k (a norm, where its parameters ask for one)"
        else:
            return ("transformers' SDPA; no position term",) * 2
        cpu = f"transformers' SDPA; the encoding acts on {where} in PyTorch"
        if getattr(cls, "uses_rotary_kernel", False):
            return cpu, ("SDPA; rotations by the Triton rotary kernel (block sizes 2, 4 and 8; PyTorch for other "
                         "sizes or without Triton)")
        return cpu, f"SDPA; the encoding acts on {where} in PyTorch"
    if kinds:
        default = cuda_default_backend(kinds)
        names = {"triton": "its Triton kernel", "flex": "FlexAttention", "torch": tile}
        forced = ["`torch` (" + tile.split(" (")[0] + ")"]
        if any(k in FLEX_KINDS for k in kinds):
            forced.append("`flex` (FlexAttention)")
        if default != "triton":
            forced.append("`triton`")
        return tile, (f"{names[default]} (term{'s' if len(kinds) > 1 else ''} {', '.join(f'`{k}`' for k in kinds)}; "
                      f"the tile-wise engine without Triton); `HF_POSENC_BACKEND` can force {' or '.join(forced)}")
    if own:
        cuda = f"its own Triton kernel ({tile.split(' (')[0]} without Triton)"
        note = _float32_note(cls.name)
        return tile, cuda + (f"; {note}" if note else "")
    if cls.name == "cape":
        return tile, f"{tile} (no Triton kernel)"
    return "its own PyTorch attention", "its own PyTorch attention (no fused kernel)"


def _float32_note(name: str) -> str:
    """A documented per-dtype exception of an attention's own kernel on CUDA (float32 CoPE), or ``""``."""
    if name == "cope":
        from .kernels import cope

        if cope.FLOAT32_ON_CUDA:
            return "float32 inputs run the tile-wise engine (the kernel's float32 path failed on an H100)"
    return ""


def _tiny_llama() -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2)).eval()


def _composition(name: str, kind: str, model: Any) -> tuple[str, str]:
    """(inert start, composes), found by patching ``model`` (a tiny Llama, copied) with a composition."""
    from .api import encoding_module
    from .encodings.compose import FIRST_KINDS
    from . import patch_model

    if kind in FIRST_KINDS:
        try:
            patch_model(copy.deepcopy(model), f"{name}+alibi")
            composes = f"yes, as the first part: `{name}+fire`, `{name}+fox`, ..."
        except ValueError as e:
            composes = f"no: {e}"
        return "not applicable: the first part of a composition acts as it does alone", composes
    try:
        patch_model(copy.deepcopy(model), f"rope+{name}")
    except ValueError as e:
        return "none (it does not compose)", f"no: {e}"
    composes = f"yes, as the term: `rope+{name}`"
    try:
        patched = patch_model(copy.deepcopy(model), f"rope+{name}", init="identity")
    except ValueError as e:
        return f"none: {e}", composes
    inert = getattr(encoding_module(patched), "inert", None)
    how = "exact (the term adds zero: the unpatched logits to float32 rounding)" if inert == "exact" else inert
    return f"`init=\"identity\"`: {how}", composes


def _parameters(spec: Any) -> list[dict[str, str]]:
    rows = []
    for f in dataclasses.fields(spec.params):
        meta = f.metadata
        types = meta.get("type")
        types = types if isinstance(types, tuple) else (types,)
        allowed = []
        if meta.get("choices"):
            allowed.append("one of " + ", ".join(f"`{c!r}`" for c in meta["choices"]))
        for key, op in (("gt", ">"), ("ge", ">="), ("le", "<=")):
            if meta.get(key) is not None:
                allowed.append(f"{op} {meta[key]:g}")
        if meta.get("optional"):
            allowed.append("or `None`")
        default = f.default if f.default is not dataclasses.MISSING else None
        rows.append({"name": f.name, "type": " or ".join(t.__name__ for t in types if t is not None),
                     "default": repr(default), "allowed": ", ".join(allowed), "help": meta.get("help", "")})
    return rows


def formula_excerpt(spec: Any) -> str:
    """The part of the encoding module's docstring that states the paper and the formula: the paragraph (or list
    item) that cites ``spec.paper``, and the indented formula block right after it when the paragraph leads into
    one. ``""`` when the docstring does not cite the paper."""
    doc = _module_docstring(spec.cls)
    lines = doc.splitlines()
    hit = next((i for i, line in enumerate(lines) if spec.paper and spec.paper in line), None)
    if hit is None:
        return ""
    bullet = None  # the list item that holds the citation, if any
    for i in range(hit, -1, -1):
        if re.match(r"\s*[*-] ", lines[i]):
            bullet = i
            break
        if not lines[i].strip():
            break
    start = hit
    while start > 0 and lines[start - 1].strip() and (bullet is None or start > bullet):
        start -= 1
    end = hit + 1
    item_indent = len(lines[bullet]) - len(lines[bullet].lstrip()) if bullet is not None else None
    while end < len(lines) and lines[end].strip():
        if bullet is not None and re.match(r"\s*[*-] ", lines[end]) and \
                len(lines[end]) - len(lines[end].lstrip()) <= item_indent:
            break
        end += 1
    excerpt = lines[start:end]
    if bullet is None:  # the formula block the paragraph, or one of the next two, leads into
        for _ in range(3):
            k = end
            while k < len(lines) and not lines[k].strip():
                k += 1
            if k >= len(lines):
                break
            if lines[k].startswith("    "):
                block_end = k
                while block_end < len(lines) and (lines[block_end].startswith("    ") or not lines[block_end].strip()):
                    block_end += 1
                while not lines[block_end - 1].strip():
                    block_end -= 1
                excerpt += [""] + lines[k:block_end]
                break
            following = k
            while following < len(lines) and lines[following].strip() and not lines[following].startswith(" "):
                following += 1
            if not lines[following - 1].rstrip().endswith(":"):
                break  # the next paragraph leads into no formula: the excerpt is the citation alone
            excerpt += [""] + lines[k:following]
            end = following
    return _rst_headings_as_bold("\n".join(excerpt))


def _rst_headings_as_bold(text: str) -> str:
    """A docstring's reStructuredText section titles (a line underlined with ``---`` or ``===``) as bold lines: in
    Markdown the underline would make a heading of the page (and an anchor that may clash with an entry's)."""
    return re.sub(r"^(\S[^\n]*)\n[-=~^]{3,}[ \t]*$", lambda m: f"**{m.group(1)}**", text, flags=re.M)


def _module_docstring(cls: type) -> str:
    source = Path(inspect.getsourcefile(cls) or "")
    if not source.is_file():
        return inspect.getdoc(inspect.getmodule(cls)) or ""
    return ast.get_docstring(ast.parse(source.read_text())) or ""


def encoding_facts(name: str, model: Any | None = None) -> dict[str, Any]:
    """What the catalogue says of encoding ``name``: ``name``, ``kind``, ``summary``, ``paper``, ``module``,
    ``formula`` (`formula_excerpt`), ``parameters`` (one dict per parameter: ``name``, ``type``, ``default``,
    ``allowed``, ``help``), ``families``, ``families_text``, ``engines`` (``cpu``, ``cuda``), ``inert`` and
    ``composes``. ``model``: the tiny Llama the compositions are tried on (built when None)."""
    from .registry import get_encoding

    spec = get_encoding(name)
    cpu, cuda = _engines(spec.cls)
    inert, composes = _composition(name, spec.kind, model if model is not None else _tiny_llama())
    return {
        "name": name, "kind": spec.kind, "summary": spec.summary, "paper": spec.paper,
        "module": spec.cls.__module__, "formula": formula_excerpt(spec), "parameters": _parameters(spec),
        "families": spec.families, "families_text": _families_text(spec.families),
        "engines": {"cpu": cpu, "cuda": cuda}, "inert": inert, "composes": composes,
    }


def layer_options() -> dict[str, str]:
    """The options every encoding takes, as options of its layers (``window``, ``sink``, ``length_scale``), with
    their help text: `hf_posenc.config.LAYER_OPTIONS`."""
    from .config import LAYER_OPTIONS

    return dict(LAYER_OPTIONS)


def _kind_anchor(kind: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", kind.lower()).strip("-")


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def encoding_catalogue(api_page: str = "api/encodings.md") -> str:
    """The catalogue page (Markdown) of every registered encoding; ``api_page``: the page (relative to the
    catalogue) whose anchors ``#<module>`` hold the encodings' full module docstrings."""
    import torch

    from .registry import FAMILIES, list_encodings

    with torch.no_grad():
        model = _tiny_llama()
        facts = [encoding_facts(name, model) for name in list_encodings()]
    kinds = [k for k in KIND_ORDER if any(f["kind"] == k for f in facts)]
    kinds += sorted({f["kind"] for f in facts} - set(kinds))
    out = [
        "# Encodings",
        "",
        f"Every encoding hf_posenc has, {len(facts)} of them, grouped by kind and in alphabetical order within each "
        "kind. This page is generated from the registry when the site is built (`hf_posenc.catalogue`): the "
        "parameters are those the code validates, the families those it patches, the engines those it runs, and "
        "the inert start and compositions what patching a tiny Llama with them gives. The formula is the "
        "paragraph of the encoding's docstring that cites its paper; the whole docstring (details, defaults and "
        "the ViT form) is on the API page, linked from each entry.",
        "",
        "Use one with `hf_posenc.patch_model(model, \"<name>\", **parameters)`; compose a rotary or absolute "
        "encoding with a term as `\"rope+fire\"` ([compositions](compositions.md)). The families: "
        f"{', '.join(f'`{f}`' for f in FAMILIES)} ([model families](families.md)). Every encoding also takes "
        "these options of its layers:",
        "",
        *[f"- `{name}`: {_cell(text)}" for name, text in layer_options().items()],
        "",
        "| kind | what it changes | encodings |",
        "|---|---|---|",
    ]
    for kind in kinds:
        names = ", ".join(f"[`{f['name']}`](#{f['name']})" for f in facts if f["kind"] == kind)
        out.append(f"| [{kind}](#{_kind_anchor(kind)}) | {KIND_ORDER.get(kind, '')} | {names} |")
    for kind in kinds:
        out += ["", f"## {kind} {{#{_kind_anchor(kind)}}}", ""]
        if kind in KIND_ORDER:
            out += [KIND_ORDER[kind][0].upper() + KIND_ORDER[kind][1:] + ".", ""]
        for f in (f for f in facts if f["kind"] == kind):
            out += _entry(f, api_page)
    return "\n".join(out) + "\n"


def _entry(f: dict[str, Any], api_page: str) -> list[str]:
    module_file = f["module"].replace(".", "/") + ".py"
    lines = [f"### `{f['name']}` {{#{f['name']}}}", "", f["summary"][0].upper() + f["summary"][1:] + ".", "",
             "| | |", "|---|---|",
             f"| kind | {f['kind']} |",
             f"| paper | <{f['paper']}> |" if f["paper"].startswith("http") else f"| paper | {_cell(f['paper'])} |",
             f"| families | {_cell(f['families_text'])} |",
             f"| engine on a CPU | {_cell(f['engines']['cpu'])} |",
             f"| engine on a CUDA GPU | {_cell(f['engines']['cuda'])} |",
             f"| inert start | {_cell(f['inert'])} |",
             f"| composes | {_cell(f['composes'])} |", ""]
    if f["parameters"]:
        lines += ["| parameter | type | default | allowed | what it does |", "|---|---|---|---|---|"]
        lines += [f"| `{p['name']}` | {p['type']} | `{p['default']}` | {_cell(p['allowed'])} | {_cell(p['help'])} |"
                  for p in f["parameters"]]
    else:
        lines.append("No parameters of its own (the layer options above apply).")
    lines.append("")
    # hf_posenc's own modules are on the API page; a user's registered encoding is named by its module
    source = f"[`{module_file}`]({api_page}#{f['module']})" if f["module"].startswith("hf_posenc.") else \
        f"`{f['module']}`"
    if f["formula"]:
        lines += [f"From the docstring of {source}:", "", f["formula"], ""]
    else:
        lines += [f"The formula and the paper: the docstring of {source}.", ""]
    return lines
