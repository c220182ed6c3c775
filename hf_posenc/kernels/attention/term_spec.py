"""What a position term is (``TermSpec``), its tensors (``TensorSpec``), the registry
(``register_term``, ``term_spec``, ``term_kinds``) and ``KernelTerm``, what an encoding hands to
the engines. The package's docstring (``hf_posenc.kernels.attention.terms``) says how every engine derives from a
spec; each built-in term is one module beside this one, registered through the same ``register_term`` a
user's own file calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .._masks import CacheSinks, cache_sinks, check_sink

__all__ = [
    "FORMS",
    "SIZES",
    "TERMS",
    "TRITON_BRANCHES",
    "KernelTerm",
    "TensorSpec",
    "TermExample",
    "TermSpec",
    "TritonHooks",
    "at_least_float32",
    "enter",
    "enter_sinks",
    "example_term",
    "flex_kinds",
    "kernel_kinds",
    "list_terms",
    "register_term",
    "term_kinds",
    "term_spec",
    "tiled_kinds",
    "toeplitz_kinds",
    "triton_id",
]

#: the forms a term can take: ``toeplitz``, a function of (h, δ) alone; ``pair``, of (b, h, i, qi, j); ``gate``,
#: c[qi] − c[j] of one per-token tensor c (B, H, Lk); ``none``, no term.
FORMS = ("none", "toeplitz", "pair", "gate")

#: The Triton kernel's compile-time branches, in the order of their ids (``triton_attention.py`` has one branch per
#: entry). A term names one of them as its ``triton``: its own (a built-in with that kind), or another one's through
#: ``lower``; a new branch is kernel code, so only a built-in term adds one (here and in the kernel).
TRITON_BRANCHES = ("none", "alibi", "kerple_log", "kerple_pow", "sandwich", "t5", "fire", "shaw", "fox")

#: the size symbols a ``TensorSpec`` shape may use that stand for the sizes of a call: the batch (``B``, the
#: dimension may also be 1), the query heads, the query and key lengths and the head dimension.
SIZES = ("B", "H", "Lq", "Lk", "D")


def at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32 when it is a half-precision float (float32 and float64 stay as they are)."""
    return x if x.dtype in (torch.float32, torch.float64) or not x.is_floating_point() else x.float()


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a term.

    Attributes:
        name: its name (the keyword of ``KernelTerm.build`` and of the derived constructor).
        shape: its shape, a tuple of ints and symbols: the sizes of a call (``SIZES``: ``"B"``, ``"H"``,
            ``"Lq"``, ``"Lk"``, ``"D"``) or a free symbol (``"T"``, ``"2M + 1"``) for a size of the term's own; or a
            string, for the docs only.
        grad: whether every engine returns its gradient (False: the Triton kernel does not, and refuses it when it
            requires one; the reference and the tile engine still do, by autograd and by hand).
        heads_dim: which dimension counts the query heads (None: shared by the heads); from ``"H"`` in ``shape``.
        ndim: its rank (checked when a term is built; a 1-element tensor is reshaped to a 0-d one where the rank
            is 0); from a tuple ``shape``.
        batch_dim: which dimension counts the batch (B or 1; None: shared by the batch); from ``"B"`` in ``shape``.
    """

    name: str
    shape: tuple[int | str, ...] | str
    grad: bool = True
    heads_dim: int | None = None
    ndim: int | None = None
    batch_dim: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(f"a term tensor's name must be an identifier, got {self.name!r}")
        if isinstance(self.shape, str):
            return
        if not isinstance(self.shape, tuple) or not all(isinstance(s, (int, str)) for s in self.shape):
            raise TypeError(f"term tensor {self.name!r}: shape must be a tuple of ints and size symbols "
                            f"({', '.join(SIZES)}, or a name of the term's own), got {self.shape!r}")
        derived = {"ndim": len(self.shape), "heads_dim": _index(self.shape, "H"), "batch_dim": _index(self.shape, "B")}
        for attr, value in derived.items():
            if getattr(self, attr) is None:
                object.__setattr__(self, attr, value)

    @property
    def shape_text(self) -> str:
        """The shape as the docs and messages write it: ``(H,)``, ``(H, T)``, ``()``."""
        if isinstance(self.shape, str):
            return self.shape
        inner = ", ".join(str(s) for s in self.shape)
        return f"({inner},)" if len(self.shape) == 1 else f"({inner})"


def _index(shape: tuple, symbol: str) -> int | None:
    return shape.index(symbol) if symbol in shape else None


#: (tensors, ints, b, h, i, qi, j) -> the term's value, broadcast over the index tensors (B|1, H, Lq, Lk) in the
#: reference, 0-d in a Flex score_mod. i: query row; qi = q_offset + i: its key index; j: key index.
PairFn = Callable[..., torch.Tensor]
#: (tensors, h, delta) -> the term's value at δ = qi − j, broadcast over h and delta.
DistanceFn = Callable[[dict, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class TritonHooks:
    """How the Triton host code (``triton_attention.py``) launches a term on its own branch: what differs per term
    there, stated beside the term (its module). Only terms with a branch of their own have them.

    Attributes:
        tensors: (term, q) -> the tensors the kernel reads as TP0 .. TP3 (float32 contiguous, or int32 indices), in
            the order of the autograd Function's trailing inputs.
        group: the row of ``LAUNCH`` (tile sizes) it runs with: ``light``, ``t5``, ``fire`` or ``shaw``.
        sizes: term -> its compile-time and runtime sizes among ``ti0``, ``ti1`` (runtime ints), ``rp`` (per-row
            histogram width), ``nhp`` (per-program histogram width); None: none.
        batch_stride: kernel tensors -> the batch stride of a per-batch tensor the kernel indexes by b (``tp_sb``).
        row_planes: per-row gradient planes the dQ kernel writes (``ROWG0``, ``ROWG1``).
        histogram: whether the dQ kernel writes a per-program table histogram (``HIST``).
        key_grad: whether the dK/dV kernel writes a per-key gradient (``DCK``).
        values: a term with a value term (shaw): (term, W (B, H, Lq, R)) -> the value term (B, H, Lq, D) from the
            per-row histogram W of the probabilities that the kernel forms (forward), whose backward takes dW and
            returns the gradient of the per-row prepared tensor (``DQA``); None otherwise.
        grads: (launch, kernel tensors, rowg, hist, dqa, dck) -> the gradient of each kernel tensor from the kernels'
            partial sums (None for one without); None: no tensor takes one.
    """

    tensors: Callable[["KernelTerm", torch.Tensor], list[torch.Tensor]]
    group: str = "light"
    sizes: Callable[["KernelTerm"], dict[str, int]] | None = None
    batch_stride: Callable[[list[torch.Tensor]], int] | None = None
    row_planes: int = 0
    histogram: bool = False
    key_grad: bool = False
    values: Callable[["KernelTerm", torch.Tensor], torch.Tensor] | None = None
    grads: Callable[..., list] | None = None


@dataclass
class TermExample:
    """A random instance of a term, for tests, the doctor and the compile check.

    Attributes:
        leaves: the tensors whose gradients are compared (leaf tensors that require one), by name.
        fixed: the other tensors (no gradient), by name.
        build: every tensor of ``leaves`` and ``fixed`` by name -> the term (the doctor calls it again with float64
            copies for its reference).
    """

    leaves: dict[str, torch.Tensor]
    fixed: dict[str, torch.Tensor]
    build: Callable[[dict[str, torch.Tensor]], "KernelTerm"]

    @property
    def term(self) -> "KernelTerm":
        """The term built from ``leaves`` and ``fixed``."""
        return self.build({**self.fixed, **self.leaves})


@dataclass(frozen=True)
class TermSpec:
    """The one statement of a position term; every engine derives from it (see the package docstring).

    The value first (a Toeplitz term needs ``distance``, a pair or gate term ``pair``); everything after ``value_term``
    is optional: what a built-in adds for speed (the tile engine's and the Triton kernel's hooks) or for checks.

    Attributes:
        kind: the term's name (``KernelTerm.kind``; an identifier: ``KernelTerm.<kind>(...)`` builds one).
        form: one of ``FORMS``.
        formula: B_h(i, j) in words (docs, messages).
        tensors: the term's tensors, in the order engines pass them around (and the derived constructor takes them).
        distance: toeplitz form: (tensors, h, δ) -> the value at (head, δ = qi − j), evaluated on broadcast index
            tensors (δ integer-valued; the tensors at least float32).
        pair: pair and gate forms: (tensors, ints, b, h, i, qi, j) -> the value, broadcast (see ``PairFn``).
        prepare: tensors derived from the query before ``pair`` reads them (shaw: q · a^K), or None.
        value_term: the term's addition to the output besides the logits (shaw), from the probabilities:
            (tensors, ints, probs (B, H, Lq, Lk), qi (Lq, 1), j (1, Lk)) -> (B, H, Lq, D); or None. A term with
            one has no FlexAttention form, and its key term is scaled with the logits (``scale · (q · k + value)``).
        ints: the names of the term's integer constants.
        ints_of: tensors -> the integer constants, derived from the tensors when a term is built without them.
        check: extra shape checks against q (B, H, Lq, D), k (B, Hkv, Lk, D) and the offset (raise ValueError).
        validate: checks of the tensors at construction (raise ValueError).
        example: (shape (B, H, Hkv, Lq, Lk, D), q_offset, generator, device, realistic=False) -> ``TermExample``:
            a random term for tests, the doctor and the compile check (``realistic``: tables of the sizes models
            use; they set the Triton kernels' compile-time sizes). None: random tensors of the declared shapes (every
            shape a tuple of ints and ``SIZES``, every tensor floating point).
        slope: for a term that is −s[h] · |δ| (ALiBi's form): tensors -> s (H,). The tile engine then carries it on
            causal calls as one more key channel (c[j] = −s · j, a constant log forget gate) and CAPE as one column.
        tiles: pair form: (plan, tensors, dtype) -> the tile engine's tiles of the term (``_tiles.PairTiles``); a
            pair term without them does not run on the tile engine.
        triton: the Triton branch that runs it (one of ``TRITON_BRANCHES``): its own kind (with ``kernel``),
            another entry's kind (with ``lower``), or None.
        lower: the term rewritten for that other branch.
        triton_limit: why the Triton kernel cannot run this term instance (or None); called with the term and
            whether a gradient is wanted.
        kernel: the Triton host code's hooks of its own branch (``TritonHooks``).
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
    ints_of: Callable[[dict], dict[str, int]] | None = None
    check: Callable[["KernelTerm", torch.Tensor, torch.Tensor, object], None] | None = None
    validate: Callable[[dict], None] | None = None
    example: Callable[..., TermExample] | None = None
    slope: Callable[[dict], torch.Tensor] | None = None
    tiles: Callable[..., Any] | None = None
    triton: str | None = None
    lower: Callable[["KernelTerm"], "KernelTerm"] | None = None
    triton_limit: Callable[["KernelTerm", bool], str | None] | None = None
    kernel: TritonHooks | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str) or not self.kind.isidentifier():
            raise ValueError(f"a term's kind must be an identifier (KernelTerm.<kind> builds one), got {self.kind!r}")
        if self.form not in FORMS:
            raise ValueError(f"term {self.kind!r}: form must be one of {FORMS}, got {self.form!r}")
        if not isinstance(self.tensors, tuple) or not all(isinstance(t, TensorSpec) for t in self.tensors):
            raise TypeError(f"term {self.kind!r}: tensors must be a tuple of TensorSpec")
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise ValueError(f"term {self.kind!r}: its tensors' names repeat: {names}")
        if self.form == "toeplitz" and self.distance is None:
            raise ValueError(f"term {self.kind!r}: a toeplitz term needs its distance function")
        if self.form in ("pair", "gate") and self.pair is None:
            raise ValueError(f"term {self.kind!r}: a {self.form} term needs its pair function")
        if self.form == "gate" and len(self.tensors) != 1:
            raise ValueError(f"term {self.kind!r}: a gate term has one tensor, its cumulative gates c (B, H, Lk); "
                             f"got {names}")
        if self.slope is not None and self.form != "toeplitz":
            raise ValueError(f"term {self.kind!r}: slope= states a Toeplitz term's −s[h] · |δ| form")
        if self.tiles is not None and (self.form != "pair" or not isinstance(self.tiles, type)
                                       or not hasattr(self.tiles, "fused")):
            raise TypeError(f"term {self.kind!r}: tiles= is a pair term's tile class (a subclass of "
                            "hf_posenc.kernels.attention._tiles.PairTiles)")
        if self.kernel is not None and not isinstance(self.kernel, TritonHooks):
            raise TypeError(f"term {self.kind!r}: kernel= is a TritonHooks, got {type(self.kernel).__name__}")

    @property
    def flex(self) -> bool:
        """Whether FlexAttention can express the term as a score_mod (not with a value term)."""
        return self.value_term is None

    @property
    def tiled(self) -> bool:
        """Whether the tile engine runs the term: every form but a pair term without its tiles."""
        return self.form != "pair" or self.tiles is not None

    def value(self, t: dict, ints: dict, b, h, i, qi, j) -> torch.Tensor:
        """B_h(i, j) on index tensors (broadcast, or FlexAttention's 0-d ones); see ``PairFn``."""
        t = {name: at_least_float32(x) for name, x in t.items()}
        if self.form == "toeplitz":
            return self.distance(t, h, qi - j)
        return self.pair(t, ints, b, h, i, qi, j)

    def distance_values(self, t: dict, h: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """A Toeplitz term's value at heads ``h`` and distances ``delta`` (broadcast), its tensors at least float32."""
        return self.distance({name: at_least_float32(x) for name, x in t.items()}, h, delta)

    def make_example(self, shape: tuple, q_offset: int, g: torch.Generator, device: torch.device | str = "cpu",
                     realistic: bool = False) -> TermExample:
        """A random instance (see ``example``): the spec's own, or random tensors of the declared shapes."""
        if self.example is not None:
            return self.example(shape, q_offset, g, device, realistic)
        sizes = dict(zip(("B", "H", "Hkv", "Lq", "Lk", "D"), shape))
        leaves, fixed = {}, {}
        for ts in self.tensors:
            if isinstance(ts.shape, str) or not all(isinstance(s, int) or s in SIZES for s in ts.shape):
                raise ValueError(f"term {self.kind!r} has no example: the shape {ts.shape_text} of its tensor "
                                 f"{ts.name!r} has sizes of its own; give TermSpec(example=...)")
            dims = [s if isinstance(s, int) else sizes[s] for s in ts.shape]
            t = (torch.randn(dims, generator=g) * 0.5).to(device)
            if ts.grad:
                leaves[ts.name] = t.requires_grad_()
            else:
                fixed[ts.name] = t
        return TermExample(leaves, fixed, lambda tensors: KernelTerm.build(self.kind, **tensors))


#: every registered term by kind, in registration order.
TERMS: dict[str, TermSpec] = {}

#: attribute names of ``KernelTerm`` a kind may not take (its derived constructor would hide them).
_RESERVED = ("build", "check", "spec", "num_heads", "kind", "tensors", "ints", "key", "value")


def register_term(spec: TermSpec) -> TermSpec:
    """Add ``spec`` to the registry: every engine then takes the term (see the package docstring), and
    ``KernelTerm.<kind>(*tensors)`` builds one. A kind is registered once.

    Raises:
        TypeError: ``spec`` is not a ``TermSpec``.
        ValueError: the kind is taken (or names a ``KernelTerm`` attribute), or its Triton branch does not exist.
    """
    if not isinstance(spec, TermSpec):
        raise TypeError(f"register_term takes a TermSpec, got {type(spec).__name__}")
    if spec.kind in TERMS:
        raise ValueError(f"kernel term {spec.kind!r} is already registered")
    if spec.kind in _RESERVED:
        raise ValueError(f"kernel term kind {spec.kind!r} would hide KernelTerm.{spec.kind}; choose another name")
    if spec.triton is not None:
        if spec.triton not in TRITON_BRANCHES:
            raise ValueError(f"term {spec.kind!r}: the Triton kernel has no branch {spec.triton!r}; its branches: "
                             f"{', '.join(TRITON_BRANCHES)} (name one with lower=, or triton=None)")
        if spec.triton == spec.kind and spec.kernel is None:
            raise ValueError(f"term {spec.kind!r} runs on its own Triton branch: give its host hooks (kernel=)")
        if spec.triton != spec.kind and (spec.triton not in TERMS or spec.lower is None):
            raise ValueError(f"term {spec.kind!r} runs on Triton's {spec.triton!r} branch: register that first, "
                             "with a lower function")
    TERMS[spec.kind] = spec
    setattr(KernelTerm, spec.kind, _constructor(spec))
    return spec


def term_spec(kind: str) -> TermSpec:
    """The ``TermSpec`` of ``kind``; ValueError naming the known kinds otherwise."""
    try:
        return TERMS[kind]
    except KeyError:
        raise ValueError(f"unknown kernel term {kind!r}; allowed: {', '.join(TERMS)}") from None


def term_kinds() -> tuple[str, ...]:
    """Every registered kind, in registration order (the reference takes them all), read now."""
    return tuple(TERMS)


def list_terms() -> list[str]:
    """Every registered term kind, in registration order (the built-ins first)."""
    return list(TERMS)


def kernel_kinds() -> tuple[str, ...]:
    """The kinds with a Triton branch of their own, in the order of the branches' ids (``TRITON_BRANCHES``)."""
    return tuple(k for k in TRITON_BRANCHES if k in TERMS and TERMS[k].triton == k)


def flex_kinds() -> tuple[str, ...]:
    """The kinds FlexAttention can express with a score_mod (not shaw's value term), read now."""
    return tuple(kind for kind, spec in TERMS.items() if spec.flex)


def tiled_kinds() -> tuple[str, ...]:
    """The kinds the tile engine runs (every registered one but a pair term without its tiles), read now."""
    return tuple(kind for kind, spec in TERMS.items() if spec.tiled)


def toeplitz_kinds() -> tuple[str, ...]:
    """The kinds that are a function of the distance δ = qi − j alone, read now."""
    return tuple(kind for kind, spec in TERMS.items() if spec.form == "toeplitz")


def triton_id(kind: str) -> int:
    """The Triton kernel's compile-time id of ``kind``'s branch (its index in ``TRITON_BRANCHES``)."""
    branch = term_spec(kind).triton
    if branch is None:
        raise ValueError(f"the {kind} term has no Triton branch")
    return TRITON_BRANCHES.index(branch)


def example_term(kind: str, shape: tuple, q_offset: int, g: torch.Generator, device="cpu",
                 realistic: bool = False) -> tuple["KernelTerm", list]:
    """A random ``kind`` term for ``shape`` (B, H, Hkv, Lq, Lk, D) and the leaves whose gradients tests compare
    (``realistic``: tables of the sizes models use, see ``TermSpec``)."""
    ex = term_spec(kind).make_example(shape, q_offset, g, device, realistic)
    return ex.term, list(ex.leaves.values())


def leaf(t: torch.Tensor, device) -> torch.Tensor:
    """``t`` on ``device``, a leaf that requires a gradient (for examples)."""
    return t.to(device).requires_grad_()


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for n <= 1), as ``triton.next_power_of_2`` (no Triton import here)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def _dist(delta: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """|δ| in ``like``'s compute dtype (float32, float64 for float64 tensors)."""
    return delta.abs().to(at_least_float32(like).dtype)


@dataclass(frozen=True)
class KernelTerm:
    """One position term for the engines; build it with ``build`` or ``KernelTerm.<kind>(*tensors)``.

    Attributes:
        kind: a registered kind (``term_kinds``).
        tensors: the term's tensors by name (its ``TermSpec``'s ``tensors``).
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
        """A ``kind`` term from its tensors by name, checked against its ``TermSpec`` (ValueError): the names,
        each tensor's rank (a 1-element tensor becomes 0-d where the rank is 0), the spec's ``validate``; integer
        constants from ``ints`` or the spec's ``ints_of``."""
        spec = term_spec(kind)
        names = [ts.name for ts in spec.tensors]
        if sorted(tensors) != sorted(names):
            raise ValueError(f"the {kind} term takes the tensors {names}, got {sorted(tensors)}")
        for ts in spec.tensors:
            t = tensors[ts.name]
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{kind} {ts.name} must be a tensor, got {type(t).__name__}")
            if ts.ndim == 0 and t.dim() != 0 and t.numel() == 1:
                t = tensors[ts.name] = t.reshape(())
            if ts.ndim is not None and t.dim() != ts.ndim:
                raise ValueError(f"{kind} {ts.name} must be {ts.shape_text}, got shape {tuple(t.shape)}")
        if spec.validate is not None:
            spec.validate(tensors)
        if ints is None and spec.ints_of is not None:
            ints = spec.ints_of(tensors)
        ints = dict(ints or {})
        if sorted(ints) != sorted(spec.ints):
            raise ValueError(f"the {kind} term takes the integer constants {list(spec.ints)}, got {sorted(ints)}")
        return cls(kind, {name: tensors[name] for name in names}, ints, key, value)


def _constructor(spec: TermSpec) -> classmethod:
    """``KernelTerm.<kind>(*tensors, key=None, value=None, ints=None, **tensors)``: ``KernelTerm.build`` with the
    tensors positional in the spec's order."""
    names = [ts.name for ts in spec.tensors]

    def make(cls, *args: torch.Tensor, key: torch.Tensor | None = None, value: torch.Tensor | None = None,
             ints: dict[str, int] | None = None, **named: torch.Tensor) -> KernelTerm:
        if len(args) > len(names):
            raise TypeError(f"KernelTerm.{spec.kind} takes the tensors {names}, got {len(args)} positional")
        given = dict(zip(names, args))
        both = sorted(set(given) & set(named))
        if both:
            raise TypeError(f"KernelTerm.{spec.kind} got {both} both by position and by name")
        return cls.build(spec.kind, key=key, value=value, ints=ints, **given, **named)

    shapes = ", ".join(f"{ts.name} {ts.shape_text}" for ts in spec.tensors) or "no tensors"
    make.__name__ = spec.kind
    make.__doc__ = f"The ``{spec.kind}`` term, {spec.formula}: {shapes} (see its TermSpec)."
    return classmethod(make)


def enter(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, term: KernelTerm, check_offset,
          window: object, check_window: Callable[[object], int | None]):
    """The entry prologue every engine shares: ``window`` validated (``check_window``), the term's replacement
    keys and values taken, the term checked against the inputs at ``check_offset``. Returns (key, value, window)."""
    window = check_window(window)
    key = term.key if term.key is not None else key
    value = term.value if term.value is not None else value
    term.check(query, key, check_offset)
    return key, value, window



def enter_sinks(term: KernelTerm, window: int | None, sink: object, sink_positions: object, causal: bool
                ) -> tuple[int | None, CacheSinks | None]:
    """The sink options every engine shares, checked (after `enter`, with its ``window``): (``sink`` (None or an int
    >= 1 with a window), the `CacheSinks` of ``sink_positions="cache"`` or None). The sinks at their cache positions
    move a pair's distance, so only a term of the distance alone takes them (a Toeplitz term, or none): ValueError
    for any other, and for ``"cache"`` without sinks or on bidirectional attention; TypeError / ValueError for a bad
    ``sink``."""
    sink = check_sink(sink, window)
    cache = cache_sinks(sink_positions, window, sink, causal)
    if cache is not None and term.spec.form not in ("toeplitz", "none"):
        raise ValueError(
            f"sink_positions='cache' moves each far sink to distance W + sink - 1 - j, which only a term of the "
            f"distance alone takes (a Toeplitz term: {', '.join(toeplitz_kinds())}); the {term.kind} term is a "
            f"{term.spec.form} term")
    return sink, cache
