"""Hypothesis property tests: every registered encoding, on every family it supports, on randomly drawn
models and inputs.

``tests/test_common.py`` checks the same properties on one fixed tiny model per family (4 heads, GQA 2:1 on
Llama, 10 tokens, one padding pattern, a fixed chunking of the cache). Here hypothesis draws what those tests
hold fixed:

* the model: 1 or 2 layers, 1, 2 or 4 query heads, every GQA ratio the head count allows (Llama), head_dim
  4, 8 or 16; on ViT the patch size, the config's grid and the image's grid (any multiple of the patch);
* the encoding's discrete parameters: every ``choices`` and ``bool`` parameter of its registry schema
  (kerple's variant, comrope's variant, cape's base, sba's remainder, fox's rope, per-layer switches, ...);
* the inputs: batch 1..3, a length per row (the shorter rows left-padded), the token ids, where a cache
  splits the sequence into chunks, DynamicCache or StaticCache, the shift, the dtype.

Each decoder property runs in two regimes. The fast tier's draws lengths up to 12 tokens and the discrete
parameters above. The ``*_across_tiles`` tests (``slow`` tier) draw a longest row just below, at or past the
engines' block and tile sizes (``TILE_EDGES``: the attention function's 128-query blocks, the tile engine's
256-row blocks, SBA's, CoPE's and CAPE's 128-row blocks and 256-key tiles), cache chunks of up to 48 tokens
(past the engines' 16-query decoding path), shifts up to the 1024 positions the models then have, and the
encoding's numeric parameters too (``numeric_params``: its float parameters over a range around their default,
and the sizes of the tables that clip: t5's buckets and distance, shaw's clip, cope's npos_max).

Properties: causality, KV cache == full forward, left-padding invariance, finite outputs and gradients in
float16 and bfloat16, and shift invariance of the position_ids for the encodings whose class claims it
(``PositionEncoding.relative``, set in one place per encoding with the reason beside it).

Examples are bounded and derandomised (the same examples on every run, no example database), so the file
runs in a fixed time.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, Phase, assume, given, settings
from hypothesis import strategies as st
from transformers import DynamicCache, StaticCache

import hf_posenc
from hf_posenc.attention import _QUERY_BLOCK
from hf_posenc.kernels.attention import tiled as attention_tiled
from hf_posenc.kernels.cape import tiled as cape_tiled
from hf_posenc.kernels.cope import tiled as cope_tiled
from hf_posenc.kernels.sba import tiled as sba_tiled
from hf_posenc.registry import get_encoding
from conftest import (
    DECODERS,
    ENCODINGS,
    LONG_INPUT_ATOL,
    LONG_SAME_ATOL,
    MAX_POSITIONS_KEY,
    NUM_LABELS,
    PAD_ID,
    SOAK,
    VOCAB,
    combos,
    make_model,
    positions_from_mask,
    sweep_only,
    with_cache,
)

SAME_ATOL = 1e-5  # the same values computed twice on different batches / with different later tokens
CACHE_ATOL = 1e-4  # cache == full forward (different summation orders)
#: shift invariance, relative to the logits' size, per model dtype (see shift_tolerance)
SHIFT_ATOL = {torch.float32: 1e-4, torch.float64: 1e-11}
#: the fast tier runs each property on one (family, encoding) pair in this many (conftest.combos)
PROPERTY_SHARE = 3
MAX_POSITIONS = 64  # the text models' maximum position (learned's table); lengths + shifts stay below it
#: the block and tile sizes (queries or keys) of the engines that a long row must cross
TILE_EDGES = tuple(sorted({_QUERY_BLOCK, attention_tiled.BLOCK_Q, sba_tiled.BLOCK_M, sba_tiled.BLOCK_N,
                           cope_tiled.BLOCK_M, cope_tiled.BLOCK_N, cape_tiled.BLOCK_Q, cape_tiled.BLOCK_K}))
#: the text models' maximum position in the tile regime (lengths up to TILE_EDGES[-1] + 16, and the shifts)
LONG_POSITIONS = 1024
#: examples per (family, encoding) of each ``*_across_tiles`` test (slow tier)
TILE_EXAMPLES = 3


def bounded(n: int, shrink: bool = True):
    """Hypothesis settings: ``n`` examples, no deadline, the same examples on every run, no database. ``shrink=False``
    reports the first failing example as drawn (the tile regime's: shrinking one of a few hundred tokens runs
    hundreds of forwards)."""
    phases = tuple(Phase) if shrink else (Phase.explicit, Phase.reuse, Phase.generate)
    return settings(
        max_examples=n,
        deadline=None,
        derandomize=True,
        database=None,
        phases=phases,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# ---------------------------------------------------------------------------------------------------
# strategies
# ---------------------------------------------------------------------------------------------------


#: families whose tiny config takes num_key_value_heads (grouped-query attention).
GQA_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3")


@dataclass(frozen=True)
class Arch:
    """A tiny model of one family: its config overrides, and the encoding's parameters."""

    family: str
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    params: tuple[tuple[str, Any], ...]
    seed: int
    patch: int = 8  # ViT
    config_grid: tuple[int, int] = (2, 2)  # ViT: the grid at the config's image size
    max_positions: int = MAX_POSITIONS  # text models

    def overrides(self) -> dict[str, Any]:
        hidden = self.heads * self.head_dim
        if self.family in GQA_FAMILIES:
            extra = {"head_dim": self.head_dim} if self.family in ("qwen3", "gemma3_text") else {}
            if self.family == "gemma3_text":  # a global layer, then a local (windowed) one: a StaticCache with
                # only sliding layers longer than the window cannot hold every key (refused, see patches/decoder.py)
                extra["layer_types"] = ["full_attention", "sliding_attention"][: self.layers]
            return dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=self.layers,
                        num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
                        max_position_embeddings=self.max_positions, **extra)
        if self.family in ("gpt_neox", "bert"):
            return dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=self.layers,
                        num_attention_heads=self.heads, max_position_embeddings=self.max_positions)
        if self.family == "gpt2":
            return dict(n_embd=hidden, n_inner=2 * hidden, n_layer=self.layers, n_head=self.heads,
                        n_positions=self.max_positions)
        rows, cols = self.config_grid
        return dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=self.layers,
                    num_attention_heads=self.heads, patch_size=self.patch,
                    image_size=[rows * self.patch, cols * self.patch])

    def build(self, encoding: str, train: bool = False, dtype: torch.dtype | None = None, head: str = "head"):
        return make_model(self.family, head, seed=self.seed, encoding=encoding, train=train, dtype=dtype,
                          config_overrides=self.overrides(), **dict(self.params))


#: parameters the property tests leave at their defaults, with where they are tested instead: rope's ``remap``
#: (causal text only, and by design not shift-invariant for self_extend and dca) in tests/test_remap.py.
NOT_DRAWN = frozenset({"remap"})


def discrete_params(encoding: str):
    """Every ``choices`` or ``bool`` parameter of the encoding's schema, drawn; the others keep their defaults."""
    fields = {}
    for f in get_encoding(encoding).param_fields():
        meta = f.metadata
        if f.name in NOT_DRAWN:
            continue
        if meta.get("choices"):
            fields[f.name] = st.sampled_from(meta["choices"])
        elif meta["type"] is bool:
            fields[f.name] = st.booleans()
    return st.fixed_dictionaries(fields).map(lambda d: tuple(sorted(d.items())))


#: Float parameters whose default is None (the encoding derives a value), and the range the tile regime draws
#: them from (log-uniform); None stays possible. Other float parameters with a default d > 0 are drawn from
#: [d / 8, 8 d] (log-uniform), within their schema's bounds.
OPTIONAL_FLOAT_RANGES = {"theta": (10.0, 1e6), "base": (2.0, 1e5), "rope_theta": (10.0, 1e6),
                         "position_scale": (0.05, 2.0)}
#: Integer parameters that size a table which clips (t5's buckets, shaw's clip, cope's positions), and the range the
#: tile regime draws them from: clipping below, at and past the lengths drawn. t5's max_distance is drawn above its
#: exact buckets (num_buckets // 2 on causal text, which t5 requires) up to 300.
INT_RANGES = {("t5", "num_buckets"): (2, 64), ("shaw", "max_relative_position"): (1, 300),
              ("cope", "npos_max"): (1, 300)}


def _log_uniform(lo: float, hi: float):
    return st.floats(math.log(lo), math.log(hi)).map(math.exp)


def numeric_params(encoding: str):
    """The tile regime's numeric parameters of ``encoding`` (see OPTIONAL_FLOAT_RANGES and INT_RANGES), drawn; the
    others keep their defaults. Bounds from the registry schema: ``gt`` is kept strictly (a 1e-6 margin)."""
    fields = {}
    for f in get_encoding(encoding).param_fields():
        meta = f.metadata
        if meta.get("choices"):
            continue
        if meta["type"] is float:
            if f.default is not None and f.default > 0:
                lo, hi = f.default / 8, f.default * 8
            elif f.name in OPTIONAL_FLOAT_RANGES:
                lo, hi = OPTIONAL_FLOAT_RANGES[f.name]
            else:
                continue
            if meta.get("gt") is not None:
                lo = max(lo, meta["gt"] * (1 + 1e-6) + 1e-6)
            if meta.get("ge") is not None:
                lo = max(lo, meta["ge"])
            if meta.get("le") is not None:
                hi = min(hi, meta["le"])
            value = _log_uniform(lo, hi)
            fields[f.name] = value if f.default is not None else st.none() | value
        elif meta["type"] is int and (encoding, f.name) in INT_RANGES:
            fields[f.name] = st.integers(*INT_RANGES[(encoding, f.name)])
    drawn = st.fixed_dictionaries(fields)
    if encoding == "t5":
        drawn = drawn.flatmap(lambda d: st.integers(d["num_buckets"] // 2 + 1, 300).map(
            lambda m: d | {"max_distance": m}))
    return drawn.map(lambda d: tuple(sorted(d.items())))


@st.composite
def archs(draw, family: str, encoding: str, long: bool = False) -> Arch:
    """A random tiny model; ``long``: the tile regime's (1024 positions, numeric parameters drawn too)."""
    heads = draw(st.sampled_from([1, 2, 4]))
    kv = draw(st.sampled_from([d for d in (1, 2, 4) if heads % d == 0])) if family in GQA_FAMILIES else heads
    arch = Arch(
        family=family,
        heads=heads,
        kv_heads=kv,
        head_dim=draw(st.sampled_from([4, 8, 16])),  # odd or small head_dim: tests/test_bad_inputs.py
        layers=draw(st.integers(1, 2)),
        params=draw(discrete_params(encoding)),
        seed=draw(st.integers(0, 2**16)),
    )
    if long:
        numeric = draw(numeric_params(encoding), label="numeric params")
        params = dict(arch.params) | {k: v for k, v in numeric if v is not None}
        arch = dataclasses.replace(arch, params=tuple(sorted(params.items())), max_positions=LONG_POSITIONS)
    if family == "vit":
        arch = dataclasses.replace(
            arch,
            patch=draw(st.sampled_from([4, 8])),
            config_grid=(draw(st.integers(1, 3)), draw(st.integers(1, 3))),
        )
    return arch


@dataclass(frozen=True)
class TextBatch:
    """Token ids of a left-padded batch: one length per row, the longest row unpadded."""

    lengths: tuple[int, ...]
    seed: int

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, attention_mask), both (B, L)."""
        length = max(self.lengths)
        g = torch.Generator().manual_seed(self.seed)
        ids = torch.randint(3, VOCAB, (len(self.lengths), length), generator=g)
        mask = torch.zeros_like(ids)
        for row, n in enumerate(self.lengths):
            mask[row, length - n :] = 1
        return ids.masked_fill(mask == 0, PAD_ID), mask


def text_batches(max_len: int = 12, long: bool = False):
    """Left-padded batches of 1 to 3 rows. ``long``: the longest row past an edge of TILE_EDGES by 1 to 16 tokens, or
    anywhere between the first edge and 16 past the last, the others any length up to it."""
    if not long:
        return st.builds(TextBatch, st.lists(st.integers(1, max_len), min_size=1, max_size=3).map(tuple),
                         st.integers(0, 2**16))
    edges = [st.integers(e + 1, e + 16) for e in TILE_EDGES] + [st.integers(TILE_EDGES[0] + 1, TILE_EDGES[-1] + 16)]

    @st.composite
    def rows(draw):
        longest = draw(st.one_of(*edges), label="longest row")
        others = draw(st.lists(st.integers(1, longest), max_size=2), label="other rows")
        order = draw(st.permutations([longest, *others]))
        return tuple(order)

    return st.builds(TextBatch, rows(), st.integers(0, 2**16))


def real_logits(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return logits[mask.bool()]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}"
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def forward(model, ids: torch.Tensor, mask: torch.Tensor, **kw) -> torch.Tensor:
    """Logits of a left-padded batch, with the position_ids ``generate`` computes."""
    pos = kw.pop("position_ids", positions_from_mask(mask))
    return model(ids, attention_mask=mask, position_ids=pos, use_cache=False, **kw).logits


# ---------------------------------------------------------------------------------------------------
# decoders: causality, cache == full forward, left padding, shift invariance
# ---------------------------------------------------------------------------------------------------


#: the (family, encoding) pairs of the ``*_across_tiles`` tests: those of the fast-tier tests (every decoder pair;
#: the later families' pairs outside their subsets are soak), all in the slow tier at least
TILE_PAIRS = combos(DECODERS)


def check_causality(family, encoding, data, long):
    """Changing the tokens after position t (of every row, padded rows too) leaves every logit up to t
    unchanged."""
    arch = data.draw(archs(family, encoding, long), label="arch")
    batch = data.draw(text_batches(long=long), label="batch")
    ids, mask = batch.tensors()
    length = ids.shape[1]
    t = data.draw(st.integers(0, length - 1), label="t")
    changed = ids.clone()
    g = torch.Generator().manual_seed(batch.seed + 1)
    changed[:, t + 1 :] = torch.randint(3, VOCAB, changed[:, t + 1 :].shape, generator=g)
    model = arch.build(encoding)
    with torch.no_grad():
        a = forward(model, ids, mask)
        b = forward(model, changed, mask)
    keep = mask.bool().clone()
    keep[:, t + 1 :] = False
    atol = LONG_INPUT_ATOL.get(encoding, LONG_SAME_ATOL) if long else SAME_ATOL
    assert max_diff(a[keep], b[keep]) < atol, f"logits up to t={t} depend on later tokens"


@pytest.mark.parametrize("family,encoding", combos(DECODERS, fast=PROPERTY_SHARE))
@bounded(8)
@given(data=st.data())
def test_causality(family, encoding, data):
    check_causality(family, encoding, data, long=False)


@pytest.mark.slow
@pytest.mark.parametrize("family,encoding", TILE_PAIRS)
@bounded(TILE_EXAMPLES, shrink=False)
@given(data=st.data())
def test_causality_across_tiles(family, encoding, data):
    check_causality(family, encoding, data, long=True)


def check_cache_matches_full_forward(family, encoding, data, long):
    """The sequence fed through a DynamicCache or StaticCache in random chunks (a prefill of any length, then
    chunks of 1 to 4 tokens, 48 in the tile regime), with the 2D mask and position_ids of ``generate``, gives the
    logits of the full forward on every real token."""
    arch = data.draw(archs(family, encoding, long), label="arch")
    batch = data.draw(text_batches(long=long), label="batch")
    most = 48 if long else 4
    kind = data.draw(st.sampled_from(["dynamic", "static"]), label="cache")
    ids, mask = batch.tensors()
    length = ids.shape[1]
    chunks, start = [], 0
    while start < length:
        n = data.draw(st.integers(1, length - start if not chunks else min(most, length - start)), label="chunk")
        chunks.append(n)
        start += n
    model = arch.build(encoding)
    pos = positions_from_mask(mask)
    with torch.no_grad():
        full = forward(model, ids, mask)
        if kind == "dynamic":
            past = DynamicCache(config=model.config)
        else:
            past = StaticCache(config=model.config, max_cache_len=length + 3)
        pieces, start = [], 0
        for n in chunks:
            out = model(ids[:, start : start + n], attention_mask=mask[:, : start + n],
                        position_ids=pos[:, start : start + n], **with_cache(past), use_cache=True)
            pieces.append(out.logits)
            start += n
    incremental = torch.cat(pieces, dim=1)
    diff = max_diff(real_logits(incremental, mask), real_logits(full, mask))
    assert diff < CACHE_ATOL, f"{kind} cache in chunks {chunks} differs from the full forward by {diff}"


@pytest.mark.parametrize("family,encoding", combos(DECODERS, fast=PROPERTY_SHARE))
@bounded(10)
@given(data=st.data())
def test_cache_matches_full_forward(family, encoding, data):
    check_cache_matches_full_forward(family, encoding, data, long=False)


@pytest.mark.slow
@pytest.mark.parametrize("family,encoding", TILE_PAIRS)
@bounded(TILE_EXAMPLES, shrink=False)
@given(data=st.data())
def test_cache_matches_full_forward_across_tiles(family, encoding, data):
    check_cache_matches_full_forward(family, encoding, data, long=True)


def check_left_padding_invariance(family, encoding, data, long):
    """Every row of a left-padded batch gives, on its real tokens, the logits of the row run alone."""
    arch = data.draw(archs(family, encoding, long), label="arch")
    batch = data.draw(text_batches(long=long), label="batch")
    ids, mask = batch.tensors()
    model = arch.build(encoding)
    with torch.no_grad():
        padded = forward(model, ids, mask)
        for row in range(ids.shape[0]):
            real = mask[row].bool()
            alone = model(ids[row][real][None], use_cache=False).logits[0]
            diff = max_diff(padded[row][real], alone)
            atol = LONG_INPUT_ATOL.get(encoding, LONG_SAME_ATOL) if long else SAME_ATOL
            assert diff < atol, f"row {row} (lengths {batch.lengths}) differs from the row alone by {diff}"


@pytest.mark.parametrize("family,encoding", combos(DECODERS, fast=PROPERTY_SHARE))
@bounded(8)
@given(data=st.data())
def test_left_padding_invariance(family, encoding, data):
    check_left_padding_invariance(family, encoding, data, long=False)


@pytest.mark.slow
@pytest.mark.parametrize("family,encoding", TILE_PAIRS)
@bounded(TILE_EXAMPLES, shrink=False)
@given(data=st.data())
def test_left_padding_invariance_across_tiles(family, encoding, data):
    check_left_padding_invariance(family, encoding, data, long=True)


#: Encodings that claim shift invariance: the class says so, or its instances may (cape: ``relative`` is a property
#: of the instance, true or false with its base).
CLAIMS_RELATIVE = tuple(e for e in ENCODINGS if get_encoding(e).cls.relative is not False)


def shift_tolerance(model, logits: torch.Tensor, reach: float, dtype: torch.dtype) -> float:
    """The bound of shift invariance: ``SHIFT_ATOL[dtype]`` relative to the logits' size, times the reach (the largest
    position over MAX_POSITIONS, past the short regime's) and the encoding's ``angular_rate()`` (radians per position
    of its fastest rotation, at least 1): a rotation angle rounds by its own ulp, so an angle's error, and a
    scaled position's, grows with both (LieRE at position_scale 1.65 in float32: 3.6e-5 at 14 positions, 1.2e-3 at
    266)."""
    rate = hf_posenc.encoding_module(model).angular_rate()
    return SHIFT_ATOL[dtype] * max(1.0, logits.abs().max().item()) * reach * max(1.0, rate)


def check_shift_invariance(family, encoding, data, long, dtype=torch.float32):
    """Encodings whose class claims ``relative``: adding one constant to every position_id (of a padded
    batch too) leaves the logits unchanged. The claim is read from the patched instance (cape's depends on
    its base: a draw without the claim is rejected, so every example checks it; the others are
    test_non_relative_is_not_invariant's)."""
    arch = data.draw(archs(family, encoding, long), label="arch")
    model = arch.build(encoding, dtype=None if dtype == torch.float32 else dtype)
    assume(hf_posenc.encoding_module(model).relative)
    batch = data.draw(text_batches(long=long), label="batch")
    shift = data.draw(st.integers(1, arch.max_positions - 1 - max(batch.lengths)), label="shift")
    ids, mask = batch.tensors()
    pos = positions_from_mask(mask)
    with torch.no_grad():
        a = forward(model, ids, mask, position_ids=pos)
        b = forward(model, ids, mask, position_ids=pos + shift)
    diff = max_diff(real_logits(a, mask), real_logits(b, mask))
    tol = shift_tolerance(model, a, max(1.0, (max(batch.lengths) + shift) / MAX_POSITIONS), dtype)
    assert diff < tol, f"shifting every position by {shift} changed the logits by {diff} (tolerance {tol})"


@pytest.mark.parametrize("family,encoding", combos(DECODERS, CLAIMS_RELATIVE, fast=PROPERTY_SHARE))
@bounded(8)
@given(data=st.data())
def test_shift_invariance(family, encoding, data):
    check_shift_invariance(family, encoding, data, long=False)


@pytest.mark.slow
@pytest.mark.parametrize("family,encoding", combos(DECODERS, CLAIMS_RELATIVE))
@bounded(TILE_EXAMPLES, shrink=False)
@given(data=st.data())
def test_shift_invariance_across_tiles(family, encoding, data):
    check_shift_invariance(family, encoding, data, long=True)


#: the rotary encodings whose positions and angles follow the model's dtype (float64 in a float64 model). rope, rope2d
#: (axial) and xpos compute their angles in float32, as transformers' own rotary does in a float64 model (rope: 8.4e-6
#: on 266 tokens shifted by 300 in float64, 9.4e-6 in float32): float32's bound is theirs.
FLOAT64_ANGLES = ("liere", "comrope")


@pytest.mark.slow
@pytest.mark.parametrize("family,encoding", combos(DECODERS, FLOAT64_ANGLES))
@bounded(TILE_EXAMPLES, shrink=False)
@given(data=st.data())
def test_shift_invariance_in_float64_across_tiles(family, encoding, data):
    """The same in a float64 model, at the tile regime's drawn rates and lengths, with float64's bound: positions
    are scaled in the model's dtype (LieRE scaled float32 positions in a float64 model: 4.1e-3 on the logits of 266
    tokens shifted by 300 at position_scale 1.65; now 0.0)."""
    check_shift_invariance(family, encoding, data, long=True, dtype=torch.float64)


NON_RELATIVE = [
    pytest.param(fam, enc, id=f"{fam}-{enc}", marks=(SOAK,) if sweep_only(fam, enc) else ())
    for fam in DECODERS
    for enc in ENCODINGS
    if not get_encoding(enc).cls.relative and fam in get_encoding(enc).families and enc != "cape"
]


@pytest.mark.parametrize("family,encoding", NON_RELATIVE)
def test_non_relative_is_not_invariant(family, encoding):
    """The converse, so that the claims stay honest: an encoding that does not claim shift invariance does
    see a large shift (3000: far past fire's threshold L = 512; the tables are made large enough)."""
    over = {MAX_POSITIONS_KEY[family]: 4096}
    model = make_model(family, encoding=encoding, config_overrides=over)
    ids = torch.randint(3, VOCAB, (1, 8), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(8)[None]
    with torch.no_grad():
        a = model(ids, position_ids=pos, use_cache=False).logits
        b = model(ids, position_ids=pos + 3000, use_cache=False).logits
    assert max_diff(a, b) > 1e-3, f"{encoding} does not claim shift invariance but a shift of 3000 changed nothing"


# ---------------------------------------------------------------------------------------------------
# every family: finite outputs and gradients in float16 and bfloat16
# ---------------------------------------------------------------------------------------------------


@st.composite
def vit_images(draw, arch: Arch) -> tuple[int, int]:
    """An image size: any multiple of the patch size (1 to 4 patches per side)."""
    return draw(st.integers(1, 4)) * arch.patch, draw(st.integers(1, 4)) * arch.patch


@pytest.mark.parametrize("family,encoding", combos(fast=PROPERTY_SHARE))
@bounded(8)
@given(data=st.data())
def test_finite_in_half_precision(family, encoding, data):
    """In float16 or bfloat16, training mode: finite outputs and loss, and a finite gradient for every
    parameter that gets one (the model's and the encoding's), on random models and (padded / any-size)
    inputs. ``cast_first`` patches a model that is already in that dtype, else the patched model is cast."""
    arch = data.draw(archs(family, encoding), label="arch")
    # Gemma 3 trains in bfloat16 only: in float16 a left-padded row overflows its gradients in the native model
    # too (transformers' SDPA attention, unpatched: a pad query sees no key, its hidden state is zero, and each
    # of Gemma's four RMSNorms per layer (eps 1e-6) multiplies that row's gradient by 1/sqrt(eps) = 1000;
    # measured on transformers 5.24, 1 layer, batch lengths (1, 2)). Google trains Gemma in bfloat16.
    # SBA likewise: a pad query sees no key and gets its remainder (0, or its own value: 0 for a pad token), so
    # the row stays zero through every layer and each RMSNorm multiplies its gradient (the pad position predicts
    # the first real token) by 1000: inf in float16 after a few (Llama, 2 layers, lengths (1, 2): measured;
    # README, Training: float16). The other encodings give such a row some key's value, as SDPA does.
    half = family == "gemma3_text" or encoding == "sba"
    dtypes = [torch.bfloat16] if half else [torch.float16, torch.bfloat16]
    dtype = data.draw(st.sampled_from(dtypes), label="dtype")
    cast_first = data.draw(st.booleans(), label="cast_first")
    if cast_first:
        model = make_model(family, seed=arch.seed, train=True, dtype=dtype, config_overrides=arch.overrides())
        hf_posenc.patch_model(model, encoding, **dict(arch.params))
    else:
        model = arch.build(encoding, train=True, dtype=dtype)
    if family == "vit":
        height, width = data.draw(vit_images(arch), label="image")
        batch = data.draw(st.integers(1, 3), label="batch")
        pixels = torch.randn(batch, 3, height, width, generator=torch.Generator().manual_seed(arch.seed))
        interpolate = encoding == "learned"  # the learned table needs it at other sizes (tested elsewhere)
        out = model(pixel_values=pixels.to(dtype), labels=torch.arange(batch) % NUM_LABELS,
                    interpolate_pos_encoding=interpolate)
    else:
        ids, mask = data.draw(text_batches().filter(lambda b: max(b.lengths) > 1), label="batch").tensors()
        labels = ids.masked_fill(mask == 0, -100)  # at least one token to predict: the longest row has two
        out = model(ids, attention_mask=mask, position_ids=positions_from_mask(mask), labels=labels, use_cache=False)
    assert out.logits.dtype == dtype
    assert torch.isfinite(out.logits).all(), "non-finite outputs"
    assert torch.isfinite(out.loss), f"non-finite loss {out.loss}"
    out.loss.backward()
    bad = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
    assert not bad, f"non-finite gradients in {dtype}: {bad}"
    for name, p in hf_posenc.encoding_module(model).named_parameters():
        assert p.dtype == dtype, f"encoding parameter {name} is {p.dtype}, the model is {dtype}"
