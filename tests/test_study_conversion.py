"""The conversion study (``hf-posenc study --from CHECKPOINT``) on a tiny pretrained-style checkpoint made here:
a small Llama and a byte-level tokenizer saved with save_pretrained (no download)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("matplotlib")

from conftest import tiny_byte_llama_checkpoint  # noqa: E402
from hf_posenc.study import StudyConfig, run_study  # noqa: E402
from hf_posenc.study import main as study_main  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_byte_llama_checkpoint(tmp_path_factory.mktemp("ckpt"), 256)


TINY = dict(steps=2, train_len=16, batch=2, eval_tokens=128, progress=False)


def test_conversion_study_evaluates_before_after_the_swap_and_fine_tuned(checkpoint, tmp_path):
    res = run_study(StudyConfig(source=str(checkpoint), out=str(tmp_path),
                                encodings=["rope", "rope+t5:init=identity", "alibi", "rope:eval_scaling=yarn"], **TINY))
    assert res["errors"] == 0
    assert res["checkpoint"]["name"] and len(res["checkpoint"]["weights_sha256"]) == 64
    assert res["data"]["unit"] == "token" and "pydoc_data" in res["data"]["source"]
    before = [e["metric"] for e in res["before"]]
    assert [e["length"] for e in res["before"]] == [16, 32, 64]
    runs = {r["encoding"]: r for r in res["results"]}
    start = {k: [e["metric"] for e in r["eval_start"]] for k, r in runs.items()}
    assert start["rope"] == pytest.approx(before, rel=1e-6)  # rope is the unpatched model
    assert start["rope+t5:init=identity"] == pytest.approx(before, rel=1e-5)  # an inert start
    assert start["alibi"] != pytest.approx(before, rel=1e-3)  # a plain swap changes the model
    assert len(runs["rope"]["train"]["losses"]) == 2
    yarn = runs["rope:eval_scaling=yarn"]
    assert yarn["train"]["losses"] == [] and any("without training" in n for n in yarn["notes"])
    table = (tmp_path / "table.md").read_text()
    assert "unpatched (before any swap)" in table and "not trained" in table
    assert (tmp_path / "study.png").stat().st_size > 0
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["settings"]["source"] == str(checkpoint) and saved["settings"]["lr"] == 1e-4


def test_zero_shot_entries_and_plans_that_fill_the_depth(checkpoint, tmp_path):
    """``zero_shot=true`` evaluates the swap without fine-tuning; a plan ending in ``/...`` fills the checkpoint's
    depth (2 layers here: rope/nope*3/... is rope, nope), whatever --layers says."""
    res = run_study(StudyConfig(source=str(checkpoint), out=None, encodings=[
        "rope:window=8,zero_shot=true", "rope/nope*3/...", "rope/nope:zero_shot=true"], **TINY))
    assert res["errors"] == 0
    runs = {r["encoding"]: r for r in res["results"]}
    zero = runs["rope:window=8,zero_shot=true"]
    assert zero["train"]["losses"] == [] and zero["label"] == "rope(window=8) zero-shot"
    assert [e["metric"] for e in zero["eval"]] == [e["metric"] for e in zero["eval_start"]]
    assert any("zero-shot" in n for n in zero["notes"])
    filled = runs["rope/nope*3/..."]
    assert [e["name"] for e in filled["position_encoding"]] == ["rope", "nope"] and filled["train"]["losses"]
    assert runs["rope/nope:zero_shot=true"]["train"]["losses"] == []
    assert "not trained" in res["table"]


def test_conversion_resume_keeps_the_finished_runs(checkpoint, tmp_path, capsys):
    cfg = dict(source=str(checkpoint), out=str(tmp_path), **TINY)
    run_study(StudyConfig(encodings=["rope"], **cfg))
    res = run_study(StudyConfig(encodings=["rope", "nope"], resume=True, **cfg))
    assert "kept from results.json" in capsys.readouterr().err
    assert [r["encoding"] for r in res["results"]] == ["rope", "nope"]


def test_conversion_options_are_validated(checkpoint, tmp_path):
    with pytest.raises(ValueError, match="--from runs the text task"):
        StudyConfig(source=str(checkpoint), task="counting").resolved()
    with pytest.raises(ValueError, match="not a checkpoint directory"):
        run_study(StudyConfig(source=str(tmp_path), out=None, encodings=["rope"], **TINY))
    c = StudyConfig(source=str(checkpoint)).resolved()
    assert c.steps == 40 and c.factors == [1.0, 2.0, 4.0] and "rope+fox:init=identity" in c.encodings


def test_cli_from(checkpoint, tmp_path, capsys):
    import argparse

    from hf_posenc.study import add_arguments, config_from_args

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--from", str(checkpoint), "--encodings", "rope", "--steps", "1", "--train-len", "16",
                         "--batch", "1", "--eval-tokens", "64", "--no-progress", "--out", str(tmp_path)])
    assert config_from_args(args).source == str(checkpoint)
    assert study_main(args) == 0
    assert "unpatched (before any swap)" in capsys.readouterr().out


# -- --from a Hugging Face Hub id, through the local Hub cache (offline) --------------------------------------

HUB_ID = "hf-posenc-test/tiny-llama"
HUB_REVISION = "0" * 39 + "1"


def _hub_cache_with(checkpoint, root):
    """A Hub cache at ``root`` holding ``checkpoint`` as the ``main`` snapshot of ``HUB_ID`` (the layout
    huggingface_hub writes: models--org--name/refs/main -> snapshots/<commit>/files)."""
    import shutil

    repo = root / ("models--" + HUB_ID.replace("/", "--"))
    shutil.copytree(checkpoint, repo / "snapshots" / HUB_REVISION)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(HUB_REVISION)
    return root


def _study_cli(args, env_extra, tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(PYTHONPATH=str(root), HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"), **env_extra)
    return subprocess.run([sys.executable, "-m", "hf_posenc", "study", *args], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture
def offline_hub(monkeypatch, tmp_path):
    """huggingface_hub's cache at ``tmp_path/hub`` and offline mode, in this process (transformers reads both
    from ``huggingface_hub.constants`` at each call)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return tmp_path / "hub"


def test_from_a_hub_id_in_process(checkpoint, offline_hub, tmp_path):
    from hf_posenc.study.pretrained import checkpoint_record, resolve_source

    with pytest.raises(ValueError, match="HF_HUB_OFFLINE is set and the local cache does not hold it") as e:
        resolve_source(HUB_ID)
    assert str(offline_hub) in str(e.value) and f"hf download {HUB_ID}" in str(e.value)
    _hub_cache_with(checkpoint, offline_hub)
    path = resolve_source(HUB_ID)
    assert path.name == HUB_REVISION and (path / "tokenizer.json").is_file()
    record = checkpoint_record(path)
    assert record["hub_id"] == HUB_ID and record["revision"] == HUB_REVISION
    assert record["weights_sha256"] == checkpoint_record(checkpoint)["weights_sha256"]
    res = run_study(StudyConfig(source=HUB_ID, out=None, encodings=["rope"], steps=1, train_len=16, batch=1,
                                eval_tokens=64, progress=False))
    assert res["errors"] == 0 and res["checkpoint"]["hub_id"] == HUB_ID
    with pytest.raises(ValueError, match="not a Hugging Face Hub id"):
        resolve_source(str(tmp_path / "no" / "such" / "dir"))
    with pytest.raises(ValueError, match="no config.json"):
        resolve_source(str(tmp_path))


@pytest.mark.slow  # two fresh processes (the environment variables are read at import)
def test_from_a_hub_id_in_the_local_cache_offline(checkpoint, tmp_path):
    cache = _hub_cache_with(checkpoint, tmp_path / "hub")
    out = tmp_path / "out"
    proc = _study_cli(["--from", HUB_ID, "--encodings", "rope", "--steps", "1", "--train-len", "16", "--batch", "1",
                       "--eval-tokens", "64", "--no-progress", "--out", str(out)], {"HF_HUB_CACHE": str(cache)},
                      tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = json.loads((out / "results.json").read_text())
    record = saved["checkpoint"]
    assert record["hub_id"] == HUB_ID and record["name"] == HUB_ID and record["revision"] == HUB_REVISION
    local = run_study(StudyConfig(source=str(checkpoint), out=None, encodings=["rope"], steps=1, train_len=16, batch=1,
                                  eval_tokens=64, progress=False))
    assert record["weights_sha256"] == local["checkpoint"]["weights_sha256"]
    assert [e["metric"] for e in saved["before"]] == pytest.approx([e["metric"] for e in local["before"]], rel=1e-6)


@pytest.mark.slow
def test_from_a_hub_id_neither_cached_nor_downloadable(tmp_path):
    proc = _study_cli(["--from", "hf-posenc-test/not-cached", "--encodings", "rope", "--no-progress", "--out",
                       str(tmp_path / "out")], {"HF_HUB_CACHE": str(tmp_path / "empty")}, tmp_path)
    assert proc.returncode == 2
    err = proc.stderr
    assert "--from 'hf-posenc-test/not-cached'" in err and "HF_HUB_OFFLINE is set" in err, err
    assert str(tmp_path / "empty") in err and "hf download hf-posenc-test/not-cached" in err
    assert "Traceback" not in err
