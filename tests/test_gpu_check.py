"""benchmarks/gpu_check.py (``make gpu-check``) without a GPU: its stages stay within 8 minutes, it reads
pytest's junit report, and its summary marks each design target met or missed from the benchmarks' rows."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_stages_fit_in_eight_minutes_and_cover_every_benchmark(gpu_check, tmp_path):
    stages = gpu_check.stages(False, tmp_path)
    assert sum(st["timeout"] for st in stages) <= 8 * 60 - 20  # room for the start and the summary
    names = [st["name"] for st in stages]
    assert names == ["doctor", "attention", "sba_cope", "rotary", "train_step"]
    assert stages[0]["cmd"][1:4] == ["-m", "hf_posenc", "doctor"]
    assert stages[0]["cmd"][stages[0]["cmd"].index("--out") + 1] == str(tmp_path / "doctor.json")
    for st in stages[1:]:
        assert str(ROOT / "benchmarks") in st["cmd"][1] and "--out" in st["cmd"]
    with_tests = gpu_check.stages(False, tmp_path, pytest=True)
    assert [st["name"] for st in with_tests][:2] == ["doctor", "pytest -m gpu"]
    assert "-m" in with_tests[1]["cmd"] and "gpu" in with_tests[1]["cmd"]
    smoke = gpu_check.stages(True, tmp_path, pytest=True)
    assert "pytest -m gpu" not in [st["name"] for st in smoke]
    assert all("--smoke" in st["cmd"] for st in smoke[1:]) and "--interpret" in smoke[0]["cmd"]


def test_pytest_counts(gpu_check, tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text('<testsuites><testsuite tests="7" failures="1" errors="0" skipped="2"/></testsuites>')
    assert gpu_check.pytest_counts(xml) == {"tests": 7, "failures": 1, "errors": 0, "skipped": 2, "passed": 4}
    assert gpu_check.pytest_counts(tmp_path / "missing.xml") is None
    partial = ("tests/test_a.py::test_x[fp32] PASSED      [  1%]\ntests/test_a.py::test_y FAILED [  2%]\n"
               "tests/test_b.py::test_z SKIPPED (needs a CUDA GPU) [  3%]\nplain line\n")
    assert gpu_check.pytest_counts(tmp_path / "missing.xml", partial) == {
        "tests": 3, "failures": 1, "errors": 0, "skipped": 1, "passed": 1, "partial": True}


def test_summary_marks_targets(gpu_check):
    attention = [
        {"term": "alibi", "batch": 4, "length": 1024, "mode": "fwd+bwd", "triton_ms": 1.05, "sdpa_ms": 1.0,
         "flex_ms": 1.2},
        {"term": "fox", "batch": 1, "length": 4096, "mode": "fwd+bwd", "triton_ms": 1.3, "sdpa_ms": 1.0,
         "flex_ms": 1.1},
        {"term": "alibi", "batch": 4, "length": 1024, "mode": "fwd", "triton_ms": 9.0, "sdpa_ms": 1.0},
    ]
    train = [{"encoding": "unpatched", "tokens_per_s": 1000.0, "ratio_vs_unpatched": 1.0},
             {"encoding": "cope", "tokens_per_s": 900.0, "ratio_vs_unpatched": 0.9, "backend": "triton"}]
    result = gpu_check.doctor_report(ROOT / "missing.json", "cpu")  # the doctor wrote nothing: a stub report
    assert result["ok"] is False and result["rows"] == [] and result["schema"].startswith("hf_posenc.doctor/")
    result["device"]["name"] = "NVIDIA H100"
    result["benchmarks"] = {
        "git_commit": None, "pytest": None,
        "stages": [{"name": "attention", "status": "ok", "seconds": 1, "rows": attention},
                   {"name": "train_step", "status": "timed out after 75 s", "seconds": 75, "rows": train}]}
    text = "\n".join(gpu_check.summary(result))
    assert text.startswith("# gpu-check on NVIDIA H100") and "## hf-posenc doctor" in text
    lines = text.splitlines()
    alibi = next(ln for ln in lines if ln.startswith("| alibi | 4 | 1024"))
    fox = next(ln for ln in lines if ln.startswith("| fox |"))
    assert "| 1.050 | 1.1 | yes |" in alibi and "SLOWER" not in alibi
    assert "| 1.300 | 1.15 | NO |" in fox and "SLOWER" in fox
    assert sum(ln.startswith("| alibi |") for ln in lines) == 1  # forward-only rows are not in the target table
    assert "| cope | triton | 900 | 0.900 | NO |" in text
    assert "| train_step | timed out after 75 s |" in text


@pytest.mark.slow  # a benchmark in a subprocess
def test_cheapest_benchmark_smoke_mode_runs(tmp_path):
    """bench_rotary.py --smoke (tiny shapes, the kernel interpreted on the CPU): the script `make gpu-check`
    runs works end to end and appends its rows as it measures them (~8 s of CPU)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton", reason="the smoke run interprets the Triton kernel")
    rows = tmp_path / "rows.jsonl"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_rotary.py"), "--smoke", "--block-sizes", "2",
           "--modes", "fwd", "--rows-jsonl", str(rows)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = rows.read_text().splitlines()
    assert len(lines) == 1 and '"triton_ms"' in lines[0]


def test_warm_up_covers_every_case_and_benchmark(gpu_check, tmp_path):
    """The CUDA warm-up compiles in parallel what the timed stages launch: the doctor one case per process
    (untimed), every benchmark with one repetition (its JSON kept out of benchmarks/results), the extra commands
    and, asked for, pytest -m gpu; --only leaves out the other benchmarks."""
    from hf_posenc.diagnostics import CASES

    warm = gpu_check.prewarm_stages(tmp_path, True, None, ["echo extra"])
    names = [st["name"] for st in warm]
    assert names[0] == "pytest -m gpu" and "-n" in warm[0]["cmd"]
    assert names[1] == "extra 0" and warm[1]["cmd"] == ["bash", "-c", "echo extra"]
    assert {f"prewarm {n}" for n in ("attention", "sba_cope", "rotary", "train_step")} <= set(names)
    assert [n for n in names if n.startswith("prewarm doctor ")] == [f"prewarm doctor {c.name}" for c in CASES]
    for st in warm:
        if st["name"].startswith("prewarm doctor"):
            assert "--no-timing" in st["cmd"] and st["cmd"][st["cmd"].index("--out") + 1].startswith(str(tmp_path))
        elif st["name"].startswith("prewarm ") and "--out" in st["cmd"]:
            assert st["cmd"][st["cmd"].index("--out") + 1].startswith(str(tmp_path))
            for flag, value in (("--max-reps", "1"), ("--rounds", "1")):
                if flag in st["cmd"]:
                    assert st["cmd"][st["cmd"].index(flag) + 1] == value
    only = [st["name"] for st in gpu_check.prewarm_stages(tmp_path, False, ["doctor", "rotary"])]
    assert "prewarm rotary" in only and "prewarm attention" not in only and "pytest -m gpu" not in only


def test_doctor_groups_cover_every_case_once(gpu_check):
    """The doctor stage's processes: every case exactly once, CoPE (whose float32 kernel broke the CUDA context
    on an H100) apart from the others."""
    from hf_posenc.diagnostics import CASES

    groups = gpu_check.doctor_groups()
    flat = [name for group in groups for name in group]
    assert sorted(flat) == sorted(c.name for c in CASES) and len(flat) == len(set(flat))
    assert ["cope"] in groups and ["cope_window"] in groups


def test_a_stage_ends_by_the_deadline(gpu_check, tmp_path):
    import sys
    import time

    st = {"name": "sleep", "timeout": 60, "cmd": [sys.executable, "-c", "import time; time.sleep(30)"]}
    t0 = time.time()
    rec = gpu_check.run_stage(st, {}, deadline=time.time() + 1)
    assert rec["status"].startswith("timed out") and time.time() - t0 < 20
