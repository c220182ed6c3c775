"""``hf-posenc study``: corpus reader, synthetic task generators, an end-to-end tiny study, determinism."""

from __future__ import annotations

import json
import random

import pytest
import torch

from hf_posenc.cli import main as cli_main
from hf_posenc.study import StudyConfig, run_study
from hf_posenc.study import data as D
from hf_posenc.study.train import eval_lengths, parse_encoding

# A tiny study: 1 layer, hidden 32, 3 steps, trained at 8 tokens, evaluated at 8..64.
TINY = dict(steps=3, train_len=8, hidden=32, layers=1, batch=4, eval_tokens=128, eval_sequences=8, progress=False)


# -- corpus ---------------------------------------------------------------------------------------------


def test_stdlib_corpus_is_deterministic_and_split_by_file():
    a, b = D.load_corpus(), D.load_corpus()
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val)
    assert a.describe() == b.describe()
    _, files = D.stdlib_files()
    assert files == sorted(files) and "os.py" in files
    assert a.val_files == files[::10]
    assert set(a.train_files) | set(a.val_files) == set(files) and not set(a.train_files) & set(a.val_files)
    assert a.train.dtype == torch.long and 0 <= int(a.train.min()) and int(a.train.max()) <= 255
    assert a.train.numel() > 1_000_000 and a.val.numel() > 100_000


def test_folder_and_file_corpus(tmp_path):
    for i in range(12):
        (tmp_path / f"f{i:02d}.txt").write_bytes(f"file {i}\n".encode())
    (tmp_path / ".hidden").write_bytes(b"hidden")
    (tmp_path / "blob.bin").write_bytes(b"\0\1\2")
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "z.txt").write_bytes(b"sub z\n")
    c = D.load_corpus(tmp_path)
    names = [f"f{i:02d}.txt" for i in range(12)] + ["sub/z.txt"]
    assert c.val_files == ["f00.txt", "f10.txt"]
    assert c.train_files == [n for n in names if n not in c.val_files]
    assert bytes(c.val.tolist()) == b"file 0\n" + D.FILE_SEPARATOR + b"file 10\n"
    assert bytes(c.train.tolist()).endswith(b"file 11\n" + D.FILE_SEPARATOR + b"sub z\n")

    one = tmp_path / "sub" / "z.txt"
    one.write_bytes(b"".join(b"line %d\n" % i for i in range(100)))
    c = D.load_corpus(one)
    assert bytes(c.train.tolist()) + bytes(c.val.tolist()) == one.read_bytes()
    assert bytes(c.train.tolist()).endswith(b"\n") and 0.05 < c.val.numel() / one.stat().st_size < 0.15
    with pytest.raises(ValueError, match="no such file"):
        D.load_corpus(tmp_path / "missing")


def test_eval_windows_cover_the_same_bytes_at_every_length():
    data = torch.arange(1000) % 256
    w = D.eval_windows(data, [8, 16, 32], tokens=100)
    assert {k: tuple(v.shape) for k, v in w.items()} == {8: (12, 8), 16: (6, 16), 32: (3, 32)}
    assert torch.equal(w[8].flatten(), w[32].flatten())
    w = D.eval_windows(data, [8, 12], tokens=100)  # chunks of lcm(8, 12) = 24 bytes
    assert {k: tuple(v.shape) for k, v in w.items()} == {8: (12, 8), 12: (8, 12)}
    assert torch.equal(w[8].flatten(), w[12].flatten())
    with pytest.raises(ValueError, match="common multiple"):
        D.eval_windows(data, [61, 64], tokens=100)


# -- synthetic tasks: hand-checked examples ------------------------------------------------------------


class ScriptedRng:
    """A stand-in for random.Random that returns scripted values, to build hand-checked sequences."""

    def __init__(self, random=(), randrange=(), randint=(), sample=(), choice=(), shuffle=None):
        self._q = {"random": list(random), "randrange": list(randrange), "randint": list(randint),
                   "sample": list(sample), "choice": list(choice)}
        self._shuffle = shuffle

    def random(self):
        return self._q["random"].pop(0)

    def randrange(self, n):
        v = self._q["randrange"].pop(0)
        assert 0 <= v < n
        return v

    def randint(self, a, b):
        v = self._q["randint"].pop(0)
        assert a <= v <= b
        return v

    def sample(self, population, k):
        v = self._q["sample"].pop(0)
        assert len(v) == k and all(x in population for x in v)
        return v

    def choice(self, seq):
        v = self._q["choice"].pop(0)
        assert v in seq
        return v

    def shuffle(self, x):
        if self._shuffle is not None:
            x[:] = [x[i] for i in self._shuffle]


def test_flip_flop_hand_checked():
    t = D.FlipFlop()
    # instruction 1 is always w (bit 1); u = 0.5 -> i (bit 0); u = 0.15 -> r; the last is always r.
    rng = ScriptedRng(random=[0.5, 0.15], randrange=[1, 0])
    ids, answers = t.generate(rng, 8)
    assert t.decode(ids) == "w 1 i 0 r 1 r 1"
    assert answers == [5, 7]
    # a second write overrides the first: w 0, u = 0.05 -> w (bit 1), u = 0.9 -> i (bit 0), then r -> 1.
    rng = ScriptedRng(random=[0.05, 0.9], randrange=[0, 1, 0])
    ids, answers = t.generate(rng, 8)
    assert t.decode(ids) == "w 0 w 1 i 0 r 1" and answers == [7]


def test_selective_copy_hand_checked():
    t = D.SelectiveCopy(num_symbols=3, num_copy=2)
    rng = ScriptedRng(sample=[[1, 4]], randrange=[2, 0])
    ids, answers = t.generate(rng, 9)
    assert t.decode(ids) == "_ c _ _ a _ | c a"
    assert answers == [7, 8]


def test_counting_hand_checked():
    t = D.Counting(num_vars=2, max_count=2, episodes=1)
    # queried variable a, n = 2 increments of a, d = 1 distractor increment of b, 6 - 3 = 3 no-ops; the
    # scripted shuffle puts the body in the order [.  a+  b+  .  a+  .].
    rng = ScriptedRng(randrange=[0], randint=[2, 1], choice=[1], shuffle=[3, 0, 2, 4, 1, 5])
    ids, answers = t.generate(rng, 9)
    assert t.decode(ids) == "a= . a+ b+ . a+ . a? 2"
    assert answers == [8]
    t1 = D.Counting(max_count=3, episodes=2)
    rng = ScriptedRng(randrange=[0, 0], randint=[1, 0], shuffle=None)
    ids, answers = t1.generate(rng, 12)
    assert t1.decode(ids) == "a= a+ . . a? 1 a= . . . a? 0" and answers == [5, 11]


def _oracle_answers(task: D.Task, ids: list[int]) -> list[tuple[int, int]]:
    """(position, expected token) of every answer, recomputed from the decoded sequence's semantics."""
    toks = [task.tokens[i] for i in ids]
    out = []
    if isinstance(task, D.FlipFlop):
        mem = None
        for k in range(0, len(toks), 2):
            op, bit = toks[k], toks[k + 1]
            if op == "w":
                mem = bit
            elif op == "r":
                out.append((k + 1, task.token_id(mem)))
    elif isinstance(task, D.SelectiveCopy):
        sep = toks.index("|")
        symbols = [ids[i] for i in range(sep) if toks[i] != "_"]
        out = [(sep + 1 + j, s) for j, s in enumerate(symbols)]
    else:
        counts: dict[str, int] = {}
        for i, tok in enumerate(toks):
            if tok.endswith("="):
                counts[tok[0]] = 0
            elif tok.endswith("+"):
                counts[tok[0]] = counts.get(tok[0], 0) + 1
            elif tok.endswith("?"):
                out.append((i + 1, task.token_id(str(counts[tok[0]]))))
    return out


@pytest.mark.parametrize(
    "task", [D.FlipFlop(), D.SelectiveCopy(), D.Counting(), D.Counting(num_vars=3, max_count=4)], ids=repr
)
@pytest.mark.parametrize("length", [64, 200])
def test_task_labels_match_an_independent_oracle(task, length):
    rng = random.Random(0)
    for _ in range(20):
        ids, answers = task.generate(rng, length)
        assert len(ids) == length and all(0 <= i < task.vocab_size for i in ids)
        assert [(p, ids[p]) for p in answers] == _oracle_answers(task, ids)
    x, y = D.task_batch(task, random.Random(1), 3, length)
    assert x.shape == y.shape == (3, length)
    mask = y != -100
    assert torch.equal(y[mask], x[mask]) and mask.any(dim=1).all()


def test_task_generators_are_seeded():
    for name in D.TASKS:
        t = D.get_task(name)
        assert t.generate(random.Random(5), 64) == t.generate(random.Random(5), 64)
    with pytest.raises(ValueError, match="at least"):
        D.SelectiveCopy().generate(random.Random(0), 10)
    with pytest.raises(ValueError, match="unknown task"):
        D.get_task("sorting")


# -- end to end -----------------------------------------------------------------------------------------


def test_tiny_study_end_to_end(tmp_path):
    res = run_study(StudyConfig(encodings=["nope", "learned", "alibi"], out=str(tmp_path), **TINY))
    data = json.loads((tmp_path / "results.json").read_text())
    png = (tmp_path / "study.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert (tmp_path / "table.md").read_text() == res["table"]
    assert data["study"]["eval_lengths"] == [8, 16, 32, 64] and data["study"]["eval_factors"] == [1, 2, 4, 8]
    assert data["study"]["metric"] == "perplexity" and data["errors"] == 0
    assert data["settings"]["seed"] == 0 and data["settings"]["steps"] == 3
    env = data["environment"]
    for key in ("python", "torch", "transformers", "hf_posenc", "device", "torch_threads"):
        assert env[key] is not None
    assert data["data"]["source"] == "stdlib" and len(data["data"]["train_sha256"]) == 64
    assert [r["encoding"] for r in data["results"]] == ["nope", "learned", "alibi"]
    for r in data["results"]:
        assert r["status"] == "ok" and len(r["train"]["losses"]) == 3
        assert [e["length"] for e in r["eval"]] == [8, 16, 32, 64]
        for e in r["eval"]:
            assert e["perplexity"] == pytest.approx(torch.tensor(e["loss"]).exp().item(), rel=1e-6)
            assert 1 < e["perplexity"] < 1000 and e["tokens"] > 0
        assert "loss_beyond_train_len" in r["eval"][-1]
    learned = data["results"][1]
    assert learned["position_encoding"]["max_positions"] == 64 and learned["notes"]
    lines = res["table"].splitlines()
    assert lines[0] == "| encoding | 8 (1x) | 16 (2x) | 32 (4x) | 64 (8x) |"
    assert lines[3].startswith("| `learned` |") and "†" in lines[3]


def test_same_seed_same_numbers():
    def numbers(res):
        return [(r["train"]["losses"], [e["metric"] for e in r["eval"]]) for r in res["results"]]

    cfg = dict(encodings=["rope", "fire"], out=None, **TINY)
    before = (torch.are_deterministic_algorithms_enabled(), torch.get_num_threads())
    a, b = run_study(StudyConfig(**cfg)), run_study(StudyConfig(**cfg))
    assert numbers(a) == numbers(b)
    assert numbers(run_study(StudyConfig(**{**cfg, "seed": 1}))) != numbers(a)
    # A model's numbers do not depend on the other encodings in the run.
    alone = run_study(StudyConfig(**{**cfg, "encodings": ["fire"]}))
    assert numbers(alone) == numbers(a)[1:]
    # The study restores the caller's torch settings.
    assert (torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()) == before


@pytest.mark.slow  # two studies; test_tiny_study_end_to_end is the fast one
def test_synthetic_task_and_vit_studies(tmp_path):
    res = run_study(StudyConfig(encodings=["cope"], task="selective-copy", out=None, **{**TINY, "train_len": 20}))
    r = res["results"][0]
    assert res["study"]["metric"] == "accuracy" and r["status"] == "ok"
    assert [e["length"] for e in r["eval"]] == [20, 40, 80, 160]
    assert all(0 <= e["accuracy"] <= 1 and e["answers"] == 8 * 8 for e in r["eval"])  # 8 sequences x 8 answers

    res = run_study(StudyConfig(encodings=["learned", "sba"], family="vit", out=str(tmp_path), **TINY))
    assert res["study"]["eval_lengths"] == [8, 12, 16, 24]  # sides: 4, 9, 16, 36 patches of 4 px
    learned, sba = res["results"]
    assert learned["status"] == "ok" and [e["patches"] for e in learned["eval"]] == [4, 9, 16, 36]
    assert sba["status"] == "ok" and [e["patches"] for e in sba["eval"]] == [4, 9, 16, 36]  # grid-order sba
    assert (tmp_path / "study.png").exists()


def test_cli_study(tmp_path, capsys):
    rc = cli_main(["study", "--encodings", "alibi", "kerple:variant=power", "--steps", "2", "--train-len", "8",
                   "--hidden", "32", "--layers", "1", "--batch", "2", "--eval-tokens", "64", "--out", str(tmp_path),
                   "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "| `alibi` |" in out and "| `kerple(variant=power)` |" in out and "results.json" in out
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["results"][1]["position_encoding"]["variant"] == "power"

    assert cli_main(["study", "--family", "vit", "--task", "counting"]) == 2
    assert "does not fit --family vit" in capsys.readouterr().err
    assert cli_main(["study", "--encodings", "nosuch"]) == 2
    assert "unknown position encoding" in capsys.readouterr().err


def test_config_validation_and_lengths():
    assert StudyConfig(family="vit").resolved().task == "digits"
    assert eval_lengths(StudyConfig(family="vit").resolved()) == [16, 24, 32, 44]
    assert eval_lengths(StudyConfig(task="flip-flop", train_len=10, factors=[1, 1.5]).resolved()) == [10, 16]
    with pytest.raises(ValueError, match="--data"):
        StudyConfig(task="counting", data="x").resolved()
    with pytest.raises(ValueError, match="multiple of the patch size"):
        StudyConfig(family="vit", train_len=10).resolved()
    assert parse_encoding("rope:theta=500000").params["theta"] == 500000
    assert parse_encoding("fire:per_layer=true").params["per_layer"] is True
    with pytest.raises(ValueError, match="key=value"):
        parse_encoding("rope:theta")


# -- a study never loses a run ----------------------------------------------------------------------------


def test_comma_separated_encodings():
    from hf_posenc.study.train import split_encodings

    assert split_encodings(["rope,alibi"]) == ["rope", "alibi"]
    assert split_encodings(["kerple:variant=power,per_layer=true"]) == ["kerple:variant=power,per_layer=true"]
    assert split_encodings(["kerple:variant=power,per_layer=true,rope,fire:per_layer=true", "nope"]) == [
        "kerple:variant=power,per_layer=true", "rope", "fire:per_layer=true", "nope"]
    assert split_encodings(["rope", "alibi"]) == ["rope", "alibi"]
    for bad, match in ((["rope,,alibi"], "empty name"), (["rope,"], "empty name"), (["theta=2,rope"], "no encoding"),
                       (["rope,theta=2"], "no encoding")):
        with pytest.raises(ValueError, match=match):
            split_encodings(bad)
    c = StudyConfig(encodings=["rope,alibi", "kerple:variant=power,per_layer=true,rope"]).resolved()
    assert c.encodings == ["rope", "alibi", "kerple:variant=power,per_layer=true"]  # the second rope is a duplicate
    assert parse_encoding(c.encodings[2]).params["per_layer"] is True


def test_missing_optional_dependency_stops_before_training(tmp_path, monkeypatch, capsys):
    """Without matplotlib (or scikit-learn for ViT) the study says how to install them before the first step."""
    import sys

    from hf_posenc.study import MissingDependencyError
    from hf_posenc.study import train as T

    def no_training(*a, **k):
        raise AssertionError("trained although a dependency is missing")

    monkeypatch.setattr(T, "_train_and_eval", no_training)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # importlib.util.find_spec -> None
    with pytest.raises(MissingDependencyError, match=r'pip install "hf_posenc\[study\]"'):
        run_study(StudyConfig(encodings=["nope"], out=str(tmp_path), **TINY))
    assert not any(tmp_path.iterdir())
    assert cli_main(["study", "--encodings", "nope", "--steps", "1", "--out", str(tmp_path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "matplotlib" in err and 'pip install "hf_posenc[study]"' in err and "Traceback" not in err
    monkeypatch.setitem(sys.modules, "sklearn", None)
    with pytest.raises(MissingDependencyError, match="scikit-learn"):
        run_study(StudyConfig(encodings=["nope"], family="vit", out=None, **TINY))


def test_interrupted_study_keeps_finished_models_and_resumes(tmp_path, monkeypatch, capsys):
    """Ctrl-C during the second model: results.json and table.md hold the first. --resume trains only the
    rest, and the numbers equal those of an uninterrupted study."""
    from hf_posenc.study import train as T

    real = T._train_and_eval
    calls = []

    def interrupt_second(spec, *a, **k):
        calls.append(spec)
        if spec == "alibi":
            raise KeyboardInterrupt
        return real(spec, *a, **k)

    monkeypatch.setattr(T, "_train_and_eval", interrupt_second)
    args = ["study", "--encodings", "nope,alibi", "--steps", "3", "--train-len", "8", "--hidden", "32", "--layers",
            "1", "--batch", "4", "--eval-tokens", "128", "--out", str(tmp_path), "--no-progress"]
    assert cli_main(args) == 130
    assert "--resume" in capsys.readouterr().err
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["complete"] is False and [r["encoding"] for r in data["results"]] == ["nope"]
    assert "| `nope` |" in (tmp_path / "table.md").read_text()
    assert not (tmp_path / "study.png").exists()

    monkeypatch.setattr(T, "_train_and_eval", lambda spec, *a, **k: calls.append(spec) or real(spec, *a, **k))
    calls.clear()
    assert cli_main([*args, "--resume"]) == 0
    assert calls == ["alibi"]  # nope was kept
    resumed = json.loads((tmp_path / "results.json").read_text())
    assert resumed["complete"] is True and resumed["resumed"]["kept_from_results_json"] == ["nope"]
    assert (tmp_path / "study.png").exists()
    fresh = run_study(StudyConfig(encodings=["nope", "alibi"], out=None, **TINY))
    assert [r["train"]["losses"] for r in resumed["results"]] == [r["train"]["losses"] for r in fresh["results"]]
    assert [[e["metric"] for e in r["eval"]] for r in resumed["results"]] == [
        [e["metric"] for e in r["eval"]] for r in fresh["results"]]

    # Other settings: refused, naming the setting and both values; nothing is trained or overwritten.
    calls.clear()
    before = (tmp_path / "results.json").read_text()
    assert cli_main([*args[:4], "5", *args[5:], "--resume"]) == 2
    err = capsys.readouterr().err
    assert "steps 3 (now 5)" in err and "Traceback" not in err
    assert calls == [] and (tmp_path / "results.json").read_text() == before
    with pytest.raises(ValueError, match="no .*results.json"):
        run_study(StudyConfig(encodings=["nope"], out=str(tmp_path / "empty"), resume=True, **TINY))
    with pytest.raises(ValueError, match="--out"):
        StudyConfig(encodings=["nope"], out=None, resume=True).resolved()


def test_failing_plot_keeps_results(tmp_path, monkeypatch, capsys):
    from hf_posenc.study import report

    def broken(results, path):
        raise RuntimeError("no display")

    monkeypatch.setattr(report, "plot", broken)
    rc = cli_main(["study", "--encodings", "nope", "--steps", "2", "--train-len", "8", "--hidden", "32", "--layers",
                   "1", "--batch", "2", "--eval-tokens", "64", "--out", str(tmp_path), "--no-progress"])
    assert rc == 1
    assert "plot failed" in capsys.readouterr().err
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["plot_error"] == "RuntimeError: no display" and data["results"][0]["status"] == "ok"
    assert (tmp_path / "table.md").read_text() == data["table"]
