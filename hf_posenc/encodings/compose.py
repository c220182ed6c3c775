"""Compositions: one absolute or rotary encoding and one term in the same layer (``"rope+fox"``).

A pretrained RoPE model moved to a new term keeps what it learned only if it keeps its rotary: the
composition ``"<first>+<term>"`` gives every layer both. The first encoding (its *slot*: an absolute or rotary
encoding, kinds ``absolute`` and ``q/k transform``) acts as it does alone: on the token embeddings, or on q and
k before they enter the KV cache. The term (a score bias, a gate, CoPE, SBA or CAPE: kinds ``score bias``,
``score + value``, ``score mix``, ``data-dependent``, ``replaces softmax``) then acts inside the attention on the
rotated q and k, exactly as it does alone on unrotated ones. So with R_n the first encoding's map at position n,

    logits_ij = scaling · (R_i q_i) · (R_j k_j) + term_ij      (or the term's own attention of R q, R k, v)

and every engine (the tile-wise PyTorch engine, FlexAttention, the Triton kernels, the full-matrix reference)
runs the term on the rotated q and k it is handed, so each engine carries both.

Configuration. ``patch_model(model, "rope+fox")`` or the config key ``{"name": "rope+fox", ...}``. Parameters of
either part may be given flat (``patch_model(m, "rope+fire", mlp_hidden=64)``) when only one part has that name,
or per part as a dict (``patch_model(m, "liere+t5", t5={"per_layer": True})``). The stored form is
``{"name": "rope+fire", "rope": {...}, "fire": {...}, "init": "default"}`` with every parameter of both parts.
``window`` belongs to the layer (the composition), as for a single encoding.

``init="identity"`` starts the term inert (`PositionEncoding.start_inert`): the patched model then gives
the unpatched model's logits at step 0 (``rope`` keeps the model's own rotary), and fine-tuning moves it from
there. "Exact" terms add exactly zero (a zero T5 table, FIRE's last layer, CoPE's position embeddings, Shaw's
tables, CAPE with ``base="fire"``): the logits then equal the unpatched model's to float32 rounding (the attention
runs with the zero bias, or the term's own kernel, where the unpatched model ran is_causal SDPA; 3e-6 measured on
the tests' tiny models). FoX's forget gates only approach 1: w = 0 and b = 10 give D_ij = -(i - j) * 4.54e-5. Which terms have an inert point, and how exact it is, each term states in ``start_inert``; ``alibi``,
``sandwich`` (fixed biases), ``kerple`` (r1, r2 >= 0.01 by its reparametrisation) and ``sba`` (it replaces
the softmax) have none and raise a ``ValueError`` saying so.

Not composable: ``tape`` (it is its own rotary, updated layer by layer), ``fox_pro`` (its QK-norm and token
shift act inside the attention, after which a rotation of the raw q and k would be mixed across tokens; the
paper's Pro block uses no RoPE), and ``fox`` with its own ``rope=True`` (two rotaries).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch
from torch import nn

from ..config import LAYER_OPTIONS, PosEncConfig
from ..registry import EncodingSpec, get_encoding, param, set_composer
from .base import ModelInfo, PosContext, PositionEncoding

__all__ = ["FIRST_KINDS", "TERM_KINDS", "ComposedEncoding", "split_name"]

#: kinds that take the first slot: they act on the embeddings or on q and k before the cache.
FIRST_KINDS = ("absolute", "q/k transform")
#: kinds that take the term slot: they act inside the attention.
TERM_KINDS = ("score bias", "score + value", "score mix", "data-dependent", "replaces softmax")
#: encodings whose kind would allow a slot but that cannot be composed, with the reason.
_NOT_COMPOSABLE = {
    "fox_pro": "its QK-norm and data-dependent token shift act on q and k inside the attention, so a rotation "
    "applied before them would be mixed across tokens (the paper's Pro block uses no RoPE); use 'rope+fox'",
}
INIT_CHOICES = ("default", "identity")

_SLOTS_HELP = (
    "a composition is one absolute or rotary encoding (kinds: absolute, q/k transform) followed by one term "
    "(kinds: score bias, score + value, score mix, data-dependent, replaces softmax), e.g. 'rope+fox'"
)


def split_name(name: str) -> tuple[str, str]:
    """``"rope+fox"`` -> ``("rope", "fox")``, validated: ``ValueError`` naming the two slots otherwise."""
    parts = name.split("+")
    if len(parts) != 2 or not all(parts):
        raise ValueError(f"{name!r}: {_SLOTS_HELP}; got {len(parts)} part(s)")
    first, term = (get_encoding(p) for p in parts)
    for spec in (first, term):
        if spec.name in _NOT_COMPOSABLE:
            raise ValueError(f"{name!r}: {spec.name!r} cannot be composed: {_NOT_COMPOSABLE[spec.name]}")
        if spec.kind not in FIRST_KINDS + TERM_KINDS:
            raise ValueError(f"{name!r}: {spec.name!r} (kind {spec.kind!r}) fits neither slot; {_SLOTS_HELP}")
    if first.kind in TERM_KINDS and term.kind in FIRST_KINDS:
        raise ValueError(f"{name!r}: the absolute or rotary encoding comes first; use '{term.name}+{first.name}'")
    if first.kind in TERM_KINDS:
        raise ValueError(f"{name!r}: {first.name!r} and {term.name!r} are both terms (the second slot); {_SLOTS_HELP}")
    if term.kind in FIRST_KINDS:
        raise ValueError(
            f"{name!r}: {first.name!r} and {term.name!r} are both absolute or rotary encodings (the first slot); "
            f"{_SLOTS_HELP}"
        )
    return first.name, term.name


def _normalise(name: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """The full stored parameters of composition ``name`` from what the user gave (flat or per part)."""
    first, term = split_name(name)
    parts: dict[str, dict[str, Any]] = {first: {}, term: {}}
    owners: dict[str, list[str]] = {}
    for part in parts:
        for key in [*get_encoding(part).param_names(), *LAYER_OPTIONS]:
            owners.setdefault(key, []).append(part)
    init = "default"
    for key, value in params.items():
        if key == "init":
            init = value
        elif key in parts:
            if isinstance(value, PosEncConfig):
                value = value.to_dict()
            if not isinstance(value, Mapping):
                raise TypeError(f"parameters of part {key!r} of {name!r} must be a dict, got {type(value).__name__}")
            given = {k: v for k, v in value.items() if k != "name"}
            if value.get("name", key) != key:
                raise ValueError(f"part {key!r} of {name!r} names another encoding: {value['name']!r}")
            parts[key].update(given)
        elif key in owners and len(owners[key]) == 1:
            parts[owners[key][0]][key] = value
        elif key in owners:
            raise ValueError(
                f"parameter {key!r} of {name!r} belongs to both {first!r} and {term!r}; give it per part, e.g. "
                f"{term}={{{key!r}: ...}}"
            )
        else:
            raise ValueError(
                f"unknown parameter {key!r} for {name!r}; allowed: init, {first}, {term}, and the parameters of "
                f"either part: {', '.join(sorted(k for k in owners if k not in LAYER_OPTIONS))}"
            )
    if init not in INIT_CHOICES:
        raise ValueError(f"init of {name!r} must be one of {list(INIT_CHOICES)}, got {init!r}")
    out: dict[str, Any] = {}
    for part, given in parts.items():
        for option in LAYER_OPTIONS:
            if option in given:
                raise ValueError(
                    f"{option} belongs to the layer, not to part {part!r}: pass {option}= to the composition"
                )
        try:
            out[part] = PosEncConfig(part, given).params
        except (ValueError, TypeError) as e:
            raise type(e)(f"part {part!r} of {name!r}: {e}") from None
    if first == "nope" and (out[first].get("qk_norm") or out[first].get("softmax_scale")):
        raise ValueError(
            f"{name!r}: nope's qk_norm and softmax_scale (DroPE) act on a nope layer alone, not inside a composition; "
            "use 'nope' with them, or a plan"
        )
    if first == "rope" and out[first].get("remap") is not None:
        raise ValueError(
            f"{name!r}: rope's remap={out[first]['remap']!r} rotates each query-key pair by a remapped distance, "
            f"piece by piece (hf_posenc.kernels.remap); no engine adds {term!r}'s term inside those pieces yet, so a "
            "remap is not composed with a term: use 'rope' with remap alone, or a plan"
        )
    if term == "fox" and out[term].get("rope"):
        raise ValueError(
            f"{name!r}: fox with rope=True brings a second rotary; the first slot ({first!r}) is the composition's "
            "position encoding on q and k"
        )
    out["init"] = init
    return dict(out)


def _part_config(config: PosEncConfig, part: str) -> PosEncConfig:
    return PosEncConfig(part, dict(config.params[part]))


class ComposedEncoding(PositionEncoding):
    """The encoding module of a composition (see the module docstring). Children: ``first`` (the absolute or
    rotary encoding) and ``term``. The capability flags are those of the part that owns each contribution;
    the model calls this module, which calls the part, so PEFT's wrapper routes to the trained copies."""

    first_cls: type = PositionEncoding
    term_cls: type = PositionEncoding

    def __init__(self, config: PosEncConfig, info: ModelInfo) -> None:
        super().__init__(config, info)
        first, term = split_name(config.name)
        self.first = self.first_cls(_part_config(config, first), info)
        self.term = self.term_cls(_part_config(config, term), info)
        #: how exact the inert start is (``start_inert``'s answer), None without ``init="identity"``.
        self.inert: str | None = None
        if config.params["init"] == "identity":
            self.inert = self.term.start_inert()

    @classmethod
    def resolve(cls, config: PosEncConfig, info: ModelInfo) -> PosEncConfig:
        first, term = split_name(config.name)
        params = dict(config.params)
        params[first] = cls.first_cls.resolve(_part_config(config, first), info).params
        params[term] = cls.term_cls.resolve(_part_config(config, term), info).params
        return config.with_params(params)

    def check_model(self, info: ModelInfo) -> None:
        pass  # each part checks the model when it is built

    def adopt_native(self, native: dict[str, torch.Tensor]) -> bool:
        return self.first.adopt_native(native)

    @property
    def relative(self) -> bool:  # type: ignore[override]
        """Shift invariant on text when both parts are."""
        return bool(getattr(self.first, "relative", False) and getattr(self.term, "relative", False))

    def angular_rate(self) -> float:
        """The rotary part's (the term rotates nothing)."""
        return self.first.angular_rate()

    @property
    def bias_per_layer(self) -> bool:  # type: ignore[override]
        return bool(getattr(self.term, "bias_per_layer", False))

    def reference_bytes(self, batch: int, heads: int, q_len: int, k_len: int, grad: bool, itemsize: int = 4) -> int:
        return self.term.reference_bytes(batch, heads, q_len, k_len, grad, itemsize)

    def forward(self, op: str, *args: Any, **kwargs: Any) -> Any:
        if op in ("embed", "rotate"):
            return self.first(op, *args, **kwargs)
        if op == "prepare":
            return self.prepare(*args, **kwargs)
        if op in ("bias", "attend", "finish", "kernel_term"):
            return self.term(op, *args, **kwargs)
        if op == "length_scale":  # a layer option: the composition's own (its parts have no layer options)
            return self.length_scale(*args, **kwargs)
        raise ValueError(
            f"unknown operation {op!r} for encoding {self.name!r}; allowed: embed, rotate, bias, attend, prepare, "
            "finish, kernel_term, length_scale"
        )

    def prepare(
        self, ctx: PosContext, layer: int, hidden: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotate q and k with the first part (if it rotates), with ``layer``'s rotation: through its own ``prepare``,
        which carries the layer (Gemma 3's sliding and full layers have their own RoPE bases; ComRoPE's and
        per-layer LieRE's generators differ per layer: with layer 0's rotation in every layer, ``rope+t5`` at
        ``init="identity"`` was 0.36 off the unpatched tiny Gemma 3's logits on 16 tokens). Then the term prepares
        them (FoX appends its log-gates to k): the term's state is computed from ``hidden``, never from the rotated
        q or k."""
        if getattr(self.first, "prepares_qkv", False):
            q, k, v = self.first("prepare", ctx, layer, hidden, q, k, v)
        elif self.first_cls.rotates_qk:
            q, k = self.first("rotate", ctx, q, k)
        if self.term_cls.prepares_qkv:
            return self.term("prepare", ctx, layer, hidden, q, k, v)
        return q, k, v

    def extra_repr(self) -> str:
        return f"init={self.posenc_config.params['init']!r}"


_CLASSES: dict[str, EncodingSpec] = {}


def composed_spec(name: str) -> EncodingSpec:
    """The registry entry of composition ``name`` (built once, then cached)."""
    if name in _CLASSES:
        return _CLASSES[name]
    first, term = split_name(name)
    fspec, tspec = get_encoding(first), get_encoding(term)
    fcls, tcls = fspec.cls, tspec.cls
    flags = {
        "first_cls": fcls,
        "term_cls": tcls,
        "adds_embeddings": fcls.adds_embeddings,
        "rotates_qk": fcls.rotates_qk,
        "uses_rotary_kernel": getattr(fcls, "uses_rotary_kernel", False),
        "has_score_bias": tcls.has_score_bias,
        "custom_attention": tcls.custom_attention,
        # the first part's prepare carries the layer to its rotation (per-layer bases and generators)
        "prepares_qkv": tcls.prepares_qkv or fcls.prepares_qkv,
        "finishes_output": tcls.finishes_output,
        "kernel_kinds": tcls.kernel_kinds,
        "attention_kernels": getattr(tcls, "attention_kernels", ()),
        "reads_mlp_output": getattr(tcls, "reads_mlp_output", False),
        "reference_footprint": tcls.reference_footprint,
        "__doc__": f"The composition {name!r}: {first} ({fspec.kind}) and {term} ({tspec.kind}).",
    }
    cls = type(f"Composed_{first}_{term}", (ComposedEncoding,), flags)
    cls.name = name
    params = dataclasses.make_dataclass(
        f"ComposedParams_{first}_{term}",
        [
            (first, dict, param(None, f"parameters of {first!r} (see its entry)", type=dict, optional=True)),
            (term, dict, param(None, f"parameters of {term!r} (see its entry)", type=dict, optional=True)),
            ("init", str, param("default", "'identity' starts the term inert (the unpatched model's logits at "
                                "step 0, where the term has an inert point); 'default' is the term's own "
                                "initialisation", type=str, choices=INIT_CHOICES)),
        ],
        frozen=True,
    )
    families = tuple(f for f in fspec.families if f in tspec.families)
    spec = EncodingSpec(
        name, cls, params, "composition", f"{first} on q/k or the embeddings, and the term of {term}",
        f"{fspec.paper} + {tspec.paper}", families, normalise=lambda p, _n=name: _normalise(_n, p),
    )
    _CLASSES[name] = spec
    return spec


set_composer(composed_spec)
