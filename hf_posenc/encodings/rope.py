"""``rope``: rotary position embedding.

"RoFormer: Enhanced Transformer with Rotary Position Embedding", Su et al. 2021,
https://arxiv.org/abs/2104.09864. For a query or key x at position m and head dimension d,

    theta_i = base^(-2i/d),  i = 0 .. d/2 - 1
    (R_m x)_pair_i = [[cos(m theta_i), -sin(m theta_i)], [sin(m theta_i), cos(m theta_i)]] @ x_pair_i

so that (R_m q)^T (R_n k) = q^T R_(n-m) k depends only on n - m. ``layout`` picks which coordinates form
a pair: ``"half"`` pairs x[i] with x[i + d/2] (the layout of transformers' Llama, so a Llama patched with
rope reproduces the unpatched model), ``"interleaved"`` pairs x[2i] with x[2i+1] (the paper's layout).
Angles are computed in float32. Queries and keys are rotated before they enter the KV cache, at their
logical ``position_ids`` (left padding shifts them as transformers does).

On ViT the patches are rotated by their index in raster order (row * cols + col); the CLS token is not
rotated (it takes no positional term).

The model's own scaling types (Llama's ``rope_parameters``). With ``theta`` left to None on a Llama whose
``rope_type`` is not ``default``, rope takes the model's rotary as it is: the frequencies theta_i and the
factor ``attention_scaling`` (s) are computed by transformers' own ``ROPE_INIT_FUNCTIONS`` from the model's
``rope_parameters``, and the rotation uses cos(m theta_i) * s and sin(m theta_i) * s, exactly as
``LlamaRotaryEmbedding`` does, so the patched model reproduces the unpatched one bit for bit. Supported:

* ``linear``, ``llama3``, ``yarn``, ``proportional``: static frequencies (they do not depend on the
  sequence length), valid at any position, past ``max_position_embeddings`` too;
* ``longrope``: two static sets; as transformers does, a forward whose largest position id + 1 exceeds
  ``original_max_position_embeddings`` uses the long factors, any other the short ones (so, as in
  transformers, keys cached before the switch keep the short-factor rotation).

Partial rotary (GPT-NeoX's ``rotary_pct``, Phi-3's ``partial_rotary_factor``): only the first
R = ``partial_rotary_factor`` x d dims of each head are rotated, with theta_i = base^(-2i/R), as transformers
does; the other d - R dims pass through. This follows the model (with an explicit ``theta`` too). Models
whose layers have their own rotary (Gemma 3: local layers at base 10000, global layers at 1e6 with their
scaling) get each layer's own frequencies when ``theta`` is None.

``dynamic`` (NTK scaling recomputed from the sequence length): transformers recomputes the frequencies
whenever a forward's largest position id + 1 exceeds the longest seen so far, and resets them below the
original length. hf_posenc computes them per forward from that forward's largest position id + 1 (as
transformers' ``_compute_dynamic_ntk_parameters`` does, through ``ROPE_INIT_FUNCTIONS``), which is what
transformers computes whenever lengths grow (prefill then decoding, or one forward); it holds no state between
forwards. An explicit ``theta`` gives plain rotary at that base on any model, ignoring the model's scaling. In
the resolved config ``theta`` stays None for scaled types: the scaling's factors live in the model's config,
which is saved with it, and are read again whenever the model is patched.

Parameters for long-context recipes, on every family:

* ``partial_rotary_factor`` f in (0, 1]: the first R = int(f x d) dims of each head rotate, with theta_i =
  base^(-2i/R) (the frequencies of the rotated width, as transformers computes them for GPT-NeoX and Phi:
  ``_compute_default_rope_parameters``, dim = int(head_dim * partial_rotary_factor)); the other d - R dims pass
  through, as in NoPE. None (default): the model's own (GPT-NeoX's ``rotary_pct``, Phi's
  ``partial_rotary_factor``), 1 on the other families -- so that rope on GPT-NeoX reproduces the model; the
  issue that introduced it asks for a default of 1, which is what every family without a partial rotary gets.
  R must be even (a rotation acts on pairs).
* ``scaling``: a dict in transformers' ``rope_parameters`` form (``{"rope_type": "yarn", "factor": 4.0,
  "original_max_position_embeddings": 2048}``), for any ``rope_type`` in transformers' ``ROPE_INIT_FUNCTIONS``
  (linear, dynamic, yarn, longrope, llama3, proportional). The frequencies and the attention scaling come from
  that function, at base ``theta`` (default: the model's ``rope_theta``, else 10000), with the model's
  ``max_position_embeddings`` where the function reads it (GPT-2: ``n_positions``; ViT: the patch count + 1),
  so on Llama rope with ``scaling`` gives the logits of a native Llama whose config carries those
  ``rope_parameters``. On ViT the positions are the raster indices of the patches, so a length in ``scaling``
  counts patches in raster order.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch

from ..config import PosEncConfig
from ..kernels.rotary.naive import apply_rotary, rotate_leading
from ..registry import param, register_encoding
from .base import ModelInfo, PosContext, PositionEncoding
from ..kernels.remap.cases import REMAPS, Remap, dca_logit_scale, remap_defaults

__all__ = ["Rope", "rope_inv_freq", "apply_rotary", "SCALED_ROPE_TYPES", "model_rope_frequencies"]


def rope_inv_freq(dim: int, base: float) -> torch.Tensor:
    """theta_i = base^(-2i/dim) for i < dim/2, float32, computed on the CPU as transformers does."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))


#: the model's ``rope_type`` values that rope reproduces (besides ``default``).
SCALED_ROPE_TYPES = ("linear", "llama3", "yarn", "longrope", "proportional", "dynamic")


def model_rope_frequencies(
    info: ModelInfo, seq_len: int | None = None, rope_parameters: dict | None = None
) -> tuple[torch.Tensor, float]:
    """(inv_freq (R/2,) float32 on the CPU, attention_scaling) of the model's ``rope_parameters`` (or the
    given ones: a layer's own), computed by transformers' ``ROPE_INIT_FUNCTIONS`` as ``LlamaRotaryEmbedding``
    computes them (``seq_len``: the length passed to the function, for longrope's long factors). R is the
    number of rotated dims (``info.rotary_dim``; the head dim unless the rotary is partial)."""
    params = info.rope_parameters if rope_parameters is None else rope_parameters
    rotary_dim = info.rotary_dim or info.head_dim
    rope_type = params["rope_type"]
    config, init = rope_init_function(info, params)
    inv_freq, scaling = init(config, None, seq_len=seq_len)
    if inv_freq.shape != (rotary_dim // 2,):
        raise ValueError(
            f"the model's rope_parameters ({rope_type!r}) give {inv_freq.numel()} frequencies for {rotary_dim} "
            f"rotated dims of head_dim={info.head_dim}; rope needs one per pair of rotated dims"
        )
    return inv_freq.float(), float(scaling)


def rope_init_function(info: ModelInfo, rope_parameters: dict) -> tuple[Any, Any]:
    """(a transformers config carrying ``rope_parameters`` for this model's shape, transformers' own
    ``ROPE_INIT_FUNCTIONS[rope_type]``): what ``LlamaRotaryEmbedding`` calls. The rotated width is
    ``info.rotary_dim`` (given to the function as ``partial_rotary_factor``, in ``rope_parameters`` and on the
    config, where transformers releases read it)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = copy.deepcopy(dict(rope_parameters))
    rotary_dim = info.rotary_dim or info.head_dim
    extra = {}
    if rotary_dim != info.head_dim and "partial_rotary_factor" not in params:
        params["partial_rotary_factor"] = rotary_dim / info.head_dim
        extra["partial_rotary_factor"] = rotary_dim / info.head_dim
    hf_logger = logging.getLogger("transformers")
    level = hf_logger.level
    hf_logger.setLevel(logging.ERROR)  # the model's config already warned about its rope_parameters
    try:
        config = LlamaConfig(
            hidden_size=info.hidden_size,
            num_attention_heads=info.num_heads,
            num_key_value_heads=info.num_kv_heads,
            head_dim=info.head_dim,
            max_position_embeddings=info.max_positions,
            rope_parameters=params,
            **extra,
        )
    finally:
        hf_logger.setLevel(level)
    return config, ROPE_INIT_FUNCTIONS[params["rope_type"]]


def half_rotation(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The factors (C, S) = ([cos, cos], [−sin, sin]) of `rotate_half_by`, built once for every tensor
    rotated by the same angles (TAPE's queries and keys of the new tokens)."""
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)


def rotate_half_by(x: torch.Tensor, factors: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x ⊙ C + roll(x, D/2) ⊙ S with ``factors`` = `half_rotation` (cos, sin): bit for bit
    ``apply_rotary(x, cos, sin, "half")`` ((−x₂) s and x₂ (−s) are the same number), in four operations
    instead of seven."""
    c, s = factors
    return x * c + x.roll(x.shape[-1] // 2, dims=-1) * s


def _check_scaling(scaling: dict, encoding: str = "rope") -> None:
    """``scaling`` of ``encoding`` (rope or a rotary built on it): a JSON-able dict with a ``rope_type`` that
    transformers' ``ROPE_INIT_FUNCTIONS`` has."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    import json

    where = f"parameter 'scaling' of encoding {encoding!r}"
    if not all(isinstance(k, str) for k in scaling):
        raise TypeError(f"{where} must have str keys, got {sorted(map(repr, scaling))}")
    try:
        json.dumps(scaling)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{where} must hold JSON values (it is stored in the model's config): {e}") from None
    kinds = sorted(ROPE_INIT_FUNCTIONS)
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in kinds:
        raise ValueError(
            f"{where} needs 'rope_type', one of transformers' {', '.join(map(repr, kinds))}; got {kind!r} (for plain "
            "rotary leave scaling None)"
        )
    if "partial_rotary_factor" in scaling:
        raise ValueError(f"{where}: give partial_rotary_factor as rope's own parameter, not inside scaling")


@dataclass
class RotaryParams:
    """The parameters of a plain rotary (rope's, and the base of xpos's)."""

    theta: float | None = param(
        None,
        "rotary base (default: the model's rope_theta on Llama, with its rope_parameters scaling, else 10000); "
        "an explicit value gives plain rotary at that base",
        type=float,
        optional=True,
        gt=1.0,
    )
    layout: str = param(
        "half",
        "which coordinates are rotated together: 'half' (x[i], x[i+d/2], transformers' Llama) or "
        "'interleaved' (x[2i], x[2i+1], the paper)",
        type=str,
        choices=("half", "interleaved"),
    )
    partial_rotary_factor: float | None = param(
        None,
        "fraction of each head's dims that rotate, in (0, 1]: the first int(factor x head_dim) dims rotate, with "
        "frequencies for that width (as transformers' GPT-NeoX and Phi), the rest pass through as in NoPE; None: "
        "the model's own (GPT-NeoX rotary_pct, Phi partial_rotary_factor), 1 elsewhere",
        type=float,
        optional=True,
        gt=0.0,
        le=1.0,
    )
    scaling: dict | None = param(
        None,
        "RoPE scaling in transformers' rope_parameters form, e.g. {'rope_type': 'yarn', 'factor': 4.0, "
        "'original_max_position_embeddings': 2048}, computed by transformers' ROPE_INIT_FUNCTIONS (any rope_type it "
        "has, dynamic included) at base theta; None: none (or the model's own, with theta None)",
        type=dict,
        optional=True,
    )

    def __post_init__(self) -> None:
        if self.scaling is not None:
            _check_scaling(self.scaling)


@dataclass
class RopeParams(RotaryParams):
    remap: str | None = param(
        None,
        "training-free extension past the pretrained context P: each query-key pair is rotated by a remapped "
        "distance f(i, j) instead of i - j (hf_posenc.kernels.remap.cases): 'rerope' (ReRoPE, min(i - j, w)), "
        "'leaky_rerope' (w + (i - j - w) / g past w), 'self_extend' (Self-Extend: grouped positions past the neighbour "
        "window w), 'dca' (Dual Chunk Attention: chunks of s - w positions); on causal models, with the model's own "
        "rope_parameters (YaRN, linear, llama3) and partial rotary; None: off",
        type=str,
        optional=True,
        choices=REMAPS,
    )
    remap_window: int | None = param(
        None,
        "w of the remap: the window below which pairs keep their distance (rerope, leaky_rerope: default P/8; "
        "self_extend's neighbour window: P/4; dca's local window: P/8), P the model's pretrained context "
        "(original_max_position_embeddings, else max_position_embeddings)",
        type=int,
        optional=True,
        ge=1,
    )
    remap_group: int | None = param(
        None,
        "g of the remap: leaky_rerope's slope 1/g past w (default 16), self_extend's group size (default 8)",
        type=int,
        optional=True,
        ge=1,
    )
    remap_chunk: int | None = param(
        None,
        "s of dca: the chunk size, > remap_window (default 3P/4; a chunk holds s - w positions)",
        type=int,
        optional=True,
        ge=2,
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        check_remap_params(self.remap, self.remap_window, self.remap_group, self.remap_chunk)


#: which remap parameters each remap reads.
REMAP_PARAMS = {
    "rerope": ("remap_window",),
    "leaky_rerope": ("remap_window", "remap_group"),
    "self_extend": ("remap_window", "remap_group"),
    "dca": ("remap_window", "remap_chunk"),
}


def check_remap_params(remap: str | None, window: int | None, group: int | None, chunk: int | None) -> None:
    """``ValueError`` for remap parameters without a remap, or that the remap does not read, or dca's w >= s."""
    given = {"remap_window": window, "remap_group": group, "remap_chunk": chunk}
    if remap is None:
        extra = [name for name, value in given.items() if value is not None]
        if extra:
            raise ValueError(f"{', '.join(extra)} of rope need remap= (one of {list(REMAPS)})")
        return
    unread = [name for name, value in given.items() if value is not None and name not in REMAP_PARAMS[remap]]
    if unread:
        raise ValueError(f"remap={remap!r} reads {', '.join(REMAP_PARAMS[remap])}, not {', '.join(unread)}")
    if remap == "dca" and window is not None and chunk is not None and window >= chunk:
        raise ValueError(f"dca needs remap_window (w = {window}) < remap_chunk (s = {chunk}): a chunk holds s - w "
                         "positions")


def pretrained_context(info: ModelInfo, scaling: dict | None = None) -> int | None:
    """P, the model's pretrained context: ``original_max_position_embeddings`` of rope's ``scaling`` or of the
    model's ``rope_parameters`` where given, else ``max_position_embeddings``; None when the model has neither."""
    for params in (scaling, info.rope_parameters):
        if params and params.get("original_max_position_embeddings"):
            return int(params["original_max_position_embeddings"])
    return info.max_positions


@register_encoding(
    "rope",
    params=RopeParams,
    kind="q/k transform",
    summary="rotary embedding of queries and keys (Llama's native kind); raster order on ViT",
    paper="https://arxiv.org/abs/2104.09864",
)
class Rope(PositionEncoding):
    """Rotary position embedding; see the module docstring for the formula."""

    rotates_qk = True
    prepares_qkv = True  # so that the layer index reaches the rotation (per-layer bases: Gemma 3)
    # (R_m q)^T (R_n k) = q^T R_(n-m) k. Not across longrope's switch between its short and long factors, nor
    # with dynamic scaling past the original length: both depend on the largest absolute position (a scaling
    # choice, not the default).
    relative = True

    #: sink_positions="cache" is a remapped distance of the sinks (hf_posenc.kernels.remap).
    cache_sink_positions = True
    #: whether the logit of a pair depends on the rotation alone, so that the remap engine can rotate it by another
    #: distance (rope: yes; xpos, whose scale also decays with i − j, sets False).
    remappable = True

    @classmethod
    def resolve(cls, config: PosEncConfig, info: ModelInfo) -> PosEncConfig:
        options = config.layer_options()
        config = cls._resolve_rotary(config, info)
        p = dict(config.params)
        kind = p.get("remap")
        if kind is None:
            return config
        if options["window"] is not None:
            raise ValueError(
                f"{cls.name}: remap={kind!r} with window={options['window']}: a remap already bounds every distance "
                "the model sees, and the engine does not cut a window out of its pieces; use one or the other"
            )
        if not info.causal:
            raise ValueError(f"{cls.name}: remap={kind!r} is defined on causal models only; {info.family} is "
                             "bidirectional")
        context = pretrained_context(info, p.get("scaling"))
        needed = [name for name in REMAP_PARAMS[kind] if p.get(name) is None]
        if needed and context is None:
            raise ValueError(
                f"{cls.name}: remap={kind!r} takes its defaults ({', '.join(needed)}) from the model's pretrained "
                "context (original_max_position_embeddings or max_position_embeddings), which this model does not "
                "have; give them explicitly"
            )
        for name, value in remap_defaults(kind, context or 0).items():
            if p.get(name) is None:
                p[name] = value
        check_remap_params(kind, p.get("remap_window"), p.get("remap_group"), p.get("remap_chunk"))
        rope_type = (p.get("scaling") or {}).get("rope_type") or (info.rope_type if p["theta"] is None else None)
        if rope_type in ("dynamic", "longrope"):
            raise ValueError(
                f"{cls.name}: remap={kind!r} with rope_type={rope_type!r}: its frequencies change with the forward's "
                "length, and the remap re-rotates cached keys by fixed frequencies; use yarn, linear, llama3 or none"
            )
        return PosEncConfig(config.name, p, **options)

    @classmethod
    def _resolve_rotary(cls, config: PosEncConfig, info: ModelInfo) -> PosEncConfig:
        p = dict(config.params)
        if p["scaling"] is not None:
            scaling = dict(p["scaling"])
            if "type" in scaling and "rope_type" not in scaling:  # transformers' older key
                scaling["rope_type"] = scaling.pop("type")
            given = scaling.pop("rope_theta", None)
            if given is not None and p["theta"] is not None and float(given) != float(p["theta"]):
                raise ValueError(f"{cls.name}: theta={p['theta']} and scaling's rope_theta={given} differ; give one")
            theta = p["theta"] if p["theta"] is not None else given
            if theta is None:
                theta = float(info.rope_theta) if info.rope_theta is not None else 10000.0
            p["theta"], p["scaling"] = float(theta), scaling
            return PosEncConfig(config.name, p)
        if p["theta"] is None:
            if info.layer_rope_parameters is not None:  # per-layer rotary: every layer's own is checked
                for params in info.layer_rope_parameters:
                    kind = params.get("rope_type", "default")
                    if kind not in ("default", *SCALED_ROPE_TYPES) or kind == "dynamic":
                        raise ValueError(
                            f"a layer's rope_parameters use rope_type={kind!r}, which hf_posenc's {cls.name} does not "
                            f"implement; supported: 'default', {', '.join(repr(t) for t in SCALED_ROPE_TYPES)}. "
                            "Pass an explicit theta to use plain rotary embedding"
                        )
                return PosEncConfig(config.name, p)  # theta stays None: each layer's own rotary
            if info.rope_type in SCALED_ROPE_TYPES and info.rope_parameters is not None:
                return PosEncConfig(config.name, p)  # theta stays None: the model's scaled rotary
            if info.rope_type not in (None, "default"):
                raise ValueError(
                    f"the model's rope_parameters use rope_type={info.rope_type!r}, which hf_posenc's {cls.name} does "
                    f"not implement; supported: 'default', {', '.join(repr(t) for t in SCALED_ROPE_TYPES)}. Pass an "
                    "explicit theta to use plain rotary embedding"
                )
            p["theta"] = float(info.rope_theta) if info.rope_theta is not None else 10000.0
        return PosEncConfig(config.name, p)

    def __init__(self, config: PosEncConfig, info: ModelInfo) -> None:
        super().__init__(config, info)
        #: the model's scaled rotary (theta None): short and long frequencies, attention scaling, longrope's
        #: switch length. Plain attributes, not buffers: they stay float32 on the CPU under ``model.to``.
        self._scaled: tuple[torch.Tensor, torch.Tensor | None, float, int | None] | None = None
        #: per-layer rotary (theta None on a model whose layers differ): one such tuple per layer.
        self._layers: list[tuple[torch.Tensor, torch.Tensor | None, float, int | None]] | None = None
        #: partial rotary: the leading dims of each head that are rotated (the model's own choice).
        factor = config.params.get("partial_rotary_factor")
        self.rotary_dim = int(info.head_dim * factor) if factor is not None else (info.rotary_dim or info.head_dim)
        info = dataclasses.replace(info, rotary_dim=self.rotary_dim if self.rotary_dim != info.head_dim else None)
        #: dynamic NTK scaling: the config that transformers' function reads, and that function (per forward).
        self._dynamic: tuple[Any, Any] | None = None
        scaling = config.params.get("scaling")
        if scaling is not None:
            params = {**scaling, "rope_theta": config.params["theta"] or 10000.0}
            if params["rope_type"] == "dynamic":
                self._dynamic = rope_init_function(info, params)
            else:
                self._scaled = self._model_frequencies(info, params)
        elif config.params["theta"] is None and info.layer_rope_parameters is not None:
            self._layers = [self._model_frequencies(info, params) for params in info.layer_rope_parameters]
        elif config.params["theta"] is None and info.rope_type == "dynamic" and info.rope_parameters is not None:
            self._dynamic = rope_init_function(info, info.rope_parameters)
        elif config.params["theta"] is None and info.rope_type in SCALED_ROPE_TYPES:
            self._scaled = self._model_frequencies(info, info.rope_parameters)

    @staticmethod
    def _model_frequencies(
        info: ModelInfo, params: dict
    ) -> tuple[torch.Tensor, torch.Tensor | None, float, int | None]:
        """(inv_freq, longrope's long inv_freq or None, attention scaling, longrope's switch length or None)
        of one set of the model's ``rope_parameters``."""
        kind = params.get("rope_type", "default")
        if kind == "default":
            theta = float(params.get("rope_theta") or 10000.0)
            return rope_inv_freq(info.rotary_dim or info.head_dim, theta), None, 1.0, None
        inv_freq, scaling = model_rope_frequencies(info, rope_parameters=params)
        long_freq, switch = None, None
        if kind == "longrope":
            switch = int(params["original_max_position_embeddings"])
            long_freq, _ = model_rope_frequencies(info, seq_len=switch + 1, rope_parameters=params)
        return inv_freq, long_freq, scaling, switch

    def remap(self) -> Remap | None:
        """The remap of this encoding's layers (`hf_posenc.kernels.remap.Remap`): rope's ``remap``, or its own
        sliding ``window`` with its sinks on a causal text model; None for plain rotary."""
        p, config = self.posenc_config.params, self.posenc_config
        if not self.remappable:
            return None
        if p.get("remap") is not None:
            return Remap(p["remap"], p["remap_window"], group=p.get("remap_group"), chunk=p.get("remap_chunk"))
        if config.window is not None and self.info.causal and self.info.grid is None:
            return Remap(None, config.window, sink=config.sink, sink_positions=config.sink_positions or "text")
        return None

    def remap_inputs(self, ctx: PosContext, layer: int, device: torch.device) -> dict:
        """What the remap engine needs of this rotary on ``layer``: ``inv_freq`` (R/2,) float32, ``rotary_dim``,
        ``layout``, and ``q_factor``: dca's per-query logit factor m² (`dca_logit_scale`) or None."""
        inv_freq, _ = self._frequencies(ctx.position_ids, device, layer, ctx.memo)
        factor = None
        if self.posenc_config.params.get("remap") == "dca":
            context = pretrained_context(self.info, self.posenc_config.params.get("scaling"))
            factor = dca_logit_scale(ctx.position_ids.to(device), context)[:, None, :, None]  # (B|1, 1, Lq, 1)
        return {"inv_freq": inv_freq, "rotary_dim": self.rotary_dim, "layout": self.posenc_config.params["layout"],
                "q_factor": factor}

    def check_model(self, info: ModelInfo) -> None:
        if info.head_dim % 2:
            raise ValueError(f"{self.name} needs an even head_dim, got {info.head_dim}")
        factor = self.posenc_config.params.get("partial_rotary_factor")
        rotary_dim = int(info.head_dim * factor) if factor is not None else (info.rotary_dim or info.head_dim)
        if rotary_dim % 2 or not 0 < rotary_dim <= info.head_dim:
            given = f" (partial_rotary_factor={factor} x head_dim={info.head_dim})" if factor is not None else ""
            raise ValueError(
                f"{self.name} needs an even number of rotated dims in 2 .. head_dim={info.head_dim}, got "
                f"{rotary_dim}{given}"
            )

    def _frequencies(
        self, positions: torch.Tensor, device: torch.device, layer: int = 0, memo: dict | None = None
    ) -> tuple[torch.Tensor, float]:
        """(inv_freq (R/2,) float32 on ``device``, attention scaling) for a forward at ``positions`` in ``layer``;
        ``memo`` (the forward's ``PosContext.memo``) keeps dynamic scaling's frequencies for the other layers."""
        if self._dynamic is not None:  # NTK: from this forward's largest position id + 1 (a tensor: no sync)
            key = ("rope_dynamic_frequencies", device)
            if memo is not None and key in memo:
                return memo[key]
            hf_config, init = self._dynamic
            inv_freq, scaling = init(hf_config, device, seq_len=positions.max().to(device) + 1)
            out = inv_freq.to(device=device, dtype=torch.float32), float(scaling)
            if memo is not None:
                memo[key] = out
            return out
        scaled = self._scaled if self._layers is None else self._layers[layer]
        if scaled is None:
            theta = self.posenc_config.params["theta"]
            if theta is None:  # constructed without resolve
                theta = float(self.info.rope_theta) if self.info.rope_theta is not None else 10000.0
            return rope_inv_freq(self.rotary_dim, theta).to(device), 1.0
        inv_freq, long_freq, scaling, switch = scaled
        inv_freq = inv_freq.to(device)
        if long_freq is not None:  # longrope: the long factors once the largest position id + 1 > switch
            inv_freq = torch.where(positions.max().to(device) + 1 > switch, long_freq.to(device), inv_freq)
        return inv_freq, scaling

    def _angles(
        self, positions: torch.Tensor, device: torch.device, layer: int = 0, memo: dict | None = None
    ) -> tuple[torch.Tensor, float]:
        inv_freq, scaling = self._frequencies(positions, device, layer, memo)
        return positions.to(device=device, dtype=torch.float32)[..., None] * inv_freq, scaling

    def prepare(
        self, ctx: PosContext, layer: int, hidden: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotate q and k with ``layer``'s rotary; v passes through unchanged."""
        q, k = self.rotate(ctx, q, k, layer)
        return q, k, v

    def rotate(
        self, ctx: PosContext, q: torch.Tensor, k: torch.Tensor, layer: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate the first ``rotary_dim`` dims of q (B, H, L, D) and k (B, Hkv, L, D) of the new tokens
        (all of them unless the model's rotary is partial) with ``layer``'s rotary."""
        _, cos, sin = self.rotation_tables(ctx, q.device, layer)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        return self.apply_tables(q, k, (cos, sin), (cos, sin))

    def rotation_tables(
        self, ctx: PosContext, device: torch.device, layer: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(positions (B|1, L) of the new tokens, cos, sin (B|1, 1, L, R/2) float32) of ``layer``'s rotary,
        times the attention scaling; on ViT the CLS token (position -1) gets cos 1, sin 0 (no rotation)."""
        if ctx.grid is None:
            positions = ctx.position_ids
        else:
            rows, cols = ctx.grid
            positions = torch.arange(rows * cols + 1, device=device)[None] - 1
        angles, scaling = self._angles(positions, device, layer, ctx.memo)
        angles = angles[:, None]  # (B|1, 1, L, D/2)
        cos, sin = angles.cos(), angles.sin()
        if scaling != 1.0:  # as LlamaRotaryEmbedding: cos * attention_scaling, sin * attention_scaling
            cos, sin = cos * scaling, sin * scaling
        if ctx.grid is not None:  # CLS (index 0, position -1) stays unrotated
            cos = cos.clone()
            sin = sin.clone()
            cos[..., 0, :] = 1.0
            sin[..., 0, :] = 0.0
        return positions, cos, sin

    def apply_tables(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        q_tables: tuple[torch.Tensor, torch.Tensor],
        k_tables: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q (B, H, L, D) and k (B, Hkv, L, D) with their first ``rotary_dim`` dims mapped by
        x * cos + rotate(x) * sin in this encoding's ``layout``, (cos, sin) (B|1, 1, L, R/2) in q's dtype:
        ``q_tables`` for the queries, ``k_tables`` for the keys; the dims past R pass through."""
        layout = self.posenc_config.params["layout"]
        return (rotate_leading(q, *q_tables, self.rotary_dim, layout),
                rotate_leading(k, *k_tables, self.rotary_dim, layout))
