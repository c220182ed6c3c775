"""Hand-checked values of each encoding's formula, and the identities with the unpatched models."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, ViTConfig, ViTForImageClassification

import hf_posenc
from hf_posenc.encodings.alibi import alibi_slopes
from hf_posenc.encodings.absolute import sinusoidal_table
from hf_posenc.encodings.base import ModelInfo, PosContext
from hf_posenc.encodings.rope import Rope


def _llama(**kw):
    torch.manual_seed(0)
    cfg = dict(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg.update(kw)
    return LlamaForCausalLM(LlamaConfig(**cfg)).eval()


def _gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=61, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                      bos_token_id=1, eos_token_id=2)).eval()


def _vit(**kw):
    torch.manual_seed(0)
    cfg = dict(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=64, num_labels=3)
    cfg.update(kw)
    return ViTForImageClassification(ViTConfig(**cfg)).eval()


# -- alibi --------------------------------------------------------------------------------------------


def test_alibi_slopes_8_heads():
    # 2^(-8h/8) = 2^-h for h = 1..8 (paper, section 3)
    assert alibi_slopes(8).tolist() == [2.0**-h for h in range(1, 9)]


def test_alibi_slopes_12_heads():
    # closest power of two is 8: its slopes 2^-1..2^-8, then every other slope of 16 heads
    # (2^-0.5, 2^-1.5, ...) taking the first 12 - 8 = 4: 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5
    expected = [2.0**-h for h in range(1, 9)] + [2.0**-0.5, 2.0**-1.5, 2.0**-2.5, 2.0**-3.5]
    torch.testing.assert_close(alibi_slopes(12), torch.tensor(expected), rtol=1e-6, atol=0)


def test_alibi_bias_text_by_hand():
    info = ModelInfo("llama", 32, 2, 2, 16, 1, True, 64)
    enc = hf_posenc.encodings.Alibi(hf_posenc.PosEncConfig("alibi"), info)
    ctx = PosContext(encoding=enc, info=info, q_offset=2)
    bias = enc.score_bias(ctx, 2, 4, torch.device("cpu"))
    # 2 heads: slopes 2^-4, 2^-8; queries are keys 2 and 3
    d = torch.tensor([[2.0, 1.0, 0.0, 1.0], [3.0, 2.0, 1.0, 0.0]])
    expected = torch.stack([-d / 16, -d / 256])[None]
    torch.testing.assert_close(bias, expected)


def test_alibi_bias_vit_uses_grid_distance_and_spares_cls():
    info = ModelInfo("vit", 32, 1, 1, 32, 1, False, 5, grid=(2, 2), patch_size=(8, 8))
    enc = hf_posenc.encodings.Alibi(hf_posenc.PosEncConfig("alibi"), info)
    ctx = PosContext(encoding=enc, info=info, grid=(2, 2))
    bias = enc.score_bias(ctx, 5, 5, torch.device("cpu"))[0, 0]
    m = 2.0**-8
    r2 = math.sqrt(2)
    patches = torch.tensor([[0, 1, 1, r2], [1, 0, r2, 1], [1, r2, 0, 1], [r2, 1, 1, 0]])
    assert torch.all(bias[0] == 0) and torch.all(bias[:, 0] == 0)
    torch.testing.assert_close(bias[1:, 1:], -m * patches)


# -- sinusoidal -------------------------------------------------------------------------------------


def test_sinusoidal_values_by_hand():
    d = 8
    table = sinusoidal_table(torch.tensor([0, 1, 5]), d, 10000.0)
    for row, pos in enumerate([0, 1, 5]):
        for i in range(d // 2):
            w = 1.0 / 10000 ** (2 * i / d)
            assert table[row, 2 * i].item() == pytest.approx(math.sin(pos * w), abs=1e-6)
            assert table[row, 2 * i + 1].item() == pytest.approx(math.cos(pos * w), abs=1e-6)
    # pos = 1, i = 0: sin(1), cos(1); i = 1: sin(0.1), cos(0.1)
    assert table[1, :4].tolist() == pytest.approx([math.sin(1), math.cos(1), math.sin(0.1), math.cos(0.1)], abs=1e-6)


@pytest.mark.parametrize("scale", [None, 1.0, 0.5])
def test_sinusoidal_on_llama_adds_table_to_embeddings(scale):
    """Default scale: the model's initializer_range. Source: "Attention Is All You Need" Section 3.4 multiplies
    the embeddings by √d_model, which puts tokens and the unit-amplitude table at the same scale; a Hugging Face
    model's embeddings start at std initializer_range, so the table gets that amplitude (module docstring)."""
    m = hf_posenc.patch_model(_llama(), "sinusoidal", **({} if scale is None else {"scale": scale}))
    want_scale = m.config.initializer_range if scale is None else scale
    assert m.config.position_encoding["scale"] == want_scale
    ids = torch.tensor([[5, 6, 7]])
    seen = {}
    m.model.layers[0].register_forward_pre_hook(lambda mod, args: seen.setdefault("x", args[0]))
    m(ids)
    expected = m.model.embed_tokens(ids) + want_scale * sinusoidal_table(torch.arange(3), 32, 10000.0)
    torch.testing.assert_close(seen["x"], expected)


def test_sinusoidal_vit_is_2d_and_zero_for_cls():
    m = hf_posenc.patch_model(_vit(), "sinusoidal", scale=1.0)
    seen = {}
    m.vit.layers[0].register_forward_pre_hook(lambda mod, args: seen.setdefault("x", args[0]))
    px = torch.randn(1, 3, 16, 24)  # grid 2 x 3
    m(px)
    emb = m.vit.embeddings
    patches = emb.patch_embeddings(px)
    tokens = torch.cat([emb.cls_token, patches], dim=1)
    rows = torch.tensor([0, 0, 0, 1, 1, 1])
    cols = torch.tensor([0, 1, 2, 0, 1, 2])
    pe = torch.cat([sinusoidal_table(rows, 16, 1e4), sinusoidal_table(cols, 16, 1e4)], dim=-1)
    torch.testing.assert_close(seen["x"], tokens + torch.cat([torch.zeros(1, 32), pe])[None])


# -- rope -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_rope_rotation_by_hand(layout):
    info = ModelInfo("llama", 8, 1, 1, 4, 1, True, 64)
    enc = Rope(Rope.resolve(hf_posenc.PosEncConfig("rope", {"layout": layout}), info), info)
    ctx = PosContext(encoding=enc, info=info, position_ids=torch.tensor([[3]]))
    x = torch.tensor([1.0, 2.0, 3.0, 4.0]).view(1, 1, 1, 4)
    q, _ = enc.rotate(ctx, x, x)
    a0, a1 = 3 * 1.0, 3 * 10000 ** (-2 / 4)  # m * theta_i
    if layout == "half":  # pairs (x0, x2), (x1, x3)
        exp = [1 * math.cos(a0) - 3 * math.sin(a0), 2 * math.cos(a1) - 4 * math.sin(a1),
               3 * math.cos(a0) + 1 * math.sin(a0), 4 * math.cos(a1) + 2 * math.sin(a1)]
    else:  # pairs (x0, x1), (x2, x3)
        exp = [1 * math.cos(a0) - 2 * math.sin(a0), 2 * math.cos(a0) + 1 * math.sin(a0),
               3 * math.cos(a1) - 4 * math.sin(a1), 4 * math.cos(a1) + 3 * math.sin(a1)]
    assert q.flatten().tolist() == pytest.approx(exp, abs=1e-5)


def test_rope_is_relative():
    """q_m . k_n depends only on n - m (the paper's claim)."""
    info = ModelInfo("llama", 16, 1, 1, 16, 1, True, 64)
    enc = Rope(Rope.resolve(hf_posenc.PosEncConfig("rope"), info), info)
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)

    def score(m, n):
        qm, _ = enc.rotate(PosContext(enc, info, position_ids=torch.tensor([[m]])), q, q)
        _, kn = enc.rotate(PosContext(enc, info, position_ids=torch.tensor([[n]])), k, k)
        return (qm * kn).sum().item()

    assert score(2, 7) == pytest.approx(score(12, 17), abs=1e-4)
    assert score(2, 7) != pytest.approx(score(2, 8), abs=1e-4)


# -- identities with the unpatched models -------------------------------------------------------


def test_rope_on_llama_reproduces_unpatched():
    m = _llama()
    ids = torch.randint(3, 61, (2, 12))
    with torch.no_grad():
        ref = m(ids).logits
        hf_posenc.patch_model(m, "rope")
        out = m(ids).logits
    assert torch.equal(out, ref)


def test_rope_on_llama_uses_model_theta():
    m = hf_posenc.patch_model(_llama(rope_parameters={"rope_type": "default", "rope_theta": 500.0}), "rope")
    assert m.config.position_encoding == {
        "name": "rope", "theta": 500.0, "layout": "half", "partial_rotary_factor": None, "scaling": None,
        "remap": None, "remap_window": None, "remap_group": None, "remap_chunk": None,
    }


def test_learned_on_gpt2_reproduces_unpatched():
    m = _gpt2()
    ids = torch.randint(3, 61, (2, 12))
    with torch.no_grad():
        ref = m(ids).logits
        hf_posenc.patch_model(m, "learned")
        out = m(ids).logits
    assert torch.equal(out, ref)


def test_learned_on_vit_reproduces_unpatched_at_any_size():
    m = _vit()
    px = torch.randn(2, 3, 32, 32)
    px2 = torch.randn(1, 3, 48, 64)
    with torch.no_grad():
        ref = m(px).logits
        ref2 = m(px2, interpolate_pos_encoding=True).logits
        hf_posenc.patch_model(m, "learned")
        assert torch.equal(m(px).logits, ref)
        assert torch.equal(m(px2, interpolate_pos_encoding=True).logits, ref2)
        with pytest.raises(ValueError, match="interpolate_pos_encoding"):
            m(px2)
