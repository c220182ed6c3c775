"""Rotate q and k by exp(c S) blocks in the eigenbasis of each S: the PyTorch engine of the learned commuting
rotations (``comrope``; ``liere`` on text with per-layer generators) wherever the Triton rotary kernel does not
run.

Block j of token t's rotation for key/value head h is exp(c[t, j] S[h, j]) with S (b x b) skew-symmetric and c a
scalar per token and block. With i S = V diag(w) V^H (`skew_exp._spectral`, one eigendecomposition per
block and call)::

    exp(c S) x = V (exp(-i c w) o (V^H x))

so the rotation of every token costs two b x b changes of basis, done for all tokens at once as products with
a block-diagonal (D x 2D) and (2D x D) real matrix per head, and a phase per eigenvalue: no (L, D/b, b, b)
rotation tensor is built (`skew_exp.skew_exp` builds one per distinct position, and its gradient is
that big too). Phases are taken in float64, then the work runs in float32 (float64 for float64 inputs).

Backward (the custom op ``hf_posenc::spectral_rotation``'s registered backward), with a = V^H dout, ae = exp(i c w) o a, y = V^H x, z = exp(-i c w) o y
(per row: a token's block in one head, of the queries or the keys):

* dx = exp(c S)^T dout = V ae (real);
* dc[t, j] = Σ dout · (S out) over the rows of token t (the heads; the batch when c is shared by it);
* dS[h, j] = Re(V M V^H), M = Σ_rows c conj(Phi_c) o (a y^H), the Daleckii-Krein adjoint of
  `skew_exp.skew_exp`'s backward with G = Σ dout x^T, which is rank one per row: the sums over rows
  are (b x R) (R x b) products, M[k, l] = (Σ ae[k] conj(y[l]) − Σ a[k] conj(z[l])) / (i (w_k − w_l)), or the
  divided difference's Taylor series where eigenvalues are close (`skew_exp.TAYLOR_BELOW`).

The backward keeps the rotated output (the tensor the attention after it keeps anyway), not the input: with V
unitary, V^H out = z and y = exp(+i c w) o z, which its sums need (at issue 14's setting a ComRoPE training
step's peak memory went from 1.25-1.26x SDPA's to 1.04-1.05x in runs of comrope and liere alone and 1.14-1.20x
in full runs, AMD EPYC, time unchanged); it takes the sums over rows in chunks of ``SUM_CHUNK`` positions. The
test oracle is ``apply_qk_rotation_reference`` with rotations from one matrix exponential per token.
"""

from __future__ import annotations

import torch

from .skew_exp import _spectral, divided_difference_grad, taylor_terms

__all__ = ["spectral_qk_rotation"]


def _block_diag(blocks: torch.Tensor) -> torch.Tensor:
    """(Hr, m, b, b) -> (Hr, m·b, m·b) block-diagonal."""
    hr, m, b, _ = blocks.shape
    out = blocks.new_zeros(hr, m, b, m, b)
    idx = torch.arange(m, device=blocks.device)
    out[:, idx, :, idx, :] = blocks.transpose(0, 1)
    return out.view(hr, m * b, m * b)


class _Basis:
    """The per-head changes of basis: ``to_eig`` (D, 2D) maps x to [Re y | Im y], y = V^H x per block;
    ``from_eig`` (2D, D) maps [Re z | Im z] to Re(V z)."""

    def __init__(self, V: torch.Tensor, dtype: torch.dtype) -> None:
        vh = V.mT.conj_physical()  # (Hr, m, b, b): y = vh @ x per block, i.e. y_row = x_row @ vh^T
        self.block = V.shape[-1]
        self.to_eig = torch.cat([_block_diag(vh.real.mT), _block_diag(vh.imag.mT)], dim=-1).to(dtype)
        self.from_eig = torch.cat([_block_diag(V.real.mT), -_block_diag(V.imag.mT)], dim=-2).to(dtype)


def _heads(x: torch.Tensor, hr: int) -> torch.Tensor:
    """(B, Hx, L, D) -> (B, Hr, Hx/Hr, L, D): the rows of each rotation head (head h uses h // (Hx / Hr))."""
    b, hx, n, d = x.shape
    return x.reshape(b, hr, hx // hr, n, d)


def _phases(c: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of c w, (Bc, Hr, 1, L, D) each in ``dtype`` (taken in float64: phases reach hundreds of
    radians), shared by the queries and keys and by forward and backward. c (Bc, L, m), w (Hr, m, b) float64."""
    theta = c[:, None, :, :, None] * w[None, :, None]  # (Bc, Hr, L, m, b)
    bc, hr, n, m, b = theta.shape
    theta = theta.reshape(bc, hr, 1, n, m * b)
    return torch.cos(theta).to(dtype), torch.sin(theta).to(dtype)


def _to_eig(x: torch.Tensor, basis: _Basis, cos: torch.Tensor, sin: torch.Tensor, conj: bool):
    """x (B, Hr, G, L, D) -> (y = [Re | Im] (B, Hr, G, L, 2D), z = [Re | Im]) with y = V^H x per block and
    z = exp(∓i c w) o y (− for the rotation, + with ``conj``: for its transpose)."""
    d = x.shape[-1]
    y = x @ basis.to_eig[None, :, None]  # (B, Hr, G, L, 2D)
    yr, yi = y[..., :d], y[..., d:]
    if conj:
        return y, torch.cat([yr * cos - yi * sin, yi * cos + yr * sin], dim=-1)
    return y, torch.cat([yr * cos + yi * sin, yi * cos - yr * sin], dim=-1)


def _rotate(x: torch.Tensor, basis: _Basis, cos: torch.Tensor, sin: torch.Tensor, conj: bool):
    """(out = Re(V z) (B, Hr, G, L, D), y, z) for x (B, Hr, G, L, D) (see `_to_eig`)."""
    y, z = _to_eig(x, basis, cos, sin, conj)
    return z @ basis.from_eig[None, :, None], y, z


def _rows(x: torch.Tensor, hr: int, m: int, b: int) -> torch.Tensor:
    """[Re | Im] (B, Hr, R, 2D) -> (Hr, m, B·R, 2b): every row of each rotation block as [Re (b) | Im (b)], for the
    sums over rows."""
    bb, _, r, _ = x.shape
    return x.view(bb, hr, r, 2, m, b).permute(1, 4, 0, 2, 3, 5).reshape(hr, m, bb * r, 2 * b)


def _conj_products(lhs: torch.Tensor, rhs: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """Σ_r u[r, k] conj(v[r, l]) (Hr, m, n, b) complex for each group of n columns u of ``lhs`` (laid out
    [Re (n) | Im (n)], groups side by side) and v = ``rhs`` ([Re (b) | Im (b)]): one real product for all."""
    prod = lhs.mT @ rhs  # (Hr, m, Σ 2n, 2b)
    b = rhs.shape[-1] // 2
    out, i = [], 0
    for n in sizes:
        blk = prod[..., i : i + 2 * n, :]
        i += 2 * n
        out.append(torch.complex(blk[..., :n, :b] + blk[..., n:, b:], blk[..., n:, :b] - blk[..., :n, b:]))
    return out


#: positions per chunk of the backward's sums over rows (bounds their temporaries).
SUM_CHUNK = 512


def _row_sums(out, a, ae, c, basis, cos, sin, terms, close_rows, dt) -> list[torch.Tensor]:
    """The sums over the rows (batch, heads of the group, positions) of one chunk of positions, per (Hr, m) block:
    [Y, X, Z_0, Z_1[K], ...] (`divided_difference_grad`) for the rotated rows out = V z (B, Hr, G, n, D) and
    a = V^H dout, ae = exp(i c w) o a ([Re | Im], (B, Hr, G, n, 2D)), c (Bc, n, m) float64.

    The input's images y = V^H x and z = exp(−i c w) o y come from the output: V is unitary, so V^H out = z and
    y = exp(+i c w) o z (the input itself is never kept or rebuilt)."""
    bb, hr, g, n, _ = out.shape
    b = basis.block
    m = out.shape[-1] // b
    z, y = _to_eig(out, basis, cos, sin, conj=True)
    ra, rae, ry, rz = (_rows(t.flatten(2, 3), hr, m, b) for t in (a, ae, y, z))  # (Hr, m, R', 2b)
    del y, z
    cr = c.to(dt)[:, None].expand(-1, g, -1, -1).reshape(c.shape[0], g * n, m)  # (Bc, G·n, m)
    cr = cr.expand(bb, -1, -1).permute(2, 0, 1).reshape(1, m, bb * g * n, 1)
    # X and the Taylor sums Z_n (n < terms) in one product: [ae | c ae | c² ae ...]^T conj(y)
    # (the higher terms only for the rows k with a close eigenvalue: ``close_rows``)
    first = rae * cr
    cols = torch.cat([close_rows, close_rows + b])  # their [Re | Im] columns
    powers = [rae, first]
    for _ in range(terms - 1):
        powers.append((powers[-1] if len(powers) > 2 else first[..., cols]) * cr)
    return [*_conj_products(ra, rz, [b]),  # Y
            *_conj_products(torch.cat(powers, dim=-1), ry, [b, b] + [len(close_rows)] * (terms - 1))]


def _forward(q: torch.Tensor, k: torch.Tensor, skew: torch.Tensor, coeff: torch.Tensor):
    """(q_out, k_out in the inputs' dtypes, the same in the compute dtype (what the backward reads), w, V, cos,
    sin)."""
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    hr = skew.shape[0]
    w, V = _spectral(skew)  # float64 (Hr, m, b), complex128 (Hr, m, b, b)
    basis = _Basis(V, dt)
    cos, sin = _phases(coeff.detach().to(torch.float64), w, dt)  # (Bc, L, m) coefficients
    outs, rotated = [], []
    for x in (q, k):
        out = _rotate(_heads(x.to(dt), hr), basis, cos, sin, conj=False)[0]
        # what the backward reads: out, for dc and for dS (out is the tensor the attention keeps anyway; the
        # input's eigenbasis images come from it, see _row_sums: x would be one more copy of q and k)
        rotated.append(out.view(x.shape))
        outs.append(rotated[-1].to(x.dtype))
    return outs[0], outs[1], rotated[0], rotated[1], w, V, cos, sin


def _backward(dq_out, dk_out, oq, ok, skew, coeff, w, V, cos, sin, q_dtype, k_dtype, want_s: bool, want_c: bool):
    """(dq, dk, dS or None, dc or None) for the output gradients ``dq_out``, ``dk_out`` (B, Hx, L, D) and the rotated
    rows ``oq``, ``ok`` (B, Hx, L, D) in the compute dtype, read only for dS and dc (else None); module docstring."""
    dt = cos.dtype
    hr, m, b, _ = skew.shape
    cdt = torch.complex128 if dt == torch.float64 else torch.complex64
    basis = _Basis(V, dt)
    c = coeff.detach().to(torch.float64)
    grads_x = []
    sums = None  # (X, Y, Z_n...) summed over the rows of q and k, per (Hr, m): (Hr, m, b, b) complex
    dc = torch.zeros(c.shape, dtype=dt, device=c.device) if want_c else None
    terms, close_rows = taylor_terms(w, c.abs().amax(dim=(0, 1)), dt) if want_s else (0, None)
    s_blocks = _block_diag(skew.detach().to(dt).mT) if want_c else None  # out @ S^T per block
    for dout, out in ((dq_out, oq), (dk_out, ok)):
        shape = dout.shape
        dr = _heads(dout.to(dt), hr)
        dx, a, ae = _rotate(dr, basis, cos, sin, conj=True)  # exp(+i c w)
        grads_x.append(dx.view(shape))
        if not (want_s or want_c):
            continue
        out = _heads(out, hr)
        if want_c:  # dc = Σ dout · (S out) over the token's rows
            per = (dr * (out @ s_blocks[None, :, None])).unflatten(-1, (m, b)).sum(-1)  # (B, Hr, G, L, m)
            per = per.sum(dim=(1, 2))  # (B, L, m)
            dc += per.sum(0, keepdim=True) if dc.shape[0] == 1 else per
        if want_s:  # in chunks of positions: the temporaries stay O(chunk), not O(L) several times over
            for p0 in range(0, out.shape[3], SUM_CHUNK):
                p1 = min(p0 + SUM_CHUNK, out.shape[3])
                part = _row_sums(out[:, :, :, p0:p1], a[:, :, :, p0:p1], ae[:, :, :, p0:p1], c[:, p0:p1],
                                 basis, cos[:, :, :, p0:p1], sin[:, :, :, p0:p1], terms, close_rows, dt)
                sums = part if sums is None else [s + p for s, p in zip(sums, part)]
    grad_skew = None
    if want_s:
        cmax = c.abs().amax(dim=(0, 1))  # (m,)
        grad_skew = divided_difference_grad(w, V, cmax, sums[1], sums[0], sums[2], sums[3:], close_rows,
                                            cdt).to(skew.dtype)
    return grads_x[0].to(q_dtype), grads_x[1].to(k_dtype), grad_skew, dc.to(coeff.dtype) if want_c else None


# -- the PyTorch custom ops (one node of a compiled graph, forward and backward) ----------------------------------
# The backward has data-dependent steps (the rows with close eigenvalues, taylor_terms) that Dynamo cannot trace
# (``torch.compile`` of a ComRoPE training step failed there), so the rotation is an opaque op with a fake (shapes
# only) and a registered backward, eager and compiled alike. Every output is contiguous (the fakes say so); the
# eigenvectors cross the op boundary as view_as_real (float64). The rotated rows in the compute dtype are an output
# of their own only when q or k is in another dtype (bfloat16, float16): otherwise they are q_out and k_out (a view
# of them), and an op's outputs may not alias one another.
# Autocast is off inside the ops: the rotation computes in float32 (float64) whatever the caller's autocast (a
# backward called inside an autocast region mixed bfloat16 products into the float32 sums: a dtype error).
# Conjugates are physical (conj_physical, not conj or mH): inside a custom op of a compiled graph PyTorch drops a
# lazy conjugation (torch 2.13, aot_eager: conj(z) * z came out as z * z; caught by torch.library.opcheck).


def _compute(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@torch.library.custom_op("hf_posenc::spectral_rotation", mutates_args=())
def _rotation_op(q: torch.Tensor, k: torch.Tensor, skew: torch.Tensor, coeff: torch.Tensor) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q_out, k_out, oq, ok, w, V real, cos, sin); oq / ok: the rotated rows in the compute dtype, or an empty (0,)
    tensor where they are q_out / k_out."""
    with torch.autocast(q.device.type, enabled=False):  # float32 math, as eager's (see the comment above)
        qo, ko, oq, ok, w, V, cos, sin = _forward(q, k, skew, coeff)
    rows = [o.contiguous() if x.dtype != o.dtype else o.new_empty(0) for x, o in ((q, oq), (k, ok))]
    return (qo.contiguous(), ko.contiguous(), *rows, w.contiguous(), torch.view_as_real(V.contiguous()),
            cos.contiguous(), sin.contiguous())


@_rotation_op.register_fake
def _(q, k, skew, coeff):
    dt = _compute(q.dtype)
    hr, m, b, _ = skew.shape
    phases = (coeff.shape[0], hr, 1, coeff.shape[1], m * b)
    return (q.new_empty(q.shape), k.new_empty(k.shape),
            q.new_empty(q.shape if q.dtype != dt else 0, dtype=dt),
            k.new_empty(k.shape if k.dtype != dt else 0, dtype=dt),
            skew.new_empty((hr, m, b), dtype=torch.float64), skew.new_empty((hr, m, b, b, 2), dtype=torch.float64),
            q.new_empty(phases, dtype=dt), q.new_empty(phases, dtype=dt))


@torch.library.custom_op("hf_posenc::spectral_rotation_backward", mutates_args=())
def _rotation_backward_op(dq_out: torch.Tensor, dk_out: torch.Tensor, oq: torch.Tensor | None,
                          ok: torch.Tensor | None, skew: torch.Tensor, coeff: torch.Tensor, w: torch.Tensor,
                          v_real: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_dtype: torch.dtype,
                          k_dtype: torch.dtype, want_s: bool, want_c: bool) -> tuple[
                              torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dS, dc), contiguous; an empty (0,) tensor for dS or dc when not wanted. ``oq``, ``ok``: the
    rotated rows (B, Hx, L, D) in the compute dtype, None when neither dS nor dc is wanted."""
    with torch.autocast(dq_out.device.type, enabled=False):
        dq, dk, ds, dc = _backward(dq_out, dk_out, oq, ok, skew, coeff, w, torch.view_as_complex(v_real), cos, sin,
                                   q_dtype, k_dtype, want_s, want_c)
    return (dq.contiguous(), dk.contiguous(), skew.new_empty(0) if ds is None else ds.contiguous(),
            coeff.new_empty(0) if dc is None else dc.contiguous())


@_rotation_backward_op.register_fake
def _(dq_out, dk_out, oq, ok, skew, coeff, w, v_real, cos, sin, q_dtype, k_dtype, want_s, want_c):
    return (dq_out.new_empty(dq_out.shape, dtype=q_dtype), dk_out.new_empty(dk_out.shape, dtype=k_dtype),
            skew.new_empty(skew.shape if want_s else 0), coeff.new_empty(coeff.shape if want_c else 0))


def _setup_context(ctx, inputs, output) -> None:
    q, k, skew, coeff = inputs
    qo, ko, oq, ok, w, v_real, cos, sin = output
    ctx.want = (ctx.needs_input_grad[2], ctx.needs_input_grad[3])
    # dq and dk need only V and the phases; dS and dc read the rotated rows in the compute dtype too: q_out /
    # k_out themselves (float32, float64 inputs) or the extra outputs
    rows = [(o if o.numel() else x_out) if any(ctx.want) else None for o, x_out in ((oq, qo), (ok, ko))]
    ctx.save_for_backward(skew, coeff, w, v_real, cos, sin, *rows)
    ctx.inputs = (q.shape, k.shape, q.dtype, k.dtype)


def _autograd(ctx, dq_out, dk_out, *_rest):
    skew, coeff, w, v_real, cos, sin, oq, ok = ctx.saved_tensors
    q_shape, k_shape, q_dtype, k_dtype = ctx.inputs
    dq_out = cos.new_zeros(q_shape) if dq_out is None else dq_out
    dk_out = cos.new_zeros(k_shape) if dk_out is None else dk_out
    dq, dk, ds, dc = torch.ops.hf_posenc.spectral_rotation_backward(
        dq_out, dk_out, oq, ok, skew, coeff, w, v_real, cos, sin, q_dtype, k_dtype, *ctx.want)
    return dq, dk, (ds if ctx.want[0] else None), (dc if ctx.want[1] else None)


_rotation_op.register_autograd(_autograd, setup_context=_setup_context)


def spectral_qk_rotation(q: torch.Tensor, k: torch.Tensor, skew: torch.Tensor,
                         coeff: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k rotated by exp(coeff[t, j] · skew[h, j]) per token t, block j and key/value head h.

    Args:
        q: (B, H, L, D) queries; k: (B, Hkv, L, D) keys, H a multiple of Hkv (query head h takes key/value head
            h // (H / Hkv)'s rotation).
        skew: (Hkv or 1, D/b, b, b) skew-symmetric blocks (float32, or float64), differentiable.
        coeff: (B or 1, L, D/b) scalar per token and block (same dtype), differentiable.

    Returns:
        (q_out, k_out) in the inputs' dtypes, computed in float32 (float64 for float64 inputs).
    """
    for name, t in (("q", q), ("k", k), ("skew", skew), ("coeff", coeff)):
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a float tensor (float32, float64, bfloat16 or float16), got {t.dtype}")
    if q.dim() != 4 or k.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"expected q (B, H, L, D) and k (B, Hkv, L, D), got {tuple(q.shape)}, {tuple(k.shape)}")
    if skew.dim() != 4 or skew.shape[-1] != skew.shape[-2]:
        raise ValueError(f"skew must be (Hkv|1, D/b, b, b), got shape {tuple(skew.shape)}")
    hr, m, b, _ = skew.shape
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    if m * b != q.shape[-1] or hr not in (1, k.shape[1]):
        raise ValueError(f"skew must be (1 or Hkv={k.shape[1]}, D/b, b, b) with D/b · b = D = {q.shape[-1]}, got shape "
                         f"{tuple(skew.shape)}")
    if coeff.dim() != 3 or coeff.shape[0] not in (1, q.shape[0]) or coeff.shape[1:] != (q.shape[2], m):
        raise ValueError(f"coeff must be (B|1, L={q.shape[2]}, {m}), got shape {tuple(coeff.shape)}")
    q_out, k_out = torch.ops.hf_posenc.spectral_rotation(q, k, skew, coeff)[:2]
    return q_out, k_out
