"""``fox`` and ``fox_pro`` beyond the common property tests: brute-force oracles of the formulas, gates at 1,
generation with the cache against recomputation, the cache state (crop, hi/lo precision), numerical
stability (bf16 at L = 2048, extreme logits) and finite-difference gradients of every parameter."""

from __future__ import annotations

import math

import pytest
import torch
from torch.func import functional_call
from transformers import DynamicCache

import hf_posenc
from hf_posenc.config import PosEncConfig
from hf_posenc.encodings.base import ModelInfo, PosContext
from hf_posenc.encodings import fox_pro as fox_pro_module
from hf_posenc.encodings.fox import forgetting_attention, pack_state, unpack_state
from hf_posenc.registry import get_encoding
from conftest import (
    EOS_ID,
    PAD_ID,
    left_pad,
    make_ids,
    make_model,
    model_inputs,
    positions_from_mask,
    tiered,
    with_cache,
)

# ---------------------------------------------------------------------------------------------------
# helpers: a bare encoding and its attention, outside any model
# ---------------------------------------------------------------------------------------------------


def bare(name: str, *, heads=4, kv_heads=2, head_dim=6, hidden=10, causal=True, dtype=torch.float64, seed=0, layers=1,
         **params):
    """A fox / fox_pro module for a one-layer model of the given shape, every parameter random (so that the
    norms' and gates' weights are not trivially 1 or 0)."""
    info = ModelInfo(
        family="llama" if causal else "vit",
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        num_layers=layers,
        causal=causal,
        max_positions=None,
        grid=None if causal else (2, 2),
        patch_size=None if causal else (8, 8),
        initializer_range=0.5,
    )
    spec = get_encoding(name)
    config = spec.cls.resolve(PosEncConfig(name, params), info)
    torch.manual_seed(seed)
    enc = spec.cls(config, info).to(dtype)
    with torch.no_grad():
        for p in enc.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return enc, info


def ctx_for(enc, info, length: int, batch: int, grid=None) -> PosContext:
    pos = None if grid else torch.arange(length).expand(batch, -1)
    return PosContext(encoding=enc, info=info, position_ids=pos, grid=grid)


def run_attention(enc, ctx, hidden, q, k, v, mask, scaling, params=None):
    """prepare -> attend (-> finish for fox_pro): out (B, L, H, D)."""
    call = (lambda *a: enc(*a)) if params is None else (lambda *a: functional_call(enc, params, a))
    q2, k2, v2 = call("prepare", ctx, 0, hidden, q, k, v)
    out, probs = call("attend", ctx, 0, q2, k2, v2, mask, scaling, 0.0, False)
    out = out.transpose(1, 2)
    if getattr(enc, "finishes_output", False):
        out = call("finish", ctx, 0, hidden, out)
    return out


def random_inputs(enc, info, batch, length, dtype=torch.float64, seed=1):
    g = torch.Generator().manual_seed(seed)
    h, hkv, d, c = info.num_heads, info.num_kv_heads, info.head_dim, info.hidden_size
    hidden = torch.randn(batch, length, c, generator=g, dtype=dtype)
    q = torch.randn(batch, h, length, d, generator=g, dtype=dtype)
    k = torch.randn(batch, hkv, length, d, generator=g, dtype=dtype)
    v = torch.randn(batch, hkv, length, d, generator=g, dtype=dtype)
    return hidden, q, k, v


def padded_mask(real: torch.Tensor) -> torch.Tensor:
    """(B, 1, L, L) bool: causal and not padding, as transformers builds it."""
    n = real.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    return (causal[None] & real[:, None, :])[:, None]


def sig(x: torch.Tensor) -> float:
    return 1.0 / (1.0 + math.exp(-float(x)))


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean() + eps) * w


# ---------------------------------------------------------------------------------------------------
# brute-force oracles (explicit loops, float64)
# ---------------------------------------------------------------------------------------------------


def brute_fox(enc, hidden, q, k, v, real, scaling):
    """o_i = Σ_j F_ij exp(s q_i·k_j) v_j / Σ_j F_ij exp(s q_i·k_j), F_ij = Π_{l=j+1..i} σ(w_h·x_l + b_h),
    over the real keys j <= i; (B, L, H, D), zeros on padded query rows."""
    w, b = enc.gate_weight[0].detach(), enc.gate_bias[0].detach()
    bsz, heads, n, d = q.shape
    groups = heads // k.shape[1]
    out = torch.zeros(bsz, n, heads, d, dtype=torch.float64)
    for bb in range(bsz):
        for h in range(heads):
            for i in range(n):
                if not real[bb, i]:
                    continue
                num, den = torch.zeros(d, dtype=torch.float64), 0.0
                for j in range(i + 1):
                    if not real[bb, j]:
                        continue
                    forget = 1.0
                    for l in range(j + 1, i + 1):
                        forget *= sig(w[h] @ hidden[bb, l] + b[h])
                    e = forget * math.exp(scaling * float(q[bb, h, i] @ k[bb, h // groups, j]))
                    num += e * v[bb, h // groups, j]
                    den += e
                out[bb, i, h] = num / den
    return out


def brute_fox_vit(enc, hidden, q, k, v, scaling):
    """Bidirectional: F_ij = Π_{l=j+1..i} f_l (j <= i), Π_{l=i..j-1} g_l (j > i); 1 on pairs with CLS (index 0)."""
    w, b = enc.gate_weight[0].detach(), enc.gate_bias[0].detach()
    wb, bb_ = enc.gate_weight_bwd[0].detach(), enc.gate_bias_bwd[0].detach()
    bsz, heads, n, d = q.shape
    out = torch.zeros(bsz, n, heads, d, dtype=torch.float64)
    for bb in range(bsz):
        for h in range(heads):
            for i in range(n):
                num, den = torch.zeros(d, dtype=torch.float64), 0.0
                for j in range(n):
                    forget = 1.0
                    if i != 0 and j != 0:
                        span = range(j + 1, i + 1) if j <= i else range(i, j)
                        for l in span:
                            if j <= i:
                                forget *= sig(w[h] @ hidden[bb, l] + b[h])
                            else:
                                forget *= sig(wb[h] @ hidden[bb, l] + bb_[h])
                    e = forget * math.exp(scaling * float(q[bb, h, i] @ k[bb, h, j]))
                    num += e * v[bb, h, j]
                    den += e
                out[bb, i, h] = num / den
    return out


def brute_fox_pro(enc, hidden, q, k, v, real, scaling):
    """FoX Pro by loops: token shift of raw k, v from the previous real token (zero before the first),
    QK-norm, forgetting attention, output norm and sigmoid output gate."""
    p = {n: t.detach()[0] for n, t in enc.named_parameters()}
    bsz, heads, n, d = q.shape
    hkv = k.shape[1]
    ks, vs = torch.zeros_like(k), torch.zeros_like(v)
    for bb in range(bsz):
        for g in range(hkv):
            for t in range(n):
                ak = sig(p["key_shift_weight"][g] @ hidden[bb, t])
                av = sig(p["value_shift_weight"][g] @ hidden[bb, t])
                has_prev = t > 0 and bool(real[bb, t - 1])
                kp = k[bb, g, t - 1] if has_prev else torch.zeros(d, dtype=torch.float64)
                vp = v[bb, g, t - 1] if has_prev else torch.zeros(d, dtype=torch.float64)
                ks[bb, g, t] = rms(ak * kp + (1 - ak) * k[bb, g, t], p["k_norm_weight"][g], 1e-5)
                vs[bb, g, t] = av * vp + (1 - av) * v[bb, g, t]
    qs = torch.zeros_like(q)
    for bb in range(bsz):
        for h in range(heads):
            for t in range(n):
                qs[bb, h, t] = rms(q[bb, h, t], p["q_norm_weight"][h], 1e-5)
    o = brute_fox(enc, hidden, qs, ks, vs, real, scaling)
    out = torch.zeros_like(o)
    for bb in range(bsz):
        for t in range(n):
            gate = torch.sigmoid(p["out_gate_weight"] @ hidden[bb, t]).view(heads, d)
            for h in range(heads):
                out[bb, t, h] = gate[h] * rms(o[bb, t, h], p["out_norm_weight"][h], 1e-6)
    return out


@pytest.mark.parametrize("name", ["fox", "fox_pro"])
def test_matches_brute_force_with_gqa_and_padding(name):
    """prepare + attend (+ finish) equal the explicit loops in float64: GQA (4 query heads on 2 kv heads),
    a left-padded row and an unpadded one."""
    enc, info = bare(name)
    bsz, n = 2, 6
    hidden, q, k, v = random_inputs(enc, info, bsz, n)
    real = torch.ones(bsz, n, dtype=torch.bool)
    real[0, :2] = False
    scaling = info.head_dim**-0.5
    got = run_attention(enc, ctx_for(enc, info, n, bsz), hidden, q, k, v, padded_mask(real), scaling)
    brute = brute_fox if name == "fox" else brute_fox_pro
    want = brute(enc, hidden, q, k, v, real, scaling)
    assert (got[real] - want[real]).abs().max() < 1e-10


@pytest.mark.parametrize("name", ["fox", "fox_pro"])
def test_decode_through_cache_state_matches_brute_force(name):
    """The state appended to k and v carries everything: prefill 3 tokens, then 1, then 2, concatenating k and v
    along the key axis as a DynamicCache does, gives the brute-force result for every new query."""
    enc, info = bare(name)
    bsz, n = 2, 6
    hidden, q, k, v = random_inputs(enc, info, bsz, n)
    scaling = info.head_dim**-0.5
    brute = brute_fox if name == "fox" else brute_fox_pro
    want = brute(enc, hidden, q, k, v, torch.ones(bsz, n, dtype=torch.bool), scaling)
    keys = values = None
    for start, stop in ((0, 3), (3, 4), (4, 6)):
        pos = torch.arange(start, stop).expand(bsz, -1)
        ctx = PosContext(encoding=enc, info=info, position_ids=pos, q_offset=start)
        sl = slice(start, stop)
        q2, k2, v2 = enc("prepare", ctx, 0, hidden[:, sl], q[:, :, sl], k[:, :, sl], v[:, :, sl])
        keys = k2 if keys is None else torch.cat([keys, k2], dim=2)
        values = v2 if values is None else torch.cat([values, v2], dim=2)
        mask = padded_mask(torch.ones(bsz, stop, dtype=torch.bool))[:, :, start:stop]
        out, _ = enc("attend", ctx, 0, q2, keys, values, mask, scaling, 0.0, False)
        out = out.transpose(1, 2)
        if name == "fox_pro":
            out = enc("finish", ctx, 0, hidden[:, sl], out)
        assert (out - want[:, sl]).abs().max() < 1e-10, f"tokens {start}..{stop}"


@pytest.mark.parametrize("name", ["fox", "fox_pro"])
def test_vit_bidirectional_matches_brute_force(name):
    """ViT: forward gates for keys at or before the query, backward gates for keys after it (raster order),
    no term on CLS pairs; fox_pro shifts each patch from the previous patch (not from CLS)."""
    enc, info = bare(name, heads=2, kv_heads=2, causal=False)
    bsz, n = 2, 5  # CLS + a 2x2 grid
    hidden, q, k, v = random_inputs(enc, info, bsz, n)
    scaling = info.head_dim**-0.5
    ctx = ctx_for(enc, info, n, bsz, grid=(2, 2))
    got = run_attention(enc, ctx, hidden, q, k, v, None, scaling)
    if name == "fox":
        want = brute_fox_vit(enc, hidden, q, k, v, scaling)
    else:
        p = {nm: t.detach()[0] for nm, t in enc.named_parameters()}
        ks, vs, qs = torch.zeros_like(k), torch.zeros_like(v), torch.zeros_like(q)
        for bb in range(bsz):
            for g in range(2):
                for t in range(n):
                    ak = 0.0 if t == 0 else sig(p["key_shift_weight"][g] @ hidden[bb, t])
                    av = 0.0 if t == 0 else sig(p["value_shift_weight"][g] @ hidden[bb, t])
                    kp = k[bb, g, t - 1] if t >= 2 else torch.zeros(info.head_dim, dtype=torch.float64)
                    vp = v[bb, g, t - 1] if t >= 2 else torch.zeros(info.head_dim, dtype=torch.float64)
                    ks[bb, g, t] = rms(ak * kp + (1 - ak) * k[bb, g, t], p["k_norm_weight"][g], 1e-5)
                    vs[bb, g, t] = av * vp + (1 - av) * v[bb, g, t]
                    qs[bb, g, t] = rms(q[bb, g, t], p["q_norm_weight"][g], 1e-5)
        o = brute_fox_vit(enc, hidden, qs, ks, vs, scaling)
        want = torch.zeros_like(o)
        for bb in range(bsz):
            for t in range(n):
                gate = torch.sigmoid(p["out_gate_weight"] @ hidden[bb, t]).view(2, info.head_dim)
                for h in range(2):
                    want[bb, t, h] = gate[h] * rms(o[bb, t, h], p["out_norm_weight"][h], 1e-6)
    assert (got - want).abs().max() < 1e-10


# ---------------------------------------------------------------------------------------------------
# gates fixed at 1
# ---------------------------------------------------------------------------------------------------


def open_gates(model) -> None:
    """w = 0, b = +1e4: log f = logsigmoid(1e4) = 0 exactly in float32, i.e. every gate is 1."""
    enc = hf_posenc.encoding_module(model)
    with torch.no_grad():
        for name, p in enc.named_parameters():
            if name.startswith("gate_weight"):
                p.zero_()
            elif name.startswith("gate_bias"):
                p.fill_(1e4)


@pytest.mark.parametrize("family", ["llama", "gpt2", "vit"])
def test_gates_at_one_equal_nope(family):
    """fox with every forget gate at 1 is attention without position encoding (same base weights), on a
    left-padded batch for the decoders."""
    fox = make_model(family, encoding="fox")
    nope = make_model(family, encoding="nope")
    open_gates(fox)
    with torch.no_grad():
        if family == "vit":
            inputs = model_inputs(family)
            got, want = fox(**inputs).logits, nope(**inputs).logits
        else:
            ids, mask = left_pad([make_ids(1, 6, seed=2)[0], make_ids(1, 9, seed=3)[0]])
            kw = dict(attention_mask=mask, position_ids=positions_from_mask(mask), use_cache=False)
            real = mask.bool()
            got, want = fox(ids, **kw).logits[real], nope(ids, **kw).logits[real]
    assert (got - want).abs().max() < 1e-5


def test_gates_at_one_with_rope_equal_unpatched_llama():
    """fox(rope=True) with gates at 1 is Llama's own rotary attention: the unpatched model's logits."""
    native = make_model("llama")
    fox = make_model("llama", encoding="fox", rope=True, rope_theta=native.config.rope_parameters["rope_theta"])
    open_gates(fox)
    ids = make_ids(2, 12)
    with torch.no_grad():
        assert (fox(ids).logits - native(ids).logits).abs().max() < 1e-5


def test_gates_change_the_output():
    """Sanity: with its random gates fox differs from nope (the oracle above is not void)."""
    fox, nope = make_model("llama", encoding="fox"), make_model("llama", encoding="nope")
    ids = make_ids(2, 10)
    with torch.no_grad():
        assert (fox(ids).logits - nope(ids).logits).abs().max() > 1e-2


# ---------------------------------------------------------------------------------------------------
# generation: cache == recomputation
# ---------------------------------------------------------------------------------------------------

NEW = 8


def recompute_greedy(model, ids, mask, n):
    with torch.no_grad():
        for _ in range(n):
            logits = model(ids, attention_mask=mask, position_ids=positions_from_mask(mask), use_cache=False).logits
            logits = logits[:, -1].clone()
            logits[:, EOS_ID] = -float("inf")
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    return ids


def generate(model, ids, mask, cache, **kw):
    kw = dict(max_new_tokens=NEW, min_new_tokens=NEW, pad_token_id=PAD_ID, do_sample=False, **kw)
    if cache is None:
        kw["use_cache"] = False
    elif cache == "static":
        kw["cache_implementation"] = "static"
    return model.generate(ids, attention_mask=mask, **kw)


GEN = [
    pytest.param(fam, enc, params, id=f"{fam}-{enc}{'-rope' if params else ''}")
    for fam in ("llama", "gpt2")
    for enc, params in (("fox", {}), ("fox_pro", {}))
] + [pytest.param("llama", "fox", {"rope": True}, id="llama-fox-rope")]


@pytest.mark.parametrize("family,name,params", GEN)
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_greedy_with_cache_equals_recomputing(family, name, params, cache):
    """Greedy decoding of 8 tokens on a left-padded batch: with a cache, the tokens of a loop that recomputes
    the full sequence at every step."""
    model = make_model(family, encoding=name, **params)
    ids, mask = left_pad([make_ids(1, 5, seed=5)[0], make_ids(1, 9, seed=6)[0]])
    with torch.no_grad():
        got = generate(model, ids, mask, cache)
    assert torch.equal(got, recompute_greedy(model, ids, mask, NEW))


@pytest.mark.parametrize("family,name,params", GEN)
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_beam_search_with_cache_equals_recomputing(family, name, params, cache):
    """Beam search (3 beams, so the cache is reordered at every step) gives the tokens of beam search
    without a cache, which recomputes the full sequences at every step."""
    model = make_model(family, encoding=name, **params)
    ids, mask = left_pad([make_ids(1, 5, seed=7)[0], make_ids(1, 8, seed=8)[0]])
    with torch.no_grad():
        got = generate(model, ids, mask, cache, num_beams=3)
        want = generate(model, ids, mask, None, num_beams=3)
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", ["fox", "fox_pro"])
def test_cache_crop_keeps_the_state(name):
    """DynamicCache.crop drops the state of the cropped tokens with them: crop after 9 tokens to 5, feed
    tokens 5..8 again (with other tokens in between first), and get the logits of the full forward."""
    model = make_model("llama", encoding=name)
    ids = make_ids(2, 9)
    other = make_ids(2, 4, seed=9)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        past = DynamicCache(config=model.config)
        model(ids[:, :5], **with_cache(past))
        model(other, **with_cache(past))  # tokens that are then cropped away
        past.crop(-other.shape[1])  # transformers 5.x: a negative count of tokens to remove
        assert past.get_seq_length() == 5
        again = model(ids[:, 5:], **with_cache(past)).logits
    assert (again - full[:, 5:]).abs().max() < 1e-4


# ---------------------------------------------------------------------------------------------------
# precision of the cached state
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_hi_lo_state_keeps_float32_precision(dtype):
    """log-gates stored in a 16-bit cache as hi/lo come back to 2^-15 relative (+1e-11 absolute for the tiny
    log-gates of gates near 1 in float16; bf16 alone: 2^-8), and their float32 cumulative sum over 4096
    tokens stays within 3e-3 (20 times better than a single 16-bit channel)."""
    g = torch.Generator().manual_seed(0)
    x = torch.nn.functional.logsigmoid(3 * torch.randn(2, 3, 4096, 5, generator=g))
    packed = pack_state(x, dtype)
    assert packed.dtype == dtype and packed.shape[-1] == 10
    back = unpack_state(packed, 5, torch.float32)
    err = (back - x).abs()
    assert (err <= 2**-15 * x.abs() + 1e-11).all(), (err / x.abs()).max().item()
    exact = x.double().cumsum(-2)
    split_error = (back.cumsum(-2) - exact).abs().max().item()
    one_error = (x.to(dtype).float().cumsum(-2) - exact).abs().max().item()
    # c reaches ~ -2000 here; its float32 rounding alone is ~2e-4, a bf16 logit of size 10 is off by ~2e-2
    assert split_error < 3e-3, split_error
    assert one_error > 20 * split_error, (one_error, split_error)  # without the split the sum drifts


def test_hi_lo_passes_gradients():
    x = torch.randn(7, 3, dtype=torch.float32, requires_grad=True)
    unpack_state(pack_state(x, torch.bfloat16), 3, torch.float32).sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


#: bf16 cache against the bf16 full forward: the L2 error of the logits as a fraction of the encoding's own effect
#: (the bf16 full forward against a bf16 ``nope`` model's). Measured 0.0 (bit-equal logits) for both (2-core AMD
#: EPYC, torch 2.13); each decoding step's gate cached 5% off gives 0.035 for fox, with a largest error of 0.23,
#: inside the old bound (0.05 * max + 0.05 = 0.24 on logits of about 4).
BF16_CACHE_OF_EFFECT = 0.02


@pytest.mark.parametrize("name", ["fox", "fox_pro"])
def test_bf16_cache_matches_bf16_full_forward(name):
    """A bf16 model: the cache (bf16 keys + hi/lo state) gives the full forward's logits up to bf16 rounding, a small
    fraction of what the encoding changes (BF16_CACHE_OF_EFFECT)."""
    model = make_model("llama", encoding=name, dtype=torch.bfloat16)
    nope = make_model("llama", encoding="nope", dtype=torch.bfloat16)
    ids = make_ids(2, 12)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits.float()
        effect = (full - nope(ids, use_cache=False).logits.float()).norm().item()
        past = DynamicCache(config=model.config)
        pieces = [model(ids[:, :6], **with_cache(past)).logits]
        pieces += [model(ids[:, i : i + 1], **with_cache(past)).logits for i in range(6, 12)]
    inc = torch.cat(pieces, dim=1).float()
    error = (inc - full).norm().item()
    assert error <= BF16_CACHE_OF_EFFECT * effect, f"{name}: cache off by {error:.3g}, {error / effect:.3f} of the effect"


# ---------------------------------------------------------------------------------------------------
# numerical stability
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["fox", "fox_pro"])
def test_bf16_long_sequence_finite(name):
    """bf16, L = 2048, one layer, training mode: finite logits, loss and gradients, and every encoding
    parameter gets a gradient."""
    torch.manual_seed(0)
    model = make_model(
        "llama", encoding=name, train=True, dtype=torch.bfloat16, config_overrides={"num_hidden_layers": 1}
    )
    ids = make_ids(1, 2048)
    out = model(ids, labels=ids, use_cache=False)
    assert torch.isfinite(out.logits).all() and torch.isfinite(out.loss)
    out.loss.backward()
    for n, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n
    for n, p in hf_posenc.encoding_module(model).named_parameters():
        assert p.grad.abs().sum() > 0, n


@pytest.mark.parametrize("name", ["fox", "fox_pro"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extreme_logits_stay_finite(name, dtype):
    """Scaled q·k of ±1e4 and gate logits of ±1e4 (log f = -1e4: a gate at 0): finite outputs and gradients,
    and the probabilities still sum to 1."""
    enc, info = bare(name, dtype=dtype)
    bsz, n = 2, 16
    hidden, q, k, v = random_inputs(enc, info, bsz, n, dtype=torch.float32)
    d = info.head_dim
    scaling = d**-0.5
    # unit-norm q and k scaled so that |q·k| * scaling reaches 1e4
    q = q / q.norm(dim=-1, keepdim=True) * math.sqrt(1e4 / scaling)
    k = k / k.norm(dim=-1, keepdim=True) * math.sqrt(1e4 / scaling)
    k[:, :, ::2] *= -1
    hidden = hidden / hidden.norm(dim=-1, keepdim=True) * 1e4 / info.initializer_range
    leaves = [t.to(dtype).requires_grad_() for t in (hidden, q, k, v)]
    real = torch.ones(bsz, n, dtype=torch.bool)
    real[0, :3] = False
    ctx = ctx_for(enc, info, n, bsz)
    q2, k2, v2 = enc("prepare", ctx, 0, *leaves)
    out, probs = enc("attend", ctx, 0, q2, k2, v2, padded_mask(real), scaling, 0.0, False)
    if name == "fox_pro":
        out = enc("finish", ctx, 0, leaves[0], out.transpose(1, 2))
    assert torch.isfinite(out).all() and torch.isfinite(probs).all()
    rows = probs.sum(-1)[real[:, None, :].expand(-1, info.num_heads, -1)]
    assert (rows - 1).abs().max() < 1e-5
    out.float().square().sum().backward()
    for t in leaves + list(enc.parameters()):
        assert torch.isfinite(t.grad).all()


# ---------------------------------------------------------------------------------------------------
# gradients against finite differences (float64)
# ---------------------------------------------------------------------------------------------------


GRADCHECK_CASES = [("fox", True, "fox"), ("fox_pro", True, "fox_pro"), ("fox", False, "fox-vit"),
                   ("fox_pro", False, "fox_pro-vit")]


@pytest.mark.parametrize(
    "name,causal", tiered([pytest.param(n, c, id=i) for n, c, i in GRADCHECK_CASES], fast=["fox"])
)
def test_gradcheck(name, causal):
    """torch.autograd.gradcheck of prepare -> attend (-> finish) in float64 with respect to every parameter of
    the encoding (forget gates, shift gates, norms, output gate) and to the attention input, q, k and v;
    GQA and a padded row on text, the bidirectional form on ViT."""
    heads, kv = (2, 1) if causal else (2, 2)
    enc, info = bare(name, heads=heads, kv_heads=kv, head_dim=4, hidden=5, causal=causal)
    bsz, n = (2, 4) if causal else (1, 5)
    hidden, q, k, v = random_inputs(enc, info, bsz, n)
    names = [nm for nm, _ in enc.named_parameters()]
    params = [p.detach().clone().requires_grad_() for p in enc.parameters()]
    if causal:
        real = torch.ones(bsz, n, dtype=torch.bool)
        real[0, 0] = False
        mask, grid = padded_mask(real), None
    else:
        real, mask, grid = torch.ones(bsz, n, dtype=torch.bool), None, (2, 2)
    ctx = ctx_for(enc, info, n, bsz, grid=grid)

    def fn(*tensors):
        ps = dict(zip(names, tensors[: len(names)]))
        out = run_attention(enc, ctx, *tensors[len(names) :], mask, 0.5, params=ps)
        return out[real]  # padded query rows are all-masked (their output is a constant 0)

    inputs = tuple(params) + tuple(t.requires_grad_() for t in (hidden, q, k, v))
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------
# parameters and configuration
# ---------------------------------------------------------------------------------------------------


def test_initialisation_follows_the_code():
    """Forget gate: w ~ N(0, initializer_range), b = 0; fox_pro: norms at 1, shift and output gate weights
    ~ N(0, initializer_range); shapes per layer, GQA-aware."""
    model = make_model("llama", encoding="fox_pro")
    enc = hf_posenc.encoding_module(model)
    cfg = model.config
    hd = cfg.hidden_size // cfg.num_attention_heads
    shapes = {n: tuple(p.shape) for n, p in enc.named_parameters()}
    assert shapes == {
        "gate_weight": (2, 4, 32),
        "gate_bias": (2, 4),
        "key_shift_weight": (2, 2, 32),
        "value_shift_weight": (2, 2, 32),
        "q_norm_weight": (2, 4, hd),
        "k_norm_weight": (2, 2, hd),
        "out_norm_weight": (2, 4, hd),
        "out_gate_weight": (2, 4 * hd, 32),
    }
    assert torch.equal(enc.gate_bias, torch.zeros_like(enc.gate_bias))
    for n in ("q_norm_weight", "k_norm_weight", "out_norm_weight"):
        assert torch.equal(getattr(enc, n), torch.ones_like(getattr(enc, n)))
    for n in ("gate_weight", "out_gate_weight"):
        std = getattr(enc, n).std().item()
        assert 0.8 * cfg.initializer_range < std < 1.2 * cfg.initializer_range, (n, std)
    vit = hf_posenc.encoding_module(make_model("vit", encoding="fox"))
    names = sorted(n for n, _ in vit.named_parameters())
    assert names == ["gate_bias", "gate_bias_bwd", "gate_weight", "gate_weight_bwd"]


def test_config_params():
    model = make_model("gpt2", encoding="fox")
    assert model.config.position_encoding == {"name": "fox", "rope": False, "rope_theta": None}
    # Source: the official code's rope_base = 500000.0 (zhixuan-lin/forgetting-transformer,
    # src/forgetting_transformer/model/forgetting_transformer/configuration_forgetting_transformer.py), on every family
    for family in ("gpt2", "llama"):
        model = make_model(family, encoding="fox", rope=True)
        assert model.config.position_encoding["rope_theta"] == 500000.0
    with pytest.raises(TypeError):
        make_model("gpt2", encoding="fox", rope="yes")
    with pytest.raises(ValueError):
        make_model("gpt2", encoding="fox_pro", rope=True)


@pytest.mark.parametrize("name", ["fox", "fox_pro"])
def test_packed_documents_equal_documents_alone(name):
    """A block-diagonal causal mask (two documents packed in one row) gives each document's own outputs: the
    forget bias and the token shift do not cross the document boundary."""
    enc, info = bare(name)
    n, cut = 7, 3
    hidden, q, k, v = random_inputs(enc, info, 1, n)
    doc = torch.tensor([0] * cut + [1] * (n - cut))
    mask = (torch.ones(n, n, dtype=torch.bool).tril() & (doc[:, None] == doc[None, :]))[None, None]
    scaling = info.head_dim**-0.5
    packed = run_attention(enc, ctx_for(enc, info, n, 1), hidden, q, k, v, mask, scaling)
    for sl in (slice(0, cut), slice(cut, n)):
        m = sl.stop - sl.start
        alone = run_attention(
            enc, ctx_for(enc, info, m, 1), hidden[:, sl], q[:, :, sl], k[:, :, sl], v[:, :, sl],
            padded_mask(torch.ones(1, m, dtype=torch.bool)), scaling,
        )
        assert (packed[:, sl] - alone).abs().max() < 1e-12


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("causal", [True, False])
def test_fused_token_states_equal_the_gates(causal, grad):
    """fox_pro's one product for the cached states equals ``shift_gates`` and ``log_gates``, on a causal
    model and on ViT (two gate sets), per layer with gradients and from one build per forward without them."""
    enc, info = bare("fox_pro", causal=causal, layers=3)
    hidden = torch.randn(2, 5, info.hidden_size, dtype=torch.float64)
    ctx = ctx_for(enc, info, 5, 2)
    for layer in range(info.num_layers):
        with torch.set_grad_enabled(grad):
            k_state, v_state = enc._token_states(ctx, layer, hidden)
        a_k, a_v = enc.shift_gates(layer, hidden)
        gates = enc._gates_to_kv(enc.log_gates(layer, hidden))
        assert torch.allclose(k_state, torch.cat([a_k[..., None], gates], dim=-1), rtol=1e-12, atol=1e-14)
        assert torch.allclose(v_state, a_v[..., None], rtol=1e-12, atol=1e-14)
    assert any(key[0] == "layer_slice" for key in ctx.memo) is not grad


def test_fox_pro_shift_without_a_mask_equals_the_masks():
    """No mask (an unpadded batch): every key but the first has its predecessor, which the no-gradient path
    takes without multiplying the predecessor flags in; the shifted and normalised keys and values equal those
    of an all-visible causal mask, with and without gradients."""
    enc, info = bare("fox_pro")
    hidden, q, k, v = random_inputs(enc, info, 2, 6)
    ctx = ctx_for(enc, info, 6, 2)
    q2, k2, v2 = enc("prepare", ctx, 0, hidden, q, k, v)
    causal = padded_mask(torch.ones(2, 6, dtype=torch.bool))
    want = enc._attention_kv(ctx_for(enc, info, 6, 2), 0, q2, k2, v2, causal)
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            got = enc._attention_kv(ctx_for(enc, info, 6, 2), 0, q2, k2, v2, None)
        for a, b in zip(got[:2], want[:2]):
            assert (a - b).abs().max() < 1e-14


@pytest.mark.parametrize("name", ["fox", "fox_pro"])
def test_kernel_term_without_a_mask_equals_an_all_visible_mask(name, monkeypatch):
    """No mask (an unpadded batch): the fused term's cumulative gates skip the validity mask; they equal those
    of a mask under which every key is visible to the last query."""
    enc, info = bare(name)
    hidden, q, k, v = random_inputs(enc, info, 2, 6)
    ctx = ctx_for(enc, info, 6, 2)
    q2, k2, v2 = enc("prepare", ctx, 0, hidden, q, k, v)
    if name == "fox_pro":  # its few-queries path on the CPU has no term: the six queries here would take it
        monkeypatch.setattr(fox_pro_module, "FEW_QUERIES", 0)
    with torch.no_grad():
        plain = enc("kernel_term", ctx_for(enc, info, 6, 2), 0, q2, k2, v2, None)
        masked = enc("kernel_term", ctx_for(enc, info, 6, 2), 0, q2, k2, v2,
                     padded_mask(torch.ones(2, 6, dtype=torch.bool)))
    for name_ in plain.tensors:
        assert (plain.tensors[name_] - masked.tensors[name_]).abs().max() < 1e-14, name_


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["plain", "padded", "chunk", "tensor_offset"])
def test_fox_pro_few_queries_read_the_cache_as_the_reference(case, dtype):
    """fox_pro's decoding path (a few queries, no gradient, CPU: one SDPA call with the forgetting bias as its float
    mask, the cache's key/value heads as the batch): its outputs equal ``attend``'s reference (forgetting attention
    of the shifted, normalised keys and shifted values) for one query at the end of the keys without a mask, under
    left padding (a padded query row sees no key), for a chunk of three queries, and at a tensor offset."""
    enc, info = bare("fox_pro", heads=6, kv_heads=2, head_dim=8, hidden=12, layers=2, dtype=torch.float32)
    n, b = 9, 3
    hidden, q, k, v = random_inputs(enc, info, b, n, dtype=torch.float32)
    q2, k2, v2 = enc("prepare", ctx_for(enc, info, n, b), 1, hidden, q, k, v)
    q2, k2, v2 = q2.to(dtype), k2.to(dtype), v2.to(dtype)  # (a bfloat16 cache holds the states as pairs)
    if dtype == torch.bfloat16:
        _, k2, v2 = enc("prepare", ctx_for(enc, info, n, b), 1, hidden.to(dtype), q.to(dtype), k.to(dtype), v.to(dtype))
    q_len = 3 if case == "chunk" else 1
    offset = n - q_len
    real = torch.ones(b, n, dtype=torch.bool)
    if case == "padded":
        real[1, :4] = False
    mask = None if case == "plain" else padded_mask(real)[:, :, offset:]
    if case == "padded":
        mask[2] = False  # a row that sees no key
    q_off = torch.tensor(offset) if case == "tensor_offset" else offset
    ctx = PosContext(encoding=enc, info=info, position_ids=torch.arange(offset, n)[None], q_offset=q_off)
    query = q2[:, :, offset:]
    with torch.no_grad():
        assert enc._decodes(ctx, query)
        got, probs = enc("attend", ctx, 1, query, k2, v2, mask, 0.3, 0.0, False)
        want = enc._attention_kv(ctx, 1, query, k2, v2, mask)
        k_ref, v_ref, gates, valid = want
        bias = enc._bias(ctx, gates, valid, q_len, k2.device)
        ref, _ = forgetting_attention(query, k_ref, v_ref, bias, mask, 0.3)
    assert probs is None
    tol = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
    if case == "padded":
        assert torch.equal(got[2], torch.zeros_like(got[2]))
