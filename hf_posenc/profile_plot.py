"""Drawing a position profile (the PNG of ``hf-posenc show``) with matplotlib (Agg canvas), imported lazily.

`draw_profile` draws one profile, one row of panels per layer; `draw_profiles_grid` draws several
(the study's ``profiles.png``), one panel each from a representative layer, in a grid of at most four columns.
Each kind is drawn the way the papers draw it:

* ``score_bias`` / ``qk_transform`` on text: the bias (or similarity) against distance, one line per head,
  the distance axis logarithmic (symlog, linear up to 1) when it spans more than two decades' worth of tokens
  (N > 100), a log value axis when every value is positive and spans more than a factor 100.
* the same on ViT: one heatmap per head over the patch grid (from the centre patch), side by side.
* ``absolute``: the N x N cosine-similarity heatmap.
* ``data_dependent``: the attention map (mean over heads) beside the encoding's own quantities: CoPE's
  positions of the last query and FoX's gates (heads x tokens), SBA's breaks of the last query. Heatmaps
  take a log colour scale when their values are positive and span more than a factor 100.
* ``none``: a panel that says so.
"""

from __future__ import annotations

import math
import os
from typing import Any

__all__ = ["GRID_COLUMNS", "draw_profile", "draw_profiles_grid", "representative_layer"]

_NO_MATPLOTLIB = 'drawing a profile needs matplotlib: pip install "hf_posenc[study]"'

#: Per-encoding quantities drawn beside the attention map: (key, title).
_QUANTITIES = (
    ("positions_last_query", "CoPE positions p_ij, last query (heads x keys)"),
    ("forget_gates", "forget gates f_t (heads x tokens)"),
    ("backward_gates", "backward gates (heads x tokens)"),
    ("decay_last_query", "decay F_ij of the last query (heads x keys)"),
    ("breaks_last_query", "stick breaks beta_ij, last query (heads x keys)"),
)


def _figure(size: tuple[float, float]) -> Any:
    """A matplotlib Figure on the Agg canvas (pyplot's global state is never touched)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(_NO_MATPLOTLIB) from e
    fig = Figure(figsize=size)
    FigureCanvasAgg(fig)
    return fig


def _curves(ax: Any, entry: dict[str, Any], key: str, ylabel: str, legend_size: float = 6) -> None:
    distance = entry["distance"]
    values = entry[key]
    shared = entry.get("shared", False)
    for h, row in enumerate(values):
        ax.plot(distance, row, linewidth=1.0, label="all heads" if shared else f"head {h}")
    if len(distance) > 100:
        ax.set_xscale("symlog", linthresh=1.0)
    flat = [v for row in values for v in row]
    if flat and min(flat) > 0 and max(flat) / min(flat) > 100:
        ax.set_yscale("log")
    ax.set_xlabel("distance d (query N-1, key N-1-d)")
    ax.set_ylabel(ylabel)
    if len(values) <= 16:
        ax.legend(fontsize=legend_size, ncol=2)


def _side_by_side(maps: list) -> list:
    """(H, rows, cols) -> one (rows, H*cols + H-1) image with a NaN column between heads."""
    rows = len(maps[0])
    out = []
    for r in range(rows):
        line: list = []
        for h, m in enumerate(maps):
            if h:
                line.append(math.nan)
            line.extend(m[r])
        out.append(line)
    return out


def _heatmap(fig: Any, ax: Any, matrix: list, title: str, xlabel: str = "", ylabel: str = "",
             title_size: float = 8) -> None:
    """A heatmap with a colour bar; a logarithmic colour scale when every value is positive and they span more
    than a factor 100 (FoX's decays)."""
    from matplotlib.colors import LogNorm

    flat = [v for row in matrix for v in row if not math.isnan(v)]
    norm = LogNorm() if flat and min(flat) > 0 and max(flat) / min(flat) > 100 else None
    image = ax.imshow(matrix, aspect="auto", interpolation="nearest", cmap="viridis", norm=norm)
    if ylabel == "head" and len(matrix) <= 16:
        ax.set_yticks(range(len(matrix)))
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.02)
    ax.set_title(title, fontsize=title_size)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)


def _panels(entry: dict[str, Any]) -> list[tuple[str, Any]]:
    """What to draw for one layer: (kind of panel, payload)."""
    kind = entry["kind"]
    if kind in ("score_bias", "qk_transform"):
        key = "bias" if kind == "score_bias" else "similarity"
        return [("grid" if "grid" in entry else "curves", key)]
    if kind == "absolute":
        return [("matrix", "similarity")]
    if kind == "data_dependent":
        panels: list[tuple[str, Any]] = [("attention", None)]
        panels += [("quantity", (k, t)) for k, t in _QUANTITIES if k in entry]
        return panels
    return [("none", None)]


def _draw_panel(fig: Any, ax: Any, entry: dict[str, Any], what: str, payload: Any, head: str,
                title_size: float = 9) -> None:
    """Draw one panel of ``entry`` (a layer of a profile) on ``ax``: ``what`` and ``payload`` from
    `_panels`, ``head`` the panel's title line."""
    if what == "curves":
        _curves(ax, entry, payload, "bias" if payload == "bias" else "trace(T_i^T T_j) / head_dim",
                legend_size=6 if title_size < 10 else 9)
        ax.set_title(head, fontsize=title_size)
    elif what == "grid":
        shared = " (all heads)" if entry.get("shared") else ", heads left to right"
        _heatmap(fig, ax, _side_by_side(entry[payload]),
                 f"{head}\n{payload} from the centre patch{shared}", "patch column", "patch row", title_size)
    elif what == "matrix":
        _heatmap(fig, ax, entry[payload], f"{head}\ncosine similarity of position vectors", "position",
                 "position", title_size)
    elif what == "attention":
        att = entry["attention"]
        heads = len(att)
        mean = [[sum(att[h][i][j] for h in range(heads)) / heads for j in range(len(att[0][i]))]
                for i in range(len(att[0]))]
        _heatmap(fig, ax, mean, f"{head}\nattention (mean over {heads} heads)", "key", "query", title_size)
    elif what == "quantity":
        key, title = payload
        _heatmap(fig, ax, entry[key], title, "key / token", "head", title_size)
    else:
        ax.text(0.5, 0.5, "no position signal", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(head, fontsize=title_size)
        ax.axis("off")


def draw_profile(profile: dict[str, Any], path: str | os.PathLike) -> None:
    """Draw ``profile`` (from `hf_posenc.position_profile`) into the PNG file ``path``: one row of
    panels per layer.

    Raises ImportError naming ``pip install "hf_posenc[study]"`` when matplotlib is missing."""
    layers = profile["layers"]
    rows = [_panels(e) for e in layers]
    cols = max(len(r) for r in rows)
    fig = _figure((5.0 * cols, 3.4 * len(layers)))
    axes = fig.subplots(len(layers), cols, squeeze=False)
    for entry, panels, line in zip(layers, rows, axes):
        for ax in line[len(panels):]:
            ax.axis("off")
        head = f"layer {entry['layer']}: {entry['encoding']} ({entry['kind']})"
        for ax, (what, payload) in zip(line, panels):
            _draw_panel(fig, ax, entry, what, payload, head)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def representative_layer(profile: dict[str, Any]) -> dict[str, Any]:
    """The layer of ``profile`` that stands for the whole model in an overview: the last layer with a position
    signal (kind other than ``none``), or the last layer when none has one. For a plan such as
    rope, rope, rope, nope this is the last rope layer."""
    layers = profile["layers"]
    if not layers:
        raise ValueError("the profile has no layers")
    with_signal = [e for e in layers if e["kind"] != "none"]
    return (with_signal or layers)[-1]


#: The overview grid's columns at most, and the size of one panel (inches at 100 dpi: 5.4 x 4.0 in is
#: 540 x 400 px, so four columns stay under 2,200 px).
GRID_COLUMNS = 4
_PANEL_SIZE = (5.4, 4.0)


def _drawn_as(entry: dict[str, Any]) -> str:
    """What a layer's overview panel shows, as a string: two layers (of any profiles) with the same string draw the
    same picture. Everything but the layer's index and encoding name, numbers to 6 significant digits."""
    import json

    def rounded(x: Any) -> Any:
        if isinstance(x, float):
            return float(f"{x:.6g}") if math.isfinite(x) else str(x)
        if isinstance(x, list):
            return [rounded(v) for v in x]
        if isinstance(x, dict):
            return {k: rounded(v) for k, v in x.items()}
        return x

    return json.dumps(rounded({k: v for k, v in entry.items() if k not in ("layer", "encoding")}), sort_keys=True)


def _where(members: list[tuple[str, dict[str, Any], int]]) -> str:
    """Which layer a panel draws: ``layer 3 of 0-3`` (with ``: rope`` where the label is not the encoding's name),
    and for a panel shared by several entries the layer of each entry whose layer differs from the first's."""
    label, entry, n_layers = members[0]
    where = f"layer {entry['layer']} of 0-{n_layers - 1}"
    if len(members) == 1:
        return where + (f": {entry['encoding']}" if entry["encoding"] != label else "")
    others = [f"{lab}: layer {e['layer']} of 0-{n - 1}" for lab, e, n in members[1:]
              if (e["layer"], n) != (entry["layer"], n_layers)]
    return "; ".join([where, *others])


def _columns(n: int) -> int:
    """Columns of a grid of ``n`` panels: at most `GRID_COLUMNS`, the fewest empty cells, then the most columns."""
    if n <= GRID_COLUMNS:
        return max(1, n)
    return min(range(3, GRID_COLUMNS + 1), key=lambda c: (-n % c, -c))


def draw_profiles_grid(items: list[tuple[str, dict[str, Any]]], path: str | os.PathLike,
                       title: str | None = None) -> list[list[str]]:
    """Draw several profiles into one PNG file ``path``: a grid of at most `GRID_COLUMNS` columns, one panel per
    distinct picture, each from its profile's `representative_layer` (the main panel of that layer: the curve or
    heatmap of its kind; for the data-dependent encodings the attention map), titled with the item's label and the
    layer drawn. ``items``: (label, profile from `hf_posenc.position_profile`) pairs.

    Items whose layers draw the same picture (rope, a rope/nope plan's last rope layer and rope with YaRN at
    evaluation: an untrained rotation is the same in every model) share one panel, titled with every label that
    shares it (``rope = rope×3/nope = rope + YaRN at eval``). Items with no position signal (``nope``) get no
    panel: the figure names them under its title (one panel says so when no item has a signal).

    At 100 dpi, the file is at most about 2,200 pixels wide, with 12-pt titles: legible at 100 % on a
    laptop screen.

    Returns:
        the labels of each panel, in the order drawn (one list per panel).

    Raises:
        ImportError: matplotlib is missing (the message names ``pip install "hf_posenc[study]"``).
        ValueError: ``items`` is empty.
    """
    if not items:
        raise ValueError("draw_profiles_grid needs at least one (label, profile) pair")
    panels: dict[str, list[tuple[str, dict[str, Any], int]]] = {}
    silent: list[str] = []
    for label, profile in items:
        entry = representative_layer(profile)
        if entry["kind"] == "none":
            silent.append(label)
            continue
        panels.setdefault(_drawn_as(entry), []).append((label, entry, len(profile["layers"])))
    groups = list(panels.values())
    cols = _columns(len(groups))
    rows = math.ceil(max(1, len(groups)) / cols)
    note = f"no position signal, not drawn: {', '.join(silent)}" if silent and groups else None
    heading = "\n".join(t for t in (title, note) if t)
    top = 0.5 * (heading.count("\n") + 1) if heading else 0.0
    fig = _figure((_PANEL_SIZE[0] * cols, _PANEL_SIZE[1] * rows + top))
    axes = fig.subplots(rows, cols, squeeze=False)
    if not groups:
        _draw_panel(fig, axes[0][0], {"kind": "none"}, "none", None, ", ".join(silent), title_size=12)
    for i, members in enumerate(groups):
        ax = axes[i // cols][i % cols]
        entry = members[0][1]
        what, payload = _panels(entry)[0]
        label = " = ".join(m[0] for m in members)
        where = _where(members)
        # heatmaps add a line of their own under the title
        head = f"{label}  ({where})" if what in ("grid", "matrix", "attention") else f"{label}\n{where}"
        _draw_panel(fig, ax, entry, what, payload, head, title_size=12 if len(head) < 60 else 10)
    for j in range(len(groups), rows * cols):
        axes[j // cols][j % cols].axis("off")
    if heading:
        fig.suptitle(heading, fontsize=14)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return [[m[0] for m in members] for members in groups] or [silent]
