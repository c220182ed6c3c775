"""The tile-wise PyTorch engines of CoPE and stick-breaking attention against the full-matrix references.

``hf_posenc.kernels.{cope,sba}.tiled`` walk key tiles right to left per query block, carrying the reverse
cumulative sums across tiles, and recompute in backward. Here: the forward output and every gradient (q,
k, v, CoPE's position table, SBA's remainder bias) against ``cope_reference`` / ``sba_reference``, by
relative error ||engine - reference|| / ||reference||, with small tiles (block_m = 16, block_n = 24) so that
every query block spans several key tiles and every carry is exercised; odd shapes (L = 77, head_dim = 40),
GQA 4:1 and 2:1, left padding, fewer queries than keys with int and 0-d tensor offsets (never read as a
number), float32 and bfloat16 (reference in float32 on the same rounded inputs), logits of ±1e4. Also: the
saved tensors are O(L·D), never (Lq, Lk); the encodings' default path on CPU is the engine; a model's
gradients through the engine equal those through the reference.

Tolerances: float32 5e-5 (the engines sum in other orders; SBA's P = T - S cancels as in the Triton
kernels), bfloat16 2e-2 (outputs and gradients rounded to bf16).
"""

from __future__ import annotations

import pytest
import torch

from hf_posenc.kernels.cope import cope_reference, cope_tiled
from hf_posenc.kernels.sba import sba_reference, sba_tiled

from conftest import make_ids, make_model

#: (B, H, Hkv, Lq, Lk, D)
SHAPE = (2, 4, 1, 77, 77, 40)
SHAPE_OFFSET = (2, 4, 2, 33, 77, 40)  # query i is key 44 + i
TILES = dict(block_m=16, block_n=24)
TOL = {torch.float32: 5e-5, torch.bfloat16: 2e-2}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def make_qkv(shape, dtype, seed=0, scale=1.0):
    b, h, hkv, lq, lk, d = shape
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, lq, h, d, generator=g) * scale).transpose(1, 2)  # transformers' layout (a view)
    k = torch.randn(b, hkv, lk, d, generator=g) * scale
    v = torch.randn(b, hkv, lk, d, generator=g)
    do = torch.randn(b, h, lq, d, generator=g)
    return [t.to(dtype) for t in (q, k, v, do)]


def padding_mask(shape, pad=6):
    b, _, _, lq, lk, _ = shape
    mask = torch.ones(b, 1, lq, lk, dtype=torch.bool)
    mask[-1, :, :, :pad] = False
    return mask


def compare(engine, reference, tensors, params, do, tol, ref_dtype=torch.float32):
    """Forward + backward of both (the reference in ``ref_dtype`` on the same values); every pair checked."""
    ins = [t.detach().clone().requires_grad_() for t in tensors]
    ps = [p.detach().clone().requires_grad_() for p in params]
    out = engine(*ins, *ps)
    out.backward(do)
    refs = [t.detach().to(ref_dtype).requires_grad_() for t in tensors]
    rps = [p.detach().to(ref_dtype).requires_grad_() for p in params]
    ref = reference(*refs, *rps)
    ref.backward(do.to(ref_dtype))
    assert out.dtype == tensors[0].dtype
    pairs = [("out", out, ref)] + [(n, a.grad, b.grad) for n, a, b in zip("qkv", ins, refs)]
    pairs += [(f"param{i}", a.grad, b.grad) for i, (a, b) in enumerate(zip(ps, rps))]
    for name, got, want in pairs:
        assert got is not None and torch.isfinite(got).all(), name
        err = rel_err(got, want)
        assert err < tol, f"{name}: relative error {err:.2e} >= {tol:.0e}"


# ---------------------------------------------------------------------------------------------- sba


def _sba(mask, offset, attend_current, remainder, scale=0.3):
    def engine(q, k, v, *bias):
        return sba_tiled(q, k, v, mask, scale, offset, attend_current, remainder, bias[0] if bias else None, **TILES)

    def reference(q, k, v, *bias):
        return sba_reference(q, k, v, mask, scale, offset, attend_current, remainder, bias[0] if bias else None)

    return engine, reference


@DTYPES
@pytest.mark.parametrize("remainder,attend_current", [("discard", False), ("current", True), ("bias", False)])
def test_sba_matches_reference(dtype, remainder, attend_current):
    q, k, v, do = make_qkv(SHAPE, dtype)
    params = [torch.randn(4, 40)] if remainder == "bias" else []
    compare(*_sba(None, 0, attend_current, remainder), [q, k, v], params, do, TOL[dtype])


@pytest.mark.parametrize("tensor_offset", [False, True], ids=["int-offset", "tensor-offset"])
@pytest.mark.parametrize("remainder,attend_current", [("current", False), ("bias", True)])
def test_sba_padding_and_offsets(tensor_offset, remainder, attend_current):
    q, k, v, do = make_qkv(SHAPE_OFFSET, torch.float32, seed=1)
    offset = torch.tensor(44) if tensor_offset else 44
    params = [torch.randn(4, 40)] if remainder == "bias" else []
    compare(*_sba(padding_mask(SHAPE_OFFSET), offset, attend_current, remainder), [q, k, v], params, do, 5e-5)


@pytest.mark.parametrize("remainder,attend_current", [("discard", False), ("current", True), ("bias", False)])
def test_sba_walk_stops_where_every_stick_is_exhausted(monkeypatch, remainder, attend_current):
    """Float32 on the CPU: once every row of a query block has broken more than 110 of stick, the walks stop; the
    output and every gradient are bit for bit those of the full walk (what it skips adds exactly 0), the walks do
    stop (fewer tiles), and both equal the reference. Random logits (z = 0.3 q.k, sp of about 1 per key) exhaust
    the sticks within about a hundred keys (L = 200, tiles 16 x 24, GQA 4:1, a padded row)."""
    from hf_posenc.kernels.sba import tiled

    shape = (2, 4, 1, 200, 200, 40)
    q, k, v, do = make_qkv(shape, torch.float32, seed=9)
    params = [torch.randn(4, 40, generator=torch.Generator().manual_seed(2))] if remainder == "bias" else []
    engine, reference = _sba(padding_mask(shape), 0, attend_current, remainder)
    tiles = []
    real_tile = tiled._tile

    def spy(*args):
        tiles.append(1)
        return real_tile(*args)

    monkeypatch.setattr(tiled, "_tile", spy)
    results = {}
    for early in (True, False):
        if not early:
            monkeypatch.setattr(tiled, "_stop_early", lambda q, dtype: False)
        tiles.clear()
        ins = [t.detach().clone().requires_grad_() for t in [q, k, v, *params]]
        out = engine(*ins)
        out.backward(do)
        results[early] = ([out.detach()] + [t.grad for t in ins], len(tiles))
    (stopped, n_stopped), (full, n_full) = results[True], results[False]
    assert n_stopped < n_full
    assert all(torch.equal(a, b) for a, b in zip(stopped, full))
    compare(engine, reference, [q, k, v], params, do, 5e-5)


def test_sba_keys_with_a_common_direction():
    """Keys sharing a mean direction: long sticks and a large T - S cancellation in the backward."""
    q, k, v, do = make_qkv((1, 2, 2, 300, 300, 32), torch.float32, seed=2)
    compare(*_sba(None, 0, False, "discard", scale=32**-0.5), [q, k + 0.7, v], [], do, 5e-5)


@DTYPES
def test_sba_extreme_logits(dtype):
    """Logits of about ±1e4 (queries scaled by 2000): a key takes the whole stick or none of it; finite, and
    equal to the reference (float32: every gradient, against the float64 reference, 2e-4: a float32 logit
    of 1e4 is only known to 1e-3, and the float32 reference itself is 4e-5 off there; bfloat16: the output,
    gradients finite)."""
    q, k, v, do = make_qkv((1, 2, 1, 40, 40, 32), torch.float32, seed=6)
    q, k, v, do = ((q * 2000.0).to(dtype), k.to(dtype), v.to(dtype), do.to(dtype))
    engine, reference = _sba(None, 0, False, "current", scale=32**-0.5)
    if dtype == torch.float32:
        compare(engine, reference, [q, k, v], [], do, 2e-4, ref_dtype=torch.float64)
        return
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    out = engine(*ins)
    out.backward(do)
    assert torch.isfinite(out).all() and all(torch.isfinite(t.grad).all() for t in ins)
    assert rel_err(out, reference(q.float(), k.float(), v.float())) < TOL[dtype]


# --------------------------------------------------------------------------------------------- cope


def _cope(mask, offset, scale=0.3):
    def engine(q, k, v, table):
        return cope_tiled(q, k, v, table, mask, scale, offset, **TILES)

    def reference(q, k, v, table):
        return cope_reference(q, k, v, table, mask, scale, offset)

    return engine, reference


@DTYPES
@pytest.mark.parametrize("npos", [64, 5])
def test_cope_matches_reference(dtype, npos):
    q, k, v, do = make_qkv(SHAPE, dtype)
    table = torch.randn(40, npos, generator=torch.Generator().manual_seed(5)) * 0.5
    compare(*_cope(None, 0), [q, k, v], [table], do, TOL[dtype])


@pytest.mark.parametrize("npos,mask", [(3, "none"), (3, "causal"), (3, "padded"), (200, "none")],
                         ids=["saturating", "saturating-causal-mask", "saturating-padded", "never-saturating"])
def test_cope_saturated_keys_through_the_fused_kernel(monkeypatch, npos, mask):
    """float32 on the CPU: once every row of a query block has counted npos - 1 gates, the keys further left all
    sit at the clamped position, so the engine hands them to torch's fused CPU attention kernel in one call per
    block (forward and backward) instead of walking them, where the mask blocks none of them (none, or a model's
    causal mask; not padding). With 3 positions that happens in every block after the first tile; with 200 never.
    Output and every gradient (the table's included) equal the reference's either way (GQA 4:1, L = 77, tiles
    16 x 24)."""
    from hf_posenc.kernels.cope import tiled

    calls = []
    for name in ("_flash_fwd", "_flash_bwd"):
        real = getattr(tiled, name)

        def spy(*args, _real=real, _name=name, **kw):
            calls.append(_name)
            return _real(*args, **kw)

        monkeypatch.setattr(tiled, name, spy)
    q, k, v, do = make_qkv(SHAPE, torch.float32, seed=3)
    table = torch.randn(40, npos, generator=torch.Generator().manual_seed(4)) * 0.5
    lq = SHAPE[3]
    masks = {"none": None, "causal": torch.ones(lq, lq, dtype=torch.bool).tril()[None, None],
             "padded": padding_mask(SHAPE)}
    compare(*_cope(masks[mask], 0), [q, k, v], [table], do, 5e-5)
    if npos == 3 and mask != "padded":  # blocks 2 .. 5 of 5 have keys left of their first tile
        assert calls.count("_flash_fwd") == calls.count("_flash_bwd") == 4
    else:
        assert not calls


@pytest.mark.parametrize("tensor_offset", [False, True], ids=["int-offset", "tensor-offset"])
def test_cope_padding_and_offsets(tensor_offset):
    q, k, v, do = make_qkv(SHAPE_OFFSET, torch.float32, seed=1)
    offset = torch.tensor(44) if tensor_offset else 44
    table = torch.randn(40, 8, generator=torch.Generator().manual_seed(6)) * 0.5
    compare(*_cope(padding_mask(SHAPE_OFFSET), offset), [q, k, v], [table], do, 5e-5)


def test_cope_decode_one_query():
    q, k, v, do = make_qkv((2, 4, 2, 1, 77, 40), torch.float32, seed=7)
    table = torch.randn(40, 16, generator=torch.Generator().manual_seed(8))
    compare(*_cope(padding_mask((2, 4, 2, 1, 77, 40)), torch.tensor(76)), [q, k, v], [table], do, 5e-5)


@pytest.mark.parametrize("window", [None, 9])
def test_cope_decoding_step_builds_the_row_whole(monkeypatch, window):
    """A decoding step (a few queries, int offset, no gradient) goes to the reference's whole-row form
    (``kernels.cope.FEW_QUERIES``), not the tile walk; with GQA, left padding (a row that sees no key) and a
    window it equals the tile engine. With gradients, or a tensor offset, the tile engine runs."""
    import hf_posenc.kernels.cope as cope_pkg

    monkeypatch.delenv("HF_POSENC_BACKEND", raising=False)
    calls = []
    monkeypatch.setattr(cope_pkg, "cope_reference", lambda *a, **k: calls.append(1) or cope_reference(*a, **k))
    shape = (2, 4, 2, 3, 60, 16)
    q, k, v, _ = make_qkv(shape, torch.float32, seed=9)
    table = torch.randn(16, 12, generator=torch.Generator().manual_seed(3)) * 0.5
    mask = padding_mask(shape)
    mask[1, ..., :] = False  # batch row 1 sees no key at all
    with torch.no_grad():
        got = cope_pkg.cope(q, k, v, table, mask, 0.25, 57, window=window)
        want = cope_tiled(q, k, v, table, mask, 0.25, 57, window=window)
        assert calls == [1]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert not got[1].any()
        cope_pkg.cope(q, k, v, table, mask, 0.25, torch.tensor(57), window=window)
    assert calls == [1]
    cope_pkg.cope(q, k, v, table.requires_grad_(), mask, 0.25, 57, window=window)
    assert calls == [1]


@DTYPES
def test_cope_extreme_logits(dtype):
    """Logits of about ±1e4: gates of exactly 0 or 1, everything finite and the output equal to the
    reference's. (Gradients only finite: with 0/1 gates positions sit on integers, where the interpolation's
    derivative jumps; the engine and the reference take different one-sided values there.)"""
    q, k, v, do = make_qkv((1, 2, 1, 40, 40, 32), torch.float32, seed=11)
    q, k, v, do = ((q * 2000.0).to(dtype), k.to(dtype), v.to(dtype), do.to(dtype))
    table = torch.randn(32, 8, generator=torch.Generator().manual_seed(7)) * 0.5
    ins = [t.detach().clone().requires_grad_() for t in (q, k, v, table)]
    out = cope_tiled(*ins[:3], ins[3], None, 32**-0.5, 0, **TILES)
    out.backward(do)
    assert torch.isfinite(out).all() and all(torch.isfinite(t.grad).all() for t in ins)
    want = cope_reference(q.float(), k.float(), v.float(), table, None, 32**-0.5, 0)
    assert rel_err(out, want) < (1e-4 if dtype == torch.float32 else TOL[dtype])


# ------------------------------------------------------------------------------------- both engines


def test_tensor_offsets_are_never_read_as_numbers(monkeypatch):
    """A 0-d tensor offset (a StaticCache's) goes through forward and backward without int()/item()."""
    q, k, v, do = make_qkv((1, 2, 1, 3, 20, 8), torch.float32)
    offset = torch.tensor(17)
    original = {name: getattr(torch.Tensor, name) for name in ("__int__", "__index__", "item", "tolist", "__bool__")}

    def guard(name):
        def method(self, *args):
            if self.dim() == 0 and self.dtype == torch.int64:
                raise AssertionError(f"a 0-d integer tensor was read with {name}")
            return original[name](self, *args)

        return method

    for name in original:
        monkeypatch.setattr(torch.Tensor, name, guard(name))
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    table = torch.randn(8, 4, requires_grad=True)
    loss = cope_tiled(*ins, table, None, 0.3, offset).sum()
    loss = loss + sba_tiled(*ins, None, 0.3, offset, remainder="current").sum()
    loss.backward()
    monkeypatch.undo()
    assert all(torch.isfinite(t.grad).all() for t in ins)


@pytest.mark.parametrize("engine", ["cope", "sba"])
def test_saved_tensors_are_linear_in_length(engine):
    """What autograd keeps between forward and backward is O(L·D) (inputs, output, row statistics), never
    a (…, Lq, Lk) tensor: everything of that size is recomputed tile by tile in backward."""
    lq = lk = 96
    q, k, v, _ = make_qkv((1, 2, 2, lq, lk, 8), torch.float32)
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if engine == "cope":
            cope_tiled(*ins, torch.randn(8, 16, requires_grad=True), None, 0.3, 0)
        else:
            sba_tiled(*ins, None, 0.3, 0)
    assert sizes and max(sizes) <= 2 * lq * 8, sizes  # (1, 2, L, 8) tensors; a (1, 2, L, L) one is 12x that


def test_block_sizes_are_validated():
    q, k, v, _ = make_qkv((1, 2, 1, 5, 5, 8), torch.float32)
    with pytest.raises(ValueError, match="block_m and block_n"):
        sba_tiled(q, k, v, None, 0.3, 0, block_m=0)
    with pytest.raises(ValueError, match="block_m and block_n"):
        cope_tiled(q, k, v, torch.zeros(8, 4), None, 0.3, 0, block_n=0)


@pytest.mark.parametrize("encoding,params", [("cope", {"npos_max": 8}), ("sba", {"remainder": "bias"})])
def test_model_gradients_engine_equal_reference(encoding, params):
    """A patched Llama on the CPU: loss and every parameter gradient through the engine (the default) equal
    those through the reference (which ``output_attentions`` selects), left padding included."""
    model = make_model("llama", encoding=encoding, **params)
    with torch.no_grad():  # non-trivial encoding parameters (CoPE's table, SBA's remainder vectors)
        for name, p in model.named_parameters():
            if "posenc" in name or "pos_emb" in name or "remainder_bias" in name:
                p.normal_(0.0, 0.5)
    ids = make_ids(2, 12)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    grads = []
    for weights in (False, True):
        model.zero_grad()
        out = model(ids, attention_mask=mask, labels=ids, output_attentions=weights)
        out.loss.backward()
        named = model.named_parameters()
        grads.append((out.loss.detach(), {n: p.grad.clone() for n, p in named if p.grad is not None}))
    (loss_e, g_e), (loss_r, g_r) = grads
    torch.testing.assert_close(loss_e, loss_r, rtol=1e-5, atol=1e-6)
    assert g_e.keys() == g_r.keys() and any("pos_emb" in n or "remainder_bias" in n for n in g_e)
    for name in g_e:
        assert rel_err(g_e[name], g_r[name]) < 5e-5, name


@pytest.mark.parametrize("encoding", ["cope", "sba"])
def test_memory_precheck_only_where_the_reference_runs(monkeypatch, encoding):
    """The O(L^2) pre-check (hf_posenc.memory) does not refuse the tile-wise engine; it still guards the
    reference, which output_attentions selects."""
    from hf_posenc.memory import ReferenceMemoryError

    model = make_model("llama", encoding=encoding)
    monkeypatch.setenv("HF_POSENC_MEMORY_BUDGET", "1MiB")
    ids = make_ids(1, 1700)  # the reference estimate must pass the pre-check floor of 256 MiB
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
        with pytest.raises(ReferenceMemoryError, match=f"{encoding}: the PyTorch reference"):
            model(ids, output_attentions=True)
