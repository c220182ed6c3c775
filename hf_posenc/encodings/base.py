"""The base class of every encoding, the model description it is built from, and the per-forward context.

An encoding is an ``nn.Module`` with up to three kinds of contribution, each a method:

* ``embed(ctx, dtype, device)`` -> a term added to the token embeddings (absolute encodings),
* ``rotate(ctx, q, k)``         -> transformed queries and keys, before they enter the KV cache,
* ``score_bias(ctx, q_len, k_len, device)`` -> an additive float32 bias of shape (1, H, Lq, Lk).

Encodings with a term inside the attention may also describe it to the fused attention kernels:
``kernel_term(ctx, layer, q, k, v, mask)`` -> a `KernelTerm`, or None
where they have none (e.g. on ViT's 2D grid); ``kernel_kinds`` lists the kinds they can return.

The model calls the module itself (``encoding("bias", ...)``), never its methods, so that wrappers such
as PEFT's ``ModulesToSaveWrapper`` route to the copy that is being trained.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from ..backend import forced_backend
from ..config import PosEncConfig
from ..kernels._masks import CacheSinks, cache_sinks
from ..registry import get_encoding, list_encodings
from .length_scale import check_length_scale_model, keys_seen, length_scale_factor, ssmax_start

__all__ = ["EngineAttention", "ModelInfo", "PosContext", "model_norm_eps", "PositionEncoding", "RelativePositions", "relative_positions", "unwrap", "vit_token_coords"]


@dataclass(frozen=True)
class ModelInfo:
    """What an encoding needs to know about the model it is attached to."""

    family: str
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    causal: bool
    #: text: the model's own maximum position count (None if it has none); ViT: patches + 1.
    max_positions: int | None
    #: ViT only: the patch grid (rows, cols) at the config's image size, and the patch size.
    grid: tuple[int, int] | None = None
    patch_size: int | None = None
    rope_theta: float | None = None
    rope_type: str | None = None
    initializer_range: float = 0.02
    #: Llama: the config's ``rope_parameters`` (theta, scaling type and its factors), read by ``rope``.
    rope_parameters: dict | None = None
    #: partial rotary (GPT-NeoX ``rotary_pct``, Phi ``partial_rotary_factor``): how many leading dims of each
    #: head the model's own rotary rotates; None: all of them.
    rotary_dim: int | None = None
    #: per-layer ``rope_parameters`` where layers differ (Gemma 3's local and global layers); None: every
    #: layer uses ``rope_parameters``.
    layer_rope_parameters: tuple[dict, ...] | None = None
    #: the epsilon of the model's own normalisation layers (``rms_norm_eps``, ``layer_norm_eps``, ...), None if it
    #: has none; what a norm an encoding adds defaults to (nope's ``qk_norm``, as DroPE's code).
    norm_eps: float | None = None
    #: per-layer sliding window (keys more than ``window - 1`` positions before the query are masked), None
    #: for a layer without one; None: no layer has one. The attention mask transformers builds carries it.
    sliding_windows: tuple[int | None, ...] | None = None


#: ``PosContext.memo`` key set by the attention function before a custom ``attend``: True when the mask it
#: hands over is causality alone (no padding, no cache, queries = keys), so ``attend`` may use is_causal kernels.
PLAIN_CAUSAL = "plain_causal"
#: ``PosContext.memo`` key prefix: ``memo[(UNWINDOWED_MASK, id(windowed))]`` is the attention mask before
#: hf_posenc's sliding ``window`` was applied to it (``windowed``): what a token's neighbours are (FoX Pro's token
#: shift) does not depend on which keys a query may attend to.
UNWINDOWED_MASK = "unwindowed_mask"


def model_norm_eps(config: Any) -> float | None:
    """The epsilon of a transformers config's normalisation layers, None where it names none."""
    for name in ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon"):
        value = getattr(config, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def new_tokens_key(length: int) -> int | str:
    """The count of a forward's new tokens as part of a ``PosContext.memo`` key: the count itself in eager mode;
    under ``torch.compile`` one constant, because Dynamo specialises a graph to a symbolic length that takes part in
    a dict key (``key in memo`` guards on its value): one graph per length (measured: 3 graphs over L = 256, 384 and
    512 for liere, rope2d and fope, where the unpatched model compiles 2).
    Only for memo entries built from the new tokens alone (their count is the same for every call of one forward,
    and the memo lives for one forward)."""
    return "new_tokens" if torch.compiler.is_compiling() else length


def narrowest_window(*windows: int | None) -> int | None:
    """The band several sliding windows leave together (the smallest), None when none is set."""
    given = [w for w in windows if w is not None]
    return min(given) if given else None


@dataclass
class PosContext:
    """Everything about one forward pass that the encoding needs, built once by the patched base model.

    Attributes:
        encoding: the (possibly wrapped) encoding module; called, never bypassed.
        info: the model description.
        position_ids: text: (B or 1, Lq) logical positions of the new tokens; ViT: None.
        q_offset: index of the first query among the keys (the cache length before this forward);
            an int, or a 0-d tensor for a StaticCache.
        grid: ViT only: the patch grid (rows, cols) of this forward's images.
        interpolate: ViT only: the ``interpolate_pos_encoding`` flag of this forward.
        need_weights: whether attention probabilities are requested (``output_attentions``).
        key_padding: which key positions hold real tokens, when the model knows it apart from the 4D masks
            (a model's own sliding window bands those): a (B|1, N) bool tensor (the 2D attention mask, key j at
            column j), True (no mask: every position is real), or None (unknown, e.g. a custom 4D mask, or not
            recorded: the decoders record it only when the model has sliding windows).
        memo: per-forward cache, e.g. the score bias shared by every layer.
    """

    encoding: Any
    info: ModelInfo
    position_ids: torch.Tensor | None = None
    q_offset: int | torch.Tensor = 0
    grid: tuple[int, int] | None = None
    interpolate: bool = False
    need_weights: bool = False
    key_padding: torch.Tensor | bool | None = None
    memo: dict = field(default_factory=dict)

    # -- helpers used by the patched attention modules ------------------------------------------
    def native_window(self, layer: int) -> int | None:
        """The model's own sliding window on the encoding's layer ``layer`` (Mistral, Gemma 3's local layers;
        ``ModelInfo.sliding_windows``), or None. transformers has banded that layer's mask with it already; the
        tile engines and the kernels take it as a number too, to skip the key tiles outside it."""
        windows = self.info.sliding_windows
        if not windows or layer >= len(windows):
            return None
        return windows[layer]

    def own_window(self) -> int | None:
        """The sliding ``window`` of the encoding this context runs (its config's), or None."""
        return getattr(getattr(unwrap(self.encoding), "posenc_config", None), "window", None)

    def unwindowed(self, mask: torch.Tensor | None) -> torch.Tensor | None:
        """The attention mask before hf_posenc's sliding ``window`` (and its sinks) cut it: which keys are real
        tokens and have a real predecessor does not depend on which keys a query may attend to (FoX's gates between
        a sink and the window count). ``mask`` itself without an own window.
        (Only with an own window: the lookup by id(mask) makes torch.compile guard on the mask object.)"""
        if mask is None or self.own_window() is None:
            return mask
        return self.memo.get((UNWINDOWED_MASK, id(mask)), mask)

    def own_sink(self) -> int | None:
        """The ``sink`` of the encoding this context runs (its config's: the first keys every query sees beside its
        sliding window), or None."""
        return getattr(getattr(unwrap(self.encoding), "posenc_config", None), "sink", None)

    def own_sink_positions(self) -> str | None:
        """The ``sink_positions`` of the encoding this context runs (its config's: ``"cache"`` puts the sinks at their
        cache positions), or None."""
        return getattr(getattr(unwrap(self.encoding), "posenc_config", None), "sink_positions", None)

    def scale_queries(
        self, layer: int, query: torch.Tensor, k_len: int, mask: torch.Tensor | None, causal: bool
    ) -> torch.Tensor:
        """``query`` (B, H, Lq, D) times the factor of the encoding's ``length_scale`` (the query's logits scaled by
        the number of keys it sees: `hf_posenc.encodings.length_scale`), or ``query`` itself without one.
        ``mask``: the attention mask (B|1, 1, Lq, Lk) bool or None (read on bidirectional models)."""
        config = getattr(unwrap(self.encoding), "posenc_config", None)
        if config is None or config.length_scale is None:
            return query
        q_len = query.shape[2]
        n = keys_seen(self.position_ids if self.grid is None else None, mask, causal, q_len, k_len, self.q_offset,
                      self.engine_window(layer), self.own_sink(), query.device)
        factor = self.encoding("length_scale", self, layer, n)
        return (query.float() * factor).to(query.dtype)

    def engine_window(self, layer: int) -> int | None:
        """The window the tile engines and kernels skip key tiles for on the encoding's layer ``layer``: the
        narrower of the encoding's own (`own_window`) and the model's (`native_window`), or None."""
        return narrowest_window(self.own_window(), self.native_window(layer))

    def at(self, layer: int) -> "tuple[PosContext, int]":
        """(the context of model layer ``layer``, the layer's index for its encoding).

        With one encoding: ``(self, layer)``. With a plan (``hf_posenc.encodings.plan``): a context whose
        ``encoding`` is that layer's entry (fetched through the called module, so that a PEFT wrapper's trained
        copy is used), with the entry's model description and a memo of its own (built once per forward and
        shared by the entry's layers), and the layer's index among the entry's layers."""
        entries = getattr(unwrap(self.encoding), "layer_entries", None)
        if entries is None:
            return self, layer
        index, local = entries[layer]
        key = ("plan_entry", index)
        sub = self.memo.get(key)
        if sub is None:
            entry = self.encoding("entry", index)
            sub = dataclasses.replace(self, encoding=entry, info=unwrap(entry).info, memo={})
            self.memo[key] = sub
        return sub, local

    def prepare(
        self, layer: int, hidden: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Transform the new queries (B, H, Lq, D), keys and values (B, Hkv, Lq, D) before they enter the
        KV cache; ``hidden`` (B, Lq, C) is the attention input. Rotary encodings rotate q and k here;
        data-dependent ones may also append per-token state to k or v, so the cache carries it."""
        enc = unwrap(self.encoding)
        in_attention = getattr(enc, "has_score_bias", False) or getattr(enc, "custom_attention", False)
        if getattr(enc, "rotates_qk", False) and not getattr(enc, "uses_rotary_kernel", False) and not in_attention:
            # (a composition's or a remap's forced backend is its attention's: the rotation before it runs in PyTorch;
            # a rotary with a remap or a window attends through the remap engine, which has Triton kernels)
            if forced_backend() == "triton" and not (callable(getattr(enc, "remap", None)) and enc.remap() is not None):
                raise ValueError(
                    f"HF_POSENC_BACKEND='triton': {enc.name!r} has no Triton kernel for its q/k transform (an "
                    "elementwise rotation that PyTorch runs at memory bandwidth); unset HF_POSENC_BACKEND or "
                    "set it to 'torch'"
                )
        if getattr(enc, "prepares_qkv", False):
            return self.encoding("prepare", self, layer, hidden, q, k, v)
        if getattr(enc, "rotates_qk", False):
            q, k = self.encoding("rotate", self, q, k)
        return q, k, v

    def finish(self, layer: int, hidden: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Post-process the attention output (B, Lq, H, D) before the output projection (e.g. an output gate)."""
        if getattr(unwrap(self.encoding), "finishes_output", False):
            return self.encoding("finish", self, layer, hidden, out)
        return out

    def score_bias(self, q_len: int, k_len: int, device: torch.device, layer: int = 0) -> torch.Tensor | None:
        """The float32 additive bias (B or 1, H, Lq, Lk) of ``layer``: built once per forward and shared
        by the layers when the encoding shares it across layers and it needs no gradient, once per layer
        otherwise."""
        enc = unwrap(self.encoding)
        if not getattr(enc, "has_score_bias", False):
            return None
        layer = layer if getattr(enc, "bias_per_layer", False) else 0
        key = ("bias", q_len, k_len, device, layer)
        if key in self.memo:
            return self.memo[key]
        bias = self.encoding("bias", self, q_len, k_len, device, layer)
        # While training an encoding with trainable parameters, its bias is rebuilt in each layer rather than
        # shared: under gradient checkpointing a layer's recomputation must build (and save) exactly what
        # its first pass did, and reentrant checkpointing runs that first pass without autograd.
        # Ask the module that is called, not the one behind a wrapper: under PEFT's ModulesToSaveWrapper the
        # original is frozen and the trained copy holds the parameters that need gradients.
        called = self.encoding
        if not (called.training and any(p.requires_grad for p in called.parameters())):
            self.memo[key] = bias
        return bias

    def is_shared(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a bias held in the per-forward memo (so derived tensors may be memoised too)."""
        return any(v is tensor for v in self.memo.values())


def cache_sink_encodings() -> list[str]:
    """The registered encodings that take ``sink_positions="cache"`` (`PositionEncoding.takes_cache_sinks`), read
    now."""
    out = []
    for name in list_encodings():
        takes = getattr(get_encoding(name).cls, "takes_cache_sinks", None)
        if takes is not None and takes():
            out.append(name)
    return out


def unwrap(module: Any) -> Any:
    """The encoding behind a wrapper (PEFT's ModulesToSaveWrapper keeps it as ``original_module``)."""
    return getattr(module, "original_module", module)


def vit_token_coords(grid: tuple[int, int], device: torch.device | None = None) -> torch.Tensor:
    """(1 + rows*cols, 2) float32 (row, col) of the CLS token (row 0, unused) and the patches in raster order."""
    rows, cols = grid
    r = torch.arange(rows, device=device, dtype=torch.float32).repeat_interleave(cols)
    c = torch.arange(cols, device=device, dtype=torch.float32).repeat(rows)
    coords = torch.stack([r, c], dim=-1)
    return torch.cat([coords.new_zeros(1, 2), coords], dim=0)


@dataclass
class RelativePositions:
    """Where each key sits relative to each query, for biases built from distances.

    Text: ``rel`` = key index - query index (Lq, Lk) float32, where query i is key ``q_offset + i``.
    ViT: ``rows``/``cols`` = key - query offsets on the patch grid (Lq, Lk) float32, and ``cls`` (Lq, Lk)
    bool, True on every pair that involves the CLS token (which takes no positional term).
    """

    rel: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    cols: torch.Tensor | None = None
    cls: torch.Tensor | None = None

    @property
    def is_grid(self) -> bool:
        return self.rows is not None

    def distance(self) -> torch.Tensor:
        """Non-negative distance (Lq, Lk): |rel| on text, Euclidean on the grid (0 on CLS pairs)."""
        if not self.is_grid:
            return self.rel.abs()
        return torch.sqrt(self.rows.square() + self.cols.square()).masked_fill(self.cls, 0.0)


def relative_positions(ctx: "PosContext", q_len: int, k_len: int, device: torch.device) -> RelativePositions:
    """The `RelativePositions` of the last ``q_len`` queries against ``k_len`` keys (float32)."""
    if ctx.grid is None:
        q_idx = torch.arange(q_len, device=device, dtype=torch.float32) + ctx.q_offset
        k_idx = torch.arange(k_len, device=device, dtype=torch.float32)
        return RelativePositions(rel=k_idx[None, :] - q_idx[:, None])
    coords = vit_token_coords(ctx.grid, device)
    q, k = coords[-q_len:], coords[-k_len:]
    is_cls = torch.zeros(coords.shape[0], dtype=torch.bool, device=device)
    is_cls[0] = True
    cls = is_cls[-q_len:, None] | is_cls[None, -k_len:]
    rows = (k[None, :, 0] - q[:, None, 0]).masked_fill(cls, 0.0)
    cols = (k[None, :, 1] - q[:, None, 1]).masked_fill(cls, 0.0)
    return RelativePositions(rows=rows, cols=cols, cls=cls)


class PositionEncoding(nn.Module):
    """Base class. Subclasses set the capability flags and implement the matching methods."""

    name: ClassVar[str] = "?"
    adds_embeddings: ClassVar[bool] = False
    rotates_qk: ClassVar[bool] = False
    has_score_bias: ClassVar[bool] = False
    #: computes the whole attention itself (``attend``), e.g. for a value term or a logit MLP.
    custom_attention: ClassVar[bool] = False
    #: transforms q, k, v (with the attention input at hand) before the KV cache (``prepare``).
    prepares_qkv: ClassVar[bool] = False
    #: post-processes the attention output before the output projection (``finish``).
    finishes_output: ClassVar[bool] = False
    #: whether ``score_bias`` differs per layer (else it is built once per forward and shared).
    bias_per_layer: bool = False
    #: the fused-attention term kinds ``kernel_term`` can return (see hf_posenc.kernels.attention.terms).
    kernel_kinds: ClassVar[tuple[str, ...]] = ()
    #: Shift invariance on text: adding one constant to every ``position_ids`` leaves the outputs unchanged
    #: (the encoding sees positions only through differences, or not at all). Each encoding that claims it
    #: sets it with the reason beside it; tests/test_properties.py checks every claim. Read it on an instance
    #: (``cape`` derives it from its base bias). ViT has no position_ids: see each docstring for the grid.
    relative: ClassVar[bool] = False
    #: Peak memory of the PyTorch reference of ``score_bias`` (with the attention that uses the bias) or
    #: ``attend``, in float32 (B, H, Lq, Lk) tensors: (without autograd, with it). Measured at L = 4096 and
    #: 2048 (tests/test_long_inputs.py reports it); ``reference_bytes`` turns it into bytes for the pre-check
    #: of hf_posenc.memory, which refuses a shape that would not fit with an error naming the amount.
    reference_footprint: ClassVar[tuple[float, float]] = (0.0, 0.0)
    #: A term's inert start (``init="identity"`` of a composition, `hf_posenc.encodings.compose`): the
    #: parameters whose zero makes the term add exactly nothing; empty where none does.
    inert_zero: ClassVar[tuple[str, ...]] = ()
    #: why the encoding has no inert start, in ``start_inert``'s error.
    no_inert_reason: ClassVar[str] = "no setting of its parameters makes it add nothing"
    #: Whether the encoding takes ``sink_positions="cache"`` (the window's sinks at their cache positions, at distance
    #: W + sink − 1 − j): only where its contribution depends on the distance alone (rope: a remap of its rotary
    #: distance). Read through ``takes_cache_sinks`` (``TermEncoding`` derives it from its terms).
    cache_sink_positions: ClassVar[bool] = False

    def __init__(self, config: PosEncConfig, info: ModelInfo) -> None:
        super().__init__()
        self.posenc_config = config
        self.info = info
        self.check_model(info)
        self._check_layer_options(config, info)
        if config.length_scale == "ssmax":
            #: SSMax's s (layers of this encoding, heads): see hf_posenc.encodings.length_scale.
            self.ssmax_scale = nn.Parameter(torch.full((info.num_layers, info.num_heads), ssmax_start(info)))

    @classmethod
    def takes_cache_sinks(cls) -> bool:
        """Whether the encoding takes ``sink_positions="cache"`` (``cache_sink_positions``)."""
        return bool(cls.cache_sink_positions)

    def cache_sinks(self) -> CacheSinks | None:
        """The `CacheSinks` of this encoding's layers (``sink_positions="cache"`` with its window and sinks on a causal
        model), or None."""
        config = self.posenc_config
        return cache_sinks(config.sink_positions, config.window, config.sink, self.info.causal)

    @staticmethod
    def _check_layer_options(config: PosEncConfig, info: ModelInfo) -> None:
        """``ValueError`` where the model cannot take the layer options ``sink`` and ``length_scale``."""
        check_length_scale_model(config.length_scale, info, config.sink, config.window, config.name)
        takes = getattr(config.spec.cls, "takes_cache_sinks", None)
        if config.sink_positions == "cache" and not (takes is not None and takes()):
            raise ValueError(
                f"sink_positions='cache' of {config.name!r}: the sinks at their cache positions move each sink's "
                "distance to W + sink - 1 - j, which suits only encodings whose term depends on the distance alone: "
                f"rotary and Toeplitz terms ({', '.join(cache_sink_encodings())}; not a composition); use "
                "sink_positions='text' (the default)"
            )
        if config.sink_positions == "cache" and not info.causal:
            raise ValueError(f"sink_positions='cache' of {config.name!r} is defined on causal models only")
        if config.sink is not None and any(w is not None for w in info.sliding_windows or ()):
            raise ValueError(
                f"sink={config.sink} of {config.name!r} on a {info.family} model with its own sliding window: "
                "transformers' mask and sliding cache drop the first keys of those layers before hf_posenc sees them; "
                "turn the model's window off (e.g. config.sliding_window = None before building the model) and give "
                "window= and sink= to the encoding instead"
            )

    def length_scale(self, ctx: "PosContext", layer: int, n: torch.Tensor) -> torch.Tensor:
        """The factor (B|1, H|1, Lq, 1) float32 of ``length_scale`` on the queries of ``layer`` that see ``n``
        keys (B|1, 1, Lq, 1) (`hf_posenc.encodings.length_scale`)."""
        kind = self.posenc_config.length_scale
        s = self.ssmax_scale[layer] if kind == "ssmax" else None
        return length_scale_factor(kind, n, self.info.max_positions, s)

    def skips_engines(self, ctx: "PosContext", query: torch.Tensor, key: torch.Tensor) -> bool:
        """Whether this call skips the fused and tile engines because the encoding's own path is the faster one
        there: ``attend`` for a custom attention, else the score bias as SDPA's float mask (read by the attention
        function). False; fox_pro's and fire's CPU decoding steps say True."""
        return False

    # -- per-layer weights ----------------------------------------------------------------------------
    def layer_slice(self, ctx: "PosContext | None", tag: object, layer: int, build: Any) -> torch.Tensor:
        """``build(layer)``: a layer's weights from the parameters stacked on dim 0 (``build`` indexes them with
        its argument, an int or ``slice(None)``, and keeps that dimension first).

        Without gradients (a decoding step) and outside ``torch.compile``, ``build(slice(None))`` runs once per
        forward for every layer, kept in ``ctx.memo`` under ``tag`` and unbound per layer: a decoding step pays
        per operation, and a select (or a concatenation) per parameter and layer added up. With gradients each
        layer builds its own (the graph then holds no node shared by the layers, which reentrant checkpointing
        replays one layer at a time). ``build`` must not copy large weights (every layer's copy would be held
        for the whole forward): slices, views and small derived tensors."""
        if ctx is None or torch.is_grad_enabled() or torch.compiler.is_compiling():
            return build(layer)
        key = ("layer_slice", id(self), tag)
        rows = ctx.memo.get(key)
        if rows is None:
            rows = ctx.memo[key] = build(slice(None)).unbind(0)
        return rows[layer]

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def resolve(cls, config: PosEncConfig, info: ModelInfo) -> PosEncConfig:
        """Fill parameters left as ``None`` from the model; raise ``ValueError`` where the model cannot take it."""
        return config

    def check_model(self, info: ModelInfo) -> None:
        """Raise ``ValueError`` if this encoding cannot work on a model of this shape."""

    def adopt_native(self, native: dict[str, torch.Tensor]) -> bool:
        """Take over the model's own position weights (e.g. GPT-2's ``wpe``) if they fit; True if adopted."""
        return False

    def angular_rate(self) -> float:
        """Radians per unit of position of the fastest rotation the encoding applies to q and k. A float32 angle
        rounds by its own ulp, so an angle at position p is off by about p · rate · 6e-8: shift invariance in float32
        holds only to that (tests/test_properties.py's bound scales with it). 1.0 for an encoding that rotates:
        RoPE's fastest pair turns by theta^0 = 1 radian per position, and the other fixed frequencies are no faster;
        0.0 for one that does not. Encodings whose rate is learned (liere, comrope, rope2d mixed) measure theirs."""
        return 1.0 if self.rotates_qk else 0.0

    def start_inert(self) -> str:
        """Set the parameters so that the term changes nothing (``init="identity"``); returns how exact that is
        (``"exact"``, or the documented tolerance). Raises ``ValueError`` with the reason where there is none."""
        if not self.inert_zero:
            raise ValueError(f"{self.name!r} has no inert start (init='identity'): {self.no_inert_reason}")
        with torch.no_grad():
            for name in self.inert_zero:
                weight = getattr(self, name, None)
                if weight is not None:
                    weight.zero_()
        return "exact"

    # -- the call interface -----------------------------------------------------------------------
    def forward(self, op: str, *args: Any, **kwargs: Any) -> Any:
        if op == "embed":
            return self.embed(*args, **kwargs)
        if op == "rotate":
            return self.rotate(*args, **kwargs)
        if op == "bias":
            self._check_bias_memory(*args, **kwargs)
            return self.score_bias(*args, **kwargs)
        if op == "attend":
            self._check_attend_memory(*args, **kwargs)
            return self.attend(*args, **kwargs)
        if op == "prepare":
            return self.prepare(*args, **kwargs)
        if op == "finish":
            return self.finish(*args, **kwargs)
        if op == "kernel_term":
            return self.kernel_term(*args, **kwargs)
        if op == "length_scale":
            return self.length_scale(*args, **kwargs)
        raise ValueError(
            f"unknown operation {op!r} for encoding {self.name!r}; allowed: embed, rotate, bias, attend, prepare, "
            "finish, kernel_term, length_scale"
        )

    # -- memory pre-check of the O(L^2) references (see hf_posenc.memory) -------------------------------
    def reference_bytes(self, batch: int, heads: int, q_len: int, k_len: int, grad: bool, itemsize: int = 4) -> int:
        """Estimated peak bytes of this encoding's reference attention at this shape (``grad``: with autograd)."""
        return int(self.reference_footprint[1 if grad else 0] * batch * heads * q_len * k_len * itemsize)

    def attend_uses_reference(self, ctx: PosContext, dropout: float, training: bool) -> bool:
        """Whether ``attend`` runs its O(L^2) PyTorch reference for this call (the memory pre-check applies to
        that reference only). True here; an encoding whose ``attend`` also has kernels or a tile-wise engine
        (O(L · block) memory) says when it does not (see `EngineAttention`)."""
        return True

    def _check_attend_memory(
        self,
        ctx: PosContext,
        layer: int,
        query: Any,
        key: Any,
        value: Any = None,
        mask: Any = None,
        scaling: float = 1.0,
        dropout: float = 0.0,
        training: bool = False,
    ) -> None:
        """Before ``attend``, with its arguments (same names): raise ``ReferenceMemoryError`` before building the
        O(L^2) intermediates of the reference if they would not fit the budget (only where the reference runs:
        `attend_uses_reference`)."""
        if not self.attend_uses_reference(ctx, dropout, training):
            return
        if not (isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor)):
            return
        batch, heads, q_len = query.shape[:3]
        itemsize = 8 if query.dtype == torch.float64 else 4
        self._check_memory("attention", batch, heads, q_len, key.shape[2], query.device, itemsize)

    def _check_bias_memory(self, ctx: PosContext, q_len: int, k_len: int, device: Any, layer: int = 0) -> None:
        """Before ``score_bias``, with its arguments (same names): the same pre-check for the bias and the
        attention that uses it."""
        position_ids = getattr(ctx, "position_ids", None)
        batch = position_ids.shape[0] if isinstance(position_ids, torch.Tensor) and position_ids.dim() == 2 else 1
        self._check_memory("score bias", batch, self.info.num_heads, q_len, k_len, device, 4)

    def _check_memory(
        self, what: str, batch: int, heads: int, q_len: int, k_len: int, device: Any, itemsize: int
    ) -> None:
        from ..memory import check_reference_memory

        if torch.compiler.is_compiling():
            return  # not checked in compiled graphs (hf_posenc.memory says why)
        nbytes = self.reference_bytes(batch, heads, int(q_len), int(k_len), torch.is_grad_enabled(), itemsize)
        shape = f"{what} at B={batch}, H={heads}, Lq={q_len}, Lk={k_len}"
        check_reference_memory(self.name, shape, nbytes, torch.device(device))

    def embed(self, ctx: PosContext, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        raise NotImplementedError

    def rotate(self, ctx: PosContext, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def score_bias(
        self, ctx: PosContext, q_len: int, k_len: int, device: torch.device, layer: int = 0
    ) -> torch.Tensor:
        raise NotImplementedError

    def prepare(
        self, ctx: PosContext, layer: int, hidden: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B, H, Lq, D), k/v (B, Hkv, Lq, D), hidden (B, Lq, C) -> q, k, v as they enter the cache.
        Whatever is appended to k or v along the last dim is cached with them (and follows ``crop``,
        beam-search reordering and StaticCache); ``attend`` receives it back for all keys."""
        raise NotImplementedError

    def finish(self, ctx: PosContext, layer: int, hidden: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out (B, Lq, H, D) -> out, before the output projection; hidden (B, Lq, C) is the attention input."""
        raise NotImplementedError

    def attend(self, ctx: PosContext, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               mask: torch.Tensor | None, scaling: float, dropout: float, training: bool
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The whole attention: q (B, H, Lq, D), k/v (B, Hkv, Lk, D), mask (B|1, 1, Lq, Lk) bool or None.
        Returns out (B, H, Lq, D) and the probabilities (B, H, Lq, Lk) or None."""
        raise NotImplementedError

    def kernel_term(
        self,
        ctx: PosContext,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> Any:
        """The position term of ``layer`` for the fused attention kernels (a ``KernelTerm``), or None when
        this encoding has none for this model (the attention then runs the reference). Arguments as for
        ``attend``; the term may replace the keys and values (e.g. to strip cached state channels)."""
        return None

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.posenc_config.params.items())


class EngineAttention(PositionEncoding):
    """A custom attention (``attend``) that runs a fused kernel or a tile-wise PyTorch engine (O(L · block)
    memory, no probabilities formed) on causal models, and its full-matrix O(L^2) reference only where those
    cannot: the probabilities requested (``output_attentions``), attention dropout while training, or a
    bidirectional model (ViT, BERT). CoPE and stick-breaking attention."""

    def attend_uses_reference(self, ctx: PosContext, dropout: float, training: bool) -> bool:
        """Whether ``attend`` runs the full-matrix reference rather than a kernel or the tile-wise engine."""
        return not self.info.causal or ctx.need_weights or (dropout > 0.0 and training)

    def attend(self, ctx: PosContext, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               mask: torch.Tensor | None, scaling: float, dropout: float, training: bool
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The attention (arguments and shapes as for `PositionEncoding.attend`): the fused kernel where
        `engine_backend` says ``"triton"`` (on CUDA, or forced with ``HF_POSENC_BACKEND=triton``), else the tile-wise
        PyTorch engine (O(L·block) memory), both through `engine` and neither forming the probabilities (None is
        returned for them); the full-matrix `reference` where `attend_uses_reference` (or `engine_backend`) says so.

        Raises:
            ValueError: ``HF_POSENC_BACKEND`` names no backend, or names ``triton`` and the kernel cannot run.
        """
        # a sliding window (hf_posenc's, the model's own) and its sinks are in ``mask`` already (a band and the
        # first columns); the engines also take them as numbers, to skip the key tiles outside them
        window, sink = ctx.engine_window(layer), ctx.own_sink()
        backend = self.engine_backend(ctx, query, key, value, mask, dropout, training)
        if backend == "triton" or (backend == "torch" and not self.attend_uses_reference(ctx, dropout, training)):
            return self.engine(backend, layer, query, key, value, mask, scaling, ctx.q_offset, window, sink), None
        return self.reference(ctx, layer, query, key, value, mask, scaling, dropout, training)

    def engine_backend(self, ctx: PosContext, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       mask: torch.Tensor | None, dropout: float, training: bool) -> str:
        """``"triton"`` (the fused kernel), ``"torch"`` (the tile-wise engine, unless `attend_uses_reference`) or
        ``"reference"`` for this call of ``attend`` (same arguments). Raises ``ValueError`` where a forced
        ``HF_POSENC_BACKEND=triton`` cannot run."""
        raise NotImplementedError

    def engine(self, backend: str, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               mask: torch.Tensor | None, scaling: float, q_offset: int | torch.Tensor, window: int | None,
               sink: int | None) -> torch.Tensor:
        """out (B, H, Lq, D) in the query's dtype from the fused kernel (``backend="triton"``) or the tile-wise
        engine (``"torch"``); ``window`` and ``sink`` as `PosContext.engine_window` and `PosContext.own_sink`."""
        raise NotImplementedError

    def reference(self, ctx: PosContext, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  mask: torch.Tensor | None, scaling: float, dropout: float, training: bool
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """The full-matrix reference (arguments as for ``attend``): out (B, H, Lq, D) in the query's dtype and the
        probabilities (B, H, Lq, Lk) (float32)."""
        raise NotImplementedError
