"""Values and cache behaviour of the data-dependent encodings ``cope``, ``sba`` and ``tape``.

* cope and sba: the attention equals explicit float64 loops over (i, j, k) of the papers' formulas (cope's
  raw form with interpolated embedding *vectors* e[p], sba's product form Π(1 − β)), with grouped-query
  heads, left padding, decode offsets, and on ViT cope's bidirectional generalisation.
* tape: with the code's exact identity init it is RoPE (== the unpatched Llama, == ``rope`` on ViT); its
  outputs are invariant to a common shift of all positions (the paper's equivariance); one layer's state
  updates equal the formulas written out by hand.
* For all three, with non-trivial parameters: KV cache (dynamic, static, left padding, decode chunks) ==
  full forward; greedy and beam search with a cache == recomputing the whole sequence; gradient
  checkpointing (reentrant too) gives the gradients computed without it; bf16 at L = 2048 gives finite
  outputs and gradients; gradients of every learned parameter match finite differences (float64).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch.func import functional_call
from torch.nn import functional as F
from transformers import DynamicCache, StaticCache

import hf_posenc
from hf_posenc.encodings.base import ModelInfo, PosContext
from hf_posenc.encodings.cope import Cope
from hf_posenc.encodings.sba import StickBreaking
from hf_posenc.encodings.tape import Tape, pack_state, unpack_state
from hf_posenc.registry import get_encoding
from conftest import (
    PAD_ID,
    enable_checkpointing,
    left_pad,
    make_ids,
    make_model,
    make_pixels,
    positions_from_mask,
    with_cache,
)

CPU = torch.device("cpu")
SAME_ATOL = 1e-5
CACHE_ATOL = 1e-4


def text_info(heads=4, kv_heads=2, head_dim=4, layers=2, hidden=None) -> ModelInfo:
    return ModelInfo("llama", hidden or heads * head_dim, heads, kv_heads, head_dim, layers, True, 64)


def vit_info(heads=2, head_dim=4, layers=2) -> ModelInfo:
    return ModelInfo("vit", heads * head_dim, heads, heads, head_dim, layers, False, 7, grid=(2, 3), patch_size=(8, 8))


def build(cls, name: str, info: ModelInfo, **params):
    torch.manual_seed(0)
    config = hf_posenc.PosEncConfig(name, params)
    return cls(config.spec.cls.resolve(config, info), info)


def double_inputs(b, h, hkv, q_len, k_len, d, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, q_len, d, generator=g, dtype=torch.float64) * scale
    k = torch.randn(b, hkv, k_len, d, generator=g, dtype=torch.float64) * scale
    v = torch.randn(b, hkv, k_len, d, generator=g, dtype=torch.float64)
    return q, k, v


def text_mask(b, q_len, k_len, q_offset, pad=(0, 2)):
    """(B, 1, Lq, Lk) causal mask (query i is key q_offset + i) with ``pad[b]`` left-padded keys per row."""
    causal = (torch.arange(q_len)[:, None] + q_offset) >= torch.arange(k_len)[None]
    mask = causal[None, None].repeat(b, 1, 1, 1)
    for row, n in enumerate(pad[:b]):
        mask[row, ..., :n] = False
    return mask


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def perturb(model, scale: float, seed: int = 3) -> None:
    """Add N(0, scale) noise to every parameter of the encoding (so zero-initialised ones matter)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in hf_posenc.encoding_module(model).parameters():
            p.add_(scale * torch.randn(p.shape, generator=g).to(p.dtype))


# ===================================================================================================
# cope
# ===================================================================================================


def cope_loop(q, k, v, mask, scaling, table, q_offset):
    """CoPE by the paper's raw formulas: gates, p_ij = Σ_{k=j..i} g_ik over allowed keys, clip, interpolated
    embedding *vector* e[p], logits s q·k + q·e[p], softmax over allowed keys."""
    b, h, q_len, d = q.shape
    hkv, k_len = k.shape[1], k.shape[2]
    npos = table.shape[1]
    out = torch.zeros_like(q)
    probs = torch.zeros(b, h, q_len, k_len, dtype=q.dtype)
    for bb, hh, i in itertools.product(range(b), range(h), range(q_len)):
        kh = hh // (h // hkv)
        qi, row = q[bb, hh, i], q_offset + i
        allowed = [bool(mask[bb, 0, i, j]) for j in range(k_len)]
        logits = {}
        for j in range(k_len):
            if not allowed[j]:
                continue
            p = sum(sigmoid(scaling * float(qi @ k[bb, kh, kk])) for kk in range(j, row + 1) if allowed[kk])
            p = min(p, npos - 1)
            lo, hi = math.floor(p), math.ceil(p)
            e = (p - lo) * table[:, hi] + (1 - p + lo) * table[:, lo]
            logits[j] = scaling * float(qi @ k[bb, kh, j]) + float(qi @ e)
        if not logits:
            continue
        m = max(logits.values())
        z = sum(math.exp(x - m) for x in logits.values())
        for j, x in logits.items():
            probs[bb, hh, i, j] = math.exp(x - m) / z
            out[bb, hh, i] += probs[bb, hh, i, j] * v[bb, kh, j]
    return out, probs


@pytest.mark.parametrize(
    "q_len,k_len,npos",
    [(6, 6, 64), (6, 6, 3), (2, 7, 4), (1, 7, 2)],
    ids=["prefill", "prefill-clipped", "chunk-after-cache", "decode-clipped"],
)
def test_cope_matches_loop(q_len, k_len, npos):
    info = text_info(heads=4, kv_heads=2, head_dim=4)
    enc = build(Cope, "cope", info, npos_max=npos, init_std=0.7).double()
    q_offset = k_len - q_len
    q, k, v = double_inputs(2, 4, 2, q_len, k_len, 4, scale=1.5)
    mask = text_mask(2, q_len, k_len, q_offset)
    want_out, want_probs = cope_loop(q, k, v, mask, 0.5, enc.pos_emb[1].detach(), q_offset)
    # the tile-wise engine (no probabilities), and the reference when the probabilities are requested
    for need_weights in (False, True):
        ctx = PosContext(encoding=enc, info=info, q_offset=q_offset, need_weights=need_weights)
        out, probs = enc.attend(ctx, 1, q, k, v, mask, 0.5, 0.0, False)
        assert out.dtype == torch.float64
        assert (out - want_out).abs().max() < 1e-12
        if need_weights:
            assert (probs - want_probs).abs().max() < 1e-12
        else:
            assert probs is None


def test_cope_masked_keys_are_not_counted():
    """A padded key with a huge logit (gate 1 if counted) changes nothing: gates are masked before the sum."""
    info = text_info(heads=2, kv_heads=2, head_dim=4)
    enc = build(Cope, "cope", info, npos_max=8, init_std=1.0).double()
    q, k, v = double_inputs(1, 2, 2, 5, 5, 4)
    mask = text_mask(1, 5, 5, 0, pad=(1,))
    ctx = PosContext(encoding=enc, info=info)
    out, _ = enc.attend(ctx, 0, q, k, v, mask, 0.5, 0.0, False)
    k2 = k.clone()
    k2[..., 0, :] = 50 * q[:, :, -1].sum(1, keepdim=True)  # padded key: σ(q·k) ≈ 1 for the last query
    out2, _ = enc.attend(ctx, 0, q, k2, v, mask, 0.5, 0.0, False)
    assert (out - out2)[..., 1:, :].abs().max() < 1e-12
    alone, _ = enc.attend(ctx, 0, q[..., 1:, :], k[..., 1:, :], v[..., 1:, :], None, 0.5, 0.0, False)
    assert (out[..., 1:, :] - alone).abs().max() < 1e-12


def cope_vit_loop(q, k, v, scaling, before, after):
    """Bidirectional CoPE on [CLS, patches in raster order]: j <= i counts k = j..i with e⁻, j > i counts
    k = i..j with e⁺; pairs with CLS (index 0) take no position term and CLS's gate is never counted."""
    b, h, n, d = q.shape
    npos = before.shape[1]
    out = torch.zeros_like(q)
    for bb, hh, i in itertools.product(range(b), range(h), range(n)):
        qi = q[bb, hh, i]
        logits = []
        for j in range(n):
            x = scaling * float(qi @ k[bb, hh, j])
            if i > 0 and j > 0:
                span, table = (range(j, i + 1), before) if j <= i else (range(i, j + 1), after)
                p = min(sum(sigmoid(scaling * float(qi @ k[bb, hh, kk])) for kk in span), npos - 1)
                lo, hi = math.floor(p), math.ceil(p)
                x += float(qi @ ((p - lo) * table[:, hi] + (1 - p + lo) * table[:, lo]))
            logits.append(x)
        a = torch.softmax(torch.tensor(logits, dtype=q.dtype), dim=0)
        out[bb, hh, i] = (a[:, None] * v[bb, hh]).sum(0)
    return out


def test_cope_vit_matches_loop():
    info = vit_info()
    enc = build(Cope, "cope", info, npos_max=4, init_std=0.7).double()
    assert sorted(n for n, _ in enc.named_parameters()) == ["pos_emb", "pos_emb_after"]
    q, k, v = double_inputs(2, 2, 2, 7, 7, 4, scale=1.5)
    ctx = PosContext(encoding=enc, info=info, grid=(2, 3))
    out, _ = enc.attend(ctx, 0, q, k, v, None, 0.5, 0.0, False)
    want = cope_vit_loop(q, k, v, 0.5, enc.pos_emb[0].detach(), enc.pos_emb_after[0].detach())
    assert (out - want).abs().max() < 1e-12


def test_cope_paper_init_is_zero_and_default_is_random():
    info = text_info()
    assert build(Cope, "cope", info, init_std=0.0).pos_emb.abs().max() == 0
    assert build(Cope, "cope", info).pos_emb.std() > 0
    with pytest.raises(ValueError):
        hf_posenc.PosEncConfig("cope", {"npos_max": 0})
    with pytest.raises(TypeError):
        hf_posenc.PosEncConfig("cope", {"npos_max": 2.5})


# ===================================================================================================
# sba
# ===================================================================================================


def sba_loop(q, k, v, mask, scaling, q_offset, attend_current, remainder, bias=None):
    """Stick-breaking by the product form: A_ij = β_ij Π_{j<k<i} (1 − β_ik) over allowed keys (k <= i with
    attend_current), remainder r_i = Π (1 − β_ik) over all breakpoints."""
    b, h, q_len, d = q.shape
    hkv, k_len = k.shape[1], k.shape[2]
    out = torch.zeros_like(q)
    weights = torch.zeros(b, h, q_len, k_len, dtype=q.dtype)
    for bb, hh, i in itertools.product(range(b), range(h), range(q_len)):
        kh = hh // (h // hkv)
        row = q_offset + i
        last = row if attend_current else row - 1
        brk = [j for j in range(0, last + 1) if mask is None or bool(mask[bb, 0, i, j])]
        beta = {j: sigmoid(scaling * float(q[bb, hh, i] @ k[bb, kh, j])) for j in brk}
        for j in brk:
            a = beta[j]
            for kk in brk:
                if kk > j:
                    a *= 1 - beta[kk]
            weights[bb, hh, i, j] = a
            out[bb, hh, i] += a * v[bb, kh, j]
        rest = math.prod(1 - beta[j] for j in brk)
        if remainder == "current":
            out[bb, hh, i] += rest * v[bb, kh, row]
            weights[bb, hh, i, row] += rest
        elif remainder == "bias":
            out[bb, hh, i] += rest * bias[hh]
    return out, weights


@pytest.mark.parametrize("remainder", ["discard", "current", "bias"])
@pytest.mark.parametrize("attend_current", [False, True], ids=["no-diag", "diag"])
@pytest.mark.parametrize("q_len,k_len", [(6, 6), (2, 7), (1, 7)], ids=["prefill", "chunk", "decode"])
def test_sba_matches_loop(remainder, attend_current, q_len, k_len):
    info = text_info(heads=4, kv_heads=2, head_dim=4)
    enc = build(StickBreaking, "sba", info, remainder=remainder, attend_current=attend_current).double()
    if remainder == "bias":
        with torch.no_grad():
            enc.remainder_bias.normal_()
    q_offset = k_len - q_len
    q, k, v = double_inputs(2, 4, 2, q_len, k_len, 4, scale=1.5)
    mask = text_mask(2, q_len, k_len, q_offset)
    bias = enc.remainder_bias[1].detach() if remainder == "bias" else None
    want_out, want_w = sba_loop(q, k, v, mask, 0.5, q_offset, attend_current, remainder, bias)
    ctx = PosContext(encoding=enc, info=info, q_offset=q_offset)  # the tile-wise engine: no weights
    out, weights = enc.attend(ctx, 1, q, k, v, mask, 0.5, 0.0, False)
    assert weights is None and (out - want_out).abs().max() < 1e-12
    ctx = PosContext(encoding=enc, info=info, q_offset=q_offset, need_weights=True)  # the reference
    out, weights = enc.attend(ctx, 1, q, k, v, mask, 0.5, 0.0, False)
    assert (out - want_out).abs().max() < 1e-12
    assert (weights - want_w).abs().max() < 1e-12
    sums = weights.sum(-1)
    if remainder == "current":
        assert (sums - 1).abs().max() < 1e-12
    else:
        assert (sums <= 1 + 1e-12).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sba_extreme_logits_stay_finite(dtype):
    """Logits of ±1e4: finite outputs and gradients; a key at +1e4 takes the whole stick, one at −1e4 none."""
    info = text_info(heads=2, kv_heads=2, head_dim=4)
    enc = build(StickBreaking, "sba", info, remainder="current")
    q = torch.zeros(1, 2, 6, 4)
    q[..., 0] = 1.0
    k = torch.zeros(1, 2, 6, 4)
    k[..., 0] = torch.tensor([1e4, -1e4, 1e4, -1e4, -1e4, 1e4]) * 2  # logits ±1e4 at scaling 0.5
    v = torch.randn(1, 2, 6, 4)
    q, k, v = (t.to(dtype).requires_grad_(True) for t in (q, k, v))
    ctx = PosContext(encoding=enc, info=info)  # the tile-wise engine
    tiled, _ = enc.attend(ctx, 0, q, k, v, None, 0.5, 0.0, False)
    tiled.float().square().sum().backward()
    assert torch.isfinite(tiled).all() and all(torch.isfinite(t.grad).all() for t in (q, k, v))
    q.grad = k.grad = v.grad = None
    ctx = PosContext(encoding=enc, info=info, need_weights=True)  # the reference, with the weights
    out, weights = enc.attend(ctx, 0, q, k, v, None, 0.5, 0.0, False)
    assert torch.isfinite(out).all() and torch.isfinite(weights).all()
    torch.testing.assert_close(tiled, out)
    # query 4 (keys 0..3, nearest first: 3 at -1e4, 2 at +1e4): key 2 takes the whole stick
    assert weights[0, 0, 4].tolist() == [0.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    # query 2: keys 1 (-1e4), 0 (+1e4) -> key 0
    assert weights[0, 0, 2, 0] == 1.0
    out.float().square().sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()


def _grid_order(grid, i):
    """Hand-written breaking order of query i on ``grid`` (index 0 = CLS, then patches in raster order): own key,
    then patches by squared grid distance, ties in raster order, CLS last; the CLS query: raster order."""
    rows, cols = grid
    coord = {1 + r * cols + c: (r, c) for r in range(rows) for c in range(cols)}
    patches = sorted(coord)
    if i == 0:
        return [0] + patches
    others = sorted((p for p in patches if p != i),
                    key=lambda p: ((coord[p][0] - coord[i][0]) ** 2 + (coord[p][1] - coord[i][1]) ** 2, p))
    return [i] + others + [0]


@pytest.mark.parametrize("remainder", ["discard", "current", "bias"])
@pytest.mark.parametrize("attend_current", [False, True], ids=["no-diag", "diag"])
def test_sba_vit_matches_grid_order_loop(remainder, attend_current):
    """ViT generalisation (sba module docstring): each query breaks the stick over its keys nearest first on the
    grid, ties in raster order, CLS last -- against the product form A = β_j Π_{k before j} (1 − β_k) in float64."""
    info = vit_info(heads=2, head_dim=4)
    enc = build(StickBreaking, "sba", info, remainder=remainder, attend_current=attend_current).double()
    if remainder == "bias":
        with torch.no_grad():
            enc.remainder_bias.normal_()
    n = 7  # CLS + a 2 x 3 grid
    q, k, v = double_inputs(2, 2, 2, n, n, 4, scale=1.5)
    ctx = PosContext(encoding=enc, info=info, grid=(2, 3))
    out, weights = enc.attend(ctx, 1, q, k, v, None, 0.5, 0.0, False)
    want_w = torch.zeros_like(weights)
    want_out = torch.zeros_like(out)
    for bb, hh, i in itertools.product(range(2), range(2), range(n)):
        order = _grid_order((2, 3), i)
        brk = order if attend_current else order[1:]
        beta = {j: sigmoid(0.5 * float(q[bb, hh, i] @ k[bb, hh, j])) for j in brk}
        left = 1.0
        for j in brk:
            want_w[bb, hh, i, j] = beta[j] * left
            want_out[bb, hh, i] += beta[j] * left * v[bb, hh, j]
            left *= 1 - beta[j]
        if remainder == "current":
            want_w[bb, hh, i, i] += left
            want_out[bb, hh, i] += left * v[bb, hh, i]
        elif remainder == "bias":
            want_out[bb, hh, i] += left * enc.remainder_bias[1, hh].detach()
    assert (weights - want_w).abs().max() < 1e-12
    assert (out - want_out).abs().max() < 1e-12


@pytest.mark.parametrize("attend_current", [False, True], ids=["no-diag", "diag"])
def test_sba_bidirectional_text_matches_sequence_order_loop(attend_current):
    """BERT generalisation (sba module docstring): own key, then keys by |i - j|, the left one first at equal
    distance -- against the product form in float64, and every key of the row takes part (not causal)."""
    info = ModelInfo("bert", 8, 2, 2, 4, 2, False, 64)
    enc = build(StickBreaking, "sba", info, remainder="current", attend_current=attend_current).double()
    n = 6
    q, k, v = double_inputs(1, 2, 2, n, n, 4, scale=1.5)
    out, weights = enc.attend(PosContext(encoding=enc, info=info), 0, q, k, v, None, 0.5, 0.0, False)
    want_w = torch.zeros_like(weights)
    for hh, i in itertools.product(range(2), range(n)):
        order = [i] + sorted((j for j in range(n) if j != i), key=lambda j: (abs(i - j), j))
        brk = order if attend_current else order[1:]
        left = 1.0
        for j in brk:
            beta = sigmoid(0.5 * float(q[0, hh, i] @ k[0, hh, j]))
            want_w[0, hh, i, j] = beta * left
            left *= 1 - beta
        want_w[0, hh, i, i] += left
    assert (weights - want_w).abs().max() < 1e-12
    assert (out - weights @ v).abs().max() < 1e-12
    assert (weights[0, :, 0, 1:] > 0).all()  # the first token attends to later ones


def test_sba_runs_on_vit():
    """A ViT patched with sba: each layer's attention output is its own returned weights (``output_attentions``,
    the grid-order stick-breaking that test_sba_vit_matches_grid_order_loop checks against a loop) times the
    values, the weights are a broken stick (>= 0, rows summing to at most 1), the output is not nope's, and every
    parameter gets a finite, non-zero gradient."""
    model = make_model("vit", encoding="sba")
    pixels = make_pixels(2)
    seen = {}
    hooks = []
    for i, layer in enumerate(model.vit.layers):
        attn = layer.attention
        hooks.append(attn.v_proj.register_forward_hook(lambda m, a, out, i=i: seen.__setitem__(("v", i), out)))
        hooks.append(attn.o_proj.register_forward_pre_hook(lambda m, a, i=i: seen.__setitem__(("o", i), a[0])))
    with torch.no_grad():
        out = model(pixel_values=pixels, output_attentions=True)
    for h in hooks:
        h.remove()
    heads = model.config.num_attention_heads
    for i, weights in enumerate(out.attentions):
        b, h, n, _ = weights.shape
        v = seen[("v", i)].reshape(b, n, heads, -1).transpose(1, 2)
        torch.testing.assert_close(seen[("o", i)], (weights @ v).transpose(1, 2).reshape(b, n, -1), rtol=0, atol=1e-6)
        assert (weights >= 0).all() and (weights.sum(-1) <= 1 + 1e-6).all()
    with torch.no_grad():
        assert (out.logits - make_model("vit", encoding="nope")(pixel_values=pixels).logits).abs().max() > 1e-3
    model(pixel_values=pixels).logits.square().sum().backward()
    for n, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, n


def test_sba_weights_from_model_sum_to_at_most_one():
    """output_attentions on a left-padded batch: ≤ 1 with the paper's default, exactly 1 with 'current';
    the first real token of a row has no earlier key and gets weight 0 everywhere (discard)."""
    ids, mask = left_pad([make_ids(1, 5, seed=2)[0], make_ids(1, 8, seed=3)[0]])
    for remainder in ("discard", "current"):
        model = make_model("llama", encoding="sba", remainder=remainder)
        with torch.no_grad():
            out = model(ids, attention_mask=mask, position_ids=positions_from_mask(mask), output_attentions=True)
        real = mask.bool()
        for probs in out.attentions:
            sums = probs.float().sum(-1)[:, 0][real]
            if remainder == "current":
                assert (sums - 1).abs().max() < 1e-5
            else:
                assert (sums <= 1 + 1e-5).all() and (sums < 0.999).any()
                assert probs[0, :, 3].abs().max() == 0  # first real token of the padded row


# ===================================================================================================
# tape
# ===================================================================================================


def test_tape_identity_init_is_rope_on_llama():
    """init_std=0 (the code's zero init): the states stay RoPE, so TAPE == the unpatched Llama (GQA, padded)."""
    native = make_model("llama")
    patched = make_model("llama", encoding="tape", init_std=0.0)
    ids, mask = left_pad([make_ids(1, 6, seed=5)[0], make_ids(1, 9, seed=6)[0]])
    kw = dict(attention_mask=mask, position_ids=positions_from_mask(mask), use_cache=False)
    with torch.no_grad():
        want, got = native(ids, **kw).logits, patched(ids, **kw).logits
    real = mask.bool()
    assert (got[real] - want[real]).abs().max() < SAME_ATOL


def test_tape_identity_init_is_rope_on_vit():
    rope = make_model("vit", encoding="rope")
    tape = make_model("vit", encoding="tape", init_std=0.0)
    pixels = make_pixels(2)
    with torch.no_grad():
        assert (tape(pixel_values=pixels).logits - rope(pixel_values=pixels).logits).abs().max() < SAME_ATOL
        perturb(tape, 0.5)
        moved = tape(pixel_values=pixels).logits
    assert (moved - rope(pixel_values=pixels).logits).abs().max() > 1e-3  # the updates act on ViT too


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_tape_shift_invariance(family):
    """The updates commute with a common rotation of every state, so shifting all positions by a constant
    changes no output -- with updates large enough to change the outputs (checked against init_std=0)."""
    model = make_model(family, encoding="tape", init_std=0.5)
    ids = make_ids(2, 9)
    pos = torch.arange(9).expand(2, -1)
    with torch.no_grad():
        base = model(ids, position_ids=pos, use_cache=False).logits
        shifted = model(ids, position_ids=pos + 37, use_cache=False).logits
        rope_like = make_model(family, encoding="tape", init_std=0.0)(ids, position_ids=pos, use_cache=False).logits
    assert (base - shifted).abs().max() < 1e-4
    assert (base - rope_like).abs().max() > 1e-2


def test_tape_layer_updates_by_hand():
    """One layer: attend stores Ê = E + a ⊙ (α E) with a_h = Σ_e W_he (with and without the probabilities
    asked for: the SDPA form over [v | E] equals the full-matrix one); the MLP hook applies
    E' = Ê + D[silu(X m) ⊙ U Ê] over heads to the MLP output m; keys carry the states of their query heads."""
    info = text_info(heads=4, kv_heads=2, head_dim=4, layers=3, hidden=8)
    enc = build(Tape, "tape", info, init_std=0.5, position_size=3).double()
    b, n = 2, 5
    g = torch.Generator().manual_seed(1)
    q = torch.randn(b, 4, n, 4, generator=g, dtype=torch.float64)
    k = torch.randn(b, 2, n, 4, generator=g, dtype=torch.float64)
    v = torch.randn(b, 2, n, 4, generator=g, dtype=torch.float64)
    hidden = torch.randn(b, n, 8, generator=g, dtype=torch.float64)
    mlp_out = torch.randn(b, n, 8, generator=g, dtype=torch.float64)
    ctx = PosContext(encoding=enc, info=info, position_ids=torch.arange(n)[None] + 3, need_weights=True)
    q1, k1, v1 = enc.prepare(ctx, 0, hidden, q, k, v)
    assert q1 is q and k1.shape == (b, 2, n, 2 * (4 + 4)) and v1 is v
    state = ctx.memo[("tape_q_state", 0)]  # the queries' states, handed to attend (not cached)
    angles = (torch.arange(n)[:, None] + 3).double() * (1.0 / 10000 ** (torch.arange(0, 4, 2).double() / 4))
    e0 = torch.cat([angles.cos(), angles.sin()], -1)  # (n, 4)
    assert state.shape == (b, 4, n, 4) and (state - e0).abs().max() < 1e-6  # fp32 angles

    def rot(x, e):
        c, s = torch.cat([e[..., :2]] * 2, -1), torch.cat([e[..., 2:]] * 2, -1)
        return x * c + torch.cat([-x[..., 2:], x[..., :2]], -1) * s

    # kv head 1 holds query heads 2 and 3: k rotated by each head's state, then the two states
    assert (k1[:, 1, :, 0:4] - rot(k[:, 1], state[:, 2])).abs().max() < 1e-12
    assert (k1[:, 1, :, 4:8] - rot(k[:, 1], state[:, 3])).abs().max() < 1e-12
    assert torch.equal(k1[:, 1, :, 8:12], state[:, 2])
    assert torch.equal(k1[:, 1, :, 12:], state[:, 3])

    mask = text_mask(b, n, n, 0)
    out, probs = enc.attend(ctx, 0, q1, k1, v1, mask, 0.5, 0.0, False)
    got_hat = ctx.memo[("tape_attn_state", 0)]

    kk = k.repeat_interleave(2, dim=1)
    scores = rot(q, state) @ rot(kk, state).transpose(-1, -2) * 0.5
    alpha = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1).nan_to_num(0.0)  # padded rows: 0
    assert (probs - alpha).abs().max() < 1e-12
    assert (out - alpha @ v.repeat_interleave(2, dim=1)).abs().max() < 1e-12
    a = enc.attn_update[0].sum(-1)
    want_hat = state + a[None, :, None, None] * (alpha @ state)
    assert (got_hat - want_hat).abs().max() < 1e-12

    fast = PosContext(encoding=enc, info=info, position_ids=torch.arange(n)[None] + 3)  # no probabilities: SDPA
    enc.prepare(fast, 0, hidden, q, k, v)
    out2, probs2 = enc.attend(fast, 0, q1, k1, v1, mask, 0.5, 0.0, False)
    assert probs2 is None
    assert (out2 - out).abs().max() < 1e-12
    assert (fast.memo[("tape_attn_state", 0)] - want_hat).abs().max() < 1e-12

    assert torch.equal(enc("mlp_output", ctx, 0, mlp_out), mlp_out)  # the MLP output passes unchanged
    enc.prepare(ctx, 1, hidden, q, k, v)
    want = want_hat.clone()
    for bb, tok, hh, dd in itertools.product(range(b), range(n), range(4), range(4)):
        gate = torch.nn.functional.silu(enc.pe_x[0] @ mlp_out[bb, tok])  # (P,)
        up = enc.pe_up[0] @ want_hat[bb, :, tok, dd]  # (P,)
        want[bb, hh, tok, dd] += enc.pe_down[0][hh] @ (gate * up)
    assert (ctx.memo[("tape_q_state", 1)] - want).abs().max() < 1e-12


@pytest.mark.parametrize("family", ["llama", "gpt2", "vit"])
def test_tape_mlp_stage_reads_the_mlp_output_of_the_layer(family):
    """Oracle of one update in a whole model (the paper's Eq. for the MLP stage; the code's
    ``LlamaDecoderLayer.forward``: ``position_states = self.pe(self.mlp(...), position_states)``): the states
    layer 1 receives equal Ê^0 + D[silu(X m) ⊙ U Ê^0], with m the output of layer 0's MLP, captured by a hook
    of the test's own, and Ê^0 taken from layer 0's attention."""
    model = make_model(family, encoding="tape", init_std=0.5)
    enc = hf_posenc.encoding_module(model)
    base = model.model if family == "llama" else model.transformer if family == "gpt2" else model.vit
    layers = base.layers if family != "gpt2" else base.h
    seen = {}
    layers[0].mlp.register_forward_hook(lambda m, a, out: seen.__setitem__("m", out.detach().clone()))
    real_prepare, real_attend = enc.prepare, enc.attend

    def prepare(ctx, layer, hidden, q, k, v):
        out = real_prepare(ctx, layer, hidden, q, k, v)
        seen[("state", layer)] = ctx.memo[("tape_q_state", layer)].detach().clone()
        return out

    def attend(ctx, layer, *args):
        out = real_attend(ctx, layer, *args)
        if layer == 0:
            seen["hat"] = ctx.memo[("tape_attn_state", 0)].detach().clone()
        return out

    enc.prepare, enc.attend = prepare, attend
    with torch.no_grad():
        if family == "vit":
            model(pixel_values=make_pixels(2))
        else:
            model(make_ids(2, 7), use_cache=False)
    hat, m = seen["hat"], seen["m"]
    gate = torch.nn.functional.silu(m @ enc.pe_x[0].T)  # (B, L, P)
    up = torch.einsum("ph,bhld->bpld", enc.pe_up[0], hat)
    want = hat + torch.einsum("hp,bpld->bhld", enc.pe_down[0], gate.transpose(1, 2)[..., None] * up)
    assert (seen[("state", 1)] - want).abs().max() < 1e-6
    # and not the attention input of layer 1 (what an attention-only hook would see)
    assert (want - hat).abs().max() > 1e-4


def test_tape_position_size_default_is_the_authors():
    """Source: github.com/VITA-Group/TAPE config/adape.json (commit e1cddc37), the config its script/train.sh
    trains: ``"position_size": 48`` with ``"num_attention_heads": 12`` (4 × heads)."""
    info = ModelInfo("llama", 768, 12, 12, 64, 2, True, 1024)
    cfg = Tape.resolve(hf_posenc.PosEncConfig("tape"), info)
    assert cfg.params["position_size"] == 48
    assert Tape(cfg, info).pe_up.shape == (1, 48, 12)


def test_tape_parameters_and_validation():
    enc = build(Tape, "tape", text_info(layers=3, hidden=16), position_size=5)
    shapes = {n: tuple(p.shape) for n, p in enc.named_parameters()}
    assert shapes == {"attn_update": (2, 4, 4), "pe_up": (2, 5, 4), "pe_x": (2, 5, 16), "pe_down": (2, 4, 5)}
    zero = build(Tape, "tape", text_info(layers=3), init_std=0.0)
    assert zero.attn_update.abs().max() == 0 and zero.pe_up.abs().max() == 0 and zero.pe_x.abs().max() > 0
    assert list(build(Tape, "tape", text_info(layers=1)).parameters()) == []
    with pytest.raises(ValueError, match="even head_dim"):
        build(Tape, "tape", text_info(head_dim=3))
    with pytest.raises(ValueError):
        hf_posenc.PosEncConfig("tape", {"position_size": 0})
    with pytest.raises(ValueError):
        hf_posenc.PosEncConfig("tape", {"init_std": -1.0})


def test_tape_state_packing_in_16_bit():
    x = torch.randn(3, 7) * 3
    for dtype, tol in ((torch.bfloat16, 2.0**-15), (torch.float16, 2.0**-20)):
        packed = pack_state(x, dtype)
        assert packed.dtype == dtype and packed.shape == (3, 14)
        assert ((unpack_state(packed, 7, torch.float32) - x).abs() / x.abs()).max() < tol
    assert torch.equal(unpack_state(pack_state(x, torch.float32), 7, torch.float32), x)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tape_state_round_trips_as_fox_state(dtype):
    """TaPE's states in a 16-bit cache come back as FoX's gates do (one packing): in float16 the lo channel is
    stored scaled by 2^11, so states of small magnitude (1e-4 .. 1) keep 22 significant bits instead of losing
    lo to float16's subnormals (relative error 4e-3 at |x| ~ 1e-4 without the scale)."""
    from hf_posenc.encodings import fox

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 64, generator=g) * torch.logspace(-4, 1, 64)
    back = unpack_state(pack_state(x, dtype), 64, torch.float32)
    assert torch.equal(back, fox.unpack_state(fox.pack_state(x, dtype), 64, torch.float32))
    assert (((back - x).abs() / x.abs()).max() < 2.0**-15), ((back - x).abs() / x.abs()).max().item()


# ===================================================================================================
# all three: cache, padding, generation, checkpointing, bf16, finite differences
# ===================================================================================================

VARIANTS = {
    "cope": ("cope", dict(init_std=0.5, npos_max=4), 0.0),
    "sba": ("sba", {}, 0.0),
    "sba-current-diag": ("sba", dict(remainder="current", attend_current=True), 0.0),
    "sba-bias": ("sba", dict(remainder="bias"), 0.5),
    "tape": ("tape", dict(init_std=0.4), 0.0),
}


def variant_model(family: str, variant: str, **kw):
    name, params, noise = VARIANTS[variant]
    model = make_model(family, encoding=name, **params, **kw)
    if noise:
        perturb(model, noise)
    return model


STEPS = (6, 1, 2, 1)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_cache_matches_full_forward_left_padded(variant, family, cache):
    model = variant_model(family, variant)
    ids, mask = left_pad([make_ids(1, 7, seed=2)[0], make_ids(1, 10, seed=3)[0]])
    pos = positions_from_mask(mask)
    with torch.no_grad():
        full = model(ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
        past = DynamicCache(config=model.config) if cache == "dynamic" else StaticCache(config=model.config, max_cache_len=16)
        pieces, start = [], 0
        for n in STEPS:
            out = model(ids[:, start : start + n], attention_mask=mask[:, : start + n],
                        position_ids=pos[:, start : start + n], **with_cache(past), use_cache=True)
            pieces.append(out.logits)
            start += n
        alone = model(ids[:1, 3:], use_cache=False).logits
    real = mask.bool()
    inc = torch.cat(pieces, dim=1)
    assert (inc[real] - full[real]).abs().max() < CACHE_ATOL
    assert (full[0, 3:] - alone[0]).abs().max() < CACHE_ATOL


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_tape_grouped_path_equals_per_head_reference(family):
    """tape's attention reads the grouped cache through views (``_grouped_attention``); asking for the probabilities
    takes the per-head full-matrix form instead. Both give the same logits for a left-padded batch, whole and cached
    in pieces (single tokens and longer chunks)."""
    model = variant_model(family, "tape")
    ids, mask = left_pad([make_ids(1, 7, seed=2)[0], make_ids(1, 10, seed=3)[0]])
    pos = positions_from_mask(mask)

    def run(weights):
        with torch.no_grad():
            full = model(ids, attention_mask=mask, position_ids=pos, use_cache=False, output_attentions=weights).logits
            past, pieces, start = DynamicCache(config=model.config), [], 0
            for n in STEPS:
                pieces.append(model(ids[:, start: start + n], attention_mask=mask[:, : start + n],
                                    position_ids=pos[:, start: start + n], **with_cache(past),
                                    use_cache=True, output_attentions=weights).logits)
                start += n
        return full, torch.cat(pieces, dim=1)

    real = mask.bool()
    for a, b in zip(run(False), run(True)):
        assert (a[real] - b[real]).abs().max() < CACHE_ATOL


def greedy_recompute(model, ids, mask, n):
    with torch.no_grad():
        for _ in range(n):
            logits = model(ids, attention_mask=mask, position_ids=positions_from_mask(mask), use_cache=False).logits
            ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    return ids


def generate(model, ids, mask, beams, cache):
    kw = dict(max_new_tokens=5, min_new_tokens=5, pad_token_id=PAD_ID, do_sample=False, num_beams=beams,
              eos_token_id=None)
    if cache is None:
        kw["use_cache"] = False
    elif cache == "static":
        kw["cache_implementation"] = "static"
    return model.generate(ids, attention_mask=mask, **kw)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_generation_with_cache_equals_recompute(variant, family):
    """Greedy (dynamic and static cache) == a loop that recomputes the whole sequence; beam search (2 and 3
    beams, which reorders the cache) with a cache == without."""
    model = variant_model(family, variant)
    ids, mask = left_pad([make_ids(1, 5, seed=5)[0], make_ids(1, 8, seed=6)[0]])
    want = greedy_recompute(model, ids, mask, 5)
    for cache in ("dynamic", "static"):
        assert torch.equal(generate(model, ids, mask, 1, cache), want), f"greedy, {cache} cache"
    for beams in (2, 3):
        assert torch.equal(generate(model, ids, mask, beams, "dynamic"), generate(model, ids, mask, beams, None))


@pytest.mark.parametrize("reentrant", [False, True], ids=["default", "reentrant"])
@pytest.mark.parametrize(
    "variant,family",
    [(v, f) for v in ("cope", "sba-bias", "tape") for f in ("llama", "vit")
     if f in get_encoding(VARIANTS[v][0]).families],
)
def test_gradient_checkpointing_same_gradients(variant, family, reentrant):
    """With large parameters (tape: states that really change across layers, carried between layers by the
    per-forward context) checkpointing gives the gradients computed without it. (Every pair the encoding supports,
    from the registry: a skip for "sba does not support vit" outlived sba's ViT generalisation.)"""
    grads = []
    for ckpt in (False, True):
        model = variant_model(family, variant, train=True)
        if ckpt:
            enable_checkpointing(model, {"use_reentrant": reentrant})
        if family == "vit":
            out = model(pixel_values=make_pixels(2), labels=torch.tensor([0, 2]))
        else:
            ids = make_ids(2, 9)
            out = model(ids, labels=ids, use_cache=False)
        out.loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    g0, g1 = grads
    assert sorted(g0) == sorted(g1)
    enc_names = [n for n in g0 if ".posenc." in n]
    assert enc_names and all(g0[n].abs().sum() > 0 for n in enc_names)
    for n in g0:
        assert torch.allclose(g0[n], g1[n], atol=1e-6, rtol=1e-5), n


@pytest.mark.parametrize("variant", ["cope", "sba", "sba-bias", "tape"])
def test_bf16_long_sequence_finite(variant):
    """bf16, L = 2048, a tiny model (1 layer; tape 2, so its update parameters are used): finite outputs,
    loss and gradients, and logits near the float32 model's: within 0.2 of the encoding's own effect (the float32
    model against nope's, L2; measured 0.033 for cope, 0.016 tape, 0.007 sba)."""
    name, params, noise = VARIANTS[variant]
    layers = 2 if name == "tape" else 1
    over = dict(num_hidden_layers=layers, max_position_embeddings=4096)
    ids = make_ids(1, 2048, seed=7)
    logits = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = make_model("llama", encoding=name, train=True, dtype=dtype, config_overrides=over, **params)
        if noise:
            perturb(model, noise)
        out = model(ids, labels=ids, use_cache=False)
        logits[dtype] = out.logits.detach().float()
    assert torch.isfinite(out.logits).all() and torch.isfinite(out.loss)
    out.loss.backward()
    for n, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n
    with torch.no_grad():
        plain = make_model("llama", encoding="nope", config_overrides=over)(ids, use_cache=False).logits
    effect = (logits[torch.float32] - plain).norm()
    assert (logits[torch.bfloat16] - logits[torch.float32]).norm() <= 0.2 * effect


TINY_GPT2 = dict(n_embd=8, n_inner=8, n_layer=2, n_head=2, vocab_size=11)


@pytest.mark.parametrize("variant", ["cope", "sba-bias", "tape"])
def test_learned_parameters_gradcheck_model(variant):
    """Finite differences (float64, a whole tiny GPT-2, left-padded batch) of the logits w.r.t. every
    parameter of the encoding. (GPT-2: Llama's RMSNorm computes in float32 even in a float64 model, which
    makes its finite differences meaningless; grouped-query heads are checked below at the module level.)"""
    name, params, noise = VARIANTS[variant]
    if name == "cope":
        params = dict(params, npos_max=3)
    if name == "tape":
        params = dict(params, position_size=3)
    model = make_model("gpt2", encoding=name, dtype=torch.float64, config_overrides=TINY_GPT2, **params)
    if noise:
        perturb(model, noise)
    ids, mask = left_pad([torch.tensor([3, 4, 5]), torch.tensor([6, 7, 8, 9, 10])])
    kw = dict(attention_mask=mask, position_ids=positions_from_mask(mask), use_cache=False)
    names = [n for n, p in model.named_parameters() if ".posenc." in n]
    assert names

    def f(*values):
        return functional_call(model, dict(zip(names, values)), args=(ids,), kwargs=kw).logits[mask.bool()]

    values = tuple(dict(model.named_parameters())[n].detach().clone().requires_grad_(True) for n in names)
    assert torch.autograd.gradcheck(f, values)


@pytest.mark.parametrize("variant", ["cope", "sba-bias", "tape"])
def test_gradcheck_module_gqa(variant):
    """Finite differences (float64) of the encoding's own computation w.r.t. q, k, v (and the attention input
    for tape) and every parameter, with grouped-query heads, left padding and a decode offset (tape: two
    layers chained through its states, so every update parameter is reached)."""
    name, params, _ = VARIANTS[variant]
    cls = {"cope": Cope, "sba": StickBreaking, "tape": Tape}[name]
    extra = {"npos_max": 3} if name == "cope" else {"position_size": 3} if name == "tape" else {}
    info = text_info(heads=4, kv_heads=2, head_dim=4, layers=2, hidden=6)
    enc = build(cls, name, info, **dict(params, **extra)).double()
    if name == "sba":
        with torch.no_grad():
            enc.remainder_bias.normal_()
    names = [n for n, _ in enc.named_parameters()]
    b, q_len, k_len = 2, (4 if name == "tape" else 3), (4 if name == "tape" else 6)
    q, k, v = double_inputs(b, 4, 2, q_len, k_len, 4, scale=1.2)
    hidden = torch.randn(b, q_len, 6, dtype=torch.float64)
    mask = text_mask(b, q_len, k_len, k_len - q_len)
    ctx_kw = dict(q_offset=k_len - q_len, position_ids=torch.arange(q_len)[None])

    def f(q, k, v, hidden, *values):
        ctx = PosContext(encoding=enc, info=info, **ctx_kw)
        params = dict(zip(names, values))
        if name != "tape":
            return functional_call(enc, params, ("attend", ctx, 1, q, k, v, mask, 0.5, 0.0, False))[0]
        out = None
        for layer in (0, 1):
            q1, k1, v1 = functional_call(enc, params, ("prepare", ctx, layer, hidden, q, k, v))
            out = functional_call(enc, params, ("attend", ctx, layer, q1, k1, v1, mask, 0.5, 0.0, False))[0]
            if layer == 0:  # ``hidden`` stands for layer 0's MLP output
                functional_call(enc, params, ("mlp_output", ctx, layer, hidden))
        return out

    args = tuple(t.detach().clone().requires_grad_(True) for t in (q, k, v, hidden, *enc.parameters()))
    assert torch.autograd.gradcheck(f, args)


def test_rotate_half_by_is_apply_rotary_bit_for_bit():
    """tape's rotation from factors built once (``rope.half_rotation``) is ``apply_rotary``'s "half" layout to the
    bit, broadcasting a key over the query heads of its group."""
    from hf_posenc.encodings.rope import apply_rotary, half_rotation, rotate_half_by

    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.float64):
        x = torch.randn(2, 3, 5, 8, generator=g, dtype=dtype)
        cos, sin = torch.randn(2, 3, 5, 4, generator=g, dtype=dtype), torch.randn(2, 3, 5, 4, generator=g, dtype=dtype)
        assert torch.equal(rotate_half_by(x, half_rotation(cos, sin)), apply_rotary(x, cos, sin, "half"))
        k = torch.randn(2, 1, 5, 8, generator=g, dtype=dtype)
        assert torch.equal(rotate_half_by(k, half_rotation(cos, sin)), apply_rotary(k.expand(2, 3, 5, 8), cos, sin, "half"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [False, True])
def test_tape_grouped_attention_equals_per_head_attention(dtype, masked):
    """tape's attention reads the cache's grouped layout through views (key/value heads as the batch): its outputs
    and state aggregates equal per-head softmax attention on the same keys, values and states, with and without a
    mask (a row that sees no key gives zeros), from a float32 and a bfloat16 (packed) cache; causal with queries =
    keys too, with the gradients of per-head copies."""
    from hf_posenc.encodings import tape as tape_module

    g = torch.Generator().manual_seed(4)
    b, hkv, groups, q_len, k_len, d = 2, 2, 3, 2, 9, 8
    h = hkv * groups
    q = torch.randn(b, h, q_len, d, generator=g)
    k = torch.randn(b, h, k_len, d, generator=g)
    st = torch.randn(b, h, k_len, d, generator=g)
    v = torch.randn(b, hkv, k_len, d, generator=g)
    grouped = lambda t: t.unflatten(1, (hkv, groups)).transpose(2, 3).reshape(b, hkv, k_len, groups * d)  # noqa: E731
    key = torch.cat([grouped(k).to(dtype), pack_state(grouped(st), dtype)], dim=-1)
    k_read = key[..., : groups * d].float().unflatten(-1, (groups, d)).transpose(2, 3).reshape(b, h, k_len, d)
    st_read = unpack_state(key[..., groups * d:], groups * d, torch.float32)
    st_read = st_read.unflatten(-1, (groups, d)).transpose(2, 3).reshape(b, h, k_len, d)
    allowed = None
    if masked:
        allowed = torch.ones(b, 1, q_len, k_len, dtype=torch.bool)
        allowed[0, :, 0, 4:] = False
        allowed[1, :, 1] = False  # sees no key
    out, agg = tape_module._grouped_attention(q, key, v, True, allowed, False, 0.3)
    scores = (q @ k_read.transpose(-1, -2)) * 0.3
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.nan_to_num(torch.softmax(scores, -1), nan=0.0)
    torch.testing.assert_close(out, probs @ v.repeat_interleave(groups, dim=1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(agg, probs @ st_read, rtol=1e-5, atol=1e-6)
    if masked:
        assert torch.equal(out[1, :, 1], torch.zeros_like(out[1, :, 1]))
    assert tape_module._grouped_attention(q, key, v, False, allowed, False, 0.3)[1] is None
    if dtype == torch.float32 and not masked:  # causal, queries = keys, gradients against per-head copies
        qc = torch.randn(b, h, k_len, d, generator=g, requires_grad=True)
        keyc, vc = key.clone().requires_grad_(True), v.clone().requires_grad_(True)
        out, agg = tape_module._grouped_attention(qc, keyc, vc, True, None, True, 0.3)
        (out.square().sum() + agg.sin().sum()).backward()
        got = [t.grad.clone() for t in (qc, keyc, vc)]
        for t in (qc, keyc, vc):
            t.grad = None
        per_head = lambda t: t.unflatten(-1, (groups, d)).transpose(2, 3).reshape(b, h, k_len, d)  # noqa: E731
        k_h, st_h = per_head(keyc[..., : groups * d]), per_head(keyc[..., groups * d:])
        v_h = vc.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(qc, k_h, v_h, is_causal=True, scale=0.3)
        agg = F.scaled_dot_product_attention(qc, k_h, st_h, is_causal=True, scale=0.3)
        (out.square().sum() + agg.sin().sum()).backward()
        for a, w in zip(got, (qc.grad, keyc.grad, vc.grad)):
            torch.testing.assert_close(a, w, rtol=1e-5, atol=1e-6)
