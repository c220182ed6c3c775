"""``fox`` and ``fox_pro``: forgetting attention, the attention of the Forgetting Transformer.

"Forgetting Transformer: Softmax Attention with a Forget Gate", Lin, Nikishin, He and Courville, ICLR 2025,
https://arxiv.org/abs/2503.02130. "The code" below is the authors' implementation,
github.com/zhixuan-lin/forgetting-transformer, ``src/forgetting_transformer/model/forgetting_transformer/
modeling_forgetting_transformer.py`` (``ForgettingAttentionLayer``, ``ShiftLinear``, ``GroupRMSNorm``).

``fox``
-------
Every query head h of every layer has a scalar forget gate computed from the attention input x_t (the
hidden state that enters the attention block, i.e. after the block's norm):

    f_t  = σ(w_h · x_t + b_h)
    c_t  = Σ_{l <= t} log f_l                       (logsigmoid and cumsum in float32)
    D_ij = c_i − c_j = Σ_{l = j+1 .. i} log f_l     (j <= i; D_ii = 0; i.e. F_ij = Π_{l=j+1..i} f_l)
    O    = softmax(Q Kᵀ · scaling + D) V            (float32 softmax over the keys the mask allows)

``scaling`` is the model's (1/sqrt(head_dim)). No RoPE by default, as in the paper; ``rope=True`` also
rotates q and k exactly as the ``rope`` encoding does (half-split layout, base ``rope_theta``: default
500000, the official code's ``rope_base: float = 500000.0`` in
``src/forgetting_transformer/model/forgetting_transformer/configuration_forgetting_transformer.py``;
pass the model's own base explicitly to keep it). Under grouped-query attention the gates stay per query
head (a key/value head serves G = H / Hkv query heads, each with its own D).

Initialisation (the code: ``fgate_proj = nn.Linear(hidden, num_heads, bias=True)`` under the model's
``_init_weights``; the T_min/T_max bias initialisation, ``fgate_bias_init``, is asserted off for this
data-dependent "full" gate): w ~ N(0, initializer_range), b = 0.

Padding: a key no query may attend to (left padding, an empty StaticCache slot) has its log-gate set to
0 before the cumsum, so D between real tokens is that of the row alone (D_ij only ever sums the gates of
tokens j+1 .. i, which are real when i and j are); padded keys are masked. A block-diagonal mask of
packed sequences works too: D_ij only involves tokens between j and i, inside one document.

``fox_pro``
-----------
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
norm); q̂ is computed in float32 and rounded to the model dtype, as in the code.

Cache state
-----------
Everything a later decode step needs rides in extra channels appended to k (and v) in ``prepare``, so
transformers' caches store it with the keys and it follows ``crop``, beam-search ``reorder_cache`` and
StaticCache (allocated lazily with the first update's shape) for free; ``attend`` receives it back for
every key and strips it:

* fox:      k ‖ [log f of the G query heads of this kv head]                      (+ log g on ViT)
* fox_pro:  k_raw ‖ [α^k, log f (G)],   v_raw ‖ [α^v]                              (+ log g on ViT)

The cumulative sum c is recomputed over all keys at each forward (O(L) per head, negligible next to
the O(L²) scores), which is what makes the state follow crop/reorder without any extra bookkeeping.
FoX Pro stores the raw (unshifted, unnormalised) k and v: the shift of the first new token at a decode
step needs the previous token's raw k and v, which only the cache holds, so the shift and the key norm
are applied in ``attend`` to every key (O(L·D) per head, again negligible next to the scores).

Precision: the states are float32 values. When the cache dtype is float32 (or float64) they are stored
as they are. When it is bfloat16 or float16, each value x is stored as two channels, hi = x.to(dtype) and
lo = ((x − hi) · s).to(dtype), read back as hi + lo / s in float32 (s = 1 for bfloat16; s = 2^11 for
float16, which keeps lo a normal float16 number for log-gates down to ~1e-7). That is 16 (bfloat16) or 22
(float16) significant bits instead of 8 or 11, a relative error below 2^-16 per log-gate: the cumulative sum
of 4096 log-gates read from a bfloat16 cache stays within 3e-3 of the exact one (float32's own rounding of
that sum is ~2e-4; a single bfloat16 channel is off by 0.5). The split is differentiable (the gradient
reaching x is that of hi + lo / s); a bit-exact alternative, viewing the float32 bits as two 16-bit values,
would carry no gradient to the gates and be corrupted by any arithmetic on the cache. float16 cannot hold
|x| > 65504: log-gates are clamped to >= −30000 before packing into float16 (exp(−30000) = 0 either way).

ViT (bidirectional, no order) -- a documented generalisation
------------------------------------------------------------
The paper defines causal forgetting only. On ViT the patches are taken in raster order (row-major, as
they are laid out) and forgetting runs in both directions with separate gates, as bidirectional
state-space vision models scan the flattened patches forward and backward (e.g. Vision Mamba,
https://arxiv.org/abs/2401.09417): a forward gate f_t = σ(w_h · x_t + b_h) and a backward gate
g_t = σ(w'_h · x_t + b'_h) per head and patch, and for patches i, j (raster indices)

    D_ij = Σ_{l = j+1 .. i} log f_l     if j <= i      (FoX on the sequence)
    D_ij = Σ_{l = i .. j−1} log g_l     if j >  i      (FoX on the reversed sequence, its own gates)

so each direction keeps FoX's semantics: the query's own gate counts, the key's does not. Every pair
involving the CLS token gets D = 0 (the CLS token takes no positional term), and CLS is no patch's
predecessor. This is a sensible generalisation -- with all gates at 1 it is NoPE, and the model can
learn per head how far (and in which raster direction) to look -- but it is anisotropic: vertical
neighbours are ``cols`` raster steps apart, so gates decay vertical context faster than horizontal
context, as with any 1D scan of an image. ``fox_pro`` on ViT shifts each patch's k and v from the
previous patch in raster order (the first patch has a zero predecessor; CLS is not shifted).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from ..config import PosEncConfig
from ..kernels.attention.terms import KernelTerm
from ..ops import expand_kv
from ..registry import param, register_encoding
from .base import UNWINDOWED_MASK, ModelInfo, PosContext, PositionEncoding
from .rope import apply_rotary, rope_inv_freq

__all__ = ["Fox", "FoxPro", "pack_state", "unpack_state", "forget_bias", "forgetting_attention"]

#: eps of the QK-norm (the code's ``GroupRMSNorm`` default) and of the output norm (the code's ``norm_eps``).
QK_NORM_EPS = 1e-5
OUT_NORM_EPS = 1e-6
#: log-gates are clamped to this before they are packed into a float16 cache (|x| <= 65504 there).
_FP16_FLOOR = -30000.0
#: the lo part of a float16 pair is stored times 2^11 (|x - hi| <= 2^-11 |x|), so that it stays a normal
#: float16 number for log-gates down to ~1e-7 (float16's smallest normal is 6e-5); bfloat16 has float32's range.
_LO_SCALE = {torch.float16: 2048.0}


# ---------------------------------------------------------------------------------------------------
# helpers: state packing, masks, the forgetting bias, the attention itself
# ---------------------------------------------------------------------------------------------------


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32, or float64 for float64 inputs (gradient checks)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def state_width(dtype: torch.dtype) -> int:
    """Channels per stored float32 value in a cache of ``dtype``: 1 (float32/64) or 2 (hi/lo, 16-bit)."""
    return 1 if dtype in (torch.float32, torch.float64) else 2


def pack_state(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(..., n) float32 values -> (..., n * w) channels of ``dtype`` (w = :func:`state_width`): the values
    themselves, or [hi (n), lo (n)] with hi = x.to(dtype), lo = ((x - hi) * s).to(dtype) (s = 2^11 for
    float16, 1 for bfloat16); read back as hi + lo / s."""
    if state_width(dtype) == 1:
        return x.to(dtype)
    scale = _LO_SCALE.get(dtype, 1.0)
    if dtype == torch.float16:
        x = x.clamp_min(_FP16_FLOOR)
    hi = x.to(dtype)
    lo = ((x - hi.to(x.dtype)) * scale).to(dtype)
    return torch.cat([hi, lo], dim=-1)


def unpack_state(t: torch.Tensor, n: int, compute: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`pack_state`: (..., n * w) -> (..., n) in ``compute`` dtype."""
    if state_width(t.dtype) == 1:
        return t[..., :n].to(compute)
    return t[..., :n].to(compute) + t[..., n : 2 * n].to(compute) / _LO_SCALE.get(t.dtype, 1.0)


def key_validity(mask: torch.Tensor | None, k_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Which keys are real tokens, and which have a real predecessor, from the attention mask.

    Returns ``valid`` (B|1, Lk) bool: some query may attend to the key (False on left padding and on empty
    StaticCache slots), and ``has_prev`` (B|1, Lk) bool: some query may attend to both key j - 1 and key j
    (False at j = 0, on the first real token after padding, and at a document boundary of a block-diagonal
    mask of packed sequences). With no mask every key is valid.
    """
    if mask is None:
        valid = torch.ones(1, k_len, dtype=torch.bool, device=device)
        return valid, F.pad(valid[:, 1:], (1, 0), value=False)
    m = mask[:, 0]  # (B|1, Lq, Lk)
    valid = m.any(dim=-2)
    has_prev = F.pad((m[..., 1:] & m[..., :-1]).any(dim=-2), (1, 0), value=False)
    return valid, has_prev


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


def _query_index(q_len: int, q_offset: int | torch.Tensor, device: torch.device) -> torch.Tensor:
    """(Lq,) int64 key index of each query (a StaticCache gives a 0-d tensor offset)."""
    off = q_offset.to(device) if isinstance(q_offset, torch.Tensor) else q_offset
    return torch.arange(q_len, device=device) + off


def forget_bias(
    log_f: torch.Tensor,
    valid: torch.Tensor,
    q_index: torch.Tensor,
    log_g: torch.Tensor | None = None,
    cls: bool = False,
) -> torch.Tensor:
    """The forgetting bias D (B, H, Lq, Lk) in the dtype of ``log_f``.

    Args:
        log_f: (B, H, Lk) log forget gates of every key (float32/64).
        valid: (B|1, Lk) bool; the gates of invalid keys (padding, empty slots) count as log 1 = 0.
        q_index: (Lq,) int64 key index of each query.
        log_g: (B, H, Lk) backward log-gates (bidirectional): D_ij for j > i sums log g over i .. j-1.
            None: causal, D_ij = c_i - c_j for every pair (pairs j > i are masked by the caller).
        cls: key 0 is a CLS token: every pair involving it gets D = 0.
    """
    keep = valid[:, None, :]
    c = log_f.masked_fill(~keep, 0.0).cumsum(-1)  # c_t = sum_{l <= t} log f_l
    cq = c.index_select(-1, q_index)
    bias = cq[..., :, None] - c[..., None, :]
    if log_g is not None:
        cg = log_g.masked_fill(~keep, 0.0).cumsum(-1)
        e = F.pad(cg[..., :-1], (1, 0))  # exclusive: e_t = sum_{l < t} log g_l
        eq = e.index_select(-1, q_index)
        backward = e[..., None, :] - eq[..., :, None]  # e_j - e_i = sum_{l=i..j-1} log g_l
        k_index = torch.arange(log_f.shape[-1], device=log_f.device)
        later = k_index[None, :] > q_index[:, None]
        bias = torch.where(later, backward, bias)
    if cls:
        k_index = torch.arange(log_f.shape[-1], device=log_f.device)
        pair = (q_index[:, None] == 0) | (k_index[None, :] == 0)
        bias = bias.masked_fill(pair, 0.0)
    return bias


def _cumulative_gates(log_f: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """c (B, H, Lk) = cumsum of the log-gates (B, H, Lk), invalid keys' gates counting as 0 (as in forget_bias)."""
    return log_f.masked_fill(~valid[:, None, :], 0.0).cumsum(-1)


def forgetting_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bias: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    training: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(Q Kᵀ · scaling + D) V in float32 (float64 for float64 inputs).

    Args:
        query: (B, H, Lq, D); key, value: (B, Hkv, Lk, D) (without state channels), H a multiple of Hkv.
        bias: (B, H, Lq, Lk) the forgetting bias D.
        mask: (B|1, 1, Lq, Lk) bool (True = attend) or None.

    Returns:
        out (B, H, Lq, D) in the query's dtype and the probabilities (B, H, Lq, Lk) in the compute dtype
        (after dropout, as transformers' eager attention returns them); rows whose keys are all masked give
        zeros.
    """
    dtype = _compute_dtype(query.dtype)
    groups = query.shape[1] // key.shape[1]
    k = expand_kv(key, groups).to(dtype)
    v = expand_kv(value, groups).to(dtype)
    scores = torch.matmul(query.to(dtype), k.transpose(-1, -2)) * scaling + bias.to(dtype)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    # torch.softmax subtracts the row maximum (stable for any finite logits); fully masked rows are NaN -> 0.
    probs = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)
    if dropout > 0:
        probs = F.dropout(probs, p=dropout, training=training)
    out = torch.matmul(probs, v)
    return out.to(query.dtype), probs


class _RmsNorm(torch.autograd.Function):
    """y = x r w, r = 1 / sqrt(mean(x², -1) + eps), w broadcast to x. Saves x and r (autograd's chain of the same
    expression keeps x r as well: one more tensor of x's size per norm, three norms a layer in FoX Pro)."""

    @staticmethod
    def forward(ctx, x, weight, eps):  # type: ignore[override]
        r = torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + eps)
        ctx.save_for_backward(x, r, weight)
        return x * r * weight

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):  # type: ignore[override]
        x, r, weight = ctx.saved_tensors
        xh = x * r
        dx = dw = None
        if ctx.needs_input_grad[0]:
            g = dy * weight
            dx = (g - xh * (g * xh).mean(dim=-1, keepdim=True)) * r
        if ctx.needs_input_grad[1]:
            dw = (dy * xh).sum_to_size(weight.shape)
        return dx, dw, None


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x², -1) + eps) * weight, in the dtype of x."""
    return _RmsNorm.apply(x, weight, eps)


def _previous(x: torch.Tensor, has_prev: torch.Tensor) -> torch.Tensor:
    """x_{t-1} along the key axis of x (B, Hkv, Lk, D), 0 where not ``has_prev`` (B|1, Lk)."""
    prev = F.pad(x[..., :-1, :], (0, 0, 1, 0))
    return torch.where(has_prev[:, None, :, None], prev, torch.zeros_like(prev))


class _TokenShift(torch.autograd.Function):
    """y_t = α_t x_{t-1} + (1 - α_t) x_t (x_{t-1} = 0 where not ``has_prev``). Saves x and α only: the shifted copy
    is rebuilt in backward (autograd's chain keeps it and (1 - α) x alongside x)."""

    @staticmethod
    def forward(ctx, x, alpha, has_prev):  # type: ignore[override]
        ctx.save_for_backward(x, alpha, has_prev)
        a = alpha[..., None]
        return a * _previous(x, has_prev) + (1 - a) * x

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


# ---------------------------------------------------------------------------------------------------
# fox
# ---------------------------------------------------------------------------------------------------


@dataclass
class FoxParams:
    rope: bool = param(False, "also apply rotary embedding to q and k (the paper's FoX uses none)", type=bool)
    rope_theta: float | None = param(
        None,
        "rotary base when rope=True (default 500000, the official FoX code's rope_base)",
        type=float,
        optional=True,
        gt=1.0,
    )


_FOX_ROPE_BASE = 500000.0  # official code: configuration_forgetting_transformer.py, rope_base


def _resolve_theta(config: PosEncConfig, info: ModelInfo) -> PosEncConfig:
    p = dict(config.params)
    if p.get("rope") and p.get("rope_theta") is None:
        p["rope_theta"] = _FOX_ROPE_BASE
    return PosEncConfig(config.name, p)


@register_encoding(
    "fox",
    params=FoxParams,
    kind="data-dependent",
    summary="forget gates σ(w·x_t + b) per head: D_ij = Σ_{j<l<=i} log f_l added to the logits; "
    "forward and backward gates along the raster order on ViT",
    paper="https://arxiv.org/abs/2503.02130",
)
class Fox(PositionEncoding):
    """Forgetting attention; see the module docstring for the formulas and the cache state.

    Parameters: ``gate_weight`` (num_layers, H, C) and ``gate_bias`` (num_layers, H); on ViT also
    ``gate_weight_bwd`` and ``gate_bias_bwd`` (the backward gates).
    """

    custom_attention = True
    prepares_qkv = True
    relative = True  # gates from x_t, D_ij from the tokens between j and i; rope=True adds rotary (relative)
    reference_footprint = (5.0, 6.5)  # float32 (B, H, Lq, Lk) tensors (hf_posenc.memory)
    kernel_kinds = ("fox",)

    def __init__(self, config: PosEncConfig, info: ModelInfo) -> None:
        super().__init__(config, info)
        self.bidirectional = not info.causal
        self.groups = info.num_heads // info.num_kv_heads
        shape = (info.num_layers, info.num_heads, info.hidden_size)
        self.gate_weight = nn.Parameter(torch.randn(shape) * info.initializer_range)
        self.gate_bias = nn.Parameter(torch.zeros(shape[:2]))
        if self.bidirectional:
            self.gate_weight_bwd = nn.Parameter(torch.randn(shape) * info.initializer_range)
            self.gate_bias_bwd = nn.Parameter(torch.zeros(shape[:2]))

    @classmethod
    def resolve(cls, config: PosEncConfig, info: ModelInfo) -> PosEncConfig:
        return _resolve_theta(config, info)

    def check_model(self, info: ModelInfo) -> None:
        if info.num_heads % info.num_kv_heads:
            raise ValueError(
                f"{self.name} needs num_heads ({info.num_heads}) divisible by num_kv_heads ({info.num_kv_heads})"
            )
        if self.posenc_config.params.get("rope") and info.head_dim % 2:
            raise ValueError(f"{self.name} with rope=True needs an even head_dim, got {info.head_dim}")

    # -- the state ------------------------------------------------------------------------------------
    @property
    def num_gate_sets(self) -> int:
        """1 (forward gates), or 2 on ViT (forward and backward)."""
        return 2 if self.bidirectional else 1

    def log_gates(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """(B, L, S, H) log forget gates logsigmoid(w·x + b) in float32 (float64 for float64 inputs), for the
        S gate sets (forward; and backward on ViT), from the attention input ``hidden`` (B, L, C)."""
        dtype = _compute_dtype(hidden.dtype)
        x = hidden.to(dtype)
        sets = [F.logsigmoid(F.linear(x, self.gate_weight[layer].to(dtype), self.gate_bias[layer].to(dtype)))]
        if self.bidirectional:
            w, b = self.gate_weight_bwd[layer].to(dtype), self.gate_bias_bwd[layer].to(dtype)
            sets.append(F.logsigmoid(F.linear(x, w, b)))
        return torch.stack(sets, dim=2)

    def _gates_to_kv(self, log_gates: torch.Tensor) -> torch.Tensor:
        """(B, L, S, H) -> (B, Hkv, L, S*G): each key/value head carries the gates of its G query heads."""
        b, n, s, h = log_gates.shape
        hkv = h // self.groups
        return log_gates.reshape(b, n, s, hkv, self.groups).permute(0, 3, 1, 2, 4).reshape(b, hkv, n, s * self.groups)

    def _gates_from_kv(self, state: torch.Tensor) -> list[torch.Tensor]:
        """(B, Hkv, Lk, S*G) -> S tensors (B, H, Lk)."""
        b, hkv, n, _ = state.shape
        state = state.reshape(b, hkv, n, self.num_gate_sets, self.groups).permute(3, 0, 1, 4, 2)
        return [s.reshape(b, hkv * self.groups, n) for s in state]

    def _rotate(self, ctx: PosContext, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE (half-split layout) at the tokens' positions, as the ``rope`` encoding does."""
        if ctx.grid is None:
            positions = ctx.position_ids
        else:
            rows, cols = ctx.grid
            positions = torch.arange(rows * cols + 1, device=q.device)[None] - 1
        inv_freq = rope_inv_freq(self.info.head_dim, self.posenc_config.params["rope_theta"]).to(q.device)
        angles = (positions.to(device=q.device, dtype=torch.float32)[..., None] * inv_freq)[:, None]
        cos, sin = angles.cos(), angles.sin()
        if ctx.grid is not None:  # the CLS token is not rotated
            cos, sin = cos.clone(), sin.clone()
            cos[..., 0, :], sin[..., 0, :] = 1.0, 0.0
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        return apply_rotary(q, cos, sin, "half"), apply_rotary(k, cos, sin, "half")

    # -- the operations ---------------------------------------------------------------------------------
    def prepare(
        self, ctx: PosContext, layer: int, hidden: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Optionally rotate q, k; append the log-gates of the new tokens to k (B, Hkv, L, D + S*G*w)."""
        if self.posenc_config.params.get("rope"):
            q, k = self._rotate(ctx, q, k)
        state = self._gates_to_kv(self.log_gates(layer, hidden))
        return q, torch.cat([k, pack_state(state, k.dtype)], dim=-1), v

    def _bias(
        self, ctx: PosContext, gates: list[torch.Tensor], valid: torch.Tensor, q_len: int, device: torch.device
    ) -> torch.Tensor:
        q_index = _query_index(q_len, ctx.q_offset, device)
        log_g = gates[1] if self.bidirectional else None
        return forget_bias(gates[0], valid, q_index, log_g=log_g, cls=ctx.grid is not None)

    def attend(
        self,
        ctx: PosContext,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor | None,
        scaling: float,
        dropout: float,
        training: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forgetting attention. q (B, H, Lq, D); key (B, Hkv, Lk, D + state), value (B, Hkv, Lk, D); mask
        (B|1, 1, Lq, Lk) bool or None. Returns out (B, H, Lq, D) and probabilities (B, H, Lq, Lk)."""
        d = query.shape[-1]
        compute = _compute_dtype(query.dtype)
        k, state = key[..., :d], key[..., d:]
        gates = self._gates_from_kv(unpack_state(state, self.num_gate_sets * self.groups, compute))
        valid, _ = key_validity(mask, key.shape[2], key.device)
        bias = self._bias(ctx, gates, valid, query.shape[2], key.device)
        return forgetting_attention(query, k, value, bias, mask, scaling, dropout, training)

    def kernel_term(self, ctx: PosContext, layer: int, query, key, value, mask) -> KernelTerm | None:
        """The fused-attention term: c (B, H, Lk), the cumulative log-gates (padding's gates zeroed, as in
        :func:`forget_bias`), with the cache's state channels stripped from the keys. None on ViT."""
        if self.bidirectional or ctx.grid is not None:
            return None
        d = query.shape[-1]
        compute = _compute_dtype(query.dtype)
        gates = self._gates_from_kv(unpack_state(key[..., d:], self.num_gate_sets * self.groups, compute))
        valid, _ = key_validity(mask, key.shape[2], key.device)
        return KernelTerm.fox(_cumulative_gates(gates[0], valid), key=key[..., :d])


# ---------------------------------------------------------------------------------------------------
# fox_pro
# ---------------------------------------------------------------------------------------------------


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

    Parameters (per layer, stacked on dim 0): the forget gates of :class:`Fox`, ``key_shift_weight`` and
    ``value_shift_weight`` (num_layers, Hkv, C), ``q_norm_weight`` (num_layers, H, D), ``k_norm_weight``
    (num_layers, Hkv, D), ``out_norm_weight`` (num_layers, H, D) and ``out_gate_weight`` (num_layers, H*D, C).
    """

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
        dtype = _compute_dtype(hidden.dtype)
        x = hidden.to(dtype)
        a_k = torch.sigmoid(F.linear(x, self.key_shift_weight[layer].to(dtype)))
        a_v = torch.sigmoid(F.linear(x, self.value_shift_weight[layer].to(dtype)))
        return a_k.transpose(1, 2), a_v.transpose(1, 2)

    def prepare(
        self, ctx: PosContext, layer: int, hidden: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q -> QK-normed q; k -> raw k ‖ [α^k, log-gates]; v -> raw v ‖ [α^v] (the shift and the key norm
        need the previous token's raw k and v, so they are applied in ``attend``)."""
        compute = _compute_dtype(q.dtype)
        q = _rms_norm(q.to(compute), self.q_norm_weight[layer].to(compute)[None, :, None, :], QK_NORM_EPS).to(q.dtype)
        a_k, a_v = self.shift_gates(layer, hidden)
        gates = self._gates_to_kv(self.log_gates(layer, hidden))
        k_state = torch.cat([a_k[..., None], gates], dim=-1)
        k = torch.cat([k, pack_state(k_state, k.dtype)], dim=-1)
        v = torch.cat([v, pack_state(a_v[..., None], v.dtype)], dim=-1)
        return q, k, v

    def _shift(self, x: torch.Tensor, alpha: torch.Tensor, has_prev: torch.Tensor, ctx: PosContext) -> torch.Tensor:
        """α_t x_{t-1} + (1 - α_t) x_t over the key axis (x_{t-1} = 0 where not ``has_prev``).

        x (B, Hkv, Lk, D), alpha (B, Hkv, Lk), has_prev (B|1, Lk) bool."""
        if ctx.grid is not None:  # the CLS token is not shifted
            alpha = alpha.clone()
            alpha[..., 0] = 0.0
        return _TokenShift.apply(x, alpha, has_prev)

    def attend(
        self,
        ctx: PosContext,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor | None,
        scaling: float,
        dropout: float,
        training: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Shift k and v, normalise k, then forgetting attention. q (B, H, Lq, D) already normalised; key
        (B, Hkv, Lk, D + state), value (B, Hkv, Lk, D + state). Returns out (B, H, Lq, D), probs (B, H, Lq, Lk)."""
        k, v, gates, valid = self._attention_kv(ctx, layer, query, key, value, mask)
        bias = self._bias(ctx, gates, valid, query.shape[2], key.device)
        return forgetting_attention(query, k, v, bias, mask, scaling, dropout, training)

    def kernel_term(self, ctx: PosContext, layer: int, query, key, value, mask) -> KernelTerm | None:
        """The fused-attention term: c of the forward gates, with the shifted, normalised keys and the shifted
        values (in the query's dtype) replacing the cached ones. None on ViT (two-way gates)."""
        if self.bidirectional or ctx.grid is not None:
            return None
        k, v, gates, valid = self._attention_kv(ctx, layer, query, key, value, mask)
        return KernelTerm.fox(_cumulative_gates(gates[0], valid), key=k.to(query.dtype), value=v.to(query.dtype))

    def _attention_kv(self, ctx: PosContext, layer: int, query, key, value, mask):
        """(shifted + normalised k, shifted v (B, Hkv, Lk, D) in float32, the log-gates, key validity)."""
        d = query.shape[-1]
        compute = _compute_dtype(query.dtype)
        n_gates = self.num_gate_sets * self.groups
        k_state = unpack_state(key[..., d:], 1 + n_gates, compute)
        a_k, gates = k_state[..., 0], self._gates_from_kv(k_state[..., 1:])
        a_v = unpack_state(value[..., d:], 1, compute)[..., 0]
        k_len = key.shape[2]
        # which keys have a real predecessor: from the mask before a sliding window cut it (the shift belongs to
        # the token, not to the queries that may see it)
        # (only with an own window: the lookup by id(mask) makes torch.compile guard on the mask object, one
        # recompile per call)
        unwindowed = mask
        if mask is not None and ctx.own_window() is not None:
            unwindowed = ctx.memo.get((UNWINDOWED_MASK, id(mask)), mask)
        valid, has_prev = key_validity(unwindowed, k_len, key.device)
        native = _native_window_has_prev(ctx, layer, k_len, key.device)
        if native is not None:
            has_prev = native
        if ctx.grid is not None:  # CLS (index 0) is no patch's predecessor
            has_prev = has_prev.clone()
            has_prev[:, : min(2, k_len)] = False
        k = self._shift(key[..., :d].to(compute), a_k, has_prev, ctx)
        k = _rms_norm(k, self.k_norm_weight[layer].to(compute)[None, :, None, :], QK_NORM_EPS)
        v = self._shift(value[..., :d].to(compute), a_v, has_prev, ctx)
        return k, v, gates, valid

    def finish(self, ctx: PosContext, layer: int, hidden: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out (B, Lq, H, D) -> σ(W_o x) ⊙ RMSNorm(out) ⊙ γ^o, per head, computed in float32."""
        compute = _compute_dtype(out.dtype)
        o = _rms_norm(out.to(compute), self.out_norm_weight[layer].to(compute), OUT_NORM_EPS)
        gate = torch.sigmoid(F.linear(hidden.to(compute), self.out_gate_weight[layer].to(compute)))
        return (o * gate.view(o.shape)).to(out.dtype)
