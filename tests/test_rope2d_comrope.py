"""rope2d (axial, mixed), comrope (ap, ld) and rope with the model's own rope_parameters scaling.

Hand-computed rotations, the relative property (shift invariance of the attention probabilities, with a
control showing the check is not vacuous), ComRoPE's commuting angle matrices, gradients against finite
differences in float64, the non-default variants through the model-level properties, and rope
reproducing transformers' Llama for every supported rope_type.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import hf_posenc
from hf_posenc.encodings.base import ModelInfo, PosContext
from hf_posenc.encodings.comrope import ComRope
from hf_posenc.encodings.rope import Rope
from hf_posenc.encodings.rope2d import Rope2d, axial_frequencies
from conftest import enable_checkpointing, forward_and_loss, left_pad, make_ids, make_model, model_inputs, with_cache

GRID = (2, 2)


def text_info(head_dim: int = 8, heads: int = 1, kv_heads: int = 1, layers: int = 1) -> ModelInfo:
    return ModelInfo("llama", heads * head_dim, heads, kv_heads, head_dim, layers, True, 64)


def vit_info(head_dim: int = 8, heads: int = 1, layers: int = 1, grid: tuple[int, int] = GRID) -> ModelInfo:
    return ModelInfo(
        "vit", heads * head_dim, heads, heads, head_dim, layers, False, grid[0] * grid[1] + 1,
        grid=grid, patch_size=(8, 8),
    )


def build(cls, name: str, info: ModelInfo, **params):
    return cls(cls.resolve(hf_posenc.PosEncConfig(name, params), info), info)


def rot2(x0: float, x1: float, a: float) -> list[float]:
    """The pair (x0, x1) rotated by angle a: [[cos, -sin], [sin, cos]] @ (x0, x1)."""
    return [x0 * math.cos(a) - x1 * math.sin(a), x0 * math.sin(a) + x1 * math.cos(a)]


def probs(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return torch.softmax((q @ k.transpose(-1, -2)).double(), dim=-1)


# ---------------------------------------------------------------------------------------------------
# rope2d: by hand
# ---------------------------------------------------------------------------------------------------


def test_rope2d_axial_2x2_grid_by_hand():
    """head_dim 8 on a 2x2 grid, base 100: theta_0 = 1, theta_1 = 100^(-1/2) = 0.1; pair 0 turns by
    theta_0 * col, pair 1 by theta_0 * row, pair 2 by theta_1 * col, pair 3 by theta_1 * row; CLS stays."""
    info = vit_info()
    enc = build(Rope2d, "rope2d", info)
    assert enc.posenc_config.params == {"variant": "axial", "base": 100.0}
    ctx = PosContext(encoding=enc, info=info, grid=GRID)
    x = torch.arange(1.0, 9.0)
    tokens = x.expand(1, 1, 5, 8).contiguous()  # CLS, (0,0), (0,1), (1,0), (1,1)
    q, k = enc.rotate(ctx, tokens, tokens)
    assert torch.equal(q, k)
    assert q[0, 0, 0].tolist() == x.tolist()  # CLS: not rotated
    assert q[0, 0, 1].tolist() == pytest.approx(x.tolist(), abs=1e-6)  # patch (0, 0): angle 0
    # patch (row 0, col 1): pairs 0 and 2 turn by 1 and 0.1, pairs 1 and 3 stay
    want = rot2(1, 2, 1.0) + [3, 4] + rot2(5, 6, 0.1) + [7, 8]
    assert q[0, 0, 2].tolist() == pytest.approx(want, abs=1e-6)
    # patch (row 1, col 0): pairs 1 and 3 turn
    want = [1, 2] + rot2(3, 4, 1.0) + [5, 6] + rot2(7, 8, 0.1)
    assert q[0, 0, 3].tolist() == pytest.approx(want, abs=1e-6)
    # patch (row 1, col 1): every pair turns
    want = rot2(1, 2, 1.0) + rot2(3, 4, 1.0) + rot2(5, 6, 0.1) + rot2(7, 8, 0.1)
    assert q[0, 0, 4].tolist() == pytest.approx(want, abs=1e-6)
    # numbers, for the record: (1 cos 1 - 2 sin 1, 1 sin 1 + 2 cos 1) = (-1.14264, 1.92207)
    assert q[0, 0, 4, :2].tolist() == pytest.approx([-1.142639, 1.922075], abs=1e-5)


def test_rope2d_axial_on_text_is_interleaved_rope():
    """On text (one axis) axial rotates every pair by position * base^(-2k/d): rope, interleaved layout."""
    info = text_info(head_dim=16, heads=4, kv_heads=2)
    enc = build(Rope2d, "rope2d", info, base=500.0)
    ref = build(Rope, "rope", info, theta=500.0, layout="interleaved")
    pos = torch.tensor([[0, 1, 5, 17, 40], [3, 4, 5, 6, 7]])
    ctx = PosContext(encoding=enc, info=info, position_ids=pos)
    q, k = torch.randn(2, 4, 5, 16), torch.randn(2, 2, 5, 16)
    got, want = enc.rotate(ctx, q, k), ref.rotate(PosContext(encoding=ref, info=info, position_ids=pos), q, k)
    assert torch.allclose(got[0], want[0], atol=1e-5) and torch.allclose(got[1], want[1], atol=1e-5)


def test_rope2d_frequencies_follow_the_paper():
    """ViT: theta_t = 100^(-t/(d/4)), even pairs on x (column), odd pairs on y (row); text: base^(-2k/d)."""
    f = axial_frequencies(16, 2, 100.0)
    theta = [100 ** (-t / 4) for t in range(4)]
    assert f[0::2, 0].tolist() == pytest.approx(theta) and f[1::2, 1].tolist() == pytest.approx(theta)
    assert f[0::2, 1].abs().sum() == 0 and f[1::2, 0].abs().sum() == 0
    assert axial_frequencies(8, 1, 100.0)[:, 0].tolist() == pytest.approx([100 ** (-2 * k / 8) for k in range(4)])


def test_rope2d_mixed_initialisation():
    """Per layer and kv head: magnitudes are the axial ones (base 10), pair 2t+1 is pair 2t's direction
    turned by pi/2; the angle differs between heads; with angle 0 mixed is axial."""
    info = vit_info(head_dim=16, heads=3, layers=2)
    enc = build(Rope2d, "rope2d", info, variant="mixed")
    assert enc.base == 10.0 and enc.freqs.shape == (2, 3, 8, 2)
    axial = axial_frequencies(16, 2, 10.0)
    f = enc.freqs.detach()
    assert torch.allclose(f.norm(dim=-1), axial.norm(dim=-1).expand(2, 3, 8), atol=1e-6)
    even, odd = f[:, :, 0::2], f[:, :, 1::2]
    turned = torch.stack([-even[..., 1], even[..., 0]], dim=-1)  # even turned by +pi/2
    assert torch.allclose(odd / odd.norm(dim=-1, keepdim=True), turned / turned.norm(dim=-1, keepdim=True), atol=1e-5)
    angle = torch.atan2(f[:, :, 0, 1], f[:, :, 0, 0])
    assert angle.flatten().unique().numel() == 6
    with torch.no_grad():
        enc.freqs.copy_(axial.expand_as(enc.freqs))
    coords = torch.tensor([[[0.0, 0.0], [1.0, 0.0], [3.0, 2.0]]])
    axial_enc = build(Rope2d, "rope2d", info, base=10.0)
    want = axial_enc.rotation_at(coords, None).expand(1, 3, 3, 8, 2, 2)
    assert torch.allclose(enc.rotation_at(coords, None, layer=1), want)


def test_rope2d_mixed_on_text_starts_as_rope():
    info = text_info(head_dim=8, heads=2, kv_heads=2, layers=2)
    enc = build(Rope2d, "rope2d", info, variant="mixed", base=100.0)
    assert enc.freqs.shape == (2, 2, 4, 1)
    assert torch.allclose(enc.freqs[..., 0], axial_frequencies(8, 1, 100.0)[:, 0].expand(2, 2, 4))


def test_rope2d_mixed_gqa_query_heads_use_their_kv_head():
    """4 query heads, 2 kv heads: query head h is rotated with kv head h // 2's frequencies."""
    info = text_info(head_dim=8, heads=4, kv_heads=2, layers=2)
    enc = build(Rope2d, "rope2d", info, variant="mixed")
    with torch.no_grad():
        enc.freqs.normal_()
    pos = torch.tensor([[2, 7, 9]])
    ctx = PosContext(encoding=enc, info=info, position_ids=pos)
    x = torch.randn(1, 1, 3, 8)
    q, k = enc.rotate(ctx, x.expand(1, 4, 3, 8), x.expand(1, 2, 3, 8), layer=1)
    assert torch.equal(q[:, 0], k[:, 0]) and torch.equal(q[:, 1], k[:, 0])
    assert torch.equal(q[:, 2], k[:, 1]) and torch.equal(q[:, 3], k[:, 1])
    assert not torch.allclose(k[:, 0], k[:, 1])
    q0, _ = enc.rotate(ctx, x.expand(1, 4, 3, 8), x.expand(1, 2, 3, 8), layer=0)
    assert not torch.allclose(q0, q), "layers share their frequencies"


# ---------------------------------------------------------------------------------------------------
# comrope: by hand, commuting, defaults, errors
# ---------------------------------------------------------------------------------------------------


def test_comrope_block2_by_hand():
    """b = 2 on text: P_j = [[0, a_j], [0, 0]] gives S_j = [[0, a_j], [-a_j, 0]] and
    exp(x S_j) = [[cos a_j x, sin a_j x], [-sin a_j x, cos a_j x]]: a rotation by -a_j x."""
    info = text_info(head_dim=4)
    enc = build(ComRope, "comrope", info, variant="ap", block_size=2, position_scale=1.0)
    with torch.no_grad():
        enc.P.zero_()
        enc.P[0, 0, 0, 0, 1] = 0.5
        enc.P[0, 0, 1, 0, 1] = -2.0
    ctx = PosContext(encoding=enc, info=info, position_ids=torch.tensor([[3]]))
    x = torch.tensor([1.0, 2.0, 3.0, 4.0]).view(1, 1, 1, 4)
    q, _ = enc.rotate(ctx, x, x)
    want = rot2(1, 2, -1.5) + rot2(3, 4, 6.0)
    assert q.flatten().tolist() == pytest.approx(want, abs=1e-5)


def test_comrope_ap_block3_rodrigues_on_the_grid():
    """b = 3, head_dim 6 on ViT: block 0 turns with the row, block 1 with the column. S = w K (K the unit
    cross-product matrix of axis u) gives Rodrigues' exp(t S) = I + sin(w t) K + (1 - cos(w t)) K^2."""
    info = vit_info(head_dim=6, grid=(3, 3))
    enc = build(ComRope, "comrope", info, variant="ap", block_size=3, position_scale=1.0)
    u = torch.tensor([1.0, 2.0, 2.0]) / 3
    K = torch.tensor([[0.0, -u[2], u[1]], [u[2], 0.0, -u[0]], [-u[1], u[0], 0.0]])
    w0, w1 = 0.7, -0.3
    with torch.no_grad():
        enc.P.zero_()
        enc.P[0, 0, 0] = torch.triu(w0 * K)  # P - P^T = w0 K
        enc.P[0, 0, 1] = torch.triu(w1 * K)
    coords = torch.tensor([[[2.0, 1.0]]])  # row 2, column 1
    rot = enc.rotation_at(coords)[0, 0, 0]  # (m=2, 3, 3)

    def rodrigues(t: float) -> torch.Tensor:
        return torch.eye(3) + math.sin(t) * K + (1 - math.cos(t)) * (K @ K)

    assert torch.allclose(rot[0], rodrigues(w0 * 2.0), atol=1e-5)
    assert torch.allclose(rot[1], rodrigues(w1 * 1.0), atol=1e-5)


def test_comrope_ld_by_hand():
    """LD, b = 2 on ViT: block j turns by -a_j (theta_0j row + theta_1j col)."""
    info = vit_info(head_dim=4, grid=(4, 4))
    enc = build(ComRope, "comrope", info, variant="ld", block_size=2)
    assert enc.axis_scale == (0.25, 0.25)  # the official code's normalisation by the training grid
    with torch.no_grad():
        enc.P.zero_()
        enc.P[0, 0, 0, 0, 1] = 1.5
        enc.P[0, 0, 1, 0, 1] = 0.5
        enc.theta.copy_(torch.tensor([[[2.0, -1.0], [0.5, 3.0]]]))  # (layer, axis, block)
    rot = enc.rotation_at(torch.tensor([[[1.0, 3.0]]]))[0, 0, 0]  # row 1, col 3 -> (0.25, 0.75)
    c0 = 2.0 * 0.25 + 0.5 * 0.75
    c1 = -1.0 * 0.25 + 3.0 * 0.75
    for j, (a, c) in enumerate([(1.5, c0), (0.5, c1)]):
        want = torch.tensor([[math.cos(a * c), math.sin(a * c)], [-math.sin(a * c), math.cos(a * c)]])
        assert torch.allclose(rot[j], want, atol=1e-6)


@pytest.mark.parametrize("variant", ["ap", "ld"])
def test_comrope_angle_matrices_commute(variant):
    """A_i = blockdiag_j B_ij: A_row A_col = A_col A_row, both non-zero, skew-symmetric; and
    R(x)^T R(y) = R(y - x)."""
    info = vit_info(head_dim=16, heads=2, grid=(4, 4))
    enc = build(ComRope, "comrope", info, variant=variant, block_size=4)
    blocks = enc.angle_matrices()  # (N, Hkv, m, b, b)
    for h in range(2):
        A = [torch.block_diag(*blocks[i, h]) for i in range(2)]
        assert A[0].abs().sum() > 0 and A[1].abs().sum() > 0
        assert torch.allclose(A[0], -A[0].T) and torch.allclose(A[1], -A[1].T)
        assert torch.allclose(A[0] @ A[1], A[1] @ A[0], atol=1e-5)
        assert not torch.allclose(A[0] @ A[0], torch.zeros_like(A[0]))  # a real product, not zeros
    coords = torch.tensor([[[1.0, 2.0], [3.0, -1.0], [2.0, -3.0]]])
    R = enc.rotation_at(coords)[0, :, :]  # (Hkv, 3, m, b, b)
    lhs = R[:, 0].transpose(-1, -2) @ R[:, 1]
    assert torch.allclose(lhs, R[:, 2], atol=1e-5)


def test_comrope_ap_blocks_alternate_between_axes():
    enc = build(ComRope, "comrope", vit_info(head_dim=16, grid=(4, 4)), variant="ap", block_size=2)
    assert enc.coefficients().tolist() == [[1, 0] * 4, [0, 1] * 4]


def test_comrope_defaults_and_initialisation():
    torch.manual_seed(0)
    llama = build(ComRope, "comrope", text_info(head_dim=16, heads=4, kv_heads=2, layers=3))
    assert llama.posenc_config.params == {"variant": "ap", "block_size": 8, "init_std": 1.0, "position_scale": 1 / 64}
    assert llama.P.shape == (3, 2, 2, 8, 8) and llama.axis_scale == (1 / 64,)
    assert 0.9 < llama.P.std().item() < 1.1
    vit = build(ComRope, "comrope", vit_info(head_dim=8))
    assert vit.block_size == 4  # 8 would leave the column axis without a block
    ld = build(ComRope, "comrope", vit_info(head_dim=8), variant="ld", init_std=0.1)
    assert ld.block_size == 8 and ld.theta.shape == (1, 2, 1) and ld.P.std().item() < 0.2


def test_comrope_text_positions_scaled_by_the_context_length():
    """Source: the official code (github.com/Longin-Yu/ComRoPE, model.py, ``CustomVITConfig.get_positions`` with
    its default ``axis_scale=True``) normalises each axis by its training extent, (p + 0.5) / n; the paper has
    no 1D experiment. On text the default is its 1D analogue, x = position / max_positions: with init_std = 1
    the median rotation angle per token is far below 0.3 rad (unscaled: near 2.9 rad), and the whole context
    still turns by O(1) radians."""
    torch.manual_seed(0)
    info = ModelInfo("llama", 64, 4, 4, 16, 2, True, 2048)
    enc = build(ComRope, "comrope", info)
    assert enc.axis_scale == (1 / 2048,) and enc.posenc_config.params["position_scale"] == 1 / 2048
    skew = enc.skew(0)  # (Hkv, m, b, b): the per-unit angles are the eigenvalues of i S
    angles = torch.linalg.eigvalsh(1j * skew.double()).abs()  # (Hkv, m, b)
    per_token = angles * enc.axis_scale[0]
    assert per_token.median() < 0.01
    assert (angles.median() * 2047 / 2048) > 0.5  # the trained context spans a real rotation
    unscaled = build(ComRope, "comrope", info, position_scale=1.0)
    assert torch.linalg.eigvalsh(1j * unscaled.skew(0).double()).abs().median() > 1.0
    with pytest.raises(ValueError, match="position_scale"):
        build(ComRope, "comrope", ModelInfo("llama", 64, 4, 4, 16, 2, True, None))


@pytest.mark.parametrize("spread", [3.0, 100.0, 3000.0])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_comrope_spectral_exponential_equals_matrix_exp(dtype, spread):
    """The spectral form (one eigendecomposition per block) equals torch.matrix_exp per position, forward and
    both gradients, including a block with repeated eigenvalues (where eigenvector gradients would fail) and one
    with close ones;
    phases of a few radians (float32 backward weights) and of hundreds and thousands (float64 ones: float32
    weights fail at thousands)."""
    from hf_posenc.kernels.rotary.skew_exp import skew_exp, skew_exp_reference

    g = torch.Generator().manual_seed(1)
    P = torch.randn(2, 3, 8, 8, generator=g, dtype=dtype)
    skew = P - P.mT
    skew[1, 2] = 0.0
    skew[1, 2, 0, 1], skew[1, 2, 1, 0], skew[1, 2, 2, 3], skew[1, 2, 3, 2] = 1.0, -1.0, 1.0, -1.0
    # close, unequal eigenvalues (the backward's Taylor series at a nonzero gap), and one gap past its threshold
    skew[0, 1] = 0.0
    for plane, angle in enumerate((1.0, 1.0 + 1e-3, 1.3, 0.2)):
        skew[0, 1, 2 * plane, 2 * plane + 1], skew[0, 1, 2 * plane + 1, 2 * plane] = angle, -angle
    skew.requires_grad_(True)
    coeff = (torch.randn(7, 3, generator=g, dtype=dtype) * spread).requires_grad_(True)
    # the oracle in float64 (float32's matrix_exp itself drifts by 2e-4 at phases of hundreds of radians)
    skew64, coeff64 = (x.detach().double().requires_grad_(True) for x in (skew, coeff))
    got, want = skew_exp(skew, coeff), skew_exp_reference(skew64, coeff64)
    tol = (1e-12 if spread < 10 else 1e-10) if dtype == torch.float64 else 2e-5
    assert (got.double() - want).abs().max() < tol
    weight = torch.randn(got.shape, generator=g, dtype=dtype)
    g_got = torch.autograd.grad((got * weight).sum(), (skew, coeff))
    g_want = torch.autograd.grad((want * weight.double()).sum(), (skew64, coeff64))
    for a, b in zip(g_got, g_want):
        assert (a.double() - b).abs().max() / b.abs().max() < tol


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
@pytest.mark.parametrize("shape", [(2, 4, 2, 2, 2), (1, 4, 4, 1, 1), (2, 6, 2, 2, 1)], ids=["gqa", "shared", "bcast"])
def test_spectral_rotation_equals_matrix_exp_rotations(monkeypatch, shape, dtype, tol):
    """``spectral_qk_rotation`` (rotation in each block's eigenbasis) equals rotating by one matrix exponential per
    token, forward and the gradients of q, k, the skew blocks and the coefficients: grouped-query heads, one
    skew shared by all heads, coefficients shared by the batch; a block with close eigenvalues (1, 1 + 1e-4)."""
    from hf_posenc.kernels.rotary import apply_qk_rotation_reference, spectral
    from hf_posenc.kernels.rotary.spectral import spectral_qk_rotation

    monkeypatch.setattr(spectral, "SUM_CHUNK", 2)  # the backward's sums in chunks of 2, 2 and 1 positions
    b, h, hkv, hr, bc = shape
    length, m, s = 5, 3, 4
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, h, length, m * s, generator=g, dtype=dtype)
    k = torch.randn(b, hkv, length, m * s, generator=g, dtype=dtype)
    P = torch.randn(hr, m, s, s, generator=g, dtype=dtype)
    skew = P - P.mT
    skew[0, 1] = 0.0
    skew[0, 1, 0, 1], skew[0, 1, 1, 0], skew[0, 1, 2, 3], skew[0, 1, 3, 2] = 1.0, -1.0, 1.0 + 1e-4, -1.0 - 1e-4
    coeff = torch.randn(bc, length, m, generator=g, dtype=dtype) * 3
    leaves = [t.clone().requires_grad_(True) for t in (q, k, skew, coeff)]
    got = spectral_qk_rotation(*leaves)
    leaves64 = [t.double().requires_grad_(True) for t in (q, k, skew, coeff)]
    rot = torch.matrix_exp(leaves64[3][:, None, :, :, None, None] * leaves64[2][None, :, None])
    want = apply_qk_rotation_reference(leaves64[0], leaves64[1], rot)
    weights = [torch.randn(t.shape, generator=g, dtype=dtype) for t in got]
    g_got = torch.autograd.grad(sum((o * w).sum() for o, w in zip(got, weights)), leaves)
    g_want = torch.autograd.grad(sum((o * w.double()).sum() for o, w in zip(want, weights)), leaves64)
    for a, ref in zip((*got, *g_got), (*want, *g_want)):
        assert a.dtype == dtype
        assert float((a.double() - ref).abs().max() / ref.abs().max()) < tol


def test_spectral_rotation_bad_inputs():
    """Shapes and dtypes that do not fit get a ValueError / TypeError naming what is expected."""
    from hf_posenc.kernels.rotary.spectral import spectral_qk_rotation

    q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8)
    skew, coeff = torch.zeros(2, 2, 4, 4), torch.zeros(1, 5, 2)
    cases = [
        ((q[0], k, skew, coeff), ValueError, r"expected q \(B, H, L, D\)"),
        ((q, k, skew[..., :3], coeff), ValueError, r"skew must be \(Hkv\|1, D/b, b, b\)"),
        ((q, k, torch.zeros(3, 2, 4, 4), coeff), ValueError, r"skew must be \(1 or Hkv=2, D/b, b, b\)"),
        ((q, k, torch.zeros(2, 3, 4, 4), coeff), ValueError, r"D/b · b = D = 8"),
        ((q[:, :3], k, skew, coeff), ValueError, r"multiple of key/value heads"),
        ((q, k, skew, torch.zeros(1, 4, 2)), ValueError, r"coeff must be \(B\|1, L=5, 2\)"),
        ((q, k, skew, coeff.long()), TypeError, "coeff must be a float tensor"),
    ]
    for args, error, match in cases:
        with pytest.raises(error, match=match):
            spectral_qk_rotation(*args)


@pytest.mark.parametrize("want_coeff", [False, True], ids=["skew-grad", "skew-and-coeff-grads"])
def test_spectral_rotation_keeps_no_copy_of_its_input(want_coeff):
    """The backward keeps the rotated q and k (the very tensors returned, which the attention keeps anyway), not
    the inputs: of the (B, H, L, D)-sized tensors saved for backward, every one shares storage with an output."""
    from hf_posenc.kernels.rotary.spectral import spectral_qk_rotation

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, 8, generator=g, requires_grad=True)
    k = torch.randn(2, 2, 6, 8, generator=g, requires_grad=True)
    P = torch.randn(2, 2, 4, 4, generator=g)
    skew = (P - P.mT).requires_grad_(True)
    coeff = torch.randn(1, 6, 2, generator=g).requires_grad_(want_coeff)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        q_out, k_out = spectral_qk_rotation(q, k, skew, coeff)
    big = [t for t in saved if t.numel() >= k.numel()]
    outputs = {q_out.untyped_storage().data_ptr(), k_out.untyped_storage().data_ptr()}
    assert len(big) == 2 and {t.untyped_storage().data_ptr() for t in big} == outputs
    (q_out.sum() + k_out.sum()).backward()  # what was kept is enough for the backward
    assert skew.grad is not None and (coeff.grad is not None) == want_coeff


@pytest.mark.parametrize(
    "name,params",
    [("comrope", {}), ("comrope", {"variant": "ld"}), ("liere", {"per_layer": True})],
    ids=["comrope-ap", "comrope-ld", "liere-per-layer"],
)
def test_spectral_rotation_path_equals_the_rotation_tensors(monkeypatch, name, params):
    """A training step of a left-padded Llama: the CPU's path (``spectral_terms`` -> ``spectral_qk_rotation``, no
    rotation tensor) gives the loss and every gradient of the rotation-tensor path (what the Triton kernel takes).
    (LieRE takes the spectral path with per-layer generators only.)"""
    from hf_posenc.encodings.liere import Liere
    from hf_posenc.encodings.rotary_base import BlockRotationEncoding

    import hf_posenc.encodings.rotary_base as rotary_base

    ids, mask = left_pad([make_ids(1, 5, seed=2)[0], make_ids(1, 8, seed=3)[0]])
    model = make_model("llama", encoding=name, **params)
    calls = []
    real = rotary_base.spectral_qk_rotation
    monkeypatch.setattr(rotary_base, "spectral_qk_rotation", lambda *a: calls.append(1) or real(*a))
    results = []
    for spectral in (True, False):
        if not spectral:
            cls = {"comrope": ComRope, "liere": Liere}[name]
            monkeypatch.setattr(cls, "spectral_terms", BlockRotationEncoding.spectral_terms)
        model.zero_grad()
        loss = model(ids, attention_mask=mask, labels=ids, use_cache=False).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (l0, g0), (l1, g1) = results
    assert len(calls) == model.config.num_hidden_layers  # the first pass took the spectral path in every layer
    torch.testing.assert_close(l0, l1, rtol=1e-5, atol=1e-6)
    assert g0.keys() == g1.keys() and any("posenc" in n for n in g0)
    scale = max(float(t.abs().max()) for t in g1.values())
    for n in g0:
        assert float((g0[n] - g1[n]).abs().max()) <= 1e-5 * scale, n


@pytest.mark.parametrize(
    "name,info,params,error,match",
    [
        ("comrope", vit_info(head_dim=8), {"block_size": 8}, ValueError, r"divisible by 2 \* block_size"),
        ("comrope", text_info(head_dim=8), {"block_size": 3}, ValueError, "not divisible by block_size=3"),
        ("comrope", text_info(head_dim=8), {"block_size": 16}, ValueError, "'block_size'.*<= 8"),
        ("comrope", text_info(head_dim=8), {"variant": "xy"}, ValueError, r"'variant'.*\['ap', 'ld'\]"),
        ("comrope", text_info(head_dim=8), {"init_std": 0.0}, ValueError, "'init_std'.*> 0.0"),
        ("comrope", text_info(head_dim=7), {}, ValueError, "no block size"),
        ("rope2d", vit_info(head_dim=6), {}, ValueError, "divisible by 4"),
        ("rope2d", text_info(head_dim=8), {"variant": "diagonal"}, ValueError, r"'variant'.*\['axial', 'mixed'\]"),
        ("rope2d", text_info(head_dim=8), {"base": 1.0}, ValueError, "'base'.*> 1.0"),
        ("rope2d", text_info(head_dim=8), {"base": "big"}, TypeError, "'base'.*float"),
    ],
)
def test_errors(name, info, params, error, match):
    cls = {"comrope": ComRope, "rope2d": Rope2d}[name]
    with pytest.raises(error, match=match):
        build(cls, name, info, **params)


def test_errors_through_patch_model():
    with pytest.raises(ValueError, match=r"comrope-ap.*divisible by 2 \* block_size = 16"):
        make_model("vit", encoding="comrope", block_size=8)
    with pytest.raises(ValueError, match="rope2d needs head_dim divisible by 4"):
        make_model("vit", encoding="rope2d", config_overrides={"hidden_size": 24})  # head_dim 6


# ---------------------------------------------------------------------------------------------------
# the relative property
# ---------------------------------------------------------------------------------------------------

ROTARY = [("rope2d", {"variant": "axial"}), ("rope2d", {"variant": "mixed"}), ("comrope", {"variant": "ap"}),
          ("comrope", {"variant": "ld"})]
ROTARY_IDS = ["rope2d-axial", "rope2d-mixed", "comrope-ap", "comrope-ld"]


def _randomise(enc) -> None:
    """Move learned parameters away from their initialisation (all of them matter)."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in enc.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("name,params", ROTARY, ids=ROTARY_IDS)
def test_relative_on_text(name, params):
    """A Llama (GQA, 2 layers): position_ids shifted by 11 give the same attention probabilities in every
    layer and the same logits; stretched positions do not (the check is not vacuous)."""
    model = make_model("llama", encoding=name, **params)
    _randomise(hf_posenc.encoding_module(model))
    ids = make_ids(2, 9)
    pos = torch.arange(9).expand(2, -1)
    with torch.no_grad():
        runs = [model(ids, position_ids=p, output_attentions=True, use_cache=False) for p in (pos, pos + 11, pos * 2)]
    base, shifted, stretched = runs
    for a, b in zip(base.attentions, shifted.attentions):
        assert (a - b).abs().max() < 2e-5
    assert (base.logits - shifted.logits).abs().max() < 1e-4
    assert max((a - b).abs().max() for a, b in zip(base.attentions, stretched.attentions)) > 1e-3


@pytest.mark.parametrize("name,params", ROTARY, ids=ROTARY_IDS)
def test_relative_on_the_grid(name, params):
    """On a 3x4 patch grid (no CLS): shifting every patch by (2, 5) leaves softmax(q k^T) unchanged for every
    head of every layer; scaling the coordinates changes it."""
    info = vit_info(head_dim=8, heads=2, layers=2, grid=(3, 4))
    cls = {"rope2d": Rope2d, "comrope": ComRope}[name]
    enc = build(cls, name, info, **params)
    _randomise(enc)
    r = torch.arange(3.0).repeat_interleave(4)
    c = torch.arange(4.0).repeat(3)
    rc = torch.stack([r, c], dim=-1)[None]  # (1, 12, 2) (row, col)
    # rope2d takes (x, y) = (col, row), comrope (row, col)
    coords = rc.flip(-1) if name == "rope2d" else rc
    q, k = torch.randn(1, 2, 12, 8), torch.randn(1, 2, 12, 8)
    from hf_posenc.kernels.rotary import apply_block_rotation

    def attention(xy: torch.Tensor, layer: int) -> torch.Tensor:
        rot = enc.rotation_at(xy, None, layer)
        return probs(apply_block_rotation(q, rot), apply_block_rotation(k, rot))

    for layer in range(2):
        p0 = attention(coords, layer)
        assert (p0 - attention(coords + torch.tensor([2.0, 5.0]), layer)).abs().max() < 1e-5
        assert (p0 - attention(coords * 1.5, layer)).abs().max() > 1e-3


@pytest.mark.parametrize("name,params", ROTARY, ids=ROTARY_IDS)
def test_cls_is_not_rotated(name, params):
    model = make_model("vit", encoding=name, **params)
    enc = hf_posenc.encoding_module(model)
    _randomise(enc)
    ctx = PosContext(encoding=enc, info=enc.info, grid=(4, 4))
    rot = enc.layer_rotation(ctx, 1, 17, torch.device("cpu"))
    eye = torch.eye(rot.shape[-1]).expand_as(rot[:, :, 0])
    assert torch.allclose(rot[:, :, 0], eye)
    assert not torch.allclose(rot[:, :, 5], eye)


def test_comrope_other_resolution_keeps_the_step():
    """The coordinates are scaled by the config's grid, not this image's: at 48x64 a patch has the rotation
    it has at the training 32x32 (no interpolation), so relative offsets mean the same at every size."""
    model = make_model("vit", encoding="comrope", variant="ld")
    enc = hf_posenc.encoding_module(model)
    small = enc.layer_rotation(PosContext(encoding=enc, info=enc.info, grid=(4, 4)), 0, 17, torch.device("cpu"))
    large = enc.layer_rotation(PosContext(encoding=enc, info=enc.info, grid=(6, 8)), 0, 49, torch.device("cpu"))
    for r in range(4):
        for c in range(4):
            assert torch.allclose(small[:, :, 1 + r * 4 + c], large[:, :, 1 + r * 8 + c])


# ---------------------------------------------------------------------------------------------------
# dtype, gradients against finite differences
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,params", ROTARY, ids=ROTARY_IDS)
def test_bf16_parameters_float32_rotations(name, params):
    model = make_model("llama", encoding=name, dtype=torch.bfloat16, **params)
    enc = hf_posenc.encoding_module(model)
    assert all(p.dtype == torch.bfloat16 for p in enc.parameters())
    ctx = PosContext(encoding=enc, info=enc.info, position_ids=torch.arange(5)[None])
    assert enc.layer_rotation(ctx, 1, 5, torch.device("cpu")).dtype == torch.float32


def test_gradcheck_rope2d_mixed():
    info = vit_info(head_dim=4, heads=2, layers=2, grid=(2, 3))
    enc = build(Rope2d, "rope2d", info, variant="mixed").double()
    coords = torch.tensor([[[0.0, 0.0], [1.0, 0.0], [2.0, 1.0], [0.5, 1.0]]])
    cls = torch.tensor([True, False, False, False])
    freqs = enc.freqs.detach().clone().requires_grad_(True)
    del enc.freqs
    assert torch.autograd.gradcheck(lambda f: _with(enc, "freqs", f, lambda: enc.rotation_at(coords, cls, 1)), (freqs,))


def _with(module, name: str, value: torch.Tensor, fn):
    """Call ``fn`` with ``module.<name>`` set to the tensor ``value`` (so gradcheck can differentiate it)."""
    setattr(module, name, value)
    return fn()


@pytest.mark.parametrize(
    "variant,info",
    [("ap", text_info(head_dim=4)), ("ld", vit_info(head_dim=4, grid=(3, 3)))],
    ids=["ap-text", "ld-grid"],
)
def test_gradcheck_comrope(variant, info):
    block = 2 if variant == "ap" else 4
    enc = build(ComRope, "comrope", info, variant=variant, block_size=block, init_std=0.5).double()
    coords = torch.tensor([[[0.0, 1.0], [2.0, 1.0], [1.0, 3.0]]])[..., : enc.num_axes]
    P = enc.P.detach().clone().requires_grad_(True)
    del enc.P
    if variant == "ap":
        fn = lambda p: _with(enc, "P", p, lambda: enc.rotation_at(coords))  # noqa: E731
        assert torch.autograd.gradcheck(fn, (P,))
        return
    theta = enc.theta.detach().clone().requires_grad_(True)
    del enc.theta

    def fn(p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        enc.P, enc.theta = p, t
        return enc.rotation_at(coords)

    assert torch.autograd.gradcheck(fn, (P, theta))


# ---------------------------------------------------------------------------------------------------
# the non-default variants through the model-level properties (test_common covers the defaults)
# ---------------------------------------------------------------------------------------------------

VARIANTS = [("rope2d", {"variant": "mixed"}), ("comrope", {"variant": "ld"})]
VARIANT_IDS = ["rope2d-mixed", "comrope-ld"]


@pytest.mark.parametrize("family", ["llama", "gpt2", "vit"])
@pytest.mark.parametrize("name,params", VARIANTS, ids=VARIANT_IDS)
def test_variant_forward_backward(family, name, params):
    model = make_model(family, encoding=name, train=True, **params)
    out, loss = forward_and_loss(family, model, model_inputs(family))
    loss.backward()
    assert torch.isfinite(out).all()
    for pname, p in hf_posenc.encoding_module(model).named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, pname
        # every layer's own slice gets a gradient
        assert (p.grad.flatten(1).abs().sum(1) > 0).all(), f"{pname}: a layer without gradient"


@pytest.mark.parametrize("name,params", VARIANTS, ids=VARIANT_IDS)
def test_variant_cache_matches_full_forward(name, params):
    model = make_model("llama", encoding=name, **params)
    ids = make_ids(2, 10)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        past = DynamicCache(config=model.config)
        pieces = [model(ids[:, :6], **with_cache(past)).logits]
        pieces += [model(ids[:, i : i + 1], **with_cache(past)).logits for i in range(6, 10)]
    assert (torch.cat(pieces, dim=1) - full).abs().max() < 1e-4


@pytest.mark.parametrize("family", ["llama", "vit"])
@pytest.mark.parametrize("name,params", VARIANTS, ids=VARIANT_IDS)
def test_variant_save_and_reload(family, name, params, tmp_path):
    model = make_model(family, encoding=name, **params)
    _randomise(hf_posenc.encoding_module(model))
    inputs = model_inputs(family)
    with torch.no_grad():
        before = model(**inputs).logits
    model.save_pretrained(tmp_path)
    loaded = hf_posenc.from_pretrained(tmp_path)
    assert loaded.config.position_encoding == model.config.position_encoding
    with torch.no_grad():
        assert torch.equal(loaded(**inputs).logits, before)


@pytest.mark.parametrize("name,params", VARIANTS, ids=VARIANT_IDS)
def test_variant_gradient_checkpointing(name, params):
    inputs = model_inputs("llama")
    grads = []
    for ckpt in (False, True):
        model = make_model("llama", encoding=name, train=True, **params)
        if ckpt:
            enable_checkpointing(model)
            assert model.model.gradient_checkpointing
        _, loss = forward_and_loss("llama", model, inputs)
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in hf_posenc.encoding_module(model).named_parameters()})
    for n in grads[0]:
        assert torch.allclose(grads[0][n], grads[1][n], atol=1e-6, rtol=1e-5), n


def test_axial_rotation_is_built_once_per_forward():
    """rope2d-axial (no parameters) builds its rotation once and shares it across layers; mixed builds one
    per layer."""
    for variant, want in (("axial", 1), ("mixed", 2)):
        model = make_model("vit", encoding="rope2d", variant=variant)
        enc = hf_posenc.encoding_module(model)
        calls = []
        inner = enc.rotation_at
        enc.rotation_at = lambda *a, **k: calls.append(1) or inner(*a, **k)
        with torch.no_grad():
            model(**model_inputs("vit"))
        assert len(calls) == want, variant


# ---------------------------------------------------------------------------------------------------
# rope with the model's own rope_parameters scaling
# ---------------------------------------------------------------------------------------------------

MAX_POS = 16
SCALED = {
    "linear": {"factor": 2.0},
    "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8},
    "yarn": {"factor": 2.0, "original_max_position_embeddings": 8},
    "longrope": {"long_factor": [1.0, 2.0, 3.0, 4.0], "short_factor": [1.0, 1.1, 1.2, 1.3],
                 "original_max_position_embeddings": 8},
    "proportional": {"partial_rotary_factor": 0.5},
}


def scaled_llama(rope_type: str, seed: int = 0) -> LlamaForCausalLM:
    cfg = LlamaConfig(
        vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=MAX_POS, initializer_range=0.2,
        rope_parameters={"rope_type": rope_type, "rope_theta": 10000.0, **SCALED[rope_type]},
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("rope_type", list(SCALED))
@pytest.mark.parametrize("length", [6, 12, 24], ids=["short", "within-max", "past-max"])
def test_rope_reproduces_scaled_llama(rope_type, length):
    """rope on a Llama with rope_parameters of each supported type gives exactly the unpatched logits,
    within and past max_position_embeddings (16) and, for longrope, on both sides of the switch (8)."""
    native, patched = scaled_llama(rope_type), hf_posenc.patch_model(scaled_llama(rope_type), "rope")
    assert patched.config.position_encoding == {
        "name": "rope", "theta": None, "layout": "half", "partial_rotary_factor": None, "scaling": None,
        "remap": None, "remap_window": None, "remap_group": None, "remap_chunk": None,
    }
    ids = torch.randint(3, 61, (2, length), generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        assert torch.equal(patched(ids).logits, native(ids).logits)


@pytest.mark.parametrize("rope_type", ["linear", "yarn", "longrope"])
def test_rope_scaled_llama_decode_matches_unpatched(rope_type):
    """With a cache, step by step past max_position_embeddings: the same logits as the unpatched model
    (for longrope including its switch to the long factors at position 8, as transformers does)."""
    native, patched = scaled_llama(rope_type), hf_posenc.patch_model(scaled_llama(rope_type), "rope")
    ids = torch.randint(3, 61, (1, 20), generator=torch.Generator().manual_seed(5))
    outs = []
    for model in (native, patched):
        past = DynamicCache(config=model.config)
        with torch.no_grad():
            steps = [model(ids[:, :5], **with_cache(past)).logits]
            steps += [model(ids[:, i : i + 1], **with_cache(past)).logits for i in range(5, 20)]
        outs.append(torch.cat(steps, dim=1))
    assert torch.equal(outs[0], outs[1])


def test_rope_scaled_llama_save_and_reload(tmp_path):
    native = scaled_llama("yarn")
    model = hf_posenc.patch_model(scaled_llama("yarn"), "rope")
    model.save_pretrained(tmp_path)
    loaded = hf_posenc.from_pretrained(tmp_path)
    ids = torch.randint(3, 61, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, native(ids).logits)


def test_rope_explicit_theta_ignores_the_scaling():
    """An explicit theta is plain rotary at that base: it differs from the scaled model."""
    native = scaled_llama("linear")
    plain = hf_posenc.patch_model(scaled_llama("linear"), "rope", theta=10000.0)
    assert plain.config.position_encoding["theta"] == 10000.0
    ids = torch.randint(3, 61, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (plain(ids).logits - native(ids).logits).abs().max() > 1e-3


@pytest.mark.parametrize("name, params", [
    ("comrope", {"variant": "ap", "position_scale": 0.05}),
    ("comrope", {"variant": "ld", "position_scale": 0.05}),
    ("liere", {"per_layer": True, "position_scale": 0.05}),
    ("liere", {"block_size": 2, "per_head": True, "position_scale": 0.05}),
    ("rope2d", {"variant": "mixed"}),
    ("rope2d", {"variant": "axial"}),
])
def test_angular_rate_is_the_fastest_turn_per_position(name, params):
    """``angular_rate()`` (what the shift-invariance bound of tests/test_properties.py reads) is the largest angle
    that any block of any layer's rotation turns by from position 0 to 1: the largest |arg| of its eigenvalues
    (below pi here, so the angle is not wrapped)."""
    model = make_model("llama", encoding=name, config_overrides={"num_hidden_layers": 3}, **params)
    enc = hf_posenc.encoding_module(model)
    ctx = PosContext(encoding=enc, info=enc.info, position_ids=torch.ones(1, 1, dtype=torch.long))
    with torch.no_grad():
        turns = [torch.linalg.eigvals(enc.layer_rotation(ctx, layer, 1, torch.device("cpu")).double()).angle().abs()
                 .max().item() for layer in range(3)]
    rate = enc.angular_rate()
    assert 0.05 < rate < math.pi
    assert rate == pytest.approx(max(turns), rel=1e-5)
