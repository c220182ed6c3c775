"""``cape``: context-adaptive positional encoding.

"CAPE: Context-Adaptive Positional Encoding for Length Extrapolation", Zheng et al. (first titled
"DAPE: Data-Adaptive Positional Encoding for Length Extrapolation", NeurIPS 2024),
https://arxiv.org/abs/2405.14722. Each layer's pre-softmax scores are

    A = Q K^T * scaling + B + f(Q K^T * scaling, B),

where B (H, Lq, Lk) is a base positional bias (ALiBi, Kerple or FIRE) and f is a two-layer MLP with a
LeakyReLU (negative slope 0.01, PyTorch's default) applied at every (i, j) across the heads: its input
is the concatenation [logits_1..H, B_1..H] (2H values: the scaled logits first, then the bias, the
order of the authors' code), its hidden width is ``mlp_hidden`` and its output has H values, one per
head. f sees the scaled logits before the mask; the (causal / padding) mask is applied afterwards,
then the softmax (in float32). As f is applied entry by entry, row i of A depends only on q_i, the keys
and B(i, .): the KV cache, causality and left padding are kept.

Choices, following the paper and the authors' code (github.com/chuanyang-Zheng/DAPE,
``megatron/model/positional_embeddings.py``, classes ``AliBi_C``, ``ParallelKerpleLog_C``, ``FIRE_C``):

* every layer has its own MLP (the authors build one per attention layer);
* ``mlp_hidden`` defaults to 32 (the paper's D_DAPE; ``mlp_width: 32`` in every config of the authors;
  the paper ablates the width);
* initialisation: PyTorch's default ``nn.Linear`` initialisation, U(-1/sqrt(fan_in), 1/sqrt(fan_in)),
  as in the authors' code (the paper states no other). f starts as a random but bounded correction:
  O(1), like the logits, near the diagonal, growing with |B| but well below |B| far from it (ALiBi,
  4 heads, 512 tokens: mean |f| 2.3 where B reaches -128), so attention at initialisation is still
  dominated by the base bias and stays finite. A zero initialisation is not used: it would also leave
  f's first layer without gradient at the start;
* the base bias ``base`` ("alibi", "kerple" or "fire", default "alibi") is the registered encoding of
  that name with its default parameters, built as the child module ``base``: its learned parameters
  (Kerple's r1, r2; FIRE's MLP, c, L) are trained and saved with the model, and it keeps its own
  per-layer semantics (``bias_per_layer``: by default one Kerple kernel shared by all layers, as in the
  KERPLE authors' code, and a FIRE function per layer, as in FIRE's; ALiBi has no parameters and is shared). Kerple is its default ``log`` variant, the
  one the authors use. For ``base="fire"`` the base is this package's FIRE, exact to the FIRE paper
  (ReLU, L initialised to 512); the authors' ``FIRE_C`` differs slightly (a LeakyReLU inside FIRE's MLP
  and L initialised to half their training length).

With f's last layer at zero, CAPE is exactly attention with the base bias.

Implementation: on text, ``attend`` runs the tile-wise attention of ``hf_posenc.kernels.cape.tiled`` (plain
PyTorch, any device; O(L · block) memory: per query block × key block it builds the logits, the base bias
tile from the base's registered term (ALiBi's slopes, Kerple's r1/r2, FIRE's table of f_θ with c and each
query's normaliser), evaluated by the term registry as every attention engine evaluates it, the MLP across
heads, an online softmax, and recomputes in backward). On text B is that term's bias in the reference too
(FIRE: its tabulated f_θ, as the attention engines use it; within its interpolation error of FIRE's exact
``score_bias``). The full-matrix reference (``hf_posenc.kernels.cape.naive``, (B, Lq, Lk, 2H) tensors) runs
where the tiles do not: attention probabilities requested (``output_attentions``), attention dropout in
training, ViT's 2D grid (short sequences), and FIRE on bidirectional text (its term is causal; the reference
takes its ``score_bias`` there). There is no Triton kernel for CAPE.

ViT (bidirectional): the base bias is the base encoding's own ViT form (distances on the 2D patch grid,
no term on pairs involving the CLS token); there is no mask, and f runs on every pair, CLS pairs
included, where its positional input B is 0 (it then adapts the logits only, with no position signal).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from ..config import PosEncConfig
from ..kernels.attention.naive import term_bias
from ..kernels.attention.terms import KernelTerm
from ..kernels.cape import cape_attention_reference, cape_attention_tiled, cape_scores_reference
from ..registry import get_encoding, param, register_encoding
from . import alibi as _alibi, fire as _fire  # noqa: F401  (importing them registers the base biases built by name)
from .base import ModelInfo, PosContext, PositionEncoding
from .term import TermEncoding

__all__ = ["Cape", "CapeMLP", "CAPE_BASES"]

#: the base biases CAPE can adapt (score-bias encodings of the registry).
CAPE_BASES = ("alibi", "kerple", "fire")


@dataclass
class CapeParams:
    base: str = param("alibi", "the base positional bias B that the MLP adapts", type=str, choices=CAPE_BASES)
    mlp_hidden: int = param(32, "hidden width of the per-layer MLP f (paper: D_DAPE = 32)", type=int, ge=1)


class CapeMLP(nn.Module):
    """f: 2H -> hidden -> H with a LeakyReLU, applied on the last dimension."""

    def __init__(self, num_heads: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(2 * num_heads, hidden)
        self.fc2 = nn.Linear(hidden, num_heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., 2H) -> (..., H), computed in the dtype of ``x`` (float32 or float64)."""
        w1, b1, w2, b2 = (t.to(x.dtype) for t in (self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias))
        return F.linear(F.leaky_relu(F.linear(x, w1, b1), negative_slope=0.01), w2, b2)


@register_encoding(
    "cape",
    params=CapeParams,
    kind="score mix",
    summary="per-layer MLP over (scaled logits, base bias) across heads, added to both; base alibi/kerple/fire",
    paper="https://arxiv.org/abs/2405.14722",
)
class Cape(PositionEncoding):
    """CAPE (DAPE); see the module docstring for the formula and the choices."""

    custom_attention = True

    def __init__(self, config: PosEncConfig, info: ModelInfo) -> None:
        super().__init__(config, info)
        p = config.params
        spec = get_encoding(p["base"])
        if not getattr(spec.cls, "has_score_bias", False):
            raise ValueError(f"cape needs a score-bias encoding as its base, got {p['base']!r}")
        if info.family not in spec.families:
            raise ValueError(f"cape's base {p['base']!r} does not support {info.family}")
        base_config = spec.cls.resolve(PosEncConfig(p["base"]), info)
        self.base = spec.cls(base_config, info)
        self.mlps = nn.ModuleList(CapeMLP(info.num_heads, p["mlp_hidden"]) for _ in range(info.num_layers))

    def reference_bytes(self, batch: int, heads: int, q_len: int, k_len: int, grad: bool, itemsize: int = 4) -> int:
        """The MLP runs on every (query, key) pair: (B, Lq, Lk, 2H) inputs and (B, Lq, Lk, mlp_hidden) activations
        dominate (measured: 5.0 GiB without autograd at L = 4096, B = 1, H = 4, hidden 32). The base bias is
        checked on its own."""
        hidden = self.posenc_config.params["mlp_hidden"]
        per_pair = (3.5 * hidden + 10 * heads) if grad else (2 * hidden + 8 * heads)
        return int(per_pair * batch * q_len * k_len * itemsize)

    def start_inert(self) -> str:
        """``init="identity"``: the base bias inert (only ``base="fire"`` has an inert start) and f's last layer
        at zero, so A = Q K^T * scaling exactly."""
        try:
            self.base.start_inert()
        except ValueError as e:
            raise ValueError(f"cape has no inert start with base={self.base.name!r} ({e}); use base='fire'") from None
        with torch.no_grad():
            for mlp in self.mlps:
                mlp.fc2.weight.zero_()
                mlp.fc2.bias.zero_()
        return "exact"

    @property
    def relative(self) -> bool:  # type: ignore[override]
        """Shift invariant on text exactly when the base bias is (alibi, kerple: yes; fire: no): f only sees
        the logits and B."""
        return bool(self.base.relative)

    # -- the terms ---------------------------------------------------------------------------------
    def base_bias(self, ctx: PosContext, q_len: int, k_len: int, device: torch.device, layer: int) -> torch.Tensor:
        """The base bias B (B|1, H, Lq, Lk) of ``layer``, float32.

        Built once per forward and shared by the layers when the base shares it across layers and it needs
        no gradient; rebuilt in each layer while a base with trainable parameters is training (as
        ``PosContext.score_bias`` does), so that a layer recomputed under gradient checkpointing builds,
        with autograd, what its first pass built (reentrant checkpointing runs that first pass without)."""
        idx = layer if getattr(self.base, "bias_per_layer", False) else 0
        key = ("cape_base", q_len, k_len, device, idx)
        if key in ctx.memo:
            return ctx.memo[key]
        term = self._base_kernel_term(ctx, idx, q_len, k_len, device)
        if term is None:  # ViT's grid, FIRE on bidirectional text: the base's own bias
            bias = self.base("bias", ctx, q_len, k_len, device, idx)
        else:  # text: the base's term, as the tiles evaluate it (its reference bias)
            self.base._check_bias_memory(ctx, q_len, k_len, device, idx)
            bias = term_bias(term, None, q_len, k_len, ctx.q_offset)
        if not (self.base.training and any(p.requires_grad for p in self.base.parameters())):
            ctx.memo[key] = bias
        return bias

    def scores(
        self, ctx: PosContext, layer: int, query: torch.Tensor, key: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        """Pre-mask scores A = L + B + f(L, B), L = Q K^T * scaling: (B, H, Lq, Lk) in float32 (float64 inputs
        stay float64). query (B, H, Lq, D), key (B, Hkv, Lk, D)."""
        if query.shape[1] % key.shape[1]:
            raise ValueError(f"query heads ({query.shape[1]}) must be a multiple of key/value heads ({key.shape[1]})")
        bias = self.base_bias(ctx, query.shape[2], key.shape[2], query.device, layer)
        mlp = self.mlps[layer]
        return cape_scores_reference(
            query, key, bias, mlp.fc1.weight, mlp.fc1.bias, mlp.fc2.weight, mlp.fc2.bias, scaling
        )

    # -- the tile-wise path -----------------------------------------------------------------------
    def uses_tiles(self, ctx: PosContext, dropout: float, training: bool) -> bool:
        """Whether ``attend`` runs the tile-wise attention: text where the base has its term (FIRE's is causal), no
        probabilities requested, no attention dropout in training (the reference runs otherwise)."""
        has_term = isinstance(self.base, TermEncoding) or self.info.causal
        return ctx.grid is None and has_term and not ctx.need_weights and not (dropout > 0 and training)

    def _base_kernel_term(self, ctx: PosContext, layer: int, q_len: int, k_len: int,
                          device: torch.device) -> KernelTerm | None:
        """The base encoding's term of ``layer`` on text (the term registry's statement of the base bias), or None
        where it has none (ViT's grid; FIRE on bidirectional text)."""
        if ctx.grid is not None:
            return None
        return self.base.term(ctx, layer, q_len, k_len, device)

    def base_term(self, ctx: PosContext, layer: int, q_len: int, k_len: int,
                  device: torch.device) -> tuple[str, tuple] | None:
        """The base bias of ``layer`` as its registered term: (kind, its tensors in the registry's order), what the
        tiles evaluate (``hf_posenc.kernels.cape.bias_tile``); gradients reach the base's parameters through them.
        None where the base has no term (ViT's grid; FIRE on bidirectional text)."""
        term = self._base_kernel_term(ctx, layer, q_len, k_len, device)
        return None if term is None else (term.kind, tuple(term.tensors.values()))

    def attend_uses_reference(self, ctx: PosContext, dropout: float, training: bool) -> bool:
        """The O(L^2) pre-check applies to the reference only: the tiles need O(L · block)."""
        return not self.uses_tiles(ctx, dropout, training)

    def attend(self, ctx: PosContext, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               mask: torch.Tensor | None, scaling: float, dropout: float, training: bool
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """CAPE attention: q (B, H, Lq, D), k/v (B, Hkv, Lk, D), mask (B|1, 1, Lq, Lk) bool (True = attend;
        causality included) or None. Returns out (B, H, Lq, D) and the probabilities (B, H, Lq, Lk), or None
        for them on the tile-wise path (see ``uses_tiles``)."""
        mlp = self.mlps[layer]
        weights = (mlp.fc1.weight, mlp.fc1.bias, mlp.fc2.weight, mlp.fc2.bias)
        found = self.base_term(ctx, layer, query.shape[2], key.shape[2], query.device) if self.uses_tiles(
            ctx, dropout, training) else None
        if found is not None:
            kind, tensors = found
            out = cape_attention_tiled(
                query, key, value, *weights, kind, tensors, mask, scaling, ctx.q_offset, causal=self.info.causal
            )
            return out, None
        bias = self.base_bias(ctx, query.shape[2], key.shape[2], query.device, layer)
        return cape_attention_reference(query, key, value, bias, *weights, mask, scaling, dropout, training)
