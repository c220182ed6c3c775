"""Outputs of ``hf-posenc study``: a markdown table, ``results.json`` and a PNG plot.

`write_results` writes ``results.json`` and ``table.md`` (the study calls it after every model, so
an interrupted study keeps what it finished), `write_plot` then ``study.png``; into the output folder:

* ``results.json``: every number (per-step training losses, every metric at every length) and the exact
  settings, versions, machine, seed and device;
* ``table.md``: the markdown table that the command also prints;
* ``study.png``: the metric against evaluation length, one line per encoding (matplotlib, Agg backend): one
  panel per evaluation split, the mean over the seeds with a band over their range, and for passkey a
  heatmap of retrieval by depth and length per encoding;
* with ``--long-eval``: ``long_eval.png``, perplexity by position up to FP, one line per entry, P and 2P marked
  (`long_eval_figure`), and with several key positions ``passkey.png``, retrieval by key position and length per
  entry (`passkey_figure`).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

__all__ = [
    "column_labels", "group_runs", "long_table", "markdown_table", "plot", "split_evals", "split_names", "spread",
    "write_json", "write_outputs", "write_plot", "write_profiles_figure", "write_results", "replot", "entry_style",
    "log_ticks", "same_lines", "joined_label", "checkpoint_title", "plot_conversion", "long_eval_figure",
    "long_label", "passkey_figure", "write_long_plots",
]

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


IN_DISTRIBUTION = "in-distribution"


def split_names(results: dict[str, Any]) -> list[str]:
    """The evaluation splits of a study: ``in-distribution`` first, then the task's others (tasks only)."""
    names = [IN_DISTRIBUTION]
    for name in (results.get("data") or {}).get("splits", {}):
        if name not in names:
            names.append(name)
    return names


def split_evals(run: dict[str, Any], split: str) -> list[dict[str, Any]]:
    """A run's evaluations (one per length) on ``split``."""
    return run["eval"] if split == IN_DISTRIBUTION else run.get("splits", {}).get(split, [])


def entry_label(run: dict[str, Any]) -> str:
    """The label of a run's entry in the table and the plot: its readable ``label`` (plans, windows, scaling
    at evaluation: see `hf_posenc.study.recipes`), else the spec as given."""
    return run.get("label") or run["encoding"]


def group_runs(results: dict[str, Any]) -> list[tuple[str, list[dict[str, Any]]]]:
    """``[(encoding spec, its runs)]`` in the order of first appearance (one run per seed)."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in results["results"]:
        groups.setdefault(r["encoding"], []).append(r)
    return list(groups.items())


def spread(values: list[float | None]) -> tuple[float | None, float | None, float | None]:
    """(mean, min, max) of the finite values; ``None`` if there are none (a diverged perplexity is None)."""
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals or len(vals) < len(values):
        return None, None, None
    return sum(vals) / len(vals), min(vals), max(vals)


def _split_table(results: dict[str, Any], split: str) -> tuple[list[str], list[str]]:
    s = results["study"]
    task = s["task"]
    labels = column_labels(results)
    lines = ["| encoding | " + " | ".join(labels) + " |", "|---|" + "---:|" * len(labels)]
    groups = group_runs(results)
    stats: dict[str, list[tuple[float | None, float | None, float | None]]] = {}
    for enc, runs in groups:
        ok = [r for r in runs if r["status"] == "ok" and split_evals(r, split)]
        if ok and len(ok) == len(runs):
            stats[enc] = [spread([split_evals(r, split)[j]["metric"] for r in ok]) for j in range(len(labels))]
    best: list[float | None] = []
    for j in range(len(labels)):
        vals = [st[j][0] for st in stats.values() if st[j][0] is not None]
        best.append((max(vals) if s["higher_is_better"] else min(vals)) if vals else None)
    notes: list[str] = []
    for enc, runs in groups:
        name = f"`{entry_label(runs[0])}`"
        bad = [r for r in runs if r["status"] != "ok"]
        if bad:
            word = "n/a" if all(r["status"] == "not_applicable" for r in bad) else "error"
            lines.append(f"| {name} | " + " | ".join([word] * len(labels)) + " |")
            seeds = f" (seed {', '.join(str(r.get('seed')) for r in bad)})" if len(runs) > 1 else ""
            notes.append(f"{name}{seeds}: {word}: {bad[0]['reason']}")
            continue
        if enc not in stats:  # runs kept by --resume from a results.json written before this split existed
            lines.append(f"| {name} | " + " | ".join(["-"] * len(labels)) + " |")
            continue
        cells = []
        for j, (mean, lo, hi) in enumerate(stats[enc]):
            text = _cell(mean, task)
            if len(runs) > 1 and mean is not None:
                text += f" ({_cell(lo, task)}-{_cell(hi, task)})"
            if mean is not None and best[j] is not None and mean == best[j]:
                text = f"**{text}**"
            length = split_evals(runs[0], split)[j]["length"]
            if runs[0]["name"] == "learned" and s["length_unit"] == "tokens" and length > s["train_length"]:
                text += LEARNED_MARK
            cells.append(text)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines, notes


def markdown_table(results: dict[str, Any]) -> str:
    """The study as a markdown table: one row per encoding, one column per evaluation length; for a task
    with out-of-distribution splits, one such table per split, each under its name.

    With several seeds a cell is ``mean (min-max)`` over the seeds. The best (mean) value of each column is
    bold. Rows for encodings that do not support the family read ``n/a``, rows that failed ``error``;
    footnotes say what the numbers are.
    """
    if results.get("before") is not None:
        return conversion_table(results)
    s = results["study"]
    task = s["task"]
    splits = split_names(results)
    lines: list[str] = []
    notes: list[str] = []
    meanings = (results.get("data") or {}).get("splits", {})
    for split in splits:
        block, block_notes = _split_table(results, split)
        if len(splits) > 1:
            meaning = meanings.get(split, {}).get("meaning", "")
            lines += ([""] if lines else []) + [f"**{split}**" + (f": {meaning}" if meaning else ""), ""]
        lines += block
        notes += [n for n in block_notes if n not in notes]
    if task == "text":
        what = (f"validation perplexity per byte (lower is better) over the same {results['data']['eval_bytes_per_length']} "
                f"bytes at every length; trained on {s['train_length']}-byte windows")
    elif task == "digits":
        what = (f"test accuracy, % (higher is better) on {results['data']['test_images']} digit images upscaled to "
                f"each side; trained at {s['train_length']} px (patch {results['data']['patch_size']}; the factor "
                "counts patches)")
    elif task == "passkey":
        what = (f"passkey: retrieval accuracy, % (higher is better): sequences whose every key digit is the argmax "
                f"(teacher-forced, the same as greedy decoding), {results['data']['eval_sequences_per_length']} "
                f"sequences per length and split; trained on length {s['train_length']}")
    else:
        what = (f"{task}: answer-token accuracy, % (higher is better), teacher-forced, "
                f"{results['data']['eval_sequences_per_length']} sequences per length and split; trained on length "
                f"{s['train_length']}")
    settings = results["settings"]
    seeds = settings.get("seeds") or [settings["seed"]]
    seed_text = (f"seed {seeds[0]}" if len(seeds) == 1 else
                 f"seeds {', '.join(map(str, seeds))} (each cell: mean (min-max) over the seeds)")
    footer = [
        "",
        (
            f"{s['family']}, {settings['layers']} layers, hidden {settings['hidden']}, {settings['heads']} heads, "
            f"{settings['steps']} steps x batch {settings['batch']}, {seed_text}, "
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


#: Marker shapes of the plots' entries. With 20 colours (tab20: the ten dark ones, then the ten light ones) and 12
#: markers, entry i gets colour i mod 20 and marker i mod 12: no two of the first 60 entries share the pair.
_MARKERS = "os^vDP*Xph<>"


def entry_style(i: int) -> dict[str, Any]:
    """The colour and marker of the ``i``-th entry of a plot (the same entry, the same style in every panel)."""
    import matplotlib

    k = i % 20
    color = matplotlib.colormaps["tab20"](2 * k if k < 10 else 2 * (k - 10) + 1)
    return {"color": color, "marker": _MARKERS[i % len(_MARKERS)]}


def log_ticks(lo: float, hi: float, most: int = 9) -> list[float]:
    """Labelled ticks for a logarithmic axis over [lo, hi] (positive): round values (1, 1.5, 2, 3, 5, 7 times a
    power of ten, fewer when the range spans several decades), at most ``most``, always including a tick at or
    below ``lo`` and one at or above ``hi`` so that every point lies between labelled ticks."""
    if not (lo > 0 and hi >= lo and math.isfinite(hi)):
        raise ValueError(f"log_ticks needs 0 < lo <= hi < inf, got {lo}, {hi}")
    for mantissas in ((1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 7, 8), (1, 1.5, 2, 3, 5, 7), (1, 2, 5), (1, 3), (1,)):
        ticks = []
        for e in range(math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 1):
            ticks += [m * 10.0 ** e for m in mantissas]
        below = max(t for t in ticks if t <= lo * (1 + 1e-9))
        above = min(t for t in ticks if t >= hi * (1 - 1e-9))
        chosen = [t for t in ticks if below <= t <= above]
        if len(chosen) <= most:
            return [float(f"{t:.6g}") for t in chosen]
    first, last = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    step = math.ceil((last - first) / (most - 1))  # powers of ten, every step-th decade, the last at or above hi
    return [10.0 ** e for e in range(first, last + step, step) if e - step < last]


def _log_axis(ax: Any, values: list[float], axis: str = "y") -> None:
    """A logarithmic axis labelled at `log_ticks` of the finite values (plain numbers, no minor labels)."""
    import matplotlib.ticker

    finite = [v for v in values if v is not None and math.isfinite(v) and v > 0]
    getattr(ax, f"set_{axis}scale")("log")
    if not finite:
        return
    ticks = log_ticks(min(finite), max(finite))
    target = ax.yaxis if axis == "y" else ax.xaxis
    target.set_major_locator(matplotlib.ticker.FixedLocator(ticks))
    target.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    target.set_minor_locator(matplotlib.ticker.NullLocator())
    # the bounding ticks where they are near the data, else a margin (and the ticks beyond it are not shown)
    lo, hi = min(finite), max(finite)
    getattr(ax, f"set_{axis}lim")(ticks[0] if ticks[0] >= lo / 1.3 else lo / 1.08,
                                  ticks[-1] if ticks[-1] <= hi * 1.3 else hi * 1.08)


def same_lines(series: list[tuple[int, str, list[float]]], rtol: float = 0.01,
               exact: float = 5e-4) -> list[tuple[int, list[str], list[float]]]:
    """Entries whose lines would be drawn on top of each other, drawn once: ``series`` is (style index, label,
    values); the result is one (style index of the first, labels, values of the first) per line drawn, in order.
    A line joins the first line whose every value is within ``rtol`` of its own (relative; NaN with NaN: 1 % is
    less than a marker's height on these plots). Its label is written ``= label`` when every value is also
    within ``exact`` (the same to about four digits), ``≈ label`` otherwise; `joined_label` joins them."""
    def close(a: list[float], b: list[float], tol: float) -> bool:
        return len(a) == len(b) and all(
            (math.isnan(x) and math.isnan(y)) or abs(x - y) <= tol * max(abs(x), abs(y)) for x, y in zip(a, b))

    groups: list[tuple[int, list[str], list[float]]] = []
    for i, label, values in series:
        for _, labels, first in groups:
            if close(first, values, rtol):
                labels.append(("= " if close(first, values, exact) else "≈ ") + label)
                break
        else:
            groups.append((i, [label], values))
    return groups


def joined_label(labels: list[str]) -> str:
    """The legend entry of a line that stands for several entries (`same_lines`): ``rope = rope+fox ≈ fire``."""
    return " ".join(labels)


def _legend(ax: Any, **kw: Any) -> None:
    """A legend whose handles are long enough to show a dashed line beside its marker (none on a panel with no
    labelled line: a conversion study whose entries are all baselines has no fine-tuning curve)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, handlelength=3.5, **kw)


def plot(results: dict[str, Any], path: str | os.PathLike) -> None:
    """Metric against evaluation length, one line per encoding (log-2 x axis; log y for perplexity); a PNG.

    Every entry has a colour-and-marker pair of its own (`entry_style`); lines that coincide are drawn once and
    labelled with every entry they stand for (`same_lines`). One panel per evaluation split (tasks with
    out-of-distribution splits). With several seeds each line is the mean over the seeds, with a band over
    their range (min to max). Passkey adds one heatmap per encoding: retrieval accuracy by depth (rows) and
    length (columns), mean over the seeds. On text, ``learned`` is dashed: past the training length it runs on
    rows of its table that were never trained."""
    if results.get("before") is not None:
        return plot_conversion(results, path)
    # The object-oriented API with the Agg canvas: no pyplot, so no global backend switch for the caller.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    s = results["study"]
    text = s["task"] == "text"
    passkey = s["task"] == "passkey"
    splits = split_names(results)
    depth_splits = [sp for sp in splits if sp.startswith("depth ")] if passkey else []
    line_splits = [sp for sp in splits if sp not in depth_splits]
    groups = [(enc, runs) for enc, runs in group_runs(results) if all(r["status"] == "ok" for r in runs)]
    n_heat = len(groups) if depth_splits else 0
    heat_cols = min(4, n_heat) if n_heat else 0
    heat_rows = math.ceil(n_heat / heat_cols) if n_heat else 0
    width = max(8.0, 5.0 * len(line_splits) + 2.5)
    fig = Figure(figsize=(width, 5 + 3.2 * heat_rows), dpi=120)
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(1 + heat_rows, max(len(line_splits), heat_cols or 1),
                            height_ratios=[5] + [3.2] * heat_rows)
    x = s["eval_lengths"]
    settings = results["settings"]
    seeds = settings.get("seeds") or [settings["seed"]]
    span = max(len(line_splits), heat_cols)
    scale = 1 if text else 100
    for k, split in enumerate(line_splits):
        ax = fig.add_subplot(grid[0, k] if len(line_splits) > 1 else grid[0, :span])
        series, bands, dashed = [], {}, set()
        for i, (enc, runs) in enumerate(groups):
            evals = [split_evals(r, split) for r in runs]
            if not all(evals):
                continue
            stats = [spread([e[j]["metric"] for e in evals]) for j in range(len(x))]
            label = entry_label(runs[0])
            if runs[0]["name"] == "learned" and s["length_unit"] == "tokens":
                label += " (dashed: untrained rows past 1x)"
                dashed.add(i)
            series.append((i, label, [m * scale if m is not None else float("nan") for m, _, _ in stats]))
            if len(runs) > 1:
                bands[i] = ([v * scale if v is not None else float("nan") for _, v, _ in stats],
                            [v * scale if v is not None else float("nan") for _, _, v in stats])
        for i, labels, ys in same_lines(series):
            style = entry_style(i)
            ax.plot(x, ys, "--" if i in dashed else "-", label=joined_label(labels), linewidth=1.6, markersize=6,
                    **style)
            if i in bands:
                ax.fill_between(x, *bands[i], color=style["color"], alpha=0.15, linewidth=0)
        ax.set_xscale("log", base=2)
        ax.set_xticks(x)
        ax.set_xticklabels(column_labels(results), fontsize=8)
        ax.minorticks_off()
        ax.axvline(s["train_length"], color="grey", linestyle=":", linewidth=1)
        if text:
            _log_axis(ax, [v for _, _, ys in series for v in ys])
            ax.set_ylabel("validation perplexity per byte (lower is better)")
        elif k == 0:
            ax.set_ylabel(("retrieval" if passkey else "accuracy") + ", % (higher is better)")
        unit = "image side, px (x patches)" if s["length_unit"].startswith("image") else "evaluation length, tokens"
        ax.set_xlabel(f"{unit}; dotted: training length", fontsize=8)
        if len(line_splits) > 1:
            ax.set_title(split, fontsize=10)
        ax.grid(True, which="major", alpha=0.3)
        if k == len(line_splits) - 1:
            _legend(ax, loc="center left", bbox_to_anchor=(1.01, 0.5))
    for i, (enc, runs) in enumerate(groups[:n_heat]):
        ax = fig.add_subplot(grid[1 + i // heat_cols, i % heat_cols])
        cells = [[100 * (spread([split_evals(r, sp)[j]["metric"] for r in runs])[0] or 0.0) for j in range(len(x))]
                 for sp in depth_splits]
        im = ax.imshow(cells, vmin=0, vmax=100, cmap="viridis", aspect="auto", origin="upper")
        for a, row in enumerate(cells):
            for b, v in enumerate(row):
                ax.text(b, a, f"{v:.0f}", ha="center", va="center", fontsize=7, color="white" if v < 60 else "black")
        ax.set_xticks(range(len(x)))
        ax.set_xticklabels([str(n) for n in x], fontsize=7)
        ax.set_yticks(range(len(depth_splits)))
        ax.set_yticklabels([sp.split(" ")[1] for sp in depth_splits], fontsize=7)
        ax.set_title(f"{enc}: retrieval %", fontsize=9)
        ax.set_xlabel("length, tokens", fontsize=7)
        ax.set_ylabel("key depth", fontsize=7)
        if i == n_heat - 1:
            fig.colorbar(im, ax=ax, fraction=0.05)
    trained = f"{s['train_length']} px" if s["length_unit"].startswith("image") else f"{s['train_length']} tokens"
    seed_text = f"seed {seeds[0]}" if len(seeds) == 1 else f"seeds {', '.join(map(str, seeds))} (mean, band: range)"
    fig.suptitle(f"hf-posenc study: {s['family']}, task {s['task']}, trained at {trained}, "
                 f"{settings['steps']} steps, {seed_text}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)


def checkpoint_title(results: dict[str, Any]) -> str:
    """How a conversion study names its checkpoint: the ``--from`` argument as given when it is a hub id or
    ``smollm2``, the directory's name when it is a path (never the name a converted file carries inside)."""
    source = str((results.get("settings") or {}).get("source") or results["checkpoint"]["path"])
    path = Path(source)
    if source == "smollm2":
        return f"smollm2 ({Path(results['checkpoint']['path']).name})"
    if path.is_absolute() or source.startswith((".", "~")) or path.is_dir() or source.count("/") != 1:
        return path.name or source
    return source  # owner/name: a hub id


def plot_conversion(results: dict[str, Any], path: str | os.PathLike) -> None:
    """A conversion study (``--from``), three panels, each with one kind of point: perplexity against fine-tuning
    step from the per-step training losses (a running mean over 5 steps); perplexity against evaluation length
    right after the swap (step 0), beside the unpatched model (black); and the same after fine-tuning. Each entry
    keeps its colour and marker in every panel; lines that coincide (an inert composition and the rope baseline)
    are drawn once, labelled with every entry they stand for. Titled from the checkpoint's directory or id
    (`checkpoint_title`)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    s = results["study"]
    fig = Figure(figsize=(18, 7.5), dpi=100)
    FigureCanvasAgg(fig)
    steps_ax, start_ax, tuned_ax = (fig.add_subplot(1, 3, k) for k in (1, 2, 3))
    x = s["eval_lengths"]
    runs = [r for _, rs in group_runs(results) for r in rs[:1] if r["status"] == "ok"]
    nan = float("nan")

    def metrics(evals: list[dict[str, Any]] | None) -> list[float]:
        return [e["metric"] if e.get("metric") is not None else nan for e in (evals or [])]

    curves, starts, tuned, untrained = [], [], [], []
    for i, r in enumerate(runs):
        label, losses = entry_label(r), r["train"]["losses"]
        if losses:
            smooth = [sum(losses[max(0, j - 4): j + 1]) / len(losses[max(0, j - 4): j + 1]) for j in range(len(losses))]
            curves.append((i, label, [math.exp(v) for v in smooth]))
            tuned.append((i, label, metrics(r["eval"])))
        else:
            untrained.append(label)
        if r.get("eval_start"):
            starts.append((i, label, metrics(r["eval_start"])))
    before = metrics(results["before"])
    black = {"color": "black", "marker": "s"}
    for i, labels, ys in same_lines(curves):
        steps_ax.plot(range(1, len(ys) + 1), ys, label=joined_label(labels), markevery=(i % 5, 5), markersize=5,
                      linewidth=1.5, **entry_style(i))
    for ax, series in ((start_ax, starts), (tuned_ax, tuned)):
        reference = "before the swap (the unpatched model)"
        lines = same_lines([(-1, reference, before)] + series)
        for i, labels, ys in lines:
            style = black if i == -1 else entry_style(i)
            ax.plot(x, ys, "-" if i != -1 or ax is start_ax else "--", label=joined_label(labels), markersize=6,
                    linewidth=1.8 if i == -1 else 1.5, **style)
    for ax in (steps_ax, start_ax, tuned_ax):
        ax.grid(True, which="major", alpha=0.3)
        ax.set_ylabel("perplexity per token (lower is better)")
    _log_axis(steps_ax, [v for _, _, ys in curves for v in ys])
    length_values = before + [v for _, _, ys in starts + tuned for v in ys]
    for ax in (start_ax, tuned_ax):
        _log_axis(ax, length_values)  # the same scale in both: comparable at a glance
        ax.set_xscale("log", base=2)
        ax.set_xticks(x)
        ax.set_xticklabels([str(n) for n in x])
        ax.minorticks_off()
        ax.set_xlabel("evaluation length, tokens")
    for ax in (steps_ax, start_ax, tuned_ax):  # below each panel: the labels are long and the lines fill the panels
        _legend(ax, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=1, frameon=False)
    steps_ax.set_xlabel(f"fine-tuning step (training loss at {s['train_length']} tokens, running mean of 5)")
    steps_ax.set_title("fine-tuning", fontsize=10)
    start_ax.set_title("right after the swap (step 0), evaluated", fontsize=10)
    after = "after fine-tuning, evaluated"
    tuned_ax.set_title(after + (f" (not trained: {', '.join(untrained)})" if untrained else ""), fontsize=10)
    st = results["settings"]
    fig.suptitle(f"hf-posenc study --from {checkpoint_title(results)}: {st['steps']} fine-tuning steps of "
                 f"{st['batch']} x {s['train_length']} tokens at lr {st['lr']:g}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path)


def conversion_table(results: dict[str, Any]) -> str:
    """A conversion study's perplexities at each length: before the swap, right after it, and fine-tuned."""
    x = results["study"]["eval_lengths"]
    heads = " | ".join(f"{n}" for n in x)
    lines = [f"| entry | after the swap: {heads} | fine-tuned: {heads} |",
             "|---|" + "---|" * (2 * len(x)),
             "| unpatched (before any swap) | " + " | ".join(_cell(e["metric"], "text") for e in results["before"])
             + " | " + " | ".join("" for _ in x) + " |"]
    for r in results["results"]:
        if r["status"] != "ok":
            lines.append(f"| {entry_label(r)} | {r['status']} |" + " |" * (2 * len(x) - 1))
            continue
        start = r.get("eval_start") or [{"metric": None}] * len(x)
        tuned = "" if not r["train"]["losses"] else " | ".join(_cell(e["metric"], "text") for e in r["eval"])
        lines.append(f"| {entry_label(r)} | " + " | ".join(_cell(e["metric"], "text") for e in start) + " | "
                     + (tuned or " | ".join("not trained" for _ in x)) + " |")
    c = results["checkpoint"]
    st = results["settings"]
    enc_lr = st.get("encoding_lr", st["lr"])  # absent: a results.json from before the encoding's own rate
    from ..training import ENCODING_LR, ENCODING_LRS

    own = ", ".join(f"{k} {v:g}" for k, v in ENCODING_LRS.items())
    if enc_lr is None:
        enc_text = (f" (the encoding's parameters at hf_posenc.param_groups' default rates: {own}, the others "
                    f"{ENCODING_LR:g})")
    else:
        enc_text = f" (the encoding's parameters at {enc_lr})" if enc_lr != st["lr"] else ""
    lines += ["", f"{c['name']} ({c['model_type']}, weights sha256 {c['weights_sha256'][:12]}), fine-tuned "
              f"{st['steps']} steps x batch {st['batch']} x {st['train_len']} tokens at lr {st['lr']}" + enc_text
              + f"; perplexity per token over the same {results['data']['eval_tokens_per_length']} validation tokens "
              f"of {results['data']['source']} at every length."]
    lines += long_table(results)
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def _passkey_cells(long: dict[str, Any], lengths: list[int]) -> list[str]:
    """One cell per passkey length: ✓ / ✗ for one key, ``k/n`` keys retrieved for several."""
    cells = []
    for n in lengths:
        got = [r["retrieved"] for r in long.get("passkey", []) if r["length"] == n]
        cells.append("" if not got else ("✓" if got[0] else "✗") if len(got) == 1 else f"{sum(got)}/{len(got)}")
    return cells


def _eval_factor(position_encoding: Any) -> float | None:
    """The factor of the rotary scaling in a recorded ``position_encoding`` (one entry's, or a plan's), or None."""
    if isinstance(position_encoding, dict):
        scaling = position_encoding.get("scaling")
        if isinstance(scaling, dict) and isinstance(scaling.get("factor"), (int, float)):
            return float(scaling["factor"])
        position_encoding = list(position_encoding.values())
    if isinstance(position_encoding, list):
        for item in position_encoding:
            found = _eval_factor(item)
            if found is not None:
                return found
    return None


def long_label(run: dict[str, Any]) -> str:
    """A run's label in the long evaluation's table and pictures: `entry_label`, the factor of its scaling at
    evaluation named where the label does not (``rope + YaRN x4 at eval`` for ``rope:eval_scaling=yarn`` run with
    ``--long-factor 4``), and `` (not trained)`` for a baseline that was not fine-tuned."""
    label = entry_label(run)
    factor = _eval_factor((run.get("long_eval") or {}).get("eval_position_encoding"))
    head, at, tail = label.rpartition(" at eval")
    if factor is not None and at and " x" not in head.rpartition(" + ")[2]:
        label = f"{head} x{factor:g}{at}{tail}"
    trained = bool((run.get("train") or {}).get("losses"))
    return label + ("" if trained or "zero-shot" in label or run.get("status") != "ok" else " (not trained)")


def _memory(long: dict[str, Any]) -> str:
    peak = long.get("peak_memory_mib")
    return "-" if peak is None else f"{peak / 1024:.1f} GiB" if peak >= 1024 else f"{peak:.0f} MiB"


def _tokens(n: int, context: int) -> str:
    """A position as the long evaluation's axes show it: in thousands (``8k`` for 8192, ``0.5k``) where the
    context P is 1024 or more and ``n`` a multiple of 512, else the number."""
    return f"{n / 1024:g}k" if context >= 1024 and n % 512 == 0 and n else str(n)


def long_table(results: dict[str, Any]) -> list[str]:
    """The evaluation past the pretrained context P (``--long-eval``) as markdown lines: perplexity on [P/2, P),
    [P, 2P), ... up to FP, passkey per length, and the time and peak memory of each entry's long evaluation; ``[]``
    without one."""
    described = (results.get("data") or {}).get("long_eval")
    before = results.get("before_long_eval")
    if not described:
        return []
    p = described["context"]
    bands = [tuple(b) for b in described["bands"]][1:]  # from [P/2, P) on ([0, P/2) is in results.json)
    lengths = sorted({n for h in described["passkey"] for n in h["lengths"]})
    head = ("| entry | " + " | ".join(f"[{lo}, {hi})" for lo, hi in bands) + " | "
            + " | ".join(f"passkey {n}" for n in lengths) + " | time | peak memory |")
    lines = ["", f"Past the pretrained context (P = {p}, `--long-eval`):", "", head,
             "|---|" + "---:|" * (len(bands) + len(lengths) + 2)]
    st = results["settings"]

    def row(label: str, long: dict[str, Any] | None) -> str:
        if not long:
            return f"| {label} | " + " | ".join("-" for _ in range(len(bands) + len(lengths) + 2)) + " |"
        got = {tuple(b["band"]): b["perplexity"] for b in long["bands"]}
        cells = [*(_cell(got.get(band), "text") for band in bands), *_passkey_cells(long, lengths),
                 _duration(long["seconds"]), _memory(long)]
        return f"| {label} | " + " | ".join(cells) + " |"

    lines.append(row("unpatched (before any swap)", before))
    for r in results["results"]:
        if r["status"] != "ok":
            lines.append(row(f"{entry_label(r)} ({r['status']})", None))
            continue
        lines.append(row(long_label(r), r.get("long_eval")))
    keys = ", ".join(f"token {h['key_at']}" for h in described["passkey"])
    env = results.get("environment") or {}
    lines += ["", f"Perplexity per token by target position over {described['window_tokens']} held-out tokens (the end "
              f"of the text, never trained on), after each entry's fine-tune ({st['steps']} steps x {st['batch']} x "
              f"{st['train_len']} tokens) unless marked; passkey: a five-digit key at {keys} of filler text, retrieved "
              "(✓, every answer token the argmax) or not (✗) by a question ending at that many tokens; time and "
              f"peak memory: the long evaluation alone, on {env.get('device_name', 'this device')} (torch threads: "
              f"{env.get('torch_threads')})."]
    return lines


def _long_runs(results: dict[str, Any]) -> list[tuple[int, str, dict[str, Any]]]:
    """(style index, label, long evaluation) of the unpatched model (index -1) and of each entry's first run that
    has one; an entry's index is the one `plot_conversion` gives it, so it keeps its colour and marker."""
    out = []
    if results.get("before_long_eval"):
        out.append((-1, "unpatched (before any swap)", results["before_long_eval"]))
    runs = [r for _, rs in group_runs(results) for r in rs[:1] if r["status"] == "ok"]
    out += [(i, long_label(r), r["long_eval"]) for i, r in enumerate(runs) if r.get("long_eval")]
    return out


_UNPATCHED = {"color": "black", "marker": "s"}


def long_eval_figure(results: dict[str, Any]) -> Any:
    """The long evaluation by position, as the long-context papers draw it: perplexity per token over bins of the
    held-out window (the bins of ``nll_bins``: mean loss per bin, exponentiated), one line per entry and the
    unpatched model (black), log y; P, 2P, ... marked by vertical lines, the part past P shaded. Lines that coincide
    are drawn once, labelled with every entry they stand for (`same_lines`). A matplotlib ``Figure`` (Agg)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    described = results["data"]["long_eval"]
    p, factor = described["context"], described.get("factor", 2)
    fig = Figure(figsize=(13, 6.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    nan = float("nan")
    series, xs, size = [], None, None
    for i, label, long in _long_runs(results):
        bins = long.get("nll_bins")
        if not bins:  # a results.json from before the bins were kept
            continue
        size = bins["tokens"]
        xs = [min((k + 0.5) * size, described["window_tokens"]) for k in range(len(bins["loss"]))]
        series.append((i, label, [math.exp(v) if v is not None and v < 700 else nan for v in bins["loss"]]))
    every = max(1, len(xs or []) // 16)
    for i, labels, ys in same_lines(series):
        style = _UNPATCHED if i == -1 else entry_style(i)
        # the unpatched model, the reference, on top of the entries that follow it
        ax.plot(xs, ys, "-", label=joined_label(labels), linewidth=1.5 if i == -1 else 1.3, markersize=4,
                markevery=((i + 1) % every, every), zorder=3 if i == -1 else 2, **style)
    ax.axvspan(p, factor * p, color="grey", alpha=0.07, linewidth=0)
    m = 1
    while m <= factor:
        ax.axvline(m * p, color="dimgrey", linestyle="-" if m == 1 else "--", linewidth=1.1)
        ax.text(m * p, 0.99, f" P = {p} " if m == 1 else f" {m}P ", transform=ax.get_xaxis_transform(),
                ha="right" if m == factor else "left", va="top", fontsize=9, color="dimgrey")
        m *= 2
    _log_axis(ax, [v for _, _, ys in series for v in ys])
    step = p // 2 if factor <= 4 else p
    ticks = list(range(0, factor * p + 1, step))
    ax.set_xticks(ticks)
    ax.set_xticklabels([_tokens(x, p) for x in ticks])
    ax.set_xlim(0, factor * p)
    ax.grid(True, which="major", alpha=0.3)
    ax.set_xlabel(f"position in the held-out window, tokens (bins of {size}; shaded: past the pretrained context P)")
    ax.set_ylabel("perplexity per token in the bin (lower is better)")
    _legend(ax, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    if not series:
        ax.text(0.5, 0.5, "no per-position losses in results.json (written before hf_posenc kept them)",
                transform=ax.transAxes, ha="center", va="center")
    title = checkpoint_title(results) if results.get("checkpoint") else "the checkpoint"
    source = str((results.get("data") or {}).get("source", "text")).split(" (")[0]
    ax.set_title(f"hf-posenc study --from {title} --long-eval: perplexity by position up to {factor}P\n"
                 f"{described['window_tokens']} held-out tokens of {source}, never trained on", fontsize=10)
    fig.tight_layout()
    return fig


def passkey_figure(results: dict[str, Any]) -> Any | None:
    """The passkey as a grid per entry (and the unpatched model): key position (rows) by question length
    (columns), green where the key was retrieved, red where not, grey where the question would come before the
    key; each cell shows the answer's log-probability. None with fewer than two key positions (the table says all
    there is). A matplotlib ``Figure`` (Agg)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import ListedColormap
    from matplotlib.figure import Figure

    described = results["data"]["long_eval"]
    keys = [h["key_at"] for h in described["passkey"]]
    if len(keys) < 2:
        return None
    lengths = sorted({n for h in described["passkey"] for n in h["lengths"]})
    panels = _long_runs(results)
    cols = min(4, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig = Figure(figsize=(3.6 * cols + 0.5, 0.45 * len(keys) * rows + 1.9 * rows + 0.6), dpi=100)
    FigureCanvasAgg(fig)
    cmap = ListedColormap(["#d7301f", "#1a9850"]).with_extremes(bad="#e6e6e6")
    nan = float("nan")
    for k, (_, label, long) in enumerate(panels):
        ax = fig.add_subplot(rows, cols, k + 1)
        found = {(r["key_at"], r["length"]): r for r in long.get("passkey", [])}
        cells = [[float(found[a, n]["retrieved"]) if (a, n) in found else nan for n in lengths] for a in keys]
        ax.imshow(cells, cmap=cmap, vmin=0, vmax=1, aspect="auto")
        for y, a in enumerate(keys):
            for x, n in enumerate(lengths):
                if (a, n) in found:
                    ax.text(x, y, f"{found[a, n]['answer_logprob']:.1f}", ha="center", va="center", fontsize=7,
                            color="white")
        ax.set_xticks(range(len(lengths)))
        ax.set_xticklabels([_tokens(n, described["context"]) for n in lengths], fontsize=7)
        ax.set_yticks(range(len(keys)))
        ax.set_yticklabels([str(a) for a in keys], fontsize=7)
        got = [r["retrieved"] for r in long.get("passkey", [])]
        ax.set_title(f"{label}: {sum(got)}/{len(got)}", fontsize=8)
        ax.set_xlabel("question ends at token", fontsize=7)
        ax.set_ylabel("key at token", fontsize=7)
    title = checkpoint_title(results) if results.get("checkpoint") else "the checkpoint"
    fig.suptitle(f"hf-posenc study --from {title} --long-eval: passkey retrieved (green) or not (red), by key "
                 "position and length; in each cell the answer's log-probability", fontsize=10)
    fig.tight_layout()
    return fig


def _long_files(results: dict[str, Any], out_dir: str | os.PathLike) -> dict[str, str]:
    """The long evaluation's pictures, where the study has them: ``long_eval.png``, and ``passkey.png`` with
    several key positions."""
    described = (results.get("data") or {}).get("long_eval")
    if not described:
        return {}
    out = Path(out_dir)
    files = {"long_eval_plot": str(out / "long_eval.png")}
    if len(described["passkey"]) > 1:
        files["passkey_plot"] = str(out / "passkey.png")
    return files


def write_long_plots(results: dict[str, Any], out_dir: str | os.PathLike) -> list[str]:
    """Draw the long evaluation's pictures (`long_eval_figure`, `passkey_figure`) into ``out_dir``, beside
    results.json; returns their paths (none without ``--long-eval``)."""
    files = _long_files(results, out_dir)
    if "long_eval_plot" in files:
        long_eval_figure(results).savefig(files["long_eval_plot"])
    if "passkey_plot" in files:
        passkey_figure(results).savefig(files["passkey_plot"])
    return list(files.values())


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
    files = {**_files(out_dir), **_long_files(results, out_dir)}
    results["files"] = files
    table = results.get("table") or markdown_table(results)
    _write_atomic(files["table"], lambda p: Path(p).write_text(table))
    _write_atomic(files["json"], lambda p: write_json(results, p))
    return files


def write_plot(results: dict[str, Any], out_dir: str | os.PathLike) -> bool:
    """Write ``study.png`` (and with ``--long-eval`` the long evaluation's pictures, `write_long_plots`). If a plot
    fails, the error is printed, recorded as ``results["plot_error"]`` and written into ``results.json`` (which, like
    ``table.md``, is complete already); returns False."""
    import sys

    files = _files(out_dir)
    try:
        plot(results, files["plot"])
        write_long_plots(results, out_dir)
        return True
    except Exception as e:  # noqa: BLE001 - recorded and reported; the numbers are already on disk
        results["plot_error"] = f"{type(e).__name__}: {e}"
        print(f"hf-posenc study: the plot failed ({results['plot_error']}); results.json and table.md are "
              "written", file=sys.stderr)
        write_results(results, out_dir)
        return False


def write_outputs(results: dict[str, Any], out_dir: str | os.PathLike) -> dict[str, str]:
    """Write ``results.json`` and ``table.md``, then ``study.png`` (see `write_plot`) into ``out_dir``."""
    files = write_results(results, out_dir)
    write_plot(results, out_dir)
    return files


def write_profiles_figure(results: dict[str, Any], out_dir: str | os.PathLike) -> str | None:
    """What each model learned: every run's profile (``profiles/*.json``, written after its training, see
    `hf_posenc.position_profile`) drawn, every layer, to ``profiles/<run>.png`` by
    `hf_posenc.profile_plot.draw_profile`; and ``profiles.png``, an overview grid of at most four columns
    with one panel per entry (its first seed), drawn from one representative layer
    (`hf_posenc.profile_plot.draw_profiles_grid`). Returns its path, or None when no run has a profile.
    A failure is printed and recorded as ``results["profiles_error"]`` (the numbers are on disk already)."""
    import json
    import sys
    from pathlib import Path

    out = Path(out_dir)
    runs = [r for r in results["results"] if r.get("status") == "ok" and r.get("profile")]
    if not runs:
        return None
    try:
        from ..profile_plot import draw_profile, draw_profiles_grid

        firsts: dict[str, tuple[str, dict[str, Any]]] = {}
        for r in runs:
            profile = json.loads((out / r["profile"]).read_text())
            draw_profile(profile, out / (r["profile"][: -len(".json")] + ".png"))
            firsts.setdefault(r["encoding"], (entry_label(r), profile))
        path = out / "profiles.png"
        draw_profiles_grid(list(firsts.values()), path, title="What each model learned (hf_posenc.position_profile "
                           "of the trained model, first seed; every layer in profiles/)")
        return str(path)
    except Exception as e:  # noqa: BLE001 - recorded and reported; the numbers are already on disk
        results["profiles_error"] = f"{type(e).__name__}: {e}"
        print(f"hf-posenc study: the profile figure failed ({results['profiles_error']})", file=sys.stderr)
        write_results(results, out_dir)
        return None


def replot(out_dir: str | os.PathLike) -> list[str]:
    """Redraw a finished study's pictures from what it wrote: ``study.png`` (and the long evaluation's,
    `write_long_plots`) from ``results.json`` (a file, or a folder holding one; the pictures go beside it) and,
    where the folder has the runs' ``profiles/*.json``,
    every profile picture and ``profiles.png``. Returns the paths written. ``python -m hf_posenc.study.report
    DIR`` runs it (the documentation's pictures are redrawn so after a change to the plots)."""
    path = Path(out_dir)
    folder = path if path.is_dir() else path.parent
    results = json.loads((path / "results.json" if path.is_dir() else path).read_text())
    written = [str(folder / "study.png")]
    plot(results, written[0])
    written += write_long_plots(results, folder)
    if any(r.get("profile") and (folder / r["profile"]).is_file() for r in results.get("results", [])):
        figure = write_profiles_figure(results, folder)
        if figure:
            written.append(figure)
    return written


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 2:
        sys.exit("usage: python -m hf_posenc.study.report STUDY_DIR_OR_RESULTS_JSON")
    print("\n".join(replot(sys.argv[1])))
