"""Position terms of the fused attention kernel family: what an encoding hands to the kernel.

A :class:`KernelTerm` names one compile-time term and carries its small tensors. The logit of query i
(key index ``qi = q_offset + i``) and key j is ``scale * q_i . k_j + B_h(i, j)`` with, for δ = qi − j:

==============  ==============================================================================================
kind            B_h(i, j)
==============  ==============================================================================================
``none``        0
``alibi``       −slopes[h] · |δ|
``kerple_log``  −r1[h] · log(1 + r2[h] · |δ|)
``kerple_pow``  −r1[h] · |δ|^r2[h]   (0 at δ = 0)
``sandwich``    table[h, min(|δ|, T − 1)]                      table (H, T): the cosine sum per distance
``t5``          table[buckets[clip(j − qi, −M, M) + M], h]      table (NB, H), buckets (2M + 1,) int
``fire``        interp(table[h], u),  u = log(1 + c·max(δ, 0)) · inv_norm[b, i] · (N − 1) / x_max
                                                                 table (H, N): f_θ at x = k·x_max/(N − 1)
``shaw``        scale · q_i . key_table[clip(j − qi, −K, K) + K]  and the value term
                out_i += Σ_j α_ij value_table[clip(j − qi, −K, K) + K]            tables (2K + 1, D)
``fox``         c[b, h, qi] − c[b, h, j]                         c (B, H, Lk) cumulative log forget gates
==============  ==============================================================================================

``interp(t, u)`` is linear interpolation, t[⌊u⌋] (1 − w) + t[⌊u⌋ + 1] w with w = u − ⌊u⌋ (u clamped to
[0, N − 1]). Text positions only (1D): the encodings return no term on ViT's 2D grid.

The tensors of ``alibi``, ``sandwich`` and the t5 ``buckets`` need no gradient; every other tensor may
(learned parameters, or functions of them built in PyTorch: the kernels return the gradient of each term
tensor, and autograd carries it on to the encoding's parameters).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...ops import eager_value_checks

__all__ = ["FLEX_KINDS", "KERNEL_KINDS", "KernelTerm"]

#: every kind the Triton kernel implements, in the order of its compile-time ids.
KERNEL_KINDS = ("none", "alibi", "kerple_log", "kerple_pow", "sandwich", "t5", "fire", "shaw", "fox")
#: the kinds FlexAttention can express with a score_mod (shaw's value term has no score_mod form).
FLEX_KINDS = ("none", "alibi", "kerple_log", "kerple_pow", "sandwich", "t5", "fire", "fox")


def _vec(name: str, t: torch.Tensor, n: int | None = None) -> torch.Tensor:
    if t.dim() != 1 or (n is not None and t.shape[0] != n):
        raise ValueError(f"{name} must be a vector{'' if n is None else f' of {n}'}, got shape {tuple(t.shape)}")
    return t


@dataclass(frozen=True)
class KernelTerm:
    """One position term for the fused attention; build it with the class methods.

    Attributes:
        kind: one of :data:`KERNEL_KINDS`.
        tensors: the term's tensors by name (see the module docstring).
        ints: the term's integer constants (``max_relative_position`` of shaw).
        key: replacement keys for the attention, (B, Hkv, Lk, D) (fox: the cache's state channels stripped),
            or None to use the keys as given.
        value: replacement values, or None.
    """

    kind: str
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    ints: dict[str, int] = field(default_factory=dict)
    key: torch.Tensor | None = None
    value: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.kind not in KERNEL_KINDS:
            raise ValueError(f"unknown kernel term {self.kind!r}; allowed: {', '.join(KERNEL_KINDS)}")

    @property
    def num_heads(self) -> int | None:
        """The number of query heads the term is built for (None when it does not depend on heads)."""
        t = self.tensors
        if self.kind == "alibi":
            return t["slopes"].shape[0]
        if self.kind in ("kerple_log", "kerple_pow"):
            return t["r1"].shape[0]
        if self.kind in ("sandwich", "fire"):
            return t["table"].shape[0]
        if self.kind == "t5":
            return t["table"].shape[1]
        if self.kind == "fox":
            return t["c"].shape[1]
        return None

    def check(self, query: torch.Tensor, key: torch.Tensor, q_offset: int | torch.Tensor = 0) -> None:
        """Raise ``ValueError`` unless the term's tensors fit q (B, H, Lq, D) and k (B, Hkv, Lk, D)."""
        b, h, q_len, d = query.shape
        k_len = key.shape[2]
        heads = self.num_heads
        if heads is not None and heads != h:
            raise ValueError(f"the {self.kind} term is built for {heads} heads, the queries have {h}")
        t = self.tensors
        if self.kind == "fire" and (t["inv_norm"].shape[0] not in (1, b) or t["inv_norm"].shape[1] != q_len):
            raise ValueError(f"fire inv_norm must be (1 or B={b}, Lq={q_len}), got {tuple(t['inv_norm'].shape)}")
        if self.kind == "shaw" and t["key_table"].shape[1] != d:
            raise ValueError(f"shaw tables must have head_dim {d} columns, got {tuple(t['key_table'].shape)}")
        if self.kind == "fox":
            if tuple(t["c"].shape) != (b, h, k_len):
                raise ValueError(f"fox c must be (B, H, Lk) = {(b, h, k_len)}, got {tuple(t['c'].shape)}")
            # A tensor offset (a StaticCache's) is read only in eager mode on CPU: elsewhere that is a device sync
            # (and a graph break under torch.compile), and a StaticCache keeps its queries among its keys anyway.
            if isinstance(q_offset, torch.Tensor) and not eager_value_checks(q_offset):
                return
            offset = int(q_offset)
            if offset + q_len > k_len:
                raise ValueError(
                    f"fox needs the queries among the keys: q_offset + Lq <= Lk, got {offset} + {q_len} > {k_len}"
                )

    # -- constructors -------------------------------------------------------------------------------
    @classmethod
    def none(cls) -> "KernelTerm":
        """No position term (plain attention)."""
        return cls("none")

    @classmethod
    def alibi(cls, slopes: torch.Tensor) -> "KernelTerm":
        """−slopes[h] |δ|; slopes (H,) float32."""
        return cls("alibi", {"slopes": _vec("slopes", slopes)})

    @classmethod
    def kerple(cls, variant: str, r1: torch.Tensor, r2: torch.Tensor) -> "KernelTerm":
        """KERPLE's ``log`` or ``power`` kernel with r1, r2 (H,) (already inside their constraints)."""
        if variant not in ("log", "power"):
            raise ValueError(f"kerple variant must be 'log' or 'power', got {variant!r}")
        _vec("r1", r1)
        _vec("r2", r2, r1.shape[0])
        return cls("kerple_log" if variant == "log" else "kerple_pow", {"r1": r1, "r2": r2})

    @classmethod
    def sandwich(cls, table: torch.Tensor) -> "KernelTerm":
        """table (H, T): the bias at distance 0 .. T − 1 (distances past T − 1 take the last column)."""
        if table.dim() != 2 or table.shape[1] < 1:
            raise ValueError(f"sandwich table must be (H, T), got shape {tuple(table.shape)}")
        return cls("sandwich", {"table": table})

    @classmethod
    def t5(cls, table: torch.Tensor, buckets: torch.Tensor) -> "KernelTerm":
        """table (NB, H); buckets (2M + 1,) integer: the bucket of relative position j − qi = −M .. M
        (positions past ±M share the bucket of ±M)."""
        if table.dim() != 2:
            raise ValueError(f"t5 table must be (num_buckets, H), got shape {tuple(table.shape)}")
        if buckets.dim() != 1 or buckets.shape[0] % 2 == 0 or buckets.is_floating_point():
            raise ValueError(f"t5 buckets must be an integer vector of odd length 2M + 1, got {tuple(buckets.shape)}")
        return cls("t5", {"table": table, "buckets": buckets})

    @classmethod
    def fire(cls, table: torch.Tensor, c: torch.Tensor, inv_norm: torch.Tensor, x_max: torch.Tensor) -> "KernelTerm":
        """table (H, N), N >= 2: f_θ at x = k x_max / (N − 1); c () > 0; inv_norm (B|1, Lq) = 1 / normaliser
        of each query; x_max () > 0 (no gradient: the grid's extent)."""
        if table.dim() != 2 or table.shape[1] < 2:
            raise ValueError(f"fire table must be (H, N) with N >= 2, got shape {tuple(table.shape)}")
        if inv_norm.dim() != 2:
            raise ValueError(f"fire inv_norm must be (B or 1, Lq), got shape {tuple(inv_norm.shape)}")
        if c.numel() != 1 or x_max.numel() != 1:
            raise ValueError("fire c and x_max must be scalars")
        return cls("fire", {"table": table, "c": c.reshape(()), "inv_norm": inv_norm, "x_max": x_max.reshape(())})

    @classmethod
    def shaw(cls, key_table: torch.Tensor, value_table: torch.Tensor) -> "KernelTerm":
        """key_table, value_table (2K + 1, D): shared by the heads; row clip(j − qi, −K, K) + K."""
        if key_table.dim() != 2 or key_table.shape != value_table.shape or key_table.shape[0] % 2 == 0:
            raise ValueError(
                f"shaw tables must both be (2K + 1, D), got {tuple(key_table.shape)} and {tuple(value_table.shape)}"
            )
        return cls("shaw", {"key_table": key_table, "value_table": value_table},
                   {"max_relative_position": (key_table.shape[0] - 1) // 2})

    @classmethod
    def fox(cls, c: torch.Tensor, key: torch.Tensor | None = None, value: torch.Tensor | None = None) -> "KernelTerm":
        """c (B, H, Lk): cumulative log forget gates (padding's gates already zeroed); D_ij = c[qi] − c[j]."""
        if c.dim() != 3:
            raise ValueError(f"fox c must be (B, H, Lk), got shape {tuple(c.shape)}")
        return cls("fox", {"c": c}, key=key, value=value)
