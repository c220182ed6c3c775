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

Defaults. ``position_size`` P = 4 × num_attention_heads: the authors' pretraining config
``config/adape.json`` (github.com/VITA-Group/TAPE, commit e1cddc37, the paper's 12-head, hidden-768 model
trained by ``script/train.sh --config_name config/${TYPE}.json``) sets ``"position_size": 48`` for
``"num_attention_heads": 12``. (A later commit of that file, bc1afb08, changes the model to 8 heads at hidden
512 with P = 256; the paper's setting is the 12-head one.)

Initialisation: the code zero-initialises W and U (``_init_weights``: "special zero initialization"), so
TAPE starts as exactly RoPE; X and D are drawn from N(0, initializer_range). ``init_std`` = None (the
default) draws W and U from N(0, initializer_range) too, ``init_std=0.0`` gives the code's zeros. Why the
default differs: with U = 0 the gradients of X and D are exactly zero at the first step (every term that
reaches them is multiplied by U), which hf_posenc's property tests reject for any learned parameter, and a
random start makes the contextual updates, and every cache/padding test of them, matter from the first
forward. The updates still start small (products of N(0, σ) factors).

Where the MLP-stage update runs
-------------------------------
As in the code (``LlamaDecoderLayer.forward``: ``hidden_states = self.mlp(...)``, then
``position_states = self.pe(hidden_states, position_states)``), x_i is the output of layer l's MLP (before
the residual addition). hf_posenc reaches it through instance-level forward hooks on each decoder layer's
``mlp`` (`hf_posenc.patches.base.tap_mlp_outputs`, installed at patch time): the hook hands the MLP
output to `Tape.mlp_output`, which computes E^{l+1} and stores it for layer l+1's ``prepare``.

Attention-stage update without (B, H, L, L) tensors
----------------------------------------------------
Σ_j α_ij E_j is attention with the states (per query head) as further values, so ``scaled_dot_product_attention``
over v and over E gives both o_i and the update. As in the code's flash path (``flash_attn_func(q, k,
position_state0)``), these are separate fused calls (PyTorch's fused CPU kernel needs values as wide as q and k;
with attention dropout, one call over [v | E] with q and k zero-padded, so that one dropout mask acts on both), with
is_causal when the mask is causality alone; they read the cache's grouped layout (below) through views, the
key/value heads as the batch (`_grouped_attention`). The attention probabilities (B, H, Lq, Lk) are built only
when they are asked for (``output_attentions``).

Where this differs from the code, and why
-----------------------------------------
* Grouped-query attention: the code asserts one key/value head per query head; here the states are per
  query head and the keys are rotated per query head (each key broadcast over the query heads of its group).
* Caching: the code disables the KV cache (``past_key_values = None`` in its model forward); here it is
  supported (below). Its random offset of the initial positions during training (``AdaRotaryEmbedding``)
  is not reproduced: by the equivariance above a common offset changes nothing.
* Attention dropout (the code has none): the update uses the same (dropped-out) α as the values.
* ViT (bidirectional), a generalisation: the initial states are those of hf_posenc's ``rope`` on ViT
  (raster index, the CLS token unrotated), and the updates use the bidirectional attention.

Cache state
-----------
Layer l needs every past key rotated by its state E^l_j, and E^l_j itself (the "values" of the attention-stage
update). ``prepare`` rotates the new tokens' keys by their states, once per query head (the states are per query
head), and stores per key/value head the key rotated for each of its G = H / Hkv query heads, then those heads'
states (G·D rotated channels, then G·D·w state channels): transformers' caches keep them with the keys, and they
follow ``crop``, beam-search ``reorder_cache`` and StaticCache (allocated lazily with the first update's shape) for
free; ``attend`` splits them. A decoding step then rotates no cached key again (rotating every cached key in every
layer cost tape 1.58x the unpatched model's decoding time on SmolLM2's shape); the cache is G·(D + D·w) channels
wide instead of D. The attention reads that layout as it is (`_grouped_attention`), without copying the keys
and states per query head. The states of the new tokens reach ``attend`` for their queries through
``PosContext.memo`` (queries are not cached).
The rotated keys are stored in the cache's dtype, as a RoPE model caches its keys. In a bfloat16/float16 cache
each float32 state value is stored as two channels (hi, lo), as FoX stores its gates
(`hf_posenc.encodings.cache_state`: 16 or 22 significant bits instead of 8 or 11).

The states of the new tokens pass from layer l's attention (Ê^l, computed in ``attend``) to its MLP hook
(E^{l+1}, `Tape.mlp_output`) and on to layer l+1 (``prepare``) through the per-forward context
(``PosContext.memo``). With reentrant gradient checkpointing the first forward of each layer runs without
autograd, so that hand-over would lose the gradient of E^{l+1}; there, layer l+1's recomputation reads
E^{l+1} as a leaf, whose gradient its backward accumulates, and layer l's recomputation hands that gradient
to E^{l+1} through an identity node on its MLP output (`_StateTunnel`; layer l+1's backward always
runs before layer l's). Non-reentrant checkpointing and plain training need none of this (the node then
passes no gradient).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from ..config import PosEncConfig
from ..kernels._common import compute_dtype
from ..ops import expand_kv
from ..registry import param, register_encoding
from .base import PLAIN_CAUSAL, ModelInfo, PosContext, PositionEncoding
from .cache_state import pack_state, unpack_state
from ..kernels._masks import allowed_keys, memo_per_mask
from .rope import half_rotation, rope_inv_freq, rotate_half_by

__all__ = ["Tape"]

_ATTN_STATE = "tape_attn_state"  # memo key: (name, layer) -> Ê^layer of the new tokens (B, H, Lq, D) float32
_Q_STATE = "tape_q_state"  # memo key: (name, layer) -> E^layer of the new tokens as prepared for their queries
_STATE = "tape_state"  # memo key: (name, layer) -> E^layer of the new tokens, from layer - 1's MLP hook
_LEAF = "tape_leaf"  # memo key: (name, layer) -> the leaf copy of E^layer read by layer (reentrant recompute)
_Q_ROT = "tape_q_rotation"  # memo key: (name, layer) -> rope.half_rotation of the new tokens' E^layer


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
        "width P of the token-conditioned state update (default: 4 * num_attention_heads, the authors' "
        "config/adape.json: 48 at 12 heads)",
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
    #: reads the output of each decoder layer's MLP (hf_posenc.patches.base.tap_mlp_outputs calls ``mlp_output``)
    reads_mlp_output = True
    relative = True  # states start as rotary and the updates are equivariant (the paper's O(2) argument)
    reference_footprint = (4.0, 6.5)  # float32 (B, H, Lq, Lk) tensors (hf_posenc.memory)

    @classmethod
    def resolve(cls, config: PosEncConfig, info: ModelInfo) -> PosEncConfig:
        p = dict(config.params)
        if p["theta"] is None:
            p["theta"] = float(info.rope_theta) if info.rope_theta is not None else 10000.0
        if p["position_size"] is None:
            p["position_size"] = 4 * info.num_heads  # authors' config/adape.json: 48 for 12 heads
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

    def mlp_update(
        self, t: int, hidden: torch.Tensor, state: torch.Tensor, ctx: PosContext | None = None
    ) -> torch.Tensor:
        """D^t [φ(X^t x) ⊙ U^t E] for states (B, H, L, D) and layer t's MLP output x (B, L, C), over the head axis.

        Computed as M_n E_n with the per-token (H, H) matrix M_n = D^t diag(φ(X^t x_n)) U^t (the same sums in
        another order), so no (B, P, L, D) tensor is built; as two batched products (``torch.einsum`` took 32
        operations for them, 13 here: a decoding step pays per operation)."""
        dtype = state.dtype
        x_proj, down, up = (self.layer_slice(ctx, name, t, lambda i, n=name: getattr(self, n)[i])
                            for name in ("pe_x", "pe_down", "pe_up"))
        gate = F.silu(hidden.to(dtype) @ x_proj.to(dtype).T)  # (B, L, P)
        mix = (down.to(dtype) * gate[..., None, :]) @ up.to(dtype)  # (B, L, H, H)
        return (mix @ state.transpose(1, 2)).transpose(1, 2)  # (B, H, L, D)

    def attend_uses_reference(self, ctx: PosContext, dropout: float, training: bool) -> bool:
        """Whether `attend` builds (B, H, Lq, Lk) tensors (the memory pre-check applies to those calls only):
        when the probabilities are asked for (``output_attentions``), and with attention dropout while training
        (PyTorch's SDPA then takes its math path); otherwise it runs fused SDPA calls."""
        return ctx.need_weights or (dropout > 0.0 and training)

    def _trainable(self) -> bool:
        return any(p.requires_grad for p in self.parameters())

    def forward(self, op: str, *args, **kwargs):
        if op == "mlp_output":
            return self.mlp_output(*args, **kwargs)
        return super().forward(op, *args, **kwargs)

    def prepare(
        self, ctx: PosContext, layer: int, hidden: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Replace k (B, Hkv, Lq, D) by its rotations by E^layer of the new tokens, one per query head of each
        key/value head, then those heads' states: (B, Hkv, Lq, G·D + G·D·w) = [k rotated for query heads 0 .. G−1
        of the group | their states, packed]; q is returned as it is, its states (and their rotation factors) are
        handed to ``attend`` through ``ctx.memo``.
        E^0 is rotary; E^layer (layer > 0) was computed by the MLP hook of layer - 1 (`mlp_output`).
        ``hidden`` (the attention input) is not used."""
        b, h, n, d = q.shape
        hkv = k.shape[1]
        if layer == 0:
            state = self.initial_state(ctx, n, q.device).to(compute_dtype(q.dtype)).expand(b, h, n, d)
        else:
            state = ctx.memo.get((_STATE, layer))
            if state is None:
                raise RuntimeError(
                    f"tape: layer {layer} found no position states from the MLP of layer {layer - 1} in this forward; "
                    "the layers of a patched model must run in order within one forward, each with its MLP"
                )
            if torch.is_grad_enabled() and not state.requires_grad and self._trainable():
                # reentrant checkpoint recomputation: read the states as a leaf (see _StateTunnel)
                state = state.detach().requires_grad_(True)
                ctx.memo[(_LEAF, layer)] = state
        half = d // 2
        rotation = half_rotation(state[..., :half], state[..., half:])  # the queries' and the keys' (B, H, n, D)
        ctx.memo[(_Q_STATE, layer)] = state  # the queries' states go to ``attend`` directly (they are not cached)
        ctx.memo[(_Q_ROT, layer)] = rotation
        groups = h // hkv
        # per key/value head g: (B, Hkv, n, G, D), the G query heads of g last but one (views of the per-head tensors)
        grouped = tuple(t.unflatten(1, (hkv, groups)).transpose(2, 3) for t in rotation)
        rotated = rotate_half_by(k.to(state.dtype)[:, :, :, None, :], grouped).reshape(b, hkv, n, groups * d)
        states = state.unflatten(1, (hkv, groups)).transpose(2, 3).reshape(b, hkv, n, groups * d)
        return q, torch.cat([rotated.to(k.dtype), pack_state(states, k.dtype)], dim=-1), v

    def mlp_output(self, ctx: PosContext, layer: int, out: torch.Tensor) -> torch.Tensor:
        """The MLP-stage update after layer ``layer``: E^{layer+1} = Ê + D[φ(X m) ⊙ U Ê] from the MLP output
        m = ``out`` (B, Lq, C), stored for layer + 1. Returns ``out`` unchanged (through an identity node that
        carries the state's gradient under reentrant checkpointing)."""
        if layer >= self.info.num_layers - 1:
            return out
        hat = ctx.memo.get((_ATTN_STATE, layer))
        if hat is None:
            raise RuntimeError(
                f"tape: the MLP of layer {layer} ran without that layer's attention in this forward; call the whole "
                "model, not a decoder layer's MLP alone"
            )
        state = hat + self.mlp_update(layer, out, hat, ctx)
        ctx.memo[(_STATE, layer + 1)] = state
        if torch.is_grad_enabled() and state.requires_grad:
            out = _StateTunnel.apply(out, state, ctx.memo, (_LEAF, layer + 1))
        return out

    def attend(self, ctx: PosContext, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               mask: torch.Tensor | None, scaling: float, dropout: float, training: bool
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention with the states' rotations, and the attention-stage state update (arguments as for
        `PositionEncoding.attend`, but for the keys).

        Args:
            query: (B, H, Lq, D) (its states come from ``prepare`` through ``ctx.memo``); key: (B, Hkv, Lk,
                G·D + G·D·w) -- k rotated by the state of each of its G query heads, then those states (packed);
                value: (B, Hkv, Lk, D).

        Returns:
            out (B, H, Lq, D) in the value's dtype, and the probabilities (B, H, Lq, Lk) when
            ``ctx.need_weights`` (else None; (B, H, Lq, Lk) tensors are built only then).
        """
        b, h, q_len, d = query.shape
        hkv, k_len = key.shape[1], key.shape[2]
        groups = h // hkv
        dtype = compute_dtype(value.dtype)
        q_state, rotation = ctx.memo.get((_Q_STATE, layer)), ctx.memo.get((_Q_ROT, layer))
        if q_state is None or rotation is None:
            raise RuntimeError(f"tape: the attention of layer {layer} ran without its prepare step in this forward")
        updates = layer < self.info.num_layers - 1
        q = rotate_half_by(query.to(dtype), rotation)
        plain = bool(ctx.memo.get(PLAIN_CAUSAL, False)) and self.info.causal
        allowed = None if plain else _allowed(ctx, mask, q_len, k_len, self.info.causal, query.device)
        # a_h = Σ_e W_{h,e}
        scale = self.layer_slice(ctx, ("attn_scale", dtype), layer,
                                 lambda i: self.attn_update[i].to(dtype).sum(-1)) if updates else None

        probs = None
        if ctx.need_weights:  # the probabilities are asked for: the full-matrix form, per query head
            # (B, Hkv, Lk, G·D) -> (B, H, Lk, D)
            per_head = lambda t: t.unflatten(-1, (groups, d)).transpose(2, 3).reshape(b, h, k_len, d)  # noqa: E731
            k = per_head(key[..., : groups * d].to(dtype))  # rotated by the keys' own states in ``prepare``
            k_state = per_head(unpack_state(key[..., groups * d:], groups * d, dtype)) if updates else None
            v = expand_kv(value, groups).to(dtype)
            probs = _weights(q, k, allowed, plain, scaling)
            dropped = F.dropout(probs, p=dropout, training=training)
            out = dropped @ v
            agg = dropped @ k_state if updates else None
        else:  # Σ_j α_ij [v_j | E_j]: the states as further values, read from the grouped cache as it is
            out, agg = _grouped_attention(q, key, value.to(dtype), updates, allowed, plain, scaling,
                                          dropout if training else 0.0)
        if updates:
            ctx.memo[(_ATTN_STATE, layer)] = q_state + scale[:, None, None] * agg
        return out.to(value.dtype), probs


def _allowed(ctx: PosContext, mask: torch.Tensor | None, q_len: int, k_len: int, causal: bool,
             device: torch.device) -> torch.Tensor | None:
    """`allowed_keys` of this forward's mask, built once per forward and shared by the layers (eager mode:
    the memo holds the mask, so its address stays its own; under ``torch.compile``, per layer). None without a
    mask where causality hides no key (each query at or past the last key: a decoding step)."""
    if mask is None and causal and isinstance(ctx.q_offset, int) and ctx.q_offset >= k_len - 1:
        return None
    return memo_per_mask(ctx.memo, "tape_allowed", mask, (q_len, k_len, causal, str(device)),
                         lambda: allowed_keys(mask, q_len, k_len, ctx.q_offset, causal, device))


def _weights(q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor | None, is_causal: bool,
             scaling: float) -> torch.Tensor:
    """The attention probabilities (B, H, Lq, Lk) of q, k (per query head); ``allowed`` and ``is_causal`` as for
    `_attention`. Rows with no allowed key (left padding) are zeros."""
    scores = (q @ k.transpose(-1, -2)) * scaling
    if is_causal:
        allowed = allowed_keys(None, q.shape[2], k.shape[2], 0, True, q.device)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)


def _grouped_attention(
    q: torch.Tensor,
    key: torch.Tensor,
    v: torch.Tensor,
    with_state: bool,
    allowed: torch.Tensor | None,
    is_causal: bool,
    scaling: float,
    dropout: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(softmax(q kᵀ · scaling) v, the same weights on the keys' states), read from the cache's grouped layout
    without copying it per query head: q (B, H, Lq, D) rotated; key (B, Hkv, Lk, G·D + G·D·w) as ``prepare``
    stores it; v (B, Hkv, Lk, D); ``with_state``: also the weights on the states (else None); ``allowed``,
    ``is_causal`` and ``dropout`` as for `_attention`. Rows with no allowed key give zeros.

    The key/value heads become the batch: (B·Hkv, G, Lk, D) views of the cache's rotated keys and states (head
    stride D, token stride the cache row) and of the values (head stride 0), fused SDPA calls on them (gradients
    bit for bit those of per-head copies). On the 2-core AMD EPYC, one thread, a decoding step of SmolLM2's shape
    at 258 keys: 87 µs a layer, against 283 µs for the explicit scores of the G heads of a group in one product,
    and a copy of the key cache per query head before that."""
    b, h, q_len, d = q.shape
    hkv, k_len = key.shape[1], key.shape[2]
    g = h // hkv
    dtype = q.dtype
    per_group = lambda t: t.unflatten(-1, (g, d)).flatten(0, 1).transpose(1, 2)  # noqa: E731  (B·Hkv, G, Lk, D)
    values = [v.to(dtype).flatten(0, 1)[:, None].expand(b * hkv, g, k_len, v.shape[-1])]
    if with_state:
        values.append(per_group(unpack_state(key[..., g * d:], g * d, dtype)))
    if allowed is not None and not is_causal:  # (B|1, 1, Lq, Lk) -> (B·Hkv, 1, Lq, Lk)
        allowed = allowed[:, None].expand(b, hkv, 1, q_len, k_len).reshape(b * hkv, 1, q_len, k_len)
    outs = _attention(q.reshape(b * hkv, g, q_len, d), per_group(key[..., : g * d].to(dtype)), tuple(values),
                      allowed, is_causal, scaling, dropout)
    outs = [o.reshape(b, h, q_len, o.shape[-1]) for o in outs]
    return outs[0], (outs[1] if with_state else None)


def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    values: tuple[torch.Tensor, ...],
    allowed: torch.Tensor | None,
    is_causal: bool,
    scaling: float,
    dropout: float,
) -> list[torch.Tensor]:
    """softmax(q kᵀ · scaling) u for each u in ``values``: q (B, H, Lq, D), k and each u (B, H, Lk, D);
    ``allowed`` (B|1, 1, Lq, Lk) bool or None; ``is_causal``: ``allowed`` is causality alone (then not read).
    Rows with no allowed key (left padding) give zeros. Returns one (B, H, Lq, D) per value.

    One SDPA call per value tensor: PyTorch's fused CPU kernel (flash attention for CPU) needs q, k and the
    values of one width and falls back to the math path, which builds (B, H, Lq, Lk) tensors, otherwise.
    With a dropout probability, one shared mask must drop the same α for every value: then the values are
    concatenated and q, k zero-padded to their width (q kᵀ unchanged) in a single call."""
    if dropout > 0 and len(values) > 1:
        width = sum(u.shape[-1] for u in values)
        extra = width - q.shape[-1]
        both = _attention(F.pad(q, (0, extra)), F.pad(k, (0, extra)), (torch.cat(values, -1),), allowed, is_causal,
                          scaling, dropout)[0]
        return list(both.split([u.shape[-1] for u in values], dim=-1))
    if allowed is None or is_causal:
        return [F.scaled_dot_product_attention(q, k, u, dropout_p=dropout, is_causal=is_causal, scale=scaling)
                for u in values]
    has_key = allowed.any(dim=-1, keepdim=True)  # (B|1, 1, Lq, 1)
    allowed = allowed | ~has_key  # SDPA would give NaN on an empty row; its output is zeroed below
    return [
        F.scaled_dot_product_attention(q, k, u, attn_mask=allowed, dropout_p=dropout, scale=scaling).masked_fill(~has_key, 0.0)
        for u in values
    ]
