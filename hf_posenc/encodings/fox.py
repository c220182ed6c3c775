"""``fox``: forgetting attention, the attention of the Forgetting Transformer (``fox_pro``, FoX with the
"Pro" block, is in `hf_posenc.encodings.fox_pro`).

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

Cache state
-----------
Everything a later decode step needs rides in extra channels appended to k (and v) in ``prepare``, so
transformers' caches store it with the keys and it follows ``crop``, beam-search ``reorder_cache`` and
StaticCache (allocated lazily with the first update's shape) for free; ``attend`` receives it back for
every key and strips it:

* fox:      k ‖ [log f of the G query heads of this kv head]                      (+ log g on ViT)
* fox_pro:  k_raw ‖ [α^k, log f (G)],   v_raw ‖ [α^v]                              (+ log g on ViT)

The states are float32 values, stored in the cache's dtype by `hf_posenc.encodings.cache_state`
(two channels, hi and lo, in a bfloat16 or float16 cache: 16 or 22 significant bits; log-gates are clamped to
>= −30000 in float16, where exp(−30000) = 0 either way).

The cumulative sum c is recomputed over all keys at each forward (O(L) per head, negligible next to
the O(L²) scores), which is what makes the state follow crop/reorder without any extra bookkeeping.

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
from ..kernels._common import compute_dtype
from ..kernels._masks import memo_per_mask, query_indices
from ..kernels.attention.terms import KernelTerm
from ..ops import expand_kv
from ..registry import param, register_encoding
from .base import ModelInfo, PosContext, PositionEncoding
from .cache_state import pack_state, unpack_state
from .rope import apply_rotary, rope_inv_freq

__all__ = ["Fox", "cumulative_gates", "forget_bias", "forgetting_attention", "key_validity"]


# ---------------------------------------------------------------------------------------------------
# helpers: masks, the forgetting bias, the attention itself
# ---------------------------------------------------------------------------------------------------


def key_validity(mask: torch.Tensor | None, k_len: int, device: torch.device,
                 memo: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Which keys are real tokens, and which have a real predecessor, from the attention mask.

    Returns ``valid`` (B|1, Lk) bool: some query may attend to the key (False on left padding and on empty
    StaticCache slots), and ``has_prev`` (B|1, Lk) bool: some query may attend to both key j - 1 and key j
    (False at j = 0, on the first real token after padding, and at a document boundary of a block-diagonal
    mask of packed sequences). With no mask every key is valid.

    ``memo`` (a forward's ``PosContext.memo``): computed once per mask (or for no mask, per key count) and shared by
    the layers that get the same mask (eager mode; under ``torch.compile`` the key, the mask's address, cannot be
    traced). The memo holds the mask too, so no other mask can take its address while the forward runs.
    """
    if memo is not None:
        return memo_per_mask(memo, "fox_key_validity", mask, (k_len, str(device)),
                             lambda: key_validity(mask, k_len, device))
    if mask is None:
        valid = torch.ones(1, k_len, dtype=torch.bool, device=device)
        return valid, F.pad(valid[:, 1:], (1, 0), value=False)
    m = mask[:, 0]  # (B|1, Lq, Lk)
    valid = m.any(dim=-2)
    has_prev = F.pad((m[..., 1:] & m[..., :-1]).any(dim=-2), (1, 0), value=False)
    return valid, has_prev


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


def cumulative_gates(log_f: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """c (B, ..., Lk) = cumsum of the log-gates (B, ..., Lk) (e.g. (B, H, Lk)), invalid keys' gates counting as 0
    (as in forget_bias); ``valid`` (B|1, Lk), broadcast over the middle axes; None: every key is valid (no mask)."""
    if valid is None:
        return log_f.cumsum(-1)
    return log_f.masked_fill(~valid[(slice(None),) + (None,) * (log_f.dim() - 2)], 0.0).cumsum(-1)


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
    dtype = compute_dtype(query.dtype)
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


#: the forget-gate bias of an inert start (``init="identity"``): σ(10) = 1 − 4.54e-5.
INERT_GATE_BIAS = 10.0

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

    def start_inert(self) -> str:
        """``init="identity"``: w = 0 and b = `INERT_GATE_BIAS`, so every forget gate is σ(10) and
        D_ij = −(i − j) · 4.54e-5 (a gate only approaches 1: the logits move by at most 4.54e-5 per token of
        distance, 0.023 at 512 tokens). A finite b keeps the gates trainable (w's gradient is not zero)."""
        with torch.no_grad():
            for name in ("gate_weight", "gate_weight_bwd"):
                if hasattr(self, name):
                    getattr(self, name).zero_()
            for name in ("gate_bias", "gate_bias_bwd"):
                if hasattr(self, name):
                    getattr(self, name).fill_(INERT_GATE_BIAS)
        per_token = -F.logsigmoid(torch.tensor(INERT_GATE_BIAS, dtype=torch.float64)).item()
        return f"within {per_token:.3g} per token of distance on each logit (forget gates sigma({INERT_GATE_BIAS:g}))"

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
        dtype = compute_dtype(hidden.dtype)
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
        q_index = query_indices(q_len, ctx.q_offset, device)
        log_g = gates[1] if self.bidirectional else None
        return forget_bias(gates[0], valid, q_index, log_g=log_g, cls=ctx.grid is not None)

    def attend(self, ctx: PosContext, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               mask: torch.Tensor | None, scaling: float, dropout: float, training: bool
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forgetting attention. q (B, H, Lq, D); key (B, Hkv, Lk, D + state), value (B, Hkv, Lk, D); mask
        (B|1, 1, Lq, Lk) bool or None. Returns out (B, H, Lq, D) and probabilities (B, H, Lq, Lk)."""
        d = query.shape[-1]
        compute = compute_dtype(query.dtype)
        k, state = key[..., :d], key[..., d:]
        gates = self._gates_from_kv(unpack_state(state, self.num_gate_sets * self.groups, compute))
        # which keys are real: from the mask before a window cut it (the gates between a sink and the window count)
        valid, _ = key_validity(ctx.unwindowed(mask), key.shape[2], key.device, ctx.memo)
        bias = self._bias(ctx, gates, valid, query.shape[2], key.device)
        return forgetting_attention(query, k, value, bias, mask, scaling, dropout, training)

    def kernel_term(self, ctx: PosContext, layer: int, query, key, value, mask) -> KernelTerm | None:
        """The fused-attention term: c (B, H, Lk), the cumulative log-gates (padding's gates zeroed, as in
        `forget_bias`), with the cache's state channels stripped from the keys. None on ViT."""
        if self.bidirectional or ctx.grid is not None:
            return None
        d = query.shape[-1]
        compute = compute_dtype(query.dtype)
        gates = self._gates_from_kv(unpack_state(key[..., d:], self.num_gate_sets * self.groups, compute))
        valid = None if mask is None else key_validity(mask, key.shape[2], key.device, ctx.memo)[0]  # None: all
        return KernelTerm.fox(cumulative_gates(gates[0], valid), key=key[..., :d])
