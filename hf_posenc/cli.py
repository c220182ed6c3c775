"""The ``hf-posenc`` command: ``hf-posenc list``, ``hf-posenc matrix``, ``hf-posenc study`` (in ``study/``),
``hf-posenc show`` (in ``show.py``), ``hf-posenc doctor`` (in ``diagnostics/``) and ``hf-posenc export``.

``hf-posenc --import MODULE ...`` (repeatable; or ``HF_POSENC_IMPORT=MODULE[,MODULE]``) imports a module first, a
dotted name or a ``.py`` file: one that registers its own terms and encodings (``hf_posenc.register_term``,
``register_encoding``), which every command then takes (``list``, ``doctor``'s cases, ``study``)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import os
import sys
from pathlib import Path

from . import list_encodings, support_matrix
from .config import LAYER_OPTIONS
from .registry import get_encoding


def _cmd_list(args: argparse.Namespace) -> int:
    for name in list_encodings():
        spec = get_encoding(name)
        print(f"{name:12s} {spec.kind:14s} {spec.summary}")
        if args.verbose:
            for f in dataclasses.fields(spec.params):
                print(f"    {f.name} = {f.default!r}: {f.metadata['help']}")
    if args.verbose:
        print("\nEvery encoding also takes:")
        for option, text in LAYER_OPTIONS.items():
            print(f"    {option} = None: {text}")
        print("A plan (a list of encodings, one per layer, repeated over the depth) is given to patch_model or "
              "the config key as a list, e.g. ['rope', 'rope', 'rope', 'nope'].")
        from .kernels.attention.terms import TERMS

        print("\nPosition terms (hf_posenc.list_terms(); the engines take every one):")
        for kind, term in TERMS.items():
            print(f"    {kind:12s} {term.form:9s} {term.formula}")
    return 0


def _cmd_matrix(args: argparse.Namespace) -> int:
    print(support_matrix())
    return 0


def _cmd_study(args: argparse.Namespace) -> int:
    from . import study

    return study.main(args)


def _cmd_show(args: argparse.Namespace) -> int:
    from . import show

    return show.main(args)


def _cmd_doctor(args: argparse.Namespace) -> int:
    from . import diagnostics

    return diagnostics.run_cli(args)


EXPORT_DESCRIPTION = """\
Write a checkpoint saved from a patched model (hf_posenc's save_pretrained) as a plain transformers checkpoint of
the stock architecture that computes the same function, with its tokenizer: a plan of rope and nope layers with
sliding windows as SmolLM3, rope with scaling as the family's own rope_parameters, rope with one window on every
layer as Mistral, learned on GPT-2 as GPT-2 (the table: docs/export.md). AutoModelForCausalLM loads OUT without
hf_posenc. Exit status 2, with the part that has no stock equivalent and the nearest recipe that exports, when
there is none."""


def _cmd_export(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from .api import from_pretrained
    from .export import export_native, tokenizer_source

    try:
        dtype = "auto" if args.dtype == "auto" else getattr(torch, args.dtype)
        model = from_pretrained(args.checkpoint, dtype=dtype)
        tokenizer = args.tokenizer if args.tokenizer is not None else tokenizer_source(model)
        target = export_native(model, args.out, tokenizer=tokenizer, check=not args.no_check)
    except ValueError as e:
        print(f"hf-posenc export: error: {e}", file=sys.stderr)
        return 2
    keys = target.route.keys.replace("`", "")
    print(f"wrote {Path(args.out)}: {target.architecture} ({keys}); tokenizer "
          f"{'copied from ' + str(tokenizer) if tokenizer is not None else 'not found: none written'}")
    return 0


#: the environment variable that lists modules to import first (comma-separated), as ``--import`` does; ``--import``
#: adds its modules to it, so that a command that re-runs itself in a child process imports them there too.
IMPORT_ENV = "HF_POSENC_IMPORT"


def import_user_module(name: str) -> object:
    """Import ``name``: a dotted module name, or the path of a ``.py`` file (imported under its stem, so that a
    checkpoint saved with its encodings records that name). Returns the module.

    Raises:
        ValueError: the module cannot be found (the message names it).
    """
    path = Path(name)
    if name.endswith(".py") or path.is_file():
        if not path.is_file():
            raise ValueError(f"--import {name}: no such file")
        stem = path.stem
        if stem in sys.modules:
            return sys.modules[stem]
        spec = importlib.util.spec_from_file_location(stem, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[stem] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(stem, None)
            raise
        return module
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        raise ValueError(f"--import {name}: {exc}") from None


def _import_first(argv: list[str]) -> None:
    """The modules of ``--import`` (anywhere in ``argv``) and of ``HF_POSENC_IMPORT``, imported before the parser is
    built (their terms then appear in ``doctor --cases``); ``HF_POSENC_IMPORT`` gains the ``--import`` ones."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--import", dest="imports", action="append", default=[])
    known, _ = pre.parse_known_args(argv)
    from_env = [m for m in os.environ.get(IMPORT_ENV, "").split(",") if m.strip()]
    for name in dict.fromkeys([*from_env, *known.imports]):
        import_user_module(name.strip())
    if known.imports:
        os.environ[IMPORT_ENV] = ",".join(dict.fromkeys([*from_env, *known.imports]))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        _import_first(argv)
    except ValueError as exc:
        print(f"hf-posenc: {exc}", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog="hf-posenc", description="Position encodings for Hugging Face models")
    parser.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                        help=f"import MODULE first (a dotted name or a .py file; repeatable; also {IMPORT_ENV}): one "
                             "that registers its own terms and encodings")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("list", help="list the registered encodings")
    p.add_argument("-v", "--verbose", action="store_true", help="show every parameter with its help text")
    p.set_defaults(func=_cmd_list)
    p = sub.add_parser("matrix", help="print the support matrix (markdown)")
    p.set_defaults(func=_cmd_matrix)
    from .study import DESCRIPTION, add_arguments

    p = sub.add_parser(
        "study", help="train one small model per encoding, evaluate at 1x-8x the training length",
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    p.set_defaults(func=_cmd_study)
    from . import show

    p = sub.add_parser(
        "show", help="write a picture of what each layer's position encoding does (profile.json, profile.png)",
        description=show.DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    show.add_arguments(p)
    p.set_defaults(func=_cmd_show)
    from . import diagnostics

    p = sub.add_parser(
        "doctor", help="check every engine on this machine against the reference; which backend each encoding uses",
        description=diagnostics.DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    diagnostics.add_arguments(p)
    p.set_defaults(func=_cmd_doctor)
    p = sub.add_parser(
        "export", help="write a patched checkpoint as the stock transformers architecture it equals (no hf_posenc)",
        description=EXPORT_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="a directory saved from a patched model")
    p.add_argument("out", metavar="OUT", help="the output directory")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="where the tokenizer is (default: CHECKPOINT, when it holds one)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="load (and write) the weights in this dtype (default: the checkpoint's own); the check before "
                   "writing runs on float32 models only")
    p.add_argument("--no-check", action="store_true",
                   help="skip comparing the exported model's output with the patched model's before writing")
    p.set_defaults(func=_cmd_export)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
