"""The install on a plain machine: ``make test`` / ``make demo`` install torch's CPU build from PyTorch's CPU index
where there is no ``nvidia-smi`` (``TORCH_INDEX_URL``), pip's default (CUDA) build where there is one, and the
README's manual steps say the same. Checked with ``make -n`` (nothing is installed)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def _setup_commands(tmp_path: Path, gpu: bool, **variables: str) -> str:
    """The commands ``make setup`` would run for a fresh venv, on a machine with or without nvidia-smi."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    if gpu:
        (fake / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
        (fake / "nvidia-smi").chmod(0o755)
    path = [str(fake)] + [d for d in os.environ.get("PATH", "").split(os.pathsep)
                          if d and not (Path(d) / "nvidia-smi").exists()]
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_INDEX_URL", "TORCH_SPEC", "MAKEFLAGS")}
    env["PATH"] = os.pathsep.join(path)
    env.update(variables)
    out = subprocess.run(["make", "-n", "-B", "setup", f"VENV={tmp_path / 'venv'}"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60, check=True)
    return out.stdout


def _torch_install(commands: str) -> str:
    return next(line.strip() for line in commands.splitlines() if re.search(r"pip install .*\"torch", line))


def test_without_nvidia_smi_make_installs_the_cpu_build_from_the_cpu_index(tmp_path):
    line = _torch_install(_setup_commands(tmp_path, gpu=False))
    assert f"--index-url {CPU_INDEX}" in line and re.search(r'"torch==\d', line), line


def test_with_nvidia_smi_make_installs_the_default_cuda_build(tmp_path):
    line = _torch_install(_setup_commands(tmp_path, gpu=True))
    assert "--index-url" not in line and line.endswith('"torch"; \\'), line


def test_torch_index_url_chooses_the_index_and_empty_means_pip_configuration(tmp_path):
    cu = "https://download.pytorch.org/whl/cu128"
    assert f"--index-url {cu}" in _torch_install(_setup_commands(tmp_path, gpu=True, TORCH_INDEX_URL=cu))
    assert "--index-url" not in _torch_install(_setup_commands(tmp_path, gpu=False, TORCH_INDEX_URL=""))


def test_the_readme_and_the_makefile_document_the_variable():
    readme = (ROOT / "README.md").read_text()
    makefile = (ROOT / "Makefile").read_text()
    assert "TORCH_INDEX_URL" in readme and f"--index-url {CPU_INDEX}" in readme
    assert f"TORCH_CPU_INDEX_URL := {CPU_INDEX}" in makefile
