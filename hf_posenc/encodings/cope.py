"""``cope``: contextual position encoding.

"Contextual Position Encoding: Learning to Count What's Important", Golovneva, Wang, Weston and Sukhbaatar
2024, https://arxiv.org/abs/2405.18719. "The code" below is the authors' reference listing in the paper's
appendix (classes ``CoPE`` and ``SelfAttn``) and their repository, github.com/facebookresearch/RAM,
``projects/cope/src/cope/context_position.py``.

For query i and key j of one head, with s the model's logit scale (1/sqrt(head_dim)):

    g_ij = σ(s · q_i·k_j)                       gates; masked (padding, future, empty cache slots) -> 0
    p_ij = Σ_{k=j..i} g_ik                       contextual position, j included (masked gates count 0)
    p_ij ← min(p_ij, npos_max − 1)
    z_i[p] = q_i·e[p]                            p = 0 .. npos_max − 1 (the "optimised" form, eq. 7)
    z_i[p_ij] = (p_ij − ⌊p_ij⌋) z_i[⌈p_ij⌉] + (1 − p_ij + ⌊p_ij⌋) z_i[⌊p_ij⌋]
    a_ij = softmax_j(s · q_i·k_j + z_i[p_ij])    over the keys the mask allows

Scaling, as in the code: the listing computes ``attn_logits = q·k / sqrt(d)``, adds ``mask.log()`` (so a
masked gate is σ(−inf) = 0, i.e. masked *before* the cumulative sum), takes ``gates = sigmoid(attn_logits)``
and then adds ``z_i[p_ij] = q_i·e[p_ij]`` unscaled. So the gates see the scaled logits and the position
term is not scaled. (The repository's training code, with its default ``--cope-nodiv`` off, divides
q·k + q·e[p] by sqrt(d) instead: the same function up to a factor sqrt(d) in the learned table e.)

Position embeddings: one table e ∈ R^{head_dim × npos_max} per layer, shared by the heads of the layer
(the code folds the heads into the batch and broadcasts one ``pos_emb`` of shape (1, head_dim, npos)),
not shared across layers (the code's ``--cope-shared`` default is off). Grouped-query models: the gates and
z use each query head's own q against its key/value head's keys (``expand_kv``).

Initialisation: the code starts the table at zeros (CoPE is then NoPE at the first step; the table's
gradient, Σ_i q_i ∂L/∂z_i, is non-zero from the first step). ``init_std`` = None (the default) draws it
from N(0, initializer_range) instead, as the other learned tables of hf_posenc do, so that the position
term, and every test of it, matters from the first forward; ``init_std=0.0`` gives the code's zeros.

Computation: everything in float32 (float64 for float64 inputs). The reference never forms the
(B, H, Lq, Lk, head_dim) tensor of interpolated embeddings: it computes z = q @ e (B, H, Lq, npos) and
gathers it at ⌊p⌋ and ⌈p⌉, so its memory is O(B·H·Lq·Lk) (logits, gates, positions, the two int64
indices, ...) plus O(B·H·Lq·npos), whatever head_dim is: ``benchmarks/bench_cope_memory.py`` measures a
peak of about 17 float32 (B, H, L, L) tensors in a forward (27 with the backward) at L = 1024, the same at
head_dim 16 and 256, where one (B, H, L, L, head_dim) tensor alone would be 16 to 256 of them.
⌊p⌋ and ⌈p⌉ carry no gradient; the weight p − ⌊p⌋ does (so the gates are trained through it).
The reference math (``cope_attention``, ``cope_positions``, ``interpolate_logits``) takes tensors only and
lives beside the kernels, in `hf_posenc.kernels.cope.naive`.

KV cache: the gates of query i only involve q_i and the keys, which the cache already holds; nothing else
is stored. Left padding: padded keys are masked, so their gates are 0 before the sum and they are not
counted; the positions between real tokens are those of the row alone.

Bidirectional text (BERT) -- the same generalisation on a line
---------------------------------------------------------------
Counts run in either direction with one table per direction, as on ViT below, over the tokens in their
order; no token is exempt (there is no CLS exception on text).

ViT (bidirectional, no order) -- a documented generalisation
------------------------------------------------------------
The paper counts over the keys between j and the query i in causal order. On ViT the patches are taken
in raster order (row-major) and the count runs over the patches between i and j in that order, in either
direction, with one table per direction (e⁻ for keys at or before the query, e⁺ for keys after it):

    p_ij = Σ_{k=j..i} g_ik   with e⁻    if j <= i      (the paper's formula)
    p_ij = Σ_{k=i..j} g_ik   with e⁺    if j >  i      (its mirror image)

Every pair that involves the CLS token gets no position term, and the CLS key's gate is not counted (the
CLS token takes no positional term). Restricted to j <= i this is exactly the paper's CoPE; like any 1D
scan of an image it is anisotropic (vertical neighbours are ``cols`` raster steps apart).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..config import PosEncConfig
from ..kernels._attn_dispatch import reference_inputs
from ..kernels.cope import cope, cope_backend, cope_torch
from ..kernels.cope.naive import cope_attention
from ..registry import param, register_encoding
from .base import EngineAttention, ModelInfo, PosContext

__all__ = ["Cope"]


@dataclass
class CopeParams:
    npos_max: int = param(
        64, "number of learned positions: contextual positions are clipped to npos_max - 1", type=int, ge=1
    )
    init_std: float | None = param(
        None,
        "standard deviation of the initial position table (default: the model's initializer_range; "
        "0.0 gives the paper code's zeros)",
        type=float,
        optional=True,
        ge=0.0,
    )


@register_encoding(
    "cope",
    params=CopeParams,
    kind="data-dependent",
    summary="contextual counts p_ij = Σ σ(q_i·k) over keys j..i, interpolated learned position logits q·e[p]; "
    "raster-order counts in both directions on ViT",
    paper="https://arxiv.org/abs/2405.18719",
)
class Cope(EngineAttention):
    """CoPE; see the module docstring for the formula.

    Parameters: ``pos_emb`` (num_layers, head_dim, npos_max); on ViT also ``pos_emb_after`` (keys after
    the query in raster order).
    """

    inert_zero = ("pos_emb", "pos_emb_after")  # zero position embeddings: q·e[p] = 0, plain attention (exact)

    custom_attention = True
    #: ``attend`` runs its own fused kernel for these backends (``hf_posenc.kernels.cope``; causal models).
    attention_kernels = ("triton",)
    relative = True  # contextual counts over keys j..i from gates σ(q·k); position_ids are never read
    reference_footprint = (19.0, 30.0)  # float32 (B, H, Lq, Lk) tensors (hf_posenc.memory)

    def __init__(self, config: PosEncConfig, info: ModelInfo) -> None:
        super().__init__(config, info)
        self.npos_max = config.params["npos_max"]
        std = config.params["init_std"]
        std = float(info.initializer_range) if std is None else std
        names = ("pos_emb", "pos_emb_after") if not info.causal else ("pos_emb",)
        for name in names:
            weight = nn.Parameter(torch.zeros(info.num_layers, info.head_dim, self.npos_max))
            if std > 0:
                with torch.no_grad():
                    nn.init.normal_(weight, mean=0.0, std=std)
            self.register_parameter(name, weight)

    def engine_backend(self, ctx: PosContext, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       mask: torch.Tensor | None, dropout: float, training: bool) -> str:
        """The fused causal kernel (``hf_posenc.kernels.cope``) or the tile-wise engine
        (``hf_posenc.kernels.cope.tiled``), as `cope_backend` picks; the bidirectional variants (BERT, ViT) run the
        reference, and forcing ``triton`` there raises."""
        return cope_backend(
            query, key, value, mask, ctx.q_offset, ctx.need_weights, dropout, training, causal=self.info.causal
        )

    def engine(self, backend: str, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               mask: torch.Tensor | None, scaling: float, q_offset: int | torch.Tensor, window: int | None,
               sink: int | None) -> torch.Tensor:
        """The kernel, or off Triton the tile-wise engine (for a decoding step without gradients the whole row at
        once: ``hf_posenc.kernels.cope.FEW_QUERIES``)."""
        run = cope if backend == "triton" else cope_torch
        return run(query, key, value, self.pos_emb[layer], mask, scaling, q_offset, window=window, sink=sink)

    def reference(self, ctx: PosContext, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  mask: torch.Tensor | None, scaling: float, dropout: float, training: bool
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """The full-matrix reference: with the probabilities requested, attention dropout while training, and for
        the bidirectional variants (BERT: both directions; ViT: raster order, CLS apart)."""
        q_len, k_len = query.shape[2], key.shape[2]
        dtype, q, k, v, allowed = reference_inputs(query, key, value, mask, ctx.q_offset, self.info.causal)
        table = self.pos_emb[layer].to(dtype)
        if self.info.causal:
            out, probs = cope_attention(q, k, v, allowed, scaling, table, dropout=dropout, training=training)
            return out.to(query.dtype), probs
        # bidirectional: both directions; on ViT (raster order) CLS (token 0) takes no position term and is not
        # counted, on text (BERT) no token is apart
        q_index = torch.arange(k_len - q_len, k_len, device=query.device)
        no_position = is_cls = None
        if ctx.grid is not None:
            is_cls = torch.zeros(k_len, dtype=torch.bool, device=query.device)
            is_cls[0] = True
            no_position = is_cls[-q_len:, None] | is_cls[None, :]
        out, probs = cope_attention(
            q, k, v, allowed, scaling, table, self.pos_emb_after[layer].to(dtype), q_index, no_position, is_cls,
            dropout=dropout, training=training,
        )
        return out.to(query.dtype), probs
