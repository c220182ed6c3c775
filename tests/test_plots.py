"""The study's pictures read at a glance: every entry has a colour-and-marker pair of its own, a dashed line shows
dashed in the legend, log axes are labelled across the data, coinciding lines and identical profiles are drawn
once with every entry they stand for named, and the conversion plot keeps one kind of point per panel and is
titled from the checkpoint's directory or id."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from matplotlib.figure import Figure  # noqa: E402

from hf_posenc.study import report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONVERSION = ROOT / "benchmarks/results/study_convert_smollm2.json"


@pytest.fixture
def figures(monkeypatch):
    """The figures the plots save, captured (they are still written)."""
    saved = []
    real = Figure.savefig

    def savefig(fig, *args, **kwargs):
        saved.append(fig)
        return real(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return saved


def test_every_entry_has_its_own_colour_and_marker():
    pairs = [(tuple(s["color"]), s["marker"]) for s in map(report.entry_style, range(60))]
    assert len(set(pairs)) == 60
    assert len({p[0] for p in pairs[:20]}) == 20


@pytest.mark.parametrize("lo, hi", [(6.78, 15.81), (5.29, 4253.0), (0.5, 0.9), (11.0, 11.0), (1.0, 1e9)])
def test_log_ticks_label_the_axis_across_the_data(lo, hi):
    ticks = report.log_ticks(lo, hi)
    assert 2 <= len(ticks) <= 9 or lo == hi
    assert ticks[0] <= lo and ticks[-1] >= hi
    assert ticks == sorted(set(ticks))
    if hi / lo < 10:  # within a decade: ticks between the ends too, not only powers of ten
        assert any(lo < t < hi for t in ticks) or hi / lo < 1.3


def test_coinciding_lines_are_drawn_once_with_every_entry_named():
    groups = report.same_lines([(0, "rope", [10.0, 7.0]), (1, "rope+fox", [10.0, 7.0001]),
                                (2, "nope", [60.0, 50.0]), (3, "fire", [60.3, 50.2]), (4, "alibi", [90.0, 80.0])])
    assert [(i, report.joined_label(labels)) for i, labels, _ in groups] == [
        (0, "rope = rope+fox"), (2, "nope ≈ fire"), (4, "alibi")]


def test_study_plot_styles_legend_and_log_ticks(tmp_path, figures):
    results = _text_results(["nope", "sinusoidal", "learned", "rope", "alibi", "kerple", "fire", "fox", "cope", "sba",
                             "rope*3/nope", "rope:eval_scaling=yarn"])
    report.plot(results, tmp_path / "study.png")
    ax = figures[-1].axes[0]
    lines = [line for line in ax.get_lines() if line.get_label() and not line.get_label().startswith("_")]
    assert len({(line.get_color() if isinstance(line.get_color(), str) else tuple(line.get_color()),
                 line.get_marker()) for line in lines}) == len(lines) == 12
    learned = next(line for line in lines if line.get_label().startswith("learned"))
    assert learned.get_linestyle() == "--" and "dashed" in learned.get_label()
    legend = ax.get_legend()
    assert legend.handlelength >= 3  # long enough to show the dashes beside the marker
    values = [v for line in lines for v in line.get_ydata()]
    shown = [t for t in ax.get_yticks() if ax.get_ylim()[0] <= t <= ax.get_ylim()[1]]
    assert min(shown) <= min(values) * 1.1 and max(shown) >= max(values) / 1.1  # labelled across the data
    assert all(label.get_text() for label in ax.get_yticklabels() if ax.get_ylim()[0] <= label.get_position()[1]
               <= ax.get_ylim()[1])


def _text_results(names: list[str]) -> dict:
    """A text study's results, made up: entry k's perplexity grows with the length at its own rate."""
    lengths = [64, 128, 256, 512]
    runs = []
    for k, name in enumerate(names):
        base = name.split(":")[0].split("*")[0]
        evals = [{"length": n, "metric": 7.0 + 0.3 * k + 0.8 * k * math.log2(n / 64) / 3} for n in lengths]
        runs.append({"encoding": name, "name": base, "label": name, "status": "ok", "eval": evals,
                     "train": {"losses": [2.0, 1.9]}})
    return {"study": {"task": "text", "family": "llama", "length_unit": "tokens", "train_length": 64,
                      "eval_lengths": lengths, "eval_factors": [1, 2, 4, 8]},
            "settings": {"seed": 0, "steps": 300}, "data": {}, "results": runs}


def test_conversion_plot_keeps_one_kind_of_point_per_panel(tmp_path, figures):
    results = json.loads(CONVERSION.read_text())
    report.plot(results, tmp_path / "convert.png")
    steps_ax, start_ax, tuned_ax = figures[-1].axes
    steps = results["settings"]["steps"]
    for line in steps_ax.get_lines():  # loss curves only: no evaluated point at step 0
        assert list(line.get_xdata()) == list(range(1, steps + 1))
    x = results["study"]["eval_lengths"]
    for ax in (start_ax, tuned_ax):
        assert all(list(line.get_xdata()) == x for line in ax.get_lines())
    labels = [line.get_label() for line in tuned_ax.get_lines()]
    # rope and the inert compositions coincide after fine-tuning: one line names all three
    assert any(label.startswith("rope = rope+fox(init=identity) = rope+fire(init=identity)") for label in labels)
    assert "not trained: rope + YaRN at eval" in tuned_ax.get_title()
    title = figures[-1].texts[0].get_text() if figures[-1].texts else figures[-1]._suptitle.get_text()
    assert "Smollm2 135M 8k" not in title and "--from smollm2 (smollm2-135m-instruct-q4_1)" in title


@pytest.mark.parametrize("source, title", [
    ("HuggingFaceTB/SmolLM2-135M", "HuggingFaceTB/SmolLM2-135M"),
    ("/data/ckpt/my-llama", "my-llama"),
    ("out/convert/llama", "llama"),
])
def test_conversion_title_is_the_checkpoint_directory_or_id(source, title):
    results = copy.deepcopy(json.loads(CONVERSION.read_text()))
    results["settings"]["source"] = source
    assert report.checkpoint_title(results) == title


def test_identical_profiles_share_a_panel_and_no_signal_gets_none(tmp_path, figures):
    import hf_posenc
    from hf_posenc.profile_plot import draw_profiles_grid

    from conftest import make_model

    rope = hf_posenc.position_profile(make_model("llama", encoding="rope"), length=6)
    plan = hf_posenc.position_profile(hf_posenc.patch_model(make_model("llama"), ["rope", "nope"]), length=6)
    alibi = hf_posenc.position_profile(make_model("llama", encoding="alibi"), length=6)
    nope = hf_posenc.position_profile(make_model("llama", encoding="nope"), length=6)
    panels = draw_profiles_grid([("nope", nope), ("rope", rope), ("alibi", alibi), ("rope/nope", plan)],
                                tmp_path / "grid.png", title="overview")
    assert panels == [["rope", "rope/nope"], ["alibi"]]
    fig = figures[-1]
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert titles[0].startswith("rope = rope/nope\n") and "rope/nope: layer 0" in titles[0]
    assert "no position signal, not drawn: nope" in fig._suptitle.get_text()
    assert draw_profiles_grid([("nope", nope)], tmp_path / "none.png") == [["nope"]]
