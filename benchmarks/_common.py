"""Helpers shared by the benchmark scripts: where they ran (device, library versions, git commit)."""

from __future__ import annotations

import json
import platform
import re
import subprocess
from pathlib import Path

import torch

from hf_posenc.machine import cpu_details, cpu_id

ROOT = Path(__file__).resolve().parents[1]


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu " + cpu_id()


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "cpu": cpu_details()}
    for mod in ("triton", "transformers"):
        try:
            out[mod] = __import__(mod).__version__
        except ImportError:
            out[mod] = None
    try:
        out["git_commit"] = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip() or None
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        out["git_dirty"] = bool(dirty.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        out["git_commit"] = None
    return out


def append_row(path: str | None, row: dict) -> None:
    """Append ``row`` as one JSON line to ``path`` (no-op for None): a run cut short keeps what it measured."""
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row, default=str) + "\n")
