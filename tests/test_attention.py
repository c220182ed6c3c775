"""posenc_attention against a plain float64 reference: masks, GQA, the causal block path, decode shapes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_posenc.attention import _QUERY_BLOCK, posenc_attention
from hf_posenc.encodings.base import ModelInfo, PosContext


class _Bias(nn.Module):
    """A stand-in encoding whose score bias is a fixed random tensor."""

    has_score_bias = True
    rotates_qk = False

    def __init__(self, bias):
        super().__init__()
        self.bias = bias

    def forward(self, op, ctx, q_len, k_len, device, layer=0):
        assert op == "bias"
        return self.bias[..., -q_len:, -k_len:]


class _Attn(nn.Module):
    def __init__(self, causal):
        super().__init__()
        self.is_causal = causal


def _reference(q, k, v, mask, bias, causal, scale):
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) * scale
    if bias is not None:
        s = s + bias.double()
    lq, lk = q.shape[2], k.shape[2]
    allowed = torch.ones(lq, lk, dtype=torch.bool)
    if causal:
        allowed = torch.arange(lq)[:, None] + (lk - lq) >= torch.arange(lk)[None]
    allowed = allowed[None, None]
    if mask is not None:
        allowed = allowed & mask
    s = s.masked_fill(~allowed, float("-inf"))
    p = torch.nan_to_num(torch.softmax(s, -1), nan=0.0)
    return (p @ v).transpose(1, 2), p


def _ctx(bias, need_weights=False, q_offset=0):
    if bias is None:
        return None
    info = ModelInfo("llama", 64, 4, 2, 16, 1, True, None)
    return PosContext(encoding=_Bias(bias), info=info, need_weights=need_weights, q_offset=q_offset)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("lq, lk", [(9, 9), (1, 9), (3, 9), (2 * _QUERY_BLOCK + 5, 2 * _QUERY_BLOCK + 5)])
@pytest.mark.parametrize("padding", [False, True])
def test_against_reference(causal, with_bias, lq, lk, padding):
    torch.manual_seed(lq + lk)
    b, h, hkv, d = 2, 4, 2, 16
    q, k, v = torch.randn(b, h, lq, d), torch.randn(b, hkv, lk, d), torch.randn(b, hkv, lk, d)
    bias = torch.randn(1, h, lq, lk) if with_bias else None
    mask = None
    if padding:
        keep = torch.ones(b, lk, dtype=torch.bool)
        keep[1, :3] = False  # left padding in row 1
        mask = keep[:, None, None, :].expand(b, 1, lq, lk)
        if causal:
            mask = mask & (torch.arange(lq)[:, None] + (lk - lq) >= torch.arange(lk)[None])
    scale = d**-0.5
    out, w = posenc_attention(_Attn(causal), q, k, v, mask, scaling=scale, posenc_ctx=_ctx(bias, q_offset=lk - lq))
    ref, _ = _reference(q, k, v, mask, bias, causal, scale)
    assert w is None
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)


def test_weights_are_probabilities():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    bias = torch.randn(1, 4, 5, 5)
    out, w = posenc_attention(_Attn(True), q, k, v, None, scaling=0.3, posenc_ctx=_ctx(bias, need_weights=True))
    ref, p = _reference(q, k, v, None, bias, True, 0.3)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(w.double(), p, rtol=1e-4, atol=1e-6)
    assert torch.all(w.triu(1) == 0)


def test_block_path_gradients_match_reference():
    torch.manual_seed(1)
    lq = 2 * _QUERY_BLOCK + 3
    q = torch.randn(1, 2, lq, 8, requires_grad=True)
    k = torch.randn(1, 2, lq, 8, requires_grad=True)
    v = torch.randn(1, 2, lq, 8, requires_grad=True)
    bias = torch.randn(1, 2, lq, lq, requires_grad=True)
    out, _ = posenc_attention(_Attn(True), q, k, v, None, scaling=0.25, posenc_ctx=_ctx(bias))
    grads = torch.autograd.grad(out.square().sum(), (q, k, v, bias))
    ref, _ = _reference(q, k, v, None, bias, True, 0.25)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v, bias))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("offset", [2, torch.tensor(2)])
def test_no_mask_never_attends_to_empty_cache_slots(with_bias, offset):
    """A StaticCache holds empty slots after the last query: without a mask they must stay unseen."""
    torch.manual_seed(3)
    q, k, v = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 8, 8), torch.randn(1, 2, 8, 8)
    bias = torch.randn(1, 4, 1, 8) if with_bias else torch.zeros(1, 4, 1, 8)
    info = ModelInfo("llama", 32, 4, 2, 8, 1, True, None)
    ctx = PosContext(encoding=_Bias(bias) if with_bias else _Bias(bias), info=info, q_offset=offset)
    if not with_bias:
        ctx.encoding.has_score_bias = False
    out, _ = posenc_attention(_Attn(True), q, k, v, None, scaling=0.3, posenc_ctx=ctx)
    ref, _ = _reference(q, k[:, :, :3], v[:, :, :3], None, bias[..., :3], True, 0.3)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)
