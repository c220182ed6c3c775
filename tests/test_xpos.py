"""xpos (Sun et al. 2022): rope's rotation with a per-frequency exponential decay zeta^((n - m)/B).

A hand-computed score, the full formula (complex form, both layouts, partial rotary) against the encoding's own
rotation, torchscale's centring (re-centred per length) against the fixed centre, the relative property, plain
rope as the limit of a large scale base on every decoder family, the KV cache and left padding on every decoder
family, save and reload, the profile, and the refusals (bidirectional families, positions out of range).
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache, StaticCache

import hf_posenc
from hf_posenc.encodings.base import ModelInfo, PosContext
from hf_posenc.encodings.xpos import Xpos, xpos_max_distance, xpos_zeta
from conftest import (
    DECODERS,
    left_pad,
    main_output,
    make_ids,
    make_model,
    model_inputs,
    positions_from_mask,
    with_cache,
)


def text_info(head_dim: int = 8, heads: int = 1, kv_heads: int = 1, max_positions: int | None = 64) -> ModelInfo:
    return ModelInfo("llama", heads * head_dim, heads, kv_heads, head_dim, 1, True, max_positions)


def build(info: ModelInfo, **params) -> Xpos:
    return Xpos(Xpos.resolve(hf_posenc.PosEncConfig("xpos", params), info), info)


def transform(enc: Xpos, q: torch.Tensor, k: torch.Tensor, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The encoding's q/k transform of tokens (1, H, L, D) at the given logical positions."""
    ctx = PosContext(encoding=enc, info=enc.info, position_ids=torch.tensor([positions]))
    return enc.rotate(ctx, q, k)


def pairs(x: torch.Tensor, rotary_dim: int, layout: str) -> torch.Tensor:
    """The rotated pairs of x (..., D) as complex numbers (..., R/2): (x[i], x[i + R/2]) or (x[2i], x[2i+1])."""
    x = x[..., :rotary_dim].double()
    if layout == "half":
        return torch.complex(x[..., : rotary_dim // 2], x[..., rotary_dim // 2 :])
    return torch.complex(x[..., 0::2], x[..., 1::2])


def formula_scores(q, k, n, m, theta, zeta, scale_base, rotary_dim, layout) -> torch.Tensor:
    """sum_i zeta_i^((n - m)/B) Re[q~_i conj(k~_i) e^(i (n - m) theta_i)] + the pass-through dims' q . k, for
    q (Lq, D) at positions n (Lq,), k (Lk, D) at positions m (Lk,): (Lq, Lk) float64."""
    rel = (n[:, None] - m[None, :]).double()  # (Lq, Lk)
    qc, kc = pairs(q, rotary_dim, layout), pairs(k, rotary_dim, layout)  # (L, R/2)
    phase = torch.exp(1j * rel[..., None] * theta.double())  # (Lq, Lk, R/2)
    decay = zeta.double() ** (rel[..., None] / scale_base)
    rotated = (decay * (qc[:, None] * kc[None].conj() * phase).real).sum(-1)
    return rotated + q[:, rotary_dim:].double() @ k[:, rotary_dim:].double().T


# ---------------------------------------------------------------------------------------------------
# the formula
# ---------------------------------------------------------------------------------------------------


def test_zeta_and_resolved_defaults():
    """zeta_i = (i / (R/2) + 0.4) / 1.4; the resolved config fills theta (rope's) and the centre (half the
    model's maximum position count)."""
    assert xpos_zeta(8, 0.4).tolist() == pytest.approx([0.4 / 1.4, 0.65 / 1.4, 0.9 / 1.4, 1.15 / 1.4], rel=1e-6)
    model = make_model("llama", encoding="xpos")
    stored = model.config.position_encoding
    assert {k: stored[k] for k in ("name", "theta", "layout", "scale_base", "gamma", "center")} == {
        "name": "xpos", "theta": 10000.0, "layout": "half", "scale_base": 512.0, "gamma": 0.4, "center": 32,
    }
    assert build(text_info(max_positions=None)).center == 0


@pytest.mark.parametrize("center", [0, 5, 50])
def test_score_by_hand(center):
    """head_dim 2 (one pair, theta_0 = 1), B = 2, zeta_0 = 0.4 / 1.4 = 2/7; a query at n = 3, a key at m = 1:
    q = (1, 0), k = (1, 0): cos(2) * (2/7)^((3 - 1)/2); q = (0, 1): Re[i e^(2i)] = -sin(2), times 2/7. The centre
    does not change the scores."""
    enc = build(text_info(head_dim=2), scale_base=2.0, center=center)
    e0, e1 = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    for q_vec, want in ((e0, math.cos(2) * 2 / 7), (e1, -math.sin(2) * 2 / 7)):
        tokens_q = torch.stack([q_vec, q_vec])[None, None]  # positions (1, 3)
        tokens_k = torch.stack([e0, e0])[None, None]
        q, k = transform(enc, tokens_q, tokens_k, [1, 3])
        assert (q[0, 0, 1] @ k[0, 0, 0]).item() == pytest.approx(want, rel=1e-5)
        # the key at the query's own position: no decay, the plain dot product
        assert (q[0, 0, 1] @ k[0, 0, 1]).item() == pytest.approx((q_vec @ e0).item(), abs=1e-6)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("partial", [None, 0.5])
def test_scores_match_the_full_formula(layout, partial):
    """q_n . k_m of the transformed tokens against sum_i zeta_i^((n - m)/B) Re[q~_i conj(k~_i) e^(i(n - m) theta_i)]
    at random positions (left to right, repeated, far apart), both layouts, full and half rotary."""
    d = 16
    enc = build(text_info(head_dim=d), layout=layout, partial_rotary_factor=partial, scale_base=32.0, theta=500.0)
    r = enc.rotary_dim
    assert r == (d if partial is None else 8)
    g = torch.Generator().manual_seed(0)
    positions = [0, 3, 3, 7, 20, 41, 40, 63, 90]
    q0, k0 = torch.randn(1, 1, len(positions), d, generator=g), torch.randn(1, 1, len(positions), d, generator=g)
    q, k = transform(enc, q0, k0, positions)
    got = (q[0, 0].double() @ k[0, 0].double().T)
    pos = torch.tensor(positions)
    theta = 500.0 ** (-torch.arange(0, r, 2, dtype=torch.float64) / r)
    want = formula_scores(q0[0, 0], k0[0, 0], pos, pos, theta, xpos_zeta(r, 0.4), 32.0, r, layout)
    # float32 angles and factors: errors of a few float32 ulps of the largest score (factors up to ~10 here)
    assert torch.allclose(got, want, rtol=1e-5, atol=4e-6 * want.abs().max().item()), (got - want).abs().max()
    if partial is not None:  # the pass-through dims carry no position and no decay
        assert torch.equal(q[..., r:], q0[..., r:]) and torch.equal(k[..., r:], k0[..., r:])


def torchscale_style(x: torch.Tensor, scale_base: float, downscale: bool) -> torch.Tensor:
    """The formula as torchscale's XPOS computes it (restated, not copied) for x (L, d) at positions 0 .. L-1:
    interleaved pairs, frequencies 10000^(-j/(d/2)), scale zeta_j^(p'/B) with p' = p - ceil(L/2) (its centring
    at -(L // 2) in Python's floor division), the reciprocal scale with ``downscale``."""
    length, d = x.shape
    j = torch.arange(d // 2, dtype=torch.float64)
    zeta = (2 * j + 0.4 * d) / (1.4 * d)
    p = torch.arange(length, dtype=torch.float64)
    angles = p[:, None] * 10000.0 ** (-j / (d // 2))
    scale = zeta ** ((p - math.ceil(length / 2))[:, None] / scale_base)
    if downscale:
        scale = 1 / scale
    cos, sin = (angles.cos() * scale).repeat_interleave(2, -1), (angles.sin() * scale).repeat_interleave(2, -1)
    x = x.double()
    turned = torch.stack([-x[:, 1::2], x[:, 0::2]], dim=-1).flatten(-2)
    return x * cos + turned * sin


@pytest.mark.parametrize("length", [7, 24])
def test_interleaved_layout_reproduces_torchscale(length):
    """layout="interleaved", theta 10000: the scores of torchscale's XPOS, whose centre moves with the length
    (re-scaled per forward), equal hf_posenc's with its fixed centre (c cancels in every score)."""
    d = 8
    enc = build(text_info(head_dim=d), layout="interleaved", theta=10000.0, scale_base=16.0)
    g = torch.Generator().manual_seed(1)
    q0, k0 = torch.randn(length, d, generator=g), torch.randn(length, d, generator=g)
    q, k = transform(enc, q0[None, None], k0[None, None], list(range(length)))
    ours = q[0, 0].double() @ k[0, 0].double().T
    theirs = torchscale_style(q0, 16.0, False) @ torchscale_style(k0, 16.0, True).T
    assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-5), (ours - theirs).abs().max()


def test_scores_depend_on_the_distance_only():
    """The same content at every position: the score matrix is Toeplitz (S[n, m] = S[n+1, m+1]), and shifting
    every position by 100 leaves it unchanged; with equal query and key content the scores follow the decay."""
    d, length = 8, 12
    enc = build(text_info(head_dim=d), scale_base=8.0)
    g = torch.Generator().manual_seed(2)
    qv, kv = torch.randn(d, generator=g), torch.randn(d, generator=g)
    tokens_q, tokens_k = qv.expand(1, 1, length, d), kv.expand(1, 1, length, d)
    q, k = transform(enc, tokens_q, tokens_k, list(range(length)))
    s = q[0, 0] @ k[0, 0].T
    assert torch.allclose(s[1:, 1:], s[:-1, :-1], atol=1e-5)
    q2, k2 = transform(enc, tokens_q, tokens_k, list(range(100, 100 + length)))
    assert torch.allclose(q2[0, 0] @ k2[0, 0].T, s, atol=1e-5)
    # the decay itself: with the query's content as the key's, S[n, 0] = sum_i |q~_i|^2 zeta_i^(n/B) cos(n theta_i)
    same_q, same_k = transform(enc, qv.expand(1, 1, length, d), qv.expand(1, 1, length, d), list(range(length)))
    norms = (same_q[0, 0] @ same_k[0, 0].T).diagonal(offset=0)
    assert torch.allclose(norms, qv.dot(qv).expand(length), rtol=1e-5)  # distance 0: |q|^2, no decay
    r = enc.rotary_dim
    theta = 10000.0 ** (-torch.arange(0, r, 2, dtype=torch.float64) / r)
    qc = pairs(qv, r, "half")
    dist = torch.arange(length, dtype=torch.float64)
    decay = xpos_zeta(r, 0.4).double() ** (dist[:, None] / 8.0)
    want = (qc.abs() ** 2 * decay * torch.cos(dist[:, None] * theta)).sum(-1)
    assert torch.allclose((same_q[0, 0] @ same_k[0, 0].T)[:, 0].double(), want, atol=1e-5)


def test_profile_shows_the_decay():
    """hf_posenc.position_profile (read from the encoding's own transform): similarity(d) =
    (2 / D) sum_i zeta_i^(d/B) cos(d theta_i), 1 at d = 0."""
    model = make_model("llama", encoding="xpos", scale_base=4.0)  # head_dim 8, theta 10000
    n = 9
    sim = torch.tensor(hf_posenc.position_profile(model, length=n)["layers"][0]["similarity"])[0].double()
    dist = torch.arange(n, dtype=torch.float64)
    theta = 10000.0 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    want = (2 / 8) * (xpos_zeta(8, 0.4).double() ** (dist[:, None] / 4.0) * torch.cos(dist[:, None] * theta)).sum(-1)
    assert torch.allclose(sim, want, atol=1e-5)


# ---------------------------------------------------------------------------------------------------
# every decoder family
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", DECODERS)
def test_large_scale_base_is_rope(family):
    """zeta^(x/B) -> 1: with B = 1e12 xpos gives rope's logits (Gemma 3's per-layer bases, Phi-3's and
    GPT-NeoX's partial rotary included); at the default B it does not (the decay is applied)."""
    ids = make_ids(2, 12)
    with torch.no_grad():
        rope = make_model(family, encoding="rope")(ids).logits
        flat = make_model(family, encoding="xpos", scale_base=1e12)(ids).logits
        decayed = make_model(family, encoding="xpos", scale_base=2.0)(ids).logits
    assert (flat - rope).abs().max().item() < 1e-5
    assert (decayed - rope).abs().max().item() > 1e-3


@pytest.mark.parametrize("family", DECODERS)
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_cache_matches_full_forward(family, cache):
    """Prefill, single tokens and a chunk through a KV cache give the full forward's logits: keys are scaled
    (at their logical positions, from a fixed centre) before they enter the cache."""
    model = make_model(family, encoding="xpos", scale_base=4.0)
    ids = make_ids(2, 10)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        past = DynamicCache(config=model.config) if cache == "dynamic" else StaticCache(config=model.config,
                                                                                       max_cache_len=16)
        pieces, start = [], 0
        for n in (5, 1, 2, 1, 1):
            pieces.append(model(ids[:, start : start + n], **with_cache(past), use_cache=True).logits)
            start += n
    assert (torch.cat(pieces, dim=1) - full).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", DECODERS)
def test_left_padding_invariance(family):
    """A left-padded row (position_ids from the mask) gives the logits of the row alone, in a full forward and
    in two decode steps after it."""
    model = make_model(family, encoding="xpos", scale_base=4.0)
    short, long = make_ids(1, 6, seed=2)[0], make_ids(1, 9, seed=3)[0]
    ids, mask = left_pad([short, long])
    pad = ids.shape[1] - short.numel()
    extra = make_ids(2, 2, seed=4)
    with torch.no_grad():
        alone = model(torch.cat([short, extra[0]])[None], use_cache=False).logits[0]
        past = DynamicCache(config=model.config)
        out = model(ids, attention_mask=mask, position_ids=positions_from_mask(mask), **with_cache(past)).logits
        steps = []
        for i in range(2):
            mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
            steps.append(model(extra[:, i : i + 1], attention_mask=mask, position_ids=positions_from_mask(mask)[:, -1:],
                               **with_cache(past)).logits[0, 0])
    assert (out[0, pad:] - alone[: short.numel()]).abs().max().item() < 1e-5
    for i, step in enumerate(steps):
        assert (step - alone[short.numel() + i]).abs().max().item() < 1e-5


@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_save_and_reload(family, tmp_path):
    """The resolved config (centre included) is stored and the reloaded model gives the same logits."""
    model = make_model(family, encoding="xpos", scale_base=64.0, center=7)
    inputs = model_inputs(family)
    with torch.no_grad():
        before = main_output(model(**inputs))
    model.save_pretrained(tmp_path)
    loaded = hf_posenc.from_pretrained(tmp_path)
    assert loaded.config.position_encoding == model.config.position_encoding
    assert loaded.config.position_encoding["center"] == 7
    with torch.no_grad():
        assert torch.equal(main_output(loaded(**inputs)), before)


def test_every_backend(monkeypatch, engine_calls):
    """xpos has no term inside the attention (its decay is a q/k factor), so every attention backend runs SDPA on
    the transformed q and k: HF_POSENC_BACKEND=torch and flex give the default's logits, and triton raises the
    clear error rope raises (the transform is elementwise, run by PyTorch at memory bandwidth)."""
    model = make_model("llama", encoding="xpos", scale_base=4.0)
    ids, mask = left_pad([make_ids(1, 6, seed=2)[0], make_ids(1, 9, seed=3)[0]])
    kw = dict(attention_mask=mask, position_ids=positions_from_mask(mask), use_cache=False)
    with torch.no_grad():
        default = model(ids, **kw).logits
        for backend in ("torch", "flex"):
            monkeypatch.setenv("HF_POSENC_BACKEND", backend)
            assert torch.equal(model(ids, **kw).logits, default), backend
        assert not engine_calls, f"no term in the attention, no engine with a term: {dict(engine_calls)}"
        monkeypatch.setenv("HF_POSENC_BACKEND", "triton")
        with pytest.raises(ValueError, match="'xpos' has no Triton kernel for its q/k transform"):
            model(ids, **kw)


# ---------------------------------------------------------------------------------------------------
# refusals
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["bert", "vit"])
def test_bidirectional_families_are_refused(family):
    """Keys after the query would grow as zeta^((n - m)/B) > 1: xpos supports the causal families only."""
    assert family not in hf_posenc.registry.get_encoding("xpos").families
    with pytest.raises(ValueError, match=rf"encoding 'xpos' does not support {family}; it supports: llama, gpt2"):
        hf_posenc.patch_model(make_model(family), "xpos")
    info = ModelInfo(family, 32, 4, 4, 8, 1, False, 64)
    with pytest.raises(ValueError, match=rf"xpos is defined for causal attention only: on the bidirectional {family}"):
        build(info)


def test_positions_out_of_range_are_refused():
    """|n - c| beyond the range where zeta_0^(-|n - c|/B) fits the dtype (half its exponent range): a ValueError
    naming the bound, on the CPU; float16's bound is tighter than float32's."""
    enc = build(text_info(), scale_base=16.0, center=0)
    limit32, limit16 = xpos_max_distance(0.4, 16.0, torch.float32), xpos_max_distance(0.4, 16.0, torch.float16)
    assert (limit32, limit16) == (566, 70)  # 64 * 16 / log2(3.5), 8 * 16 / log2(3.5)
    x = torch.randn(1, 1, 1, 8)
    transform(enc, x, x, [limit32])  # at the bound: fine
    with pytest.raises(ValueError, match=rf"xpos: position {limit32 + 1} is {limit32 + 1} from the centre c=0; .* "
                                         rf"up to \|n - c\| = {limit32}"):
        transform(enc, x, x, [limit32 + 1])
    with pytest.raises(ValueError, match=rf"range of torch.float16 up to \|n - c\| = {limit16}"):
        transform(enc, x.half(), x.half(), [limit16 + 1])
    q, k = transform(enc, x, x, [limit32])
    assert torch.isfinite(q).all() and torch.isfinite(k).all()


def test_bad_parameters():
    with pytest.raises(ValueError, match=r"parameter 'scale_base' of encoding 'xpos' must be > 0.0"):
        hf_posenc.PosEncConfig("xpos", {"scale_base": 0.0})
    with pytest.raises(ValueError, match=r"parameter 'center' of encoding 'xpos' must be >= 0"):
        hf_posenc.PosEncConfig("xpos", {"center": -1})
    with pytest.raises(ValueError, match=r"parameter 'scaling' of encoding 'xpos' needs 'rope_type'"):
        hf_posenc.PosEncConfig("xpos", {"scaling": {"factor": 2.0}})
    with pytest.raises(ValueError, match=r"xpos needs an even number of rotated dims"):
        build(text_info(head_dim=8), partial_rotary_factor=0.25 * 0.9)
