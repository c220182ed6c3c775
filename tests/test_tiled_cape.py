"""The tile-wise CAPE attention (hf_posenc.kernels.cape.tiled) against the full-matrix reference.

The oracle is the encoding's reference path: the base's bias on text (its registered term's reference bias, the
registry's statement that the tiles evaluate too; FIRE: its tabulated f_θ) and ``cape_scores_reference`` over
(B, Lq, Lk, 2H) tensors. Forward and every gradient (q, k, v, the MLP's
weights, the base bias's parameters), relative to the largest gradient; odd shapes and tiles, grouped-query
heads, key padding with an empty row, a decode with Lq < Lk and a 0-d tensor offset, float64, float32 and
bfloat16.
"""

from __future__ import annotations

import pytest
import torch

import hf_posenc
from hf_posenc.config import PosEncConfig
from hf_posenc.encodings.base import ModelInfo, PosContext
from hf_posenc.encodings.cape import Cape
from hf_posenc.kernels.cape import cape_attention_tiled
from conftest import make_ids, make_model

GQA = ModelInfo("llama", 32, 4, 2, 8, 2, True, 64)
BASES = [("alibi", {}), ("kerple", {}), ("fire", {})]


def _cape(base: str, dtype: torch.dtype = torch.float64) -> Cape:
    torch.manual_seed(0)
    enc = Cape(Cape.resolve(PosEncConfig("cape", {"base": base, "mlp_hidden": 6}), GQA), GQA).to(dtype)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # move away from the initialisation so every parameter matters
        for p in enc.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g, dtype=torch.float64).to(dtype))
    return enc


def _inputs(b: int, q_len: int, k_len: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, 4, q_len, 8, generator=g, dtype=torch.float64).to(dtype).requires_grad_(True)
    k = torch.randn(b, 2, k_len, 8, generator=g, dtype=torch.float64).to(dtype).requires_grad_(True)
    v = torch.randn(b, 2, k_len, 8, generator=g, dtype=torch.float64).to(dtype).requires_grad_(True)
    return q, k, v


def _mask(b: int, q_len: int, k_len: int, offset: int) -> torch.Tensor:
    """Causal at ``offset`` with left padding in row 1 (3 keys), whose first query sees no key at all."""
    mask = (torch.arange(q_len)[:, None] + offset >= torch.arange(k_len)[None, :]).expand(b, 1, q_len, k_len).clone()
    if b > 1:
        mask[1, :, :, :3] = False
        mask[1, :, 0, :] = False
    return mask


def _run(enc: Cape, ctx: PosContext, tiled: bool, q, k, v, mask, blocks=(4, 5)):
    ctx.need_weights = not tiled  # probabilities requested: the reference; otherwise the tiles
    if tiled:
        kind, tensors = enc.base_term(ctx, 1, q.shape[2], k.shape[2], q.device)
        mlp = enc.mlps[1]
        return cape_attention_tiled(
            q, k, v, mlp.fc1.weight, mlp.fc1.bias, mlp.fc2.weight, mlp.fc2.bias, kind, tensors, mask, 0.4,
            ctx.q_offset, causal=True, block_q=blocks[0], block_k=blocks[1],
        )
    return enc.attend(ctx, 1, q, k, v, mask, 0.4, 0.0, False)[0]


def _grads(out, inputs, weight):
    return torch.autograd.grad((out.double() * weight).sum(), inputs, allow_unused=True)


def _compare(enc, ctx, q, k, v, mask, tol, blocks=(4, 5), floor=1e-3):
    got = _run(enc, ctx, True, q, k, v, mask, blocks)
    want = _run(enc, ctx, False, q, k, v, mask)
    assert got.dtype == want.dtype == v.dtype
    assert (got.double() - want.double()).abs().max() <= tol * want.double().abs().max()
    params = [p for p in enc.parameters() if p.requires_grad]
    inputs = [q, k, v, *params]
    weight = torch.randn(want.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    g_got, g_want = _grads(got, inputs, weight), _grads(want, inputs, weight)
    largest = max(g.abs().max().item() for g in g_want if g is not None)
    names = ["q", "k", "v"] + [n for n, p in enc.named_parameters() if p.requires_grad]
    checked = 0
    for name, a, b in zip(names, g_got, g_want):
        if b is None:  # a parameter of another layer
            assert a is None or a.abs().max() == 0, name
            continue
        assert a is not None, name
        err = (a.double() - b.double()).abs().max().item()
        assert err <= tol * max(b.abs().max().item(), floor * largest), (name, err, b.abs().max().item())
        checked += 1
    return checked


@pytest.mark.parametrize("base,params", BASES, ids=[b for b, _ in BASES])
@pytest.mark.parametrize("offset_kind", ["int", "tensor"])
def test_forward_and_every_gradient_float64(base, params, offset_kind):
    """Odd shapes (Lq 13, Lk 17, tiles 4 x 5), GQA (4 query heads, 2 kv heads), a prefix in the cache (offset 4),
    left padding with an empty row: forward and the gradients of q, k, v, the MLP and the base's parameters."""
    enc = _cape(base)
    q, k, v = _inputs(2, 13, 17, torch.float64)
    offset = 4 if offset_kind == "int" else torch.tensor(4)
    pos = (torch.arange(13) + 4)[None].repeat(2, 1)
    pos[1] -= 3  # row 1 is left padded by 3: its logical positions start 3 lower
    ctx = PosContext(encoding=enc, info=GQA, position_ids=pos, q_offset=offset)
    checked = _compare(enc, ctx, q, k, v, _mask(2, 13, 17, 4), 1e-9)
    expected = {"alibi": 7, "kerple": 9, "fire": 13}[base]  # q, k, v, fc1/fc2 weight and bias of layer 1, base
    assert checked == expected


@pytest.mark.parametrize("q_len", [1, 3])
def test_decode_with_a_tensor_offset(q_len):
    """Lq < Lk with a 0-d tensor offset (as a StaticCache gives) and empty cache slots after the queries."""
    enc = _cape("fire")
    k_len = 11
    offset = torch.tensor(6)
    q, k, v = _inputs(1, q_len, k_len, torch.float64, seed=2)
    ctx = PosContext(encoding=enc, info=GQA, position_ids=(torch.arange(q_len) + 6)[None], q_offset=offset)
    mask = (torch.arange(q_len)[:, None] + 6 >= torch.arange(k_len)[None, :])[None, None]
    _compare(enc, ctx, q, k, v, mask, 1e-9, blocks=(2, 3))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)], ids=["fp32", "bf16"])
def test_float32_and_bfloat16(dtype, tol):
    """The tiles compute in float32 from bf16 inputs (the reference multiplies bf16 probabilities by bf16 values,
    hence the tolerance); bf16 parameters are read in float32. Gradients relative to the largest one (that of
    fc2.bias is 0 in exact arithmetic: a constant per row and head leaves the softmax unchanged)."""
    enc = _cape("kerple", torch.float32 if dtype == torch.float32 else torch.bfloat16)
    q, k, v = _inputs(2, 9, 9, dtype, seed=3)
    ctx = PosContext(encoding=enc, info=GQA, position_ids=torch.arange(9)[None].repeat(2, 1))
    _compare(enc, ctx, q, k, v, _mask(2, 9, 9, 0), tol, blocks=(4, 4), floor=1.0)


def test_large_tiles_and_no_mask():
    """One tile covering everything, and no mask at all (bidirectional use)."""
    enc = _cape("alibi")
    q, k, v = _inputs(1, 6, 6, torch.float64, seed=4)
    ctx = PosContext(encoding=enc, info=GQA, position_ids=torch.arange(6)[None])
    _compare(enc, ctx, q, k, v, None, 1e-9, blocks=(64, 64))


def test_model_training_step_matches_the_reference():
    """A patched Llama: the loss and every parameter gradient of a training step on the tiles (the default)
    equal those of the reference path (forced by requesting the attention probabilities)."""
    model = make_model("llama", encoding="cape", base="kerple", train=True)
    ids = make_ids(2, 12)

    def run(output_attentions: bool):
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids, use_cache=False, output_attentions=output_attentions)
        out.loss.backward()
        return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    loss_t, grads_t = run(False)
    loss_r, grads_r = run(True)
    assert abs(loss_t - loss_r) < 1e-5
    assert grads_t.keys() == grads_r.keys()
    assert any("mlps" in n for n in grads_t) and any("r1_raw" in n for n in grads_t)
    largest = max(g.abs().max() for g in grads_r.values())
    for name in grads_r:
        assert (grads_t[name] - grads_r[name]).abs().max() <= 1e-4 * largest, name


def test_alibi_rank_one_form_equals_the_full_tile(monkeypatch):
    """With fixed ALiBi slopes the engine feeds the MLP [L; |δ|; 1] (the bias columns folded into one column,
    −(w1_B · slopes)); with learned slopes it keeps the full [L; B; 1] tile. Both give the same output and the same
    gradients of q, k, v and the MLP (float64), and the learned slopes get theirs."""
    from hf_posenc.kernels.cape import tiled

    forms = []
    real = tiled._bias_into

    def spy(slot, *args):
        forms.append(slot.shape[0])
        return real(slot, *args)

    monkeypatch.setattr(tiled, "_bias_into", spy)
    g = torch.Generator().manual_seed(3)
    w1, b1 = torch.randn(6, 8, generator=g, dtype=torch.float64), torch.randn(6, generator=g, dtype=torch.float64)
    w2, b2 = torch.randn(4, 6, generator=g, dtype=torch.float64), torch.randn(4, generator=g, dtype=torch.float64)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64)
    q, k, v = _inputs(2, 13, 17, torch.float64)
    weights = [t.requires_grad_() for t in (w1, b1, w2, b2)]
    results = []
    for learned in (False, True):
        s_in = slopes.clone().requires_grad_(learned)
        forms.clear()
        out = cape_attention_tiled(q, k, v, w1, b1, w2, b2, "alibi", (s_in,), _mask(2, 13, 17, 4), 0.4, 4,
                                   block_q=4, block_k=5)
        assert forms and set(forms) == {4 if learned else 1}
        inputs = [q, k, v, *weights] + ([s_in] if learned else [])
        weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
        results.append((out, _grads(out, inputs, weight)))
    (out_r, g_r), (out_f, g_f) = results
    assert (out_r - out_f).abs().max() <= 1e-12
    largest = max(g.abs().max().item() for g in g_f)  # b2's gradient is 0 up to rounding (a constant per row)
    for a, b in zip(g_r, g_f[:7]):
        assert (a - b).abs().max() <= 1e-10 * max(b.abs().max().item(), 1e-3 * largest)
    assert g_f[7].abs().max() > 0


def test_bad_inputs():
    q, k, v = _inputs(1, 4, 4, torch.float32)
    w1, b1, w2, b2 = torch.zeros(3, 8), torch.zeros(3), torch.zeros(4, 3), torch.zeros(4)
    slopes = (torch.ones(4),)
    with pytest.raises(ValueError, match="unknown kernel term"):
        cape_attention_tiled(q, k, v, w1, b1, w2, b2, "mystery", slopes, None, 1.0)
    with pytest.raises(ValueError, match="not a position bias"):
        cape_attention_tiled(q, k, v, w1, b1, w2, b2, "shaw", slopes, None, 1.0)
    with pytest.raises(ValueError, match="takes the tensors"):
        cape_attention_tiled(q, k, v, w1, b1, w2, b2, "t5", slopes, None, 1.0)
    with pytest.raises(ValueError, match="2H = 8"):
        cape_attention_tiled(q, k, v, w1[:, :6], b1, w2, b2, "alibi", slopes, None, 1.0)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        cape_attention_tiled(q[:, :3], k, v, w1, b1, w2, b2, "alibi", slopes, None, 1.0)
    with pytest.raises(TypeError, match="bool"):
        cape_attention_tiled(q, k, v, w1, b1, w2, b2, "alibi", slopes, torch.zeros(1, 1, 4, 4), 1.0)


def test_cape_is_registered_with_the_tiles():
    assert "cape" in hf_posenc.list_encodings()
