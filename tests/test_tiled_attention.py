"""The tile-wise PyTorch attention engine (``kernels/attention/tiled.py``) against the full-matrix reference,
and the ``torch`` backend's dispatch to it in patched models.

Engine tests compare the forward output and every gradient (q, k, v and the term's learned tensors) with
``attention_reference`` on the inputs of tests/test_kernel_attention.py (L = 77, head_dim = 40, GQA 4:1,
left padding with fully masked query rows), with small blocks so that every path runs: several query
blocks, several key tiles per block (online softmax), the diagonal tile, skipped tiles; float32 and
bfloat16; causal and bidirectional; a chunk of queries after a cache with an int or a 0-d tensor offset.
Model tests: a patched Llama on the engine (the default on the CPU) against the same model on the
references (logits, loss, every parameter's gradient).
"""

from __future__ import annotations

import pytest
import torch

from hf_posenc import attention as attention_module
from hf_posenc.kernels.attention import KERNEL_KINDS, TERM_KINDS, KernelTerm, attention_reference
from hf_posenc.kernels.attention.tiled import TILED_KINDS, tiled_attention
from hf_posenc.kernels._masks import band_allowed

from conftest import make_model
from test_kernel_attention import MODEL_CASES, MODEL_IDS, SHAPE, SHAPE_CHUNK, _kink_free, _padded_batch, make_inputs, make_term, rel_err

TOL = {torch.float64: 2e-5, torch.float32: 2e-5, torch.bfloat16: 2e-2}
TOL_TERM = {torch.float64: 1e-4, torch.float32: 1e-4, torch.bfloat16: 3e-2}
BLOCKS = dict(block_q=16, block_k=24)


def _run(fn, q, k, v, term, leaves, gout, **kw):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v, term, **kw)
    return out, list(torch.autograd.grad(out, [q, k, v, *leaves], gout))


def _check(kind, shape, dtype, causal, q_offset=None, tensor_offset=False, padding=True):
    b, h, hkv, lq, lk, d = shape
    q_offset = lk - lq if q_offset is None else q_offset
    q, k, v, gout, valid, g = make_inputs(shape, dtype, 0, padding, device="cpu")
    term, leaves = make_term(kind, shape, q_offset, g, device="cpu")
    kw = dict(scale=d**-0.5, causal=causal, key_valid=valid)
    off = torch.tensor(q_offset) if tensor_offset else q_offset
    out, grads = _run(tiled_attention, q, k, v, term, leaves, gout, q_offset=off, **kw, **BLOCKS)
    up = (lambda x: x.double()) if dtype == torch.float64 else (lambda x: x.float())
    ref, ref_grads = _run(attention_reference, up(q), up(k), up(v), term, leaves, up(gout),
                          q_offset=q_offset, **kw)
    assert out.dtype == dtype and out.shape == (b, h, lq, d)
    errors = {"out": rel_err(out, ref)}
    for name, got, want in zip(["dq", "dk", "dv"] + [f"term{i}" for i in range(len(leaves))], grads, ref_grads):
        assert got.dtype == want.dtype or name in ("dq", "dk", "dv")
        errors[name] = rel_err(got, want)
    for name, err in errors.items():
        limit = TOL_TERM[dtype] if name.startswith("term") else TOL[dtype] * (1 if name == "out" else 2)
        assert err <= limit, f"{kind} {dtype} causal={causal}: {name} rel err {err:.2e} > {limit:.0e} ({errors})"


def test_engine_covers_every_kernel_kind():
    assert set(TILED_KINDS) == set(TERM_KINDS) and set(KERNEL_KINDS) <= set(TERM_KINDS)


@pytest.mark.parametrize("kind", TILED_KINDS)
def test_engine_matches_reference(kind):
    """Causal, GQA 4:1, left padding (rows that see no key), fp32 and bf16; bidirectional in fp32."""
    _check(kind, SHAPE, torch.float32, causal=True)
    _check(kind, SHAPE, torch.bfloat16, causal=True)
    _check(kind, SHAPE, torch.float32, causal=False)


@pytest.mark.parametrize("kind", ["kerple_log", "t5", "fire", "fox"])
def test_engine_online_softmax_path_float64(kind):
    """float64 inputs take the online softmax over key tiles (no fused kernel), against the reference."""
    _check(kind, SHAPE, torch.float64, causal=True)


@pytest.mark.parametrize("kind", TILED_KINDS)
@pytest.mark.parametrize("tensor_offset", [False, True], ids=["int-offset", "tensor-offset"])
def test_engine_chunk_after_cache(kind, tensor_offset):
    """21 queries after 56 cached keys (Lq < Lk), the offset an int or a 0-d tensor (StaticCache)."""
    _check(kind, SHAPE_CHUNK, torch.float32, causal=True, tensor_offset=tensor_offset)


@pytest.mark.parametrize("kind", TILED_KINDS)
def test_engine_unpadded_split_at_the_diagonal(kind):
    """No padding, an int offset: the blocks split at their diagonal square (``_block_parts``). A full sequence
    in float32 and bfloat16, a 21-query chunk after 56 cached keys, and one decoded query after 76: output and
    every gradient against the reference."""
    _check(kind, SHAPE, torch.float32, causal=True, padding=False)
    _check(kind, SHAPE, torch.bfloat16, causal=True, padding=False)
    _check(kind, SHAPE_CHUNK, torch.float32, causal=True, padding=False)
    _check(kind, (2, 4, 2, 1, 77, 40), torch.float32, causal=True, padding=False)


@pytest.mark.parametrize("kind", ["kerple_pow", "t5", "shaw", "fox"])
def test_engine_decode_with_empty_cache_slots(kind):
    """One query at key 40 of 77 slots (a StaticCache): the slots after it are masked by causality."""
    _check(kind, (2, 4, 2, 1, 77, 40), torch.float32, causal=True, q_offset=40, tensor_offset=True, padding=False)


def test_engine_default_blocks_single_key_tile():
    """The default blocks (all keys in one tile at this length) against the reference."""
    q, k, v, gout, valid, g = make_inputs(SHAPE, torch.float32, 1, True, device="cpu")
    term, leaves = make_term("kerple_log", SHAPE, 0, g, device="cpu")
    kw = dict(scale=0.2, causal=True, q_offset=0, key_valid=valid)
    out, grads = _run(tiled_attention, q, k, v, term, leaves, gout, **kw)
    ref, ref_grads = _run(attention_reference, q, k, v, term, leaves, gout, **kw)
    assert rel_err(out, ref) < 2e-5
    assert all(rel_err(a, b) < 1e-4 for a, b in zip(grads, ref_grads))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fused-kernel-tiles", "online-softmax-tiles"])
def test_engine_builds_no_full_matrix(masked_tiles, dtype):
    """Every tile has at most block_q rows (and, on the online-softmax path, block_k columns); causal tiles
    right of their queries' diagonal are never built. float32 on the CPU runs each query block through
    torch's fused kernel against all the keys it sees; float64 takes the online softmax over key tiles."""
    seen = masked_tiles
    q, k, v, gout, valid, g = make_inputs((2, 2, 2, 64, 64, 8), dtype, 0, True, device="cpu")
    term, _ = make_term("sandwich", (2, 2, 2, 64, 64, 8), 0, g, device="cpu")
    tiled_attention(q, k, v, term, scale=1.0, causal=True, key_valid=valid, block_q=16, block_k=16)
    assert all(n <= 16 for _, n, _, _ in seen)
    assert all(k0 < q0 + n and k1 <= q0 + n for q0, n, k0, k1 in seen)  # nothing right of the diagonal
    if dtype == torch.float64:
        assert all(k1 - k0 <= 16 for _, _, k0, k1 in seen)
        assert len(seen) == 1 + 2 + 3 + 4  # 4 query blocks see 1, 2, 3, 4 key tiles
    else:
        assert [(k0, k1) for _, _, k0, k1 in seen] == [(0, 16), (0, 32), (0, 48), (0, 64)]


@pytest.mark.parametrize("kind", ["alibi", "fox", "sandwich", "fire", "none"])
def test_causal_blocks_split_at_the_diagonal(monkeypatch, masked_tiles, kind):
    """Causal, unpadded, with an int offset, each query block runs the fused kernel twice and fills no mask with
    -inf: the keys before its diagonal square with the term alone (ALiBi's and sandwich's a strided view of their
    per-distance values), the square with the term and the kernel's own causal mask (``_block_parts``). FoX rides
    in a key channel (``_Tile.key_channel``), so it has no float mask at all, forward or backward; ALiBi,
    sandwich (no gradient) and plain attention take the same parts in backward. Output and every gradient (FoX's
    gates, FIRE's table) equal the reference's."""
    from hf_posenc.kernels.attention import _tiled_fused as tiled  # the fused-CPU path

    calls = []
    for name in ("_flash_fwd", "_flash_bwd"):
        real = getattr(tiled, name)

        def spy(*args, _real=real, _name=name, **kw):
            first = 0 if _name == "_flash_fwd" else 1  # the backward's arguments start with dO
            causal = args[4 if _name == "_flash_fwd" else 7]
            calls.append((_name, args[first].shape[2], args[first + 1].shape[2], causal, kw.get("attn_mask") is None))
            return _real(*args, **kw)

        monkeypatch.setattr(tiled, name, spy)
    shape = (2, 4, 2, 64, 64, 16)
    q, k, v, gout, _, g = make_inputs(shape, torch.float32, 3, False, device="cpu")
    term, leaves = make_term(kind, shape, 0, g, device="cpu")
    if kind == "fire":  # the largest pair off the grid's clamped end (a kink of u, where the two sides differ)
        t = term.tensors
        term = KernelTerm.fire(t["table"], t["c"], t["inv_norm"], t["x_max"] * 1.05)
    kw = dict(scale=0.25, causal=True, q_offset=0, key_valid=None)
    with torch.no_grad():
        tiled_attention(q, k, v, term, **kw, block_q=16)
    assert not masked_tiles  # the forward fills no mask
    calls.clear()
    out, grads = _run(tiled_attention, q, k, v, term, leaves, gout, **kw, block_q=16)
    ref, ref_grads = _run(attention_reference, q, k, v, term, leaves, gout, **kw)
    assert rel_err(out, ref) < 2e-5
    assert all(rel_err(a, b) < 1e-4 for a, b in zip(grads, ref_grads))
    assert not masked_tiles or kind == "fire"  # FIRE's table gradient: the online passes recompute its tiles
    fwd = [c[1:4] for c in calls if c[0] == "_flash_fwd"]
    # block q0 = 16 t: keys 0 .. 16 t (none for the first block), then the 16 x 16 square with its causal mask
    assert fwd == [(16, 16, True)] + [x for t in (1, 2, 3) for x in ((16, 16 * t, False), (16, 16, True))]
    no_mask = kind in ("fox", "none")
    assert all(c[4] == no_mask for c in calls)
    bwd = [c for c in calls if c[0] == "_flash_bwd"]
    assert bool(bwd) == (kind != "fire") and any(c[3] for c in bwd) == (kind != "fire")


@pytest.mark.parametrize("kind", ["alibi", "fox"])
def test_key_channel_with_padding(monkeypatch, kind):
    """Causal with left padding (blocks that do not split at their diagonal), ALiBi and FoX ride in one more key
    channel (``_Tile.key_channel``: the fused kernel gets head_dim + 1), with learned ALiBi slopes, whose gradient
    comes from that channel (-sum_j j dc_j), against the reference: output and every gradient."""
    from hf_posenc.kernels.attention import _tiled_fused as tiled  # the fused-CPU path

    widths = []
    real = tiled._flash_fwd

    def spy(*args, **kw):
        widths.append(args[1].shape[-1])
        return real(*args, **kw)

    monkeypatch.setattr(tiled, "_flash_fwd", spy)
    shape = (2, 4, 2, 64, 64, 16)
    q, k, v, gout, valid, g = make_inputs(shape, torch.float32, 4, True, device="cpu")
    term, leaves = make_term(kind, shape, 0, g, device="cpu")
    if kind == "alibi":  # learned slopes
        leaves = [term.tensors["slopes"].clone().requires_grad_()]
        term = KernelTerm.alibi(leaves[0])
    kw = dict(scale=0.25, causal=True, q_offset=0, key_valid=valid)
    out, grads = _run(tiled_attention, q, k, v, term, leaves, gout, **kw, block_q=16)
    ref, ref_grads = _run(attention_reference, q, k, v, term, leaves, gout, **kw)
    assert widths and all(w == 17 for w in widths)
    assert rel_err(out, ref) < 2e-5
    errors = [rel_err(a, b) for a, b in zip(grads, ref_grads)]
    assert len(errors) == 4 and all(e < 1e-4 for e in errors), errors


def test_engine_refuses_bad_input():
    q = torch.randn(1, 4, 8, 16)
    k = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="block_q"):
        tiled_attention(q, k, k, KernelTerm.none(), scale=1.0, causal=True, block_q=0)
    with pytest.raises(ValueError, match="heads"):
        tiled_attention(q, k, k, KernelTerm.alibi(torch.ones(3)), scale=1.0, causal=True)
    with pytest.raises(ValueError, match="multiple"):
        tiled_attention(q, torch.randn(1, 3, 8, 16), torch.randn(1, 3, 8, 16), KernelTerm.none(), scale=1.0, causal=True)
    with pytest.raises(TypeError, match="q_offset"):
        tiled_attention(q, k, k, KernelTerm.none(), scale=1.0, causal=True, q_offset=1.5)


# -- patched models ----------------------------------------------------------------------------------


def _spy_engine(monkeypatch):
    calls = []
    real = attention_module.tiled_attention

    def spy(*args, **kwargs):
        calls.append(args[3].kind)
        return real(*args, **kwargs)

    monkeypatch.setattr(attention_module, "tiled_attention", spy)
    return calls


@pytest.mark.parametrize("name, params", MODEL_CASES, ids=MODEL_IDS)
def test_model_engine_matches_reference(monkeypatch, name, params):
    """A one-layer Llama (GQA 2:1, left-padded batch, train mode): the engine, the default of the torch
    backend on the CPU, against the full-matrix references (the engine switched off), logits, loss and the
    gradient of every parameter, the encoding's included (fire: kink-free MLP, see test_kernel_attention)."""
    monkeypatch.setenv("HF_POSENC_BACKEND", "torch")
    ids, mask = _padded_batch()
    results = {}
    for engine in (True, False):
        calls = _spy_engine(monkeypatch)
        if not engine:
            monkeypatch.setattr(attention_module, "_tiled_torch_attention", lambda *a, **k: None)
        model = _kink_free(make_model("llama", encoding=name, train=True, config_overrides={"num_hidden_layers": 1},
                                      **params))
        out = model(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False)
        out.loss.backward()
        assert bool(calls) == engine
        results[engine] = (out.logits.detach(), out.loss.detach(),
                           {n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    (ref, ref_loss, ref_grads), (got, loss, grads) = results[False], results[True]
    assert rel_err(got, ref) < 1e-5 and abs(loss - ref_loss) < 1e-5
    assert grads.keys() == ref_grads.keys()
    scale = max(g.norm() for g in ref_grads.values())
    for n, g in grads.items():
        tol = 1e-3 if n.endswith(("log_c", "log_threshold")) else 2e-5
        err = rel_err(g, ref_grads[n], floor=1e-3 * scale)
        assert err < tol, f"{name}: gradient of {n} rel err {err:.1e}"


def test_model_dropout_and_weights_use_the_reference(monkeypatch):
    """Attention dropout while training and output_attentions are the reference's (documented paths)."""
    calls = _spy_engine(monkeypatch)
    model = make_model("llama", encoding="kerple", train=True, config_overrides={"attention_dropout": 0.1})
    ids = torch.randint(0, 50, (1, 9))
    model(input_ids=ids, use_cache=False)
    assert calls == []
    model.eval()
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=False, output_attentions=True)
    assert calls == [] and out.attentions[0] is not None
    model(input_ids=ids, use_cache=False)
    assert calls  # eval: no dropout, the engine


def _padded_inputs(shape, norm: float = 1.0, pad: int = 40):
    """q, k, v (q and k scaled by ``norm``), key_valid with batch row 1's first ``pad`` keys padding, and the
    incoming gradient, drawn in that order from torch's global generator."""
    b, h, hkv, lq, lk, d = shape
    q = torch.randn(b, h, lq, d) * norm
    k, v = torch.randn(b, hkv, lk, d) * norm, torch.randn(b, hkv, lk, d)
    valid = torch.ones(b, lk, dtype=torch.bool)
    valid[1, :pad] = False
    return q, k, v, valid, torch.randn(b, h, lq, d)


def _errors_vs_float64(term_of, leaves, q, k, v, gout, names, blocks, **kw):
    """(relative error of the output, {name: relative error of each gradient}, {name: the float64 gradient}) of
    the engine (float32, with ``blocks``) against the float64 reference; ``term_of(*leaves)`` builds the term
    from its learned tensors (q, k, v and the leaves' gradients are named by ``names``, in that order)."""
    out, grads = _run(tiled_attention, q, k, v, term_of(*leaves), leaves, gout, **blocks, **kw)
    leaves64 = [x.detach().double().requires_grad_() for x in leaves]
    ref, ref_grads = _run(attention_reference, q.double(), k.double(), v.double(), term_of(*leaves64), leaves64,
                          gout.double(), **kw)
    errs = {n: rel_err(got, want) for n, got, want in zip(names, grads, ref_grads)}
    return rel_err(out, ref), errs, dict(zip(names, ref_grads))


@pytest.mark.parametrize("kind", ["alibi", "sandwich", "kerple_pow"])
def test_backward_without_subnormals_keeps_the_gradients(kind):
    """Steep decays (ALiBi slopes 1 to 8 over 300 keys: most probabilities far below float32's smallest normal
    number): without a term gradient through the CPU fused backward, whose mask flushes what no logit can lift
    and whose per-head shift lifts the rest; with one (KERPLE) through the online passes, which flush the
    subnormal probabilities. q, k, v (and the term's) gradients equal the float64 reference's. Large q, k norms
    make the shift hit its cap."""
    torch.manual_seed(0)
    shape = b, h, hkv, lq, lk, d = 2, 4, 2, 300, 300, 16
    leaves = []
    if kind == "alibi":
        term = KernelTerm("alibi", {"slopes": torch.tensor([8.0, 4.0, 2.0, 1.0])}, {})
    elif kind == "sandwich":  # a table that falls by 2 per position: the steepest decay a learned-free table gives
        term = KernelTerm("sandwich", {"table": -2.0 * torch.arange(lk).float().expand(h, lk).contiguous()}, {})
    else:  # −r1 δ^r2 with r1 up to 3: a learned, steep decay
        leaves = [torch.tensor(r).requires_grad_() for r in ([3.0, 1.0, 0.5, 0.2], [1.0, 1.2, 0.9, 1.1])]
    term_of = (lambda r1, r2: KernelTerm.kerple_pow(r1, r2)) if leaves else (lambda: term)
    for norm in (1.0, 6.0):
        q, k, v, valid, gout = _padded_inputs(shape, norm)
        out_err, errs, _ = _errors_vs_float64(term_of, leaves, q, k, v, gout, ("dq", "dk", "dv", "r1", "r2"),
                                           dict(block_q=64), scale=d**-0.5, causal=True, key_valid=valid)
        assert out_err <= 2e-5
        for name, err in errs.items():
            assert err <= 4e-5, (norm, name, err)


def test_fox_fused_backward_under_steep_forgetting():
    """FoX through the CPU fused kernel (its bias in an extra key channel, c's gradient read from it) with gates
    that forget fast (log f down to −4 per token, so most probabilities underflow; the keys no logit can lift are
    left out, the rest shifted): output and the gradients of q, k, v and c equal the float64 reference's; GQA,
    left padding."""
    torch.manual_seed(1)
    shape = b, h, hkv, lq, lk, d = 2, 4, 2, 300, 300, 16
    log_f = torch.nn.functional.logsigmoid(torch.randn(b, h, lk) * 2 - torch.tensor([4.0, 1.0, 0.0, -2.0])[:, None])
    for norm in (1.0, 6.0):
        c = log_f.cumsum(-1).requires_grad_()
        q, k, v, valid, gout = _padded_inputs(shape, norm)
        out_err, errs, _ = _errors_vs_float64(KernelTerm.fox, [c], q, k, v, gout, ("dq", "dk", "dv", "dc"),
                                           dict(block_q=64), scale=d**-0.5, causal=True, key_valid=valid)
        assert out_err <= 2e-5
        for name, err in errs.items():
            assert err <= 1e-4, (norm, name, err)


def test_fire_tiles_are_freed_between_tiles(monkeypatch):
    """FIRE's tile builder keeps a tile's parts only from its bias to its gradient in the backward, and nothing
    after a forward or a backward (a held tile made every next one fault in fresh pages, measured). The gradients
    still match the reference."""
    import dataclasses

    from hf_posenc.kernels.attention.terms import TERMS
    from hf_posenc.kernels.attention.terms.fire import FireTiles  # FIRE's tiles (its registry entry's ``tiles``)

    built = []

    class Spy(FireTiles):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setitem(TERMS, "fire", dataclasses.replace(TERMS["fire"], tiles=Spy))
    q, k, v, gout, valid, g = make_inputs(SHAPE, torch.float32, 0, True, device="cpu")
    term, leaves = make_term("fire", SHAPE, 0, g, device="cpu")
    kw = dict(scale=0.3, causal=True, key_valid=valid, block_q=16, block_k=16)
    out, grads = _run(tiled_attention, q, k, v, term, leaves, gout, **kw)
    assert len(built) == 2  # one for the forward, one for the backward
    assert all(t.last is None for t in built)
    assert not built[0].keep and built[1].keep
    ref, ref_grads = _run(attention_reference, q, k, v, term, leaves, gout, scale=0.3, causal=True, key_valid=valid)
    assert rel_err(out, ref) < 2e-5
    assert all(rel_err(a, b) < 1e-4 for a, b in zip(grads, ref_grads))


@pytest.mark.parametrize("norm_rows", [1, 2])
def test_fire_tiles_by_hand_match_the_reference(norm_rows):
    """FIRE's tiles (one gather of values and slopes for all heads; the table's gradient scattered over the
    cells, c's and inv_norm's through the slopes): output and the gradients of q, k, v, the table, c and
    inv_norm equal the float64 reference's, with one normaliser row shared by the batch or one per row, a
    256-cell table and cells up to the table's last one. c's gradient is a sum of terms that cancel (a softmax
    row's dS sums to 0): there the bound is twice the float32 reference's own error (7 % here, measured)."""
    torch.manual_seed(2)
    b, h, hkv, lq, lk, d = 2, 4, 2, 150, 150, 16
    grid = torch.arange(256, dtype=torch.float32)
    table = (torch.sin(grid / 40 + torch.arange(h)[:, None]) * 2).requires_grad_()
    c = torch.tensor(0.7).requires_grad_()
    positions = torch.arange(lq, dtype=torch.float32).expand(norm_rows, lq)
    inv_norm = (1.0 / torch.log1p(0.7 * positions.clamp(min=20))).requires_grad_()
    x_max = (torch.log1p(0.7 * torch.arange(lq).float())[None] * inv_norm.detach()).max()
    q, k, v, valid, gout = _padded_inputs((b, h, hkv, lq, lk, d), pad=7)
    kw = dict(scale=d**-0.5, causal=True, key_valid=valid)
    leaves = [table, c, inv_norm]
    names = ("dq", "dk", "dv", "table", "c", "inv_norm")
    out_err, errs, ref_grads = _errors_vs_float64(lambda *t: KernelTerm.fire(*t, x_max.to(t[0].dtype)), leaves, q,
                                                  k, v, gout, names, dict(block_q=32, block_k=48), **kw)
    _, ref32_grads = _run(attention_reference, q, k, v, KernelTerm.fire(table, c, inv_norm, x_max), leaves, gout,
                          **kw)
    assert out_err <= 2e-5
    for name, f32 in zip(names, ref32_grads):
        assert errs[name] <= max(1e-4, 2 * rel_err(f32, ref_grads[name])), (name, errs[name])


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
@pytest.mark.parametrize("window", [None, 3, 40])
def test_shaw_band_through_the_fused_kernel(window, padded):
    """Shaw, causal, on the CPU fused kernel: the far keys' bucket as the row's frame, the band of K keys as the
    mask term, the value term from the band's probabilities. Output and the gradients of q, k, v and both tables
    equal the float64 reference's: K = 8 over 120 keys, GQA, left padding (rows that see no key) or none (then,
    without a window, the keys before each block's band go through the kernel unmasked, merged by their lse),
    a chunk of queries after a cache, and sliding windows narrower and wider than the band."""
    torch.manual_seed(3)
    b, h, hkv, lq, lk, d, kmax = 2, 4, 2, 50, 120, 16, 8
    a_k = (torch.randn(2 * kmax + 1, d) * 0.5).requires_grad_()
    a_v = (torch.randn(2 * kmax + 1, d) * 0.5).requires_grad_()
    q, k, v, valid, gout = _padded_inputs((b, h, hkv, lq, lk, d), pad=75)  # row 1's first queries see no key
    valid = valid if padded else None
    out_err, errs, _ = _errors_vs_float64(KernelTerm.shaw, [a_k, a_v], q, k, v, gout, ("dq", "dk", "dv", "a_k", "a_v"),
                                          dict(block_q=16), scale=d**-0.5, causal=True, key_valid=valid,
                                          q_offset=lk - lq, window=window)
    assert out_err <= 2e-5
    for name, err in errs.items():
        assert err <= 4e-5, (name, err)


def test_exp_flushed_is_exp_with_nothing_below_the_floor():
    """``exp_flushed`` (clamp, exp, zero at the floor: x86's exp is slow on -inf and underflowing arguments) gives
    exp(x) wherever exp(x) > 2^-125, 0 elsewhere (-inf included), keeps NaN and +inf, and leaves float64 to a
    plain exp. The threshold sits well above e^EXP_FLOOR, so a clamped entry is zeroed whatever a device's exp
    rounds it to (an H100's rounds it above the CPU's: a threshold at the CPU's value kept masked entries there)."""
    from hf_posenc.kernels._subnormal import _FLUSH_AT, EXP_FLOOR, exp_flushed

    x = torch.tensor([float("-inf"), -1e30, -200.0, -104.0, -88.0, EXP_FLOOR, -87.0, -86.7, -86.5, -20.0, 0.0, 3.0,
                      80.0, float("inf"), float("nan")])
    got = exp_flushed(x.clone())
    want = torch.where(torch.exp(x.double()) <= 2.0**-125, torch.zeros_like(x), torch.exp(x))
    assert torch.equal(got[:-1], want[:-1])
    assert got[6] == 0 and got[7] == 0 and got[8] > 0  # -87.0, -86.7 zeroed; -86.5 (2.6e-38) kept
    assert torch.isnan(got[-1])
    assert bool((got[got > 0] >= torch.finfo(torch.float32).tiny).all())  # nothing subnormal
    # a device whose exp is many ulps above the CPU's at the floor still zeroes the clamped entries
    at_floor = torch.tensor(EXP_FLOOR, dtype=torch.float64).exp().item()
    assert at_floor * 1.5 < _FLUSH_AT
    x64 = torch.tensor([-800.0, -100.0, 0.0], dtype=torch.float64)
    assert torch.equal(exp_flushed(x64.clone()), torch.exp(x64))


@pytest.mark.parametrize("kind", [k for k in TILED_KINDS if k != "shaw"])
@pytest.mark.parametrize("q_len, offset, window, causal", [(1, 40, None, True), (3, 38, 7, True), (2, 0, None, False)])
def test_few_queries_without_gradients_match_the_reference(kind, q_len, offset, window, causal):
    """A decoding step (a few queries, no gradient) runs one SDPA call with the term's rows as its mask
    (``tiled.FEW_QUERIES``): against the reference, with GQA, left padding (a row that sees no key) and a window."""
    from hf_posenc.kernels.attention import tiled as tiled_mod
    from hf_posenc.kernels.attention.terms import example_term

    calls = []
    original = tiled_mod._few_queries
    tiled_mod._few_queries = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        g = torch.Generator().manual_seed(5)
        b, h, hkv, k_len, d = 2, 4, 2, offset + q_len if causal else 41, 24
        shape = (b, h, hkv, q_len, k_len, d)
        q, k, v = (torch.randn(b, n, ln, d, generator=g) for n, ln in ((h, q_len), (hkv, k_len), (hkv, k_len)))
        term, _ = example_term(kind, shape, offset, g)
        valid = torch.ones(b, k_len, dtype=torch.bool)
        valid[1, : k_len - 1] = False  # row 1 sees only the last key, or none under a window when it is not causal
        if not causal:
            valid[1] = False
        kw = dict(scale=d**-0.5, causal=causal, q_offset=offset, key_valid=valid, window=window)
        with torch.no_grad():
            got = tiled_attention(q, k, v, term, **kw)
            ref = attention_reference(q, k, v, term, **kw)
    finally:
        tiled_mod._few_queries = original
    assert calls, "the few-queries path did not run"
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_few_queries_reuse_a_bias_only_for_the_very_same_term_tensors(monkeypatch):
    """A decoding step's bias is evaluated once for the layers whose terms hold the same tensors (a bias shared by
    the layers) and afresh for other tensors, another offset, or a tensor changed in place; outputs stay those of
    the reference."""
    from hf_posenc.kernels.attention import tiled as tiled_mod

    evaluated = []
    original = tiled_mod.term_bias
    monkeypatch.setattr(tiled_mod, "term_bias", lambda *a, **k: evaluated.append(1) or original(*a, **k))
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(1, 4, 1, 16, generator=g), torch.randn(1, 2, 9, 16, generator=g), torch.randn(1, 2, 9, 16, generator=g)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    memo = {}
    kw = dict(scale=0.25, causal=True, q_offset=8, memo=memo)

    def run(term, **extra):
        with torch.no_grad():
            got = tiled_attention(q, k, v, term, **dict(kw, **extra))
            want = attention_reference(q, k, v, term, scale=0.25, causal=True, q_offset=extra.get("q_offset", 8))
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)

    run(KernelTerm.alibi(slopes))
    run(KernelTerm.alibi(slopes))  # another layer, the same tensor: reused
    assert len(evaluated) == 1
    run(KernelTerm.alibi(slopes.clone()))  # equal values, other tensor: evaluated
    run(KernelTerm.alibi(slopes[:]))  # the first tensor again after another one: only the last bias is kept
    assert len(evaluated) == 3
    run(KernelTerm.alibi(slopes[:]), q_offset=7)  # the same tensor (a view of it), another offset
    assert len(evaluated) == 4
    slopes.mul_(2.0)  # changed in place (its version moves): evaluated
    run(KernelTerm.alibi(slopes))
    assert len(evaluated) == 5


def test_few_queries_skip_the_mask_only_where_every_key_is_seen():
    """Without key padding the few-queries path drops its 0 / −inf mask where every query sees every key by
    position (``tiled._sees_every_key``): that predicate against the band itself, over offsets, lengths and
    windows both ways; then the outputs against the reference where it holds and where it does not."""
    from hf_posenc.kernels.attention import tiled as tiled_mod
    from hf_posenc.kernels.attention.terms import example_term

    for causal in (True, False):
        for q_len in (1, 2, 3):
            for k_len in (1, 4, 6):
                for offset in range(0, k_len):
                    for window in (None, 1, 2, 4, 5, 6, 7, 9):
                        q_idx = torch.arange(q_len) + offset
                        band = band_allowed(q_idx, torch.arange(k_len), causal, window)
                        assert tiled_mod._sees_every_key(q_len, k_len, offset, causal, window) == bool(band.all()), \
                            (causal, q_len, k_len, offset, window)
    g = torch.Generator().manual_seed(7)
    b, h, hkv, d = 1, 4, 2, 16
    for q_len, offset, k_len, window, causal in [(1, 20, 21, None, True), (1, 20, 21, 21, True), (1, 20, 21, 20, True),
                                                 (2, 19, 21, None, True), (2, 0, 21, None, False),
                                                 (2, 5, 21, 16, False), (2, 5, 21, 17, False)]:
        shape = (b, h, hkv, q_len, k_len, d)
        q, k, v = (torch.randn(b, n, ln, d, generator=g) for n, ln in ((h, q_len), (hkv, k_len), (hkv, k_len)))
        term, _ = example_term("alibi", shape, offset, g)
        kw = dict(scale=d**-0.5, causal=causal, q_offset=offset, window=window)
        with torch.no_grad():
            memo: dict = {}
            got = tiled_attention(q, k, v, term, memo=memo, **kw)
            (entry,) = [value for key, value in memo.items() if key[0] == "few_queries_mask"]
            assert (entry[1] is None) == tiled_mod._sees_every_key(q_len, k_len, offset, causal, window)
            torch.testing.assert_close(got, attention_reference(q, k, v, term, **kw), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["kerple_log", "t5", "fox"])
def test_few_queries_share_masks_across_layers(kind):
    """With a per-forward memo (a model's layers), the few-queries path builds its mask and index tensors once:
    two layers' terms (different parameters) against the reference with the shared memo, then a new key-padding
    tensor of the same size, which must not reuse the first one's mask."""
    from hf_posenc.kernels.attention.terms import example_term

    g = torch.Generator().manual_seed(6)
    b, h, hkv, q_len, offset, d = 2, 4, 2, 1, 30, 16
    k_len = offset + q_len
    shape = (b, h, hkv, q_len, k_len, d)
    q, k, v = (torch.randn(b, n, ln, d, generator=g) for n, ln in ((h, q_len), (hkv, k_len), (hkv, k_len)))
    valid = torch.ones(b, k_len, dtype=torch.bool)
    valid[1, :5] = False
    memo: dict = {}
    with torch.no_grad():
        for layer in range(2):
            term, _ = example_term(kind, shape, offset, g)
            kw = dict(scale=d**-0.5, causal=True, q_offset=offset, key_valid=valid)
            got = tiled_attention(q, k, v, term, memo=memo, **kw)
            torch.testing.assert_close(got, attention_reference(q, k, v, term, **kw), rtol=1e-5, atol=1e-5)
        masks = [key for key in memo if key[0] == "few_queries_mask"]
        assert len(masks) == 1 and any(key[0] == "term_bias_index" for key in memo)
        other = valid.clone()
        other[0, 10:20] = False  # the same size, other padding: its own mask
        kw = dict(scale=d**-0.5, causal=True, q_offset=offset, key_valid=other)
        got = tiled_attention(q, k, v, term, memo=memo, **kw)
        torch.testing.assert_close(got, attention_reference(q, k, v, term, **kw), rtol=1e-5, atol=1e-5)
