"""The doctor's checks (cases) and their inputs (problems): one case per registered attention term (built from the
term registry: its entry's example, every engine that has the term), the windowed launch, SBA, CoPE, CAPE, the
rotary kernel and the remap engine."""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any, Callable

import torch
from torch.nn import functional as F

from ..kernels._attn_dispatch import common_unsupported
from ..kernels.attention import (
    KernelTerm,
    attention_reference,
    flex_attention_term,
    flex_unsupported,
    fused_attention,
    kernel_unsupported,
    term_bias,
    tiled_attention,
    tiled_unsupported,
)
from ..kernels.attention.terms import TERMS, term_spec
from ..kernels.cape import cape_attention_reference, cape_attention_tiled
from ..kernels.cope import cope_reference, cope_tiled
from ..kernels.cope import triton_unsupported as cope_triton_unsupported
from ..kernels.rotary import _kernel_unsupported as rotary_unsupported
from ..kernels.rotary import apply_qk_rotation_reference
from ..kernels.sba import sba_reference, sba_tiled

__all__ = ["QUICK_CASES", "SHAPE", "SHAPE_INTERPRETED", "TILES", "Case", "Problem", "build_problem", "case_seed",
           "cases"]

#: (B, H, Hkv, L, D): GQA 2:1, an odd length, a head_dim that is not a power of two.
SHAPE = (2, 4, 2, 77, 40)
#: Triton's interpreter (CPU): one Python step per program and tile, so a tiny shape.
SHAPE_INTERPRETED = (2, 2, 1, 17, 16)
#: query and key tile sizes of the tile-wise engines here: several tiles along L, so the carries between
#: tiles are checked (the engines' defaults cover short sequences with a single tile).
TILES = (16, 32)


# -- the problems ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    """One check: a family (``attention``, ``sba``, ``cope``, ``cape``, ``rotary``, ``remap``), its variant and
    window."""

    name: str
    family: str
    variant: str
    engines: tuple[str, ...]
    window: bool = False


_ATTENTION_ENGINES = ("triton", "tiled", "flex")
#: the checks after the attention terms', in the order they run.
_OTHER_CASES: tuple[Case, ...] = (
    Case("alibi_window", "attention", "alibi", _ATTENTION_ENGINES, window=True),
    Case("sba", "sba", "bias", ("triton", "tiled")),
    Case("sba_window", "sba", "bias", ("triton", "tiled"), window=True),
    Case("cope", "cope", "", ("triton", "tiled")),
    Case("cope_window", "cope", "", ("triton", "tiled"), window=True),
    Case("cape", "cape", "kerple_log", ("tiled",)),
    Case("rotary_s2", "rotary", "2", ("triton",)),
    Case("rotary_s8", "rotary", "8", ("triton",)),
    Case("remap_dca", "remap", "dca", ("triton", "tiled")),
    Case("remap_sinks", "remap", "sinks", ("triton", "tiled")),
)
#: ``--quick``: one case of each family, the window included.
QUICK_CASES = ("alibi", "fire", "fox", "alibi_window", "sba", "cope_window", "cape", "rotary_s2", "remap_dca")


def cases() -> tuple[Case, ...]:
    """Every check, in the order it runs, read from the term registry now: one per registered attention term (but
    ``none``; every engine, a row skipped with the reason where it has no form of the term: shaw's FlexAttention,
    a term without a Triton branch), then the other kernels'."""
    terms = tuple(Case(kind, "attention", kind, _ATTENTION_ENGINES) for kind, spec in TERMS.items()
                  if spec.form != "none")
    return terms + _OTHER_CASES


def case_seed(seed: int, case: Case, dtype_name: str) -> int:
    """The seed of a case's inputs: the same for every engine of a case and dtype, whatever else runs (and whatever
    else is registered: from the case's name, not its place)."""
    return seed + zlib.crc32(f"{case.name}/{dtype_name}".encode()) % 1_000_000


@dataclasses.dataclass
class Problem:
    """Inputs of one case and how each engine and the reference compute it.

    ``inputs``: (name, leaf tensor) whose gradients are checked; q, k, v come first (in the row's dtype),
    then the term's parameters (float32). ``run(engine, *inputs)`` returns the output, or a tuple of outputs;
    ``reference(*inputs)`` the same from float64 copies. ``grad_out``: the incoming gradient(s)."""

    inputs: list[tuple[str, torch.Tensor]]
    run: Callable[..., Any]
    reference: Callable[..., Any]
    grad_out: tuple[torch.Tensor, ...]
    unsupported: Callable[[str, list[torch.Tensor]], str | None]
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _leaf(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.to(device).requires_grad_()


def _qkv(shape, dtype, device, g) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (B, H, L, D) as transformers lays it out (a transposed view), k, v (B, Hkv, L, D), the incoming gradient."""
    b, h, hkv, n, d = shape
    q = torch.randn(b, n, h, d, generator=g).transpose(1, 2)
    k = torch.randn(b, hkv, n, d, generator=g)
    v = torch.randn(b, hkv, n, d, generator=g)
    gout = torch.randn(b, h, n, d, generator=g)
    return tuple(t.to(device=device, dtype=dtype) for t in (q, k, v, gout))


def _key_valid(shape, device) -> torch.Tensor:
    """(B, L) bool: the last batch row left-padded (its first queries see no key at all)."""
    b, _, _, n, _ = shape
    valid = torch.ones(b, n, dtype=torch.bool)
    if b > 1:
        valid[-1, : n // 8 + 1] = False
    return valid.to(device)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The yardstick of the timings: SDPA, causal, no bias, on the same q, k, v."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


def _window(case: Case, shape) -> int | None:
    return max(2, shape[3] // 3) if case.window else None


def _attention_problem(case: Case, shape, dtype, device, g) -> Problem:
    """One registered attention term (its registry entry's example: the leaves whose gradients are checked, float32,
    shaped as its encodings build them) on every engine against the float64 reference."""
    q, k, v, gout = _qkv(shape, dtype, device, g)
    b, h, hkv, n, d = shape
    example = term_spec(case.variant).make_example((b, h, hkv, n, n, d), 0, g, device)
    params, fixed = example.leaves, example.fixed
    valid = _key_valid(shape, device)
    window = _window(case, shape)
    names = list(params)
    kw = dict(scale=shape[4] ** -0.5, causal=True, q_offset=0, key_valid=valid, window=window)
    flex_memo: dict = {}

    def split(tensors):
        return tensors[:3], dict(zip(names, tensors[3:]))

    def term_of(p: dict, fixed_tensors: dict) -> KernelTerm:
        return example.build({**fixed_tensors, **p})

    def run(engine, *tensors):
        (q_, k_, v_), p = split(tensors)
        term = term_of(p, fixed)
        if engine == "triton":
            return fused_attention(q_, k_, v_, term, **kw)
        if engine == "tiled":
            return tiled_attention(q_, k_, v_, term, block_q=TILES[0], block_k=TILES[1], **kw)
        if engine == "flex":  # the block mask built once, as a model builds it once per forward for every layer
            return flex_attention_term(q_, k_, v_, term, memo=flex_memo, **kw)
        raise ValueError(engine)

    def reference(*tensors):
        (q_, k_, v_), p = split(tensors)
        fixed64 = {name: (t.double() if t.is_floating_point() else t) for name, t in fixed.items()}
        return attention_reference(q_, k_, v_, term_of(p, fixed64), **kw)

    def unsupported(engine, tensors):
        (q_, k_, v_), p = split(tensors)
        term = term_of(p, fixed)
        check = {"triton": kernel_unsupported, "tiled": tiled_unsupported, "flex": flex_unsupported}[engine]
        return check(q_, k_, v_, term)

    inputs = [("q", q), ("k", k), ("v", v), *params.items()]
    return Problem(inputs, run, reference, (gout,), unsupported, (q, k, v))


def _padding_mask(shape, device) -> torch.Tensor:
    valid = _key_valid(shape, device)
    n = shape[3]
    return valid[:, None, None, :].expand(shape[0], 1, n, n).contiguous()


def _sba_problem(case: Case, shape, dtype, device, g) -> Problem:
    b, h, _, n, d = shape
    q, k, v, gout = _qkv(shape, dtype, device, g)
    bias = _leaf(torch.randn(h, d, generator=g) * 0.3, device)
    mask = _padding_mask(shape, device)
    window = _window(case, shape)
    scale = d**-0.5

    def run(engine, q_, k_, v_, bias_):
        if engine == "triton":
            from ..kernels.sba.triton_sba import sba_triton

            return sba_triton(q_, k_, v_, mask, scale, 0, False, "bias", bias_, window=window)
        return sba_tiled(q_, k_, v_, mask, scale, 0, False, "bias", bias_, block_m=TILES[0], block_n=TILES[1],
                         window=window)

    def reference(q_, k_, v_, bias_):
        return sba_reference(q_, k_, v_, mask, scale, 0, False, "bias", bias_, window=window)

    def unsupported(engine, tensors):
        if engine == "triton":
            return common_unsupported("sba", "sba.triton_sba", q, k, v, mask, 0, False, 0.0, False)
        return None

    return Problem([("q", q), ("k", k), ("v", v), ("bias", bias)], run, reference, (gout,), unsupported,
                   (q, k, v))


def _cope_problem(case: Case, shape, dtype, device, g) -> Problem:
    b, h, _, n, d = shape
    q, k, v, gout = _qkv(shape, dtype, device, g)
    table = _leaf(torch.randn(d, 16, generator=g) * 0.3, device)
    mask = _padding_mask(shape, device)
    window = _window(case, shape)
    scale = d**-0.5

    def run(engine, q_, k_, v_, table_):
        if engine == "triton":
            from ..kernels.cope.triton_cope import cope_triton

            return cope_triton(q_, k_, v_, table_, mask, scale, 0, window=window)
        return cope_tiled(q_, k_, v_, table_, mask, scale, 0, block_m=TILES[0], block_n=TILES[1], window=window)

    def reference(q_, k_, v_, table_):
        return cope_reference(q_, k_, v_, table_, mask, scale, 0, window=window)

    def unsupported(engine, tensors):
        if engine == "triton":  # float32 on CUDA refused: it broke the CUDA context on an H100
            return cope_triton_unsupported(q, k, v, mask, 0)
        return None

    return Problem([("q", q), ("k", k), ("v", v), ("table", table)], run, reference, (gout,), unsupported,
                   (q, k, v))


def _cape_problem(case: Case, shape, dtype, device, g) -> Problem:
    """CAPE over KERPLE's log bias: the tile-wise engine against ``cape_attention_reference`` with the bias of
    the attention reference's ``term_bias``."""
    b, h, _, n, d = shape
    q, k, v, gout = _qkv(shape, dtype, device, g)
    hidden = 8
    params = {"w1": torch.randn(hidden, 2 * h, generator=g) * 0.3, "b1": torch.randn(hidden, generator=g) * 0.1,
              "w2": torch.randn(h, hidden, generator=g) * 0.3, "b2": torch.randn(h, generator=g) * 0.1,
              "r1": torch.rand(h, generator=g) * 2 + 0.05, "r2": torch.rand(h, generator=g) + 0.05}
    params = {name: _leaf(t, device) for name, t in params.items()}
    causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    mask = _padding_mask(shape, device) & causal
    scale = d**-0.5

    def run(engine, q_, k_, v_, w1, b1, w2, b2, r1, r2):
        return cape_attention_tiled(q_, k_, v_, w1, b1, w2, b2, case.variant, (r1, r2), mask, scale, 0, causal=True,
                                    block_q=TILES[0], block_k=TILES[1])

    def reference(q_, k_, v_, w1, b1, w2, b2, r1, r2):
        bias = term_bias(KernelTerm.kerple_log(r1, r2), None, n, n)
        return cape_attention_reference(q_, k_, v_, bias, w1, b1, w2, b2, mask, scale)[0]

    return Problem([("q", q), ("k", k), ("v", v), *params.items()], run, reference, (gout,),
                   lambda engine, tensors: None, (q, k, v))


def _rotary_problem(case: Case, shape, dtype, device, g) -> Problem:
    """The rotary kernel (q and k in one pass) against ``apply_qk_rotation_reference``; rotations per kv head."""
    b, h, hkv, n, d = shape
    s = int(case.variant)
    q, k, v, gq = _qkv(shape, dtype, device, g)
    gk = torch.randn(b, hkv, n, d, generator=g).to(device=device, dtype=dtype)
    rot = _leaf(torch.randn(1, hkv, n, d // s, s, s, generator=g), device)

    def run(engine, q_, k_, rot_):
        from ..kernels.rotary.triton_rotary import rotary_qk

        return rotary_qk(q_, k_, rot_)

    def reference(q_, k_, rot_):
        return apply_qk_rotation_reference(q_, k_, rot_)

    def unsupported(engine, tensors):
        return rotary_unsupported(q, k, rot)

    return Problem([("q", q), ("k", k), ("rot", rot)], run, reference, (gq, gk), unsupported, (q, k, v))


def _remap_problem(case: Case, shape, dtype, device, g) -> Problem:
    """The remap engine (rope's ``remap``: DCA's three pieces; or a window with its sinks at cache positions) on its
    Triton kernels and its PyTorch calls against the full-matrix oracle (``remap_reference``), rotary over every head
    dim, the last batch row left-padded."""
    from ..kernels.remap import Remap, remap_attention, remap_reference
    from ..kernels.remap.engine import _triton_unsupported

    b, _, _, n, d = shape
    q, k, v, gout = _qkv(shape, dtype, device, g)
    valid = _key_valid(shape, device)
    c = max(2, n // 5)  # DCA's chunks of c = s − w positions: several of them, all three pieces present
    remap = (Remap("dca", 2, chunk=c + 2) if case.variant == "dca"
             else Remap(None, max(2, n // 3), sink=2, sink_positions="cache"))
    pad = (~valid).sum(-1, keepdim=True)
    pos = torch.arange(n, device=device)[None] - pad  # a left-padded row's positions start at its first token
    rotary = d - d % 2
    kw = dict(scale=d**-0.5, pos_q=pos, inv_freq=1.0 / (10000 ** (torch.arange(0, rotary, 2, device=device) / rotary)),
              rotary_dim=rotary, layout="half", key_valid=valid)

    def run(engine, q_, k_, v_):
        return remap_attention(q_, k_, v_, remap, backend="triton" if engine == "triton" else "torch",
                               block=TILES[0], **kw)

    def reference(q_, k_, v_):
        return remap_reference(q_, k_, v_, remap, pos_k=pos, **kw)

    def unsupported(engine, tensors):
        return _triton_unsupported(q, k, v) if engine == "triton" else None

    return Problem([("q", q), ("k", k), ("v", v)], run, reference, (gout,), unsupported, (q, k, v))


def build_problem(case: Case, shape, dtype, device, g) -> Problem:
    """The inputs of ``case`` at ``shape`` (B, H, Hkv, L, D) in ``dtype`` on ``device``, drawn from ``g``."""
    return _BUILDERS[case.family](case, shape, dtype, device, g)


_BUILDERS = {"attention": _attention_problem, "sba": _sba_problem, "cope": _cope_problem, "cape": _cape_problem,
             "rotary": _rotary_problem, "remap": _remap_problem}
