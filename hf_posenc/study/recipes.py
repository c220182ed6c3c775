"""Study entries beyond one encoding: plans, windows, partial rotary, scaled rope, and scaling at evaluation only.

An ``--encodings`` spec (see `hf_posenc.study.train.split_encodings`) is one of:

* ``name`` or ``name:key=value,...``: one encoding; every encoding takes ``window=N``, rope takes
  ``partial_rotary_factor=F`` and ``scaling={'rope_type':'yarn','factor':2.0}`` (a Python literal; no commas
  inside a value on the command line, so write scaling from Python, or use ``eval_scaling``);
* a plan: entries joined by ``/``, each an encoding spec as above, ``name*K`` repeating an entry K times:
  ``rope*3/nope`` (SmolLM3's 3:1), ``rope:window=16*3/nope`` (RNoPE-SWA); repeated over the depth like
  any plan (its length must divide the number of layers); ending in ``/...``, it is repeated over the depth and
  its last repeat cut at the last layer, as SmolLM3's ``no_rope_layers`` pattern is: ``rope*3/nope/...`` on a
  30-layer model is 7 x (rope, rope, rope, nope) + rope, rope (``StudyEntry.to_depth``);
* ``zero_shot=true`` on an entry (on any one entry of a plan) in a conversion study (``--from``): the swapped
  model is evaluated without fine-tuning, like the ``eval_scaling`` baselines;
* ``eval_scaling=TYPE`` on a rope entry (``rope:eval_scaling=yarn``): the model is trained with plain rope and,
  at each evaluation length L longer than the training length T, rope is re-patched with transformers' ``TYPE``
  scaling (``yarn`` or ``linear``, i.e. position interpolation) of factor L / T and
  ``original_max_position_embeddings`` T -- the usual "train short, extend with YaRN" baseline. The model is not
  retrained; at L <= T it is the plain model. The weights of the other entries of a plan are carried over to the
  re-patched model (rope has none; the plan's structure is unchanged). A conversion study's long evaluation
  (``--long-eval``, `hf_posenc.study.long`) runs it once over F x P tokens, with factor F (the long factor) and
  ``original_max_position_embeddings`` P;
* ``eval_factor=X`` beside ``eval_scaling`` fixes the factor at X (a number > 1) wherever the scaling applies,
  instead of L / T (or F): ``rope:eval_scaling=yarn,eval_factor=2`` and ``rope:eval_scaling=yarn,eval_factor=4`` are
  two entries, "YaRN x2" and "YaRN x4", each with its own row. The entry's other parameters pass through to the
  encoding unchanged (``rope:remap=...,eval_scaling=yarn`` keeps ``remap`` when rope is re-patched).

Each entry gets a readable label for the table and the plot (`entry_label`): ``rope×3/nope``,
``rope(window=16)×3/nope``, ``rope + YaRN at eval``, ``rope + YaRN x4 at eval``.
"""

from __future__ import annotations

import ast
import dataclasses
from dataclasses import dataclass
from typing import Any

from ..config import PosEncConfig

__all__ = ["EVAL_SCALINGS", "StudyEntry", "apply_eval_scaling", "entry_label", "parse_study_entry"]

#: scaling types the study can apply at evaluation only (transformers' ``rope_type`` names).
EVAL_SCALINGS = ("yarn", "linear")
_EVAL_NAMES = {"yarn": "YaRN", "linear": "PI"}


#: the last piece of a plan that repeats it over the depth, cutting its last repeat at the last layer
FILL_DEPTH = "..."


@dataclass(frozen=True)
class StudyEntry:
    """One entry of a study: the encoding (one config, or a plan: one config per plan entry), the scaling applied
    at evaluation only (or None), the label shown in the table and the plot, whether a conversion study evaluates
    it without fine-tuning (``zero_shot``), whether its plan fills the depth (``fills_depth``, a plan ending in
    ``/...``), and the fixed factor of its evaluation-time scaling (``eval_factor``; None: the factor follows the
    length)."""

    encoding: PosEncConfig | list[PosEncConfig]
    eval_scaling: str | None
    label: str
    zero_shot: bool = False
    fills_depth: bool = False
    eval_factor: float | None = None

    def to_depth(self, layers: int) -> StudyEntry:
        """A plan that fills the depth as one entry per layer: repeated, the last repeat cut at layer ``layers``
        (itself when the plan does not fill the depth)."""
        if not self.fills_depth:
            return self
        if not isinstance(layers, int) or layers < 1:
            raise ValueError(f"a model depth must be an integer >= 1, got {layers!r}")
        plan = list(self.encoding)
        full = (plan * (layers // len(plan) + 1))[:layers]
        return dataclasses.replace(self, encoding=full, fills_depth=False)

    @property
    def is_plan(self) -> bool:
        return isinstance(self.encoding, list)

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.encoding] if self.is_plan else [self.encoding.name]


def _value(text: str) -> Any:
    lowered = text.strip().lower()
    if lowered in ("true", "false", "none"):
        return {"true": True, "false": False, "none": None}[lowered]
    try:
        return ast.literal_eval(text.strip())
    except (ValueError, SyntaxError):
        return text.strip()


def _parse_one(spec: str, where: str) -> tuple[PosEncConfig, str | None, bool, float | None]:
    """``name`` or ``name:key=value,...`` -> (config, eval_scaling, zero_shot, eval_factor)."""
    name, _, rest = spec.partition(":")
    params: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"--encodings {where!r}: parameters are key=value pairs separated by commas")
        params[key.strip()] = _value(value)
    eval_scaling = params.pop("eval_scaling", None)
    zero_shot = params.pop("zero_shot", False)
    eval_factor = params.pop("eval_factor", None)
    if not isinstance(zero_shot, bool):
        raise ValueError(f"--encodings {where!r}: zero_shot is true or false, got {zero_shot!r}")
    config = PosEncConfig.coerce(name.strip(), **params)
    if eval_scaling is not None:
        if config.name != "rope":
            raise ValueError(f"--encodings {where!r}: eval_scaling applies to rope only, not {config.name!r}")
        if eval_scaling not in EVAL_SCALINGS:
            raise ValueError(
                f"--encodings {where!r}: eval_scaling must be one of {', '.join(EVAL_SCALINGS)}, got {eval_scaling!r}"
            )
        if config.params.get("scaling") is not None:
            raise ValueError(f"--encodings {where!r}: give scaling or eval_scaling, not both")
    if eval_factor is not None:
        if eval_scaling is None:
            raise ValueError(f"--encodings {where!r}: eval_factor is the factor of eval_scaling; give both "
                             "(rope:eval_scaling=yarn,eval_factor=4)")
        if isinstance(eval_factor, bool) or not isinstance(eval_factor, (int, float)) or not eval_factor > 1:
            raise ValueError(f"--encodings {where!r}: eval_factor must be a number > 1, got {eval_factor!r}")
        eval_factor = float(eval_factor)
    return config, eval_scaling, zero_shot, eval_factor


def _short(config: PosEncConfig) -> str:
    """``name`` or ``name(key=value, ...)`` with the parameters that differ from the defaults."""
    defaults = PosEncConfig(config.name).params
    changed = {k: v for k, v in config.params.items() if v != defaults.get(k)}
    changed.update({k: v for k, v in config.layer_options().items() if v is not None})
    if not changed:
        return config.name
    return f"{config.name}(" + ", ".join(f"{k}={v}" for k, v in changed.items()) + ")"


def entry_label(encoding: PosEncConfig | list[PosEncConfig], eval_scaling: str | None = None,
                zero_shot: bool = False, fills_depth: bool = False, eval_factor: float | None = None) -> str:
    """A readable label: runs of a plan's equal entries compressed (``rope×3/nope``), ``/…`` for a plan that fills
    the depth, parameters that differ from the defaults in parentheses, the scaling at evaluation named
    (``rope + YaRN at eval``, with its fixed factor: ``rope + YaRN x4 at eval``), `` zero-shot`` for an entry
    evaluated without fine-tuning."""
    if isinstance(encoding, list):
        runs: list[list[Any]] = []
        for config in encoding:
            text = _short(config)
            if runs and runs[-1][0] == text:
                runs[-1][1] += 1
            else:
                runs.append([text, 1])
        label = "/".join(text if n == 1 else f"{text}×{n}" for text, n in runs)
    else:
        label = _short(encoding)
    if fills_depth:
        label += "/…"
    if eval_scaling is not None:
        factor = "" if eval_factor is None else f" x{eval_factor:g}"
        label += f" + {_EVAL_NAMES.get(eval_scaling, eval_scaling)}{factor} at eval"
    if zero_shot:
        label += " zero-shot"
    return label


def parse_study_entry(spec: str) -> StudyEntry:
    """A ``--encodings`` spec (see the module docstring) -> `StudyEntry`; ``ValueError``/``TypeError``
    naming the spec for a bad one."""
    if "/" not in spec and "*" not in spec.partition(":")[0]:
        config, eval_scaling, zero_shot, factor = _parse_one(spec, spec)
        return StudyEntry(config, eval_scaling, entry_label(config, eval_scaling, zero_shot, eval_factor=factor),
                          zero_shot, eval_factor=factor)
    entries: list[PosEncConfig] = []
    scalings, factors = set(), set()
    zero_shot = fills = False
    pieces = spec.split("/")
    if pieces[-1].strip() == FILL_DEPTH:
        fills = True
        pieces = pieces[:-1]
        if not pieces:
            raise ValueError(f"--encodings {spec!r}: '/...' repeats the plan before it; write e.g. rope*3/nope/...")
    for piece in pieces:
        piece = piece.strip()
        if not piece:
            raise ValueError(f"--encodings {spec!r}: empty plan entry between slashes; write e.g. rope*3/nope")
        if piece == FILL_DEPTH:
            raise ValueError(f"--encodings {spec!r}: '...' may only end a plan (rope*3/nope/...)")
        body, star, count = piece.rpartition("*")
        if star and count.strip().isdigit() and body:
            repeat, piece = int(count), body
            if repeat < 1:
                raise ValueError(f"--encodings {spec!r}: a repeat count must be >= 1, got {repeat}")
        else:
            repeat = 1
        config, eval_scaling, zero, factor = _parse_one(piece, spec)
        scalings.add(eval_scaling)
        factors.add(factor)
        zero_shot |= zero
        entries.extend([config] * repeat)
    scalings.discard(None)
    if len(scalings) > 1:
        raise ValueError(f"--encodings {spec!r}: one eval_scaling per plan, got {sorted(scalings)}")
    eval_scaling = next(iter(scalings), None)
    factors.discard(None)
    if len(factors) > 1:
        raise ValueError(f"--encodings {spec!r}: one eval_factor per plan, got {sorted(factors)}")
    factor = next(iter(factors), None)
    return StudyEntry(entries, eval_scaling, entry_label(entries, eval_scaling, zero_shot, fills, factor), zero_shot,
                      fills, factor)


def _scaled(config: PosEncConfig, eval_scaling: str, train_len: int, length: int,
            factor: float | None = None) -> PosEncConfig:
    if config.name != "rope" or length <= train_len:
        return config
    scaling = {"rope_type": eval_scaling, "factor": length / train_len if factor is None else factor}
    if eval_scaling == "yarn":
        scaling["original_max_position_embeddings"] = train_len
    return config.replace(scaling=scaling)


def apply_eval_scaling(model: Any, entry: StudyEntry, train_len: int, length: int) -> dict[str, Any]:
    """Re-patch ``model`` (trained with ``entry``) for evaluation at ``length``: its rope entries with
    ``entry.eval_scaling`` of factor ``entry.eval_factor``, or length / train_len without one (none at length <=
    train_len), ``original_max_position_embeddings`` train_len. Returns the ``position_encoding`` the evaluation
    ran with."""
    from ..api import encoding_module, patch_model

    if entry.eval_scaling is None:
        raise ValueError("this study entry has no eval_scaling")
    trained = {k: v.clone() for k, v in encoding_module(model).state_dict().items()}
    if entry.is_plan:
        patch_model(model, [_scaled(c, entry.eval_scaling, train_len, length, entry.eval_factor)
                            for c in entry.encoding])
    else:
        patch_model(model, _scaled(entry.encoding, entry.eval_scaling, train_len, length, entry.eval_factor))
    encoding_module(model).load_state_dict(trained)  # the other entries' trained weights (rope has none)
    return model.config.position_encoding
