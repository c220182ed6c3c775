"""Study entries beyond one encoding: plans, windows, partial rotary, scaling at evaluation only (issue 22)."""

from __future__ import annotations

import pytest

from hf_posenc.cli import main as cli_main
from hf_posenc.study import StudyConfig, run_study
from hf_posenc.study.recipes import entry_label, parse_study_entry

TINY = dict(steps=3, train_len=8, hidden=32, layers=4, batch=4, eval_tokens=128, eval_sequences=8, progress=False)


@pytest.mark.parametrize("spec, label, layers", [
    ("rope", "rope", None),
    ("rope*3/nope", "rope×3/nope", ["rope", "rope", "rope", "nope"]),
    ("rope:window=16*3/nope", "rope(window=16)×3/nope", ["rope", "rope", "rope", "nope"]),
    ("alibi/fire", "alibi/fire", ["alibi", "fire"]),
    ("rope:partial_rotary_factor=0.5", "rope(partial_rotary_factor=0.5)", None),
    ("rope:eval_scaling=yarn", "rope + YaRN at eval", None),
    ("rope:eval_scaling=linear*3/nope", "rope×3/nope + PI at eval", ["rope", "rope", "rope", "nope"]),
    ("rope:window=8192,sink=4,zero_shot=true", "rope(window=8192, sink=4) zero-shot", None),
    ("rope:window=64*3/nope/...", "rope(window=64)×3/nope/…", ["rope", "rope", "rope", "nope"]),
    ("nope:qk_norm=qk", "nope(qk_norm=qk)", None),
    ("nope:length_scale=ssmax", "nope(length_scale=ssmax)", None),
])
def test_entries_and_labels(spec, label, layers):
    entry = parse_study_entry(spec)
    assert entry.label == label
    assert (entry.names if entry.is_plan else None) == layers
    assert entry_label(entry.encoding, entry.eval_scaling, entry.zero_shot, entry.fills_depth) == label


def test_plan_that_fills_the_depth():
    entry = parse_study_entry("rope:window=64*3/nope/...")
    assert entry.fills_depth and not entry.zero_shot
    full = entry.to_depth(10)
    assert full.names == ["rope", "rope", "rope", "nope"] * 2 + ["rope", "rope"] and not full.fills_depth
    assert full.encoding[0].window == 64 and full.label == entry.label
    assert parse_study_entry("rope*3/nope").to_depth(10).names == ["rope", "rope", "rope", "nope"]  # not filling
    with pytest.raises(ValueError, match="may only end a plan"):
        parse_study_entry("rope/.../nope")
    with pytest.raises(ValueError, match="zero_shot is true or false"):
        parse_study_entry("rope:zero_shot=3")
    with pytest.raises(ValueError, match="applies to a conversion study"):
        StudyConfig(encodings=["rope:zero_shot=true"]).resolved()


@pytest.mark.parametrize("spec, pattern", [
    ("rope//nope", "empty plan entry"),
    ("alibi:eval_scaling=yarn", "eval_scaling applies to rope only"),
    ("rope:eval_scaling=ntk", "eval_scaling must be one of yarn, linear"),
    ("rope:window=0", "must be >= 1"),
    ("rope*0/nope", "repeat count must be >= 1"),
    ("bogus/nope", "unknown position encoding 'bogus'"),
])
def test_bad_entries(spec, pattern):
    with pytest.raises((ValueError, TypeError), match=pattern):
        parse_study_entry(spec)


def test_plan_must_divide_layers_is_a_clean_cli_error(tmp_path, capsys):
    code = cli_main(["study", "--encodings", "rope*2/nope", "--layers", "4", "--steps", "1", "--no-progress",
                     "--out", str(tmp_path)])
    assert code == 2
    err = capsys.readouterr().err
    assert "must divide --layers (4)" in err and "Traceback" not in err


@pytest.mark.slow  # a whole study
def test_eval_scaling_study(tmp_path):
    """rope and rope + YaRN at eval train the same model (same numbers at 1x, the training length) and differ
    past it, where the evaluation ran with YaRN of factor L / T (recorded per length); a plan and a window run."""
    res = run_study(StudyConfig(encodings=["rope", "rope:eval_scaling=yarn", "rope:window=4*3/nope"],
                                out=str(tmp_path), **TINY))
    assert res["errors"] == 0
    rope, yarn, plan = res["results"]
    assert yarn["label"] == "rope + YaRN at eval" and plan["label"] == "rope(window=4)×3/nope"
    assert yarn["train"]["losses"] == rope["train"]["losses"]
    assert yarn["eval"][0]["metric"] == rope["eval"][0]["metric"]
    assert "scaling" not in yarn["eval"][0]["eval_position_encoding"] or \
        yarn["eval"][0]["eval_position_encoding"]["scaling"] is None
    for e in yarn["eval"][1:]:
        scaling = e["eval_position_encoding"]["scaling"]
        assert scaling == {"rope_type": "yarn", "factor": e["length"] / 8, "original_max_position_embeddings": 8}
    assert yarn["eval"][-1]["metric"] != rope["eval"][-1]["metric"]
    assert [e["window"] if "window" in e else None for e in plan["position_encoding"]] == [4, 4, 4, None]
    assert "rope + YaRN at eval" in (tmp_path / "table.md").read_text()


@pytest.mark.slow  # a whole study
def test_study_writes_what_each_model_learned(tmp_path):
    """Every trained run's profile (profiles/<run>.json, a position_profile) and profiles.png side by side; the
    task's profile of a data-dependent encoding is drawn on one of the task's sequences."""
    import json

    res = run_study(StudyConfig(encodings=["alibi", "cope"], task="selective-copy", out=str(tmp_path),
                                **{**TINY, "train_len": 20, "layers": 2}))
    assert res["errors"] == 0 and (tmp_path / "profiles.png").stat().st_size > 0
    for run in res["results"]:
        profile = json.loads((tmp_path / run["profile"]).read_text())
        assert len(profile["layers"]) == 2 and (tmp_path / run["profile"].replace(".json", ".png")).is_file()
    cope = json.loads((tmp_path / res["results"][1]["profile"]).read_text())
    assert cope["layers"][0]["kind"] == "data_dependent" and len(cope["tokens"]) == 20


def test_profiles_overview_is_a_grid_of_at_most_four_columns(tmp_path):
    """profiles.png: one panel per entry, from its last layer with a position signal (the rope layer of a
    rope/nope plan), titled with the entry; at most 4 columns and 2,400 px wide, so 5 entries give 2 rows."""
    from matplotlib.figure import Figure
    from PIL import Image

    import hf_posenc
    from hf_posenc import profile_plot
    from hf_posenc.profile_plot import draw_profiles_grid, representative_layer

    from conftest import make_model

    plan = hf_posenc.patch_model(make_model("llama"), ["rope", "nope"])
    profile = hf_posenc.position_profile(plan, length=6)
    assert representative_layer(profile)["encoding"] == "rope" and representative_layer(profile)["layer"] == 0
    nope = hf_posenc.position_profile(make_model("llama", encoding="nope"), length=6)
    assert representative_layer(nope)["layer"] == len(nope["layers"]) - 1  # no signal anywhere: the last layer
    titles = []
    real_savefig = Figure.savefig

    def savefig(fig, *args, **kwargs):
        titles.extend(ax.get_title() for ax in fig.axes if ax.get_title())
        return real_savefig(fig, *args, **kwargs)

    # five entries whose pictures differ (the grid draws identical ones once, see tests/test_plots.py)
    items = [(f"entry {i}", hf_posenc.position_profile(make_model("llama", encoding=name), length=6))
             for i, name in enumerate(("alibi", "kerple", "t5", "sandwich", "fire"))]
    try:
        Figure.savefig = savefig
        draw_profiles_grid(items, tmp_path / "grid.png", title="overview")
    finally:
        Figure.savefig = real_savefig
    width, height = Image.open(tmp_path / "grid.png").size
    assert width <= 2400 and width > height  # 3 columns, 2 rows (the fewest empty cells)
    assert [t.split("\n")[0].split("  (")[0] for t in titles] == [f"entry {i}" for i in range(5)]
    assert profile_plot.GRID_COLUMNS == 4
    with pytest.raises(ValueError, match="at least one"):
        draw_profiles_grid([], tmp_path / "none.png")
