"""The CoPE paper's three tasks on their splits, with several seeds: run the studies, or collect them, into one JSON.

    python benchmarks/study_cope_tasks.py --run OUT_DIR              # the three studies (long: see README)
    python benchmarks/study_cope_tasks.py --collect OUT_DIR          # only combine OUT_DIR/<task>/results.json

Each task is an ordinary ``hf-posenc study`` (``--task flip-flop``, ``selective-copy``, ``counting``), in
``OUT_DIR/<task>``, with the settings below (training length and steps per task: counting needs 44 tokens for
its four episodes). The combined file (default ``benchmarks/results/study_cope_tasks.json``) keeps every run of
every study (all but the per-step training losses, which stay in each study's own results.json), and the script prints one markdown table: per encoding and split, the accuracy at the training
length and at 2x, as ``mean (min-max)`` over the seeds.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hf_posenc.study import StudyConfig, run_study
from hf_posenc.study.report import group_runs, split_evals, split_names, spread

ENCODINGS = ["nope", "rope", "alibi", "fire", "fox", "sba", "cope"]
#: task: (training length, steps): the settings of the stored results (benchmarks/results/study_cope_tasks.json,
#: docs/study-results.md), 800 steps for every task.
TASKS = {"flip-flop": (32, 800), "selective-copy": (32, 800), "counting": (48, 800)}
SETTINGS = {"encodings": ENCODINGS, "seeds": [0, 1, 2], "jobs": 2, "hidden": 128, "layers": 2, "factors": [1, 2],
            "progress": False}


def _cell(values: list[float]) -> str:
    mean, lo, hi = spread(values)
    if mean is None:
        return "n/a"
    return f"{100 * mean:.1f} ({100 * lo:.1f}-{100 * hi:.1f})"


def summary_table(studies: dict[str, dict]) -> str:
    """One markdown table per task: a row per encoding; per split, accuracy (%) at 1x and 2x the training
    length, ``mean (min-max)`` over the seeds."""
    blocks = []
    for task, res in studies.items():
        columns = [(split, j, f"{split} {n}") for split in split_names(res)
                   for j, n in enumerate(res["study"]["eval_lengths"])]
        s = res["settings"]
        title = (f"**{task}** (trained at {res['study']['train_length']} tokens, {s['steps']} steps, seeds "
                 f"{', '.join(map(str, s['seeds']))}; {res['wall_seconds'] / 60:.0f} min wall)")
        lines = [title, "",
                 "| encoding | " + " | ".join(c[2] for c in columns) + " |", "|---|" + "---:|" * len(columns)]
        for enc, runs in group_runs(res):
            ok = [r for r in runs if r["status"] == "ok"]
            cells = [_cell([split_evals(r, split)[j]["metric"] for r in ok]) if ok else "-" for split, j, _ in columns]
            lines.append(f"| `{enc}` | " + " | ".join(cells) + " |")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--run", metavar="DIR", help="run the three studies into DIR/<task>, then combine")
    g.add_argument("--collect", metavar="DIR", help="combine DIR/<task>/results.json (from earlier runs)")
    p.add_argument("--json", default="benchmarks/results/study_cope_tasks.json", help="combined output file")
    p.add_argument("--device-note", default="", help="words about the machine for the JSON (e.g. its load)")
    args = p.parse_args(argv)
    root = Path(args.run or args.collect)
    studies: dict[str, dict] = {}
    for task, (length, steps) in TASKS.items():
        if args.run:
            run_study(StudyConfig(task=task, train_len=length, steps=steps, out=str(root / task), **SETTINGS))
        path = root / task / "results.json"
        if not path.exists():
            print(f"study_cope_tasks: {path} is missing; run it first (--run)", file=sys.stderr)
            continue
        res = json.loads(path.read_text())
        for r in res["results"]:  # per-step losses stay in the study's own results.json (first, last kept)
            r.get("train", {}).pop("losses", None)
        studies[task] = res
    if not studies:
        return 2
    table = summary_table(studies)
    out = {
        "what": "the CoPE paper's three tasks on their splits (hf-posenc study), every run of every study",
        "device_note": args.device_note,
        "table": table,
        "wall_seconds": {task: res["wall_seconds"] for task, res in studies.items()},
        "complete": {task: res["complete"] for task, res in studies.items()},
        "studies": studies,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(table)
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
