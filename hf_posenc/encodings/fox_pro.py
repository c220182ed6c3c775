"""``fox_pro``: FoX with the "Pro" block of the Forgetting Transformer.

"Forgetting Transformer: Softmax Attention with a Forget Gate", Lin, Nikishin, He and Courville, ICLR 2025,
https://arxiv.org/abs/2503.02130. "The code" below is the authors' implementation,
github.com/zhixuan-lin/forgetting-transformer (``ForgettingAttentionLayer``, ``ShiftLinear``, ``GroupRMSNorm``);
the forgetting attention itself, its gates, padding, cache state and ViT generalisation are ``fox``'s
(`hf_posenc.encodings.fox`).

FoX with the "Pro" block of the paper (the authors' ``configs/experiment/*/forgetting_transformer/pro_*.yaml``:
``qk_norm``, ``use_k_shift``, ``use_v_shift``, ``use_output_gate``, ``use_output_norm``, ``use_rope:
false``), in the code's order:

    k_t, v_t        raw projections (the model's own k_proj / v_proj)
    k̃_t = α^k_t k_{t−1} + (1 − α^k_t) k_t,   α^k_t = σ(u^k_g · x_t)      data-dependent token shift,
    ṽ_t = α^v_t v_{t−1} + (1 − α^v_t) v_t,   α^v_t = σ(u^v_g · x_t)      one α per key/value head g,
                                                                       no bias (``ShiftLinear``); k_{t-1} = 0
                                                                       for the first token (and after left
                                                                       padding or a document boundary)
    q̂_t = RMSNorm(q_t) ⊙ γ^q_h,  k̂_t = RMSNorm(k̃_t) ⊙ γ^k_g          QK-norm per head, eps 1e-5
    o_i = forgetting attention of (q̂, k̂, ṽ) as in ``fox`` (no RoPE)
    o_i ← σ(W_o x_i) ⊙ RMSNorm(o_i) ⊙ γ^o_h                          output norm per head (eps 1e-6, the
                                                                       code's ``norm_eps``), then the sigmoid
                                                                       output gate (``ogate_proj``, no bias);
                                                                       then the model's o_proj

RMSNorm(x) = x / sqrt(mean(x²) + eps) over one head's channels. Initialisation as in the code: u^k, u^v
and W_o ~ N(0, initializer_range); γ^q, γ^k, γ^o = 1 (per head and channel:
``qk_norm_share_param_across_head=False``, the code's default since its 2025-03-31 changelog).
The code supports no GQA (``num_kv_heads`` must be None); here the shift gates and γ^k belong to the
key/value heads, the forget gates and γ^q, γ^o to the query heads. The shift, the key norm and the value
shift are computed in float32 inside the attention (the code rounds k̃ to the model dtype before its
norm); q̂ (with γ^k, below) is computed in float32 and rounded to the model dtype, as in the code.

Cache state: k_raw ‖ [α^k, log f (G)] and v_raw ‖ [α^v] (+ log g on ViT), packed by
`hf_posenc.encodings.cache_state`: one logsigmoid of one product gives them all, α = exp(log σ(u·x)). FoX Pro
stores the raw (unshifted, unnormalised) k and v: the shift of the first new token at a decode step needs the
previous token's raw k and v, which only the cache holds, so the shift and the key norm are applied in ``attend`` to
every key (O(L·D) per head, negligible next to the scores). γ^k is applied to the queries instead of the keys: q̂ ·
(RMSNorm(k̃) ⊙ γ^k_g) = (q̂ ⊙ γ^k_g) · RMSNorm(k̃) for each query head of key/value head g, the same sum of products
(so a decoding step does not multiply every cached key by it); the probabilities, the outputs and the gradients are
those of the formula above. On ViT it shifts each patch's k and v from the previous patch in raster order (the first
patch has a zero predecessor; CLS is not shifted).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from ..backend import forced_backend
from ..config import PosEncConfig
from ..kernels._common import compute_dtype
from ..kernels._masks import query_indices
from ..kernels.attention.terms import KernelTerm
from ..kernels.attention.tiled import FEW_QUERIES  # the decoding steps: as many queries as the engine's
from ..registry import register_encoding
from .base import ModelInfo, PosContext, PositionEncoding
from .cache_state import pack_state, unpack_state
from .fox import Fox, cumulative_gates, forgetting_attention, key_validity

__all__ = ["FoxPro"]


#: eps of the QK-norm (the code's ``GroupRMSNorm`` default) and of the output norm (the code's ``norm_eps``).
QK_NORM_EPS = 1e-5
OUT_NORM_EPS = 1e-6


def _native_window_has_prev(ctx: PosContext, layer: int, k_len: int, device: torch.device) -> torch.Tensor | None:
    """``has_prev`` (B|1, Lk) on a layer with the model's own sliding window (Mistral, Gemma 3's local layers),
    or None elsewhere. transformers bands that layer's mask, so the first key of a query's window has no
    visible predecessor there, though it has one in the sequence; the token shift is the token's, so read the
    neighbours from the model's key padding (``PosContext.key_padding``) instead. None when that is unknown
    (a custom 4D mask): the mask is then all there is."""
    windows = ctx.info.sliding_windows
    if not windows or layer >= len(windows) or windows[layer] is None or ctx.key_padding is None:
        return None
    if ctx.key_padding is True:
        real = torch.ones(1, k_len, dtype=torch.bool, device=device)
    else:
        real = ctx.key_padding.to(device=device, dtype=torch.bool)[:, :k_len]
        real = F.pad(real, (0, k_len - real.shape[1]), value=False)  # a StaticCache's empty slots
    return F.pad(real[:, 1:] & real[:, :-1], (1, 0), value=False)


class _RmsNorm(torch.autograd.Function):
    """y = x r w, r = 1 / sqrt(mean(x², -1) + eps), w broadcast to x (None: 1). Saves x and r (autograd's chain of
    the same expression keeps x r as well: one more tensor of x's size per norm, three norms a layer in FoX Pro)."""

    @staticmethod
    def forward(ctx, x, weight, eps):  # type: ignore[override]
        r = torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + eps)
        ctx.save_for_backward(x, r, weight)
        return x * r if weight is None else x * r * weight

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):  # type: ignore[override]
        x, r, weight = ctx.saved_tensors
        xh = x * r
        dx = dw = None
        if ctx.needs_input_grad[0]:
            g = dy if weight is None else dy * weight
            dx = (g - xh * (g * xh).mean(dim=-1, keepdim=True)) * r
        if ctx.needs_input_grad[1]:
            dw = (dy * xh).sum_to_size(weight.shape)
        return dx, dw, None


def _needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x², -1) + eps) * weight (None: no weight), in the dtype of x. Without a gradient, torch's
    rms_norm (a decoding step normalises every cached key of every layer: 34 µs against 60 µs for the three ops,
    64 x 288 keys, one thread of the 2-core AMD EPYC)."""
    if not (_needs_grad(x) or (weight is not None and _needs_grad(weight))):
        y = F.rms_norm(x, (x.shape[-1],), eps=eps)
        return y if weight is None else y * weight
    return _RmsNorm.apply(x, weight, eps)


def _previous(x: torch.Tensor, has_prev: torch.Tensor | None) -> torch.Tensor:
    """x_{t-1} along the key axis of x (B, Hkv, Lk, D), 0 where not ``has_prev`` (B|1, Lk); None: every key but
    the first has its predecessor (no mask), so the padding's zero is all there is to apply."""
    prev = F.pad(x[..., :-1, :], (0, 0, 1, 0))
    return prev if has_prev is None else prev * has_prev[:, None, :, None]


def _shifted(x: torch.Tensor, alpha: torch.Tensor, has_prev: torch.Tensor | None) -> torch.Tensor:
    """y_t = α_t x_{t-1} + (1 - α_t) x_t as one lerp, x_t + α_t (x_{t-1} - x_t) (a third of the time of the
    products and sum, which a decoding step pays on every cached key and value of every layer)."""
    return torch.lerp(x, _previous(x, has_prev), alpha[..., None])


class _TokenShift(torch.autograd.Function):
    """y_t = α_t x_{t-1} + (1 - α_t) x_t (x_{t-1} = 0 where not ``has_prev``). Saves x and α only: the shifted copy
    is rebuilt in backward (autograd's chain keeps it and (1 - α) x alongside x)."""

    @staticmethod
    def forward(ctx, x, alpha, has_prev):  # type: ignore[override]
        ctx.save_for_backward(x, alpha, has_prev)
        return _shifted(x, alpha, has_prev)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):  # type: ignore[override]
        x, alpha, has_prev = ctx.saved_tensors
        a = alpha[..., None]
        dx = da = None
        if ctx.needs_input_grad[0]:
            to_prev = torch.where(has_prev[:, None, :, None], dy * a, torch.zeros_like(dy))  # dL/dx_{t-1} via y_t
            dx = dy * (1 - a) + F.pad(to_prev[..., 1:, :], (0, 0, 0, 1))
        if ctx.needs_input_grad[1]:
            da = (dy * (_previous(x, has_prev) - x)).sum(dim=-1)
        return dx, da, None


@dataclass
class FoxProParams:
    pass


@register_encoding(
    "fox_pro",
    params=FoxProParams,
    kind="data-dependent",
    summary="FoX Pro: forget gates plus QK-norm, data-dependent token shift of k and v, output norm and "
    "sigmoid output gate; no RoPE; raster order both ways on ViT",
    paper="https://arxiv.org/abs/2503.02130",
)
class FoxPro(Fox):
    """FoX with the Pro block; see the module docstring.

    Parameters (per layer, stacked on dim 0): the forget gates of `Fox`, ``key_shift_weight`` and
    ``value_shift_weight`` (num_layers, Hkv, C), ``q_norm_weight`` (num_layers, H, D), ``k_norm_weight``
    (num_layers, Hkv, D), ``out_norm_weight`` (num_layers, H, D) and ``out_gate_weight`` (num_layers, H*D, C).
    """

    no_inert_reason = "its QK-norm and output gate change the attention even with every forget gate at 1"

    def start_inert(self) -> str:
        return PositionEncoding.start_inert(self)  # raises with no_inert_reason

    finishes_output = True

    def __init__(self, config: PosEncConfig, info: ModelInfo) -> None:
        super().__init__(config, info)
        n, h, hkv, d, c = info.num_layers, info.num_heads, info.num_kv_heads, info.head_dim, info.hidden_size
        std = info.initializer_range
        self.key_shift_weight = nn.Parameter(torch.randn(n, hkv, c) * std)
        self.value_shift_weight = nn.Parameter(torch.randn(n, hkv, c) * std)
        self.q_norm_weight = nn.Parameter(torch.ones(n, h, d))
        self.k_norm_weight = nn.Parameter(torch.ones(n, hkv, d))
        self.out_norm_weight = nn.Parameter(torch.ones(n, h, d))
        self.out_gate_weight = nn.Parameter(torch.randn(n, h * d, c) * std)

    @classmethod
    def resolve(cls, config: PosEncConfig, info: ModelInfo) -> PosEncConfig:
        return config

    def shift_gates(self, layer: int, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """α^k, α^v (B, Hkv, L) = σ(u · x_t) in float32 (float64 for float64 inputs)."""
        dtype = compute_dtype(hidden.dtype)
        x = hidden.to(dtype)
        a_k = torch.sigmoid(F.linear(x, self.key_shift_weight[layer].to(dtype)))
        a_v = torch.sigmoid(F.linear(x, self.value_shift_weight[layer].to(dtype)))
        return a_k.transpose(1, 2), a_v.transpose(1, 2)

    def prepare(
        self, ctx: PosContext, layer: int, hidden: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q -> QK-normed q, times γ^k of its key/value head (see `_query_gain`); k -> raw k ‖ [α^k,
        log-gates]; v -> raw v ‖ [α^v] (the shift and the key norm need the previous token's raw k and v, so
        they are applied in ``attend``)."""
        compute = compute_dtype(q.dtype)
        gain = self.layer_slice(ctx, ("query_gain", compute), layer, lambda i: self._query_gain(i).to(compute))
        q = _rms_norm(q.to(compute), gain, QK_NORM_EPS).to(q.dtype)
        k_state, v_state = self._token_states(ctx, layer, hidden)
        k = torch.cat([k, pack_state(k_state, k.dtype)], dim=-1)
        v = torch.cat([v, pack_state(v_state, v.dtype)], dim=-1)
        return q, k, v

    def _query_gain(self, index: int | slice) -> torch.Tensor:
        """γ^q_h ⊙ γ^k_g(h) (..., H, 1, D) for the layers ``index`` picks: q̂ · (RMSNorm(k̃) ⊙ γ^k) =
        (q̂ ⊙ γ^k) · RMSNorm(k̃) for the G query heads of each key/value head, so the key norm's gain rides on the
        query once instead of on every cached key at every decoding step."""
        key_gain = self.k_norm_weight[index].repeat_interleave(self.groups, dim=-2)
        return (self.q_norm_weight[index] * key_gain).unsqueeze(-2)

    def _state_order(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The row order of `_state_weight` (R,): rows of [u^k (Hkv), u^v (Hkv), gate weights (S·H)] listed as
        the cache holds their outputs: per key/value head g, u^k_g then the gates of its G query heads (set by
        set, the order of `_gates_to_kv`); then u^v of every head. With it, (R,) bool: the rows that are
        shift gates (u^k, u^v). Built once per device."""
        orders = self.__dict__.setdefault("_state_orders", {})  # a plain attribute, per device
        if device not in orders:
            hkv, g, heads, sets = self.info.num_kv_heads, self.groups, self.info.num_heads, self.num_gate_sets
            rows = []
            for kv in range(hkv):
                rows.append(kv)
                rows += [2 * hkv + s * heads + kv * g + gi for s in range(sets) for gi in range(g)]
            rows += [hkv + kv for kv in range(hkv)]
            order = torch.tensor(rows, device=device)
            orders[device] = (order, order < 2 * hkv)
        return orders[device]

    def _state_weight(self, index: int | slice) -> tuple[torch.Tensor, torch.Tensor]:
        """The weight (..., R, C) and bias (..., R) whose logsigmoid gives the cached states (`_token_states`)
        for the layers ``index`` picks, rows in `_state_order`; the shift gates have no bias."""
        weights = [self.key_shift_weight[index], self.value_shift_weight[index], self.gate_weight[index]]
        biases = [self.gate_bias[index]]
        if self.bidirectional:  # the backward gates too
            weights.append(self.gate_weight_bwd[index])
            biases.append(self.gate_bias_bwd[index])
        zero = biases[0].new_zeros(biases[0].shape[:-1] + (2 * self.info.num_kv_heads,))
        order = self._state_order(weights[0].device)[0]
        return (torch.cat(weights, dim=-2).index_select(-2, order),
                torch.cat([zero, *biases], dim=-1).index_select(-1, order))

    def _token_states(
        self, ctx: PosContext | None, layer: int, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached states of the new tokens, [α^k, log-gates (S·G)] (B, Hkv, L, 1 + S·G) and [α^v]
        (B, Hkv, L, 1) in float32 (float64 for float64 inputs): `shift_gates` as exp(log σ(u·x)) and
        `log_gates` from one product and one logsigmoid, the rows of u^k, u^v and the gate weights stacked in
        the cache's order (each output is the dot product of its own linear map; a decoding step pays per
        operation, not per multiply-add)."""
        dtype = compute_dtype(hidden.dtype)
        hkv = self.info.num_kv_heads
        weight = self.layer_slice(ctx, ("state_weight", dtype), layer, lambda i: self._state_weight(i)[0].to(dtype))
        bias = self.layer_slice(ctx, ("state_bias", dtype), layer, lambda i: self._state_weight(i)[1].to(dtype))
        y = F.logsigmoid(F.linear(hidden.to(dtype), weight, bias))  # (B, L, Hkv (1 + S G) + Hkv)
        y = torch.where(self._state_order(y.device)[1], y.exp(), y)  # α = exp(log α): the new tokens' only
        split = y.shape[-1] - hkv
        return y[..., :split].unflatten(-1, (hkv, -1)).transpose(1, 2), y[..., split:, None].transpose(1, 2)

    def _shift(self, x: torch.Tensor, alpha: torch.Tensor, has_prev: torch.Tensor, ctx: PosContext,
               plain: bool = False) -> torch.Tensor:
        """α_t x_{t-1} + (1 - α_t) x_t over the key axis (x_{t-1} = 0 where not ``has_prev``).

        x (B, Hkv, Lk, D), alpha (B, Hkv, Lk), has_prev (B|1, Lk) bool; ``plain``: ``has_prev`` is known to be
        every key but the first (no mask), so it is not multiplied in."""
        if ctx.grid is not None:  # the CLS token is not shifted
            alpha = alpha.clone()
            alpha[..., 0] = 0.0
        if not _needs_grad(x, alpha):
            return _shifted(x, alpha, None if plain else has_prev)
        return _TokenShift.apply(x, alpha, has_prev)

    def attend(self, ctx: PosContext, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               mask: torch.Tensor | None, scaling: float, dropout: float, training: bool
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Shift k and v, normalise k, then forgetting attention. q (B, H, Lq, D) already normalised; key
        (B, Hkv, Lk, D + state), value (B, Hkv, Lk, D + state). Returns out (B, H, Lq, D), probs (B, H, Lq, Lk)."""
        if self._decodes(ctx, query):
            return self._few_queries(ctx, layer, query, key, value, mask, scaling), None
        k, v, gates, valid = self._attention_kv(ctx, layer, query, key, value, mask)
        bias = self._bias(ctx, gates, valid, query.shape[2], key.device)
        return forgetting_attention(query, k, v, bias, mask, scaling, dropout, training)

    def kernel_term(self, ctx: PosContext, layer: int, query, key, value, mask) -> KernelTerm | None:
        """The fused-attention term: c of the forward gates, with the shifted, normalised keys and the shifted
        values (in the query's dtype) replacing the cached ones. None on ViT (two-way gates), and for the
        decoding steps that `attend` computes from the cache without those tensors (`_decodes`)."""
        if self.bidirectional or ctx.grid is not None or self._decodes(ctx, query):
            return None
        k, v, gates, valid = self._attention_kv(ctx, layer, query, key, value, mask)
        valid = None if mask is None else valid  # no mask: every key is valid
        return KernelTerm.fox(cumulative_gates(gates[0], valid), key=k.to(query.dtype), value=v.to(query.dtype))

    def _attention_kv(self, ctx: PosContext, layer: int, query, key, value, mask):
        """(shifted + normalised k, shifted v (B, Hkv, Lk, D) in float32, the log-gates (S tensors (B, H, Lk)), key
        validity)."""
        k, v, gates, valid = self._shifted_kv(ctx, layer, query, key, value, mask)
        return k, v, self._gates_from_kv(gates), valid

    def _shifted_kv(self, ctx: PosContext, layer: int, query, key, value, mask):
        """(shifted + normalised k, shifted v (B, Hkv, Lk, D) in float32, the log-gates as cached (B, Hkv, Lk, S·G),
        key validity)."""
        d = query.shape[-1]
        compute = compute_dtype(query.dtype)
        a_k, a_v, gates, valid, has_prev, plain = self._key_states(ctx, layer, query, key, value, mask)
        k = self._shift(key[..., :d].to(compute), a_k, has_prev, ctx, plain)
        k = _rms_norm(k, None, QK_NORM_EPS)  # γ^k is on the queries (prepare)
        v = self._shift(value[..., :d].to(compute), a_v, has_prev, ctx, plain)
        return k, v, gates, valid

    def _key_states(self, ctx: PosContext, layer: int, query, key, value, mask):
        """The cached states read back: (α^k, α^v (B, Hkv, Lk), the log-gates as cached (B, Hkv, Lk, S·G), key
        validity (B|1, Lk), has_prev (B|1, Lk), plain: every key but the first has its predecessor (no mask))."""
        d = query.shape[-1]
        compute = compute_dtype(query.dtype)
        n_gates = self.num_gate_sets * self.groups
        k_state = unpack_state(key[..., d:], 1 + n_gates, compute)
        a_k, gates = k_state[..., 0], k_state[..., 1:]
        a_v = unpack_state(value[..., d:], 1, compute)[..., 0]
        k_len = key.shape[2]
        # which keys have a real predecessor: from the mask before a sliding window cut it (the shift belongs to
        # the token, not to the queries that may see it)
        unwindowed = ctx.unwindowed(mask)
        valid, has_prev = key_validity(unwindowed, k_len, key.device, ctx.memo)
        native = _native_window_has_prev(ctx, layer, k_len, key.device)
        if native is not None:
            has_prev = native
        if ctx.grid is not None:  # CLS (index 0) is no patch's predecessor
            has_prev = has_prev.clone()
            has_prev[:, : min(2, k_len)] = False
        plain = unwindowed is None and native is None and ctx.grid is None  # every key but the first has one
        return a_k, a_v, gates, valid, has_prev, plain

    def skips_engines(self, ctx: PosContext, query: torch.Tensor, key: torch.Tensor) -> bool:
        """True where `attend` computes the call itself (`_decodes`): no engine is tried first."""
        return self._decodes(ctx, query)

    def _decodes(self, ctx: PosContext, query: torch.Tensor) -> bool:
        """Whether this call takes `_few_queries` (``attend``; ``kernel_term`` then gives None): a few
        queries on the CPU without gradients, in eager mode (a compiled graph keeps the tile engine's op), causal
        text, no probabilities asked for, no backend forced but ``torch`` (a forced Triton or flex backend runs
        its kernels or raises)."""
        return (query.shape[2] <= FEW_QUERIES and query.device.type == "cpu" and not self.bidirectional
                and ctx.grid is None and not ctx.need_weights and not torch.is_grad_enabled()
                and not torch.compiler.is_compiling() and forced_backend() in (None, "torch"))

    def _few_queries(self, ctx: PosContext, layer: int, query, key, value, mask, scaling: float) -> torch.Tensor:
        """The attention of a few queries (a decoding step): out (B, H, Lq, D).

        The shifted, normalised keys and the shifted values of `_shifted_kv` (a pad and a lerp
        each, the norm as ``F.rms_norm``), the forgetting bias D_ij = c_i − c_j from the log-gates summed in the
        cache's layout, and one fused SDPA call with D as its float mask, the key/value heads as the batch (the G
        query heads of each, and their queries, as its rows): the reference's sums (``forgetting_attention``)
        without the engines' checks and without a (B, H, Lq, Lk) product of its own. Forming the scores
        explicitly instead (the key norm as a factor on them, the value shift as weights on the raw values)
        measured the same: a decoding step of SmolLM2's shape 1.28x the unpatched model's either way (2-core AMD
        EPYC, one thread, 15 interleaved rounds)."""
        b, h, q_len, d = query.shape
        hkv, k_len = key.shape[1], key.shape[2]
        compute = compute_dtype(query.dtype)
        k, v, gates, valid = self._shifted_kv(ctx, layer, query, key, value, mask)
        # (B, Hkv, G, Lk): the gates transposed before the sum, so that c and the bias are laid out by key (SDPA
        # reads a strided mask at half speed)
        c = cumulative_gates(gates.transpose(2, 3), None if mask is None else valid)
        if isinstance(ctx.q_offset, int):
            c_q = c[..., ctx.q_offset: ctx.q_offset + q_len]
        else:
            c_q = c.index_select(-1, query_indices(q_len, ctx.q_offset, c.device))
        bias = c_q[..., None] - c[..., None, :]  # (B, Hkv, G, Lq, Lk)
        if mask is not None:
            bias.masked_fill_(~mask[:, :, None], float("-inf"))
        out = F.scaled_dot_product_attention(query.to(compute).reshape(b, hkv, -1, d), k, v,
                                             attn_mask=bias.view(b, hkv, -1, k_len), scale=scaling)
        if mask is not None:
            out = torch.nan_to_num(out, nan=0.0)  # a row with no visible key
        return out.view(b, h, q_len, d).to(query.dtype)

    def finish(self, ctx: PosContext, layer: int, hidden: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out (B, Lq, H, D) -> σ(W_o x) ⊙ RMSNorm(out) ⊙ γ^o, per head, computed in float32."""
        compute = compute_dtype(out.dtype)
        gain = self.layer_slice(ctx, ("out_norm", compute), layer, lambda i: self.out_norm_weight[i].to(compute))
        weight = self.layer_slice(ctx, "out_gate", layer, lambda i: self.out_gate_weight[i])  # a view: no copy
        o = _rms_norm(out.to(compute), gain, OUT_NORM_EPS)
        gate = torch.sigmoid(F.linear(hidden.to(compute), weight.to(compute)))
        return (o * gate.view(o.shape)).to(out.dtype)
