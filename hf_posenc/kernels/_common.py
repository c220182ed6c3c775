"""What every kernel family shares: the dtypes and head dims the Triton kernels take, the Triton import probe,
and the dtype the PyTorch references and engines compute in. One definition each; the dispatchers
(``_attn_dispatch.py``, ``attention/__init__.py``, ``rotary/__init__.py``) and the encodings read them here.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import logging

import torch

__all__ = ["KERNEL_DTYPES", "MAX_HEAD_DIM", "compute_dtype", "triton_import_error"]

#: the dtypes of q, k, v (and of the rotary inputs) the Triton kernels take; one dtype per call.
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: the widest head dim the Triton attention kernels (fused terms, CoPE, SBA) take (their tiles hold D columns).
MAX_HEAD_DIM = 128


#: module -> what `_probe` found (None, a reason string, or a `_Broken`), filled on the first question about each.
_IMPORT_ERRORS: dict[str, str | _Broken | None] = {}


class _Broken:
    """Triton is installed, but importing it or the kernel module failed: the message to raise and its cause."""

    def __init__(self, message: str, cause: BaseException) -> None:
        self.message, self.cause = message, cause


def _triton_version() -> str:
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"


def _probe(module: str) -> str | _Broken | None:
    """None: Triton and ``hf_posenc.kernels.<module>`` import. A string: the ``triton`` package is missing (the
    only answer that means "no Triton"). A `_Broken`: anything else went wrong."""
    from ._errors import ALTERNATIVES

    other = ALTERNATIVES.get(module.split(".")[0], "HF_POSENC_BACKEND=torch")
    try:
        import triton  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - a broken Triton is a finding, never "no Triton"
        if isinstance(exc, ModuleNotFoundError) and exc.name == "triton":
            return f"{type(exc).__name__}: {exc}"
        return _Broken(f"Triton {_triton_version()} is installed, but `import triton` failed ({type(exc).__name__}: "
                       f"{exc}), so hf_posenc.kernels.{module} cannot run: repair or uninstall Triton, or run on "
                       f"another backend with {other}", exc)
    try:
        importlib.import_module(f"hf_posenc.kernels.{module}")
    except Exception as exc:  # noqa: BLE001 - ours: a bug or a Triton it does not support, raised where used
        return _Broken(f"hf_posenc's kernel module hf_posenc.kernels.{module} failed to import with Triton "
                       f"{_triton_version()} installed ({type(exc).__name__}: {exc}). This is not a missing Triton: "
                       f"please report it; meanwhile run on another backend with {other}", exc)
    return None


def _answer(found: str | _Broken | None) -> str | None:
    if isinstance(found, _Broken):
        from ._errors import KernelImportError

        raise KernelImportError(found.message) from found.cause
    return found


def triton_import_error(module: str) -> str | None:
    """None when Triton and the kernel module ``hf_posenc.kernels.<module>`` (``"cope.triton_cope"``) import;
    the reason (``"ModuleNotFoundError: No module named 'triton'"``) when the ``triton`` package is missing, the
    only case that means "no Triton" (hf_posenc checks no Triton version: a Triton too old for a kernel module
    fails that module's import, below). Cached per module.

    Raises:
        KernelImportError: (a ``RuntimeError``, from `hf_posenc.kernels._errors`) Triton is installed, but
            ``import triton`` or the kernel module raised (any exception, the import error chained): the message
            names the module. Every dispatch asks here before it picks the kernel, so such a module raises where
            it is used, never passes for "no Triton" (an unforced model on CUDA would run the PyTorch engine
            silently). ``HF_POSENC_BACKEND=torch`` never asks.

    Safe under ``torch.compile``: dynamo cannot trace an import (``importlib.import_module`` is marked as
    skipped, and a compiled model's dispatch asks this in its first traced forward: seen on an H100 with torch
    2.11, ``tests/test_compile.py::test_static_decoding_never_syncs``). While compiling, the answer comes from
    `_constant_import_error`, which dynamo runs eagerly and folds in as a constant; a `KernelImportError` raised
    there comes out of ``torch.compile`` wrapped (``torch._dynamo.exc.InternalTorchDynamoError``, torch 2.13) with
    its message."""
    if torch.compiler.is_compiling():
        return _constant_import_error(module)
    if module not in _IMPORT_ERRORS:
        _IMPORT_ERRORS[module] = _probe(module)
    return _answer(_IMPORT_ERRORS[module])


@torch.compiler.assume_constant_result
def _constant_import_error(module: str) -> str | None:
    if module not in _IMPORT_ERRORS:
        _IMPORT_ERRORS[module] = _probe(module)
    return _answer(_IMPORT_ERRORS[module])


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the PyTorch references and engines compute in for inputs of ``dtype``: float64 for float64
    inputs (gradient checks), float32 for everything else (float32, bfloat16, float16)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def debug_log(logger_name: str, message: str) -> None:
    """``logging.getLogger(logger_name).debug(message)``, inside ``torch.compile`` too: there it runs once, while
    the graph is traced (Dynamo supports no Logger method: a debug line in traced code broke the graph of every
    encoding without a kernel term on BERT)."""
    if torch.compiler.is_compiling():
        _traced_debug_log(logger_name, message)
    else:
        logging.getLogger(logger_name).debug(message)


@torch.compiler.assume_constant_result
def _traced_debug_log(logger_name: str, message: str) -> bool:
    logging.getLogger(logger_name).debug(message)
    return True


def without_autocast(fn):
    """Decorator of the engines' forward and backward: ``fn`` runs with autocast off (CPU and CUDA). The engines
    compute in their own dtype (float32; float64 for float64 inputs) and cast their outputs back; under a caller's
    autocast their products came out in bfloat16 and met float32 tensors (a bfloat16 autocast training step failed
    for stick-breaking, Shaw and ComRoPE: a dtype error, a KeyError on the dtype)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
            return fn(*args, **kwargs)

    return wrapper
