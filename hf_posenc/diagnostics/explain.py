"""The doctor's explanations: which backend each registered encoding uses by default on a device, and why."""

from __future__ import annotations

import torch

from ..backend import forced_backend

__all__ = ["default_backends"]


# -- default backends ------------------------------------------------------------------------------------


def default_backends(device: torch.device | str) -> list[dict[str, str | None]]:
    """Which backend each registered encoding uses by default on ``device``, and why.

    The decisions are the package's own (``hf_posenc.attention.attention_backend``, the dispatchers of
    ``sba``, ``cope`` and the rotary kernel, the table in ``hf_posenc.kernels.defaults``, and
    ``HF_POSENC_BACKEND``), asked on this device; this function only explains them. A call may still fall
    back to ``torch`` for inputs an engine does not take (e.g. ``output_attentions``, dropout in training).

    Returns:
        one dict per encoding: ``encoding``, ``kind`` (the registry's), ``attention`` (``triton``,
        ``flex``, ``torch``, or ``error``), ``rotation`` (the rotary kernel's backend, for encodings whose
        rotations go through it, else None) and ``why`` (a sentence).
    """
    from ..attention import attention_backend
    from ..kernels import defaults
    from ..kernels._errors import KernelImportError
    from ..kernels.cope import cope_backend
    from ..kernels.sba import sba_backend
    from ..kernels.rotary import rotation_backend
    from ..registry import get_encoding, list_encodings

    device = torch.device(device)
    on_cuda = device.type == "cuda"
    forced = None
    try:
        forced = forced_backend()
    except ValueError as exc:
        return [{"encoding": name, "kind": get_encoding(name).kind, "attention": "error", "rotation": None,
                 "why": str(exc)} for name in list_encodings()]
    probe = torch.zeros(1, 1, 1, 8, device=device)
    rows = []
    for name in list_encodings():
        spec = get_encoding(name)
        cls = spec.cls
        kinds = tuple(getattr(cls, "kernel_kinds", ()))
        own_kernels = tuple(getattr(cls, "attention_kernels", ()))
        row: dict[str, str | None] = {"encoding": name, "kind": spec.kind, "attention": None, "rotation": None}
        try:
            if own_kernels:  # sba, cope: the encoding's attend dispatches to its own kernels
                ask = sba_backend if name == "sba" else cope_backend
                backend = ask(probe, probe, probe)
                why = _why_own(name, backend, forced, on_cuda, defaults)
            else:
                backend = attention_backend(cls, device)
                why = _why_attention(cls, kinds, backend, forced, on_cuda, defaults)
        except (ValueError, KernelImportError) as exc:  # a broken kernel module: the row says so
            backend, why = "error", str(exc)
        row["attention"], row["why"] = backend, why
        if getattr(cls, "uses_rotary_kernel", False):
            try:
                rot = rotation_backend(None, probe, 2)
                row["rotation"] = rot
                row["why"] += " Rotations: " + (
                    "the Triton rotary kernel (block sizes 2, 4, 8; other sizes rotate in PyTorch)." if rot == "triton"
                    else _why_rotation(forced, on_cuda, defaults))
            except (ValueError, KernelImportError) as exc:
                row["rotation"] = "error"
                row["why"] += f" Rotations: {exc}"
        rows.append(row)
    return rows


def _measured(defaults, kind: str) -> str:
    note = defaults.MEASURED.get(kind)
    return f"measured: {note}" if note else "not yet measured on a GPU (the kernels are the default by design)"


def _why_attention(cls, kinds, backend, forced, on_cuda, defaults) -> str:
    in_attention = getattr(cls, "has_score_bias", False) or getattr(cls, "custom_attention", False)
    if not in_attention:
        return "No term inside the attention: transformers' own SDPA."
    if forced is not None:
        return f"HF_POSENC_BACKEND={forced} forces it."
    if not kinds:
        if cls.name == "cape":
            return "CAPE has no Triton kernel: its tile-wise PyTorch engine (O(L·block) memory)."
        return "No kernel for this attention: the encoding's own PyTorch attention."
    if not on_cuda:
        return ("Not a CUDA device: the tile-wise PyTorch engine (the Triton kernels need CUDA; FlexAttention "
                "only when forced).")
    table = defaults.cuda_default_backend(kinds)
    if backend == "torch" and table == "triton":
        from ..kernels.attention import _triton_import_error

        return f"Triton is not usable here ({_triton_import_error()}): the tile-wise PyTorch engine."
    return (f"CUDA default for {'/'.join(kinds)} in hf_posenc/kernels/defaults.py: {table} "
            f"({_measured(defaults, kinds[0])}).")


def _why_own(name, backend, forced, on_cuda, defaults) -> str:
    if forced is not None:
        return f"HF_POSENC_BACKEND={forced} gives {backend} (the tile-wise engine for torch and flex)."
    if backend == "triton":
        return f"CUDA default for {name}: triton ({_measured(defaults, name)})."
    if not on_cuda:
        return "Not a CUDA device: the tile-wise PyTorch engine (the Triton kernels need CUDA)."
    if defaults.cuda_default_backend(name) != "triton":
        return f"CUDA default for {name} in hf_posenc/kernels/defaults.py: torch ({_measured(defaults, name)})."
    from ..kernels._attn_dispatch import triton_import_error

    return f"Triton is not usable here ({triton_import_error(f'{name}.triton_{name}')}): the tile-wise engine."


def _why_rotation(forced, on_cuda, defaults) -> str:
    if forced is not None:
        return f"PyTorch (HF_POSENC_BACKEND={forced})."
    if not on_cuda:
        return "PyTorch (not a CUDA device)."
    if defaults.cuda_default_backend("rotary") != "triton":
        return "PyTorch (the CUDA default for rotary in hf_posenc/kernels/defaults.py)."
    from ..kernels.rotary import _triton_import_error

    return f"PyTorch (Triton is not usable here: {_triton_import_error()})."
