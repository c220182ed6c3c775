"""One tile of CAPE's base bias B, from the term registry (``hf_posenc.kernels.attention.terms``): the base
encoding's term (its ``kind`` and its tensors, in the compute dtype) evaluated on the tile's indices by its
registry entry, the same function every attention engine evaluates (text positions):

* a Toeplitz term: its ``distance`` at δ = qi − j (qi = q_offset + i), per head;
* a pair term (FIRE's interpolated table): its ``pair`` value at (b, h, i, qi, j).

A term stated as −s[h] · |δ| (its entry's ``slope``: ALiBi) is written straight into the tile's slot, and CAPE's
engine takes it in a rank-one form where s needs no gradient (``tiled.py``).
"""

from __future__ import annotations

import torch

from ..attention.term_spec import TermSpec, term_spec

__all__ = ["base_bias_tile", "base_unsupported"]


def base_unsupported(kind: str) -> str | None:
    """Why the registered term ``kind`` cannot be CAPE's base bias (a sentence), or None: CAPE adds a bias of the
    positions alone (no term that reads the queries or adds a value term)."""
    spec = term_spec(kind)
    if spec.form in ("none", "gate") or spec.prepare is not None or spec.value_term is not None:
        return (f"the {kind} term is not a position bias (CAPE's base must be a term of the positions alone: a "
                "Toeplitz or pair term that reads neither the queries nor the keys, with no value term)")
    return None


def _heads(spec: TermSpec, t: dict[str, torch.Tensor]) -> int:
    for ts in spec.tensors:
        if ts.heads_dim is not None:
            return t[ts.name].shape[ts.heads_dim]
    raise ValueError(f"the {spec.kind} term has no tensor that counts the heads; CAPE's base needs one")


def base_bias_tile(
    kind: str,
    tensors: tuple[torch.Tensor, ...],
    q_index: torch.Tensor,
    k_index: torch.Tensor,
    rows: slice,
    batch_row: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The bias tile, heads first: (B|1, H, n, nk), or (1, H, n, nk) for one ``batch_row``.

    Args:
        kind: a registered term kind (``base_unsupported`` None).
        tensors: the term's tensors, in its registry entry's order, floating ones in the compute dtype.
        q_index: (n,) key index of each query of the tile (q_offset + i), in the compute dtype.
        k_index: (nk,) key indices of the tile.
        rows: the tile's query rows (a pair term's per-query tensors are indexed by them).
        batch_row: the one batch row wanted (a pair term's tensors may differ per row; a Toeplitz term is the
            same on every row), or None for all of them.
        out: where to write the tile of that one row, (H, n, nk) (no autograd through it); the result is then
            ``out[None]``.
    """
    spec = term_spec(kind)
    t = dict(zip((ts.name for ts in spec.tensors), tensors))
    if out is not None:
        if batch_row is None:
            raise ValueError("base_bias_tile writes one batch row into out: give batch_row")
        if spec.slope is not None:  # −s · |δ| straight into out: no tile-sized temporary
            delta = (q_index[:, None] - k_index[None, :]).abs_()
            return torch.mul(delta, -spec.slope(t)[:, None, None], out=out)[None]
        return out.copy_(base_bias_tile(kind, tensors, q_index, k_index, rows, batch_row)[0])[None]
    heads = torch.arange(_heads(spec, t), device=q_index.device)
    if spec.form == "toeplitz":
        delta = q_index[:, None] - k_index[None, :]  # (n, nk) qi − j
        return spec.distance_values(t, heads[:, None, None], delta[None])[None]
    batches = [t[ts.name].shape[ts.batch_dim] for ts in spec.tensors if ts.batch_dim is not None]
    b_size = max(batches, default=1)
    if batch_row is not None and b_size > 1:
        b = torch.tensor([batch_row], device=q_index.device)
    else:
        b = torch.arange(b_size, device=q_index.device)
    i = torch.arange(rows.start, rows.stop, device=q_index.device)[:, None]
    ints = spec.ints_of(t) if spec.ints_of is not None else {}
    return spec.value(t, ints, b[:, None, None, None], heads[None, :, None, None], i, q_index[:, None],
                      k_index[None, :])
