"""Sliding windows in the attention engines and kernels (issue 22), against the references with a band mask.

Query i is key qi = q_offset + i. Causal: key j is visible iff qi − window < j <= qi (transformers'
``sliding_window``); bidirectional: iff |qi − j| < window. The references (``attention_reference``,
``cope_reference``, ``sba_reference``) apply the band as a mask; for CoPE and stick-breaking a key outside the
band is absent exactly as a masked key is (no weight, no gate, no break). Every engine is compared with them,
forward and every gradient, by relative error; window 1 (each query sees only itself: every gradient that enters
through the logits is zero, compared at the dtype's rounding, ``ZERO_GRAD_EPS``), a window at least as long as the keys (bit for bit the result
without a window), a query chunk after a cache with an int and a 0-d tensor offset, GQA, left padding.
"Skipped" is tested by poisoning: keys left of every window hold NaN, and a result that read them would be
NaN. The Triton kernels run in Triton's interpreter (tests/conftest.py sets ``TRITON_INTERPRET=1``) on tiny
shapes.
"""

from __future__ import annotations

import pytest
import torch

from hf_posenc.kernels.attention import TILED_KINDS, attention_reference, flex_attention_term, tiled_attention
from hf_posenc.kernels.cope import cope, cope_reference, cope_tiled
from hf_posenc.kernels.sba import sba_reference, sba_tiled, stick_breaking

from conftest import tiered
from test_kernel_attention import _TRITON_MISSING, SHAPE, SHAPE_CHUNK, make_inputs, make_term, rel_err, triton_attention

TOL = {torch.float64: 1e-10, torch.float32: 2e-5}
TOL_TERM = {torch.float64: 1e-9, torch.float32: 1e-4}


def _grads(fn, tensors, leaves, gout, **kw):
    xs = [x.detach().requires_grad_() for x in tensors]
    out = fn(*xs, **kw)
    return out, list(torch.autograd.grad(out, [*xs, *leaves], gout, allow_unused=True))


#: A gradient that is zero in exact arithmetic (window 1: one visible key, d(softmax)/d(logit) = 0) may be this many
#: units of rounding (the dtype's eps) times the size of the values it is a difference of (the largest reference
#: dv, at least 1). Measured at most 14 (FIRE's table and the interpreted CoPE kernel in float32).
ZERO_GRAD_EPS = 64


def _assert_close(out, grads, ref, ref_grads, dtype, window, names, what):
    assert torch.isfinite(out).all(), what
    errors = {"out": rel_err(out, ref)}
    scale = max(1.0, dict(zip(names, ref_grads))["dv"].abs().max().item())
    for name, got, want in zip(names, grads, ref_grads):
        if want is None:
            continue
        rounding = ZERO_GRAD_EPS * torch.finfo(got.dtype).eps * scale
        if window == 1 and want.abs().max().item() <= rounding:  # zero but for rounding: so must the engine's be
            biggest = got.abs().max().item()
            assert biggest <= rounding, f"{what}: {name} must be 0 (window 1), is {biggest:.2e} > {rounding:.1e}"
        else:
            errors[name] = rel_err(got, want)
    for name, err in errors.items():
        limit = TOL_TERM[dtype] if name.startswith("term") else TOL[dtype] * (1 if name == "out" else 2)
        assert err <= limit, f"{what}: {name} error {err:.2e} > {limit:.0e} ({errors})"


# -- the attention family: tile-wise engine ----------------------------------------------------------------


def _attention_case(fn, kind, shape, causal, window, tensor_offset=False, dtype=torch.float32, **extra):
    *_, lq, lk, d = shape
    q_offset = lk - lq
    q, k, v, gout, valid, g = make_inputs(shape, dtype, 1, True, device="cpu")
    term, leaves = make_term(kind, shape, q_offset, g, device="cpu")
    kw = dict(scale=d**-0.5, causal=causal, key_valid=valid, window=window)
    off = torch.tensor(q_offset) if tensor_offset else q_offset
    out, grads = _grads(lambda *x: fn(*x, term, q_offset=off, **kw, **extra), (q, k, v), leaves, gout)
    ref, ref_grads = _grads(lambda *x: attention_reference(*x, term, q_offset=q_offset, **kw), (q, k, v), leaves,
                            gout)
    names = ["dq", "dk", "dv"] + [f"term{i}" for i in range(len(leaves))]
    _assert_close(out, grads, ref, ref_grads, dtype, window, names,
                  f"{kind} causal={causal} window={window} offset={'tensor' if tensor_offset else 'int'}")
    return out


@pytest.mark.parametrize("kind", TILED_KINDS)
def test_tiled_chunk_after_cache(kind):
    # 21 queries at keys 56..76, window 8, tiles of 8 keys: the first key tiles are never built
    _attention_case(tiled_attention, kind, SHAPE_CHUNK, True, 8, block_q=8, block_k=8)


@pytest.mark.parametrize("kind,causal,window,tensor_offset", [
    ("none", True, 5, False), ("alibi", True, 1, False), ("fox", True, 13, True), ("shaw", True, 5, False),
    ("t5", False, 4, False), ("fire", False, 1, False), ("kerple_pow", False, 9, True), ("sandwich", True, 3, True),
])
def test_tiled_prefill(kind, causal, window, tensor_offset):
    _attention_case(tiled_attention, kind, SHAPE, causal, window, tensor_offset, block_q=16, block_k=8)


@pytest.mark.parametrize("causal", [True, False])
def test_tiled_float64_online_softmax(causal):
    # float64 runs the online-softmax path (the fused CPU kernel takes float32 only)
    _attention_case(tiled_attention, "alibi", SHAPE_CHUNK, causal, 6, dtype=torch.float64, block_q=8, block_k=8)


@pytest.mark.parametrize("sink", [None, 3])
@pytest.mark.parametrize("causal", [True, False])
def test_tiled_window_past_the_keys_is_no_window(causal, sink):
    q, k, v, _, valid, g = make_inputs(SHAPE, torch.float32, 2, True, device="cpu")
    term, _ = make_term("fox", SHAPE, 0, g, device="cpu")
    kw = dict(scale=0.2, causal=causal, key_valid=valid, block_q=16, block_k=8)
    with torch.no_grad():
        full = tiled_attention(q, k, v, term, **kw)
        windowed = tiled_attention(q, k, v, term, window=SHAPE[4], sink=sink, **kw)
        narrow = tiled_attention(q, k, v, term, window=4, sink=sink, **kw)
    assert torch.equal(full, windowed)
    assert not torch.allclose(full, narrow)


def _poisoned(shape, first_visible, dtype=torch.float32):
    """q, k, v with keys [0, first_visible) of k and v NaN (left of every window), and clean copies."""
    b, h, hkv, lq, lk, d = shape
    g = torch.Generator().manual_seed(3)
    q = torch.randn(b, h, lq, d, generator=g, dtype=dtype)
    k = torch.randn(b, hkv, lk, d, generator=g, dtype=dtype)
    v = torch.randn(b, hkv, lk, d, generator=g, dtype=dtype)
    kp, vp = k.clone(), v.clone()
    kp[:, :, :first_visible] = float("nan")
    vp[:, :, :first_visible] = float("nan")
    return q, k, v, kp, vp


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_tiled_skips_the_key_tiles_left_of_the_window(dtype):
    # 8 queries at keys 24..31, window 3: the first query sees keys from 22; keys 0..19 are never read
    shape = (1, 2, 1, 8, 32, 8)
    q, k, v, kp, vp = _poisoned(shape, 20, dtype)
    term = make_term("none", shape, 24, torch.Generator(), device="cpu")[0]
    kw = dict(scale=0.3, causal=True, q_offset=24, window=3)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, kp, vp))
    out = tiled_attention(qg, kg, vg, term, block_q=4, block_k=4, **kw)
    out.backward(torch.ones_like(out))
    ref = attention_reference(q, k, v, term, **kw)
    assert torch.isfinite(out).all() and torch.isfinite(qg.grad).all()
    assert rel_err(out, ref) < TOL[dtype]
    assert (kg.grad[:, :, :20] == 0).all() and (vg.grad[:, :, :20] == 0).all()


def test_flex_folds_the_window_into_the_block_mask():
    shape = (2, 4, 2, 21, 40, 16)
    q, k, v, _, valid, g = make_inputs(shape, torch.float32, 4, True, device="cpu")
    term, _ = make_term("alibi", shape, 19, g, device="cpu")
    for causal, window in ((True, 6), (False, 3)):
        kw = dict(scale=0.25, causal=causal, q_offset=19, key_valid=valid, window=window)
        with torch.no_grad():
            out = flex_attention_term(q, k, v, term, **kw)
            ref = attention_reference(q, k, v, term, **kw)
            full = attention_reference(q, k, v, term, **{**kw, "window": None})
        assert rel_err(out, ref) < 1e-5
        assert rel_err(full, ref) > 1e-2


BAD_WINDOWS = [(0, ValueError), (-3, ValueError), (2.0, TypeError), (True, TypeError), ("8", TypeError)]


@pytest.mark.parametrize("window,error", BAD_WINDOWS)
def test_bad_windows_are_refused(window, error):
    shape = (1, 2, 1, 4, 4, 8)
    q, k, v, _, _, g = make_inputs(shape, torch.float32, 0, False, device="cpu")
    term = make_term("none", shape, 0, g, device="cpu")[0]
    table = torch.randn(8, 4)
    calls = [
        lambda: attention_reference(q, k, v, term, scale=1.0, causal=True, window=window),
        lambda: tiled_attention(q, k, v, term, scale=1.0, causal=True, window=window),
        lambda: flex_attention_term(q, k, v, term, scale=1.0, causal=True, window=window),
        lambda: cope_tiled(q, k, v, table, None, 1.0, window=window),
        lambda: cope_reference(q, k, v, table, None, 1.0, window=window),
        lambda: cope(q, k, v, table, None, 1.0, window=window),
        lambda: sba_tiled(q, k, v, None, 1.0, window=window),
        lambda: sba_reference(q, k, v, None, 1.0, 0, window=window),
        lambda: stick_breaking(q, k, v, None, 1.0, window=window),
    ]
    if triton_attention is not None:
        from hf_posenc.kernels.cope.triton_cope import cope_triton
        from hf_posenc.kernels.sba.triton_sba import sba_triton

        calls += [
            lambda: triton_attention.fused_attention(q, k, v, term, scale=1.0, causal=True, window=window),
            lambda: cope_triton(q, k, v, table, None, 1.0, 0, window=window),
            lambda: sba_triton(q, k, v, None, 1.0, 0, window=window),
        ]
    for call in calls:
        with pytest.raises(error, match="window"):
            call()


# -- CoPE and stick-breaking: tile-wise engines ------------------------------------------------------------


def _cope_sba_inputs(shape, seed, dtype, padding):
    b, h, hkv, lq, lk, d = shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, lq, d, generator=g, dtype=dtype)
    k = torch.randn(b, hkv, lk, d, generator=g, dtype=dtype)
    v = torch.randn(b, hkv, lk, d, generator=g, dtype=dtype)
    gout = torch.randn(b, h, lq, d, generator=g, dtype=dtype)
    mask = None
    if padding:
        mask = torch.ones(b, 1, lq, lk, dtype=torch.bool)
        mask[-1, :, :, :3] = False
    return q, k, v, gout, mask, g


# (B, H, Hkv, Lq, Lk, D), q_offset = Lk - Lq
COPE_SBA_CASES = [
    ((2, 4, 2, 19, 19, 8), 4, False, True),  # prefill, GQA, padding
    ((1, 2, 1, 19, 19, 8), 1, False, False),  # window 1
    ((2, 2, 1, 7, 30, 8), 5, False, True),  # a chunk after a cache (int offset)
    ((2, 2, 1, 7, 30, 8), 5, True, True),  # the same with a 0-d tensor offset
    ((1, 4, 2, 3, 30, 8), 30, True, False),  # decode, window = Lk
]


@pytest.mark.parametrize("shape,window,tensor_offset,padding", COPE_SBA_CASES)
def test_cope_tiled_window(shape, window, tensor_offset, padding):
    q, k, v, gout, mask, g = _cope_sba_inputs(shape, 5, torch.float64, padding)
    table = torch.randn(shape[-1], 6, generator=g, dtype=torch.float64).requires_grad_()
    off = shape[4] - shape[3]
    o = torch.tensor(off) if tensor_offset else off
    out, grads = _grads(lambda *x: cope_tiled(*x, table, mask, 0.4, o, block_m=4, block_n=3, window=window),
                        (q, k, v), [table], gout)
    ref, ref_grads = _grads(lambda *x: cope_reference(*x, table, mask, 0.4, off, window=window), (q, k, v),
                            [table], gout)
    _assert_close(out, grads, ref, ref_grads, torch.float64, window, ["dq", "dk", "dv", "term0"], f"cope w={window}")


@pytest.mark.parametrize("attend_current,remainder", [(False, "discard"), (True, "current"), (False, "bias")])
@pytest.mark.parametrize("shape,window,tensor_offset,padding", COPE_SBA_CASES)
def test_sba_tiled_window(shape, window, tensor_offset, padding, attend_current, remainder):
    q, k, v, gout, mask, g = _cope_sba_inputs(shape, 6, torch.float64, padding)
    bias = torch.randn(shape[1], shape[-1], generator=g, dtype=torch.float64).requires_grad_()
    bias = bias if remainder == "bias" else None
    leaves = [bias] if bias is not None else []
    off = shape[4] - shape[3]
    o = torch.tensor(off) if tensor_offset else off
    out, grads = _grads(lambda *x: sba_tiled(*x, mask, 0.4, o, attend_current, remainder, bias, block_m=4,
                                             block_n=3, window=window), (q, k, v), leaves, gout)
    ref, ref_grads = _grads(lambda *x: sba_reference(*x, mask, 0.4, off, attend_current, remainder, bias,
                                                     window=window), (q, k, v), leaves, gout)
    _assert_close(out, grads, ref, ref_grads, torch.float64, window, ["dq", "dk", "dv", "term0"],
                  f"sba w={window} {attend_current} {remainder}")


@pytest.mark.parametrize("sink", [None, 2])
def test_cope_sba_window_removes_keys_like_a_mask(sink):
    # the window is the mask that removes the keys qi - j >= window (but the sinks j < sink): same result, mask or
    # window
    shape = (1, 2, 1, 12, 12, 8)
    q, k, v, _, _, g = _cope_sba_inputs(shape, 7, torch.float64, False)
    table = torch.randn(8, 5, generator=g, dtype=torch.float64)
    i = torch.arange(12)
    band = (((i[:, None] - i[None, :]) < 4) | (i[None, :] < (sink or 0)))[None, None]
    with torch.no_grad():
        assert torch.allclose(cope_tiled(q, k, v, table, None, 0.5, window=4, sink=sink),
                              cope_tiled(q, k, v, table, band, 0.5))
        assert torch.allclose(sba_tiled(q, k, v, None, 0.5, 0, True, "current", window=4, sink=sink),
                              sba_tiled(q, k, v, band, 0.5, 0, True, "current"))
        assert torch.equal(sba_tiled(q, k, v, None, 0.5, window=12), sba_tiled(q, k, v, None, 0.5))
        assert torch.equal(cope_tiled(q, k, v, table, None, 0.5, window=12), cope_tiled(q, k, v, table, None, 0.5))
        # the dispatchers pass the window on (the tile-wise engines on the CPU)
        assert rel_err(cope(q, k, v, table, None, 0.5, window=4, sink=sink),
                       cope_reference(q, k, v, table, band, 0.5)) < 1e-12
        assert rel_err(stick_breaking(q, k, v, None, 0.5, window=4, sink=sink),
                       sba_reference(q, k, v, band, 0.5, 0)) < 1e-12


def test_cope_sba_tiled_skip_the_tiles_left_of_the_window():
    shape = (1, 2, 1, 8, 32, 8)  # queries at keys 24..31, window 3: keys 0..19 are never read
    q, k, v, kp, vp = _poisoned(shape, 20, torch.float64)
    table = torch.randn(8, 5, dtype=torch.float64)
    for run, ref in (
        (lambda *x: cope_tiled(*x, table, None, 0.5, 24, block_m=4, block_n=4, window=3),
         lambda *x: cope_reference(*x, table, None, 0.5, 24, window=3)),
        (lambda *x: sba_tiled(*x, None, 0.5, 24, False, "current", block_m=4, block_n=4, window=3),
         lambda *x: sba_reference(*x, None, 0.5, 24, False, "current", window=3)),
    ):
        qg, kg, vg = (x.clone().requires_grad_() for x in (q, kp, vp))
        out = run(qg, kg, vg)
        out.backward(torch.ones_like(out))
        assert torch.isfinite(out).all() and torch.isfinite(qg.grad).all()
        assert rel_err(out, ref(q, k, v)) < 1e-12
        assert (kg.grad[:, :, :20] == 0).all() and (vg.grad[:, :, :20] == 0).all()


# -- Triton kernels (interpreter) ----------------------------------------------------------------------------


@pytest.fixture
def interpreted():
    if _TRITON_MISSING is not None:
        pytest.skip(_TRITON_MISSING)
    if not torch.cuda.is_available() and not (
        triton_attention.interpreting() and triton_attention.stdlib_matches_mode()
    ):
        pytest.skip("TRITON_INTERPRET=1 was not set before triton was imported (see tests/conftest.py)")


@pytest.mark.parametrize("kind,causal,window,tensor_offset", tiered([
    ("fox", True, 8, False), ("shaw", True, 1, True), ("t5", False, 5, False), ("kerple_log", True, 100, False),
], fast=[("shaw", True, 1, True)]))
def test_fused_attention_window(interpreted, kind, causal, window, tensor_offset):
    _attention_case(triton_attention.fused_attention, kind, SHAPE_CHUNK, causal, window, tensor_offset)


@pytest.mark.parametrize("causal", [True, False])
def test_fused_attention_skips_the_tiles_outside_the_window(interpreted, causal):
    # 16 queries at keys 134..149, window 8 (interpreter tiles: 64): keys 0..63 are in no query tile's range
    shape = (1, 2, 1, 16, 150, 16)
    q, k, v, kp, vp = _poisoned(shape, 64)
    term = make_term("alibi", shape, 134, torch.Generator(), device="cpu")[0]
    kw = dict(scale=0.3, causal=causal, q_offset=134, window=8)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, kp, vp))
    out = triton_attention.fused_attention(qg, kg, vg, term, **kw)
    out.backward(torch.ones_like(out))
    assert torch.isfinite(out).all() and torch.isfinite(qg.grad).all()
    assert rel_err(out, attention_reference(q, k, v, term, **kw)) < 2e-5
    assert (kg.grad[:, :, :64] == 0).all() and (vg.grad[:, :, :64] == 0).all()


@pytest.mark.parametrize("family", ["cope", "sba"])
@pytest.mark.parametrize("shape,window,tensor_offset", [
    ((1, 2, 1, 70, 70, 16), 5, False),  # 3 query blocks of 32: the last skips key tile 0
    ((1, 2, 1, 9, 79, 16), 1, True),  # decode chunk, tensor offset
])
def test_cope_sba_triton_window(interpreted, monkeypatch, family, shape, window, tensor_offset):
    from hf_posenc.kernels.cope import triton_cope
    from hf_posenc.kernels.sba import triton_sba

    module = triton_cope if family == "cope" else triton_sba
    monkeypatch.setattr(module, "CARRY_SLOTS", 1)  # checkpoints every other tile: the key-major carry replay runs
    check_cope_sba_triton(family, shape, window, tensor_offset)


def check_cope_sba_triton(family, shape, window, tensor_offset, sink=None):
    """CoPE's or SBA's Triton kernel (interpreter, float32, padded rows) against its reference with a window (and
    ``sink`` sinks), forward and every gradient (q, k, v, CoPE's table)."""
    from hf_posenc.kernels.cope import triton_cope
    from hf_posenc.kernels.sba import triton_sba

    q, k, v, gout, mask, g = _cope_sba_inputs(shape, 8, torch.float32, True)
    off = shape[4] - shape[3]
    o = torch.tensor(off) if tensor_offset else off
    kw = dict(window=window, sink=sink)
    if family == "cope":
        table = torch.randn(shape[-1], 6, generator=g).requires_grad_()
        leaves = [table]
        run = lambda *x: triton_cope.cope_triton(*x, table, mask, 0.4, o, **kw)  # noqa: E731
        ref = lambda *x: cope_reference(*x, table, mask, 0.4, off, **kw)  # noqa: E731
    else:
        leaves = []
        run = lambda *x: triton_sba.sba_triton(*x, mask, 0.4, o, True, "current", **kw)  # noqa: E731
        ref = lambda *x: sba_reference(*x, mask, 0.4, off, True, "current", **kw)  # noqa: E731
    out, grads = _grads(run, (q, k, v), leaves, gout)
    want, want_grads = _grads(ref, (q, k, v), leaves, gout)
    where = f"{family} triton w={window}" + (f" sink={sink}" if sink is not None else "")
    _assert_close(out, grads, want, want_grads, torch.float32, window, ["dq", "dk", "dv", "term0"], where)


@pytest.mark.parametrize("family", ["cope", "sba"])
def test_cope_sba_triton_skip_the_tiles_left_of_the_window(interpreted, family):
    from hf_posenc.kernels.cope.triton_cope import cope_triton
    from hf_posenc.kernels.sba.triton_sba import sba_triton

    shape = (1, 2, 1, 8, 80, 16)  # queries at keys 72..79, window 5 (tiles of 32): keys 0..63 never read
    q, k, v, kp, vp = _poisoned(shape, 64)
    table = torch.randn(16, 5)
    if family == "cope":
        run = lambda *x: cope_triton(*x, table, None, 0.5, 72, window=5)  # noqa: E731
        ref = cope_reference(q, k, v, table, None, 0.5, 72, window=5)
    else:
        run = lambda *x: sba_triton(*x, None, 0.5, 72, False, "discard", window=5)  # noqa: E731
        ref = sba_reference(q, k, v, None, 0.5, 72, False, "discard", window=5)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, kp, vp))
    out = run(qg, kg, vg)
    out.backward(torch.ones_like(out))
    assert torch.isfinite(out).all() and torch.isfinite(qg.grad).all()
    assert rel_err(out, ref) < 1e-5
    assert (kg.grad[:, :, :64] == 0).all() and (vg.grad[:, :, :64] == 0).all()


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fused-kernel-tiles", "online-softmax-tiles"])
def test_tiled_builds_only_the_tiles_in_the_band(masked_tiles, causal, dtype):
    """Every tile the engine masks lies inside its query block's band: from the first query's window edge
    (qi − window + 1) to the last query's diagonal (causal) or window edge (bidirectional)."""
    seen = masked_tiles
    shape, window = (1, 2, 2, 64, 64, 8), 5
    q, k, v, _, _, g = make_inputs(shape, dtype, 0, False, device="cpu")
    term, _ = make_term("alibi", shape, 0, g, device="cpu")
    tiled_attention(q, k, v, term, scale=1.0, causal=causal, block_q=16, block_k=8, window=window)
    assert len({q0 for q0, *_ in seen}) == 4
    for q0, n, k0, k1 in seen:
        assert k0 >= q0 - window + 1 and k1 <= (q0 + n if causal else q0 + n - 1 + window)
    if dtype == torch.float64:  # online softmax: tiles of block_k keys from the first query's window edge
        assert all(k1 - k0 <= 8 for *_, k0, k1 in seen)
