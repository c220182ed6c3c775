"""The autotuner of exact engine paths (hf_posenc.kernels.autotune): choice, cache, off switch, forcing."""

from __future__ import annotations

import json
import time

import pytest

from hf_posenc.kernels import autotune

SITE = autotune.register_site("test.sleepy", ("fast", "slow"), default="slow", help="a site for the tests")


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_POSENC_CACHE", str(tmp_path))
    monkeypatch.delenv(autotune.ENV_TUNE, raising=False)
    monkeypatch.delenv(autotune.ENV_FORCE, raising=False)
    autotune.clear_cache()
    yield
    autotune.clear_cache()


def _runner(calls):
    def run(path):
        calls.append(path)
        time.sleep(0.004 if path == "slow" else 0.0005)
    return run


def test_times_the_paths_once_and_caches_the_fastest(capsys):
    calls = []
    assert autotune.choose("test.sleepy", "L64", _runner(calls)) == "fast"
    assert set(calls) == {"fast", "slow"} and len(calls) >= 6  # warm-up + at least two interleaved rounds
    assert "timing 2 exact paths of test.sleepy" in capsys.readouterr().err
    calls.clear()
    assert autotune.choose("test.sleepy", "L64", _runner(calls)) == "fast"
    assert calls == []  # known: not timed again
    data = json.loads(autotune.cache_path().read_text())
    assert data["cpu"] and any(k.startswith("test.sleepy|L64|") for k in data["choices"])
    autotune._MEMORY.clear()  # a new process reads the file
    assert autotune.choose("test.sleepy", "L64", _runner(calls)) == "fast" and calls == []


def test_clear_cache_forgets(monkeypatch):
    autotune.choose("test.sleepy", "L64", _runner([]))
    assert autotune.cache_path().exists()
    autotune.clear_cache()
    assert not autotune.cache_path().exists()
    calls = []
    autotune.choose("test.sleepy", "L64", _runner(calls))
    assert calls


def test_off_takes_the_default_without_timing(monkeypatch):
    monkeypatch.setenv(autotune.ENV_TUNE, "off")
    calls = []
    assert autotune.choose("test.sleepy", "L64", _runner(calls)) == "slow"
    assert calls == [] and not autotune.cache_path().exists()


def test_force_and_its_errors(monkeypatch):
    monkeypatch.setenv(autotune.ENV_FORCE, "test.sleepy=slow")
    calls = []
    assert autotune.choose("test.sleepy", "L64", _runner(calls)) == "slow" and calls == []
    monkeypatch.setenv(autotune.ENV_FORCE, "test.sleepy=warp")
    with pytest.raises(ValueError, match="has paths fast, slow"):
        autotune.choose("test.sleepy", "L64", _runner(calls))
    monkeypatch.setenv(autotune.ENV_FORCE, "nosuch=fast")
    with pytest.raises(ValueError, match="unknown site 'nosuch'"):
        autotune.choose("test.sleepy", "L64", _runner(calls))
    monkeypatch.setenv(autotune.ENV_FORCE, "")
    monkeypatch.setenv(autotune.ENV_TUNE, "maybe")
    with pytest.raises(ValueError, match="'on' or 'off'"):
        autotune.choose("test.sleepy", "L64", _runner(calls))


def test_not_timed_off_the_cpu():
    calls = []
    assert autotune.choose("test.sleepy", "L64", _runner(calls), device="meta") == "slow" and calls == []


def test_shape_class_rounds_up_to_powers_of_two():
    assert autotune.shape_class(L=1500, H=8, D=33) == "L2048-H8-D64"
    assert autotune.shape_class(L=1) == "L1"
    with pytest.raises(ValueError, match="not one of its paths"):
        autotune.register_site("test.bad", ("a",), default="b", help="")
