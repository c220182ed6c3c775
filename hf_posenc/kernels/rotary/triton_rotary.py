"""Triton kernel: per-position block-diagonal rotation of queries AND keys in one launch, with its backward.

Layout in the style of Liger-Kernel: the kernel, its launcher, the ``torch.autograd.Function`` and a thin
wrapper (``rotary_qk``), beside the PyTorch reference in ``naive.py``.

Math (s the block size, g = h // (H / Hkv) the key/value head of query head h)::

    forward   q_out[b, h, l, blk*s + i] = sum_j R[b', g', l, blk, i, j] * q[b, h, l, blk*s + j]
              k_out[b, g, l, blk*s + i] = sum_j R[b', g', l, blk, i, j] * k[b, g, l, blk*s + j]
    backward  dq = R^T dq_out, dk = R^T dk_out                               (same kernel, TRANSPOSE)
              dR[b', g', l, blk, i, j] = sum over the broadcast (b, g) and the heads that use R of
                                          dout[.., blk*s + i] * x[.., blk*s + j]     (x = q or k)

with b' = b or 0 and g' = g or 0 when R is broadcast over the batch or the heads.

Tiling. A program owns one rotation tile: ``BLOCK_L`` positions of one rotation index (b', g'), held in
registers as a (BLOCK_L, next_pow2(D), s) float32 tensor, element [l, d, t] = R[l, d // s, d % s, t] (or
R[l, d // s, t, d % s] for the transpose), so that out[l, d] = sum_t tile[l, d, t] * x[l, s*(d // s) + t]
(x gathered by blocks, columns past D masked). It loops over a chunk of the (b, g) pairs that share that
rotation and, for each, over the H/Hkv query heads of the group and the key head: every q/k element is
read from DRAM once and written once, the rotation once per program. The grid is (L tiles, splits,
rotation indices); the pair loop is split into more programs only when the L tiles alone would not fill
the GPU (``PROGRAMS_PER_SM``). The sum over t (s = 2, 4, 8) is a halving tree of ``tl.reshape`` +
``tl.split``: only builtins of ``triton.language`` are used (see ``interpreting``).

Gradient of R: accumulated in registers over the program's pairs and heads (a reduction along the tile,
no atomics), in the same pass as dq and dk, so that q, k and the incoming gradients are read only once.
(An einsum outside the kernel would re-read them and materialise float32 copies of bf16 tensors.) With
one split the program writes its dR tile directly; with several, each split writes a partial tile to a
(splits, ...) float32 buffer that PyTorch sums: deterministic, and small, because splits are used only when
L is short (at most about programs x tile elements floats). dR is computed only when R requires a
gradient (learned rotations); then q and k are saved for backward, otherwise only R is.
All math is float32; q/k outputs and gradients come back in the input dtype, dR in R's dtype.

Only Triton features present in 3.2 and later are used (no tensor descriptors, no ``tl.range`` options,
no tuples of tensors).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from .._errors import guarded

__all__ = ["RotaryQKFunction", "rotary_qk", "rotary_single", "SUPPORTED_BLOCK_SIZES"]

SUPPORTED_BLOCK_SIZES = (2, 4, 8)

# Launch parameters (module attributes, so that benchmarks/bench_rotary.py can sweep them on a GPU).
#: elements of the (BLOCK_L, next_pow2(D), s) float32 rotation tile held by one program. Chosen from the
#: register counts of the sm_90 cubin (Triton 3.9, num_warps=4, D=128; no GPU to time it on yet):
#: 2048 elements take 64-95 registers per thread without dR and 96-140 with it, no spills; 4096 take
#: 120-166 and spill with dR at s=2.
TILE_ELEMENTS = 2048
NUM_WARPS = 4
#: programs per SM the launch aims for; the pair loop is split (more programs) until it is reached.
PROGRAMS_PER_SM = 16
#: positions per program in the interpreter (registers are free there and each program costs Python time).
INTERPRETER_BLOCK_L = 64

def _rotary_qk_kernel(
    XQ, XK,  # tensors rotated: q, k (forward) or dq_out, dk_out (backward); (B, H|Hkv, L, D), last stride 1
    OQ, OK,  # outputs, same shapes
    YQ, YK,  # the saved forward inputs q, k (backward with COMPUTE_DROT only)
    R,  # (n_rot, L, D/s, s, s) contiguous rotations, n_rot = Br * Hr
    DR,  # (n_split, n_rot, L, D/s, s, s) float32 partial gradients of R (COMPUTE_DROT only)
    L, G, HR, NH_BCAST, N_PAIRS, PAIRS_PER_PROG, N_ROT,
    sxq_b, sxq_h, sxq_l, sxk_b, sxk_h, sxk_l,
    soq_b, soq_h, soq_l, sok_b, sok_h, sok_l,
    syq_b, syq_h, syq_l, syk_b, syk_h, syk_l,
    D: tl.constexpr, S: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr,
    TRANSPOSE: tl.constexpr, COMPUTE_DROT: tl.constexpr,
):
    # Only builtins of triton.language (no tl.sum, tl.zeros, ...: those are @jit functions of Triton's
    # standard library, frozen compiled or interpreted when triton is first imported, see interpreting()).
    pid_l = tl.program_id(0)
    pid_split = tl.program_id(1)
    pid_r = tl.program_id(2)
    # The rotation index (b', g') and the range of (b, g) pairs that share it handled by this program.
    rb = pid_r // HR
    rh = pid_r % HR
    p_start = pid_split * PAIRS_PER_PROG
    p_stop = tl.minimum(p_start + PAIRS_PER_PROG, N_PAIRS)

    offs_l = pid_l * BLOCK_L + tl.arange(0, BLOCK_L)
    offs_d = tl.arange(0, BLOCK_D)
    offs_t = tl.arange(0, S)
    mask_l = offs_l < L
    mask_d = offs_d < D
    rows = offs_l.to(tl.int64)
    blk_start = (offs_d // S) * S  # first column of the block of column d
    mask2 = mask_l[:, None] & mask_d[None, :]
    mask3 = mask2[:, :, None]

    # Rotation tile (BLOCK_L, BLOCK_D, S), element [l, d, t] (rot is [l, blk, i, j], d = blk*S + i or j):
    #   forward   R[l, blk(d), i = d % S, j = t]   (contiguous)
    #   transpose R[l, blk(d), i = t, j = d % S]
    # so that out[l, d] = sum_t tile[l, d, t] * x[l, blk_start(d) + t] in both directions.
    fwd_col = offs_d[:, None] * S + offs_t[None, :]  # also the layout of dR[l, blk, i = d % S, j = t]
    if TRANSPOSE:
        r_col = blk_start[:, None] * S + offs_t[None, :] * S + (offs_d % S)[:, None]
    else:
        r_col = fwd_col
    r_row = rows[:, None, None] * (D * S)
    r_base = pid_r.to(tl.int64) * L * (D * S)
    rot = tl.load(R + r_base + r_row + r_col[None, :, :], mask=mask3, other=0.0).to(tl.float32)
    x_col = (blk_start[:, None] + offs_t[None, :])[None, :, :]  # gather: the S columns of d's block

    if COMPUTE_DROT:
        acc = tl.full((BLOCK_L, BLOCK_D, S), 0.0, tl.float32)

    for p in range(p_start, p_stop):
        b = (rb + p // NH_BCAST).to(tl.int64)
        g = (rh + p % NH_BCAST).to(tl.int64)
        # heads 0..G-1 are the query heads of group g, head G is the key head g.
        for hh in range(0, G + 1):
            if hh < G:
                h = g * G + hh
                x_ptr = XQ + b * sxq_b + h * sxq_h
                o_ptr = OQ + b * soq_b + h * soq_h
                y_ptr = YQ + b * syq_b + h * syq_h
                # row offsets as int64 tensors: a stride Triton specialised to the constant 1 in one
                # branch and not in the other would give the two branches different types
                x_row = rows * sxq_l
                o_row = rows * soq_l
                y_row = rows * syq_l
            else:
                x_ptr = XK + b * sxk_b + g * sxk_h
                o_ptr = OK + b * sok_b + g * sok_h
                y_ptr = YK + b * syk_b + g * syk_h
                x_row = rows * sxk_l
                o_row = rows * sok_l
                y_row = rows * syk_l
            xg = tl.load(x_ptr + x_row[:, None, None] + x_col, mask=mask3, other=0.0).to(tl.float32)
            prod = rot * xg
            # sum over the last axis (size S in 2, 4, 8) by halving: reshape + split are builtins.
            if S == 8:
                a8, b8 = tl.split(tl.reshape(prod, (BLOCK_L, BLOCK_D, 4, 2)))
                prod = a8 + b8
            if S >= 4:
                a4, b4 = tl.split(tl.reshape(prod, (BLOCK_L, BLOCK_D, 2, 2)))
                prod = a4 + b4
            a2, b2 = tl.split(prod)
            out = a2 + b2
            tl.store(o_ptr + o_row[:, None] + offs_d[None, :], out.to(o_ptr.dtype.element_ty), mask=mask2)
            if COMPUTE_DROT:
                # dR[l, blk, i, j] += dout[l, blk*S + i] * x_in[l, blk*S + j], i = d % S, j = t
                gd = tl.load(x_ptr + x_row[:, None] + offs_d[None, :], mask=mask2, other=0.0).to(tl.float32)
                yg = tl.load(y_ptr + y_row[:, None, None] + x_col, mask=mask3, other=0.0).to(tl.float32)
                acc += gd[:, :, None] * yg

    if COMPUTE_DROT:
        dr_base = (pid_split.to(tl.int64) * N_ROT + pid_r) * L * (D * S)
        tl.store(DR + dr_base + r_row + fwd_col[None, :, :], acc, mask=mask3)


_KERNELS: dict[bool, object] = {}


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``), read now.

    ``triton.jit`` reads the flag when it decorates a function. The kernel here is decorated on first use,
    once per mode (``_kernel``), so setting the variable after this module (or triton) was imported works
    for it. Triton's own ``@jit`` library functions (``tl.sum``, ``tl.max``, and ``tl.zeros`` in recent
    versions) are decorated when triton is first imported, and an interpreted kernel that calls them fails
    ("Cannot call @triton.jit'd outside of the scope of a kernel") unless the variable was set before that
    import. tests/conftest.py sets it before anything imports triton; this kernel still uses builtins only,
    so that it also runs interpreted when a user sets the variable late.
    """
    try:
        from triton import knobs

        return bool(knobs.runtime.interpret)
    except (ImportError, AttributeError):  # triton < 3.4 has no knobs
        return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def _kernel():
    """The jitted kernel for the current mode (``triton.jit`` returns an interpreted function when
    TRITON_INTERPRET is set at the time it is called, a compiled one otherwise)."""
    mode = interpreting()
    kern = _KERNELS.get(mode)
    if kern is None:
        kern = _KERNELS[mode] = triton.jit(_rotary_qk_kernel)
    return kern


def _target_programs(device: torch.device) -> int:
    """How many programs a launch should have at least: ``PROGRAMS_PER_SM`` per SM on a GPU; 1 in the
    interpreter, which runs programs one after the other (fewer, larger programs are faster there)."""
    if device.type == "cuda":
        return PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def _block_l(block_d: int, s: int, length: int) -> int:
    """Positions per program: the rotation tile (BLOCK_L, block_d, s) within ``TILE_ELEMENTS``."""
    budget = INTERPRETER_BLOCK_L if interpreting() else max(1, TILE_ELEMENTS // (block_d * s))
    return max(1, min(budget, triton.next_power_of_2(length), 64))


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """The kernel takes any strides over (B, H, L) but needs stride 1 along D."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _launch(
    xq: torch.Tensor | None,
    xk: torch.Tensor,
    rot: torch.Tensor,
    transpose: bool,
    yq: torch.Tensor | None = None,
    yk: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """Rotate xq (B, H, L, D) or None and xk (B, Hkv, L, D) by rot (Br, Hr, L, D/s, s, s) (or by its
    transpose), and, when yq/yk (the forward inputs) are given, return dR = sum xq ⊗ yq + xk ⊗ yk too."""
    b, hkv, length, d = xk.shape
    s = rot.shape[-1]
    br, hr = rot.shape[0], rot.shape[1]
    groups = 0 if xq is None else xq.shape[1] // hkv
    compute_drot = yk is not None

    xk = _last_dim_contiguous(xk)
    ok = torch.empty((b, hkv, length, d), dtype=xk.dtype, device=xk.device)
    if xq is not None:
        xq = _last_dim_contiguous(xq)
        oq = torch.empty(xq.shape, dtype=xq.dtype, device=xq.device)
    else:  # no queries: the q pointers are never dereferenced (G = 0)
        xq, oq = xk, ok
    if compute_drot:
        yk = _last_dim_contiguous(yk)
        yq = yk if yq is None else _last_dim_contiguous(yq)
    else:
        yq, yk = xq, xk
    rot_c = rot.contiguous()

    n_rot = br * hr
    nh_bcast = hkv if hr == 1 else 1
    n_pairs = (b if br == 1 else 1) * nh_bcast
    block_d = triton.next_power_of_2(d)
    block_l = _block_l(block_d, s, length)
    n_tiles = triton.cdiv(length, block_l)
    want_split = max(1, math.ceil(_target_programs(xk.device) / (n_tiles * n_rot)))
    pairs_per_prog = triton.cdiv(n_pairs, min(n_pairs, want_split))
    n_split = triton.cdiv(n_pairs, pairs_per_prog)

    if compute_drot:
        dr = torch.empty((n_split, n_rot, length, d // s, s, s), dtype=torch.float32, device=xk.device)
    else:
        dr = rot_c  # never written (COMPUTE_DROT is False)

    grid = (n_tiles, n_split, n_rot)
    shapes = {"q": "none" if groups == 0 else xq.shape, "k": xk.shape, "rot": rot.shape}
    guarded(_kernel(), "rotary", shapes, xk.dtype)[grid](
        xq, xk, oq, ok, yq, yk, rot_c, dr,
        length, groups, hr, nh_bcast, n_pairs, pairs_per_prog, n_rot,
        xq.stride(0), xq.stride(1), xq.stride(2), xk.stride(0), xk.stride(1), xk.stride(2),
        oq.stride(0), oq.stride(1), oq.stride(2), ok.stride(0), ok.stride(1), ok.stride(2),
        yq.stride(0), yq.stride(1), yq.stride(2), yk.stride(0), yk.stride(1), yk.stride(2),
        D=d, S=s, BLOCK_D=block_d, BLOCK_L=block_l, TRANSPOSE=transpose, COMPUTE_DROT=compute_drot,
        num_warps=NUM_WARPS,
    )
    drot = None
    if compute_drot:
        drot = (dr[0] if n_split == 1 else dr.sum(0)).view(rot.shape).to(rot.dtype)
    return (oq if groups else None), ok, drot


class RotaryQKFunction(torch.autograd.Function):
    """(q_out, k_out) = (R_g q, R k) with gradients for q, k and R; q may be None (keys only)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor | None, k: torch.Tensor, rot: torch.Tensor):
        q_out, k_out, _ = _launch(q, k, rot, transpose=False)
        ctx.rot_needs_grad = bool(ctx.needs_input_grad[2])
        ctx.has_q = q is not None
        if ctx.rot_needs_grad:  # q and k are needed only for dR
            ctx.save_for_backward(q, k, rot)
        else:
            ctx.save_for_backward(rot)
        return q_out, k_out

    @staticmethod
    def backward(ctx, dq_out: torch.Tensor | None, dk_out: torch.Tensor):
        if ctx.rot_needs_grad:
            q, k, rot = ctx.saved_tensors
        else:
            (rot,) = ctx.saved_tensors
            q = k = None
        if not ctx.has_q:
            dq_out = None
        dq, dk, drot = _launch(dq_out, dk_out, rot, transpose=True, yq=q, yk=k)
        return (
            dq if ctx.needs_input_grad[0] else None,
            dk if ctx.needs_input_grad[1] else None,
            drot,
        )


def rotary_qk(q: torch.Tensor, k: torch.Tensor, rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q (B, H, L, D) and k (B, Hkv, L, D) by rot (B|1, Hkv|1, L, D/s, s, s) with the Triton kernel.

    Query head h uses the rotation of key/value head h // (H / Hkv). Inputs are float32, bfloat16 or
    float16 (math in float32, outputs in the input dtype); s in {2, 4, 8}; no empty tensors. Shapes are
    checked by the dispatcher (``hf_posenc.kernels.rotary.apply_qk_rotation``), the public entry point.

    Returns:
        (q_out (B, H, L, D), k_out (B, Hkv, L, D)), contiguous.
    """
    return RotaryQKFunction.apply(q, k, rot)


def rotary_single(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """Rotate one tensor x (B, H, L, D) by rot (B|1, H|1, L, D/s, s, s) with the Triton kernel."""
    return RotaryQKFunction.apply(None, x, rot)[1]
