"""liere and fope: hand-computed cases, orthogonality, the (non-)relative property, clipping, reduction to
rope, parameter validation, and finite-difference gradients of the learned parameters (float64)."""

from __future__ import annotations

import math

import pytest
import torch

import hf_posenc
from hf_posenc import PosEncConfig
from hf_posenc.encodings.base import ModelInfo, PosContext
from hf_posenc.encodings.fope import Fope
from hf_posenc.encodings.liere import Liere
from hf_posenc.encodings.rope import Rope

from conftest import (
    enable_checkpointing,
    left_pad,
    make_ids,
    make_model,
    make_pixels,
    positions_from_mask,
    tiered,
    with_cache,
)

CPU = torch.device("cpu")
# (family, hidden, heads, kv heads, head_dim, layers, causal, max positions)
TEXT = ModelInfo("llama", 32, 4, 2, 8, 2, True, 64)
GRID = ModelInfo("vit", 32, 2, 2, 8, 2, False, 10, grid=(3, 3), patch_size=(8, 8))


def build(cls, name, info, **params):
    return cls(cls.resolve(PosEncConfig(name, params), info), info)


def text_ctx(enc, info, positions):
    """A text PosContext with ``positions`` (L,) or (B, L) as position_ids."""
    pos = torch.as_tensor(positions)
    return PosContext(encoding=enc, info=info, position_ids=pos[None] if pos.dim() == 1 else pos)


def set_generators(enc, a):
    """Make the generators exactly ``a`` (..., s, s skew-symmetric): P = upper triangle of a."""
    with torch.no_grad():
        upper = torch.triu(torch.as_tensor(a, dtype=enc.generator_raw.dtype), 1)
        enc.generator_raw.copy_(upper.expand_as(enc.generator_raw))


def probs(q, k, rq, rk):
    """softmax over keys of (R_q q)^T (R_k k): q (N, D), k (N, D), rq/rk (N, D/s, s, s)."""
    s = rq.shape[-1]
    qr = torch.einsum("nkij,nkj->nki", rq, q.reshape(q.shape[0], -1, s)).flatten(1)
    kr = torch.einsum("nkij,nkj->nki", rk, k.reshape(k.shape[0], -1, s)).flatten(1)
    return torch.softmax(qr @ kr.T, dim=-1)


# =====================================================================================================
# liere
# =====================================================================================================


def test_liere_block2_is_a_plane_rotation_by_p_times_a():
    """Block size 2: A = [[0, a], [-a, 0]], so R(p) = exp(pA) = [[cos pa, sin pa], [-sin pa, cos pa]]."""
    info = ModelInfo("llama", 8, 2, 1, 4, 1, True, 64)
    enc = build(Liere, "liere", info, block_size=2, position_scale=1.0)
    a = torch.tensor([[[0.0, 0.7], [-0.7, 0.0]], [[0.0, -1.3], [1.3, 0.0]]])  # the two blocks of the head
    set_generators(enc, a)
    positions = torch.tensor([0, 1, 5, 2])
    rot = enc.rotation(text_ctx(enc, info, positions), 4, CPU)[0, 0]  # (L, 2 blocks, 2, 2)
    for i, p in enumerate(positions.tolist()):
        for blk, ang in enumerate((0.7, -1.3)):
            c, s = math.cos(p * ang), math.sin(p * ang)
            torch.testing.assert_close(rot[i, blk], torch.tensor([[c, s], [-s, c]]), atol=1e-5, rtol=0)
    # applied to a query: pair (x0, x1) at p = 5 -> (c x0 + s x1, -s x0 + c x1)
    q = torch.randn(1, 2, 4, 4)
    k = torch.randn(1, 1, 4, 4)
    rq, rk = enc.rotate(text_ctx(enc, info, positions), q, k)
    c, s = math.cos(5 * 0.7), math.sin(5 * 0.7)
    x = q[0, 1, 2]
    want = torch.stack([c * x[0] + s * x[1], -s * x[0] + c * x[1]])
    torch.testing.assert_close(rq[0, 1, 2, :2], want, atol=1e-5, rtol=0)


def test_liere_block3_matches_rodrigues():
    """Block size 3: exp(pA) for A = |w| K (K the unit axis' cross-product matrix) is Rodrigues' rotation
    I + sin(p|w|) K + (1 - cos(p|w|)) K^2."""
    info = ModelInfo("llama", 6, 1, 1, 6, 1, True, 64)
    enc = build(Liere, "liere", info, block_size=3, position_scale=0.5)
    w = torch.tensor([0.3, -1.1, 0.8])
    cross = torch.tensor([[0.0, -w[2], w[1]], [w[2], 0.0, -w[0]], [-w[1], w[0], 0.0]])
    set_generators(enc, torch.stack([cross, 2 * cross]))  # second block: twice as fast
    rot = enc.rotation(text_ctx(enc, info, [3]), 1, CPU)[0, 0, 0]
    norm = w.norm()
    unit = cross / norm
    for blk, speed in enumerate((1.0, 2.0)):
        t = 1.5 * speed * norm  # p = 3 * 0.5
        expected = torch.eye(3) + torch.sin(t) * unit + (1 - torch.cos(t)) * unit @ unit
        torch.testing.assert_close(rot[blk], expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("block_size", [2, 4, 8])
@pytest.mark.parametrize("info", [TEXT, GRID], ids=["text", "vit"])
def test_liere_rotations_are_orthogonal(info, block_size):
    """R(p) is orthogonal with determinant 1 (exp of a skew-symmetric matrix), for the default random
    generators (entries up to 2*pi) at scaled positions; ViT's CLS block is the identity."""
    torch.manual_seed(0)
    enc = build(Liere, "liere", info, block_size=block_size, per_head=True)
    if info.family == "vit":
        ctx = PosContext(encoding=enc, info=info, grid=(3, 4))
        length = 13
    else:
        ctx = text_ctx(enc, info, torch.tensor([[0, 3, 9, 63], [70, 1, 2, 2]]))
        length = 4
    rot = enc.rotation(ctx, length, CPU)
    assert rot.dtype == torch.float32
    eye = torch.eye(block_size).expand_as(rot)
    torch.testing.assert_close(rot @ rot.transpose(-1, -2), eye, atol=2e-5, rtol=0)
    torch.testing.assert_close(torch.linalg.det(rot), torch.ones(rot.shape[:-2]), atol=2e-5, rtol=0)
    if info.family == "vit":
        torch.testing.assert_close(rot[:, :, 0], eye[:, :, 0])  # CLS: not rotated
        assert (rot[:, :, 1:] - eye[:, :, 1:]).abs().amax() > 0.1


def test_liere_is_not_relative_with_two_axes_but_is_with_commuting_generators():
    """Shifting every position by the same 2D offset changes the attention probabilities for random
    (non-commuting) generators; the same test passes for commuting ones (A_2 = 0.5 A_1), so it can tell."""
    torch.manual_seed(1)
    enc = build(Liere, "liere", GRID, block_size=4, position_scale=0.3)
    coords = torch.tensor([[r, c] for r in range(3) for c in range(3)], dtype=torch.float32) * 0.3
    shift = torch.tensor([0.9, -0.6])
    q, k = torch.randn(9, 8), torch.randn(9, 8)
    with torch.no_grad():
        gens = enc.generators()[0, :, 0]  # (axes, blocks, s, s)
        assert (gens[0] @ gens[1] - gens[1] @ gens[0]).abs().amax() > 1e-2, "random generators commute"
        r0, r1 = enc.rotations_at(coords)[0], enc.rotations_at(coords + shift)[0]
        moved = (probs(q, k, r0, r0) - probs(q, k, r1, r1)).abs().amax()
        assert moved > 1e-2, f"liere looked relative on ViT (max change {moved})"
        set_generators(enc, torch.stack([gens[0], 0.5 * gens[0]])[None, :, None])
        r0, r1 = enc.rotations_at(coords)[0], enc.rotations_at(coords + shift)[0]
        torch.testing.assert_close(probs(q, k, r0, r0), probs(q, k, r1, r1), atol=1e-5, rtol=0)


@pytest.mark.parametrize("per_head", [False, True], ids=["shared", "per-head"])
def test_liere_is_relative_on_text(per_head):
    """One axis: shifting every position_id leaves every layer's attention probabilities unchanged (Llama, GQA)."""
    model = make_model("llama", encoding="liere", per_head=per_head, per_layer=True)
    with torch.no_grad():
        for p in hf_posenc.encoding_module(model).parameters():
            p.mul_(20.0)  # fast rotations, so that the positions matter
    ids = make_ids(2, 9)
    pos = torch.arange(9).expand(2, -1)
    with torch.no_grad():
        a = model(ids, position_ids=pos, output_attentions=True, use_cache=False)
        b = model(ids, position_ids=pos + 11, output_attentions=True, use_cache=False)
        c = model(ids, position_ids=pos * 2, output_attentions=True, use_cache=False)
    for pa, pb in zip(a.attentions, b.attentions):
        torch.testing.assert_close(pa, pb, atol=2e-5, rtol=0)
    assert max((pa - pc).abs().amax() for pa, pc in zip(a.attentions, c.attentions)) > 1e-3, "positions unused"


def test_liere_positions_follow_the_official_normalisation():
    """ViT: each axis of n patches spans linspace(0, n / n_train, n); text: position / (L_train - 1)."""
    enc = build(Liere, "liere", GRID)
    for grid in [(3, 3), (6, 4), (1, 5)]:
        coords, cls = enc.positions(PosContext(encoding=enc, info=GRID, grid=grid), grid[0] * grid[1] + 1, CPU)
        rows = torch.linspace(0, grid[0] / 3, grid[0])
        cols = torch.linspace(0, grid[1] / 3, grid[1])
        want = torch.cartesian_prod(rows, cols)
        torch.testing.assert_close(coords[0, 1:], want, atol=1e-6, rtol=0)
        assert cls[0] and not cls[1:].any()
    enc = build(Liere, "liere", TEXT)
    coords, cls = enc.positions(text_ctx(enc, TEXT, [0, 7, 63, 100]), 4, CPU)
    torch.testing.assert_close(coords[0, :, 0], torch.tensor([0, 7, 63, 100]) / 63.0)
    assert cls is None
    enc = build(Liere, "liere", GRID, position_scale=0.5)
    coords, _ = enc.positions(PosContext(encoding=enc, info=GRID, grid=(2, 2)), 5, CPU)
    torch.testing.assert_close(coords[0, 1:], torch.tensor([[0, 0], [0, 0.5], [0.5, 0], [0.5, 0.5]]))


def test_liere_initialisation_as_official_code():
    """Generator entries above the diagonal ~ U[0, 2*pi), A = P - P^T skew-symmetric."""
    torch.manual_seed(0)
    info = ModelInfo("llama", 256, 8, 8, 64, 4, True, 64)
    enc = build(Liere, "liere", info, per_head=True, per_layer=True)
    assert enc.generator_raw.shape == (4, 1, 8, 1, 64, 64)  # one dense block over the head (the default)
    gens = enc.generators()
    torch.testing.assert_close(gens, -gens.transpose(-1, -2))
    upper = gens[..., torch.triu_indices(64, 64, 1)[0], torch.triu_indices(64, 64, 1)[1]]
    assert upper.min() >= 0 and upper.max() < 2 * math.pi
    assert abs(upper.mean().item() - math.pi) < 0.05


def test_liere_gqa_query_heads_use_their_kv_heads_rotation():
    torch.manual_seed(0)
    enc = build(Liere, "liere", TEXT, per_head=True)
    x = torch.randn(1, 1, 3, 8)
    q, k = x.expand(1, 4, 3, 8), x.expand(1, 2, 3, 8)
    rq, rk = enc.rotate(text_ctx(enc, TEXT, [2, 9, 30]), q, k)
    torch.testing.assert_close(rq[:, 0], rk[:, 0])
    torch.testing.assert_close(rq[:, 1], rk[:, 0])
    torch.testing.assert_close(rq[:, 2], rk[:, 1])
    torch.testing.assert_close(rq[:, 3], rk[:, 1])
    assert (rk[:, 0] - rk[:, 1]).abs().amax() > 1e-3


def test_liere_one_matrix_exp_per_forward_over_distinct_positions(monkeypatch):
    """The rotation tensors (what the Triton kernel takes; the CPU rotates in the eigenbasis instead, see
    test_rope2d_comrope.py::test_spectral_rotation_path_equals_the_rotation_tensors): shared generators, one
    exponential (on text: one spectral ``skew_exp``) per forward (not per layer), over the distinct positions of
    the batch only (left padding repeats position 0); per-layer generators: one call per layer."""
    import hf_posenc.encodings.liere as liere_module

    monkeypatch.setattr(liere_module.Liere, "spectral_terms", lambda self, *args: None)
    calls = []
    real = liere_module.skew_exp  # text has one axis: the spectral form replaces matrix_exp

    def counting(skew, coeff):
        calls.append((skew.shape[0], coeff.shape[0]))
        return real(skew, coeff)

    monkeypatch.setattr(liere_module, "skew_exp", counting)
    monkeypatch.setattr(torch.linalg, "matrix_exp", lambda x: pytest.fail("matrix_exp on text"))
    ids, mask = left_pad([make_ids(1, 4, seed=2)[0], make_ids(1, 7, seed=3)[0]])
    pos = positions_from_mask(mask)  # row 0: 0, 0, 0, 0, 1, 2, 3; row 1: 0..6
    for per_layer, n_calls in ((False, 1), (True, 2)):
        model = make_model("llama", encoding="liere", per_layer=per_layer)
        calls.clear()
        with torch.no_grad():
            model(ids, attention_mask=mask, position_ids=pos, use_cache=False)
        assert len(calls) == n_calls, calls
        assert all(c[1] == 7 for c in calls), calls  # (heads, distinct positions)


def test_liere_bf16_parameters_compute_in_float32():
    enc = build(Liere, "liere", GRID, per_head=True).to(torch.bfloat16)
    rot = enc.rotation(PosContext(encoding=enc, info=GRID, grid=(3, 3)), 10, CPU)
    assert rot.dtype == torch.float32
    torch.testing.assert_close(rot @ rot.transpose(-1, -2), torch.eye(8).expand_as(rot), atol=2e-5, rtol=0)
    q = torch.randn(2, 2, 10, 8, dtype=torch.bfloat16)
    rq, rk = enc.rotate(PosContext(encoding=enc, info=GRID, grid=(3, 3)), q, q)
    assert rq.dtype == torch.bfloat16


@pytest.mark.parametrize("info", [TEXT, GRID], ids=["text", "vit"])
def test_liere_gradcheck(info):
    """d(rotated q . rotated k) / d(raw generators) against finite differences in float64 (per layer and head)."""
    torch.manual_seed(0)
    small = ModelInfo(info.family, 8, 2, 2, 4, 2, info.causal, 16, grid=info.grid, patch_size=info.patch_size)
    enc = build(Liere, "liere", small, block_size=2 if info.family == "vit" else 4, per_head=True, per_layer=True)
    enc = enc.double()
    raw = (enc.generator_raw.detach().clone() * 0.3).requires_grad_(True)
    del enc.generator_raw
    coords = torch.rand(3, enc.num_axes, dtype=torch.float64) * 2
    q, k = torch.randn(2, 3, 4, dtype=torch.float64), torch.randn(2, 3, 4, dtype=torch.float64)

    def logits(p):
        enc.generator_raw = p
        out = []
        for layer in range(2):
            rot = enc.rotations_at(coords, layer)  # (H, N, K, s, s)
            s = rot.shape[-1]
            qr = torch.einsum("hnkij,hnkj->hnki", rot, q.reshape(2, 3, -1, s)).flatten(2)
            kr = torch.einsum("hnkij,hnkj->hnki", rot, k.reshape(2, 3, -1, s)).flatten(2)
            out.append(qr @ kr.transpose(-1, -2))
        return torch.stack(out)

    assert torch.autograd.gradcheck(logits, (raw,), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "params,error",
    [
        ({"block_size": 9}, ValueError),
        ({"block_size": 1}, ValueError),
        ({"block_size": 2.5}, TypeError),
        ({"per_head": "yes"}, TypeError),
        ({"per_layer": 1}, TypeError),
        ({"position_scale": 0.0}, ValueError),
        ({"position_scale": -1.0}, ValueError),
        ({"blocks": 2}, ValueError),
    ],
)
def test_liere_rejects_bad_parameters(params, error):
    with pytest.raises(error):
        hf_posenc.patch_model(make_model("gpt2"), "liere", **params)


def test_liere_default_is_one_dense_block_per_head():
    """Source: the official code (StanfordMIMI/LieRE, models/rope_vit.py) learns one dense skew-symmetric
    generator over the head (generator_dim 64 at head_dim 64): block_size defaults to head_dim."""
    info = ModelInfo("llama", 64, 4, 2, 16, 1, True, 64)
    cfg = Liere.resolve(PosEncConfig("liere"), info)
    assert cfg.params["block_size"] == 16
    enc = Liere(cfg, info)
    assert enc.generator_raw.shape == (1, 1, 1, 1, 16, 16)


@pytest.mark.parametrize(
    "info",
    tiered([pytest.param(ModelInfo("llama", 64, 4, 2, 16, 1, True, 64), id="text"), pytest.param(GRID, id="vit")],
           fast=["text"]),
)
def test_liere_dense_block_is_exact_against_matrix_exp_float64(info):
    """q' = exp(Σ_i p_i A_i) q with one dense (D x D) generator per axis, against an independent float64
    matrix_exp of the full D x D matrix, per token; and the rotation is differentiable (gradcheck)."""
    enc = build(Liere, "liere", info, position_scale=0.3).double()
    d = info.head_dim
    gens = enc.generators()[0, :, 0, 0]  # (axes, D, D)
    assert gens.shape[-1] == d
    if info.family == "vit":
        ctx, n = PosContext(encoding=enc, info=info, grid=(3, 3)), 10
        coords = torch.tensor([[0.0, 0.0]] + [[r, c] for r in range(3) for c in range(3)], dtype=torch.float64)
    else:
        positions = torch.tensor([0, 3, 7, 3, 11])
        ctx, n = text_ctx(enc, info, positions), 5
        coords = positions.double()[:, None]
    q = torch.randn(1, info.num_heads, n, d, dtype=torch.float64)
    k = torch.randn(1, info.num_kv_heads, n, d, dtype=torch.float64)
    rq, rk = enc.rotate(ctx, q, k)
    for t in range(n):
        if info.family == "vit" and t == 0:
            want = torch.eye(d, dtype=torch.float64)  # CLS: not rotated
        else:
            p = coords[t] * 0.3  # positions are scaled in the model's dtype (float64 here), as in the encoding
            want = torch.linalg.matrix_exp(torch.einsum("a,aij->ij", p, gens.detach()))
        torch.testing.assert_close(rq[0, :, t], q[0, :, t] @ want.T, atol=1e-10, rtol=0)
        torch.testing.assert_close(rk[0, :, t], k[0, :, t] @ want.T, atol=1e-10, rtol=0)

    raw = enc.generator_raw.detach().clone().requires_grad_(True)

    def f(raw):
        p = raw - raw.transpose(-1, -2)
        algebra = torch.einsum("na,ahkij->hnkij", coords[1:3, : p.shape[1]] * 0.3, p[0])
        return torch.linalg.matrix_exp(algebra)

    got = enc.rotations_at(coords[1:3, : enc.num_axes] * 0.3)
    torch.testing.assert_close(got, f(enc.generator_raw), atol=1e-12, rtol=0)
    assert torch.autograd.gradcheck(lambda r: (enc.rotations_at.__func__(_with_raw(enc, r), coords[1:3, : enc.num_axes] * 0.3)), (raw,))


class _RawView:
    """``enc`` with ``generator_raw`` replaced (for gradcheck of rotations_at)."""

    def __init__(self, enc, raw):
        self._enc, self.generator_raw = enc, raw

    def __getattr__(self, name):
        return getattr(self._enc, name)

    def generators(self):
        return Liere.generators(self)


def _with_raw(enc, raw):
    return _RawView(enc, raw)


def test_liere_block_above_8_runs_in_a_model():
    """Blocks larger than the Triton kernel's 8 rotate through the PyTorch path (head_dim 16, one block)."""
    model = make_model("llama", encoding="liere", config_overrides={"hidden_size": 64, "num_attention_heads": 4,
                                                                    "num_key_value_heads": 2})
    assert model.config.position_encoding["block_size"] == 16
    ids = make_ids(2, 9)
    model(ids, labels=ids).loss.backward()
    assert hf_posenc.encoding_module(model).generator_raw.grad.abs().max() > 0


def test_liere_block_size_must_divide_head_dim():
    with pytest.raises(ValueError, match="allowed here"):
        hf_posenc.patch_model(make_model("llama"), "liere", block_size=3)  # head_dim 8
    model = hf_posenc.patch_model(make_model("llama"), "liere", block_size=4)
    assert model.config.position_encoding["block_size"] == 4
    assert hf_posenc.patch_model(make_model("llama"), "liere").config.position_encoding["block_size"] == 8


# =====================================================================================================
# fope
# =====================================================================================================


def fope_identity(info, **params):
    """fope with the coefficient matrices at their identity-equivalent (sigma = 0)."""
    return build(Fope, "fope", info, sigma=0.0, **params)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_fope_reduces_to_rope_with_identity_coefficients_and_no_clipping(layout):
    """a = b = identity on the dominant frequencies, train_length = 0: exactly rope (GQA, padded positions)."""
    torch.manual_seed(0)
    fope = fope_identity(TEXT, train_length=0, layout=layout, theta=500.0)
    rope = build(Rope, "rope", TEXT, layout=layout, theta=500.0)
    pos = torch.tensor([[0, 0, 1, 2, 3], [4, 5, 6, 7, 100]])
    q, k = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8)
    want = rope.rotate(text_ctx(rope, TEXT, pos), q, k)
    got = fope.rotate(text_ctx(fope, TEXT, pos), q, k, layer=1)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)


def test_fope_identity_without_clipping_reproduces_unpatched_llama():
    native = make_model("llama")
    patched = make_model("llama", encoding="fope", sigma=0.0, train_length=0)
    ids, mask = left_pad([make_ids(1, 6, seed=5)[0], make_ids(1, 8, seed=6)[0]])
    kw = dict(attention_mask=mask, position_ids=positions_from_mask(mask), use_cache=False)
    with torch.no_grad():
        want, got = native(ids, **kw).logits, patched(ids, **kw).logits
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=1e-5, rtol=0)


def test_fope_clipping_sets_low_frequency_angles_to_zero():
    """head_dim 8, theta 10000: frequencies 1, 0.1, 0.01, 0.001; L_train = 64 puts the floor at 2*pi/64 =
    0.098, so pairs 2 and 3 get angle 0 (C = 1, S = 0) at every position; pairs 0 and 1 keep rope's angles."""
    fope = fope_identity(TEXT)  # train_length defaults to the model's 64 positions
    assert fope.posenc_config.params["train_length"] == 64
    keep, fourier = fope._masks()
    assert keep.tolist() == [[True, True, False, False]] and fourier.tolist() == [[True, True, False, False]]
    pos = torch.tensor([[0.0, 1.0, 5.0, 63.0, 1000.0]])
    c, s = fope.fourier_terms(pos[..., None])
    angles = pos[0, :, None] * torch.tensor([1.0, 0.1, 0.0, 0.0])
    torch.testing.assert_close(c[0, 0], angles.cos(), atol=1e-6, rtol=0)
    torch.testing.assert_close(s[0, 0], angles.sin(), atol=1e-6, rtol=0)
    # clipped frequencies are also dropped from the harmonics: their coefficient rows have no effect
    fope = build(Fope, "fope", TEXT, sigma=0.5)
    before = fope.fourier_terms(pos[..., None])
    with torch.no_grad():
        fope.cos_coef[:, :, :, 2:] += 100.0
        fope.sin_coef[:, :, :, 2:] -= 100.0
    after = fope.fourier_terms(pos[..., None])
    for x, y in zip(before, after):
        torch.testing.assert_close(x, y)


def test_fope_hand_computed_small_case():
    """head_dim 4 (2 pairs), D = 2 frequencies 100^0 = 1 and 100^(-1/2) = 0.1, no clipping, one head:
    C_m(n) = a_0m cos(n) + a_1m cos(0.1 n), S_m(n) = b_0m sin(n) + b_1m sin(0.1 n), and the pair
    (x_m, x_{m+2}) becomes (x_m C_m - x_{m+2} S_m, x_{m+2} C_m + x_m S_m)."""
    info = ModelInfo("llama", 4, 1, 1, 4, 1, True, 64)
    fope = build(Fope, "fope", info, theta=100.0, train_length=0)
    a = torch.tensor([[0.9, -0.2], [0.3, 1.1]])  # cos coefficients (frequency j, pair m)
    b = torch.tensor([[1.2, 0.4], [-0.5, 0.8]])  # sin coefficients
    with torch.no_grad():
        fope.cos_coef.copy_(a[None, None, None])
        fope.sin_coef.copy_(b[None, None, None])
    x = torch.tensor([0.5, -1.0, 2.0, 0.25])
    n = 3.0
    out = fope.rotate(text_ctx(fope, info, [3]), x.view(1, 1, 1, 4), x.view(1, 1, 1, 4))[0][0, 0, 0]
    want = []
    terms = []
    for m in range(2):
        cm = a[0, m] * math.cos(n) + a[1, m] * math.cos(0.1 * n)
        sm = b[0, m] * math.sin(n) + b[1, m] * math.sin(0.1 * n)
        terms.append((cm, sm))
    for m in range(2):
        cm, sm = terms[m]
        want.append(x[m] * cm - x[m + 2] * sm)
    for m in range(2):
        cm, sm = terms[m]
        want.append(x[m + 2] * cm + x[m] * sm)
    torch.testing.assert_close(out, torch.stack(want), atol=1e-6, rtol=0)


def test_fope_init_is_eye_plus_official_xavier():
    """eye_xavier_norm: identity on the dominant frequency of each pair plus N(0, sigma^2 * 2 / (P (|K| + H)))."""
    torch.manual_seed(0)
    info = ModelInfo("llama", 2048, 16, 16, 128, 3, True, 512)
    fope = build(Fope, "fope", info, sigma=0.6, num_frequencies=128)  # D = 2 * head_dim/2: step 2
    keep, fourier = fope._masks()
    n_keep, n_pairs = int(keep.sum()), int(fourier.sum())
    # floor 2*pi/512 = 0.01227: 10000^(-j/128) >= it for j <= 128 ln(81.49) / ln(10000) = 61.2, so 62 kept
    # frequencies (j = 0..61); pair m's dominant frequency is j = 2m: 31 Fourier pairs (m = 0..30)
    assert (n_keep, n_pairs) == (62, 31)
    assert fope.cos_coef.shape == (3, 1, 16, 128, 64)
    eye = torch.zeros(128, 64)
    eye[torch.arange(64) * 2, torch.arange(64)] = 1.0
    noise = fope.cos_coef - eye
    std = 0.6 * math.sqrt(2 / (n_pairs * (n_keep + 16)))
    assert abs(noise.std().item() / std - 1) < 0.02
    assert (fope.cos_coef - fope.sin_coef).abs().amax() > 0  # separate matrices
    assert (fope.cos_coef[0] - fope.cos_coef[1]).abs().amax() > 0  # per layer


def test_fope_coefficients_are_fixed_buffers_unless_learnable():
    model = make_model("llama", encoding="fope")
    enc = hf_posenc.encoding_module(model)
    assert list(enc.parameters()) == []
    assert sorted(enc.state_dict()) == ["cos_coef", "sin_coef"]
    model = make_model("llama", encoding="fope", learnable=True, train=True)
    enc = hf_posenc.encoding_module(model)
    ids = make_ids(2, 12)
    model(ids, labels=ids, use_cache=False).loss.backward()
    for p in (enc.cos_coef, enc.sin_coef):
        assert p.grad is not None and p.grad.abs().sum() > 0


def test_fope_vit_is_axial_with_the_cls_untouched():
    """ViT: the first half of the pairs follows the patch row, the second half the column (each a FoPE over
    head_dim/2 with theta 100); floors 2*pi/rows and 2*pi/cols of the training grid; CLS gets (C, S) = (1, 0)."""
    info = ModelInfo("vit", 64, 2, 2, 16, 2, False, 257, grid=(16, 8), patch_size=(8, 8))
    fope = build(Fope, "fope", info)
    assert fope.posenc_config.params["theta"] == 100.0
    # per axis 4 pairs, frequencies 100^(-m/4) = 1, 0.316, 0.1, 0.0316; floors 2*pi/16 = 0.39, 2*pi/8 = 0.79
    keep, fourier = fope._masks()
    assert fourier.tolist() == [[True, False, False, False], [True, False, False, False]]
    assert keep.tolist() == [[True, False, False, False], [True, False, False, False]]
    ctx = PosContext(encoding=fope, info=info, grid=(5, 7))
    c, s = fope.terms(ctx, 1, 36, CPU)
    assert c.shape == (1, 2, 36, 8)
    torch.testing.assert_close(c[0, :, 0], torch.ones(2, 8))
    torch.testing.assert_close(s[0, :, 0], torch.zeros(2, 8))
    coords = torch.tensor([[r, col] for r in range(5) for col in range(7)], dtype=torch.float32)
    rows_same = coords[:, 0][:, None] == coords[:, 0][None]
    cols_same = coords[:, 1][:, None] == coords[:, 1][None]
    patch = c[0, 0, 1:]  # (35, 8)
    row_part, col_part = patch[:, :4], patch[:, 4:]
    row_diff = (row_part[:, None] - row_part[None]).abs().amax(-1)
    col_diff = (col_part[:, None] - col_part[None]).abs().amax(-1)
    assert row_diff[rows_same].max() < 1e-6 and col_diff[cols_same].max() < 1e-6
    assert row_diff[~rows_same].min() > 1e-3 and col_diff[~cols_same].min() > 1e-3
    # train_length overrides both axes; 0 keeps every frequency
    fope = build(Fope, "fope", info, train_length=0)
    assert fope._masks()[1].all()


def test_fope_runs_on_vit_at_another_resolution():
    """A 48x64 image (a 6x8 grid; the config's is 4x4) runs without interpolation: every patch's (C, S) is that of
    its own coordinates whatever the grid (the patches of the 4x4 corner keep the 4x4 grid's), the others differ
    from all of them, and the model's output is not nope's."""
    model = make_model("vit", encoding="fope", train_length=0)
    pixels = make_pixels(1, 48, 64)
    with torch.no_grad():
        out = model(pixel_values=pixels).logits
        plain = make_model("vit", encoding="nope")(pixel_values=pixels).logits
    assert torch.isfinite(out).all() and (out - plain).abs().max() > 1e-3
    fope = hf_posenc.encoding_module(model)
    with torch.no_grad():
        big = fope.terms(PosContext(encoding=fope, info=fope.info, grid=(6, 8)), 0, 49, CPU)
        small = fope.terms(PosContext(encoding=fope, info=fope.info, grid=(4, 4)), 0, 17, CPU)
    corner = [1 + r * 8 + c for r in range(4) for c in range(4)]
    outside = [i for i in range(1, 49) if i not in corner]
    for b, s in zip(big, small):
        torch.testing.assert_close(b[..., corner, :], s[..., 1:, :], rtol=0, atol=1e-6)
        gap = (b[..., outside, None, :] - s[..., None, 1:, :]).abs().amax(dim=(0, 1, -1))  # (outside, corner)
        assert gap.min() > 1e-3


@pytest.mark.parametrize("info", [TEXT, GRID], ids=["text", "vit"])
def test_fope_gradcheck(info):
    """d(C, S, and the transformed q) / d(coefficients) against finite differences in float64 (learnable)."""
    torch.manual_seed(0)
    fope = build(Fope, "fope", info, learnable=True, train_length=0, num_frequencies=8).double()
    a = fope.cos_coef.detach().clone().requires_grad_(True)
    b = fope.sin_coef.detach().clone().requires_grad_(True)
    del fope.cos_coef, fope.sin_coef
    coords = torch.rand(1, 3, fope.num_axes, dtype=torch.float64) * 5
    x = torch.randn(1, 2, 3, 8, dtype=torch.float64)

    def out(a_, b_):
        fope.cos_coef, fope.sin_coef = a_, b_
        c, s = fope.fourier_terms(coords, layer=1)
        xf = x[..., :4], x[..., 4:]
        return torch.cat([xf[0] * c - xf[1] * s, xf[1] * c + xf[0] * s], dim=-1), c, s

    assert torch.autograd.gradcheck(out, (a, b), eps=1e-6, atol=1e-6)


def test_fope_bf16_buffers_compute_in_float32():
    model = make_model("llama", encoding="fope", dtype=torch.bfloat16)
    enc = hf_posenc.encoding_module(model)
    assert enc.cos_coef.dtype == torch.bfloat16
    ctx = text_ctx(enc, enc.info, [0, 5, 9])
    c, s = enc.terms(ctx, 0, 3, CPU)
    assert c.dtype == s.dtype == torch.float32


@pytest.mark.parametrize(
    "family,params,error",
    [
        ("llama", {"num_frequencies": 6}, ValueError),  # not a multiple of head_dim/2 = 4
        ("llama", {"sigma": -0.1}, ValueError),
        ("llama", {"train_length": -1}, ValueError),
        ("llama", {"train_length": 1.5}, TypeError),
        ("llama", {"theta": 1.0}, ValueError),
        ("llama", {"layout": "pairs"}, ValueError),
        ("llama", {"learnable": "no"}, TypeError),
        ("vit", {"num_frequencies": 2}, ValueError),
    ],
)
def test_fope_rejects_bad_parameters(family, params, error):
    with pytest.raises(error):
        hf_posenc.patch_model(make_model(family), "fope", **params)


def test_fope_needs_head_dim_divisible_by_four_on_vit():
    with pytest.raises(ValueError, match="divisible by 4"):
        hf_posenc.patch_model(make_model("vit", config_overrides={"hidden_size": 24, "num_attention_heads": 4}), "fope")


# =====================================================================================================
# non-default variants through the model: cache == full forward, gradient checkpointing
# =====================================================================================================

VARIANTS = [
    ("liere", {"per_head": True, "per_layer": True, "block_size": 4}),
    ("fope", {"learnable": True, "per_layer": False, "num_frequencies": 8}),
    ("fope", {"learnable": True, "layout": "interleaved", "sigma": 0.5}),
]
VARIANT_IDS = ["liere-per-head-layer", "fope-learnable-shared", "fope-learnable-interleaved"]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("encoding,params", VARIANTS, ids=VARIANT_IDS)
def test_variants_cache_matches_full_forward(family, encoding, params):
    from transformers import DynamicCache

    model = make_model(family, encoding=encoding, **params)
    ids = make_ids(2, 9)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        past = DynamicCache(config=model.config)
        pieces = [model(ids[:, :5], **with_cache(past)).logits]
        pieces += [model(ids[:, i : i + 1], **with_cache(past)).logits for i in range(5, 9)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["llama", "vit"])
@pytest.mark.parametrize("encoding,params", VARIANTS, ids=VARIANT_IDS)
def test_variants_gradient_checkpointing(family, encoding, params):
    """Trainable encodings are rebuilt per layer in training, so checkpointed (reentrant) recomputation gives
    the same loss and gradients, the encoding's included. (On the 4x4 test grid with head_dim 8 every ViT
    frequency is under fope's default floor 2*pi/4, so clipping is turned off there.)"""
    from conftest import forward_and_loss, model_inputs

    if family == "vit" and encoding == "fope":
        params = {**params, "train_length": 0}
    inputs = model_inputs(family)
    results = []
    for ckpt in (False, True):
        model = make_model(family, encoding=encoding, train=True, **params)
        if ckpt:
            enable_checkpointing(model, {"use_reentrant": True})
        _, loss = forward_and_loss(family, model, inputs)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (l0, g0), (l1, g1) = results
    torch.testing.assert_close(l0, l1)
    assert sorted(g0) == sorted(g1)
    assert all(g0[n].abs().sum() > 0 for n in g0 if "posenc" in n) and any("posenc" in n for n in g0)
    for n in g0:
        torch.testing.assert_close(g0[n], g1[n], atol=1e-6, rtol=1e-5)
