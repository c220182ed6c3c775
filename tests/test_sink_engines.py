"""Attention sinks (``sink=k`` beside a sliding ``window``, issue 44) on every engine, against the references.

Query i is key qi = q_offset + i. Causal: key j is visible iff j <= qi and (qi − window < j or j < sink);
bidirectional: iff |qi − j| < window or j < sink. The references (``attention_reference``, ``cope_reference``,
``sba_reference``) apply that as a mask (``band_allowed``); every engine takes the sink as a number beside the
window, builds no mask, and never reads the key tiles between the sinks and the window: "never read" is tested by
poisoning those keys with NaN. Forward and every gradient (q, k, v and the term's or encoding's own tensors) are
compared by relative error, with odd shapes (L = 77, head_dim 40, GQA), left padding (whose first keys are sink
keys: a batch row whose sinks are all padding), an int and a 0-d tensor offset (StaticCache), decoding steps and
bidirectional attention. Through a model: a Llama patched with window + sink gives the logits of the same model
without a window under an explicit 4D mask (band | sink columns), with the engine (not the mask path) running,
and its cached decoding gives its full forward. The Triton kernels run in Triton's interpreter (tests/conftest.py
sets ``TRITON_INTERPRET=1``) on small shapes.
"""

from __future__ import annotations

import pytest
import torch

import hf_posenc
import hf_posenc.attention as posenc_attention_module
from hf_posenc.kernels._masks import CacheSinks, band_allowed
from hf_posenc.kernels.attention import (
    TILED_KINDS, attention_reference, flex_attention_term, term_bias, tiled_attention,
)
from hf_posenc.kernels.cope import cope, cope_reference, cope_tiled
from hf_posenc.kernels.custom_ops import tiled_attention_op
from hf_posenc.kernels.sba import sba_reference, sba_tiled, stick_breaking

from conftest import make_ids, make_model, tiered
from test_kernel_attention import SHAPE, SHAPE_CHUNK, make_inputs, make_term, rel_err, triton_attention
from test_window_kernels import (  # noqa: F401 (interpreted: a fixture)
    _assert_close,
    _cope_sba_inputs,
    _grads,
    check_cope_sba_triton,
    interpreted,
)

ENGINE_PATHS = ("fused", "online")  # the tile engine's two exact CPU paths (hf_posenc.kernels.autotune)


@pytest.fixture(params=ENGINE_PATHS)
def engine_path(request, monkeypatch):
    """Each exact CPU path of the tile engine in turn (the fused kernel per block, the online passes)."""
    monkeypatch.setenv("HF_POSENC_TUNE_FORCE", f"tiled.engine={request.param}")
    return request.param


def _sink_case(fn, kind, shape, causal, window, sink, tensor_offset=False, dtype=torch.float32, sink_positions=None,
               **extra):
    """``fn`` against the reference with ``window`` and ``sink`` (and ``sink_positions``), forward and every
    gradient; returns (its output, the reference without what is tested: without the sinks, or with them at their
    text positions where ``sink_positions`` is given), for the caller to check that it matters."""
    *_, lq, lk, d = shape
    q_offset = lk - lq
    q, k, v, gout, valid, g = make_inputs(shape, dtype, 1, True, device="cpu")
    q, k, v, gout = (x.to(dtype) for x in (q, k, v, gout))
    term, leaves = make_term(kind, shape, q_offset, g, device="cpu")
    kw = dict(scale=d**-0.5, causal=causal, key_valid=valid, window=window)
    off = torch.tensor(q_offset) if tensor_offset else q_offset
    where = dict(sink=sink, sink_positions=sink_positions)
    out, grads = _grads(lambda *x: fn(*x, term, q_offset=off, **where, **kw, **extra), (q, k, v), leaves, gout)
    ref, ref_grads = _grads(lambda *x: attention_reference(*x, term, q_offset=q_offset, **where, **kw), (q, k, v),
                            leaves, gout)
    names = ["dq", "dk", "dv"] + [f"term{i}" for i in range(len(leaves))]
    _assert_close(out, grads, ref, ref_grads, dtype, window, names,
                  f"{kind} causal={causal} window={window} sink={sink} sink_positions={sink_positions} "
                  f"offset={'tensor' if tensor_offset else 'int'}")
    with torch.no_grad():
        plain = attention_reference(q, k, v, term, q_offset=q_offset, sink=None if sink_positions is None else sink,
                                    **kw)
    return out, plain


# -- the tile engine ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", TILED_KINDS)
def test_tiled_sink_chunk_after_cache(kind, engine_path):
    # 21 queries at keys 56..76, window 6, sinks 0..2, blocks of 8: the sinks' tiles apart, the keys between unread
    out, plain = _sink_case(tiled_attention, kind, SHAPE_CHUNK, True, 6, 3, block_q=8, block_k=8)
    if kind != "fox":  # FoX's gates decay over the ~50 keys to the sinks: their weight is below float32's reach
        assert rel_err(out, plain) > 1e-3


@pytest.mark.parametrize("kind,causal,window,sink,tensor_offset", [
    ("none", True, 9, 4, False), ("alibi", True, 9, 7, True), ("shaw", True, 5, 2, False), ("fox", True, 13, 6, True),
    ("t5", False, 4, 3, False), ("fire", False, 5, 30, False), ("kerple_pow", False, 9, 4, True),
    ("sandwich", True, 1, 1, False), ("shaw", False, 5, 4, True),
])
def test_tiled_sink_prefill(kind, causal, window, sink, tensor_offset, engine_path):
    # L = 77 (blocks of 16 queries, tiles of 8 keys), head_dim 40, 4 query heads on 1 key/value head, batch row 1
    # left-padded by 5 keys (its sinks are padding when sink <= 5)
    _sink_case(tiled_attention, kind, SHAPE, causal, window, sink, tensor_offset, block_q=16, block_k=8)


@pytest.mark.parametrize("causal", [True, False])
def test_tiled_sink_float64(causal):
    _sink_case(tiled_attention, "alibi", SHAPE_CHUNK, causal, 6, 4, dtype=torch.float64, block_q=8, block_k=8)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("padding", [True, False])
def test_tiled_sink_decoding_steps(causal, padding):
    # a few queries without gradients (tiled.FEW_QUERIES: one SDPA call with the band | sink mask)
    shape = (2, 4, 2, 3, 60, 40)
    q, k, v, _, valid, g = make_inputs(shape, torch.float32, 2, padding, device="cpu")
    term, _ = make_term("alibi", shape, 57, g, device="cpu")
    kw = dict(scale=0.2, causal=causal, q_offset=57, key_valid=valid, window=5, sink=4)
    with torch.no_grad():
        out = tiled_attention(q, k, v, term, memo={}, **kw)
        ref = attention_reference(q, k, v, term, **kw)
        plain = attention_reference(q, k, v, term, **{**kw, "sink": None})
    assert rel_err(out, ref) < 2e-6
    assert rel_err(plain, ref) > 1e-3


def _poisoned_gap(shape, lo, hi, dtype=torch.float32):
    """q, k, v and copies of k, v whose keys [lo, hi) (between the sinks and every window) are NaN."""
    b, h, hkv, lq, lk, d = shape
    g = torch.Generator().manual_seed(3)
    q = torch.randn(b, h, lq, d, generator=g, dtype=dtype)
    k = torch.randn(b, hkv, lk, d, generator=g, dtype=dtype)
    v = torch.randn(b, hkv, lk, d, generator=g, dtype=dtype)
    kp, vp = k.clone(), v.clone()
    kp[:, :, lo:hi] = float("nan")
    vp[:, :, lo:hi] = float("nan")
    return q, k, v, kp, vp


def _check_gap_unread(run, ref, q, k, v, kp, vp, lo, hi, sink, tol):
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, kp, vp))
    out = run(qg, kg, vg)
    out.backward(torch.ones_like(out))
    assert torch.isfinite(out).all() and torch.isfinite(qg.grad).all()
    assert rel_err(out, ref(q, k, v)) < tol
    assert (kg.grad[:, :, lo:hi] == 0).all() and (vg.grad[:, :, lo:hi] == 0).all()
    assert (vg.grad[:, :, :sink] != 0).any()  # the sinks are read


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_tiled_never_reads_between_the_sinks_and_the_window(causal, dtype, engine_path):
    # 8 queries at keys 40..47, window 3, sinks 0..3: keys 6..35 lie in no block's range
    shape = (2, 2, 1, 8, 48, 8)
    q, k, v, kp, vp = _poisoned_gap(shape, 6, 36, dtype)
    term = make_term("alibi", shape, 40, torch.Generator(), device="cpu")[0]
    kw = dict(scale=0.3, causal=causal, q_offset=40, window=3, sink=4)
    _check_gap_unread(lambda *x: tiled_attention(*x, term, block_q=4, block_k=4, **kw),
                      lambda *x: attention_reference(*x, term, **kw), q, k, v, kp, vp, 6, 36, 4,
                      2e-5 if dtype == torch.float32 else 1e-12)


def test_tiled_sink_touching_the_window_is_one_range():
    from hf_posenc.kernels.attention._tiles import _Plan

    plan = _Plan("none", (), {}, 1.0, True, 0, 4, 4, window=5, sink=3)
    assert plan.key_ranges(0, 4, 20) == [(0, 4)]  # queries 0..3: every key they see from key 0 on
    assert plan.key_ranges(4, 8, 20) == [(0, 8)]  # the window starts at key 0 .. 3: one range with the sinks
    assert plan.key_ranges(8, 12, 20) == [(0, 3), (4, 12)]  # key 3 is outside every window of the block
    bidir = _Plan("none", (), {}, 1.0, False, 0, 4, 4, window=2, sink=9)
    assert bidir.key_ranges(0, 4, 20) == [(0, 9)]  # the sinks reach past the block's last window edge
    assert bidir.key_ranges(12, 16, 20) == [(0, 9), (11, 17)]


# -- the custom op (torch.compile's engine), FlexAttention --------------------------------------------------


@pytest.mark.parametrize("causal", [True, False])
def test_custom_op_sink(causal):
    _sink_case(lambda *x, **kw: tiled_attention_op(*x, **kw), "kerple_log", SHAPE_CHUNK, causal, 6, 3)


@pytest.mark.parametrize("sink_positions", [None, "cache"])
def test_custom_op_reference_branch_takes_the_sink(sink_positions):
    # a mask that is not causal + key padding (a key hidden from one query only) runs the op's masked reference; with
    # the sinks at their cache positions (tests/test_cache_sinks.py) its bias takes them there too
    shape = (1, 2, 1, 12, 12, 8)
    q, k, v, gout, _, g = make_inputs(shape, torch.float32, 3, False, device="cpu")
    term, leaves = make_term("alibi", shape, 0, g, device="cpu")
    i = torch.arange(12)
    mask = (i[None, :] <= i[:, None])[None, None].clone()
    mask[0, 0, 9, 5] = False
    kw = dict(scale=0.3, causal=True, window=3)
    out, grads = _grads(lambda *x: tiled_attention_op(*x, term, mask=mask, sink=2, sink_positions=sink_positions,
                                                      **kw), (q, k, v), leaves, gout)
    allowed = mask & band_allowed(i, i, True, 3, 2)[None, None]
    cache = None if sink_positions is None else CacheSinks(3, 2)

    def ref(q, k, v):  # softmax under that mask with the window and its sinks in it (one key/value head)
        scores = (q @ k.transpose(-1, -2)) * 0.3 + term_bias(term, q, 12, 12, cache_sinks=cache)
        return torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v

    want, want_grads = _grads(ref, (q, k, v), leaves, gout)
    _assert_close(out, grads, want, want_grads, torch.float32, 3, ["dq", "dk", "dv", "term0"], "masked reference")


def test_flex_folds_the_sinks_into_the_block_mask():
    shape = (2, 4, 2, 21, 40, 16)
    q, k, v, _, valid, g = make_inputs(shape, torch.float32, 4, True, device="cpu")
    term, _ = make_term("alibi", shape, 19, g, device="cpu")
    for causal, window, sink in ((True, 6, 7), (False, 3, 2)):
        kw = dict(scale=0.25, causal=causal, q_offset=19, key_valid=valid, window=window)
        with torch.no_grad():
            out = flex_attention_term(q, k, v, term, sink=sink, **kw)
            ref = attention_reference(q, k, v, term, sink=sink, **kw)
            plain = attention_reference(q, k, v, term, **kw)
        assert rel_err(out, ref) < 1e-5
        assert rel_err(plain, ref) > 1e-2


BAD_SINKS = [(0, 4, ValueError, ">= 1"), (-2, 4, ValueError, ">= 1"), (2.0, 4, TypeError, "int"),
             (True, 4, TypeError, "int"), (3, None, ValueError, "needs a sliding window")]


@pytest.mark.parametrize("sink,window,error,match", BAD_SINKS)
def test_bad_sinks_are_refused(sink, window, error, match):
    shape = (1, 2, 1, 4, 4, 8)
    q, k, v, _, _, g = make_inputs(shape, torch.float32, 0, False, device="cpu")
    term = make_term("none", shape, 0, g, device="cpu")[0]
    table = torch.randn(8, 4)
    kw = dict(window=window, sink=sink)
    calls = [
        lambda: attention_reference(q, k, v, term, scale=1.0, causal=True, **kw),
        lambda: tiled_attention(q, k, v, term, scale=1.0, causal=True, **kw),
        lambda: tiled_attention_op(q, k, v, term, scale=1.0, causal=True, **kw),
        lambda: flex_attention_term(q, k, v, term, scale=1.0, causal=True, **kw),
        lambda: cope_tiled(q, k, v, table, None, 1.0, **kw),
        lambda: cope_reference(q, k, v, table, None, 1.0, **kw),
        lambda: cope(q, k, v, table, None, 1.0, **kw),
        lambda: sba_tiled(q, k, v, None, 1.0, **kw),
        lambda: sba_reference(q, k, v, None, 1.0, 0, **kw),
        lambda: stick_breaking(q, k, v, None, 1.0, **kw),
    ]
    if triton_attention is not None:
        from hf_posenc.kernels.cope.triton_cope import cope_triton
        from hf_posenc.kernels.sba.triton_sba import sba_triton

        calls += [
            lambda: triton_attention.fused_attention(q, k, v, term, scale=1.0, causal=True, **kw),
            lambda: cope_triton(q, k, v, table, None, 1.0, 0, **kw),
            lambda: sba_triton(q, k, v, None, 1.0, 0, **kw),
        ]
    for call in calls:
        with pytest.raises(error, match=match):
            call()


# -- CoPE and stick-breaking: tile engines ----------------------------------------------------------------


# (B, H, Hkv, Lq, Lk, D), window, sink, tensor offset, padding (batch row −1 left-padded by 3 keys)
COPE_SBA_CASES = [
    ((2, 4, 2, 19, 19, 8), 4, 2, False, True),  # prefill, GQA, the sinks of the padded row all padding
    ((2, 4, 2, 40, 40, 8), 6, 7, False, True),  # prefill, a gap for the later blocks
    ((1, 2, 1, 19, 19, 8), 1, 1, False, False),  # window 1, one sink
    ((2, 2, 1, 7, 30, 8), 5, 3, False, True),  # a chunk after a cache (int offset)
    ((2, 2, 1, 7, 30, 8), 5, 3, True, True),  # the same with a 0-d tensor offset
    ((1, 4, 2, 3, 30, 8), 6, 4, False, False),  # decoding steps
]


@pytest.mark.parametrize("shape,window,sink,tensor_offset,padding", COPE_SBA_CASES)
def test_cope_tiled_sink(shape, window, sink, tensor_offset, padding):
    q, k, v, gout, mask, g = _cope_sba_inputs(shape, 5, torch.float64, padding)
    table = torch.randn(shape[-1], 6, generator=g, dtype=torch.float64).requires_grad_()
    off = shape[4] - shape[3]
    o = torch.tensor(off) if tensor_offset else off
    out, grads = _grads(lambda *x: cope_tiled(*x, table, mask, 0.4, o, block_m=4, block_n=3, window=window,
                                              sink=sink), (q, k, v), [table], gout)
    ref, ref_grads = _grads(lambda *x: cope_reference(*x, table, mask, 0.4, off, window=window, sink=sink), (q, k, v),
                            [table], gout)
    _assert_close(out, grads, ref, ref_grads, torch.float64, window, ["dq", "dk", "dv", "term0"],
                  f"cope w={window} sink={sink}")
    with torch.no_grad():
        assert rel_err(cope_reference(q, k, v, table, mask, 0.4, off, window=window), ref) > 1e-3


@pytest.mark.parametrize("attend_current,remainder", [(False, "discard"), (True, "current"), (False, "bias")])
@pytest.mark.parametrize("shape,window,sink,tensor_offset,padding", COPE_SBA_CASES)
def test_sba_tiled_sink(shape, window, sink, tensor_offset, padding, attend_current, remainder):
    q, k, v, gout, mask, g = _cope_sba_inputs(shape, 6, torch.float64, padding)
    bias = torch.randn(shape[1], shape[-1], generator=g, dtype=torch.float64).requires_grad_()
    bias = bias if remainder == "bias" else None
    leaves = [bias] if bias is not None else []
    off = shape[4] - shape[3]
    o = torch.tensor(off) if tensor_offset else off
    out, grads = _grads(lambda *x: sba_tiled(*x, mask, 0.4, o, attend_current, remainder, bias, block_m=4,
                                             block_n=3, window=window, sink=sink), (q, k, v), leaves, gout)
    ref, ref_grads = _grads(lambda *x: sba_reference(*x, mask, 0.4, off, attend_current, remainder, bias,
                                                     window=window, sink=sink), (q, k, v), leaves, gout)
    _assert_close(out, grads, ref, ref_grads, torch.float64, window, ["dq", "dk", "dv", "term0"],
                  f"sba w={window} sink={sink} {attend_current} {remainder}")


def test_cope_sba_tiled_never_read_between_the_sinks_and_the_window():
    shape = (1, 2, 1, 8, 32, 8)  # queries at keys 24..31, window 3, sinks 0..2: keys 4..19 never read
    q, k, v, kp, vp = _poisoned_gap(shape, 4, 20, torch.float64)
    table = torch.randn(8, 5, dtype=torch.float64)
    kw = dict(window=3, sink=3)
    _check_gap_unread(lambda *x: cope_tiled(*x, table, None, 0.5, 24, block_m=4, block_n=4, **kw),
                      lambda *x: cope_reference(*x, table, None, 0.5, 24, **kw), q, k, v, kp, vp, 4, 20, 3, 1e-12)
    _check_gap_unread(lambda *x: sba_tiled(*x, None, 0.5, 24, False, "current", block_m=4, block_n=4, **kw),
                      lambda *x: sba_reference(*x, None, 0.5, 24, False, "current", **kw), q, k, v, kp, vp, 4, 20, 3,
                      1e-12)


def test_cope_sba_dispatchers_pass_the_sink_on():
    shape = (1, 2, 1, 12, 12, 8)
    q, k, v, _, _, g = _cope_sba_inputs(shape, 7, torch.float64, False)
    table = torch.randn(8, 5, generator=g, dtype=torch.float64)
    with torch.no_grad():
        assert rel_err(cope(q, k, v, table, None, 0.5, window=3, sink=2),
                       cope_reference(q, k, v, table, None, 0.5, window=3, sink=2)) < 1e-12
        assert rel_err(stick_breaking(q, k, v, None, 0.5, window=3, sink=2),
                       sba_reference(q, k, v, None, 0.5, 0, window=3, sink=2)) < 1e-12


# -- Triton kernels (interpreter) ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind,causal,window,sink,tensor_offset", tiered([
    ("fox", True, 8, 3, False), ("shaw", True, 1, 2, True), ("t5", False, 5, 4, False), ("alibi", False, 5, 30, True),
    ("kerple_log", True, 6, 5, False), ("fire", True, 9, 2, True),
], fast=[("shaw", True, 1, 2, True)]))
def test_fused_attention_sink(interpreted, kind, causal, window, sink, tensor_offset):
    _sink_case(triton_attention.fused_attention, kind, SHAPE_CHUNK, causal, window, sink, tensor_offset)


@pytest.mark.parametrize("causal", [True, False])
def test_fused_attention_never_reads_between_the_sinks_and_the_window(interpreted, causal):
    # 16 queries at keys 184..199, window 8 (interpreter tiles: 64): tile 1 (keys 64..127) lies in no query tile's
    # range; the sinks 0..4 are in tile 0, walked first
    shape = (2, 2, 1, 16, 200, 16)
    q, k, v, kp, vp = _poisoned_gap(shape, 64, 128)
    term = make_term("alibi", shape, 184, torch.Generator(), device="cpu")[0]
    kw = dict(scale=0.3, causal=causal, q_offset=184, window=8, sink=5)
    _check_gap_unread(lambda *x: triton_attention.fused_attention(*x, term, **kw),
                      lambda *x: attention_reference(*x, term, **kw), q, k, v, kp, vp, 64, 128, 5, 2e-5)


@pytest.mark.parametrize("family", ["cope", "sba"])
@pytest.mark.parametrize("slots", tiered([2, 64], fast=[2]))
@pytest.mark.parametrize("shape,window,sink,tensor_offset", [
    ((1, 2, 1, 130, 130, 16), 5, 3, False),  # 5 query blocks of 32: the last walks tile 3, then tile 0 (gap: 1, 2)
    ((2, 2, 1, 9, 140, 16), 4, 40, True),  # decode chunk, tensor offset, sinks over two tiles
])
def test_cope_sba_triton_sink(interpreted, monkeypatch, family, slots, shape, window, sink, tensor_offset):
    from hf_posenc.kernels.cope import triton_cope
    from hf_posenc.kernels.sba import triton_sba

    module = triton_cope if family == "cope" else triton_sba
    # 2 carry slots: checkpoints every 3rd tile, one of them between the sinks and the window (the query-major
    # kernel stores it, the key-major one restarts from it); 64: every tile a checkpoint
    monkeypatch.setattr(module, "CARRY_SLOTS", slots)
    check_cope_sba_triton(family, shape, window, tensor_offset, sink)


@pytest.mark.parametrize("family", ["cope", "sba"])
def test_cope_sba_triton_never_read_between_the_sinks_and_the_window(interpreted, family):
    from hf_posenc.kernels.cope.triton_cope import cope_triton
    from hf_posenc.kernels.sba.triton_sba import sba_triton

    shape = (1, 2, 1, 8, 112, 16)  # queries at keys 104..111, window 5 (tiles of 32): keys 32..95 never read
    q, k, v, kp, vp = _poisoned_gap(shape, 32, 96)
    table = torch.randn(16, 5)
    kw = dict(window=5, sink=4)
    if family == "cope":
        run = lambda *x: cope_triton(*x, table, None, 0.5, 104, **kw)  # noqa: E731
        ref = lambda *x: cope_reference(*x, table, None, 0.5, 104, **kw)  # noqa: E731
    else:
        run = lambda *x: sba_triton(*x, None, 0.5, 104, False, "discard", **kw)  # noqa: E731
        ref = lambda *x: sba_reference(*x, None, 0.5, 104, False, "discard", **kw)  # noqa: E731
    _check_gap_unread(run, ref, q, k, v, kp, vp, 32, 96, 4, 1e-5)


# -- through a model ---------------------------------------------------------------------------------------------


def _spy(monkeypatch, module, name, calls):
    """Wrap ``module.name`` so that each call records its ``sink`` keyword."""
    inner = getattr(module, name)

    def wrapper(*args, **kwargs):
        calls.append(kwargs.get("sink"))
        return inner(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)


def _engine_spy(monkeypatch, encoding):
    """The calls of the engine ``encoding``'s layers run in a patched Llama on the CPU, and the mask path's."""
    calls, masks = [], []
    if encoding == "cope":
        import hf_posenc.encodings.cope as where

        _spy(monkeypatch, where, "cope_torch", calls)
    elif encoding == "sba":
        import hf_posenc.encodings.sba as where

        _spy(monkeypatch, where, "sba_tiled", calls)
    else:
        _spy(monkeypatch, posenc_attention_module, "tiled_attention", calls)
        inner = posenc_attention_module._windowed_mask
        monkeypatch.setattr(posenc_attention_module, "_windowed_mask",
                            lambda *a, **kw: masks.append(1) or inner(*a, **kw))
    return calls, masks


@pytest.mark.parametrize("encoding", tiered(("alibi", "t5", "fox", "cope", "sba", "shaw", "fire", "kerple"),
                                            fast=("alibi", "fox", "cope", "sba")))
def test_model_sink_matches_a_band_and_sink_mask(monkeypatch, encoding):
    """A Llama with window + sink: the same logits as the model without a window under an explicit 4D mask (query i
    sees keys i − window < j <= i and j < sink), the engine (not the mask path) running with the sink; its cached
    decoding gives its full forward (decoding steps on the engine's few-queries path)."""
    window, sink, length = 3, 2, 20  # 20 queries: past the decoding-step paths (FEW_QUERIES)
    windowed = make_model("llama", encoding={"name": encoding, "window": window, "sink": sink},
                          config_overrides={"num_hidden_layers": 2})
    plain = make_model("llama", encoding=encoding, config_overrides={"num_hidden_layers": 2})
    ids = make_ids(1, length)
    i = torch.arange(length)
    allowed = band_allowed(i, i, True, window, sink)
    mask = torch.zeros(1, 1, length, length).masked_fill(~allowed, torch.finfo(torch.float32).min)
    calls, masks = _engine_spy(monkeypatch, encoding)
    with torch.no_grad():
        want = plain(ids, attention_mask=mask).logits
        calls.clear()
        got = windowed(ids).logits
        assert calls == [sink, sink] and not masks  # both layers on the engine, with the sink; no band mask built
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        nosink = make_model("llama", encoding={"name": encoding, "window": window},
                            config_overrides={"num_hidden_layers": 2})(ids).logits
        assert not torch.allclose(nosink, got, rtol=1e-3, atol=1e-3)  # the sinks matter
        calls.clear()
        out = windowed.generate(ids[:, :17], max_new_tokens=5, do_sample=False, output_logits=True,
                                return_dict_in_generate=True, pad_token_id=0)
        assert calls and all(s == sink for s in calls)  # the prompt (FIRE's decoding steps take its own path)
        full = windowed(out.sequences).logits
    for step, logits in enumerate(out.logits):
        torch.testing.assert_close(logits[0], full[0, 16 + step], rtol=1e-4, atol=1e-4)


def test_model_sink_with_left_padding_and_a_static_cache(monkeypatch):
    """A left-padded batch (the padded row's sinks are padding: the sinks are the first key positions) gives the
    logits of the model without a window under the band | sink mask and the padding; a static cache (a tensor offset
    in the engine) decodes as the dynamic one."""
    encoding = {"name": "alibi", "window": 3, "sink": 2}
    windowed = make_model("llama", encoding=encoding, config_overrides={"num_hidden_layers": 2})
    plain = make_model("llama", encoding="alibi", config_overrides={"num_hidden_layers": 2})
    ids = make_ids(2, 9)
    attn = torch.ones_like(ids)
    attn[1, :3] = 0
    i = torch.arange(9)
    allowed = band_allowed(i, i, True, 3, 2)[None, None] & attn.bool()[:, None, None, :]
    mask = torch.zeros(2, 1, 9, 9).masked_fill(~allowed, torch.finfo(torch.float32).min)
    calls, _ = _engine_spy(monkeypatch, "alibi")
    with torch.no_grad():
        want = plain(ids, attention_mask=mask).logits
        calls.clear()
        got = windowed(ids, attention_mask=attn).logits
    assert calls == [2, 2]
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[1, 3:], want[1, 3:], rtol=1e-4, atol=1e-4)  # the padded queries see no key
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        dynamic = windowed.generate(ids[:1, :6], **kw)
        static = windowed.generate(ids[:1, :6], cache_implementation="static", **kw)
    assert torch.equal(dynamic, static)


def test_sink_survives_save_and_load(tmp_path):
    model = make_model("llama", encoding={"name": "alibi", "window": 3, "sink": 2},
                       config_overrides={"num_hidden_layers": 2})
    model.save_pretrained(tmp_path)
    loaded = hf_posenc.from_pretrained(tmp_path)
    assert loaded.config.position_encoding["sink"] == 2
    ids = make_ids(1, 10)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
