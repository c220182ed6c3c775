"""Shared machinery of the q/k-transform encodings that rotate by block-diagonal matrices.

A subclass builds, for the positions of this forward, one rotation per position (and optionally per
key/value head) as a block-diagonal matrix with blocks of size ``s``; the base class applies it to the
new queries and keys (before they enter the KV cache) through ``hf_posenc.kernels.rotary``.
With grouped-query attention, query head h uses the rotation of its key/value head h // (H / Hkv), so
that q_h^T k_{g(h)} keeps the relative property.
"""

from __future__ import annotations

import torch

from ..kernels.rotary import apply_qk_rotation, rotation_backend
from ..kernels.rotary.spectral import spectral_qk_rotation
from .base import PosContext, PositionEncoding, new_tokens_key

__all__ = ["BlockRotationEncoding", "distinct_positions", "token_coordinates"]


def distinct_positions(coords: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the distinct rows of ``coords`` (N, axes), sorted, and the index (N,) of each row among them), so that a
    rotation is computed once per distinct position; the index is None when the rows are those distinct rows
    already (a batch of one sequence without padding: positions 0 .. L − 1), which then need no gather (and no
    scatter in backward: measured 24 ms a step for LieRE at L = 2048). One axis (text) takes the 1D unique.

    Under ``torch.compile`` the rows are returned as they are (one rotation per token, no gather): the number of
    distinct rows is data-dependent, a size that inductor cannot plan for (GuardOnDataDependentSymNode in the
    bmm that follows). Every token's rotation is the same function of its position, so the numbers are eager's.
    """
    if torch.compiler.is_compiling():
        return coords, None
    if coords.shape[1] == 1:
        unique, inverse = torch.unique(coords[:, 0], return_inverse=True)
        unique = unique[:, None]
    else:
        unique, inverse = torch.unique(coords, dim=0, return_inverse=True)
    if unique.shape[0] == coords.shape[0] and torch.equal(unique, coords):
        return coords, None
    return unique, inverse


def token_coordinates(
    ctx: PosContext, length: int, device: torch.device, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Coordinates of the ``length`` new tokens: (B|1, L, 2) in ``dtype`` (float32 by default; the encodings that
    scale them pass their compute dtype, `hf_posenc.kernels._common.compute_dtype`, so that a float64 model
    scales its positions in float64) and a CLS mask (L,) bool or None.

    Text: (position, 0) with the logical ``position_ids``. ViT: (row, col) of each patch on the grid in
    raster order, the CLS token (index 0) flagged in the mask (it is not rotated).
    """
    if ctx.grid is None:
        pos = ctx.position_ids.to(device=device, dtype=dtype)
        return torch.stack([pos, torch.zeros_like(pos)], dim=-1), None
    rows, cols = ctx.grid
    r = torch.arange(rows, device=device, dtype=dtype).repeat_interleave(cols)
    c = torch.arange(cols, device=device, dtype=dtype).repeat(rows)
    coords = torch.cat([torch.zeros(1, 2, device=device, dtype=dtype), torch.stack([r, c], dim=-1)])[-length:]
    cls = torch.zeros(rows * cols + 1, dtype=torch.bool, device=device)
    cls[0] = True
    return coords[None], cls[-length:]


class BlockRotationEncoding(PositionEncoding):
    """Base of rotary encodings: subclasses implement ``rotation`` (the same in every layer), or
    ``layer_rotation`` when the rotation has parameters per layer (the layer index reaches it through
    ``prepare``, which the patched attention modules call with it)."""

    rotates_qk = True
    #: the rotation runs through hf_posenc.kernels.rotary (the Triton kernel on CUDA).
    uses_rotary_kernel = True
    prepares_qkv = True  # so that the layer index reaches ``layer_rotation``; v passes through unchanged

    def rotation(self, ctx: PosContext, length: int, device: torch.device) -> torch.Tensor:
        """(B|1, Hkv|1, L, D/s, s, s) float32 rotations of the ``length`` new tokens."""
        raise NotImplementedError

    def layer_rotation(self, ctx: PosContext, layer: int, length: int, device: torch.device) -> torch.Tensor:
        """The rotations (B|1, Hkv|1, L, D/s, s, s) used in ``layer``. Default: ``rotation``, built once per
        forward and shared by every layer, unless it is being trained (under gradient checkpointing a
        layer's recomputation must build exactly what its first pass built, as for score biases)."""
        key = ("rotation", new_tokens_key(length), device)
        if key in ctx.memo:
            return ctx.memo[key]
        rot = self.rotation(ctx, length, device)
        if not (self.training and any(p.requires_grad for p in self.parameters())):
            ctx.memo[key] = rot
        return rot

    def spectral_terms(
        self, ctx: PosContext, layer: int, length: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``layer``'s rotations of the ``length`` new tokens as exponentials, block j of token t's rotation for
        key/value head h being exp(coeff[t, j] · skew[h, j]): (skew (Hkv|1, D/s, s, s), coeff (B|1, L, D/s)), or
        None where they are not of that form (the default). When given, ``rotate`` applies them through
        ``spectral_qk_rotation`` wherever the Triton rotary kernel would not run."""
        return None

    def prepare(
        self, ctx: PosContext, layer: int, hidden: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k = self.rotate(ctx, q, k, layer)
        return q, k, v

    def rotate(
        self, ctx: PosContext, q: torch.Tensor, k: torch.Tensor, layer: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q (B, H, L, D) and k (B, Hkv, L, D) of the new tokens with ``layer``'s rotations."""
        spectral = self.spectral_terms(ctx, layer, q.shape[2], q.device)
        if spectral is not None and rotation_backend(q, k, spectral[0].shape[-1]) == "torch":
            return spectral_qk_rotation(q, k, *spectral)  # in each block's eigenbasis: no rotation tensor
        rot = self.layer_rotation(ctx, layer, q.shape[2], q.device)
        # q and k in one pass (the Triton kernel on CUDA); query head h uses the rotation of kv head h // (H / Hkv)
        return apply_qk_rotation(q, k, rot)
