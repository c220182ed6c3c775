"""kerple and sandwich: closed forms at chosen parameters, constraints, and finite-difference gradients."""

from __future__ import annotations

import math

import pytest
import torch

import hf_posenc
from hf_posenc import PosEncConfig
from hf_posenc.encodings.base import ModelInfo, PosContext
from hf_posenc.encodings.kerple import Kerple
from hf_posenc.encodings.sandwich import Sandwich

TEXT = ModelInfo("llama", 32, 2, 2, 16, 2, True, 64)
GRID = ModelInfo("vit", 32, 2, 2, 16, 2, False, 5, grid=(2, 2), patch_size=(8, 8))
CPU = torch.device("cpu")


def _kerple(variant, info=TEXT, per_layer=True):
    enc = Kerple(PosEncConfig("kerple", {"variant": variant, "per_layer": per_layer}), info)
    return enc


def _set(enc, r1, r2):
    """Set the constrained parameters to r1, r2 (each (layers, H)) through the inverse reparametrisation."""
    with torch.no_grad():
        enc.r1_raw.copy_(torch.log(torch.expm1(torch.tensor(r1) - 1e-2)))
        if enc.variant == "log":
            enc.r2_raw.copy_(torch.log(torch.expm1(torch.tensor(r2) - 1e-2)))
        else:
            enc.r2_raw.copy_(torch.logit(torch.tensor(r2) / 2))


@pytest.mark.parametrize("variant", ["log", "power"])
def test_kerple_closed_form_text(variant):
    enc = _kerple(variant)
    _set(enc, [[0.5, 2.0], [1.0, 1.0]], [[0.25, 1.5], [1.0, 1.0]])
    ctx = PosContext(encoding=enc, info=TEXT, q_offset=1)
    bias = enc.score_bias(ctx, 2, 3, CPU, layer=0)[0]  # queries are keys 1, 2
    d = torch.tensor([[1.0, 0.0, 1.0], [2.0, 1.0, 0.0]])
    if variant == "log":
        expected = torch.stack([-0.5 * torch.log(1 + 0.25 * d), -2.0 * torch.log(1 + 1.5 * d)])
    else:
        expected = torch.stack([-0.5 * d**0.25, -2.0 * d**1.5])
    torch.testing.assert_close(bias, expected, rtol=1e-5, atol=1e-6)
    # layer 1 has its own kernel
    other = enc.score_bias(ctx, 2, 3, CPU, layer=1)[0]
    if variant == "log":
        torch.testing.assert_close(other[0], -torch.log(1 + d), rtol=1e-5, atol=1e-6)
    else:
        torch.testing.assert_close(other[0], -d, rtol=1e-5, atol=1e-6)


def test_kerple_vit_uses_grid_distance_and_spares_cls():
    enc = _kerple("log", GRID)
    _set(enc, [[1.0, 1.0], [1.0, 1.0]], [[1.0, 1.0], [1.0, 1.0]])
    bias = enc.score_bias(PosContext(encoding=enc, info=GRID, grid=(2, 2)), 5, 5, CPU)[0, 0]
    r2 = math.sqrt(2)
    d = torch.tensor([[0, 1, 1, r2], [1, 0, r2, 1], [1, r2, 0, 1], [r2, 1, 1, 0]])
    torch.testing.assert_close(bias[1:, 1:], -torch.log1p(d))
    assert torch.all(bias[0] == 0) and torch.all(bias[:, 0] == 0)


@pytest.mark.parametrize("variant", ["log", "power"])
def test_kerple_constraints_hold_for_any_raw_value(variant):
    enc = _kerple(variant)
    with torch.no_grad():
        enc.r1_raw.copy_(torch.tensor([[-50.0, 50.0], [0.0, -3.0]]))
        enc.r2_raw.copy_(torch.tensor([[-50.0, 50.0], [0.0, 3.0]]))
    r1, r2 = enc.kernel_params()
    assert torch.all(r1 >= 1e-2) and torch.all(r2 > 0)
    if variant == "power":
        assert torch.all(r2 <= 2)


@pytest.mark.parametrize("variant", ["log", "power"])
def test_kerple_gradcheck(variant):
    """d bias / d (raw r1, raw r2) against finite differences, float64."""
    enc = _kerple(variant).double()
    ctx = PosContext(encoding=enc, info=TEXT, q_offset=2)
    r1 = enc.r1_raw.detach().clone().requires_grad_(True)
    r2 = enc.r2_raw.detach().clone().requires_grad_(True)
    del enc.r1_raw, enc.r2_raw  # replaced by plain tensors that gradcheck perturbs

    def bias_of(a, b):
        enc.r1_raw, enc.r2_raw = a, b
        return enc.score_bias(ctx, 3, 5, CPU, layer=1)

    assert torch.autograd.gradcheck(bias_of, (r1, r2), eps=1e-6, atol=1e-5)


def test_kerple_gradients_reach_both_parameters_in_a_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2))
    hf_posenc.patch_model(m, "kerple", variant="power")
    m(torch.randint(0, 61, (1, 9)), labels=torch.randint(0, 61, (1, 9))).loss.backward()
    enc = hf_posenc.encoding_module(m)
    for p in (enc.r1_raw, enc.r2_raw):
        assert p.grad is not None and torch.all(p.grad != 0)


def test_kerple_defaults_follow_the_authors_code():
    """Source: github.com/chijames/KERPLE. megatron/model/gpt2_model.py builds one ``rpe_emb`` and passes it
    to every layer (shared kernel); megatron/mpu/layers.py draws ParallelKerpleLog's scale ``bias_p`` from
    U(0, 2) and rate ``bias_a`` from U(0, 1), and ParallelKerplePower's scale ``bias_a`` from U(0, 1) and
    exponent ``bias_p`` from U(0, 2)."""
    info = ModelInfo("llama", 32, 256, 256, 16, 3, True, 64)  # 256 heads, 3 layers: enough draws to see ranges
    cfg = PosEncConfig("kerple", {"variant": "log"})
    assert cfg.params["per_layer"] is False
    torch.manual_seed(0)
    log = Kerple(PosEncConfig("kerple", {"variant": "log"}), info)
    torch.manual_seed(0)
    power = Kerple(PosEncConfig("kerple", {"variant": "power"}), info)
    for enc in (log, power):
        assert enc.r1_raw.shape == (1, 256) and enc.r2_raw.shape == (1, 256)  # shared by the 3 layers
    r1, r2 = log.kernel_params()
    assert 1.0 < r1.max() < 2.0 and r2.max() < 1.0  # log: scale ~ U(0, 2), rate ~ U(0, 1)
    r1, r2 = power.kernel_params()
    assert r1.max() < 1.0 and 1.0 < r2.max() < 2.0  # power: scale ~ U(0, 1), exponent ~ U(0, 2)
    assert r1.min() >= 1e-2 and r2.min() >= 1e-2


def test_kerple_shared_kernel_is_the_same_in_every_layer():
    enc = _kerple("log", per_layer=False)
    ctx = PosContext(encoding=enc, info=TEXT, q_offset=0)
    assert torch.equal(enc.score_bias(ctx, 4, 4, CPU, layer=0), enc.score_bias(ctx, 4, 4, CPU, layer=1))
    per = _kerple("log", per_layer=True)
    assert per.r1_raw.shape[0] == TEXT.num_layers


def test_sandwich_closed_form_text():
    enc = Sandwich(Sandwich.resolve(PosEncConfig("sandwich", {"dim": 4}), TEXT), TEXT)
    ctx = PosContext(encoding=enc, info=TEXT, q_offset=0)
    bias = enc.score_bias(ctx, 3, 3, CPU)[0]
    # dim 4: k = 1, 2 with frequencies 10000^(-2k/4) = 0.01, 0.0001; 2 heads: scales 8*1/2 = 4, 8*2/2 = 8
    for h, scale in enumerate([4.0, 8.0]):
        for i in range(3):
            for j in range(3):
                d = i - j
                expected = (math.cos(d * 0.01) + math.cos(d * 0.0001) - 2.0) / scale
                assert bias[h, i, j].item() == pytest.approx(expected, abs=1e-7)
    assert torch.all(bias.diagonal(dim1=-2, dim2=-1) == 0)


def test_sandwich_defaults_to_head_dim_and_grid():
    cfg = Sandwich.resolve(PosEncConfig("sandwich"), GRID)
    assert cfg.params["dim"] == 16
    enc = Sandwich(cfg, GRID)
    bias = enc.score_bias(PosContext(encoding=enc, info=GRID, grid=(2, 2)), 5, 5, CPU)[0]
    k = torch.arange(1, 9, dtype=torch.float64)
    inv = 10000.0 ** (-2 * k / 16)
    d = math.sqrt(2)
    expected = ((torch.cos(d * inv).sum() - 8) / 4).item()
    assert bias[0, 1, 4].item() == pytest.approx(expected, abs=1e-6)  # patches (0,0) and (1,1)
    assert torch.all(bias[:, 0] == 0) and torch.all(bias[:, :, 0] == 0)


def test_sandwich_odd_dim_is_an_error():
    with pytest.raises(ValueError, match="even dim"):
        Sandwich.resolve(PosEncConfig("sandwich", {"dim": 5}), TEXT)
