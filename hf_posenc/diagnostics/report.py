"""The doctor's report as text."""

from __future__ import annotations

__all__ = ["format_report"]

# -- text ------------------------------------------------------------------------------------------------


def _fmt(x: float | None, spec: str) -> str:
    """``x`` formatted with ``spec`` (e.g. ``"9.2e"``), or a dash of the same width for None."""
    width = int(spec.split(".")[0] or 0)
    return "-".rjust(width) if x is None else format(x, spec)


def format_report(report: dict) -> str:
    """The report as text: versions and device, one line per row run, skipped engines, default backends."""
    v, dev = report["versions"], report["device"]
    lines = ["hf-posenc doctor", ""]
    lines.append("versions: " + ", ".join(f"{k} {v[k] or '-'}" for k in v))
    cap = f", compute capability {dev['capability']}, {dev['sm_count']} SMs, {dev['memory_gib']} GiB" \
        if dev["type"] == "cuda" else f", {dev.get('threads')} threads"
    lines.append(f"device: {dev['type']} ({dev['name']}{cap})")
    env = {k: val for k, val in report["environment"].items() if val is not None}
    lines.append("environment: " + (", ".join(f"{k}={val}" for k, val in env.items()) or "-")
                 + f"; Triton interpreter: {'on' if report['triton_interpreter'] else 'off'}")
    lines += ["", "checks: relative error of the output and of every gradient against the float64 reference (max err); "
                  "median ms", "of forward+backward, alternating with SDPA (causal, no bias) on the same shape:", ""]
    header = f"{'case':14s} {'engine':7s} {'dtype':9s} {'L':>4s} {'max err':>9s} {'tol':>7s} {'status':6s} " \
             f"{'ms':>8s} {'sdpa ms':>8s} {'x sdpa':>7s}  note"
    lines += [header, "-" * len(header)]
    skipped: dict[tuple[str, str], list[str]] = {}
    for r in report["rows"]:
        if r["status"] == "skip":
            skipped.setdefault((r["engine"], r["note"]), []).append(f"{r['case']} {r['dtype']}")
            continue
        status = r["status"].upper() if r["status"] != "pass" else "pass"
        worst = ""
        if r["status"] == "fail" and r["errors"]:
            bad = [k for k, e in r["errors"].items() if e is None or e > r["tolerance"]]
            worst = "over tolerance: " + ", ".join(bad)
        note = r["note"] or ""
        if note.startswith("forward only") and r["engine"] == "flex":
            note = f"forward only (FlexAttention has no backward on {report['device']['type']})"
        note = "; ".join(x for x in (worst, note) if x)
        lines.append(f"{r['case']:14s} {r['engine']:7s} {r['dtype']:9s} {r['shape']['L']:>4d} "
                     f"{_fmt(r['max_error'], '9.2e')} {r['tolerance']:7.0e} {status:6s} {_fmt(r['engine_ms'], '8.2f')} "
                     f"{_fmt(r['sdpa_ms'], '8.2f')} {_fmt(r['ratio_vs_sdpa'], '7.2f')}  {note}")
    for (engine, why), which in skipped.items():
        lines.append(f"skipped {engine} ({len(which)} checks): {why}")
    lines += ["", f"default backends on {report['device']['type']} (HF_POSENC_BACKEND="
                  f"{report['environment'].get('HF_POSENC_BACKEND') or 'unset'}):", ""]
    for d in report["defaults"]:
        rot = f", rotation {d['rotation']}" if d["rotation"] else ""
        lines.append(f"{d['encoding']:11s} {d['attention']}{rot}: {d['why']}")
    s = report["summary"]
    verdict = "OK" if report["ok"] else ("FAILED" if report["ok"] is False else "INCOMPLETE")
    lines += ["", f"{verdict}: {s.get('pass', 0)} passed ({s.get('forward_only', 0)} forward only), "
                  f"{s.get('fail', 0)} failed, {s.get('error', 0)} errors, {s.get('skip', 0)} skipped "
                  f"in {report['seconds']} s"]
    if not report["ok"]:
        lines.append("Please attach the JSON report (hf-posenc doctor --out report.json) to a bug report.")
    return "\n".join(lines)
