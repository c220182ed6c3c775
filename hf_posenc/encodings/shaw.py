"""``shaw``: learned relative position representations on the keys and the values.

"Self-Attention with Relative Position Representations", Shaw, Uszkoreit and Vaswani 2018,
https://arxiv.org/abs/1803.02155. With learned vectors w^K_r, w^V_r of size head_dim for r = -k .. k
(k = ``max_relative_position``) and a_ij = w_{clip(j - i, -k, k)}, stored as rows clip(j - i, -k, k) + k
of a (2k + 1, head_dim) table:

    e_ij  = q_i . (k_j + a^K_ij) * scaling                 (scaling: the model's, 1/sqrt(head_dim))
    α_ij  = softmax_j(e_ij)                                 (float32, over the keys the mask allows)
    z_i   = Σ_j α_ij (v_j + a^V_ij)

Both the logit term (eq. 4) and the value term (eq. 3) are kept. As in the paper, the tables are shared
by the heads of a layer (grouped-query models too) and each layer has its own. Attention dropout, when
the model trains with it, drops α_ij in both sums.

Computed without materialising (B, H, Lq, Lk, D): the logit term is (q @ a^K^T), (B, H, Lq, 2k + 1),
gathered at the relative index (the paper's own efficient form, section 3.3); the value term sums the
probabilities into the 2k + 1 relative buckets (``scatter_add`` over the (Lq, Lk) index), then multiplies
by a^V. Everything is computed in float32 (float64 for float64 inputs), whatever the model's dtype; the
output is cast back to the query's dtype.

Initialisation: normal with std = the model's ``initializer_range``, like the other learned tables of
hf_posenc (the paper's tensor2tensor code leaves them to the model's default initializer).

On ViT (bidirectional, 2D grid + CLS): per-axis relative tables, with separate tables for rows and
columns, each clipped on its own axis:

    a^K_ij = a^K_row[clip(r_j - r_i, -k, k) + k] + a^K_col[clip(c_j - c_i, -k, k) + k]   (a^V alike)

and every pair that involves the CLS token gets zero vectors (e_ij = q_i . k_j * scaling, value v_j).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from ..config import PosEncConfig
from ..kernels.attention.terms import KernelTerm
from ..ops import expand_kv, masked_softmax, upcast
from ..registry import param, register_encoding
from .base import ModelInfo, PosContext, PositionEncoding, relative_positions

__all__ = ["Shaw"]


@dataclass
class ShawParams:
    max_relative_position: int = param(
        16, "clipping distance k: relative positions j - i are clipped to [-k, k] (per axis on ViT)", type=int, ge=1
    )


@register_encoding(
    "shaw",
    params=ShawParams,
    kind="score + value",
    summary="learned a^K, a^V vectors per clipped relative position (logit and value terms); per-axis on ViT",
    paper="https://arxiv.org/abs/1803.02155",
)
class Shaw(PositionEncoding):
    """Shaw et al. relative position representations; see the module docstring for the formula.

    Parameters: text: ``rel_key`` and ``rel_value`` (num_layers, 2k + 1, head_dim); ViT: ``rel_key_row``,
    ``rel_key_col``, ``rel_value_row``, ``rel_value_col`` of that shape.
    """

    # zero a^K and a^V: no logit term, no value term (exact)
    inert_zero = ("rel_key", "rel_value", "rel_key_row", "rel_key_col", "rel_value_row", "rel_value_col")

    custom_attention = True
    relative = True  # tables indexed by clip(j - i) (indices); position_ids are never read
    reference_footprint = (7.0, 8.0)  # float32 (B, H, Lq, Lk) tensors (hf_posenc.memory)
    kernel_kinds = ("shaw",)

    def kernel_term(self, ctx: PosContext, layer: int, query, key, value, mask) -> KernelTerm | None:
        """The fused-attention term: a^K and a^V (2K + 1, head_dim) of ``layer``, both terms in the kernel.
        None on ViT (per-axis tables)."""
        if ctx.grid is not None:
            return None
        return KernelTerm.shaw(self.rel_key[layer], self.rel_value[layer])

    def __init__(self, config: PosEncConfig, info: ModelInfo) -> None:
        super().__init__(config, info)
        self.max_relative_position = config.params["max_relative_position"]
        self.axes = ("row", "col") if info.family == "vit" else ("",)
        shape = (info.num_layers, 2 * self.max_relative_position + 1, info.head_dim)
        for kind in ("key", "value"):
            for axis in self.axes:
                weight = nn.Parameter(torch.empty(shape))
                with torch.no_grad():
                    nn.init.normal_(weight, mean=0.0, std=info.initializer_range)
                self.register_parameter(self._name(kind, axis), weight)

    @staticmethod
    def _name(kind: str, axis: str) -> str:
        return f"rel_{kind}_{axis}" if axis else f"rel_{kind}"

    def _indices(
        self, ctx: PosContext, q_len: int, k_len: int, device: torch.device
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """The clipped relative index clip(j - i, -k, k) + k (Lq, Lk) int64 per axis (one on text, row and
        column on ViT), and on ViT the (Lq, Lk) bool mask of the pairs that involve CLS (no positional term).
        Built once per forward (they do not depend on the parameters)."""
        memo_key = ("shaw_index", q_len, k_len, device)
        if memo_key not in ctx.memo:
            k = self.max_relative_position
            rp = relative_positions(ctx, q_len, k_len, device)
            rels = [rp.rows, rp.cols] if rp.is_grid else [rp.rel]
            index = [rel.long().clamp(-k, k) + k for rel in rels]
            ctx.memo[memo_key] = (index, rp.cls)
        return ctx.memo[memo_key]

    def attend(self, ctx: PosContext, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               mask: torch.Tensor | None, scaling: float, dropout: float, training: bool
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention with both relative terms (arguments as for `PositionEncoding.attend`; ``scaling`` applies to
        q . (k + a^K)).

        Returns:
            out (B, H, Lq, D) in the query's dtype, and the probabilities α (B, H, Lq, Lk) float32.
        """
        b, h, q_len, _ = query.shape
        k_len = key.shape[2]
        groups = h // key.shape[1]
        q = upcast(query)
        dtype = q.dtype
        k = expand_kv(key, groups).to(dtype)
        v = expand_kv(value, groups).to(dtype)
        index, cls = self._indices(ctx, q_len, k_len, query.device)
        index = [i.expand(b, h, q_len, k_len) for i in index]
        a_key = [getattr(self, self._name("key", axis))[layer].to(dtype) for axis in self.axes]
        a_value = [getattr(self, self._name("value", axis))[layer].to(dtype) for axis in self.axes]

        scores = q @ k.transpose(-1, -2)
        for idx, table in zip(index, a_key):
            term = (q @ table.T).gather(-1, idx)  # q_i . a^K[idx_ij]
            scores = scores + (term if cls is None else term.masked_fill(cls, 0.0))
        probs = masked_softmax(scores * scaling, mask)
        probs = F.dropout(probs, p=dropout, training=training)

        out = probs @ v
        spread = probs if cls is None else probs.masked_fill(cls, 0.0)
        for idx, table in zip(index, a_value):
            buckets = spread.new_zeros(b, h, q_len, table.shape[0]).scatter_add(-1, idx, spread)
            out = out + buckets @ table  # Σ_j α_ij a^V[idx_ij]
        return out.to(query.dtype), probs
