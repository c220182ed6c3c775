"""The autotuner of exact engine paths (hf_posenc.kernels.autotune): choice, cache, off switch, forcing.

The timing runs on a fake clock: the ``time`` module inside ``autotune`` is replaced by :class:`FakeClock`, whose
``perf_counter`` reads a counter that the test's paths advance by the cost they declare. No test sleeps, so the
choices do not depend on the load of a shared machine.
"""

from __future__ import annotations

import json

import pytest
import torch

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


class FakeClock:
    """Stands in for the ``time`` module inside ``autotune``: ``perf_counter`` reads ``now``, which only ``spend``
    moves (anything else autotune might take from ``time`` is missing, and fails loudly)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def spend(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture(autouse=True)
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(autotune, "time", fake)
    return fake


def _runner(calls, clock, cost=None):
    """A path that records its calls and spends ``cost[path]`` seconds of the fake clock ("fast" 8x faster by
    default: well past the switch margin)."""
    cost = cost or {"slow": 0.004, "fast": 0.0005}

    def run(path):
        calls.append(path)
        clock.spend(cost[path])
    return run


def test_times_the_paths_once_and_caches_the_fastest(capsys, clock):
    calls = []
    assert autotune.choose("test.sleepy", "L64", _runner(calls, clock)) == "fast"
    assert set(calls) == {"fast", "slow"} and len(calls) >= 6  # warm-up + at least two interleaved rounds
    assert "timing 2 exact paths of test.sleepy" in capsys.readouterr().err
    calls.clear()
    assert autotune.choose("test.sleepy", "L64", _runner(calls, clock)) == "fast"
    assert calls == []  # known: not timed again
    data = json.loads(autotune.cache_path().read_text())
    assert data["cpu"] and any(k.startswith("test.sleepy|L64|") for k in data["choices"])
    autotune._MEMORY.clear()  # a new process reads the file
    assert autotune.choose("test.sleepy", "L64", _runner(calls, clock)) == "fast" and calls == []


def test_clear_cache_forgets(clock):
    autotune.choose("test.sleepy", "L64", _runner([], clock))
    assert autotune.cache_path().exists()
    autotune.clear_cache()
    assert not autotune.cache_path().exists()
    calls = []
    autotune.choose("test.sleepy", "L64", _runner(calls, clock))
    assert calls


def test_off_takes_the_default_without_timing(monkeypatch, clock):
    monkeypatch.setenv(autotune.ENV_TUNE, "off")
    calls = []
    assert autotune.choose("test.sleepy", "L64", _runner(calls, clock)) == "slow"
    assert calls == [] and not autotune.cache_path().exists()


def test_force_and_its_errors(monkeypatch, clock):
    monkeypatch.setenv(autotune.ENV_FORCE, "test.sleepy=slow")
    calls = []
    assert autotune.choose("test.sleepy", "L64", _runner(calls, clock)) == "slow" and calls == []
    monkeypatch.setenv(autotune.ENV_FORCE, "test.sleepy=warp")
    with pytest.raises(ValueError, match="has paths fast, slow"):
        autotune.choose("test.sleepy", "L64", _runner(calls, clock))
    monkeypatch.setenv(autotune.ENV_FORCE, "nosuch=fast")
    with pytest.raises(ValueError, match="unknown site 'nosuch'"):
        autotune.choose("test.sleepy", "L64", _runner(calls, clock))
    monkeypatch.setenv(autotune.ENV_FORCE, "")
    monkeypatch.setenv(autotune.ENV_TUNE, "maybe")
    with pytest.raises(ValueError, match="'on' or 'off'"):
        autotune.choose("test.sleepy", "L64", _runner(calls, clock))


def test_not_timed_off_the_cpu(clock):
    calls = []
    assert autotune.choose("test.sleepy", "L64", _runner(calls, clock), device="meta") == "slow" and calls == []


def test_shape_class_rounds_up_to_powers_of_two():
    assert autotune.shape_class(L=1500, H=8, D=33) == "L2048-H8-D64"
    assert autotune.shape_class(L=1) == "L1"
    with pytest.raises(ValueError, match="not one of its paths"):
        autotune.register_site("test.bad", ("a",), default="b", help="")


# -- the tile engine's site: both paths exact ---------------------------------------------------------------
from hf_posenc.kernels.attention import terms as _terms  # noqa: E402
from hf_posenc.kernels.attention.naive import attention_reference  # noqa: E402
from hf_posenc.kernels.attention.tiled import tiled_attention  # noqa: E402


def _case(kind, causal, padding, seed=0):
    shape = (2, 4, 2, 77, 77, 40)  # GQA, odd length and head_dim
    g = torch.Generator().manual_seed(seed)
    b, h, hkv, lq, lk, d = shape
    q, k, v = (torch.randn(b, n, lq, d, generator=g) for n in (h, hkv, hkv))
    term, leaves = _terms.example_term(kind, shape, 0, g)
    valid = None
    if padding:
        valid = torch.ones(b, lk, dtype=torch.bool)
        valid[1, :5] = False
    return q, k, v, term, leaves, valid


def _run(engine, q, k, v, term, leaves, valid, causal):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    for t in leaves:
        t.grad = None
    out = engine(q, k, v, term, scale=40 ** -0.5, causal=causal, key_valid=valid)
    out.backward(torch.ones_like(out))
    return [out.detach(), q.grad, k.grad, v.grad, *[t.grad.clone() for t in leaves]]


#: (kind, causal, padding) cases of the tile engine's site. Shaw without a causal mask has no fused path (the engine
#: runs the online passes and asks the autotuner nothing): that case is tests/test_tiled_attention.py's.
ENGINE_CASES = [
    pytest.param(kind, causal, padding, id=f"{kind}-{'causal' if causal else 'bidir'}{'-padded' if padding else ''}")
    for kind in [k for k in _terms.TILED_KINDS if k != "none"] + ["none"]
    for causal, padding in [(True, False), (True, True), (False, True)]
    if not (kind == "shaw" and not causal)
]


@pytest.mark.parametrize("kind, causal, padding", ENGINE_CASES)
def test_tile_engine_paths_give_the_same_numbers(kind, causal, padding, monkeypatch):
    """Whatever the autotuner picks, the numbers are the reference's: each forced path, forward and every
    gradient (q, k, v and the term's leaves), against the full-matrix reference. The engine's site is asked (a
    spy on ``autotune.choose``) and answers the forced path, so that the two runs are not one path twice."""
    asked = []
    real_choose = autotune.choose
    monkeypatch.setattr(autotune, "choose", lambda site, *a, **kw: asked.append(site) or real_choose(site, *a, **kw))
    q, k, v, term, leaves, valid = _case(kind, causal, padding)
    ref = _run(attention_reference, q, k, v, term, leaves, valid, causal)
    for path in ("fused", "online"):
        monkeypatch.setenv(autotune.ENV_FORCE, f"tiled.engine={path}")
        asked.clear()
        got = _run(tiled_attention, q, k, v, term, leaves, valid, causal)
        assert asked and set(asked) == {"tiled.engine"}, f"the engine did not ask for its path ({asked})"
        for name, a, r in zip(["out", "dq", "dk", "dv", *[f"leaf{i}" for i in range(len(leaves))]], got, ref):
            err = ((a.double() - r.double()).norm() / r.double().norm().clamp_min(1e-30)).item()
            assert err < 1e-4, f"{path} {name}: relative error {err:.2e}"  # the kernel tests' float32 bound


def test_tile_engine_tunes_once_per_case(monkeypatch):
    monkeypatch.setenv(autotune.ENV_TUNE, "on")
    q, k, v, term, leaves, valid = _case("alibi", True, False)
    tiled_attention(q, k, v, term, scale=0.2, causal=True)
    choices = json.loads(autotune.cache_path().read_text())["choices"]
    (entry,) = [key for key in choices if key.startswith("tiled.engine|alibi-causal-dense-full-infer-")]
    assert choices[entry] in ("fused", "online")


@pytest.mark.parametrize("fast_cost, want", [(0.0019, "slow"), (0.0018, "slow"), (0.0016, "fast")],
                         ids=["5pc-faster", "10pc-faster", "20pc-faster"])
def test_the_default_stays_unless_another_path_is_clearly_faster(clock, fast_cost, want):
    """The default ("slow", 2 ms) gives way only to a path more than SWITCH_MARGIN (15 %) faster."""
    assert autotune.SWITCH_MARGIN == 0.15
    calls = []
    assert autotune.choose("test.sleepy", "L32", _runner(calls, clock, {"slow": 0.002, "fast": fast_cost})) == want


def test_timing_stops_at_the_budget_after_two_rounds(clock):
    """Each path costing 1.5 s (over TUNE_BUDGET_S = 2 s after one round): a warm-up call and two timed rounds."""
    assert autotune.TUNE_BUDGET_S == 2.0
    calls = []
    autotune.choose("test.sleepy", "L32", _runner(calls, clock, {"slow": 1.5, "fast": 1.5}))
    assert calls == ["fast", "slow"] * 3
    calls.clear()
    autotune.choose("test.sleepy", "L16", _runner(calls, clock, {"slow": 1e-3, "fast": 1e-3}))
    assert len(calls) == 2 * 8  # cheap paths: the warm-up and all seven rounds
