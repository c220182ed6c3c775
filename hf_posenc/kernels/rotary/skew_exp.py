"""exp(c S) for skew-symmetric blocks S and many scalars c, through the spectral form of S.

A real skew-symmetric S (b x b) is normal: i S is Hermitian, i S = V diag(w) V^H with real w, so

    exp(c S) = V diag(exp(-i c w)) V^H = sum_k cos(c w_k) Re(v_k v_k^H) + sin(c w_k) Im(v_k v_k^H)
             = I + sum_k (cos(c w_k) - 1) Re(v_k v_k^H) + sin(c w_k) Im(v_k v_k^H),

exact for every c (the eigendecomposition is taken once per block, then every position costs one
(b,) x (b, b*b) product instead of a matrix exponential). The result is real and orthogonal.

Backward (a custom autograd Function; no gradient flows through the eigenvectors, whose derivative is
unstable at close eigenvalues). With G = dL/dR(c):

* dL/dc = <G, S exp(c S)>;
* dL/dS = sum_c c Re(V (conj(Phi_c) o (V^H G V)) V^H), the adjoint of the Fréchet derivative of exp at the
  normal matrix c S (Daleckii-Krein), with the divided differences of exp at the eigenvalues -i c w:
  c conj(Phi_c)_kl = (exp(i c w_k) - exp(i c w_l)) / (i (w_k - w_l)) (= c exp(i c w_k) at w_k = w_l). The sum
  over positions is taken before the change of basis (:func:`_skew_grad`): one product over the positions
  per block, no b x b product per position; close eigenvalues take the divided difference's Taylor series.

The eigendecomposition runs in complex128 whatever the input dtype (b x b blocks: negligible cost).
"""

from __future__ import annotations

import math

import torch

__all__ = ["skew_exp", "skew_exp_reference"]

#: the largest phase |c w| (radians) whose backward sums over positions run in float32 for float32 inputs
#: (float32 rounds 256 rad to 1.5e-5 rad; LieRE's default generators reach 66 rad at the end of the trained
#: context); larger phases (positions far past it, e.g. ``position_scale=1``) take float64.
PHASE_FLOAT32 = 256.0


def _spectral(skew: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(w (..., b) float64, V (..., b, b) complex128) with i S = V diag(w) V^H."""
    herm = 1j * skew.detach().to(torch.float64).to(torch.complex128)
    return torch.linalg.eigh(herm)


#: pairs of eigenvalues with |c|max · |w_k − w_l| below this take the Taylor series of the divided difference
#: (:func:`_skew_grad`); the others its closed form, whose cancellation then costs at most eps / 0.1.
TAYLOR_BELOW = 0.1
#: terms of that series: the first one left out is below 0.1^9 / 10! ≈ 3e-16 of the sum.
TAYLOR_TERMS = 9


def _skew_grad(skew: torch.Tensor, coeff: torch.Tensor, w: torch.Tensor, V: torch.Tensor,
               grad: torch.Tensor) -> torch.Tensor:
    """dL/dS = Re(V M V^H), M = Σ_c (V^H G_c V) ∘ conj(Φ_c) c (module docstring), with no product per position.

    conj(Φ_c)[k, l] c = (e^{icw_k} − e^{icw_l}) / (i Δ_kl), Δ_kl = w_k − w_l, so with
    H_n[k] = Σ_c c^n e^{icw_k} G_c (one (U,)-long product per block for all k, x, y at once) and
    R_n[k', k, l] = (V^H H_n[k'] V)[k, l]:

    * M[k, l] = (R_0[k, k, l] − R_0[l, k, l]) / (i Δ_kl) where |c|max |Δ_kl| >= TAYLOR_BELOW;
    * M[k, l] = Σ_n (−i Δ_kl)^n / (n + 1)! R_{n+1}[k, k, l] elsewhere (the diagonal, equal and close
      eigenvalues: the series of e^{icw_k} (1 − e^{−icΔ}) / (iΔ), exact at Δ = 0).

    The sums over positions run in float32 for float32 inputs while every phase |c w| stays under PHASE_FLOAT32
    (cos and sin taken in float64 first), else float64. Measured on the 2-core CPU (8 heads x 4 blocks of
    8 x 2048 positions, profiled): 25 ms a layer against 103 ms when forming V^H G_c V per position."""
    wide = skew.dtype == torch.float64 or float(coeff.abs().max() * w.abs().max()) > PHASE_FLOAT32
    real = torch.float64 if wide else torch.float32
    cdt = torch.complex128 if wide else torch.complex64
    hkv, u, m, b, _ = grad.shape
    c = coeff.detach().to(torch.float64).T[None, :, :, None]  # (1, m, U, 1)
    phase = c * w[:, :, None, :]  # (Hkv, m, U, b)
    cos, sin = torch.cos(phase), torch.sin(phase)
    g = grad.to(real).permute(0, 2, 1, 3, 4).reshape(hkv, m, u, b * b)  # (Hkv, m, U, b²)
    Vc = V.to(cdt)
    Vh = Vc.mH

    def rotated(weight_cos: torch.Tensor, weight_sin: torch.Tensor) -> torch.Tensor:
        """R[k', k, l] (Hkv, m, b, b, b) for H[k'] = Σ_c (weight_cos + i weight_sin)[c, k'] G_c."""
        a = torch.cat([weight_cos, weight_sin], dim=-1).to(real)  # (Hkv, m, U, 2b)
        h = (a.transpose(-1, -2) @ g).view(hkv, m, 2, b, b, b)  # (Hkv, m, cos|sin, k', x, y)
        hc = torch.complex(h[:, :, 0], h[:, :, 1])  # (Hkv, m, k', x, y)
        return Vh[:, :, None] @ hc @ Vc[:, :, None]

    gap = (w[..., :, None] - w[..., None, :])  # (Hkv, m, b, b) float64
    small = gap.abs() * coeff.detach().to(torch.float64).abs().amax(0)[None, :, None, None] < TAYLOR_BELOW
    r0 = rotated(cos, sin)
    x = r0.diagonal(dim1=-3, dim2=-2).transpose(-1, -2)  # R_0[k, k, l] -> (.., k, l)
    y = r0.diagonal(dim1=-3, dim2=-1)  # R_0[l, k, l] -> (.., k, l)
    safe = torch.where(small, torch.ones_like(gap), gap).to(cdt)
    M = (x - y) / (1j * safe)
    offdiag_small = bool((small & ~torch.eye(b, dtype=torch.bool, device=small.device)).any())
    terms = TAYLOR_TERMS if offdiag_small else 1  # the diagonal alone needs the first term only
    taylor = torch.zeros_like(M)
    power = torch.ones_like(c)
    step = (-1j * gap).to(cdt)
    factor = torch.ones_like(step)
    for n in range(terms):
        power = power * c  # c^(n + 1)
        z = rotated(power * cos, power * sin).diagonal(dim1=-3, dim2=-2).transpose(-1, -2)
        taylor = taylor + factor / math.factorial(n + 1) * z
        factor = factor * step
    M = torch.where(small, taylor, M)
    return (Vc @ M @ Vh).real.to(skew.dtype)


class _SkewExp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, skew: torch.Tensor, coeff: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        w, V = _spectral(skew)  # (Hkv, m, b), (Hkv, m, b, b)
        dtype = skew.dtype
        # outer[..., k, x, y] = V[x, k] conj(V[y, k]): (Hkv, m, b_k, b, b)
        outer = V.transpose(-1, -2)[..., :, :, None] * V.conj().transpose(-1, -2)[..., :, None, :]
        phase = coeff.to(torch.float64)[None, :, :, None] * w[:, None]  # (Hkv, U, m, b)
        # sum_k Re(v_k v_k^H) = I, so exp(c S) = I + sum_k (cos - 1) Re(.) + sin Im(.): exactly I at c = 0,
        # and accurate for small angles (cos - 1 = -2 sin^2(phase / 2)).
        cos_m1, sin = (-2 * torch.sin(phase / 2).square()).to(dtype), torch.sin(phase).to(dtype)
        re, im = outer.real.to(dtype), outer.imag.to(dtype)  # (Hkv, m, b_k, b, b)
        flat = re.shape[:-2] + (-1,)
        rot = torch.einsum("humk,hmkx->humx", cos_m1, re.reshape(flat)) + torch.einsum(
            "humk,hmkx->humx", sin, im.reshape(flat)
        )
        eye = torch.eye(skew.shape[-1], dtype=dtype, device=skew.device)
        rot = rot.unflatten(-1, skew.shape[-2:]) + eye  # (Hkv, U, m, b, b)
        ctx.save_for_backward(skew, coeff, rot, w, V)
        return rot

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        skew, coeff, rot, w, V = ctx.saved_tensors
        grad_skew = grad_coeff = None
        if ctx.needs_input_grad[1]:
            grad_coeff = (grad * torch.matmul(skew[:, None], rot)).sum(dim=(0, 3, 4))  # (U, m)
        if ctx.needs_input_grad[0]:
            grad_skew = _skew_grad(skew, coeff, w, V, grad)
        return grad_skew, grad_coeff


def skew_exp(skew: torch.Tensor, coeff: torch.Tensor) -> torch.Tensor:
    """exp(coeff[u, j] * skew[h, j]) for every u: R (Hkv, U, m, b, b).

    Args:
        skew: (Hkv, m, b, b) skew-symmetric blocks S (float32 or float64).
        coeff: (U, m) scalars c, one per position u and block j, same dtype.

    Returns:
        (Hkv, U, m, b, b) rotations in the dtype of ``skew``; differentiable in both inputs.
    """
    if skew.dim() != 4 or skew.shape[-1] != skew.shape[-2]:
        raise ValueError(f"skew must be (Hkv, m, b, b), got shape {tuple(skew.shape)}")
    if coeff.dim() != 2 or coeff.shape[1] != skew.shape[1]:
        raise ValueError(f"coeff must be (U, {skew.shape[1]}), got shape {tuple(coeff.shape)}")
    return _SkewExp.apply(skew, coeff.to(skew.dtype))


def skew_exp_reference(skew: torch.Tensor, coeff: torch.Tensor) -> torch.Tensor:
    """The same with ``torch.matrix_exp`` per position (the test oracle)."""
    return torch.matrix_exp(coeff.to(skew.dtype)[None, :, :, None, None] * skew[:, None])
