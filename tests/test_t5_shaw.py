"""Values of ``t5`` (bucketed relative bias) and ``shaw`` (relative key and value representations).

T5's bucketing is checked against transformers' own ``T5Attention``; Shaw's attention against explicit
float64 loops over (i, j); the gradient of every learned table against finite differences (gradcheck).
"""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call
from transformers import T5Config
from transformers.models.t5.modeling_t5 import T5Attention

import hf_posenc
from hf_posenc.encodings.base import ModelInfo, PosContext
from hf_posenc.encodings.shaw import Shaw
from hf_posenc.encodings.t5 import T5Bias, t5_relative_position_bucket
from conftest import make_model, model_inputs

CPU = torch.device("cpu")


def text_info(heads: int = 2, kv_heads: int | None = None, head_dim: int = 3, layers: int = 2) -> ModelInfo:
    return ModelInfo("llama", heads * head_dim, heads, kv_heads or heads, head_dim, layers, True, 64)


def vit_info(heads: int = 2, head_dim: int = 3, layers: int = 2) -> ModelInfo:
    return ModelInfo("vit", heads * head_dim, heads, heads, head_dim, layers, False, 5, grid=(2, 2), patch_size=(8, 8))


def build(cls, name: str, info: ModelInfo, **params):
    torch.manual_seed(0)
    return cls(hf_posenc.PosEncConfig(name, params), info)


def vit_coords() -> list[tuple[int, int] | None]:
    """(row, col) of the 5 tokens of a 2x2 grid; None for CLS."""
    return [None, (0, 0), (0, 1), (1, 0), (1, 1)]


# ===================================================================================================
# t5
# ===================================================================================================

BUCKET_CASES = [(32, 128), (16, 64), (8, 20), (10, 30), (33, 100), (64, 256), (4, 9), (6, 4)]


@pytest.mark.parametrize("bidirectional", [False, True], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("num_buckets,max_distance", BUCKET_CASES, ids=[f"{n}-{m}" for n, m in BUCKET_CASES])
def test_t5_bucket_matches_transformers(bidirectional, num_buckets, max_distance):
    rel = torch.arange(-600, 601)[None, :] + torch.tensor([0, 1000, -1000])[:, None]  # (3, 1201), beyond max_distance
    if (num_buckets if not bidirectional else num_buckets // 2) // 2 >= max_distance:
        pytest.skip("max_distance must exceed max_exact (hf_posenc refuses it; T5 divides by log(<=1))")
    want = T5Attention._relative_position_bucket(rel, bidirectional, num_buckets, max_distance)
    got = t5_relative_position_bucket(rel, bidirectional, num_buckets, max_distance)
    assert got.dtype == torch.long
    assert torch.equal(got, want)


def test_t5_bucket_small_values_by_hand():
    # causal, 32 buckets: n = max(-rel, 0); exact below 16; log buckets 16..31 up to 128
    rel = torch.tensor([3, 0, -1, -15, -16, -127, -128, -5000])
    assert t5_relative_position_bucket(rel, False, 32, 128).tolist() == [0, 0, 1, 15, 16, 31, 31, 31]
    # bidirectional, 32 buckets: 16 per sign, exact below 8, positive offsets + 16
    rel = torch.tensor([-1, 0, 1, 7, -7, 8, -8, 200, -200])
    assert t5_relative_position_bucket(rel, True, 32, 128).tolist() == [1, 0, 17, 23, 7, 24, 8, 31, 15]


@pytest.mark.parametrize("q_offset", [0, 3])
def test_t5_text_bias_matches_t5_decoder(q_offset):
    """Same table: the bias equals T5 decoder's compute_bias (key - query, unidirectional buckets)."""
    info = text_info(heads=3)
    enc = build(T5Bias, "t5", info, num_buckets=8, max_distance=20)
    cfg = T5Config(d_model=12, d_kv=4, num_heads=3, relative_attention_num_buckets=8,
                   relative_attention_max_distance=20, is_decoder=True)
    ref = T5Attention(cfg, has_relative_attention_bias=True, layer_idx=0)
    with torch.no_grad():
        ref.relative_attention_bias.weight.copy_(enc.table)
    q_len, k_len = 40 - q_offset, 40
    ctx = PosContext(encoding=enc, info=info, q_offset=q_offset)
    got = enc.score_bias(ctx, q_len, k_len, CPU)
    want = ref.compute_bias(q_len, k_len, past_seen_tokens=q_offset)
    assert got.shape == (1, 3, q_len, k_len) and got.dtype == torch.float32
    assert torch.equal(got, want)


def test_t5_vit_bias_by_hand():
    """2x2 grid + CLS, 32 buckets (bidirectional: Δ=0 -> 0, Δ=-1 -> 1, Δ=+1 -> 17): row + column tables, 0 on CLS."""
    info = vit_info(heads=2)
    enc = build(T5Bias, "t5", info)
    assert enc.table_row.shape == enc.table_col.shape == (32, 2) and not enc.bias_per_layer
    ctx = PosContext(encoding=enc, info=info, grid=(2, 2))
    bias = enc.score_bias(ctx, 5, 5, CPU)
    bucket = {0: 0, -1: 1, 1: 17}
    want = torch.zeros(1, 2, 5, 5)
    for i, a in enumerate(vit_coords()):
        for j, b in enumerate(vit_coords()):
            if a is None or b is None:
                continue
            want[0, :, i, j] = enc.table_row[bucket[b[0] - a[0]]] + enc.table_col[bucket[b[1] - a[1]]]
    assert torch.equal(bias, want)
    assert bias[0, :, 0].abs().sum() == 0 and bias[0, :, :, 0].abs().sum() == 0


def test_t5_per_layer_tables():
    info = text_info(heads=2, layers=3)
    enc = build(T5Bias, "t5", info, num_buckets=8, max_distance=20, per_layer=True)
    assert enc.bias_per_layer and enc.table.shape == (3, 8, 2)
    ctx = PosContext(encoding=enc, info=info)
    for layer in range(3):
        bias = enc.score_bias(ctx, 6, 6, CPU, layer)
        buckets = t5_relative_position_bucket(torch.arange(6)[None] - torch.arange(6)[:, None], False, 8, 20)
        assert torch.equal(bias[0], enc.table[layer][buckets].permute(2, 0, 1))


@pytest.mark.parametrize("family", ["llama", "vit"])
def test_t5_per_layer_in_a_model(family):
    """per_layer=True with every layer's table equal to the shared one gives the shared model's outputs, on the
    fast path and with output_attentions; different tables per layer change them."""
    # base models: on ViT the classifier reads the CLS token alone, on which the last layer's bias is 0
    shared = make_model(family, "base", encoding="t5")
    per_layer = make_model(family, "base", encoding="t5", per_layer=True)
    enc, enc_pl = hf_posenc.encoding_module(shared), hf_posenc.encoding_module(per_layer)
    inputs = model_inputs(family)
    with torch.no_grad():
        for name, p in enc.named_parameters():
            getattr(enc_pl, name).copy_(p[None].expand_as(getattr(enc_pl, name)))
        want = shared(**inputs).last_hidden_state
        assert torch.allclose(per_layer(**inputs).last_hidden_state, want, atol=1e-5)
        assert torch.allclose(per_layer(**inputs, output_attentions=True).last_hidden_state, want, atol=1e-5)
        for p in enc_pl.parameters():
            p[1].normal_(0, 1.0)  # the last layer's tables only
        changed = per_layer(**inputs).last_hidden_state
        assert (changed - want).abs().max() > 1e-3
        assert torch.allclose(per_layer(**inputs, output_attentions=True).last_hidden_state, changed, atol=1e-5)


@pytest.mark.parametrize("info", [text_info(), vit_info()], ids=["text", "vit"])
@pytest.mark.parametrize("per_layer", [False, True], ids=["shared", "per-layer"])
def test_t5_gradcheck(info, per_layer):
    enc = build(T5Bias, "t5", info, num_buckets=8, max_distance=12, per_layer=per_layer).double()
    ctx = PosContext(encoding=enc, info=info, q_offset=2, grid=info.grid)
    q_len, k_len = (5, 5) if info.grid else (3, 5)
    names = [n for n, _ in enc.named_parameters()]

    def f(*tables):
        return functional_call(enc, dict(zip(names, tables)), ("bias", ctx, q_len, k_len, CPU, 1))

    tables = tuple(p.detach().clone().requires_grad_(True) for p in enc.parameters())
    assert f(*tables).dtype == torch.float64
    assert torch.autograd.gradcheck(f, tables)


def test_t5_bf16_table_computes_in_float32():
    info = text_info()
    enc = build(T5Bias, "t5", info)
    ctx = PosContext(encoding=enc, info=info)
    want = enc.score_bias(ctx, 4, 4, CPU)
    enc.to(torch.bfloat16)
    got = enc.score_bias(ctx, 4, 4, CPU)
    assert got.dtype == torch.float32
    assert torch.equal(got, enc.table.float()[t5_relative_position_bucket(
        torch.arange(4)[None] - torch.arange(4)[:, None], False, 32, 128)].permute(2, 0, 1)[None])
    assert (got - want).abs().max() < 1e-2


def test_t5_validation():
    with pytest.raises(TypeError):
        hf_posenc.PosEncConfig("t5", {"num_buckets": 3.5})
    with pytest.raises(TypeError):
        hf_posenc.PosEncConfig("t5", {"per_layer": 1})
    with pytest.raises(ValueError):
        hf_posenc.PosEncConfig("t5", {"num_buckets": 1})
    with pytest.raises(ValueError, match="max_distance"):
        T5Bias(hf_posenc.PosEncConfig("t5", {"num_buckets": 32, "max_distance": 16}), text_info())
    # bidirectional: 8 exact buckets per sign at 32, so 16 is fine on ViT
    T5Bias(hf_posenc.PosEncConfig("t5", {"num_buckets": 32, "max_distance": 16}), vit_info())
    with pytest.raises(ValueError, match="num_buckets"):
        T5Bias(hf_posenc.PosEncConfig("t5", {"num_buckets": 3, "max_distance": 16}), vit_info())


# ===================================================================================================
# shaw
# ===================================================================================================


def shaw_by_hand(q, k, v, a_key, a_value, rel, mask, scaling):
    """Explicit loops, float64. q (B, H, Lq, D); k, v (B, Hkv, Lk, D); rel(i, j) -> list of (axis, index) or
    [] (no positional term); a_key/a_value: dict axis -> (R, D); mask (B, Lq, Lk) bool."""
    b_, h_, lq, d = q.shape
    lk, groups = k.shape[2], h_ // k.shape[1]
    out = torch.zeros(b_, h_, lq, d, dtype=torch.float64)
    probs = torch.zeros(b_, h_, lq, lk, dtype=torch.float64)
    for b in range(b_):
        for h in range(h_):
            g = h // groups
            for i in range(lq):
                e = torch.full((lk,), float("-inf"), dtype=torch.float64)
                for j in range(lk):
                    if not mask[b, i, j]:
                        continue
                    key = k[b, g, j].clone()
                    for axis, r in rel(i, j):
                        key = key + a_key[axis][r]
                    e[j] = (q[b, h, i] * key).sum() * scaling
                if torch.isinf(e).all():
                    continue
                alpha = torch.softmax(e, 0)
                probs[b, h, i] = alpha
                for j in range(lk):
                    val = v[b, g, j].clone()
                    for axis, r in rel(i, j):
                        val = val + a_value[axis][r]
                    out[b, h, i] += alpha[j] * val
    return out, probs


def double_inputs(b, h, hkv, lq, lk, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, lq, d, generator=g, dtype=torch.float64),
            torch.randn(b, hkv, lk, d, generator=g, dtype=torch.float64),
            torch.randn(b, hkv, lk, d, generator=g, dtype=torch.float64))


def test_shaw_text_by_hand():
    """GQA (4 query heads, 2 kv heads), a cache offset (queries are keys 3..5 of 6), causal mask plus a padded
    key in row 1, k = 2 so that clipping happens (j - i ranges over -5..2)."""
    k_clip, layer = 2, 1
    info = text_info(heads=4, kv_heads=2, head_dim=3)
    enc = build(Shaw, "shaw", info, max_relative_position=k_clip).double()
    assert enc.rel_key.shape == enc.rel_value.shape == (2, 5, 3)
    q, k, v = double_inputs(2, 4, 2, 3, 6, 3)
    offset = 3
    causal = (torch.arange(3)[:, None] + offset) >= torch.arange(6)[None]
    mask = causal[None].repeat(2, 1, 1)
    mask[1, :, 0] = False
    ctx = PosContext(encoding=enc, info=info, q_offset=offset)
    out, probs = enc.attend(ctx, layer, q, k, v, mask[:, None], 0.37, 0.0, False)

    def rel(i, j):
        return [("", max(-k_clip, min(k_clip, j - (i + offset))) + k_clip)]

    want_out, want_probs = shaw_by_hand(q, k, v, {"": enc.rel_key[layer]}, {"": enc.rel_value[layer]},
                                        rel, mask, 0.37)
    assert out.shape == (2, 4, 3, 3) and probs.shape == (2, 4, 3, 6)
    torch.testing.assert_close(probs, want_probs, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)


def test_shaw_vit_by_hand():
    """2x2 grid + CLS, k = 1 per axis: a = a_row[Δr + 1] + a_col[Δc + 1], zero vectors on CLS pairs."""
    info = vit_info(heads=2, head_dim=4)
    enc = build(Shaw, "shaw", info, max_relative_position=1).double()
    q, k, v = double_inputs(1, 2, 2, 5, 5, 4, seed=3)
    ctx = PosContext(encoding=enc, info=info, grid=(2, 2))
    out, probs = enc.attend(ctx, 0, q, k, v, None, 0.5, 0.0, False)
    coords = vit_coords()

    def rel(i, j):
        a, b = coords[i], coords[j]
        if a is None or b is None:
            return []
        return [("row", b[0] - a[0] + 1), ("col", b[1] - a[1] + 1)]

    tables = {
        kind: {axis: getattr(enc, f"rel_{kind}_{axis}")[0] for axis in ("row", "col")} for kind in ("key", "value")
    }
    want_out, want_probs = shaw_by_hand(q, k, v, tables["key"], tables["value"], rel,
                                        torch.ones(1, 5, 5, dtype=torch.bool), 0.5)
    torch.testing.assert_close(probs, want_probs, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("family", ["text", "vit"])
def test_shaw_gradcheck(family):
    """Finite differences (float64) of the output and the probabilities w.r.t. q, k, v and every table."""
    if family == "text":
        info = text_info(heads=4, kv_heads=2, head_dim=3)
        q, k, v = double_inputs(2, 4, 2, 3, 5, 3)
        mask = ((torch.arange(3)[:, None] + 2) >= torch.arange(5)[None])[None, None].repeat(2, 1, 1, 1)
        mask[1, ..., 0] = False
        ctx_kw = dict(q_offset=2)
    else:
        info = vit_info(heads=2, head_dim=3)
        q, k, v = double_inputs(1, 2, 2, 5, 5, 3)
        mask, ctx_kw = None, dict(grid=(2, 2))
    enc = build(Shaw, "shaw", info, max_relative_position=1).double()
    ctx = PosContext(encoding=enc, info=info, **ctx_kw)
    names = [n for n, _ in enc.named_parameters()]

    def f(q, k, v, *tables):
        return functional_call(enc, dict(zip(names, tables)), ("attend", ctx, 1, q, k, v, mask, 0.6, 0.0, False))

    args = tuple(t.detach().clone().requires_grad_(True) for t in (q, k, v, *enc.parameters()))
    assert torch.autograd.gradcheck(f, args)


def test_shaw_bf16_computes_in_float32():
    info = text_info(heads=2, head_dim=4)
    enc = build(Shaw, "shaw", info, max_relative_position=2)
    q, k, v = (t.float() for t in double_inputs(1, 2, 2, 4, 4, 4))
    ctx = PosContext(encoding=enc, info=info)
    want, _ = enc.attend(ctx, 0, q, k, v, None, 0.5, 0.0, False)
    enc.to(torch.bfloat16)
    qb, kb, vb = (t.bfloat16() for t in (q, k, v))
    out, probs = enc.attend(ctx, 0, qb, kb, vb, None, 0.5, 0.0, False)
    assert out.dtype == torch.bfloat16 and probs.dtype == torch.float32
    # the same computation on the bf16 values, in float32
    ref = Shaw(enc.posenc_config, info)
    ref.load_state_dict({n: p.float() for n, p in enc.state_dict().items()})
    exact, _ = ref.attend(ctx, 0, qb.float(), kb.float(), vb.float(), None, 0.5, 0.0, False)
    assert torch.equal(out, exact.bfloat16())
    assert (out.float() - want).abs().max() < 0.1


@pytest.mark.parametrize("encoding", ["shaw", "t5"])
@pytest.mark.parametrize("family", ["llama", "gpt2", "vit"])
def test_zero_tables_equal_nope(family, encoding):
    """With every table at zero, shaw and t5 add nothing: the model is the same model patched with nope."""
    model = make_model(family, encoding=encoding)
    nope = make_model(family, encoding="nope")
    with torch.no_grad():
        for p in hf_posenc.encoding_module(model).parameters():
            p.zero_()
        inputs = model_inputs(family)
        assert torch.allclose(model(**inputs).logits, nope(**inputs).logits, atol=1e-5)


def test_shaw_validation_and_parameters():
    with pytest.raises(ValueError):
        hf_posenc.PosEncConfig("shaw", {"max_relative_position": 0})
    with pytest.raises(TypeError):
        hf_posenc.PosEncConfig("shaw", {"max_relative_position": "16"})
    model = make_model("vit", encoding="shaw", max_relative_position=3)
    names = sorted(n for n, _ in hf_posenc.encoding_module(model).named_parameters())
    assert names == ["rel_key_col", "rel_key_row", "rel_value_col", "rel_value_row"]
    assert hf_posenc.encoding_module(model).rel_key_row.shape == (2, 7, 8)
