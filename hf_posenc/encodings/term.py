"""``TermEncoding``: the base of an encoding whose contribution is one position term inside the attention.

The term is stated once, as a registered ``hf_posenc.kernels.attention.terms.TermSpec``
(``hf_posenc.register_term``); the encoding holds its parameters and builds the term's tensors from them
(``TermEncoding.term``). Everything else derives from that one statement:

* ``kernel_term`` (what the engines take: the tile engine, FlexAttention, the Triton kernel where the term has a
  branch) is ``TermEncoding.term`` on text;
* ``score_bias`` (the full-matrix reference, used where the engines do not run: ``output_attentions``, attention
  dropout in training, a custom mask) is the registry's reference bias of the same term
  (``hf_posenc.kernels.attention.naive.term_bias``): no second formula;
* ``sink_positions="cache"`` (the window's sinks at their cache positions) where every kind the encoding returns is
  a Toeplitz term (``takes_cache_sinks``): the engines and ``score_bias`` take a far sink's term at its cache
  distance (`hf_posenc.kernels._masks.CacheSinks`);
* on ViT's 2D patch grid (no 1D term), the encoding's grid form: ``grid_distance = "euclidean"`` evaluates a
  Toeplitz term's value at the Euclidean distance between the two patches (no term on pairs that involve the CLS
  token, as ALiBi and KERPLE do), or a subclass overrides ``TermEncoding.grid_bias``; an encoding with neither
  does not take ViT (register it with ``families`` that leave ViT out).

Built-in score biases (alibi, kerple, sandwich, t5, dpb) and a user's own file use this same base; see
docs/adding-an-encoding.md and ``examples/custom_term.py``.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ..config import PosEncConfig
from ..kernels.attention.naive import term_bias
from ..kernels.attention.terms import KernelTerm, term_spec
from .base import ModelInfo, PosContext, PositionEncoding, relative_positions

__all__ = ["TermEncoding"]

#: the grid forms ``TermEncoding.grid_distance`` names.
GRID_DISTANCES = ("euclidean",)


class TermEncoding(PositionEncoding):
    """An encoding that adds one registered position term to the logits (see the module docstring).

    Subclasses set ``kernel_kinds`` (the registered kinds ``term`` returns), implement ``term``, and may
    set ``grid_distance`` (or override ``grid_bias``) for ViT, ``inert_zero`` (the parameters whose zero
    makes the term add nothing: ``init="identity"`` of a composition), ``relative`` (shift invariance on text, which
    the property tests then check) and ``bias_per_layer`` (False when every layer's term is the same: the reference
    bias is then built once per forward).
    """

    has_score_bias = True
    #: the term may differ per layer (a subclass whose layers share one term sets False: one bias per forward).
    bias_per_layer = True
    #: ViT's form of the term: ``"euclidean"`` (a Toeplitz term's value at the patches' Euclidean distance, no term
    #: on CLS pairs) or None (override ``grid_bias``, or leave ViT out of the encoding's families).
    grid_distance: ClassVar[str | None] = None
    #: float32 (B, H, Lq, Lk) tensors of the reference path (hf_posenc.memory's pre-check): KERPLE's, the largest
    #: measured among the built-in Toeplitz terms; a subclass that measured its own sets it.
    reference_footprint = (3.0, 8.0)

    def __init__(self, config: PosEncConfig, info: ModelInfo) -> None:
        super().__init__(config, info)
        if not self.kernel_kinds:
            raise ValueError(f"{type(self).__name__} sets no kernel_kinds: the registered term kinds its term() "
                             "returns")
        for kind in self.kernel_kinds:
            spec = term_spec(kind)  # ValueError naming the registered kinds: register the term first
            if spec.value_term is not None or spec.prepare is not None:
                raise ValueError(f"{type(self).__name__}: the {kind} term reads the queries or adds a value term; a "
                                 "TermEncoding adds a score bias (its reference is a bias of the positions alone)")
        if self.grid_distance is not None and self.grid_distance not in GRID_DISTANCES:
            raise ValueError(f"{type(self).__name__}.grid_distance must be one of {GRID_DISTANCES} or None, got "
                             f"{self.grid_distance!r}")

    @classmethod
    def takes_cache_sinks(cls) -> bool:
        """``sink_positions="cache"`` moves a far sink's distance: taken where every kind of ``kernel_kinds`` is a
        Toeplitz term (a function of the distance alone; its registry entry says so)."""
        return bool(cls.kernel_kinds) and all(term_spec(kind).form == "toeplitz" for kind in cls.kernel_kinds)

    def term(self, ctx: PosContext, layer: int, q_len: int, k_len: int, device: torch.device) -> KernelTerm | None:
        """The position term of ``layer`` for ``q_len`` queries (key indices ``ctx.q_offset`` + i) against
        ``k_len`` keys on ``device``: ``KernelTerm.build(kind, **tensors)`` (or ``KernelTerm.<kind>(...)``) with
        tensors built from the encoding's parameters (gradients flow back to them), or None for no term. Text only
        (1D positions)."""
        raise NotImplementedError

    def kernel_term(self, ctx: PosContext, layer: int, query, key, value, mask) -> KernelTerm | None:
        """``term`` on text; None on ViT's 2D grid (the reference then runs ``grid_bias``)."""
        if ctx.grid is not None:
            return None
        return self.term(ctx, layer, query.shape[2], key.shape[2], query.device)

    def score_bias(
        self, ctx: PosContext, q_len: int, k_len: int, device: torch.device, layer: int = 0
    ) -> torch.Tensor:
        """(B|1, H, Lq, Lk) float32 (float64 for float64 parameters): on text the registry's reference bias of
        ``term`` (the term's one formula; with the sinks at their cache positions, a far sink's at its cache
        distance), on ViT ``grid_bias``."""
        if ctx.grid is not None:
            return self.grid_bias(ctx, q_len, k_len, device, layer)
        term = self.term(ctx, layer, q_len, k_len, device)
        bias = None if term is None else term_bias(term, None, q_len, k_len, ctx.q_offset,
                                                   cache_sinks=self.cache_sinks())
        if bias is None:
            return torch.zeros(1, self.info.num_heads, q_len, k_len, device=device)
        return bias

    def grid_bias(
        self, ctx: PosContext, q_len: int, k_len: int, device: torch.device, layer: int = 0
    ) -> torch.Tensor:
        """ViT's bias (1, H, Lq, Lk) on the patch grid: with ``grid_distance = "euclidean"``, the Toeplitz term of
        ``term`` at the Euclidean distance between the two patches (its ``distance`` function takes real
        distances), 0 on every pair that involves the CLS token."""
        if self.grid_distance != "euclidean":
            raise ValueError(f"{self.name!r} has no form on ViT's patch grid (set grid_distance or override "
                             "grid_bias, or register it without the vit family)")
        term = self.term(ctx, layer, q_len, k_len, device)
        spec = term.spec
        if spec.form != "toeplitz":
            raise ValueError(f"grid_distance='euclidean' takes a Toeplitz term; {term.kind} is a {spec.form} term")
        rel = relative_positions(ctx, q_len, k_len, device)
        heads = torch.arange(self.info.num_heads, device=device)[:, None, None]
        bias = spec.distance_values(term.tensors, heads, rel.distance()[None])  # (H, Lq, Lk)
        return bias.masked_fill(rel.cls, 0.0)[None]

    def check_model(self, info: ModelInfo) -> None:
        """ViT needs a grid form (``grid_distance`` or an own ``grid_bias``)."""
        if info.family == "vit" and self.grid_distance is None and type(self).grid_bias is TermEncoding.grid_bias:
            raise ValueError(f"{type(self).__name__} has no form on ViT's patch grid: set grid_distance or override "
                             "grid_bias, or register the encoding with families that leave vit out")
