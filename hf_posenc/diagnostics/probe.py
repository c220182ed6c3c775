"""The doctor's probe of the machine: versions, the device, the variables that steer the engines."""

from __future__ import annotations

import os
import platform
from typing import Any

import torch

from ..machine import cpu_id

__all__ = ["environment"]


# -- environment -----------------------------------------------------------------------------------------


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except ImportError:
        return None
    except Exception as exc:  # a broken install: say so in the report  # noqa: BLE001
        return f"import failed: {type(exc).__name__}: {exc}"


def _interpreting() -> bool:
    from ..kernels._jit import interpreting

    try:
        return interpreting()
    except Exception:  # noqa: BLE001 - triton missing or broken: not interpreting
        return False


def environment(device: torch.device | str) -> dict[str, Any]:
    """Versions, the device (name, compute capability, SMs, memory) and the variables that steer the engines."""
    from .. import __version__

    device = torch.device(device)

    versions = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
                "triton": _version("triton"), "transformers": _version("transformers"), "hf_posenc": __version__}
    dev: dict[str, Any] = {"type": device.type}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        dev.update(name=props.name, capability=f"{props.major}.{props.minor}", sm_count=props.multi_processor_count,
                   memory_gib=round(props.total_memory / 2**30, 1))
    else:
        dev.update(name=cpu_id(), capability=None, threads=torch.get_num_threads())
    env = {name: os.environ.get(name) for name in ("HF_POSENC_BACKEND", "TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES")}
    return {"versions": versions, "device": dev, "platform": platform.platform(), "environment": env,
            "triton_interpreter": _interpreting()}
