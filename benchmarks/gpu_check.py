"""`make gpu-check`: hf-posenc doctor and every GPU benchmark in one run, one JSON and one table named after the GPU.

    python benchmarks/gpu_check.py            # on a CUDA machine with torch, Triton and transformers installed
    python benchmarks/gpu_check.py --smoke    # CPU: every stage with tiny shapes in Triton's interpreter
    python benchmarks/gpu_check.py --pytest   # also `pytest -m gpu tests/` (full sizes, long L; ~200 s more)

Stages, each a subprocess with its own time limit (the default stages' limits add up to 7.5 minutes; a
stage that runs out of time is reported as such, with the rows it had measured):

1. ``hf-posenc doctor``: every engine (Triton kernels, FlexAttention, the tile-wise engines) against the
   float64 references, forward and every gradient, float32 (TF32 off) and bfloat16, on small odd shapes with
   GQA, key padding and windowed launches, each timed against SDPA; and the default backend of each
   encoding. This is the correctness part: the JSON written is the doctor's report (``hf_posenc.doctor``,
   docs/doctor.md), with the benchmarks added under ``benchmarks``, so that a user's
   ``hf-posenc doctor --out report.json`` and this file have one format.
2. ``bench_attention.py``: every term kind, B = 4096 / L, H = 32, D = 128, bf16, L = 1k, 4k, 16k, forward
   and forward+backward: SDPA flash (causal, no bias: the floor), our Triton kernel, compiled FlexAttention
   with the same score_mod, the eager reference up to L = 4k.
3. ``bench_sba_cope.py``: SBA and CoPE against SDPA flash and their eager references.
4. ``bench_rotary.py``: the rotary kernel against the PyTorch rotation (eager and compiled).
5. ``bench_train_step.py``: tokens/s of a 12-layer 768-wide Llama training step, unpatched vs alibi, kerple,
   fox, cope, sba.

``--pytest`` adds ``pytest -m gpu tests/`` before the benchmarks (every kernel against its reference at full
sizes, odd shapes, decode, 16k; it needs the repository's tests/).

On CUDA a warm-up phase first runs, in parallel processes, the doctor case by case, every benchmark with one
repetition and ``pytest -m gpu`` (with ``--pytest``; it is reported from there): Triton compiles each kernel
variant on its first launch (about 1.5-3 s of one CPU core each, some 200 variants in all), and that is what
made the serial stages run out of time. The warm-up fills Triton's and inductor's on-disk caches on every
core of the machine at once; the timed stages then load the compiled kernels. ``--no-prewarm`` skips it.

Writes ``benchmarks/results/gpu_check_<gpu>.json`` (the doctor's report plus ``benchmarks``: every row of every
stage, the git commit, each stage's status and time) and ``gpu_check_<gpu>.md`` (the doctor's summary, the
tables, the design targets met or missed), and prints the summary. Nothing is installed and nothing needs the
internet. The exit status is 1 when a doctor check failed, the GPU tests failed or a stage crashed; missed
speed targets are reported, not failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))

#: design targets (../shared/DESIGN.md, "Performance targets"): kernel time / SDPA flash time, fwd+bwd.
TARGETS = {"alibi": 1.10, "kerple_log": 1.10, "kerple_pow": 1.10, "sandwich": 1.10, "t5": 1.10, "fire": 1.10,
           "fox": 1.15, "sba": 1.5, "cope": 2.5}
#: end to end: tokens/s of the patched model / unpatched.
TRAIN_TARGET = 0.95


def stages(smoke: bool, tmp: Path, pytest: bool = False) -> list[dict]:
    """name, command, time limit (s) and the JSON-lines file of rows of each stage."""
    py = sys.executable
    s = [{"name": "doctor", "timeout": 150, "report": tmp / "doctor.json", "per_family": not smoke,
          "cmd": [py, "-m", "hf_posenc", "doctor", "--out", str(tmp / "doctor.json"), "--no-progress",
                  *(["--quick", "--interpret", "--no-timing"] if smoke else [])]}]
    if pytest and not smoke:
        s.append({"name": "pytest -m gpu", "timeout": 200,
                  "cmd": [py, "-m", "pytest", "-v", "-m", "gpu", "-p", "no:cacheprovider", "--durations=15",
                          f"--junitxml={tmp / 'pytest.xml'}", str(ROOT / "tests")]})
    common = ["--smoke"] if smoke else ["--budget-ms", "40", "--warmup", "2", "--max-reps", "20"]
    lengths = [] if smoke else ["--lengths", "1024", "4096", "16384"]
    s.append({"name": "attention", "timeout": 150, "rows": tmp / "attention.jsonl",
              "cmd": [py, str(BENCH / "bench_attention.py"), *common, *lengths,
                      *([] if smoke else ["--tokens", "4096", "--eager-max-length", "4096"])]})
    s.append({"name": "sba_cope", "timeout": 45, "rows": tmp / "sba_cope.jsonl",
              "cmd": [py, str(BENCH / "bench_sba_cope.py"), *common, *lengths,
                      *([] if smoke else ["--batches", "1", "--eager-max-length", "4096",
                                          "--check-max-length", "4096"])]})
    s.append({"name": "rotary", "timeout": 45, "rows": tmp / "rotary.jsonl",
              "cmd": [py, str(BENCH / "bench_rotary.py"), *common, *lengths,
                      # one dynamic compile of the reference, not one per shape (24 static compiles took the
                      # whole stage on the H100)
                      *([] if smoke else ["--batches", "1", "4", "--compile", "dynamic"])]})
    s.append({"name": "train_step", "timeout": 60, "json": tmp / "train_step.json",
              "cmd": [py, str(BENCH / "bench_train_step.py"),
                      *(["--smoke"] if smoke else ["--rounds", "3", "--steps", "3", "--warmup", "2"])]})
    for st in s:
        if smoke:  # the interpreter on a CPU: correctness only, no time limit that means anything
            st["timeout"] *= 30
        if "rows" in st:
            st["cmd"] += ["--rows-jsonl", str(st["rows"])]
            if not smoke:
                st["cmd"] += ["--out", str(tmp / f"{st['name']}.json")]
        elif "json" in st and not smoke:
            st["cmd"] += ["--out", str(st["json"])]
    return s


def prewarm_stages(tmp: Path, pytest: bool, only: list[str] | None = None, extra: list[str] | None = None
                   ) -> list[dict]:
    """The warm-up phase (CUDA): the doctor one case per process, every benchmark with one repetition, and
    ``pytest -m gpu`` when asked. Their timings are thrown away; the pytest stage is the one reported."""
    from hf_posenc.diagnostics import CASES

    py = sys.executable
    warm = tmp / "prewarm"
    warm.mkdir(parents=True, exist_ok=True)
    out = []
    if pytest:
        out.append({"name": "pytest -m gpu", "timeout": 300,
                    "cmd": [py, "-m", "pytest", "-v", "-m", "gpu", "-p", "no:cacheprovider", "--durations=15",
                            "-n", "4", f"--junitxml={tmp / 'pytest.xml'}", str(ROOT / "tests")]})
    for i, cmd in enumerate(extra or []):  # e.g. diagnostics that need the GPU but not a quiet one
        out.append({"name": f"extra {i}", "timeout": 600, "cmd": ["bash", "-c", cmd]})
    for st in stages(False, warm):
        if st["name"] == "doctor" or (only and st["name"] not in only):
            continue
        cmd = [c for c in st["cmd"]]
        for flag, value in (("--budget-ms", "1"), ("--warmup", "1"), ("--max-reps", "1"),
                            ("--rounds", "1"), ("--steps", "1")):
            if flag in cmd:
                cmd[cmd.index(flag) + 1] = value
        out.append({"name": f"prewarm {st['name']}", "timeout": 300, "cmd": cmd})
    for case in CASES:
        out.append({"name": f"prewarm doctor {case.name}", "timeout": 240,
                    "cmd": [py, "-m", "hf_posenc", "doctor", "--cases", case.name, "--no-timing", "--no-progress",
                            "--out", str(warm / f"doctor_{case.name}.json")]})
    return out


def run_parallel(sts: list[dict], env: dict, workers: int, deadline: float | None = None) -> list[dict]:
    """Run stages in ``workers`` parallel processes; their records in the order given."""
    from concurrent.futures import ThreadPoolExecutor

    def one(st):
        rec = run_stage(st, env, deadline)
        print(f"[gpu-check] {st['name']}: {rec['status']} in {rec['seconds']} s", flush=True)
        return rec

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(one, sts))


def doctor_groups() -> list[list[str]]:
    """The doctor's cases in the processes of the doctor stage: the attention terms together (one kernel, many
    terms), every other kernel's cases on their own (CoPE's unwindowed and windowed apart)."""
    from hf_posenc.diagnostics import CASES

    groups: dict[str, list[str]] = {}
    for case in CASES:
        key = case.family if case.family in ("attention", "sba", "rotary", "remap") else case.name
        groups.setdefault(key, []).append(case.name)
    return list(groups.values())


def run_doctor_per_family(st: dict, env: dict, deadline: float | None = None) -> dict:
    """The doctor stage on CUDA: one process per group of cases (`doctor_groups`), run one after the
    other (so the timings are not shared), their reports merged (``hf_posenc.diagnostics.merge_reports``). A
    kernel that breaks the CUDA context (an illegal memory access) makes every later check of its process fail;
    here it costs only its own group."""
    from hf_posenc.diagnostics import merge_reports

    t0 = time.time()
    report = Path(st["report"])
    reports, outputs, statuses = [], [], []
    groups = doctor_groups()
    for names in groups:
        part = report.with_name(f"doctor_{names[0]}.json")
        cmd = [a if a != str(report) else str(part) for a in st["cmd"]] + ["--cases", ",".join(names)]
        end = t0 + st["timeout"] if deadline is None else min(deadline, t0 + st["timeout"])
        rec = run_stage(dict(st, name=f"doctor {names[0]}", cmd=cmd, report=part), env, end)
        outputs.append(f"## doctor --cases {','.join(names)}: {rec['status']} in {rec['seconds']} s\n"
                       f"{rec.get('output', '')}")
        statuses.append(rec["status"])
        print(f"[gpu-check]   doctor {','.join(names)}: {rec['status']} in {rec['seconds']} s", flush=True)
        if part.exists():
            try:
                reports.append(json.loads(part.read_text()))
            except json.JSONDecodeError:
                pass
    if reports:
        merged = merge_reports(reports)
        if len(reports) < len(groups):
            merged["complete"] = False
        report.write_text(json.dumps(merged, indent=1, default=str) + "\n")
    bad = [f"{','.join(n)}: {st_}" for n, st_ in zip(groups, statuses) if st_ not in ("ok", "exit 1")]
    out = "\n".join(outputs)
    return {"name": st["name"], "status": "ok" if all(x == "ok" for x in statuses) else
            ("exit 1" if not bad else "; ".join(bad)), "seconds": round(time.time() - t0, 1),
            "command": " ".join(st["cmd"]) + " (one process per case)", "output_tail": out[-4000:], "output": out,
            "checks": len(merged["rows"]) if reports else None}


def run_stage(st: dict, env: dict, deadline: float | None = None) -> dict:
    """Run one stage; its status, seconds, the tail of its output and its rows. ``deadline`` (a time.time()):
    the stage's time limit is cut so that it ends by then."""
    t0 = time.time()
    limit = st["timeout"] if deadline is None else max(5.0, min(st["timeout"], deadline - t0))
    st = dict(st, timeout=round(limit))
    try:
        proc = subprocess.run(st["cmd"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=st["timeout"])
        status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
        out = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        status = f"timed out after {st['timeout']} s"
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
    rec = {"name": st["name"], "status": status, "seconds": round(time.time() - t0, 1), "command": " ".join(st["cmd"]),
           "output_tail": out[-4000:], "output": out}
    if st.get("rows") and Path(st["rows"]).exists():
        rec["rows"] = [json.loads(line) for line in Path(st["rows"]).read_text().splitlines() if line.strip()]
    if st.get("report") and Path(st["report"]).exists():  # the doctor's checks stay in its report
        try:
            rec["checks"] = len(json.loads(Path(st["report"]).read_text())["rows"])
        except (json.JSONDecodeError, KeyError):
            rec["checks"] = None
    if st.get("json") and Path(st["json"]).exists():
        rec["rows"] = json.loads(Path(st["json"]).read_text())["results"]
    return rec


def pytest_counts(path: Path, output: str = "") -> dict | None:
    """passed / failed / errors / skipped from pytest's junit report, or, when pytest was stopped before
    writing it (the stage's time limit), from the ``-v`` lines it had printed (``partial``: True)."""
    if not path.exists():
        if not output:
            return None
        words = (re.findall(r"::\S+ (PASSED|FAILED|ERROR|SKIPPED)", output)
                 + re.findall(r"\] (PASSED|FAILED|ERROR|SKIPPED) \S+::", output))  # pytest-xdist's -v lines
        counts = {w: words.count(w) for w in ("PASSED", "FAILED", "ERROR", "SKIPPED")}
        return {"tests": sum(counts.values()), "failures": counts["FAILED"], "errors": counts["ERROR"],
                "skipped": counts["SKIPPED"], "passed": counts["PASSED"], "partial": True}
    suites = ET.parse(path).getroot()
    suites = [suites] if suites.tag == "testsuite" else list(suites)
    total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    total["passed"] = total["tests"] - total["failures"] - total["errors"] - total["skipped"]
    return total


def _r(a, b):
    return None if not a or not b else a / b


def summary(result: dict) -> list[str]:
    """The markdown summary: the doctor's report, stage status, the kernels' ratios against their targets,
    end-to-end tokens/s. ``result``: the doctor's report with ``benchmarks`` (see `main`)."""
    from hf_posenc.diagnostics import format_report

    bench = result["benchmarks"]
    lines = [f"# gpu-check on {result['device']['name']}", "",
             f"versions: `{json.dumps(result['versions'])}`, git commit `{bench.get('git_commit')}`", "",
             "## hf-posenc doctor", "", "```", format_report(result) if result.get("rows") is not None
             else "(no report)", "```", "",
             "| stage | status | seconds | rows |", "|---|---|---|---|"]
    for st in bench["stages"]:
        rows = len(result.get("rows") or []) if st["name"] == "doctor" else len(st.get("rows", []))
        lines.append(f"| {st['name']} | {st['status']} | {st['seconds']} | {rows} |")
    if bench.get("pytest"):
        p = bench["pytest"]
        lines += ["", f"pytest -m gpu: {p['passed']} passed, {p['failures']} failed, {p['errors']} errors, "
                      f"{p['skipped']} skipped{' (partial: the stage ran out of time)' if p.get('partial') else ''}"]
    stages = {st["name"]: st for st in bench["stages"]}
    lines += ["", "## kernels, forward+backward: time / SDPA flash (target) and / FlexAttention",
              "", "| kernel | B | L | triton ms | sdpa ms | triton/sdpa | target | met | flex ms | triton/flex "
                  "| eager/triton | peak MB |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = [dict(r, kernel=r["term"]) for r in stages.get("attention", {}).get("rows", [])]
    rows += [dict(r, kernel=r["kind"]) for r in stages.get("sba_cope", {}).get("rows", [])]
    for r in rows:
        if r.get("mode") != "fwd+bwd":
            continue
        ratio = _r(r.get("triton_ms"), r.get("sdpa_ms"))
        target = TARGETS.get(r["kernel"])
        met = "-" if ratio is None or target is None else ("yes" if ratio <= target else "NO")
        flex = _r(r.get("triton_ms"), r.get("flex_ms"))
        fmt = lambda v, d=3: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
        lines.append(f"| {r['kernel']} | {r.get('batch')} | {r.get('length')} | {fmt(r.get('triton_ms'))} | "
                     f"{fmt(r.get('sdpa_ms'))} | {fmt(ratio)} | {target or '-'} | {met} | {fmt(r.get('flex_ms'))} | "
                     f"{fmt(flex)}{' SLOWER' if flex and flex > 1 else ''} | "
                     f"{fmt(_r(r.get('eager_ms'), r.get('triton_ms')), 1)} | "
                     f"{fmt(r.get('triton_mb'), 0)} |")
    rot = stages.get("rotary", {}).get("rows", [])
    if rot:
        lines += ["", "## rotary kernel: % of SDPA attention time (target <= 5%)", "",
                  "| s | B | L | mode | triton ms | % of attention |", "|---|---|---|---|---|---|"]
        for r in rot:
            pct = r.get("rotation_pct_of_attention")
            lines.append(f"| {r.get('s')} | {r.get('B')} | {r.get('L')} | {r.get('mode')} | {r.get('triton_ms')} | "
                         f"{'-' if pct is None else f'{pct:.1f}'} |")
    train = stages.get("train_step", {}).get("rows", [])
    if train:
        lines += ["", f"## end to end: training step tokens/s (target >= {TRAIN_TARGET} of unpatched)", "",
                  "| encoding | backend | tokens/s | vs unpatched | met | peak MB |", "|---|---|---|---|---|---|"]
        for r in train:
            ratio = r.get("ratio_vs_unpatched")
            met = "-" if ratio is None or r["encoding"] == "unpatched" else ("yes" if ratio >= TRAIN_TARGET else "NO")
            lines.append(f"| {r['encoding']} | {r.get('backend') or '-'} | {r['tokens_per_s']:.0f} | "
                         f"{'-' if ratio is None else f'{ratio:.3f}'} | {met} | {r.get('peak_mb') or '-'} |")
    return lines


def doctor_report(path: Path, device) -> dict:
    """The doctor's report from ``path`` (possibly partial: ``complete`` false), or, when the doctor wrote
    nothing, a report without rows (``ok`` false) built here, so that the file keeps the one format."""
    if path.exists():
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError:
            pass
    from hf_posenc.diagnostics import SCHEMA, default_backends, environment

    return {"schema": SCHEMA, "ok": False, "complete": False, **environment(device), "settings": {}, "rows": [],
            "summary": {}, "defaults": default_backends(device), "seconds": None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="CPU: tiny shapes, interpreted kernels; nothing is written")
    p.add_argument("--pytest", action="store_true", help="also run `pytest -m gpu tests/` (about 200 s more)")
    p.add_argument("--only", nargs="+", default=None, help="run only these stages (by name)")
    p.add_argument("--out-dir", default=str(BENCH / "results"))
    p.add_argument("--no-prewarm", action="store_true",
                   help="CUDA: skip the parallel warm-up that compiles every kernel before the timed stages")
    p.add_argument("--workers", type=int, default=min(12, os.cpu_count() or 1),
                   help="parallel processes of the warm-up phase")
    p.add_argument("--log-dir", default=None, help="write each stage's whole output to a file here")
    p.add_argument("--prewarm-extra", nargs="+", default=None, metavar="CMD",
                   help="shell commands run in the warm-up's pool too (logged as 'extra N')")
    p.add_argument("--deadline", type=float, default=None,
                   help="seconds for the whole run: the stages' time limits are cut to end within it (the warm-up "
                        "gets at most 45 %% of it), so that the results are written")
    args = p.parse_args(argv)
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print("gpu_check.py needs a CUDA GPU (torch.cuda.is_available() is False); `--smoke` runs every stage "
              "with tiny shapes on the CPU.", file=sys.stderr)
        return 2
    from _common import device_name, slug, versions

    device = torch.device("cuda" if cuda else "cpu")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    if cuda:
        env.pop("TRITON_INTERPRET", None)
        env.pop("HF_POSENC_BACKEND", None)  # the defaults are what is measured
    git = versions()
    bench = {"git_commit": git.get("git_commit"), "git_dirty": git.get("git_dirty"), "stages": []}
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        tmp = Path(tmp)
        logs = Path(args.log_dir) if args.log_dir else None
        if logs:
            logs.mkdir(parents=True, exist_ok=True)
        prewarm = cuda and not args.smoke and not args.no_prewarm
        if prewarm:
            t1 = time.time()
            warm = prewarm_stages(tmp, args.pytest, args.only, args.prewarm_extra)
            print(f"[gpu-check] warm-up: {len(warm)} processes, {args.workers} at a time", flush=True)
            warm_deadline = None if args.deadline is None else t0 + 0.45 * args.deadline
            for rec in run_parallel(warm, env, args.workers, warm_deadline):
                if logs:
                    (logs / (re.sub(r"[^A-Za-z0-9_.-]+", "_", rec["name"]) + ".log")).write_text(rec.get("output", ""))
                if rec["name"] == "pytest -m gpu":
                    bench["stages"].append(rec)
                else:
                    bench.setdefault("prewarm", []).append(
                        {k: rec[k] for k in ("name", "status", "seconds")})
            bench["prewarm_seconds"] = round(time.time() - t1, 1)
        for st in stages(args.smoke, tmp, args.pytest and not prewarm):
            if args.only and st["name"] not in args.only:
                continue
            print(f"[gpu-check] {st['name']} (limit {st['timeout']} s) ...", flush=True)
            end = None if args.deadline is None else t0 + args.deadline - 10
            rec = run_doctor_per_family(st, env, end) if st.get("per_family") else run_stage(st, env, end)
            count = f"{rec['checks']} checks" if "checks" in rec else f"{len(rec.get('rows', []))} rows"
            print(f"[gpu-check] {st['name']}: {rec['status']} in {rec['seconds']} s, {count}", flush=True)
            if rec["status"] != "ok":
                print(rec["output_tail"][-1500:], flush=True)
            if logs:
                (logs / (re.sub(r"[^A-Za-z0-9_.-]+", "_", rec["name"]) + ".log")).write_text(rec.get("output", ""))
            bench["stages"].append(rec)
        tests = [st for st in bench["stages"] if st["name"] == "pytest -m gpu"]
        bench["pytest"] = pytest_counts(tmp / "pytest.xml", tests[0]["output"] if tests else "")
        for st in bench["stages"]:
            st.pop("output", None)
        result = doctor_report(tmp / "doctor.json", device)
    bench["seconds"] = round(time.time() - t0, 1)
    result["benchmarks"] = bench
    text = "\n".join(summary(result))
    print("\n" + text)
    if not args.smoke:
        out = Path(args.out_dir) / f"gpu_check_{slug(device_name(device))}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1, default=str) + "\n")
        out.with_suffix(".md").write_text(text + "\n")
        print(f"\nwrote {out} and {out.with_suffix('.md')} ({bench['seconds']} s)")
    ran_doctor = any(st["name"] == "doctor" for st in bench["stages"])
    crashed = [st["name"] for st in bench["stages"] if st["status"].startswith("exit") and st["name"] != "doctor"]
    doctor_failed = ran_doctor and not result.get("ok")
    tests_failed = bench["pytest"] is not None and (bench["pytest"]["failures"] or bench["pytest"]["errors"])
    return 1 if crashed or doctor_failed or tests_failed else 0


if __name__ == "__main__":
    sys.exit(main())
