"""exp(c S) for skew-symmetric blocks S and many scalars c, through the spectral form of S.

A real skew-symmetric S (b x b) is normal: i S is Hermitian, i S = V diag(w) V^H with real w, so

    exp(c S) = V diag(exp(-i c w)) V^H = sum_k cos(c w_k) Re(v_k v_k^H) + sin(c w_k) Im(v_k v_k^H)
             = I + sum_k (cos(c w_k) - 1) Re(v_k v_k^H) + sin(c w_k) Im(v_k v_k^H),

exact for every c (the eigendecomposition is taken once per block, then every position costs one
(b,) x (b, b*b) product instead of a matrix exponential). The result is real and orthogonal.

Backward (a custom autograd Function; no gradient flows through the eigenvectors, whose derivative is
unstable at close eigenvalues; the weights below in float32 for float32 inputs whose phases |c w| stay under
``PHASE_FLOAT32``). With G = dL/dR(c):

* dL/dc = <G, S exp(c S)>;
* dL/dS = sum_c c Re(V (conj(Phi_c) o (V^H G V)) V^H), the adjoint of the Fréchet derivative of exp at the
  normal matrix c S (Daleckii-Krein), with the divided differences of exp at the eigenvalues -i c w:
  Phi_kl = exp(-i c (w_k + w_l) / 2) * sinc(c (w_k - w_l) / 2), sinc(z) = sin(z) / z. This form is
  finite and exact for equal or close eigenvalues (Phi_kk = exp(-i c w_k)).

The eigendecomposition runs in complex128 whatever the input dtype (b x b blocks: negligible cost).
"""

from __future__ import annotations

import math

import torch

__all__ = ["skew_exp", "skew_exp_reference"]

#: the largest phase |c w| (radians) whose backward weights are computed in float32 for float32 inputs
#: (float32 rounds 256 rad to 1.5e-5 rad; LieRE's default generators reach 66 rad at the end of the trained
#: context); larger phases (positions far past it, e.g. ``position_scale=1``) take float64. float32 made the
#: backward 5x faster (410 -> 76 ms, 8 heads x 4 blocks of 8 x 2048 positions).
PHASE_FLOAT32 = 256.0


def _spectral(skew: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(w (..., b) float64, V (..., b, b) complex128) with i S = V diag(w) V^H."""
    herm = 1j * skew.detach().to(torch.float64).to(torch.complex128)
    return torch.linalg.eigh(herm)


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
            # The weights in float32 for float32 inputs while every phase is below PHASE_FLOAT32 radians (its
            # rounding then stays under 1.5e-5), else in float64; built from
            # the eigenvalues' half sums and differences once.
            cdt = torch.complex128 if skew.dtype == torch.float64 else torch.complex64
            wide = skew.dtype == torch.float64 or float(coeff.abs().max() * w.abs().max()) > PHASE_FLOAT32
            real = torch.float64 if wide else torch.float32
            Vc = V.to(cdt)[:, None]  # (Hkv, 1, m, b, b)
            gt = torch.view_as_real(Vc.mH @ grad.to(cdt) @ Vc)  # (Hkv, U, m, b, b, 2)
            c = coeff.to(real)[None, :, :, None, None]  # (1, U, m, 1, 1)
            wr = w.to(real)
            mid = ((wr[..., :, None] + wr[..., None, :]) / 2)[:, None]  # (Hkv, 1, m, b, b)
            gap = ((wr[..., :, None] - wr[..., None, :]) / (2 * math.pi))[:, None]
            # conj(Phi) = exp(+i c (w_k + w_l) / 2) * sinc(c (w_k - w_l) / 2); torch.sinc(x) = sin(pi x) / (pi x)
            weight = torch.sinc(c * gap).mul_(c)
            mean = c * mid
            re, im = weight * torch.cos(mean), weight.mul_(torch.sin(mean))
            re, im = re.to(gt.dtype), im.to(gt.dtype)
            g_re, g_im = gt[..., 0], gt[..., 1]
            m_re = (re * g_re).sub_(im * g_im).sum(dim=1)  # (Hkv, m, b, b)
            m_im = (re * g_im).add_(im * g_re).sum(dim=1)
            Vm = V.to(cdt)
            grad_skew = (Vm @ torch.complex(m_re, m_im) @ Vm.mH).real.to(skew.dtype)
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
