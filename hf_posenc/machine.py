"""The machine hf_posenc runs on: the CPU model's name (for the autotuner's cache, benchmarks and study records).

Cloud VMs often name very different CPUs alike (``lscpu`` says just "AMD EPYC" on a family-25 Zen 3/4 and on a
family-26 Zen 5), and a speed measured on one need not hold on the other, so `cpu_id` adds the CPU
family and model that ``/proc/cpuinfo`` reports.
"""

from __future__ import annotations

import functools
import platform

__all__ = ["cpu_details", "cpu_id", "cpu_name"]


@functools.lru_cache(maxsize=1)
def cpu_details() -> dict:
    """``/proc/cpuinfo``'s first processor: ``{"model_name", "vendor", "family", "model", "stepping"}`` (each None
    where the file does not say; off Linux only ``model_name``, from ``platform``)."""
    keys = {"model name": "model_name", "vendor_id": "vendor", "cpu family": "family", "model": "model",
            "stepping": "stepping"}
    out: dict = dict.fromkeys(keys.values())
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block ends here
                key, _, value = line.partition(":")
                key = key.strip()
                if key in keys:
                    value = value.strip()
                    out[keys[key]] = int(value) if keys[key] in ("family", "model", "stepping") and value.isdigit() \
                        else value
    except OSError:
        pass
    if not out["model_name"]:
        out["model_name"] = platform.processor() or platform.machine() or "unknown CPU"
    return out


def cpu_name() -> str:
    """The CPU model, e.g. ``"AMD EPYC"`` or ``"Intel(R) Xeon(R) Processor"``: /proc/cpuinfo's first ``model
    name``, else what ``platform`` says."""
    return cpu_details()["model_name"]


def cpu_id() -> str:
    """The CPU model with its family and model numbers where known, e.g. ``"AMD EPYC family 26 model 2"``: the
    name under which a CPU's measurements (benchmarks, the autotuner's cache) are kept apart."""
    d = cpu_details()
    if d["family"] is None or d["model"] is None:
        return d["model_name"]
    return f"{d['model_name']} family {d['family']} model {d['model']}"
