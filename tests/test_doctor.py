"""``hf-posenc doctor`` / ``hf_posenc.doctor()`` (the hf_posenc/diagnostics package) on the CPU.

The tile-wise engines pass against the float64 references (forward and every gradient); FlexAttention's CPU
row checks the forward only and says why; the Triton kernels run in Triton's interpreter with the tiny shape
(tests/conftest.py sets ``TRITON_INTERPRET=1`` before triton's first import); the JSON report has its schema;
an engine made wrong (in its output, or only in its gradients) or crashing fails its row and gives exit
status 1; the command line (``hf-posenc doctor``, ``python -m hf_posenc doctor``) works end to end.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hf_posenc
from hf_posenc import cli
from hf_posenc.registry import list_encodings

diag = importlib.import_module("hf_posenc.diagnostics")  # ``hf_posenc.doctor`` is the function
diag_cases = importlib.import_module("hf_posenc.diagnostics.cases")  # where the checks call the engines
ROOT = Path(__file__).resolve().parents[1]
CPU = not torch.cuda.is_available()
ROW_KEYS = {"case", "family", "engine", "dtype", "shape", "window", "status", "tolerance", "max_error", "errors",
            "checked", "engine_ms", "sdpa_ms", "ratio_vs_sdpa", "timed", "note", "interpreted"}


@pytest.fixture(autouse=True)
def _unforced(monkeypatch):
    monkeypatch.delenv("HF_POSENC_BACKEND", raising=False)


def _rows(report, **match):
    return [r for r in report["rows"] if all(r[k] == v for k, v in match.items())]


def test_tiled_engines_pass_forward_and_every_gradient():
    """Every case of the tile-wise engines (the attention terms, the window, SBA, CoPE, CAPE) on the CPU."""
    report = hf_posenc.doctor(device="cpu", engines="tiled", timing=False, verbose=False)
    rows = report["rows"]
    assert {r["case"] for r in rows} == {c.name for c in diag.CASES if "tiled" in c.engines}
    for r in rows:
        assert r["status"] == "pass", r
        assert r["max_error"] <= diag.TOLERANCE["float32"] and r["shape"]["L"] == diag.SHAPE[3]
        assert r["checked"][:4] == ["out", "dq", "dk", "dv"], r
    params = {r["case"]: r["checked"][4:] for r in rows}
    assert params["alibi"] == [] and params["kerple_log"] == ["dr1", "dr2"] and params["fox"] == ["dlog_f"]
    assert params["fire"] == ["dtable", "dc", "dinv_norm"] and params["sba"] == ["dbias"]
    assert params["cope_window"] == ["dtable"] and params["cape"] == ["dw1", "db1", "dw2", "db2", "dr1", "dr2"]
    assert [r["window"] for r in rows if r["case"].endswith("_window")] == [diag.SHAPE[3] // 3] * 3
    assert report["ok"] is True and report["complete"] is True


@pytest.mark.skipif(not CPU, reason="FlexAttention has a backward on CUDA")
def test_flex_on_cpu_checks_the_forward_and_says_so():
    report = hf_posenc.doctor(device="cpu", engines="flex", cases="alibi_window,shaw", timing=False, verbose=False)
    shaw, window = report["rows"]  # in the order of diag.CASES
    assert window["status"] == "pass" and window["checked"] == ["out"] and "no backward" in window["note"]
    assert shaw["status"] == "skip" and "no FlexAttention form" in shaw["note"]
    assert report["ok"] and report["summary"]["forward_only"] == 1 and report["summary"]["skip"] == 1


def test_triton_kernels_in_the_interpreter():
    """The Triton kernels (attention with a term and a window, SBA, CoPE, rotary) interpreted, tiny shapes."""
    pytest.importorskip("triton")
    if CPU and not diag._interpreter_ready():
        pytest.skip("TRITON_INTERPRET=1 was not set before triton was imported (see tests/conftest.py)")
    cases = "fox,alibi_window,sba,cope_window,rotary_s8"
    report = hf_posenc.doctor(engines="triton", cases=cases, verbose=False)
    assert [r["case"] for r in report["rows"]] == cases.split(",")
    for r in report["rows"]:
        assert r["status"] == "pass", r
        assert "dq" in r["checked"] and "dk" in r["checked"]
        if CPU:  # tiny shapes, never timed
            assert r["interpreted"] and r["shape"]["L"] == diag.SHAPE_INTERPRETED[3] and r["engine_ms"] is None
    assert report["triton_interpreter"] is CPU


def test_json_report_schema(tmp_path):
    out = tmp_path / "sub" / "report.json"
    report = hf_posenc.doctor(device="cpu", engines="tiled,triton", cases="t5,cope", out=out, verbose=False)
    data = json.loads(out.read_text())  # strict JSON: no NaN or Infinity
    assert data == json.loads(json.dumps(report))
    assert data["schema"] == diag.SCHEMA and data["ok"] is True and data["complete"] is True
    assert set(data) == {"schema", "ok", "complete", "created", "versions", "device", "platform", "environment",
                         "triton_interpreter", "settings", "rows", "summary", "defaults", "seconds"}
    assert set(data["versions"]) == {"python", "torch", "cuda", "triton", "transformers", "hf_posenc"}
    assert data["versions"]["hf_posenc"] == hf_posenc.__version__ and data["device"]["type"] == "cpu"
    assert data["settings"]["dtypes"] == ["float32"] and data["settings"]["tolerance"] == diag.TOLERANCE
    assert [(r["engine"], r["case"]) for r in data["rows"]] == [
        ("triton", "t5"), ("triton", "cope"), ("tiled", "t5"), ("tiled", "cope")]  # the kernels first
    for r in data["rows"]:
        assert set(r) == ROW_KEYS
        if r["status"] == "pass":
            assert r["max_error"] == max(r["errors"].values()) and list(r["errors"]) == r["checked"]
    tiled = _rows(data, engine="tiled", case="t5")[0]
    assert tiled["timed"] == "fwd+bwd" and tiled["engine_ms"] > 0 and tiled["sdpa_ms"] > 0
    assert math.isclose(tiled["ratio_vs_sdpa"], tiled["engine_ms"] / tiled["sdpa_ms"])
    assert data["summary"]["rows"] == 4 and data["summary"]["fail"] == data["summary"]["error"] == 0
    defaults = {d["encoding"]: d for d in data["defaults"]}
    assert set(defaults) == set(list_encodings())
    assert set(defaults["alibi"]) == {"encoding", "kind", "attention", "rotation", "why"}
    if CPU:
        assert defaults["alibi"]["attention"] == "torch" and "tile-wise" in defaults["alibi"]["why"]
        assert defaults["sba"]["attention"] == "torch" and defaults["rope"]["attention"] == "torch"
        assert defaults["comrope"]["rotation"] == "torch" and defaults["alibi"]["rotation"] is None


def test_defaults_follow_the_forced_backend(monkeypatch):
    monkeypatch.setenv("HF_POSENC_BACKEND", "flex")
    rows = {d["encoding"]: d for d in diag.default_backends("cpu")}
    assert rows["alibi"]["attention"] == "flex" and "HF_POSENC_BACKEND=flex" in rows["alibi"]["why"]
    assert rows["rope"]["attention"] == "torch"
    assert rows["cope"]["attention"] == "torch"  # CoPE has no flex form: its tile-wise engine
    assert rows["tape"]["attention"] == "error" and "no flex attention kernel" in rows["tape"]["why"]
    monkeypatch.setenv("HF_POSENC_BACKEND", "nonsense")
    assert {d["attention"] for d in diag.default_backends("cpu")} == {"error"}


def _wrong_gradient(fn, factor):
    """``fn`` with its forward unchanged and the gradients reaching its output scaled by ``factor``."""

    def wrapped(*args, **kwargs):
        out = fn(*args, **kwargs)
        return out + (factor - 1.0) * (out - out.detach())

    return wrapped


@pytest.mark.parametrize("how", ["output", "gradient", "crash"])
def test_a_wrong_engine_fails_its_row_and_the_exit_status(monkeypatch, tmp_path, how):
    tiled = diag_cases.tiled_attention
    if how == "output":
        monkeypatch.setattr(diag_cases, "tiled_attention", lambda *a, **k: tiled(*a, **k) * 1.01)
    elif how == "gradient":
        monkeypatch.setattr(diag_cases, "tiled_attention", _wrong_gradient(tiled, 1.01))
    else:
        def crash(*a, **k):
            raise RuntimeError("engine broke")

        monkeypatch.setattr(diag_cases, "tiled_attention", crash)
    out = tmp_path / "r.json"
    code = cli.main(["doctor", "--engines", "tiled", "--cases", "alibi,sba", "--no-timing", "--no-progress",
                     "--out", str(out)])
    assert code == 1
    data = json.loads(out.read_text())
    alibi, sba = data["rows"]
    assert sba["status"] == "pass" and data["ok"] is False  # the sba engine was not touched
    if how == "crash":
        assert alibi["status"] == "error" and "engine broke" in alibi["note"] and data["summary"]["error"] == 1
        return
    assert alibi["status"] == "fail" and data["summary"]["fail"] == 1
    errors = alibi["errors"]
    if how == "output":
        assert errors["out"] > 5e-3
    else:  # the forward is right; the gradients are 1% off
        assert errors["out"] < 1e-5 and min(errors["dq"], errors["dk"], errors["dv"]) > 5e-3


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown engines"):
        hf_posenc.doctor(engines="cuda_magic", verbose=False)
    with pytest.raises(ValueError, match="unknown cases"):
        hf_posenc.doctor(cases="alibi,nope", verbose=False)
    with pytest.raises(ValueError, match="unknown dtypes"):
        hf_posenc.doctor(dtypes="int8", verbose=False)
    assert cli.main(["doctor", "--engines", "cuda_magic", "--no-progress"]) == 2


def test_command_line_entry_point(tmp_path, capsys):
    """``python -m hf_posenc doctor`` in a fresh process: exit 0, the text summary and the report. One cheap case
    with the default timing on (alibi: 1.0 s of checks, against 11.9 s for cape, measured on the 2-core AMD EPYC;
    every case's checks run in-process in test_tiled_engines_pass_forward_and_every_gradient)."""
    out = tmp_path / "report.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", "hf_posenc", "doctor", "--engines", "tiled", "--cases", "alibi",
                           "--dtype", "fp32", "--out", str(out)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "hf-posenc doctor" in proc.stdout and "OK: 1 passed" in proc.stdout and "alibi" in proc.stdout
    assert "default backends on" in proc.stdout and f"report written to {out}" in proc.stdout
    assert json.loads(out.read_text())["rows"][0]["case"] == "alibi"


def test_interpret_rerun_keeps_every_option():
    """``--interpret`` re-runs the doctor in a child process with TRITON_INTERPRET=1 and the same options."""
    import argparse

    p = argparse.ArgumentParser()
    diag.add_arguments(p)
    argv = ["--out", "r.json", "--dtype", "bf16,fp32", "--engines", "triton", "--cases", "sba", "--quick",
            "--no-timing", "--interpret", "--no-progress", "--seed", "3", "--device", "cpu"]
    args = p.parse_args(argv)
    assert p.parse_args(diag._argv_of(args)) == args


def test_merged_reports_keep_every_row_and_fail_if_any_part_failed():
    """hf_posenc.diagnostics.merge_reports: the report of the doctor run one process per kernel family."""
    from hf_posenc.diagnostics import merge_reports

    a = diag.doctor(device="cpu", engines="tiled", cases="alibi", timing=False, verbose=False)
    b = diag.doctor(device="cpu", engines="tiled", cases="sba", timing=False, verbose=False)
    merged = merge_reports([a, b])
    assert merged["rows"] == a["rows"] + b["rows"] and merged["settings"]["cases"] == ["alibi", "sba"]
    assert merged["ok"] and merged["complete"] and merged["summary"]["rows"] == len(a["rows"]) + len(b["rows"])
    broken = dict(b, ok=False, complete=False, rows=[dict(b["rows"][0], status="error")])
    worse = merge_reports([a, broken])
    assert not worse["ok"] and not worse["complete"] and worse["summary"]["error"] == 1
    assert a["rows"][0]["status"] == "pass"  # the inputs are not modified
    with pytest.raises(ValueError):
        merge_reports([])
