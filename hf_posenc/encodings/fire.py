"""``fire``: functional interpolation for relative positions.

"Functional Interpolation for Relative Positions Improves Long Context Transformers", Li et al. 2023,
https://arxiv.org/abs/2310.04418. The logit of query i and key j (j <= i, causal) gets, per head h,

    B_h(i, j) = f_theta( psi(i - j) / psi(max(L, i)) )_h,        psi(x) = log(c * x + 1)

with f_theta an MLP 1 -> ``mlp_hidden`` -> H with a ReLU (paper: hidden width 32, ReLU), c > 0 and the
threshold L > 0 learned. Dividing by psi(max(L, i)) is the paper's "progressive interpolation": the
input of f_theta stays in [0, 1] whatever the length, and the threshold L keeps short sequences from
being over-normalised. i is the query's absolute (0-based) position.

Details, following the PyTorch listing of FIRE in the paper's appendix (class ``FIRE``, defaults
``mlp_width=32, init_c=0.1, init_L=512., eps=1e-6``; it learns L as ``|L_multiplier * init_L|`` with
``L_multiplier`` initialised to 1, and uses ``|c * x|``):

* initialisation: c = ``init_c`` (default 0.1, the listing's value), L = ``init_threshold`` (default
  512, the listing's value); the MLP takes PyTorch's default ``nn.Linear`` initialisation, as in the
  listing: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weights and biases;
* positivity: c = exp(c_hat) and L = exp(L_hat), a reparametrisation (never a clamp in place); at
  initialisation a step on L_hat moves L as a step on the listing's ``L_multiplier`` does (both scale
  with L); any real c_hat, L_hat is valid;
* the listing's eps = 1e-6 is added to the normaliser: psi(i - j) / (psi(max(L, i)) + 1e-6);
* ``per_layer`` (default True): every layer has its own FIRE (its own MLP, c and L), as in the paper's
  experiments (the DAPE/CAPE authors' reimplementation also builds one FIRE per attention layer);
  False shares one FIRE across all layers (its bias is then built once per forward when not training).
  The per-layer parameters are stored stacked, one row per layer (``fc1_weight`` (layers, hidden),
  ``fc1_bias``, ``fc2_weight`` (layers, H, hidden), ``fc2_bias``, ``log_c`` (layers,), ``log_threshold``).
* ``fc2_bias`` (the last ``nn.Linear``'s bias, kept as in the listing) has no effect on the output on text:
  it adds one constant per head to every score of a row, which the softmax cancels, so its gradient is 0 in
  exact arithmetic (computed gradients are rounding noise). On ViT it does act: pairs with the CLS token
  get no term, so it shifts the patch keys against the CLS key.

Text: i is the query's logical position ``ctx.position_ids`` (B|1, Lq), so the normaliser follows the
KV cache (a decode step's query sits at a large i) and left padding (position_ids are shifted by the
padding). i - j is the key/query index distance, equal to the logical distance between real tokens
under left padding. Only j <= i matters under the causal mask; future keys use max(i - j, 0) = 0 so
that the masked entries stay finite.

ViT (bidirectional, 2D; a documented generalisation): i - j becomes the Euclidean distance d_ij between
the two patches on the patch grid, and the query position in the normaliser becomes the largest such
distance on the current grid, r = sqrt((rows - 1)^2 + (cols - 1)^2):

    B_h(i, j) = f_theta( psi(d_ij) / psi(max(L, r)) )_h,

so the MLP input again lies in [0, 1] on any grid. Bidirectional text (BERT) is the same on a line:
d_ij = |i - j| and r = L - 1, the largest distance in this forward's sequence (padding included); the fused
kernels take the causal form only, so there the reference runs. Pairs involving the CLS token get no positional term
(bias 0). Everything is computed in float32 (float64 stays float64), whatever the parameters' dtype.

Float64 is exact: the positions, r and every step of the bias are float64 for float64 parameters, and a float64
model's attention takes the exact bias (the full-matrix reference) rather than the fused term's table of f_theta
(`Fire.kernel_term`, which interpolates f_theta and so differs near its kinks by ~1e-5); it logs that at
debug level. float32, bfloat16 and half models keep the fused term.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from ..backend import forced_backend
from ..config import PosEncConfig
from ..kernels._common import debug_log
from ..kernels.attention.terms import KernelTerm
from ..kernels.attention.tiled import FEW_QUERIES
from ..ops import eager_value_checks
from ..registry import param, register_encoding
from .base import ModelInfo, PosContext, PositionEncoding, relative_positions

__all__ = ["Fire", "FireFunction"]

#: added to the normaliser, as in the paper's listing.
FIRE_EPS = 1e-6


def _up(t: torch.Tensor) -> torch.Tensor:
    """At least float32 (half and bfloat16 parameters are computed in float32; float64 stays)."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


@dataclass
class FireParams:
    mlp_hidden: int = param(32, "hidden width of the MLP f_theta (paper: 32)", type=int, ge=1)
    init_c: float = param(0.1, "initial value of c in psi(x) = log(c x + 1) (paper's listing: 0.1)", type=float, gt=0)
    init_threshold: float = param(512.0, "initial value of the threshold L in psi(max(L, i)) (paper: 512)",
                                  type=float, gt=0)
    per_layer: bool = param(True, "a FIRE per layer (paper) or one shared by all layers", type=bool)


class FireFunction:
    """One FIRE (the MLP f_theta, c and L) read from row ``idx`` of the stacked parameters of `Fire`,
    in at least float32; ``idx=None``: every row at once, with a leading layer dimension that broadcasts
    (c, L (n, 1, 1); every result gains that dimension first)."""

    def __init__(self, enc: "Fire", idx: int | None) -> None:
        if idx is None:
            self.w1, self.b1 = _up(enc.fc1_weight)[:, None], _up(enc.fc1_bias)[:, None]  # (n, 1, hidden)
            self.w2, self.b2 = _up(enc.fc2_weight), _up(enc.fc2_bias)[:, None]  # (n, H, hidden), (n, 1, H)
            self.c = torch.exp(_up(enc.log_c))[:, None, None]
            self.threshold = torch.exp(_up(enc.log_threshold))[:, None, None]
            return
        self.w1, self.b1 = _up(enc.fc1_weight[idx]), _up(enc.fc1_bias[idx])  # (hidden,), (hidden,)
        self.w2, self.b2 = _up(enc.fc2_weight[idx]), _up(enc.fc2_bias[idx])  # (H, hidden), (H,)
        self.c = torch.exp(_up(enc.log_c[idx]))  # c > 0
        self.threshold = torch.exp(_up(enc.log_threshold[idx]))  # L > 0

    def psi(self, x: torch.Tensor) -> torch.Tensor:
        """psi(x) = log(c x + 1), elementwise, in the wider of the two dtypes (a 0-d float64 c would not
        widen a float32 x by type promotion)."""
        return torch.log1p(self.c * x.to(torch.promote_types(x.dtype, self.c.dtype)))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """f_theta on (...) inputs -> (..., H): fc2(relu(x * w1 + b1))."""
        dt = torch.promote_types(x.dtype, self.w1.dtype)
        hidden = F.relu(x.to(dt)[..., None] * self.w1.to(dt) + self.b1.to(dt))
        if self.w2.dim() == 3:  # every layer: (n, ..., hidden) -> (n, ..., H), one batched product
            return torch.baddbmm(self.b2.to(dt), hidden, self.w2.to(dt).transpose(1, 2))
        return F.linear(hidden, self.w2.to(dt), self.b2.to(dt))

    def bias(self, distance: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """f_theta(psi(distance) / (psi(max(L, position)) + eps)) moved to (..., H, Lq, Lk).

        Args:
            distance: (Lq, Lk) non-negative distances.
            position: the normaliser's position, broadcastable to (..., Lq, 1): (B|1, Lq, 1) on text,
                a 0-d tensor on ViT.
        """
        normaliser = self.psi(torch.maximum(self.threshold, position.to(self.threshold.dtype))) + FIRE_EPS
        x = self.psi(distance) / normaliser  # (..., Lq, Lk)
        return self.mlp(x).movedim(-1, -3)


@register_encoding(
    "fire",
    params=FireParams,
    kind="score bias",
    summary="MLP of the log-distance over the log of max(L, query position); Euclidean patch distance on ViT",
    paper="https://arxiv.org/abs/2310.04418",
)
class Fire(PositionEncoding):
    """FIRE; see the module docstring for the formula, the initialisation and the ViT generalisation."""

    inert_zero = ("fc2_weight", "fc2_bias")  # f_θ's last layer at zero: the bias is 0 everywhere (exact)

    has_score_bias = True
    relative = False  # the normaliser psi(max(L, i)) reads the query's absolute position i

    def reference_bytes(self, batch: int, heads: int, q_len: int, k_len: int, grad: bool, itemsize: int = 4) -> int:
        """The MLP runs on every (query, key) pair: (B|1, Lq, Lk, mlp_hidden) activations dominate (measured at
        L = 2048 and 4096, hidden 32: 4.2 GiB without autograd at L = 4096, B = 1, H = 4)."""
        hidden = self.posenc_config.params["mlp_hidden"]
        per_pair = (3.5 * hidden + 3 * heads) if grad else (2 * hidden + 2 * heads)
        return int(per_pair * batch * q_len * k_len * itemsize)
    kernel_kinds = ("fire",)

    def kernel_term(self, ctx: PosContext, layer: int, query, key, value, mask) -> KernelTerm | None:
        """The fused-attention term: f_θ of ``layer`` tabulated at ``KERNEL_GRID`` points over [0, x_max]
        (x_max = the largest MLP input of any pair this forward can see, at least 1), c, and each query's
        1 / (psi(max(L, i)) + eps). The kernel interpolates the table linearly: f_θ is piecewise linear,
        so this differs from ``score_bias`` only in the grid cells that hold a kink of the ReLU (by at most
        |slope change| · x_max / (4 (KERNEL_GRID − 1))). Gradients reach the MLP through the table and c, L
        through c and the normaliser. None on ViT and on bidirectional text (the kernel's term is causal), and
        for float64 queries or parameters: float64 is the exact dtype, so the reference builds the bias by the
        formula (logged at debug level)."""
        if ctx.grid is not None or not self.info.causal:
            return None
        if query.dtype == torch.float64 or self.fc1_weight.dtype == torch.float64:
            debug_log(__name__, "fire: float64 attention takes the exact bias (full-matrix reference), not the fused "
                      "term's interpolated table of f_theta")
            return None
        return self.term(ctx, layer, query.shape[2], key.shape[2], query.device)

    def term(self, ctx: PosContext, layer: int, q_len: int, k_len: int, device: torch.device) -> KernelTerm | None:
        """The ``fire`` term of ``layer`` (see `kernel_term`, which takes it on causal text in float32 and
        below), in the parameters' dtype; None on ViT and bidirectional text (the term is causal). CAPE's base."""
        if ctx.grid is not None or not self.info.causal:
            return None
        if not self._shares_terms(ctx):
            return KernelTerm.fire(*self._term(self.function(layer), ctx, q_len, device))
        key = ("fire_every_layer_term", id(self), q_len, str(device))
        if key not in ctx.memo:  # each tensor unbound per layer once (a select per tensor and layer otherwise)
            ctx.memo[key] = list(zip(*(t.unbind(0) for t in self._term(FireFunction(self, None), ctx, q_len,
                                                                        device))))
        return KernelTerm.fire(*ctx.memo[key][layer])

    def _shares_terms(self, ctx: PosContext) -> bool:
        """Whether this forward builds the fused-attention term of every layer at once, kept in its memo (a
        decoding step paid the few operations of `_term` in each of its layers): in eager mode without
        gradients to the encoding, one FIRE per layer."""
        return self.bias_per_layer and self._frozen_eager()

    def _frozen_eager(self) -> bool:
        """Eager mode, and no gradient flows to FIRE's parameters."""
        return not torch.compiler.is_compiling() and not (
            torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters()))

    def skips_engines(self, ctx: PosContext, query: torch.Tensor, key: torch.Tensor) -> bool:
        """True for a decoding step on the CPU: at most ``FEW_QUERIES`` float32 queries of causal text, in eval
        and eager mode, without gradients to FIRE, no backend forced but ``torch``, and every layer's bias within
        ``EVERY_LAYER_BIAS_ELEMENTS`` (`_every_layer_bias`). The attention then takes `score_bias`,
        the exact bias of every layer built at once per forward, as SDPA's float mask; the tile engine would
        evaluate each layer's interpolated term in that layer, about 20 operations each. Half and bfloat16 models
        keep the engine, which adds the term in float32 (that path would round the bias to the model's dtype)."""
        return (query.device.type == "cpu" and query.dtype == torch.float32 and ctx.grid is None
                and self.info.causal and forced_backend() in (None, "torch")
                and self._every_layer_bias(ctx, query.shape[0], query.shape[2], key.shape[2]))

    def _every_layer_bias(self, ctx: PosContext, batch: int, q_len: int, k_len: int) -> bool:
        """Whether `score_bias` builds the bias of every layer at once (one FIRE per layer, causal text,
        eval mode, eager, no gradient to FIRE, a few queries, and its largest tensor, the MLP's hidden activations
        of every layer, within ``EVERY_LAYER_BIAS_ELEMENTS``). Not in train mode: reentrant checkpointing runs a
        layer's first pass without gradients and its recomputation with them, and both must build the same bias."""
        width = max(self.posenc_config.params["mlp_hidden"], self.info.num_heads)
        return (q_len <= FEW_QUERIES and not self.training and self.bias_per_layer and ctx.grid is None
                and self.info.causal
                and self.info.num_layers * batch * q_len * k_len * width <= self.EVERY_LAYER_BIAS_ELEMENTS
                and self._frozen_eager())

    #: the most elements the every-layer bias of a decoding step may hold in one tensor (64 MiB in float32:
    #: 17k keys for 30 layers, one sequence, one query, an MLP 32 wide); beyond, each layer's term is evaluated
    #: by the engine in its layer.
    EVERY_LAYER_BIAS_ELEMENTS = 2**24

    def _term(self, fn: FireFunction, ctx: PosContext, q_len: int, device: torch.device):
        """(table (H, N), c, inv_norm (B|1, Lq), x_max) of `kernel_term` for the FIRE ``fn``; for every
        layer's (``FireFunction(self, None)``) each with a leading layer dimension."""
        position = self._query_positions(ctx, q_len, device, fn.c.dtype)  # (B|1, Lq)
        inv_norm = 1.0 / (fn.psi(torch.maximum(fn.threshold, position.to(fn.threshold.dtype))) + FIRE_EPS)
        q_index = torch.arange(q_len, device=device, dtype=fn.c.dtype) + ctx.q_offset  # i − j <= q_index
        x_max = (fn.psi(q_index) * inv_norm).amax(dim=(-2, -1)).detach().clamp_min(1.0)
        grid = torch.linspace(0.0, 1.0, self.KERNEL_GRID, device=device, dtype=inv_norm.dtype) * x_max[..., None]
        return fn.mlp(grid).transpose(-1, -2), fn.c.reshape(x_max.shape), inv_norm, x_max

    #: points of the table that the fused attention kernel interpolates.
    KERNEL_GRID = 256

    def __init__(self, config: PosEncConfig, info: ModelInfo) -> None:
        super().__init__(config, info)
        p = config.params
        self.bias_per_layer = bool(p["per_layer"])
        n, heads, hidden = info.num_layers if self.bias_per_layer else 1, info.num_heads, p["mlp_hidden"]
        # One row per layer. The MLP gets nn.Linear's default initialisation, U(-1/sqrt(fan_in), 1/sqrt(fan_in))
        # for weights and biases (fan_in 1, then hidden), as in the paper's listing.
        self.fc1_weight = nn.Parameter(torch.empty(n, hidden).uniform_(-1.0, 1.0))
        self.fc1_bias = nn.Parameter(torch.empty(n, hidden).uniform_(-1.0, 1.0))
        bound = hidden**-0.5
        self.fc2_weight = nn.Parameter(torch.empty(n, heads, hidden).uniform_(-bound, bound))
        self.fc2_bias = nn.Parameter(torch.empty(n, heads).uniform_(-bound, bound))
        self.log_c = nn.Parameter(torch.full((n,), math.log(p["init_c"])))
        self.log_threshold = nn.Parameter(torch.full((n,), math.log(p["init_threshold"])))

    def function(self, layer: int = 0) -> FireFunction:
        """The FIRE of ``layer`` (the shared one when ``per_layer`` is False)."""
        return FireFunction(self, layer if self.bias_per_layer else 0)

    def score_bias(
        self, ctx: PosContext, q_len: int, k_len: int, device: torch.device, layer: int = 0
    ) -> torch.Tensor:
        """(B|1, H, Lq, Lk) float32 FIRE bias of ``layer``: B|1 follows ``ctx.position_ids`` on text, 1 on ViT."""
        fn = self.function(layer)
        dtype = fn.c.dtype  # float32, or float64 for float64 parameters
        rel = relative_positions(ctx, q_len, k_len, device)
        if rel.is_grid:
            rows, cols = ctx.grid
            r = torch.tensor(math.hypot(rows - 1, cols - 1), device=device, dtype=dtype)
            # the grid offsets are integers (exact in float32); their Euclidean norm is taken in ``dtype``
            distance = torch.sqrt(rel.rows.to(dtype).square() + rel.cols.to(dtype).square()).masked_fill(rel.cls, 0.0)
            bias = fn.bias(distance, r)[None]  # (1, H, Lq, Lk)
            return bias.masked_fill(rel.cls, 0.0)
        if not self.info.causal:  # bidirectional text: |i - j| over the largest distance in this sequence
            r = torch.tensor(float(max(k_len - 1, 0)), device=device, dtype=dtype)
            return fn.bias(rel.rel.abs(), r)[None]
        distance = (-rel.rel).clamp_min(0.0)  # i - j for j <= i; 0 on (masked) future keys
        position = self._query_positions(ctx, q_len, device, dtype)
        if not self._every_layer_bias(ctx, position.shape[0], q_len, k_len):
            return fn.bias(distance, position[:, :, None])
        key = ("fire_every_layer_bias", id(self), q_len, k_len, str(device))
        if key not in ctx.memo:  # unbound once: a view per layer
            ctx.memo[key] = self._every_layer_causal_bias(distance, position).unbind(0)
        return ctx.memo[key][layer]

    def _every_layer_causal_bias(self, distance: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """`FireFunction.bias` of every layer at once, (layers, B|1, H, Lq, Lk), from the distances (Lq, Lk)
        and the query positions (B|1, Lq): the same formula, the layer dimension first (the MLP's second product
        batched over the layers)."""
        fn = FireFunction(self, None)  # c, L (n, 1, 1)
        normaliser = fn.psi(torch.maximum(fn.threshold, position.to(fn.threshold.dtype))) + FIRE_EPS  # (n, B|1, Lq)
        x = fn.psi(distance)[:, None] / normaliser[..., None]  # (n, B|1, Lq, Lk)
        return fn.mlp(x.flatten(1)).unflatten(1, x.shape[1:]).movedim(-1, -3)

    @staticmethod
    def _query_positions(
        ctx: PosContext, q_len: int, device: torch.device, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """(B|1, Lq) absolute positions i of the queries in ``dtype`` (float32, or float64 for a float64 FIRE);
        one row when every row is the same."""
        pos = ctx.position_ids
        if pos is None:
            return (torch.arange(q_len, device=device, dtype=dtype) + ctx.q_offset)[None]
        pos = pos.to(device=device, dtype=dtype)
        if pos.dim() == 1:
            pos = pos[None]
        if pos.dim() != 2 or pos.shape[-1] != q_len:
            raise ValueError(
                f"fire expects position_ids of shape (batch, {q_len}) for {q_len} queries, got {tuple(pos.shape)}"
            )
        # The usual unpadded batch: one bias for every row. Reading the rows is a sync (and a graph break under
        # torch.compile), so it is done in eager mode on CPU only; elsewhere the bias keeps one row per sequence.
        if pos.shape[0] > 1 and eager_value_checks(pos) and bool((pos == pos[:1]).all()):
            pos = pos[:1]
        return pos
