"""The doctor's run: ``doctor`` (the rows in order, the report written as they come) and ``merge_reports``."""

from __future__ import annotations

import copy
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from .cases import QUICK_CASES, SHAPE, SHAPE_INTERPRETED, TILES, Case, case_seed, cases as all_cases
from .explain import default_backends
from .probe import _interpreting, environment
from .report import format_report
from .rows import TOLERANCE, check_row

__all__ = ["ENGINES", "REPORT_NAME", "SCHEMA", "doctor", "merge_reports", "report_path"]

#: the report's schema id (bumped when a field changes meaning or disappears).
SCHEMA = "hf_posenc.doctor/1"
#: engines in the order they run (the most important first: a run cut short keeps those rows).
ENGINES = ("triton", "tiled", "flex")
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "float32": "float32",
                  "bfloat16": "bfloat16", "float16": "float16"}

# -- the run ---------------------------------------------------------------------------------------------


def _parse_list(value: str | Sequence[str] | None, allowed: Sequence[str], what: str) -> list[str] | None:
    if value is None:
        return None
    items = [x.strip() for x in (value.split(",") if isinstance(value, str) else value) if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise ValueError(f"unknown {what} {bad or items!r}; allowed: {', '.join(allowed)}")
    return items


def _dtype_names(dtypes: str | Sequence[str] | None, device: torch.device, quick: bool) -> list[str]:
    if dtypes is None:
        if device.type != "cuda":
            return ["float32"]
        return ["bfloat16"] if quick else ["float32", "bfloat16"]
    items = [x.strip() for x in (dtypes.split(",") if isinstance(dtypes, str) else dtypes) if x.strip()]
    bad = [x for x in items if x not in _DTYPE_ALIASES]
    if bad or not items:
        raise ValueError(f"unknown dtypes {bad or items!r}; allowed: {', '.join(_DTYPE_ALIASES)}")
    return list(dict.fromkeys(_DTYPE_ALIASES[x] for x in items))


def _plan(cases: list[Case], engines: list[str], dtypes: list[str]) -> list[tuple[Case, str, str]]:
    return [(case, engine, dtype) for engine in ENGINES if engine in engines for case in cases
            if engine in case.engines for dtype in dtypes]


def _summary(rows: list[dict]) -> dict[str, int]:
    counts = {status: sum(r["status"] == status for r in rows) for status in ("pass", "fail", "error", "skip")}
    counts["forward_only"] = sum(r["status"] == "pass" and r["timed"] != "fwd+bwd" and "dq" not in r["checked"]
                                 for r in rows)
    counts["rows"] = len(rows)
    return counts


class _Progress:
    """tqdm on stderr when asked for, else nothing."""

    def __init__(self, total: int, enabled: bool) -> None:
        self._bar = None
        if enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc="hf-posenc doctor", unit="check", file=sys.stderr, leave=False,
                             dynamic_ncols=True)

    def step(self, label: str) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(label, refresh=False)
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def doctor(
    *,
    device: str | torch.device | None = None,
    dtypes: str | Sequence[str] | None = None,
    engines: str | Sequence[str] | None = None,
    cases: str | Sequence[str] | None = None,
    quick: bool = False,
    timing: bool = True,
    out: str | os.PathLike | None = None,
    progress: bool = False,
    verbose: bool = True,
    seed: int = 0,
) -> dict[str, Any]:
    """Check every engine available here against the reference; return the report (and write it to ``out``).

    Args:
        device: where to run (default: ``cuda`` when available, else ``cpu``).
        dtypes: input dtypes (``float32``/``fp32``, ``bfloat16``/``bf16``, ``float16``/``fp16``; a list or a
            comma-separated string). Default: float32 and bfloat16 on CUDA (bfloat16 with ``quick``), float32
            on the CPU.
        engines: a subset of ``ENGINES`` (default: all).
        cases: a subset of the case names (``hf_posenc.diagnostics.cases()``: one per registered attention term,
            then the other kernels'; default: all, or ``QUICK_CASES`` with ``quick``).
        quick: fewer cases (one per family) and, on CUDA, one dtype.
        timing: time each row's engine against SDPA (rows run in Triton's interpreter are never timed).
        out: a file, or a directory (the file is then ``hf-posenc-doctor.json`` in it, see `report_path`);
            the JSON report is written there after every row (a run cut short leaves the rows done, with
            ``complete: false``).
        progress: show a progress bar (tqdm, on stderr).
        verbose: print the report as a text summary when done (stdout).
        seed: seed of the random inputs.

    Returns:
        the report (see docs/doctor.md): ``schema``, ``ok``, ``complete``, ``versions``, ``device``,
        ``environment``, ``settings``, ``rows``, ``summary``, ``defaults``, ``seconds``.

    Raises:
        ValueError: an unknown device, dtype, engine or case.
    """
    t0 = time.time()
    if out is not None:
        out = report_path(out)  # a bad path fails now, not after the checks
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device} was asked for, but torch.cuda.is_available() is False")
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"the doctor runs on cuda or cpu, got {device}")
    engine_list = _parse_list(engines, ENGINES, "engines") or list(ENGINES)
    every = all_cases()  # from the term registry, now
    names = [c.name for c in every]
    case_names = _parse_list(cases, names, "cases") or (list(QUICK_CASES) if quick else names)
    case_list = [c for c in every if c.name in case_names]
    dtype_list = _dtype_names(dtypes, device, quick)
    interpreted = device.type != "cuda" and _interpreting()
    env = environment(device)
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "ok": None,
        "complete": False,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **env,
        "settings": {"device": str(device), "dtypes": dtype_list, "engines": engine_list, "cases": case_names,
                     "shape": _shape_dict(SHAPE), "shape_interpreted": _shape_dict(SHAPE_INTERPRETED),
                     "tiles": list(TILES), "tolerance": dict(TOLERANCE), "timing": timing, "seed": seed,
                     "reference": "float64, the package's full-matrix references, on the same rounded inputs"},
        "rows": [],
        "summary": {},
        "defaults": default_backends(device),
        "seconds": None,
    }
    plan = _plan(case_list, engine_list, dtype_list)
    bar = _Progress(len(plan), progress)
    tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # float32 means float32
    # FlexAttention compiles once per term kind, dtype and window on CUDA: more than dynamo's default limit of
    # recompilations (past it, flex would run uncompiled and be timed so)
    dynamo = torch._dynamo.config
    limit_name = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"
    limit = getattr(dynamo, limit_name)
    setattr(dynamo, limit_name, max(limit, 8 * len(plan)))
    try:
        for case, engine, dtype in plan:
            shape = SHAPE_INTERPRETED if (engine == "triton" and interpreted) else SHAPE
            # the same inputs for every engine of a case and dtype, whatever else was selected
            row = check_row(case, engine, dtype, shape, device, case_seed(seed, case, dtype), timing,
                             engine == "triton" and interpreted)
            report["rows"].append(row)
            report["summary"] = _summary(report["rows"])
            report["seconds"] = round(time.time() - t0, 1)
            bar.step(f"{case.name} {engine} {dtype}: {row['status']}")
            if out is not None:
                _write(report, out)
    finally:
        bar.close()
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
        setattr(dynamo, limit_name, limit)
    report["summary"] = _summary(report["rows"])
    report["ok"] = report["summary"]["fail"] == 0 and report["summary"]["error"] == 0
    report["complete"] = True
    report["seconds"] = round(time.time() - t0, 1)
    if out is not None:
        _write(report, out)
    if verbose:
        print(format_report(report))
    return report


def merge_reports(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One report from the reports of separate runs (e.g. one process per case, so that a kernel that corrupts
    the CUDA context -- an illegal memory access -- costs only its own case's rows): the rows concatenated, the
    summary recomputed, ``ok`` and ``complete`` only if every part was, ``settings['cases']`` joined."""
    if not reports:
        raise ValueError("merge_reports needs at least one report")
    merged = copy.deepcopy(reports[0])
    merged["rows"] = [row for r in reports for row in r.get("rows", [])]
    merged["settings"]["cases"] = [c for r in reports for c in r.get("settings", {}).get("cases", [])]
    merged["summary"] = _summary(merged["rows"])
    merged["complete"] = all(r.get("complete") for r in reports)
    merged["ok"] = bool(all(r.get("ok") for r in reports) and merged["summary"]["fail"] == 0
                        and merged["summary"]["error"] == 0)
    merged["seconds"] = round(sum(r.get("seconds") or 0.0 for r in reports), 1)
    return merged


def _shape_dict(shape) -> dict[str, int]:
    return dict(zip(("B", "H", "Hkv", "L", "D"), shape))


#: The report's file name when ``--out`` (``out=``) names a directory.
REPORT_NAME = "hf-posenc-doctor.json"


def report_path(out: str | os.PathLike) -> Path:
    """Where the report given as ``out`` goes: ``out`` itself for a file, ``out/hf-posenc-doctor.json`` for a
    directory (one that exists, or a path written with a trailing slash).

    Raises:
        ValueError: ``out`` is empty, or a parent of the file is an existing file.
    """
    text = os.fspath(out)
    if not text:
        raise ValueError("--out is empty; give a file (report.json) or a directory")
    path = Path(text)
    if path.is_dir() or text.endswith(("/", os.sep)):
        path = path / REPORT_NAME
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"--out {text}: {parent} is a file, not a directory")
            break
    return path


def _write(report: dict, out: str | os.PathLike) -> None:
    path = report_path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, allow_nan=False) + "\n")
    tmp.replace(path)
