"""``tape``: contextualised equivariant position encoding -- position states updated layer by layer.

"Rethinking Addressing in Language Models via Contextualized Equivariant Positional Encoding", Zhu, Wang,
Cai, Lee, Li and Wang 2025 (ICML 2025), https://arxiv.org/abs/2501.00712. "The code" below is the authors'
from-scratch language model, github.com/VITA-Group/TAPE, ``models/llama/adape.py`` (``TYPE=adape`` in
its README; ``PELlamaAttention``, ``PELayer``, ``LlamaDecoderLayer``, ``AdaRotaryEmbedding``), whose update
rules are reproduced here; where hf_posenc's hooks cannot reproduce them exactly, this is said below.

Position states
---------------
Every token i carries, per layer l and per query head h, a position state E^l_{i,h}: D/2 complex numbers
(c, s) (one per rotary frequency; D = head_dim), stored as the pair (cos-like, sin-like) of transformers'
half-split rotary layout. They start as rotary embedding and replace it in the attention:

    E^0_{i,h,k}   = (cos(pos_i θ_k), sin(pos_i θ_k)),  θ_k = theta^(−2k/D)      (RoPE; all heads alike)
    q̃_i = q_i ⊙ C_i + rot(q_i) ⊙ S_i,   k̃_j = k_j ⊙ C_j + rot(k_j) ⊙ S_j          (RoPE with the states)
    α_ij = softmax_j(s · q̃_i·k̃_j)      (s = the model's scale),   o_i = Σ_j α_ij v_j

and after the attention of layer l the states are updated, first by the attention itself, then by a
token-conditioned map over the head axis (the code's ``PELlamaAttention`` output ``pos_output``, the
``post_attention_linear`` einsum and ``PELayer``):

    Ê^l_i   = E^l_i + a^l ⊙ Σ_j α_ij E^l_j,        a^l_h = Σ_e W^l_{h,e}            (W^l ∈ R^{H×H})
    E^{l+1}_i = Ê^l_i + D^l [ φ(X^l x_i) ⊙ (U^l Ê^l_i) ]                            (per frequency, over heads)

with U^l ∈ R^{P×H} (``up_proj``), X^l ∈ R^{P×C} (``x_proj``), D^l ∈ R^{H×P} (``down_proj``), φ = SiLU (the
code's ``hidden_act``), P = ``position_size``. a^l_h is exactly the code's ``einsum('bqnd,qe->bqnd', E,
W)``, which sums W over its second index (a per-head scale; W is kept as the code's (H, H) matrix).
Both updates are linear in E with token- and attention-dependent coefficients, so they commute with a
common rotation of every state (the paper's O(2) equivariance) and with permutations of the tokens:
attention logits stay functions of relative position when the states are pure rotations, and a common
shift of all positions leaves every output unchanged (tested). The last layer's updates feed nothing,
so only layers 0 .. L−2 have update parameters.

Initialisation: the code zero-initialises W and U (``_init_weights``: "special zero initialization"), so
TAPE starts as exactly RoPE; X and D are drawn from N(0, initializer_range). ``init_std`` = None (the
default) draws W and U from N(0, initializer_range) too, ``init_std=0.0`` gives the code's zeros. Why the
default differs: with U = 0 the gradients of X and D are exactly zero at the first step (every term that
reaches them is multiplied by U), which hf_posenc's property tests reject for any learned parameter, and a
random start makes the contextual updates, and every cache/padding test of them, matter from the first
forward. The updates still start small (products of N(0, σ) factors).

Where this differs from the code, and why
-----------------------------------------
* x_i in the MLP-stage update: the code uses the output of layer l's MLP (``self.pe(self.mlp(...), E)``).
  hf_posenc's hooks see the attention input of each layer only (``prepare``), so x_i here is the
  attention input of layer l+1 (the normalised residual stream after layer l, which contains that MLP
  output). The update is applied at the start of layer l+1, which is where its result is first used.
* Grouped-query attention: the code asserts one key/value head per query head; here the states are per
  query head and the keys are rotated per query head (after ``expand_kv``).
* Caching: the code disables the KV cache (``past_key_values = None`` in its model forward); here it is
  supported (below). Its random offset of the initial positions during training (``AdaRotaryEmbedding``)
  is not reproduced: by the equivariance above a common offset changes nothing.
* Attention dropout (the code has none): the update uses the same (dropped-out) α as the values.
* ViT (bidirectional), a generalisation: the initial states are those of hf_posenc's ``rope`` on ViT
  (raster index, the CLS token unrotated), and the updates use the bidirectional attention.

Cache state
-----------
Layer l needs E^l_j of every past key (to rotate the keys and as the "values" of the attention-stage
update). ``prepare`` appends E^l of the new tokens to their keys (per key/value head, the states of its
G = H / Hkv query heads), so transformers' caches store them with the keys and they follow ``crop``,
beam-search ``reorder_cache`` and StaticCache (allocated lazily with the first update's shape) for free;
``attend`` strips them. The states of the new tokens are also appended to their queries (not cached).
In a bfloat16/float16 cache each float32 value x is stored as two channels hi = x.to(dtype),
lo = (x − hi).to(dtype), read back as hi + lo (16 or 22 significant bits instead of 8 or 11).

The states of the new tokens pass from layer l (Ê^l, computed in ``attend``) to layer l+1 (``prepare``)
through the per-forward context (``PosContext.memo``). With reentrant gradient checkpointing the first
forward of each layer runs without autograd, so that hand-over would lose the gradient of Ê^l; there,
layer l+1's recomputation reads Ê^l as a leaf, whose gradient its backward accumulates, and layer l's
recomputation hands that gradient to Ê^l through an identity node on its attention output
(:class:`_StateTunnel`; layer l+1's backward always runs before layer l's). Non-reentrant checkpointing
and plain training need none of this (the node then passes no gradient).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from ..config import PosEncConfig
from ..ops import expand_kv
from ..registry import param, register_encoding
from .base import ModelInfo, PosContext, PositionEncoding
from .cope import allowed_keys
from .rope import apply_rotary, rope_inv_freq

__all__ = ["Tape", "pack_state", "unpack_state"]

_ATTN_STATE = "tape_attn_state"  # memo key: (name, layer) -> Ê^layer of the new tokens (B, H, Lq, D) float32
_LEAF = "tape_leaf"  # memo key: (name, layer) -> the leaf copy of Ê^layer read by layer + 1 (reentrant recompute)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _width(dtype: torch.dtype) -> int:
    """Channels per stored value: 1 in a float32/float64 tensor, 2 (hi, lo) in a 16-bit one."""
    return 1 if dtype in (torch.float32, torch.float64) else 2


def pack_state(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(..., n) float values -> (..., n * w) channels of ``dtype``: x, or [hi, lo] with hi = x.to(dtype),
    lo = (x - hi).to(dtype) in a 16-bit dtype."""
    if _width(dtype) == 1:
        return x.to(dtype)
    hi = x.to(dtype)
    lo = (x - hi.to(x.dtype)).to(dtype)
    return torch.cat([hi, lo], dim=-1)


def unpack_state(t: torch.Tensor, n: int, compute: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`pack_state`: (..., n * w) -> (..., n) in ``compute`` dtype."""
    if _width(t.dtype) == 1:
        return t[..., :n].to(compute)
    return t[..., :n].to(compute) + t[..., n : 2 * n].to(compute)


class _StateTunnel(torch.autograd.Function):
    """Identity on ``out``; its backward gives ``state`` the gradient accumulated on the leaf stored at
    ``memo[key]`` (by the next layer's reentrant recomputation), or none."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, state: torch.Tensor, memo: dict, key: tuple) -> torch.Tensor:
        ctx.memo, ctx.key = memo, key
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        leaf = ctx.memo.get(ctx.key)
        grad_state = None if leaf is None else leaf.grad
        return grad_out, grad_state, None, None


@dataclass
class TapeParams:
    theta: float | None = param(
        None,
        "rotary base of the initial states (default: the model's rope_theta on Llama, else 10000)",
        type=float,
        optional=True,
        gt=1.0,
    )
    position_size: int | None = param(
        None,
        "width P of the token-conditioned state update (default: hidden_size // 2, as the authors' config)",
        type=int,
        optional=True,
        ge=1,
    )
    init_std: float | None = param(
        None,
        "std of the initial attention-update matrix W and up-projection U, which the code zero-initialises "
        "(default: the model's initializer_range; 0.0 gives the code's exact RoPE start)",
        type=float,
        optional=True,
        ge=0.0,
    )


@register_encoding(
    "tape",
    params=TapeParams,
    kind="contextual states",
    summary="rotary position states per head, updated after every layer by the attention and a token-conditioned "
    "map over heads (equivariant); states ride in the KV cache",
    paper="https://arxiv.org/abs/2501.00712",
)
class Tape(PositionEncoding):
    """TAPE; see the module docstring for the formulas.

    Parameters (only with 2 layers or more; index t = the update after layer t, t < num_layers - 1):
    ``attn_update`` (t, H, H), ``pe_up`` (t, P, H), ``pe_x`` (t, P, hidden_size), ``pe_down`` (t, H, P).
    """

    custom_attention = True
    prepares_qkv = True
    relative = True  # states start as rotary and the updates are equivariant (the paper's O(2) argument)
    reference_footprint = (4.0, 6.5)  # float32 (B, H, Lq, Lk) tensors (hf_posenc.memory)

    @classmethod
    def resolve(cls, config: PosEncConfig, info: ModelInfo) -> PosEncConfig:
        p = dict(config.params)
        if p["theta"] is None:
            p["theta"] = float(info.rope_theta) if info.rope_theta is not None else 10000.0
        if p["position_size"] is None:
            p["position_size"] = max(1, info.hidden_size // 2)
        return PosEncConfig(config.name, p)

    def __init__(self, config: PosEncConfig, info: ModelInfo) -> None:
        super().__init__(config, info)
        config = self.resolve(config, info)
        self.theta = float(config.params["theta"])
        self.position_size = int(config.params["position_size"])
        std = config.params["init_std"]
        std = float(info.initializer_range) if std is None else std
        n, h, p, c = info.num_layers - 1, info.num_heads, self.position_size, info.hidden_size
        if n > 0:
            shapes = {"attn_update": (n, h, h), "pe_up": (n, p, h), "pe_x": (n, p, c), "pe_down": (n, h, p)}
            stds = {"attn_update": std, "pe_up": std, "pe_x": info.initializer_range, "pe_down": info.initializer_range}
            for name, shape in shapes.items():
                weight = nn.Parameter(torch.zeros(shape))
                if stds[name] > 0:
                    with torch.no_grad():
                        nn.init.normal_(weight, mean=0.0, std=stds[name])
                self.register_parameter(name, weight)

    def check_model(self, info: ModelInfo) -> None:
        if info.head_dim % 2:
            raise ValueError(f"tape needs an even head_dim (rotary states), got {info.head_dim}")

    # -- states ----------------------------------------------------------------------------------
    def initial_state(self, ctx: PosContext, length: int, device: torch.device) -> torch.Tensor:
        """E^0 of the new tokens: (B|1, 1, Lq, D) float32, [cos | sin] of the rotary angles."""
        if ctx.grid is None:
            positions = ctx.position_ids
        else:  # raster index, as hf_posenc's rope on ViT; CLS (index 0) stays unrotated
            rows, cols = ctx.grid
            positions = (torch.arange(rows * cols + 1, device=device) - 1)[None, -length:]
        inv_freq = rope_inv_freq(self.info.head_dim, self.theta).to(device)
        angles = positions.to(device=device, dtype=torch.float32)[..., None] * inv_freq  # (B|1, L, D/2)
        cos, sin = angles.cos(), angles.sin()
        if ctx.grid is not None:
            is_cls = (positions < 0)[..., None]
            cos = cos.masked_fill(is_cls, 1.0)
            sin = sin.masked_fill(is_cls, 0.0)
        return torch.cat([cos, sin], dim=-1)[:, None]

    def mlp_update(self, t: int, hidden: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """D^t [φ(X^t x) ⊙ U^t E] for states (B, H, L, D) and token features x (B, L, C), over the head axis."""
        dtype = state.dtype
        up = torch.einsum("bhnd,ph->bpnd", state, self.pe_up[t].to(dtype))
        gate = F.silu(hidden.to(dtype) @ self.pe_x[t].to(dtype).T)  # (B, L, P)
        mixed = gate.transpose(1, 2)[..., None] * up
        return torch.einsum("bpnd,hp->bhnd", mixed, self.pe_down[t].to(dtype))

    def _trainable(self) -> bool:
        return any(p.requires_grad for p in self.parameters())

    def prepare(
        self, ctx: PosContext, layer: int, hidden: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Append E^layer of the new tokens to q (B, H, Lq, D) and k (B, Hkv, Lq, D) (see the module docstring);
        ``hidden`` (B, Lq, C) is this layer's attention input (x of the previous layer's update)."""
        b, h, n, d = q.shape
        hkv = k.shape[1]
        if layer == 0:
            state = self.initial_state(ctx, n, q.device).to(_compute_dtype(q.dtype)).expand(b, h, n, d)
        else:
            prev = ctx.memo.get((_ATTN_STATE, layer - 1))
            if prev is None:
                raise RuntimeError(
                    f"tape: layer {layer} found no position states from layer {layer - 1} in this forward; the "
                    "layers of a patched model must run in order within one forward"
                )
            if torch.is_grad_enabled() and not prev.requires_grad and self._trainable():
                # reentrant checkpoint recomputation: read the states as a leaf (see _StateTunnel)
                prev = prev.detach().requires_grad_(True)
                ctx.memo[(_LEAF, layer - 1)] = prev
            state = prev + self.mlp_update(layer - 1, hidden, prev)
        packed = pack_state(state, q.dtype)  # (B, H, n, D * w)
        width = packed.shape[-1]
        groups = h // hkv
        packed_k = packed.reshape(b, hkv, groups, n, width).permute(0, 1, 3, 2, 4).reshape(b, hkv, n, groups * width)
        return torch.cat([q, packed], dim=-1), torch.cat([k, packed_k.to(k.dtype)], dim=-1), v

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
        """Attention with the states' rotations, and the attention-stage state update.

        Args:
            query: (B, H, Lq, D + D·w) -- q and its states; key: (B, Hkv, Lk, D + G·D·w) -- k and the states of
                its G query heads; value: (B, Hkv, Lk, D).
            mask: (B|1, 1, Lq, Lk) bool (True = attend; causality included) or None.
            scaling: the model's logit scale.

        Returns:
            out (B, H, Lq, D) in the value's dtype, and the probabilities (B, H, Lq, Lk).
        """
        b, h, q_len, _ = query.shape
        hkv, k_len, d = key.shape[1], key.shape[2], value.shape[-1]
        groups = h // hkv
        dtype = _compute_dtype(value.dtype)
        width = query.shape[-1] - d
        q_state = unpack_state(query[..., d:], d, dtype)
        k_state = key[..., d:].reshape(b, hkv, k_len, groups, width).permute(0, 1, 3, 2, 4).reshape(b, h, k_len, width)
        k_state = unpack_state(k_state, d, dtype)
        half = d // 2
        q = apply_rotary(query[..., :d].to(dtype), q_state[..., :half], q_state[..., half:], "half")
        k = apply_rotary(expand_kv(key[..., :d], groups).to(dtype), k_state[..., :half], k_state[..., half:], "half")
        v = expand_kv(value, groups).to(dtype)

        scores = (q @ k.transpose(-1, -2)) * scaling
        allowed = allowed_keys(mask, q_len, k_len, ctx.q_offset, self.info.causal, query.device)
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)  # fully masked rows (left padding) -> 0
        dropped = F.dropout(probs, p=dropout, training=training)
        out = dropped @ v
        if layer < self.info.num_layers - 1:
            scale = self.attn_update[layer].to(dtype).sum(-1)  # a_h = Σ_e W_{h,e}, the code's einsum
            state = q_state + scale[None, :, None, None] * (dropped @ k_state)
            ctx.memo[(_ATTN_STATE, layer)] = state
            if torch.is_grad_enabled() and state.requires_grad:
                out = _StateTunnel.apply(out, state, ctx.memo, (_LEAF, layer))
        return out.to(value.dtype), probs
