"""``hf-posenc study``: the papers' evaluation splits, passkey, seeds with spread, ``--jobs``, bad input.

Every split is measured on generated data and every label is checked by an independent reading of the
sequence written here (not the generator's own bookkeeping).
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from hf_posenc.cli import main as cli_main
from hf_posenc.study import StudyConfig, report, run_study
from hf_posenc.study import data as D
from hf_posenc.study.sources import make_source
from hf_posenc.study.sources import subseed as _subseed
from hf_posenc.study.train import eval_lengths

TINY = {"steps": 3, "train_len": 16, "hidden": 32, "layers": 1, "batch": 4, "eval_sequences": 6, "progress": False,
        "factors": [1, 2]}


def _labels_of(task: D.Task, length: int, seed: int, n: int = 200):
    rng = random.Random(seed)
    return [task.generate(rng, length) for _ in range(n)]


# -- flip-flop ------------------------------------------------------------------------------------------


def _flip_flop_check(task: D.FlipFlop, ids: list[int], answers: list[int]) -> list[str]:
    """Independent reading: instructions at even positions, bits at odd; a read's bit is the last write's."""
    text = task.decode(ids).split()
    ops, bits = text[0::2], text[1::2]
    assert set(ops) <= {"w", "r", "i"} and set(bits) <= {"0", "1"}
    assert ops[0] == "w" and ops[-1] == "r"
    memory = None
    expect = []
    for k, (op, bit) in enumerate(zip(ops, bits)):
        if op == "w":
            memory = bit
        elif op == "r":
            assert bit == memory
            expect.append(2 * k + 1)
    assert answers == expect
    return ops[1:-1]  # the freely drawn instructions


@pytest.mark.parametrize("split, p_ignore", [("in-distribution", 0.8), ("sparse", 0.98), ("dense", 0.1)])
def test_flip_flop_splits_have_their_ignore_rate(split, p_ignore):
    task = D.FlipFlop().splits()[split]
    free = []
    for ids, answers in _labels_of(task, 128, seed=1, n=300):
        free += _flip_flop_check(task, ids, answers)
    rate = free.count("i") / len(free)
    se = (p_ignore * (1 - p_ignore) / len(free)) ** 0.5
    assert abs(rate - p_ignore) < 5 * se + 1e-3, (split, rate)
    assert abs(free.count("w") / len(free) - (1 - p_ignore) / 2) < 5 * se + 1e-3
    assert task.describe()["p_ignore"] == pytest.approx(p_ignore)
    assert D.FlipFlop().splits()["in-distribution"] == D.FlipFlop()  # the training distribution is unchanged


# -- selective copy ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("split, scale", [("in-distribution", 1.0), ("dense", 0.5), ("sparse", 2.0)])
def test_selective_copy_splits_have_their_blank_density(split, scale):
    task = D.SelectiveCopy().splits()[split]
    train_blanks = 64 - 1 - 2 * 8  # blanks of a training sequence of 64 tokens
    for ids, answers in _labels_of(task, 64, seed=2, n=100):
        text = task.decode(ids).split()
        sep = text.index("|")
        context, copied = text[:sep], text[sep + 1 :]
        blanks = context.count("_")
        assert blanks == round(scale * train_blanks)
        assert len(ids) == task.sequence_length(64) == 2 * 8 + 1 + blanks
        symbols = [t for t in context if t != "_"]
        assert copied == symbols and len(symbols) == 8  # independent label check: the symbols, in order
        assert answers == list(range(sep + 1, len(ids)))
    x, y = D.task_batch(task, random.Random(0), 3, 64)
    assert x.shape == (3, task.sequence_length(64)) and ((y != -100).sum(1) == 8).all()


# -- counting ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("split, stretch", [("in-distribution", 1), ("ood", 4)])
def test_counting_splits_episodes_and_labels(split, stretch):
    task = D.Counting().splits()[split]
    for ids, answers in _labels_of(task, 64, seed=3, n=100):
        text = task.decode(ids).split()
        assert len(text) == 64 * stretch
        # Independent reading: split at the resets; each episode is "a= body a? n", n = the a+ in body.
        starts = [k for k, t in enumerate(text) if t == "a="]
        assert len(starts) == 4 == len(answers)
        for e, s in enumerate(starts):
            end = starts[e + 1] if e + 1 < len(starts) else len(text)
            episode = text[s:end]
            assert episode[-2] == "a?" and episode[-1] == str(episode.count("a+"))
            assert answers[e] == end - 1
        sizes = [b - a for a, b in zip(starts, [*starts[1:], len(text)])]
        assert sizes[:3] == [16 * stretch] * 3  # episodes stretched by the split, not added


# -- passkey -----------------------------------------------------------------------------------------------


def _passkey_read(task: D.Passkey, ids: list[int]) -> tuple[int, list[str], list[str], int]:
    """Independent reading: filler before the key, the key digits, the digits after the question."""
    text = task.decode(ids).split()
    k, q = text.index("K"), text.index("?")
    n = task.digits
    key, asked = text[k + 1 : k + 1 + n], text[q + 1 :]
    filler = [t for t in text[:k] + text[k + 1 + n : q]]
    assert set(filler) <= set("abcd") and all(t.isdigit() for t in key)
    assert "".join(filler) == ("abcd" * len(text))[: len(filler)]  # the filler pattern is unbroken
    return k, key, asked, len(filler)


def test_passkey_depths_and_labels():
    task = D.Passkey()
    for split, t in task.splits().items():
        offsets = []
        for ids, answers in _labels_of(t, 48, seed=4, n=60):
            k, key, asked, filler = _passkey_read(t, ids)
            assert asked == key and answers == list(range(48 - 5, 48)) and len(ids) == 48
            offsets.append(k / filler)
            if t.depth is not None:
                assert k == round(t.depth * filler)
        if split == "in-distribution":
            assert len(set(offsets)) > 10 and 0.35 < sum(offsets) / len(offsets) < 0.65  # uniform depth
        else:
            assert split == f"depth {t.depth:.2f}"
    with pytest.raises(ValueError, match="at least 13"):
        task.generate(random.Random(0), 12)


# -- the study: in-distribution numbers unchanged, splits recorded ------------------------------------------


def test_in_distribution_eval_sets_keep_their_seeds_and_splits_are_recorded():
    c = StudyConfig(task="selective-copy", **{**TINY, "train_len": 20}).resolved()
    data = make_source(c, eval_lengths(c))
    for n in (20, 40):  # the sets that the study evaluated on before splits existed
        want = D.task_batch(D.SelectiveCopy(), random.Random(_subseed(0, "eval", n)), 6, n)
        assert all(torch.equal(a, b) for a, b in zip(data.eval_sets["in-distribution", n], want))
    assert set(data.describe()["splits"]) == {"in-distribution", "dense", "sparse"}
    assert data.describe()["splits"]["sparse"]["blank_scale"] == 2.0


def test_study_with_splits_and_seeds(tmp_path):
    res = run_study(StudyConfig(encodings=["alibi"], task="flip-flop", seeds=[0, 1], out=str(tmp_path), **TINY))
    data = json.loads((tmp_path / "results.json").read_text())
    assert [(r["encoding"], r["seed"]) for r in data["results"]] == [("alibi", 0), ("alibi", 1)]
    assert data["data"]["splits"]["sparse"]["p_ignore"] == pytest.approx(0.98)
    for r in data["results"]:
        assert set(r["splits"]) == {"sparse", "dense"}
        for e in r["splits"]["sparse"]:
            assert 0 <= e["accuracy"] <= 1 and e["sequence_length"] == e["length"]
    lines = res["table"].splitlines()
    assert "**sparse**: FFL(0.98)" in res["table"] and "seeds 0, 1" in res["table"]
    # each cell: mean (min-max) over the two runs
    row = next(line for line in lines if line.startswith("| `alibi` |"))
    first = row.split("|")[2].strip().strip("*")
    vals = [100 * r["eval"][0]["metric"] for r in data["results"]]
    assert first == f"{sum(vals) / 2:.1f} ({min(vals):.1f}-{max(vals):.1f})"
    assert (tmp_path / "study.png").read_bytes()[:4] == b"\x89PNG"
    assert report.spread([0.5, 0.7]) == (0.6, 0.5, 0.7) and report.spread([1.0, None]) == (None, None, None)


@pytest.mark.slow  # the same study three times, in processes
def test_same_seeds_same_numbers_with_and_without_jobs(tmp_path):
    def numbers(res):
        return [(r["encoding"], r["seed"], r["train"]["losses"], [e["metric"] for e in r["eval"]],
                 {k: [e["metric"] for e in v] for k, v in r.get("splits", {}).items()}) for r in res["results"]]

    cfg = dict(encodings=["rope", "fire"], task="counting", out=None, **{**TINY, "train_len": 44})
    serial = run_study(StudyConfig(seeds=[0, 1], **cfg))
    parallel = run_study(StudyConfig(seeds=[0, 1], jobs=2, **cfg))
    assert numbers(parallel) == numbers(serial)
    assert numbers(serial)[0][2] != numbers(serial)[1][2]  # the seeds differ
    # --seed N is --seeds N, and a run does not depend on the other seeds of the study.
    assert numbers(run_study(StudyConfig(seed=1, **{**cfg, "encodings": ["fire"]}))) == numbers(serial)[3:]


def test_resume_keeps_runs_per_seed(tmp_path):
    cfg = dict(encodings=["nope"], task="passkey", out=str(tmp_path), **TINY)
    first = run_study(StudyConfig(seeds=[0], **cfg))
    both = run_study(StudyConfig(seeds=[0, 1], resume=True, **cfg))
    assert both["resumed"]["kept_from_results_json"] == ["nope seed 0"]
    assert both["results"][0] == json.loads(json.dumps(first["results"][0]))
    assert [r["seed"] for r in both["results"]] == [0, 1]
    assert set(both["results"][1]["splits"]) == {f"depth {d:.2f}" for d in D.Passkey.DEPTHS}


# -- bad input through the command line --------------------------------------------------------------------


def test_cli_bad_input_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["study", "--task", "sorting"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'sorting'" in err and "passkey" in err and "Traceback" not in err
    for args, message in (
        (["--task", "passkey", "--train-len", "12"], "below the minimum of --task passkey: sequences of at least 13"),
        (["--task", "selective-copy", "--train-len", "10"], "at least 17"),
        (["--seeds", "0", "-1"], "--seeds must be integers >= 0"),
        (["--jobs", "0"], "--jobs must be an integer >= 1"),
    ):
        assert cli_main(["study", *args, "--no-progress", "--out", "/nonexistent/never"]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err


@pytest.mark.slow  # a whole study
def test_resume_of_a_results_json_from_before_the_splits(tmp_path):
    """A task study written before splits and seeds existed (no "splits", no "seed") resumes: its runs are kept
    and read '-' in the split tables; the new runs get the splits."""
    cfg = {"task": "flip-flop", "out": str(tmp_path), **TINY}
    run_study(StudyConfig(encodings=["nope"], **cfg))
    path = tmp_path / "results.json"
    old = json.loads(path.read_text())
    del old["data"]["splits"]
    for key in ("seeds", "jobs"):
        del old["settings"][key]
    for r in old["results"]:
        del r["splits"], r["seed"]
    path.write_text(json.dumps(old))
    res = run_study(StudyConfig(encodings=["nope", "alibi"], resume=True, **cfg))
    assert res["resumed"]["kept_from_results_json"] == ["nope"]
    assert "splits" in res["results"][1] and res["results"][0]["seed"] == 0
    sparse = res["table"].split("**sparse**")[1]
    assert "| `nope` | - | - |" in sparse and "| `alibi` | " in sparse
