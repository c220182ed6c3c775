"""Outputs of ``hf-posenc study``: a markdown table, ``results.json`` and a PNG plot.

:func:`write_results` writes ``results.json`` and ``table.md`` (the study calls it after every model, so
an interrupted study keeps what it finished), :func:`write_plot` then ``study.png``; into the output folder:

* ``results.json``: every number (per-step training losses, every metric at every length) and the exact
  settings, versions, machine, seed and device;
* ``table.md``: the markdown table that the command also prints;
* ``study.png``: the metric against evaluation length, one line per encoding (matplotlib, Agg backend).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

__all__ = ["column_labels", "markdown_table", "plot", "write_json", "write_outputs", "write_plot", "write_results"]

LEARNED_MARK = "†"


def column_labels(results: dict[str, Any]) -> list[str]:
    """Column headers: ``64 (1x)`` for tokens, ``24 px (2.25x)`` for ViT sides (factor in patches)."""
    s = results["study"]
    out = []
    for n, f in zip(s["eval_lengths"], s["eval_factors"]):
        ftxt = f"{f:.3g}x"
        out.append(f"{n} px ({ftxt})" if s["length_unit"].startswith("image") else f"{n} ({ftxt})")
    return out


def _cell(value: float | None, task: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "inf"
    if task == "text":
        return f"{value:.2f}" if value < 1e4 else f"{value:.2e}"
    return f"{100 * value:.1f}"


def markdown_table(results: dict[str, Any]) -> str:
    """The study as a markdown table: one row per encoding, one column per evaluation length.

    The best value of each column is bold. Rows for encodings that do not support the family read
    ``n/a``, rows that failed ``error``; footnotes say what the numbers are.
    """
    s = results["study"]
    task = s["task"]
    labels = column_labels(results)
    lines = ["| encoding | " + " | ".join(labels) + " |", "|---|" + "---:|" * len(labels)]
    ok = [r for r in results["results"] if r["status"] == "ok"]
    best: list[float | None] = []
    for j in range(len(labels)):
        vals = [r["eval"][j]["metric"] for r in ok if r["eval"][j]["metric"] is not None]
        best.append((max(vals) if s["higher_is_better"] else min(vals)) if vals else None)
    notes: list[str] = []
    for r in results["results"]:
        name = f"`{r['encoding']}`"
        if r["status"] != "ok":
            word = "n/a" if r["status"] == "not_applicable" else "error"
            lines.append(f"| {name} | " + " | ".join([word] * len(labels)) + " |")
            notes.append(f"`{r['encoding']}`: {word}: {r['reason']}")
            continue
        cells = []
        for j, e in enumerate(r["eval"]):
            text = _cell(e["metric"], task)
            if e["metric"] is not None and best[j] is not None and e["metric"] == best[j]:
                text = f"**{text}**"
            if r["name"] == "learned" and s["length_unit"] == "tokens" and e["length"] > s["train_length"]:
                text += LEARNED_MARK
            cells.append(text)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if task == "text":
        what = (f"validation perplexity per byte (lower is better) over the same {results['data']['eval_bytes_per_length']} "
                f"bytes at every length; trained on {s['train_length']}-byte windows")
    elif task == "digits":
        what = (f"test accuracy, % (higher is better) on {results['data']['test_images']} digit images upscaled to "
                f"each side; trained at {s['train_length']} px (patch {results['data']['patch_size']}; the factor "
                "counts patches)")
    else:
        what = (f"{task}: answer-token accuracy, % (higher is better), teacher-forced, "
                f"{results['data']['eval_sequences_per_length']} sequences per length; trained on length "
                f"{s['train_length']}")
    settings = results["settings"]
    footer = [
        "",
        (
            f"{s['family']}, {settings['layers']} layers, hidden {settings['hidden']}, {settings['heads']} heads, "
            f"{settings['steps']} steps x batch {settings['batch']}, seed {settings['seed']}, "
            f"device {settings['device_resolved']}. Metric: {what}."
        ),
    ]
    if any(r["name"] == "learned" and r["status"] == "ok" for r in results["results"]) and s["length_unit"] == "tokens":
        footer.append(
            f"{LEARNED_MARK} `learned` has a table long enough for the longest length, but its rows past the "
            "training length were never trained (initial values): an absolute table has no way to extrapolate."
        )
    footer += notes
    return "\n".join(lines + footer)


def _clean(x: Any) -> Any:
    """JSON-safe: non-finite floats become ``null``."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def write_json(results: dict[str, Any], path: str | os.PathLike) -> None:
    """``results`` as indented JSON (strict: non-finite numbers are written as ``null``)."""
    with open(path, "w") as f:
        json.dump(_clean(results), f, indent=2, allow_nan=False)
        f.write("\n")


def plot(results: dict[str, Any], path: str | os.PathLike) -> None:
    """Metric against evaluation length, one line per encoding (log-2 x axis; log y for perplexity); a PNG."""
    # The object-oriented API with the Agg canvas: no pyplot, so no global backend switch for the caller.
    import matplotlib
    import matplotlib.ticker
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    s = results["study"]
    text = s["task"] == "text"
    fig = Figure(figsize=(8, 5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    colors = matplotlib.colormaps["tab10"]
    x = s["eval_lengths"]
    markers = "os^vDP*Xph"
    for i, r in enumerate(r for r in results["results"] if r["status"] == "ok"):
        ys = [e["metric"] if e["metric"] is not None else float("nan") for e in r["eval"]]
        if not text:
            ys = [100 * y for y in ys]
        # Ten colours, then the same colours dashed; markers cycle independently. Text `learned` is dashed:
        # past the training length it runs on untrained rows.
        dashed = (r["name"] == "learned" and s["length_unit"] == "tokens") or i >= 10
        style = "--" if dashed else "-"
        ax.plot(x, ys, style, marker=markers[i % len(markers)], label=r["encoding"], color=colors(i % 10),
                linewidth=1.6, markersize=5)
    ax.set_xscale("log", base=2)
    ax.set_xticks(x)
    ax.set_xticklabels(column_labels(results), fontsize=8)
    ax.axvline(s["train_length"], color="grey", linestyle=":", linewidth=1)
    if text:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.yaxis.set_minor_formatter(matplotlib.ticker.ScalarFormatter())
        ax.tick_params(axis="y", which="minor", labelsize=7)
        ax.set_ylabel("validation perplexity per byte (lower is better)")
    else:
        ax.set_ylabel("accuracy, % (higher is better)")
    unit = "image side, px (x patches)" if s["length_unit"].startswith("image") else "evaluation length, tokens"
    ax.set_xlabel(f"{unit}; dotted: training length")
    settings = results["settings"]
    trained = f"{s['train_length']} px" if s["length_unit"].startswith("image") else f"{s['train_length']} tokens"
    ax.set_title(f"hf-posenc study: {s['family']}, task {s['task']}, trained at {trained}, "
                 f"{settings['steps']} steps, seed {settings['seed']}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path)


def _files(out_dir: str | os.PathLike) -> dict[str, str]:
    out = Path(out_dir)
    return {"json": str(out / "results.json"), "table": str(out / "table.md"), "plot": str(out / "study.png")}


def _write_atomic(path: str, write: Any) -> None:
    """Write through a temporary file and rename it over ``path``: a crash mid-write leaves the old file."""
    tmp = f"{path}.tmp"
    write(tmp)
    os.replace(tmp, path)


def write_results(results: dict[str, Any], out_dir: str | os.PathLike) -> dict[str, str]:
    """Write ``results.json`` and ``table.md`` into ``out_dir`` (created), each atomically; return the paths
    of the three outputs. The study calls it after every model."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    files = _files(out_dir)
    results["files"] = files
    table = results.get("table") or markdown_table(results)
    _write_atomic(files["table"], lambda p: Path(p).write_text(table))
    _write_atomic(files["json"], lambda p: write_json(results, p))
    return files


def write_plot(results: dict[str, Any], out_dir: str | os.PathLike) -> bool:
    """Write ``study.png``. If the plot fails, the error is printed, recorded as ``results["plot_error"]``
    and written into ``results.json`` (which, like ``table.md``, is complete already); returns False."""
    import sys

    files = _files(out_dir)
    try:
        plot(results, files["plot"])
        return True
    except Exception as e:  # noqa: BLE001 - recorded and reported; the numbers are already on disk
        results["plot_error"] = f"{type(e).__name__}: {e}"
        print(f"hf-posenc study: the plot failed ({results['plot_error']}); results.json and table.md are "
              "written", file=sys.stderr)
        write_results(results, out_dir)
        return False


def write_outputs(results: dict[str, Any], out_dir: str | os.PathLike) -> dict[str, str]:
    """Write ``results.json`` and ``table.md``, then ``study.png`` (see :func:`write_plot`) into ``out_dir``."""
    files = write_results(results, out_dir)
    write_plot(results, out_dir)
    return files
