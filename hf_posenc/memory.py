"""A memory pre-check for the PyTorch references whose intermediates grow as O(L^2).

The references of the encodings with terms inside the attention (score biases, custom attentions) build
tensors of shape (B, H, Lq, Lk) -- a few of them, or dozens (cope, cape, fire). On a CPU an allocation that
does not fit is often not an exception at all: the kernel's OOM killer ends the process, or the machine
swaps for minutes. So before building them, each such encoding estimates the bytes its reference needs at
this shape (``PositionEncoding.reference_bytes``, from per-encoding footprints measured at L = 4096 by
``tests/test_long_inputs.py``) and raises `ReferenceMemoryError`, naming that amount, when it is over
the budget:

* ``HF_POSENC_MEMORY_BUDGET`` when set: a size (``24GiB``, ``512MiB``, ``8e9``, ``16G``) or ``none`` / ``off``
  (no check);
* otherwise the memory the system reports as available (``MemAvailable`` in /proc/meminfo), read only when an
  estimate is large; no check where it cannot be read.

Only tensors on the CPU are checked: there the references always run, whereas on CUDA the fused kernels may
run instead, and torch raises its own ``OutOfMemoryError`` there. Nor inside ``torch.compile``: a compiled graph
cannot read the budget (a file and the environment) and would be specialised to every length the check formats
(one graph per length); a compiled model's references meet the allocator as they are.
"""

from __future__ import annotations

import os
import re

import torch

__all__ = ["ENV_VAR", "ReferenceMemoryError", "check_reference_memory", "memory_budget", "parse_size"]

ENV_VAR = "HF_POSENC_MEMORY_BUDGET"
#: estimates below this are never checked (no file read in the usual small forward).
_FLOOR = 256 * 2**20
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


class ReferenceMemoryError(MemoryError):
    """An encoding's PyTorch reference would need more memory than the budget (``HF_POSENC_MEMORY_BUDGET``)."""


def parse_size(text: str) -> int | None:
    """``"24GiB"`` -> bytes; ``"none"``, ``"off"``, ``"unlimited"``, ``"0"`` -> None (no limit).

    Units: B, k/KB (10^3), KiB (2^10), M/MB, MiB, G/GB, GiB, T/TB, TiB; case-insensitive; a bare number is bytes.
    """
    s = text.strip().lower().replace(" ", "")
    if s in ("none", "off", "unlimited", "inf", "0", ""):
        return None
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[0-9]+)?)([a-z]*)", s)
    if m is None or m.group(2) not in _UNITS:
        raise ValueError(
            f"{ENV_VAR}={text!r} is not a size; use e.g. 24GiB, 512MiB, 8e9 (bytes), or 'none' to disable the check"
        )
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def _available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def memory_budget(device: torch.device) -> tuple[int | None, str]:
    """(bytes the references may use on ``device`` or None for no limit, where that number comes from)."""
    if torch.device(device).type != "cpu":
        return None, "not checked off the CPU"
    text = os.environ.get(ENV_VAR)
    if text is not None and text.strip():
        return parse_size(text), f"{ENV_VAR}={text.strip()}"
    return _available_bytes(), "the memory available on this machine (set HF_POSENC_MEMORY_BUDGET to change)"


def _fmt(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def check_reference_memory(name: str, what: str, nbytes: int, device: torch.device) -> None:
    """Raise `ReferenceMemoryError` if ``nbytes`` (the estimate for ``what``) is over the budget."""
    if nbytes < _FLOOR:
        return
    budget, source = memory_budget(device)
    if budget is None or nbytes <= budget:
        return
    raise ReferenceMemoryError(
        f"{name}: the PyTorch reference ({what}) would need about {_fmt(nbytes)} for its O(L^2) intermediates, over "
        f"the memory budget of {_fmt(budget)} ({source}). Use shorter inputs or a smaller batch, run on a CUDA "
        f"GPU (fused kernels, where {name} has one), or set {ENV_VAR} (e.g. 64GiB, or 'none' to disable the check)"
    )
