"""What every kernel family shares: the dtypes and head dims the Triton kernels take, the Triton import probe,
and the dtype the PyTorch references and engines compute in. One definition each; the dispatchers
(``_attn_dispatch.py``, ``attention/__init__.py``, ``rotary/__init__.py``) and the encodings read them here.
"""

from __future__ import annotations

import functools
import importlib
import logging

import torch

__all__ = ["KERNEL_DTYPES", "MAX_HEAD_DIM", "compute_dtype", "triton_import_error"]

#: the dtypes of q, k, v (and of the rotary inputs) the Triton kernels take; one dtype per call.
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: the widest head dim the Triton attention kernels (fused terms, CoPE, SBA) take (their tiles hold D columns).
MAX_HEAD_DIM = 128


#: module -> triton_import_error's answer, filled on the first question about each module.
_IMPORT_ERRORS: dict[str, str | None] = {}


def _import_error(module: str) -> str | None:
    try:
        importlib.import_module(f"hf_posenc.kernels.{module}")
    except ImportError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def triton_import_error(module: str) -> str | None:
    """None when Triton and the kernel module ``hf_posenc.kernels.<module>`` (``"cope.triton_cope"``) import,
    else why not (``"ModuleNotFoundError: No module named 'triton'"``): Triton missing, or too old for the
    kernel module. Cached per module.

    Safe under ``torch.compile``: dynamo cannot trace an import (``importlib.import_module`` is marked as
    skipped, and a compiled model's dispatch asks this in its first traced forward: seen on an H100 with torch
    2.11, ``tests/test_compile.py::test_static_decoding_never_syncs``). While compiling, the answer comes from
    `_constant_import_error`, which dynamo runs eagerly and folds in as a constant."""
    if torch.compiler.is_compiling():
        return _constant_import_error(module)
    if module not in _IMPORT_ERRORS:
        _IMPORT_ERRORS[module] = _import_error(module)
    return _IMPORT_ERRORS[module]


@torch.compiler.assume_constant_result
def _constant_import_error(module: str) -> str | None:
    if module not in _IMPORT_ERRORS:
        _IMPORT_ERRORS[module] = _import_error(module)
    return _IMPORT_ERRORS[module]


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
