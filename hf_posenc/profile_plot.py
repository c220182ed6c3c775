"""Drawing a position profile (the PNG of ``hf-posenc show``) with matplotlib (Agg canvas), imported lazily.

One row of panels per layer, drawn the way the papers draw each kind:

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

__all__ = ["draw_profile"]

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


def _curves(ax: Any, entry: dict[str, Any], key: str, ylabel: str) -> None:
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
        ax.legend(fontsize=6, ncol=2)


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


def _heatmap(fig: Any, ax: Any, matrix: list, title: str, xlabel: str = "", ylabel: str = "") -> None:
    """A heatmap with a colour bar; a logarithmic colour scale when every value is positive and they span more
    than a factor 100 (FoX's decays)."""
    from matplotlib.colors import LogNorm

    flat = [v for row in matrix for v in row if not math.isnan(v)]
    norm = LogNorm() if flat and min(flat) > 0 and max(flat) / min(flat) > 100 else None
    image = ax.imshow(matrix, aspect="auto", interpolation="nearest", cmap="viridis", norm=norm)
    if ylabel == "head" and len(matrix) <= 16:
        ax.set_yticks(range(len(matrix)))
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.02)
    ax.set_title(title, fontsize=8)
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


def draw_profile(profile: dict[str, Any], path: str | os.PathLike) -> None:
    """Draw ``profile`` (from :func:`hf_posenc.position_profile`) into the PNG file ``path``.

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
            if what == "curves":
                _curves(ax, entry, payload, "bias" if payload == "bias" else "trace(T_i^T T_j) / head_dim")
                ax.set_title(head, fontsize=9)
            elif what == "grid":
                shared = " (all heads)" if entry.get("shared") else ", heads left to right"
                _heatmap(fig, ax, _side_by_side(entry[payload]),
                         f"{head}\n{payload} from the centre patch{shared}", "patch column", "patch row")
            elif what == "matrix":
                _heatmap(fig, ax, entry[payload], f"{head}\ncosine similarity of position vectors", "position",
                         "position")
            elif what == "attention":
                att = entry["attention"]
                heads = len(att)
                mean = [[sum(att[h][i][j] for h in range(heads)) / heads for j in range(len(att[0][i]))]
                        for i in range(len(att[0]))]
                _heatmap(fig, ax, mean, f"{head}\nattention (mean over {heads} heads)", "key", "query")
            elif what == "quantity":
                key, title = payload
                _heatmap(fig, ax, entry[key], title, "key / token", "head")
            else:
                ax.text(0.5, 0.5, "no position signal", ha="center", va="center", transform=ax.transAxes)
                ax.set_title(head, fontsize=9)
                ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
