"""The machine hf_posenc runs on: the CPU model's name (for the autotuner's cache, benchmarks and study records)."""

from __future__ import annotations

import functools
import platform

__all__ = ["cpu_name"]


@functools.lru_cache(maxsize=1)
def cpu_name() -> str:
    """The CPU model, e.g. ``"AMD EPYC"`` or ``"Intel(R) Xeon(R) Processor"``: /proc/cpuinfo's first ``model
    name``, else what ``platform`` says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"
