"""``dpb``: Dynamic Position Bias, a learned MLP of the signed relative position.

CrossFormer ("CrossFormer: A Versatile Vision Transformer Hinging on Cross-scale Attention", Wang et al. 2021,
https://arxiv.org/abs/2108.00154, section 3.3 "Dynamic Position Bias") computes each head's bias from the
relative position by an MLP instead of a table, so that it is defined at every offset; x-transformers'
``DynamicPositionBias`` (lucidrains/x-transformers, ``x_transformers/x_transformers.py``) brings it to text.
The logit of query i and key j gets, per head h,

    B_h(i, j) = MLP(x)_h,    x = i − j                      (text, signed)
                             x = sign(i − j) · log(1 + |i − j|)   (``log_distance``)
    MLP = Linear(d_in, hidden) [LayerNorm] SiLU, (depth − 1) × (Linear(hidden, hidden) [LayerNorm] SiLU),
          Linear(hidden, H)

Defaults, from x-transformers (``AttentionLayers``: ``DynamicPositionBias(dim = dim // 4, heads = heads,
log_distance = dynamic_pos_bias_log_distance, depth = dynamic_pos_bias_mlp_depth, norm = dynamic_pos_bias_norm)``
with ``dynamic_pos_bias_log_distance = False``, ``dynamic_pos_bias_mlp_depth = 2``, ``dynamic_pos_bias_norm =
False``): hidden width = the model's hidden size // 4, depth 2, the plain signed distance (``log_distance``
False; its form sign(x) log(|x| + 1) is x-transformers', the SwinV2 log-spaced coordinates), no LayerNorm, SiLU;
one MLP shared by every layer (x-transformers builds one ``rel_pos`` in ``AttentionLayers`` and hands it to each
attention layer; ``per_layer=True`` gives each layer its own). CrossFormer's own ``DynamicPosBias``
(github.com/cheerss/CrossFormer, ``models/crossformer.py``) uses the same width (``dim // 4``), with a LayerNorm
and a ReLU before each of its three Linear layers after the input projection. Initialisation: PyTorch's
default ``nn.Linear`` (U(−1/sqrt(fan_in), 1/sqrt(fan_in)) for weights and biases, as both codes leave it);
LayerNorm weight 1, bias 0.

Text (Llama-like families, GPT-2, BERT): the MLP runs once per distinct relative position, on a table of
2M + 1 signed distances δ = −M .. M that covers every (query, key) pair of the forward, not once per pair; the
bias is that table read at δ = qi − j (a Toeplitz term, ``kernels.attention.terms``' ``dpb``). Causal models
only read δ >= 0 (masked pairs read finite values). The last Linear's bias adds one constant per head to every
score of a row on text, which the softmax cancels (its gradient is 0 in exact arithmetic), as FIRE's does.

ViT (bidirectional, 2D grid + CLS): CrossFormer's form, the MLP of the 2-vector of per-axis offsets
(Δrow, Δcol) = query − key on the patch grid (each axis through sign(x) log(1 + |x|) with ``log_distance``),
evaluated once per distinct offset ((2 rows − 1)(2 cols − 1) of them); every pair that involves the CLS token
gets no positional term (bias 0). The fused engines take no term there (as for ``t5`` and ``fire``): the
reference runs.

Everything is computed in float32 (float64 stays float64), whatever the parameters' dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from ..config import PosEncConfig
from ..kernels.attention.terms import KernelTerm
from ..registry import param, register_encoding
from .base import ModelInfo, PosContext, relative_positions
from .term import TermEncoding

__all__ = ["Dpb"]


def _up(t: torch.Tensor) -> torch.Tensor:
    """At least float32 (half and bfloat16 parameters are computed in float32; float64 stays)."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def _table_half(q_offset: int | torch.Tensor, q_len: int, k_len: int) -> int:
    """M such that every text pair's δ = qi − j lies in −M .. M: query i is key ``q_offset + i`` among Lk keys. A
    tensor offset (a StaticCache's) is not read (a device sync, a graph break): its queries are among the keys
    (``q_offset + Lq <= Lk``), so Lk − 1 is enough."""
    if isinstance(q_offset, torch.Tensor):
        return max(k_len - 1, 0)
    return max(k_len - 1, q_offset + q_len - 1, 0)


@dataclass
class DpbParams:
    hidden: int | None = param(
        None, "hidden width of the MLP (default: the model's hidden size // 4, as x-transformers' dim // 4)",
        type=int, optional=True, ge=1,
    )
    depth: int = param(2, "Linear + activation blocks before the output Linear (x-transformers: 2)", type=int, ge=1)
    log_distance: bool = param(
        False, "feed sign(x) log(1 + |x|) instead of the signed distance x (x-transformers' option; default off)",
        type=bool,
    )
    norm: bool = param(False, "a LayerNorm after each hidden Linear (x-transformers' option; default off)", type=bool)
    per_layer: bool = param(
        False, "an MLP per layer, or one shared by all layers (default, as x-transformers' AttentionLayers)",
        type=bool,
    )


@register_encoding(
    "dpb",
    params=DpbParams,
    kind="score bias",
    summary="learned MLP of the signed (log-)distance per head; CrossFormer's MLP of the 2D offset on ViT",
    paper="https://arxiv.org/abs/2108.00154",
)
class Dpb(TermEncoding):
    """Dynamic Position Bias; see the module docstring for the formula, the defaults and the ViT form (on text the
    bias is the ``dpb`` term's reference bias, its table the MLP per signed distance; ViT in `grid_bias`).

    Parameters (one row per layer with ``per_layer``, else one): ``w_in`` (n, hidden, d_in) with d_in 1 on text
    and 2 on ViT, ``b_in`` (n, hidden), ``w_mid`` (n, depth − 1, hidden, hidden), ``b_mid`` (n, depth − 1,
    hidden), ``w_out`` (n, H, hidden), ``b_out`` (n, H), and with ``norm`` ``norm_weight``, ``norm_bias``
    (n, depth, hidden).
    """

    inert_zero = ("w_out", "b_out")  # the MLP's output layer at zero: the bias is 0 everywhere (exact)

    relative = True  # a function of i − j (key/query indices); position_ids are never read
    reference_footprint = (5.0, 6.0)  # float32 (B, H, Lq, Lk) tensors (hf_posenc.memory), as t5's table gather
    kernel_kinds = ("dpb",)

    @classmethod
    def resolve(cls, config: PosEncConfig, info: ModelInfo) -> PosEncConfig:
        p = dict(config.params)
        if p["hidden"] is None:
            p["hidden"] = max(1, info.hidden_size // 4)
        return PosEncConfig(config.name, p)

    def __init__(self, config: PosEncConfig, info: ModelInfo) -> None:
        super().__init__(config, info)
        p = config.params
        self.bias_per_layer = bool(p["per_layer"])
        self.depth, self.log_distance, self.norm = p["depth"], bool(p["log_distance"]), bool(p["norm"])
        n, hidden, heads = info.num_layers if self.bias_per_layer else 1, p["hidden"], info.num_heads
        d_in = 2 if info.family == "vit" else 1

        def uniform(*shape: int, fan_in: int) -> nn.Parameter:  # nn.Linear's default initialisation
            bound = fan_in**-0.5
            return nn.Parameter(torch.empty(*shape).uniform_(-bound, bound))

        self.w_in, self.b_in = uniform(n, hidden, d_in, fan_in=d_in), uniform(n, hidden, fan_in=d_in)
        self.w_mid = uniform(n, self.depth - 1, hidden, hidden, fan_in=hidden)
        self.b_mid = uniform(n, self.depth - 1, hidden, fan_in=hidden)
        self.w_out, self.b_out = uniform(n, heads, hidden, fan_in=hidden), uniform(n, heads, fan_in=hidden)
        if self.norm:
            self.norm_weight = nn.Parameter(torch.ones(n, self.depth, hidden))
            self.norm_bias = nn.Parameter(torch.zeros(n, self.depth, hidden))

    def _input(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP's input of signed offsets ``x``: x itself, or sign(x) log(1 + |x|) with ``log_distance``."""
        return torch.sign(x) * torch.log1p(x.abs()) if self.log_distance else x

    def mlp(self, x: torch.Tensor, layer: int = 0) -> torch.Tensor:
        """The MLP of ``layer`` on inputs x (..., d_in) (already through `_input`) -> (..., H), in at least
        float32."""
        i = layer if self.bias_per_layer else 0
        dt = torch.promote_types(x.dtype, _up(self.w_in).dtype)
        up = lambda t: _up(t[i]).to(dt)  # noqa: E731
        h = F.linear(x.to(dt), up(self.w_in), up(self.b_in))
        for k in range(self.depth):
            if k > 0:
                h = F.linear(h, up(self.w_mid)[k - 1], up(self.b_mid)[k - 1])
            if self.norm:
                h = F.layer_norm(h, h.shape[-1:], up(self.norm_weight)[k], up(self.norm_bias)[k])
            h = F.silu(h)
        return F.linear(h, up(self.w_out), up(self.b_out))

    def distance_table(self, half: int, device: torch.device, layer: int = 0) -> torch.Tensor:
        """(H, 2M + 1) float32: the bias at text offsets δ = qi − j = −M .. M (M = ``half``) of ``layer``."""
        delta = torch.arange(-half, half + 1, device=device, dtype=torch.float32)
        return self.mlp(self._input(delta)[:, None], layer).T

    def _table(self, ctx: PosContext, q_len: int, k_len: int, device: torch.device, layer: int) -> torch.Tensor:
        """The text table of this forward: without autograd, built once per forward per MLP and shared by the layers
        that share it; with autograd, built per layer (a memoised table would sit outside each layer's activation
        checkpoint, whose recomputation must rebuild what it saved; the MLP on 2M + 1 inputs is small); per layer
        under ``torch.compile`` too."""
        half = _table_half(ctx.q_offset, q_len, k_len)
        # under torch.compile no memo either: its key would hold the (symbolic) half-width, and Dynamo specialises
        # a graph to a length in a dict key (one graph per length)
        trained = torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters())
        if trained or torch.compiler.is_compiling():
            return self.distance_table(half, device, layer)
        memo_key = ("dpb_table", half, device, layer if self.bias_per_layer else 0)
        if memo_key not in ctx.memo:
            ctx.memo[memo_key] = self.distance_table(half, device, layer)
        return ctx.memo[memo_key]

    def term(self, ctx: PosContext, layer: int, q_len: int, k_len: int, device: torch.device) -> KernelTerm:
        """The ``dpb`` term: the table (H, 2M + 1) of ``layer`` over every offset of this forward (a Toeplitz term;
        gradients reach the MLP through it)."""
        return KernelTerm.dpb(self._table(ctx, q_len, k_len, device, layer))

    def grid_bias(
        self, ctx: PosContext, q_len: int, k_len: int, device: torch.device, layer: int = 0
    ) -> torch.Tensor:
        """ViT: (1, H, Lq, Lk) float32, the MLP of the 2D offset, 0 on CLS pairs."""
        rel = relative_positions(ctx, q_len, k_len, device)
        rows, cols = ctx.grid
        dr = torch.arange(-(rows - 1), rows, device=device, dtype=torch.float32)
        dc = torch.arange(-(cols - 1), cols, device=device, dtype=torch.float32)
        offsets = torch.stack(torch.meshgrid(dr, dc, indexing="ij"), dim=-1)  # (2R − 1, 2C − 1, 2): query − key
        table = self.mlp(self._input(offsets), layer)  # (2R − 1, 2C − 1, H)
        bias = table[(-rel.rows).long() + rows - 1, (-rel.cols).long() + cols - 1].permute(2, 0, 1)
        return bias.masked_fill(rel.cls, 0.0)[None]
