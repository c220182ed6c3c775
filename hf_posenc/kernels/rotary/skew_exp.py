"""exp(c S) for skew-symmetric blocks S and many scalars c, through the spectral form of S.

A real skew-symmetric S (b x b) is normal: i S is Hermitian, i S = V diag(w) V^H with real w, so

    exp(c S) = V diag(exp(-i c w)) V^H = sum_k cos(c w_k) Re(v_k v_k^H) + sin(c w_k) Im(v_k v_k^H)
             = I + sum_k (cos(c w_k) - 1) Re(v_k v_k^H) + sin(c w_k) Im(v_k v_k^H),

exact for every c (the eigendecomposition is taken once per block, then every position costs one
(b,) x (b, b*b) product instead of a matrix exponential). The result is real and orthogonal.

Backward (the custom op ``hf_posenc::skew_exp``'s registered backward; no gradient flows through the eigenvectors, whose derivative is
unstable at close eigenvalues). With G = dL/dR(c):

* dL/dc = <G, S exp(c S)>;
* dL/dS = sum_c c Re(V (conj(Phi_c) o (V^H G V)) V^H), the adjoint of the Fréchet derivative of exp at the
  normal matrix c S (Daleckii-Krein), with the divided differences of exp at the eigenvalues -i c w:
  c conj(Phi_c)_kl = (exp(i c w_k) - exp(i c w_l)) / (i (w_k - w_l)) (= c exp(i c w_k) at w_k = w_l). The sum
  over positions is taken before the change of basis (`_skew_grad`): one product over the positions
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
#: (`_skew_grad`); the others its closed form, whose cancellation then costs at most eps / 0.1.
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
    Vh = Vc.mT.conj_physical()  # physical: see the custom ops below

    def rotated(weight_cos: torch.Tensor, weight_sin: torch.Tensor) -> torch.Tensor:
        """R[k', k, l] (Hkv, m, b, b, b) for H[k'] = Σ_c (weight_cos + i weight_sin)[c, k'] G_c."""
        a = torch.cat([weight_cos, weight_sin], dim=-1).to(real)  # (Hkv, m, U, 2b)
        h = (a.transpose(-1, -2) @ g).view(hkv, m, 2, b, b, b)  # (Hkv, m, cos|sin, k', x, y)
        hc = torch.complex(h[:, :, 0], h[:, :, 1])  # (Hkv, m, k', x, y)
        return Vh[:, :, None] @ hc @ Vc[:, :, None]

    cmax = coeff.detach().to(torch.float64).abs().amax(0)  # (m,)
    terms, rows = taylor_terms(w, cmax, real)
    r0 = rotated(cos, sin)
    x = r0.diagonal(dim1=-3, dim2=-2).transpose(-1, -2)  # R_0[k, k, l] -> (.., k, l)
    y = r0.diagonal(dim1=-3, dim2=-1)  # R_0[l, k, l] -> (.., k, l)
    z, power = [], c
    for n in range(terms):  # Z_n = R_{n+1}[k, k, l], the higher ones at the rows with a close eigenvalue only
        zn = rotated(power * cos, power * sin).diagonal(dim1=-3, dim2=-2).transpose(-1, -2)
        z.append(zn if n == 0 else zn[..., rows, :])
        power = power * c
    return divided_difference_grad(w, V, cmax, x, y, z[0], z[1:], rows, cdt).to(skew.dtype)


def taylor_terms(w: torch.Tensor, cmax: torch.Tensor, dtype: torch.dtype) -> tuple[int, torch.Tensor]:
    """How many terms of the divided difference's Taylor series `divided_difference_grad` needs, and the rows
    k (int64) that need more than the first: 1 and none when only the diagonal (Δ = 0) takes the series, else
    enough terms for x^n / (n + 1)! to fall below the dtype's resolution at x = max |c|max |Δ| over the close
    pairs (< TAYLOR_BELOW), for the rows with a close pair in some block."""
    gap = (w[..., :, None] - w[..., None, :]).abs() * cmax.to(w.dtype)[None, :, None, None]
    close = (gap < TAYLOR_BELOW) & ~torch.eye(w.shape[-1], dtype=torch.bool, device=w.device)
    rows = close.flatten(0, -3).any(-1).any(0).nonzero()[:, 0]  # (|K|,)
    if rows.numel() == 0:
        return 1, rows
    x, tol = float(gap[close].max()), (1e-17 if dtype == torch.float64 else 1e-9)
    n = 1
    while n < TAYLOR_TERMS and x**n / math.factorial(n + 1) >= tol:
        n += 1
    return n, rows


def divided_difference_grad(w: torch.Tensor, V: torch.Tensor, cmax: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
                            z0: torch.Tensor, z_rows: list[torch.Tensor], rows: torch.Tensor,
                            cdt: torch.dtype) -> torch.Tensor:
    """Re(V M V^H) (Hr, m, b, b) from the sums X[k, l] = Σ e^{icw_k} T[k, l], Y[k, l] = Σ e^{icw_l} T[k, l] and
    Z_n[k, l] = Σ c^{n+1} e^{icw_k} T[k, l] (T = V^H G V per position, the sums over positions; Z_0 whole, the
    higher ones at the rows ``rows`` only), with M = (X − Y) / (i Δ) where |c|max |Δ| >= TAYLOR_BELOW, else
    Σ_n (−i Δ)^n / (n + 1)! Z_n (Δ_kl = w_k − w_l; the rows outside ``rows`` have no close pair off the
    diagonal, where Δ = 0 leaves Z_0 alone)."""
    gap = w[..., :, None] - w[..., None, :]  # (Hr, m, b, b) float64
    small = gap.abs() * cmax.to(gap.dtype)[None, :, None, None] < TAYLOR_BELOW
    safe = torch.where(small, torch.ones_like(gap), gap).to(cdt)
    direct = (x - y) / (1j * safe)
    taylor = z0.clone()
    if z_rows:
        step = (-1j * gap[..., rows, :]).to(cdt)  # (Hr, m, |K|, b)
        factor = step
        extra = torch.zeros_like(z_rows[0])
        for n, zn in enumerate(z_rows, start=1):
            extra = extra + factor / math.factorial(n + 1) * zn
            factor = factor * step
        taylor[..., rows, :] += extra
    Vc = V.to(cdt)
    return (Vc @ torch.where(small, taylor, direct) @ Vc.mT.conj_physical()).real


def _forward(skew: torch.Tensor, coeff: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(R (Hkv, U, m, b, b) in skew's dtype, w (Hkv, m, b) float64, V (Hkv, m, b, b) complex128)."""
    w, V = _spectral(skew)  # (Hkv, m, b), (Hkv, m, b, b)
    dtype = skew.dtype
    # outer[..., k, x, y] = V[x, k] conj(V[y, k]): (Hkv, m, b_k, b, b)
    outer = V.transpose(-1, -2)[..., :, :, None] * V.conj_physical().transpose(-1, -2)[..., :, None, :]
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
    return (rot.unflatten(-1, skew.shape[-2:]) + eye).contiguous(), w, V


def _backward(skew: torch.Tensor, coeff: torch.Tensor, rot: torch.Tensor, w: torch.Tensor, V: torch.Tensor,
              grad: torch.Tensor, want_skew: bool, want_coeff: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(dL/dS or None, dL/dc or None) from G = ``grad`` (module docstring)."""
    with torch.no_grad():
        grad_coeff = (grad * torch.matmul(skew[:, None], rot)).sum(dim=(0, 3, 4)) if want_coeff else None  # (U, m)
        grad_skew = _skew_grad(skew, coeff, w, V, grad) if want_skew else None
    return grad_skew, grad_coeff


# -- the PyTorch custom ops (one node of a compiled graph, forward and backward) ----------------------------------
# The backward has data-dependent steps (the float64 switch on the largest phase, the rows with close eigenvalues):
# Dynamo cannot trace them (``torch.compile`` of a LieRE or ComRoPE training step failed on them), so the rotation
# is an opaque op with a fake (shapes only) and a registered backward, eager and compiled alike. The
# eigendecomposition crosses the op boundary as real tensors (w float64, V as view_as_real float64).
# Conjugates are physical (conj_physical, not conj or mH): inside a custom op of a compiled graph PyTorch drops a
# lazy conjugation (torch 2.13, aot_eager: conj(z) * z came out as z * z; caught by torch.library.opcheck).


@torch.library.custom_op("hf_posenc::skew_exp", mutates_args=())
def _skew_exp_op(skew: torch.Tensor, coeff: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(R, w, V as (Hkv, m, b, b, 2) float64), every output contiguous."""
    with torch.autocast(skew.device.type, enabled=False):  # float32 / float64 math whatever the caller's autocast
        rot, w, V = _forward(skew, coeff)
    return rot, w.contiguous(), torch.view_as_real(V.contiguous())


@_skew_exp_op.register_fake
def _(skew, coeff):
    hkv, m, b, _ = skew.shape
    return (skew.new_empty((hkv, coeff.shape[0], m, b, b)), skew.new_empty((hkv, m, b), dtype=torch.float64),
            skew.new_empty((hkv, m, b, b, 2), dtype=torch.float64))


@torch.library.custom_op("hf_posenc::skew_exp_backward", mutates_args=())
def _skew_exp_backward_op(skew: torch.Tensor, coeff: torch.Tensor, rot: torch.Tensor, w: torch.Tensor,
                          v_real: torch.Tensor, grad: torch.Tensor, want_skew: bool,
                          want_coeff: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(dL/dS, dL/dc), contiguous; an empty (0,) tensor for the one not wanted."""
    with torch.autocast(skew.device.type, enabled=False):
        gs, gc = _backward(skew, coeff, rot, w, torch.view_as_complex(v_real), grad, want_skew, want_coeff)
    return (skew.new_empty(0) if gs is None else gs.contiguous(), coeff.new_empty(0) if gc is None else gc.contiguous())


@_skew_exp_backward_op.register_fake
def _(skew, coeff, rot, w, v_real, grad, want_skew, want_coeff):
    return skew.new_empty(skew.shape if want_skew else 0), coeff.new_empty(coeff.shape if want_coeff else 0)


def _setup_context(ctx, inputs, output) -> None:
    skew, coeff = inputs
    rot, w, v_real = output
    ctx.save_for_backward(skew, coeff, rot, w, v_real)


def _autograd(ctx, grad, _grad_w, _grad_v):
    skew, coeff, rot, w, v_real = ctx.saved_tensors
    want_skew, want_coeff = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    gs, gc = torch.ops.hf_posenc.skew_exp_backward(skew, coeff, rot, w, v_real, grad, want_skew, want_coeff)
    return (gs if want_skew else None), (gc if want_coeff else None)


_skew_exp_op.register_autograd(_autograd, setup_context=_setup_context)


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
    return torch.ops.hf_posenc.skew_exp(skew, coeff.to(skew.dtype))[0]


def skew_exp_reference(skew: torch.Tensor, coeff: torch.Tensor) -> torch.Tensor:
    """The same with ``torch.matrix_exp`` per position (the test oracle)."""
    return torch.matrix_exp(coeff.to(skew.dtype)[None, :, :, None, None] * skew[:, None])
