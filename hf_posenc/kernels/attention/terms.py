"""Position terms of the fused attention kernel family: the term registry, and what an encoding hands over.

Each term is stated ONCE, as a `TermSpec` in `TERMS`: its tensors (names, shapes, which may carry
a gradient), its *form* and its value. Every engine derives from that entry:

* the reference bias (`term_bias`, the oracle) evaluates the value on broadcast index tensors
  (B, H, Lq, Lk);
* the FlexAttention ``score_mod`` (`score_mod_for`) evaluates the same function on FlexAttention's
  0-d indices, ``score + value(b, h, q_idx, kv_idx)``;
* the tile engine (``tiled.py``) takes a Toeplitz term's per-distance values F (H, N) from ``distance`` (one
  call per forward, each tile a strided view of them), a gate's per-token ``c`` from its tensor, FIRE's cells
  from `fire_psi` / `fire_cell`;
* the Triton kernel (``triton_attention.py``, one compile-time branch per entry of `KERNEL_KINDS`) takes
  its term id from `triton_id`; an entry without its own branch names an existing one (``triton``) and
  how to express itself there (``lower``), or none.

The logit of query i (key index ``qi = q_offset + i``) and key j is ``scale * q_i . k_j + B_h(i, j)`` with,
for δ = qi − j:

==============  ===========  ====================================================================================
kind            form         B_h(i, j)
==============  ===========  ====================================================================================
``none``        none         0
``alibi``       toeplitz     −slopes[h] · |δ|
``kerple_log``  toeplitz     −r1[h] · log(1 + r2[h] · |δ|)
``kerple_pow``  toeplitz     −r1[h] · |δ|^r2[h]   (0 at δ = 0)
``sandwich``    toeplitz     table[h, min(|δ|, T − 1)]                      table (H, T): the cosine sum per distance
``t5``          toeplitz     table[buckets[clip(j − qi, −M, M) + M], h]      table (NB, H), buckets (2M + 1,) int
``dpb``         toeplitz     table[h, clip(δ, −M, M) + M]                    table (H, 2M + 1): the DPB MLP per signed δ
``fire``        pair         interp(table[h], u),  u = log(1 + c·max(δ, 0)) · inv_norm[b, i] · (N − 1) / x_max
                                                                              table (H, N): f_θ at x = k·x_max/(N − 1)
``shaw``        pair         scale · q_i . key_table[clip(j − qi, −K, K) + K]  and the value term
                             out_i += Σ_j α_ij value_table[clip(j − qi, −K, K) + K]          tables (2K + 1, D)
``fox``         gate         c[b, h, qi] − c[b, h, j]                         c (B, H, Lk) cumulative log forget gates
==============  ===========  ====================================================================================

Forms: ``toeplitz``, a function of (h, δ) alone (``distance``); ``pair``, of (b, h, i, qi, j) (``pair``); ``gate``,
c[qi] − c[j] of a per-token vector c (``pair`` too; the tile engine carries c as a key channel).
``interp(t, u)`` is linear interpolation, t[⌊u⌋] (1 − w) + t[⌊u⌋ + 1] w with w = u − ⌊u⌋ (u clamped to
[0, N − 1]). Text positions only (1D): the encodings return no term on ViT's 2D grid.

Tensors marked ``grad=False`` (``alibi``'s slopes, ``sandwich``'s table, the t5 ``buckets``, FIRE's ``x_max``)
take no gradient in the Triton kernel (it refuses them when they require one); every other tensor may (learned parameters, or functions of them built in PyTorch: the engines
return the gradient of each term tensor, and autograd carries it on to the encoding's parameters).

Adding a term: one `register_term` call below (its tensors, form, value and example), then its encoding
returns ``KernelTerm.build(kind, ...)``. The reference and FlexAttention need nothing more; nor does the tile
engine for a Toeplitz or gate term (a pair term needs its tile path in ``_tiles.py``, which refuses it until
then); the Triton kernel needs a branch, or an existing one through ``lower``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ...ops import eager_value_checks

__all__ = [
    "FLEX_KINDS",
    "FORMS",
    "KERNEL_KINDS",
    "TERMS",
    "TERM_KINDS",
    "TILED_KINDS",
    "TOEPLITZ_KINDS",
    "KernelTerm",
    "TensorSpec",
    "TermSpec",
    "example_term",
    "fire_cell",
    "fire_psi",
    "register_term",
    "term_spec",
    "triton_id",
]

#: the forms a term can take (see the module docstring).
FORMS = ("none", "toeplitz", "pair", "gate")


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a term: its name, its shape (for messages and docs), whether every engine returns its gradient
    (False: the Triton kernel does not, and refuses it when it requires one; the reference and the tile engine
    still do, by autograd and by hand), which of its dimensions counts the heads (None: shared by the heads),
    its rank, and which dimension counts the batch (B or 1; None: shared by the batch)."""

    name: str
    shape: str
    grad: bool = True
    heads_dim: int | None = None
    ndim: int | None = None
    batch_dim: int | None = None


#: (tensors, ints, b, h, i, qi, j) -> the term's value, broadcast over the index tensors (B|1, H, Lq, Lk) in the
#: reference, 0-d in a Flex score_mod. i: query row; qi = q_offset + i: its key index; j: key index.
PairFn = Callable[..., torch.Tensor]
#: (tensors, h, delta) -> the term's value at δ = qi − j, broadcast over h and delta.
DistanceFn = Callable[[dict, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class TermSpec:
    """The one statement of a position term; every engine derives from it (see the module docstring).

    Attributes:
        kind: the term's name (``KernelTerm.kind``).
        form: one of `FORMS`.
        formula: B_h(i, j) in words (docs, messages).
        tensors: the term's tensors, in the order engines pass them around.
        distance: toeplitz form: the value at (head, δ), evaluated on broadcast index tensors.
        pair: pair/gate forms: the value at (b, h, i, qi, j).
        prepare: tensors derived from the query before ``pair`` reads them (shaw: q · a^K), or None.
        value_term: the term's addition to the output besides the logits (shaw), from the probabilities:
            (tensors, ints, probs (B, H, Lq, Lk), qi (Lq, 1), j (1, Lk)) -> (B, H, Lq, D); or None. A term with
            one has no FlexAttention form.
        ints: the names of the term's integer constants.
        check: extra shape checks against q (B, H, Lq, D), k (B, Hkv, Lk, D) and the offset (raise ValueError).
        validate: checks of the tensors at construction (raise ValueError).
        triton: the Triton branch that runs it: its own kind, another entry's kind (with ``lower``), or None.
        lower: the term rewritten for that other branch.
        triton_limit: why the Triton kernel cannot run this term instance (or None); called with the term and
            whether a gradient is wanted.
        example: (shape (B, H, Hkv, Lq, Lk, D), q_offset, generator, device, realistic=False) -> (term, leaves):
            a random term for tests and the compile check, with the leaf tensors whose gradients the tests compare;
            ``realistic``: tables of the sizes models use (they set the Triton kernels' compile-time sizes).
    """

    kind: str
    form: str
    formula: str
    tensors: tuple[TensorSpec, ...] = ()
    distance: DistanceFn | None = None
    pair: PairFn | None = None
    prepare: Callable[["KernelTerm", torch.Tensor], dict] | None = None
    value_term: Callable[..., torch.Tensor] | None = None
    ints: tuple[str, ...] = ()
    check: Callable[["KernelTerm", torch.Tensor, torch.Tensor, object], None] | None = None
    validate: Callable[[dict], None] | None = None
    triton: str | None = None
    lower: Callable[["KernelTerm"], "KernelTerm"] | None = None
    triton_limit: Callable[["KernelTerm", bool], str | None] | None = None
    example: Callable[..., tuple["KernelTerm", list]] | None = None

    def __post_init__(self) -> None:
        if self.form not in FORMS:
            raise ValueError(f"term {self.kind!r}: form must be one of {FORMS}, got {self.form!r}")
        if self.form == "toeplitz" and self.distance is None:
            raise ValueError(f"term {self.kind!r}: a toeplitz term needs its distance function")
        if self.form in ("pair", "gate") and self.pair is None:
            raise ValueError(f"term {self.kind!r}: a {self.form} term needs its pair function")

    @property
    def flex(self) -> bool:
        """Whether FlexAttention can express the term as a score_mod (not with a value term)."""
        return self.value_term is None

    def value(self, t: dict, ints: dict, b, h, i, qi, j) -> torch.Tensor:
        """B_h(i, j) on index tensors (broadcast, or FlexAttention's 0-d ones); see `PairFn`."""
        if self.form == "toeplitz":
            return self.distance(t, h, qi - j)
        return self.pair(t, ints, b, h, i, qi, j)


#: every registered term by kind, in registration order.
TERMS: dict[str, TermSpec] = {}


def register_term(spec: TermSpec) -> TermSpec:
    """Add ``spec`` to `TERMS` (a kind is registered once). The terms are registered in this module: the kind
    tuples below (`TERM_KINDS`, `KERNEL_KINDS`, ...) are computed once, after the last entry."""
    if spec.kind in TERMS:
        raise ValueError(f"kernel term {spec.kind!r} is already registered")
    if spec.triton is not None and spec.triton != spec.kind and (spec.triton not in TERMS or spec.lower is None):
        raise ValueError(f"term {spec.kind!r} runs on Triton's {spec.triton!r} branch: register that first, with "
                         "a lower function")
    TERMS[spec.kind] = spec
    return spec


def term_spec(kind: str) -> TermSpec:
    """The `TermSpec` of ``kind``; ValueError naming the known kinds otherwise."""
    try:
        return TERMS[kind]
    except KeyError:
        raise ValueError(f"unknown kernel term {kind!r}; allowed: {', '.join(TERMS)}") from None


def triton_id(kind: str) -> int:
    """The Triton kernel's compile-time id of ``kind``'s branch (its index in `KERNEL_KINDS`)."""
    branch = term_spec(kind).triton
    if branch is None:
        raise ValueError(f"the {kind} term has no Triton branch")
    return KERNEL_KINDS.index(branch)


def example_term(kind: str, shape: tuple, q_offset: int, g: torch.Generator, device="cpu",
                 realistic: bool = False) -> tuple["KernelTerm", list]:
    """A random ``kind`` term for ``shape`` (B, H, Hkv, Lq, Lk, D) and the leaves whose gradients tests compare
    (``realistic``: tables of the sizes models use, see `TermSpec`)."""
    return term_spec(kind).example(shape, q_offset, g, device, realistic)


def _f(x: torch.Tensor) -> torch.Tensor:
    """At least float32 (float64 stays float64)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _dist(delta: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """|δ| in ``like``'s compute dtype (float32, float64 for float64 tensors)."""
    return delta.abs().to(_f(like).dtype)


# -- the terms ---------------------------------------------------------------------------------------------


def _leaf(t: torch.Tensor, device) -> torch.Tensor:
    return t.to(device).requires_grad_()


register_term(TermSpec("none", "none", "0", triton="none",
                       example=lambda shape, off, g, dev, realistic=False: (KernelTerm("none"), [])))


def _alibi_example(shape, off, g, device, realistic=False):
    h = shape[1]  # ALiBi's slopes for a power of two heads (Press et al.): 2^(−8k/H), k = 1 .. H
    return KernelTerm.alibi((2.0 ** (-8.0 * torch.arange(1, h + 1) / h)).to(device)), []


register_term(TermSpec(
    "alibi", "toeplitz", "−slopes[h] · |δ|",
    tensors=(TensorSpec("slopes", "(H,)", grad=False, heads_dim=0, ndim=1),),
    distance=lambda t, h, delta: -_f(t["slopes"])[h] * _dist(delta, t["slopes"]),
    triton="alibi",
    example=_alibi_example,
))


def _kerple_log(t, h, delta):
    r1, r2 = _f(t["r1"])[h], _f(t["r2"])[h]
    return -r1 * torch.log1p(r2 * _dist(delta, t["r1"]))


def _kerple_pow(t, h, delta):
    r1, r2 = _f(t["r1"])[h], _f(t["r2"])[h]
    dist = _dist(delta, t["r1"])
    # d^r2 has an infinite derivative in r2 at d = 0: 0 there, with a zero gradient
    safe = torch.where(dist > 0, dist, torch.ones_like(dist))
    return torch.where(dist > 0, -r1 * safe.pow(r2), torch.zeros_like(r1 * dist))


def _kerple_example(variant):
    def make(shape, off, g, device, realistic=False):
        h = shape[1]
        r1 = _leaf(torch.rand(h, generator=g) * 2 + 0.05, device)
        r2 = _leaf(torch.rand(h, generator=g) * (1.9 if variant == "power" else 1.0) + 0.05, device)
        return KernelTerm.kerple(variant, r1, r2), [r1, r2]
    return make


def _kerple_validate(t: dict) -> None:
    if t["r2"].shape != t["r1"].shape:
        raise ValueError(f"r2 must be a vector of {t['r1'].shape[0]}, got shape {tuple(t['r2'].shape)}")


for _kind, _fn, _variant in (("kerple_log", _kerple_log, "log"), ("kerple_pow", _kerple_pow, "power")):
    register_term(TermSpec(
        _kind, "toeplitz", "−r1[h] · log(1 + r2[h] · |δ|)" if _variant == "log" else "−r1[h] · |δ|^r2[h]",
        tensors=(TensorSpec("r1", "(H,)", heads_dim=0, ndim=1), TensorSpec("r2", "(H,)", ndim=1)),
        distance=_fn, validate=_kerple_validate, triton=_kind, example=_kerple_example(_variant),
    ))


def _sandwich(t, h, delta):
    table = _f(t["table"])
    return table[h, delta.abs().long().clamp(max=table.shape[1] - 1)]


register_term(TermSpec(
    "sandwich", "toeplitz", "table[h, min(|δ|, T − 1)]",
    tensors=(TensorSpec("table", "(H, T)", grad=False, heads_dim=0, ndim=2),),
    distance=_sandwich, triton="sandwich",
    # a table shorter than the distances: the last column is reused
    example=lambda shape, off, g, dev, realistic=False: (
        KernelTerm.sandwich(torch.randn(shape[1], shape[4] // 2, generator=g).to(dev)), []),
))


def _t5(t, h, delta):
    table, buckets = _f(t["table"]), t["buckets"].long()
    m = (buckets.shape[0] - 1) // 2
    return table[buckets[(-delta.long()).clamp(-m, m) + m], h]


def _t5_validate(t: dict) -> None:
    b = t["buckets"]
    if b.dim() != 1 or b.shape[0] % 2 == 0 or b.is_floating_point():
        raise ValueError(f"t5 buckets must be an integer vector of odd length 2M + 1, got {tuple(b.shape)}")


def _t5_example(shape, off, g, device, realistic=False):
    nb, m = (32, 128) if realistic else (8, 20)  # T5's 32 buckets over ±128, or a small table
    table = _leaf(torch.randn(nb, shape[1], generator=g), device)
    # causal buckets of j − qi = −M .. M: the distance max(qi − j, 0) itself up to NB − 1, then the last bucket
    buckets = (-torch.arange(-m, m + 1)).clamp(0, nb - 1)
    return KernelTerm.t5(table, buckets.to(device)), [table]


register_term(TermSpec(
    "t5", "toeplitz", "table[buckets[clip(j − qi, −M, M) + M], h]",
    tensors=(TensorSpec("table", "(NB, H)", heads_dim=1, ndim=2), TensorSpec("buckets", "(2M + 1,)", grad=False)),
    distance=_t5, validate=_t5_validate, triton="t5", example=_t5_example,
))


def fire_psi(c: torch.Tensor, dpos: torch.Tensor) -> torch.Tensor:
    """FIRE's ψ(δ) = log(1 + c δ) at the (clamped, non-negative) distances ``dpos``."""
    return torch.log1p(c * dpos)


def fire_cell(u: torch.Tensor, n: int, inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(cell ⌊u⌋ <= N − 2, weight u − cell of cell + 1) of FIRE's fractional cells ``u`` (clamped to [0, N − 1]),
    for a table of N points. The cell carries no gradient; the weight carries u's (``inplace``: the weight is
    written over the clamped copy of u, one tile less to allocate; for inputs that need no gradient)."""
    u = u.clamp(0.0, n - 1.0)
    if inplace:
        cell = u.floor().clamp_(max=n - 2)
        return cell, u.sub_(cell)
    cell = u.detach().floor().clamp(max=n - 2)
    return cell, u - cell


def _fire(t, ints, b, h, i, qi, j):
    table, c, inv = _f(t["table"]), _f(t["c"]), _f(t["inv_norm"])
    n = table.shape[1]
    scale = (n - 1) / _f(t["x_max"]).detach()
    dpos = (qi - j).clamp(min=0).to(table.dtype)
    u = fire_psi(c, dpos) * (inv[b if inv.shape[0] > 1 else 0, i] * scale)
    cell, w = fire_cell(u, n)
    k0 = cell.long()
    t0 = table[h, k0]
    return t0 + w * (table[h, k0 + 1] - t0)


def _fire_validate(t: dict) -> None:
    if t["table"].shape[1] < 2:
        raise ValueError(f"fire table must be (H, N) with N >= 2, got shape {tuple(t['table'].shape)}")
    if t["c"].numel() != 1 or t["x_max"].numel() != 1:
        raise ValueError("fire c and x_max must be scalars")


def _fire_check(term, query, key, q_offset) -> None:
    b, q_len = query.shape[0], query.shape[2]
    inv = term.tensors["inv_norm"]
    if inv.shape[0] not in (1, b) or inv.shape[1] != q_len:
        raise ValueError(f"fire inv_norm must be (1 or B={b}, Lq={q_len}), got {tuple(inv.shape)}")


def _fire_example(shape, off, g, device, realistic=False):
    b, h, lq = shape[0], shape[1], shape[3]  # a small table (interpreter time); x_max covers every visible pair
    table = _leaf(torch.randn(h, 64 if realistic else 24, generator=g), device)
    c = _leaf(torch.tensor(0.3), device)
    inv_norm = _leaf(torch.rand(b, lq, generator=g) * 0.2 + 0.2, device)
    q_idx = torch.arange(lq, dtype=torch.float32, device=device) + off
    x_max = (torch.log1p(c.detach() * q_idx)[None] * inv_norm.detach()).max().clamp_min(1.0)
    return KernelTerm.fire(table, c, inv_norm, x_max), [table, c, inv_norm]


register_term(TermSpec(
    "fire", "pair", "interp(table[h], log(1 + c·max(δ, 0)) · inv_norm[b, i] · (N − 1) / x_max)",
    tensors=(TensorSpec("table", "(H, N)", heads_dim=0, ndim=2), TensorSpec("c", "()"),
             TensorSpec("inv_norm", "(B|1, Lq)", ndim=2, batch_dim=0), TensorSpec("x_max", "()", grad=False)),
    pair=_fire, validate=_fire_validate, check=_fire_check, triton="fire", example=_fire_example,
))


def _shaw(t, ints, b, h, i, qi, j):
    k = ints["max_relative_position"]
    return t["qa"][b, h, i, (j - qi).clamp(-k, k) + k]


def _shaw_values(t, ints, probs, qi, j):
    """Σ_j P_ij value_table[clip(j − qi, −K, K) + K]: the probabilities summed per relative bucket, times the table."""
    k = ints["max_relative_position"]
    b, h, q_len, k_len = probs.shape
    rel = (j - qi).clamp(-k, k) + k
    buckets = probs.new_zeros(b, h, q_len, 2 * k + 1).scatter_add(-1, rel.expand(b, h, q_len, k_len), probs)
    return buckets @ _f(t["value_table"])


def _shaw_check(term, query, key, q_offset) -> None:
    if term.tensors["key_table"].shape[1] != query.shape[-1]:
        raise ValueError(
            f"shaw tables must have head_dim {query.shape[-1]} columns, got {tuple(term.tensors['key_table'].shape)}"
        )


def _shaw_validate(t: dict) -> None:
    a, v = t["key_table"], t["value_table"]
    if a.shape != v.shape or a.shape[0] % 2 == 0:
        raise ValueError(f"shaw tables must both be (2K + 1, D), got {tuple(a.shape)} and {tuple(v.shape)}")


def _shaw_example(shape, off, g, device, realistic=False):
    d, rows = shape[5], 33 if realistic else 11  # K = 16 (Shaw et al.'s largest clip) or 5
    a_k = _leaf(torch.randn(rows, d, generator=g) * 0.3, device)
    a_v = _leaf(torch.randn(rows, d, generator=g) * 0.3, device)
    return KernelTerm.shaw(a_k, a_v), [a_k, a_v]


register_term(TermSpec(
    "shaw", "pair", "scale · q_i . key_table[clip(j − qi, −K, K) + K] (+ the value term)",
    tensors=(TensorSpec("key_table", "(2K + 1, D)", ndim=2), TensorSpec("value_table", "(2K + 1, D)", ndim=2)),
    # the key term is scale-free here: the reference scales q . a^K with the logits
    prepare=lambda term, query: {"qa": _f(query) @ _f(term.tensors["key_table"]).T},  # (B, H, Lq, 2K + 1)
    pair=_shaw, value_term=_shaw_values, ints=("max_relative_position",), check=_shaw_check, validate=_shaw_validate,
    triton="shaw", example=_shaw_example,
))


def _fox(t, ints, b, h, i, qi, j):
    c = _f(t["c"])
    return c[b, h, qi] - c[b, h, j]


def _fox_check(term, query, key, q_offset) -> None:
    b, h, q_len, _ = query.shape
    k_len = key.shape[2]
    c = term.tensors["c"]
    if tuple(c.shape) != (b, h, k_len):
        raise ValueError(f"fox c must be (B, H, Lk) = {(b, h, k_len)}, got {tuple(c.shape)}")
    # A tensor offset (a StaticCache's) is read only in eager mode on CPU: elsewhere that is a device sync (and a
    # graph break under torch.compile), and a StaticCache keeps its queries among its keys anyway.
    if isinstance(q_offset, torch.Tensor) and not eager_value_checks(q_offset):
        return
    offset = int(q_offset)
    if offset + q_len > k_len:
        raise ValueError(f"fox needs the queries among the keys: q_offset + Lq <= Lk, got {offset} + {q_len} > {k_len}")


def _fox_example(shape, off, g, device, realistic=False):
    b, h, lk = shape[0], shape[1], shape[4]
    log_f = _leaf(torch.nn.functional.logsigmoid(torch.randn(b, h, lk, generator=g) + 2.0), device)
    return KernelTerm.fox(log_f.cumsum(-1)), [log_f]


register_term(TermSpec(
    "fox", "gate", "c[b, h, qi] − c[b, h, j]",
    tensors=(TensorSpec("c", "(B, H, Lk)", heads_dim=1, ndim=3, batch_dim=0),),
    pair=_fox, check=_fox_check, triton="fox", example=_fox_example,
))


# Dynamic Position Bias (hf_posenc.encodings.dpb): an MLP evaluated once per signed distance, a Toeplitz table.
def _dpb(t, h, delta):
    table = _f(t["table"])
    m = (table.shape[1] - 1) // 2
    return table[h, delta.long().clamp(-m, m) + m]


def _dpb_validate(t: dict) -> None:
    if t["table"].shape[1] % 2 == 0:
        raise ValueError(f"dpb table must be (H, 2M + 1), got shape {tuple(t['table'].shape)}")


#: the largest t5 table the Triton t5 branch's backward takes: its dQ programs hold a histogram of
#: next_power_of_2(rows) float32 cells in registers and loop over the rows present in each tile.
T5_BRANCH_MAX_ROWS = 256


def _dpb_lower(term: "KernelTerm") -> "KernelTerm":
    """The same term on Triton's t5 branch: table (2M + 1, H) rows for relative positions j − qi = −M .. M, the
    identity as its buckets (row M − δ holds the value at δ)."""
    table = term.tensors["table"]
    rows = table.shape[1]
    return KernelTerm.t5(table.flip(1).T, torch.arange(rows, device=table.device))


def _dpb_triton_limit(term: "KernelTerm", grad: bool) -> str | None:
    rows = term.tensors["table"].shape[1]
    if grad and rows > T5_BRANCH_MAX_ROWS:
        return (f"the dpb table spans {rows} relative positions; its gradient in the Triton kernel goes through the "
                f"t5 branch's per-program histogram, which holds at most {T5_BRANCH_MAX_ROWS} (registers)")
    return None


def _dpb_example(shape, off, g, device, realistic=False):
    b, h, hkv, lq, lk, d = shape
    m = max(lk - 1, off + lq - 1)
    table = _leaf(torch.randn(h, 2 * m + 1, generator=g) * 0.5, device)
    return KernelTerm.build("dpb", table=table), [table]


register_term(TermSpec(
    "dpb", "toeplitz", "table[h, clip(δ, −M, M) + M]",
    tensors=(TensorSpec("table", "(H, 2M + 1)", heads_dim=0, ndim=2),),
    distance=_dpb, validate=_dpb_validate, triton="t5", lower=_dpb_lower, triton_limit=_dpb_triton_limit,
    example=_dpb_example,
))


#: every registered kind (the reference and the tile engine take them all).
TERM_KINDS = tuple(TERMS)
#: every kind the Triton kernel implements as a branch of its own, in the order of its compile-time ids.
KERNEL_KINDS = tuple(kind for kind, spec in TERMS.items() if spec.triton == kind)
#: the kinds FlexAttention can express with a score_mod (shaw's value term has no score_mod form).
FLEX_KINDS = tuple(kind for kind, spec in TERMS.items() if spec.flex)
#: every kind the tile-wise engine implements (all of them).
TILED_KINDS = TERM_KINDS
#: the terms that are a function of the distance δ = qi − j alone.
TOEPLITZ_KINDS = tuple(kind for kind, spec in TERMS.items() if spec.form == "toeplitz")


@dataclass(frozen=True)
class KernelTerm:
    """One position term for the fused attention; build it with `build` or the class methods.

    Attributes:
        kind: one of `TERM_KINDS`.
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
        if self.kind not in TERMS:
            raise ValueError(f"unknown kernel term {self.kind!r}; allowed: {', '.join(TERMS)}")

    @property
    def spec(self) -> TermSpec:
        """The registry entry of this term."""
        return TERMS[self.kind]

    @property
    def num_heads(self) -> int | None:
        """The number of query heads the term is built for (None when it does not depend on heads)."""
        for ts in self.spec.tensors:
            if ts.heads_dim is not None:
                return self.tensors[ts.name].shape[ts.heads_dim]
        return None

    def check(self, query: torch.Tensor, key: torch.Tensor, q_offset: int | torch.Tensor = 0) -> None:
        """Raise ``ValueError`` unless the term's tensors fit q (B, H, Lq, D) and k (B, Hkv, Lk, D)."""
        heads = self.num_heads
        if heads is not None and heads != query.shape[1]:
            raise ValueError(f"the {self.kind} term is built for {heads} heads, the queries have {query.shape[1]}")
        if self.spec.check is not None:
            self.spec.check(self, query, key, q_offset)

    @classmethod
    def build(cls, kind: str, key: torch.Tensor | None = None, value: torch.Tensor | None = None,
              ints: dict[str, int] | None = None, **tensors: torch.Tensor) -> "KernelTerm":
        """A ``kind`` term from its tensors by name, checked against its `TermSpec` (ValueError)."""
        spec = term_spec(kind)
        names = [ts.name for ts in spec.tensors]
        if sorted(tensors) != sorted(names):
            raise ValueError(f"the {kind} term takes the tensors {names}, got {sorted(tensors)}")
        for ts in spec.tensors:
            t = tensors[ts.name]
            if ts.ndim is not None and t.dim() != ts.ndim:
                raise ValueError(f"{kind} {ts.name} must be {ts.shape}, got shape {tuple(t.shape)}")
        if spec.validate is not None:
            spec.validate(tensors)
        return cls(kind, {name: tensors[name] for name in names}, dict(ints or {}), key, value)

    # -- constructors of the terms with arguments beyond their tensors --------------------------------------
    @classmethod
    def none(cls) -> "KernelTerm":
        """No position term (plain attention)."""
        return cls("none")

    @classmethod
    def alibi(cls, slopes: torch.Tensor) -> "KernelTerm":
        """−slopes[h] |δ|; slopes (H,) float32."""
        return cls.build("alibi", slopes=slopes)

    @classmethod
    def kerple(cls, variant: str, r1: torch.Tensor, r2: torch.Tensor) -> "KernelTerm":
        """KERPLE's ``log`` or ``power`` kernel with r1, r2 (H,) (already inside their constraints)."""
        if variant not in ("log", "power"):
            raise ValueError(f"kerple variant must be 'log' or 'power', got {variant!r}")
        return cls.build("kerple_log" if variant == "log" else "kerple_pow", r1=r1, r2=r2)

    @classmethod
    def sandwich(cls, table: torch.Tensor) -> "KernelTerm":
        """table (H, T): the bias at distance 0 .. T − 1 (distances past T − 1 take the last column)."""
        if table.dim() != 2 or table.shape[1] < 1:
            raise ValueError(f"sandwich table must be (H, T), got shape {tuple(table.shape)}")
        return cls.build("sandwich", table=table)

    @classmethod
    def t5(cls, table: torch.Tensor, buckets: torch.Tensor) -> "KernelTerm":
        """table (NB, H); buckets (2M + 1,) integer: the bucket of relative position j − qi = −M .. M
        (positions past ±M share the bucket of ±M)."""
        if table.dim() != 2:
            raise ValueError(f"t5 table must be (num_buckets, H), got shape {tuple(table.shape)}")
        return cls.build("t5", table=table, buckets=buckets)

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
        return cls.build("fire", table=table, c=c.reshape(()), inv_norm=inv_norm, x_max=x_max.reshape(()))

    @classmethod
    def shaw(cls, key_table: torch.Tensor, value_table: torch.Tensor) -> "KernelTerm":
        """key_table, value_table (2K + 1, D): shared by the heads; row clip(j − qi, −K, K) + K."""
        if key_table.dim() != 2 or key_table.shape != value_table.shape or key_table.shape[0] % 2 == 0:
            raise ValueError(
                f"shaw tables must both be (2K + 1, D), got {tuple(key_table.shape)} and {tuple(value_table.shape)}"
            )
        return cls.build("shaw", key_table=key_table, value_table=value_table,
                         ints={"max_relative_position": (key_table.shape[0] - 1) // 2})

    @classmethod
    def fox(cls, c: torch.Tensor, key: torch.Tensor | None = None, value: torch.Tensor | None = None) -> "KernelTerm":
        """c (B, H, Lk): cumulative log forget gates (padding's gates already zeroed); D_ij = c[qi] − c[j]."""
        if c.dim() != 3:
            raise ValueError(f"fox c must be (B, H, Lk), got shape {tuple(c.shape)}")
        return cls.build("fox", key=key, value=value, c=c)


def enter(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, term: KernelTerm, check_offset,
          window: object, check_window: Callable[[object], int | None]):
    """The entry prologue every engine shares: ``window`` validated (``check_window``), the term's replacement
    keys and values taken, the term checked against the inputs at ``check_offset``. Returns (key, value, window)."""
    window = check_window(window)
    key = term.key if term.key is not None else key
    value = term.value if term.value is not None else value
    term.check(query, key, check_offset)
    return key, value, window
