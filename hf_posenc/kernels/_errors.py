"""Errors of the Triton kernels that a user can act on.

A kernel that fails to compile or to launch (a Triton compile error, shared memory over the GPU's per-block
limit, too many registers, a driver error at launch) raises `KernelError`: a ``RuntimeError`` whose
message names the kernel, the shapes and dtype of its inputs and its launch configuration, and says how to
run the op on another backend (``HF_POSENC_BACKEND=torch``, or ``flex`` for the attention terms that have
a FlexAttention form). The Triton exception is chained as its ``__cause__``. Nothing falls back silently.

Launchers wrap each launch as ``guarded(kernel, family, shapes, dtype)[grid](...)`` instead of
``kernel[grid](...)``: the launch itself is unchanged (a compile-only hook on ``JITFunction.run`` still sees
it), only its exceptions are translated.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["KernelError", "KernelImportError", "guarded", "ALTERNATIVES"]

#: how to pick another backend, per kernel family (what ``HF_POSENC_BACKEND`` offers for its op).
ALTERNATIVES = {
    "attention": "HF_POSENC_BACKEND=torch (the PyTorch reference / SDPA with the bias) or HF_POSENC_BACKEND=flex "
                 "(FlexAttention with the term as a score_mod; not for shaw)",
    "sba": "HF_POSENC_BACKEND=torch (the PyTorch reference; stick-breaking has no FlexAttention form)",
    "cope": "HF_POSENC_BACKEND=torch (the PyTorch reference; CoPE has no FlexAttention form)",
    "rotary": "HF_POSENC_BACKEND=torch (the PyTorch rotation)",
    "remap": "HF_POSENC_BACKEND=torch (the remap engine's PyTorch calls; a remap has no FlexAttention form)",
}

#: launch options worth naming in the message (tile sizes, dims, warps, stages).
_CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BM", "BN", "BLOCK_L", "BLOCK_D", "BD", "HEAD_D", "D", "S", "NP", "RP", "NHP",
                "TERM", "num_warps", "num_stages")


class KernelError(RuntimeError):
    """A Triton kernel of hf_posenc failed to compile or launch; the message says how to avoid it."""


class KernelImportError(RuntimeError):
    """Triton is installed, but it or one of hf_posenc's kernel modules (``hf_posenc.kernels.cope.triton_cope``)
    failed to import: a broken install or a bug, never "no Triton". Raised where the kernel module is asked for
    (the dispatch); the message names the module and how to run on another backend, the import error is chained."""


def _describe(kernel_name: str, family: str, shapes: dict[str, Any], dtype: torch.dtype, config: dict,
              exc: BaseException) -> str:
    dims = ", ".join(f"{name}={shape if isinstance(shape, str) else tuple(shape)}" for name, shape in shapes.items())
    cfg = ", ".join(f"{k}={config[k]}" for k in _CONFIG_KEYS if k in config)
    cause = f"{type(exc).__name__}: {exc}".strip().splitlines()
    head = cause[0][:400] if cause else type(exc).__name__
    return (
        f"the Triton kernel {kernel_name} ({family}) failed to compile or launch for {dims}, dtype={dtype}"
        f"{f' ({cfg})' if cfg else ''}: {head}. Run this op on another backend with {ALTERNATIVES[family]}; "
        "please report the error with this message (the Triton error is chained below)."
    )


class _Guarded:
    def __init__(self, kernel: Any, family: str, shapes: dict[str, Any], dtype: torch.dtype) -> None:
        if family not in ALTERNATIVES:
            raise ValueError(f"unknown kernel family {family!r}; allowed: {', '.join(ALTERNATIVES)}")
        self.kernel, self.family, self.shapes, self.dtype = kernel, family, shapes, dtype

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        launch = self.kernel[grid]

        def run(*args: Any, **kwargs: Any) -> Any:
            try:
                return launch(*args, **kwargs)
            except KernelError:
                raise
            except Exception as exc:  # compile or launch error: name it, never let it pass silently
                fn = getattr(self.kernel, "fn", self.kernel)
                name = getattr(fn, "__name__", type(self.kernel).__name__)
                raise KernelError(_describe(name, self.family, self.shapes, self.dtype, kwargs, exc)) from exc

        return run


def guarded(kernel: Any, family: str, shapes: dict[str, Any], dtype: torch.dtype) -> _Guarded:
    """``kernel`` whose ``[grid](...)`` launch raises `KernelError` (naming ``family``, ``shapes``
    e.g. ``{"q": q.shape, "k": k.shape}`` and ``dtype``) instead of a bare Triton error."""
    return _Guarded(kernel, family, shapes, dtype)
