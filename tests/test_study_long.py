"""The conversion study's evaluation past the pretrained context (``--long-eval``, hf_posenc/study/long.py; issue
44) on a tiny checkpoint made here (P = its max_position_embeddings = 256): the chunked prefill equals one forward,
a passkey answered on top of a cropped cache equals a standalone prompt, no attention call sees more than a chunk
of queries, and the study runs, reports and resumes it."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("matplotlib")

from conftest import tiny_byte_llama_checkpoint  # noqa: E402
import hf_posenc  # noqa: E402
from hf_posenc.study import StudyConfig, run_study  # noqa: E402
from hf_posenc.study import report  # noqa: E402
from hf_posenc.study.long import (  # noqa: E402
    _INTRO, check_long_factor, default_passkey_lengths, estimate_seconds, evaluate_long, make_long_eval, nll_bin,
)
from hf_posenc.study.recipes import apply_eval_scaling, parse_study_entry  # noqa: E402

P = 256


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_byte_llama_checkpoint(tmp_path_factory.mktemp("ckpt"), P)


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint)


def _model(checkpoint, encoding=None, **params):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="sdpa").eval()
    if encoding is not None:
        hf_posenc.patch_model(model, encoding, **params)
    return model


def _data(tokenizer, **kw):
    held_out = torch.randint(0, 200, (3 * P,), generator=torch.Generator().manual_seed(1))
    return make_long_eval(tokenizer, held_out, P, seed=0, lengths=(0.5, 1.0, 1.5, 2.0), positions=(0.0, 0.75), **kw)


@pytest.mark.parametrize("encoding,params", [(None, {}), ("rope+fox", {"init": "identity"}), ("alibi", {}),
                                              ("rope", {"window": 40, "sink": 2})],
                         ids=["unpatched", "rope+fox", "alibi", "window+sink"])
def test_chunked_bands_and_cropped_passkey_equal_plain_forwards(checkpoint, tokenizer, encoding, params):
    model = _model(checkpoint, encoding, **params)
    data = _data(tokenizer)
    assert data.chunk == P // 8 and data.window.numel() == 2 * P
    out = evaluate_long(model, data, torch.device("cpu"), progress=False)
    with torch.no_grad():
        ids = data.window[None]
        logits = model(input_ids=ids).logits[0].float()
    nll = torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:], reduction="none").double()
    for band in out["bands"]:
        lo, hi = band["band"]
        assert band["tokens"] == hi - max(lo, 1)
        assert band["loss"] == pytest.approx(float(nll[max(lo, 1) - 1 : hi - 1].mean()), rel=1e-5, abs=1e-5)
    assert [b["band"] for b in out["bands"]] == [[0, P // 2], [P // 2, P], [P, 2 * P]]
    assert len(out["passkey"]) == sum(len(h.lengths) for h in data.haystacks)
    for h in data.haystacks:
        q = h.question.numel()
        for r in [r for r in out["passkey"] if r["key"] == h.key]:
            prompt = torch.cat([h.ids[: r["length"] - q], h.question])[None]
            assert prompt.shape[1] == r["length"]
            with torch.no_grad():
                scores = model(input_ids=prompt).logits[0, -h.answer - 1 : -1].float().log_softmax(-1)
            answer = h.question[-h.answer :]
            assert r["answer_logprob"] == pytest.approx(float(scores.gather(-1, answer[:, None]).sum()), abs=1e-3)
            assert r["retrieved"] == bool((scores.argmax(-1) == answer).all())
            assert r["distance"] == r["length"] - h.key_at


def test_haystack_holds_the_key_where_it_says(tokenizer):
    data = _data(tokenizer)
    held_out = torch.randint(0, 200, (3 * P,), generator=torch.Generator().manual_seed(1))
    assert torch.equal(data.window, held_out[-2 * P :])
    for h, f in zip(data.haystacks, (0.0, 0.75)):
        sentence = tokenizer(f"\nThe pass key is {h.key}. Remember it. {h.key} is the pass key.\n",
                             add_special_tokens=False)["input_ids"]
        intro = tokenizer(_INTRO, add_special_tokens=False)["input_ids"]
        assert h.key_at == max(round(f * P), len(intro)) and h.ids[: len(intro)].tolist() == intro
        assert h.ids[h.key_at : h.key_at + len(sentence)].tolist() == sentence
        assert h.ids.numel() == 2 * P
        assert h.question[-h.answer :].tolist() == tokenizer(f" {h.key}", add_special_tokens=False)["input_ids"]
        assert all(n - h.question.numel() >= h.key_at + len(sentence) for n in h.lengths) and max(h.lengths) == 2 * P
    assert data.haystacks[0].key != data.haystacks[1].key
    with pytest.raises(ValueError, match=f"2P = {2 * P} held-out tokens"):
        make_long_eval(tokenizer, torch.zeros(2 * P - 1, dtype=torch.long), P, seed=0)
    with pytest.raises(ValueError, match="fractions of P in \\(0, 2\\]"):
        make_long_eval(tokenizer, torch.zeros(2 * P, dtype=torch.long), P, seed=0, lengths=(3.0,))


@pytest.mark.parametrize("encoding", [None, "rope+fire"], ids=["unpatched-sdpa", "hf_posenc"])
def test_no_attention_call_sees_more_than_a_chunk_of_queries(checkpoint, tokenizer, encoding, monkeypatch):
    """Memory: every attention call gets at most ``chunk`` queries, or a passkey question's (so a mask of at most
    that x 2P), and the
    patched model's term runs in the tile engine (never the full-matrix reference)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    import hf_posenc.attention as A

    model = _model(checkpoint, encoding, init="identity") if encoding else _model(checkpoint)
    seen, engine = [], []
    if encoding is None:  # transformers' SDPA attention, looked up by name at each call
        inner = ALL_ATTENTION_FUNCTIONS["sdpa"]

        def spy(module, q, k, v, mask, **kw):
            seen.append((q.shape[2], k.shape[2], None if mask is None else mask.shape[-2]))
            return inner(module, q, k, v, mask, **kw)

        monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "sdpa", spy)
    else:  # hf_posenc's attention hands the term to the tile engine (None: the full-matrix reference would run)
        tiled = A._tiled_torch_attention

        def spy_engine(ctx, layer, q, k, v, mask, *args, **kw):
            seen.append((q.shape[2], k.shape[2], None if mask is None else mask.shape[-2]))
            out = tiled(ctx, layer, q, k, v, mask, *args, **kw)
            engine.append(out is not None)
            return out

        monkeypatch.setattr(A, "_tiled_torch_attention", spy_engine)
    data = _data(tokenizer)
    evaluate_long(model, data, torch.device("cpu"), progress=False)
    most = max(data.chunk, *(h.question.numel() for h in data.haystacks))  # a chunk, or a question and its answer
    assert seen and max(q for q, _, _ in seen) <= most
    assert max(k for _, k, _ in seen) == 2 * P  # the whole window was seen ...
    assert all(m is None or m <= most for _, _, m in seen)  # ... a chunk of queries at a time
    if encoding:
        assert engine and all(engine)


def test_estimate(checkpoint, tokenizer):
    data = _data(tokenizer)
    est = estimate_seconds(_model(checkpoint), data, torch.device("cpu"), chunks=3)
    assert len(est["chunk_seconds"]) == 3 and est["passes_per_entry"] == 3 and est["pass_tokens"] == 2 * P
    assert est["per_entry_seconds"] >= 0


TINY = dict(steps=1, train_len=16, batch=1, eval_tokens=64, progress=False, long_eval=True)


def test_study_long_eval_reports_and_resumes(checkpoint, tmp_path, capsys):
    cfg = dict(source=str(checkpoint), out=str(tmp_path), **TINY)
    res = run_study(StudyConfig(encodings=["rope", "rope:eval_scaling=yarn"], **cfg))
    assert res["errors"] == 0
    err = capsys.readouterr().err
    assert f"long evaluation (--long-eval) past the pretrained context P = {P}" in err and "per entry" in err
    before = res["before_long_eval"]
    assert [b["band"] for b in before["bands"]][1:] == [[P // 2, P], [P, 2 * P]]
    runs = {r["encoding"]: r for r in res["results"]}
    yarn = runs["rope:eval_scaling=yarn"]["long_eval"]
    scaling = yarn["eval_position_encoding"]["scaling"]
    assert scaling["factor"] == 2.0 and scaling["original_max_position_embeddings"] == P  # YaRN x2 = 2P / P
    assert yarn["bands"] != before["bands"]
    assert runs["rope"]["long_eval"]["passkey"]
    assert res["data"]["long_eval"]["context"] == P and res["long_eval_estimate"]["evaluations"] == 3
    assert res["long_eval_estimate"]["passes_per_entry"] == 2
    table = (tmp_path / "table.md").read_text()
    assert f"| entry | [{P // 2}, {P}) | [{P}, {2 * P}) |" in table and "rope + YaRN x2 at eval (not trained)" in table
    # the held-out text excludes the last 2P tokens from training
    assert res["data"]["val_tokens"] >= 2 * P
    # --resume keeps every finished run with its long evaluation, and the unpatched model's
    res2 = run_study(StudyConfig(encodings=["rope", "rope:eval_scaling=yarn", "nope"], resume=True, **cfg))
    assert res2["before_long_eval"] == json.loads(json.dumps(before))
    runs2 = {r["encoding"]: r for r in res2["results"]}
    assert runs2["rope"]["long_eval"] == json.loads(json.dumps(runs["rope"]["long_eval"]))
    assert runs2["nope"]["long_eval"]["bands"]
    # the long evaluation is a setting: resuming without it is refused
    with pytest.raises(ValueError, match="long_eval"):
        run_study(StudyConfig(encodings=["rope"], resume=True, **{**cfg, "long_eval": False}))


def test_resume_of_a_results_json_from_before_long_factor(checkpoint, tmp_path):
    """A results.json written before --long-factor (no factor, no kept losses, no peak memory) resumes at factor 2,
    keeping its runs; the table and the pictures take them as they are."""
    cfg = dict(source=str(checkpoint), out=str(tmp_path), **TINY)
    run_study(StudyConfig(encodings=["rope:eval_scaling=yarn"], **cfg))
    old = json.loads((tmp_path / "results.json").read_text())
    del old["settings"]["long_factor"]
    for key in ("factor", "nll_bin_tokens"):
        del old["data"]["long_eval"][key]
    old["data"]["long_eval"]["how"] = "the wording of an older version"
    for long in [old["before_long_eval"], *(r["long_eval"] for r in old["results"])]:
        for key in ("factor", "nll_bins", "peak_memory_mib", "peak_memory_growth_mib", "memory_measure"):
            del long[key]
    (tmp_path / "results.json").write_text(json.dumps(old))
    res = run_study(StudyConfig(encodings=["rope:eval_scaling=yarn"], resume=True, **cfg))
    assert res["resumed"]["kept_from_results_json"] == ["rope:eval_scaling=yarn"] and "plot_error" not in res
    assert (tmp_path / "long_eval.png").is_file() and "| rope + YaRN x2 at eval (not trained) |" in res["table"]
    # but another factor is another study
    with pytest.raises(ValueError, match="long_factor 2 .now 4."):
        run_study(StudyConfig(encodings=["rope:eval_scaling=yarn"], resume=True, long_factor=4, **cfg))


def test_long_eval_options_are_validated(checkpoint):
    with pytest.raises(ValueError, match="needs --from"):
        StudyConfig(long_eval=True).resolved()
    with pytest.raises(ValueError, match="--passkey-lengths must be fractions"):
        StudyConfig(source=str(checkpoint), long_eval=True, passkey_lengths=[2.5]).resolved()
    with pytest.raises(ValueError, match="with --long-eval only"):
        StudyConfig(source=str(checkpoint), passkey_positions=[0.5]).resolved()
    c = StudyConfig(source=str(checkpoint), long_eval=True).resolved()
    assert c.passkey_lengths == [0.5, 1.0, 1.5, 2.0] and c.passkey_positions == [0.25]


def test_cli_options(checkpoint):
    import argparse

    from hf_posenc.study import add_arguments, config_from_args

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--from", str(checkpoint), "--long-eval", "--passkey-lengths", "1", "2",
                         "--passkey-positions", "0.5", "--encoding-lr", "0.02"])
    c = config_from_args(args).resolved()
    assert c.long_eval and c.passkey_lengths == [1.0, 2.0] and c.passkey_positions == [0.5] and c.encoding_lr == 0.02
    c = config_from_args(p.parse_args(["--from", str(checkpoint)])).resolved()
    assert not c.long_eval and c.encoding_lr is None  # a conversion study: param_groups' defaults
    assert config_from_args(p.parse_args([])).resolved().encoding_lr == 3e-3  # from scratch: --lr


# -- --long-factor: the bands, the kept per-token losses and the passkey up to F x P ---------------------------


def test_factor_four_reaches_4p_with_bands_bins_and_passkey(checkpoint, tokenizer):
    import os
    from pathlib import Path

    held_out = torch.randint(0, 200, (5 * P,), generator=torch.Generator().manual_seed(2))
    data = make_long_eval(tokenizer, held_out, P, seed=0, positions=(0.25, 2.5), factor=4)
    assert data.bands == [(0, P // 2), (P // 2, P), (P, 2 * P), (2 * P, 4 * P)]
    assert torch.equal(data.window, held_out[-4 * P :]) and all(h.ids.numel() == 4 * P for h in data.haystacks)
    defaults = [round(f * P) for f in (0.5, 1, 1.5, 2, 3, 4)]  # the default lengths at factor 4
    assert set(data.haystacks[0].lengths) <= set(defaults) and {3 * P, 4 * P} <= set(data.haystacks[0].lengths)
    assert data.haystacks[1].lengths == [3 * P, 4 * P]  # only the questions after the key at 2.5P
    model = _model(checkpoint)
    out = evaluate_long(model, data, torch.device("cpu"), progress=False)
    with torch.no_grad():
        logits = model(input_ids=data.window[None]).logits[0].float()
    nll = torch.nn.functional.cross_entropy(logits[:-1], data.window[1:], reduction="none").double()
    assert out["factor"] == 4 and [b["band"] for b in out["bands"]] == [list(b) for b in data.bands]
    for band in out["bands"]:
        lo, hi = band["band"]
        assert band["loss"] == pytest.approx(float(nll[max(lo, 1) - 1 : hi - 1].mean()), rel=1e-5, abs=1e-5)
    # the kept losses: the mean of each bin of nll_bin(P) target positions (position 0 has no target)
    size = nll_bin(P)
    assert out["nll_bins"]["tokens"] == size == P // 32 and len(out["nll_bins"]["loss"]) == 4 * P // size
    for k, loss in enumerate(out["nll_bins"]["loss"]):
        part = nll[max(k * size, 1) - 1 : (k + 1) * size - 1]
        assert loss == pytest.approx(float(part.mean()), abs=1e-4)
    # the answer at 4P, on the cropped cache of one prefill, is that of a standalone prompt of 4P tokens
    h = data.haystacks[1]
    last = next(r for r in out["passkey"] if r["key"] == h.key and r["length"] == 4 * P)
    prompt = torch.cat([h.ids[: 4 * P - h.question.numel()], h.question])[None]
    with torch.no_grad():
        scores = model(input_ids=prompt).logits[0, -h.answer - 1 : -1].float().log_softmax(-1)
    answer = h.question[-h.answer :]
    assert last["answer_logprob"] == pytest.approx(float(scores.gather(-1, answer[:, None]).sum()), abs=1e-3)
    assert len(out["passkey"]) == sum(len(h.lengths) for h in data.haystacks)
    # time and peak memory of the evaluation
    assert out["seconds"] >= 0 and out["cpu_seconds"] >= 0
    if os.access(Path("/proc/self/clear_refs"), os.W_OK):
        assert out["memory_measure"].startswith("the process's peak resident set")
        assert out["peak_memory_mib"] > 0 and 0 <= out["peak_memory_growth_mib"] <= out["peak_memory_mib"]


def test_long_factor_is_validated():
    assert default_passkey_lengths(2) == (0.5, 1.0, 1.5, 2.0)
    assert default_passkey_lengths(8) == (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0)
    for bad in (1, 3, 6, 0, -4):
        with pytest.raises(ValueError, match="power of two >= 2"):
            check_long_factor(bad)
    for bad in (True, 2.0, "4"):
        with pytest.raises(TypeError, match="--long-factor must be an integer"):
            check_long_factor(bad)
    with pytest.raises(ValueError, match="fractions of P in \\(0, 4\\]"):
        make_long_eval(None, torch.zeros(4 * P, dtype=torch.long), P, seed=0, lengths=(4.5,), factor=4)
    with pytest.raises(ValueError, match=f"4P = {4 * P} held-out tokens"):
        make_long_eval(None, torch.zeros(4 * P - 1, dtype=torch.long), P, seed=0, factor=4)


def test_long_factor_options(checkpoint):
    import argparse

    from hf_posenc.study import add_arguments, config_from_args

    c = StudyConfig(source=str(checkpoint), long_eval=True, long_factor=4).resolved()
    assert c.long_factor == 4 and c.passkey_lengths == [0.5, 1.0, 1.5, 2.0, 3.0, 4.0]
    assert StudyConfig(source=str(checkpoint), long_eval=True).resolved().long_factor == 2
    with pytest.raises(ValueError, match="power of two"):
        StudyConfig(source=str(checkpoint), long_eval=True, long_factor=3).resolved()
    with pytest.raises(ValueError, match=r"--passkey-lengths must be fractions .* in \(0, 4\]"):
        StudyConfig(source=str(checkpoint), long_eval=True, long_factor=4, passkey_lengths=[4.5]).resolved()
    with pytest.raises(ValueError, match=r"--passkey-positions must be fractions .* in \[0, 4\)"):
        StudyConfig(source=str(checkpoint), long_eval=True, long_factor=4, passkey_positions=[4]).resolved()
    with pytest.raises(ValueError, match="--long-factor, --passkey-lengths and --passkey-positions apply with "
                       "--long-eval only"):
        StudyConfig(source=str(checkpoint), long_factor=4).resolved()
    p = argparse.ArgumentParser()
    add_arguments(p)
    c = config_from_args(p.parse_args(["--from", str(checkpoint), "--long-eval", "--long-factor", "8"])).resolved()
    assert c.long_factor == 8 and max(c.passkey_lengths) == 8.0


# -- YaRN's factor as an entry parameter ---------------------------------------------------------------------


def test_yarn_factor_is_an_entry_parameter(checkpoint):
    x4 = parse_study_entry("rope:eval_scaling=yarn,eval_factor=4")
    assert x4.eval_scaling == "yarn" and x4.eval_factor == 4.0 and x4.label == "rope + YaRN x4 at eval"
    assert parse_study_entry("rope:eval_scaling=yarn,eval_factor=2").label == "rope + YaRN x2 at eval"
    plain = parse_study_entry("rope:eval_scaling=yarn")
    assert plain.eval_factor is None and plain.label == "rope + YaRN at eval"
    plan = parse_study_entry("rope:eval_scaling=yarn,eval_factor=4*3/nope/...")
    assert plan.eval_factor == 4.0 and plan.label == "rope×3/nope/… + YaRN x4 at eval"
    assert plan.to_depth(6).eval_factor == 4.0 and len(plan.to_depth(6).encoding) == 6
    for spec, match in (("rope:eval_factor=2", "give both"), ("rope:eval_scaling=yarn,eval_factor=1", "> 1"),
                        ("rope:eval_scaling=yarn,eval_factor=true", "> 1"),
                        ("rope:eval_scaling=yarn,eval_factor=x", "> 1"),
                        ("rope:eval_scaling=yarn,eval_factor=2/rope:eval_scaling=yarn,eval_factor=4",
                         "one eval_factor per plan")):
        with pytest.raises(ValueError, match=match):
            parse_study_entry(spec)
    # the factor is fixed at every length past the training length; the entry's other parameters pass through
    entry = parse_study_entry("rope:theta=20000.0,eval_scaling=yarn,eval_factor=4")
    model = _model(checkpoint, entry.encoding)
    pe = apply_eval_scaling(model, entry, 16, 32)
    assert pe["scaling"]["factor"] == 4.0 and pe["scaling"]["original_max_position_embeddings"] == 16
    assert pe["theta"] == 20000.0
    assert apply_eval_scaling(model, plain, 16, 32)["scaling"]["factor"] == 2.0  # without: L / T


def test_study_long_factor_yarn_entries_and_pictures(checkpoint, tmp_path):
    specs = ["rope:eval_scaling=yarn", "rope:eval_scaling=yarn,eval_factor=2", "rope:eval_scaling=yarn,eval_factor=4"]
    res = run_study(StudyConfig(encodings=specs, source=str(checkpoint), out=str(tmp_path), long_factor=4,
                                passkey_positions=[0.25, 1.5], **TINY))
    assert res["errors"] == 0
    bands = [[0, P // 2], [P // 2, P], [P, 2 * P], [2 * P, 4 * P]]
    assert [b["band"] for b in res["before_long_eval"]["bands"]] == bands
    runs = {r["encoding"]: r for r in res["results"]}
    factors = [runs[s]["long_eval"]["eval_position_encoding"]["scaling"]["factor"] for s in specs]
    assert factors == [4.0, 2.0, 4.0]  # without eval_factor: the long factor (4P / P)
    assert all(runs[s]["long_eval"]["eval_position_encoding"]["scaling"]["original_max_position_embeddings"] == P
               for s in specs)
    x2, x4 = runs[specs[1]]["long_eval"], runs[specs[2]]["long_eval"]
    assert x2["bands"] != x4["bands"] and x4["bands"] == runs[specs[0]]["long_eval"]["bands"]
    table = (tmp_path / "table.md").read_text()
    assert f"| entry | [{P // 2}, {P}) | [{P}, {2 * P}) | [{2 * P}, {4 * P}) | passkey " in table
    assert f"passkey {3 * P} | passkey {4 * P} | time | peak memory |" in table
    for label in ("rope + YaRN x2 at eval (not trained)", "rope + YaRN x4 at eval (not trained)"):
        assert f"| {label} |" in table
    # the pictures, beside results.json
    files = json.loads((tmp_path / "results.json").read_text())["files"]
    assert files["long_eval_plot"] == str(tmp_path / "long_eval.png")
    assert files["passkey_plot"] == str(tmp_path / "passkey.png")
    import matplotlib.image

    for name in ("long_eval.png", "passkey.png"):
        assert matplotlib.image.imread(tmp_path / name).shape[0] > 200
    ax = report.long_eval_figure(res).axes[0]
    vertical = {line.get_xdata()[0] for line in ax.lines if len(set(line.get_xdata())) == 1}
    assert vertical == {P, 2 * P, 4 * P}  # P, 2P and 4P marked
    curves = [line for line in ax.lines if len(set(line.get_xdata())) > 1]
    labels = [line.get_label() for line in curves]
    assert labels[0].startswith("unpatched (before any swap)")
    assert any("rope + YaRN x2 at eval" in x for x in labels) and any("rope + YaRN x4 at eval" in x for x in labels)
    size = nll_bin(P)
    for line in curves:
        assert len(line.get_xdata()) == 4 * P // size
    before = [float(torch.tensor(v).exp()) for v in res["before_long_eval"]["nll_bins"]["loss"]]
    assert list(curves[0].get_ydata()) == pytest.approx(before)
    grid = report.passkey_figure(res)
    assert len(grid.axes) == 4  # the unpatched model and the three entries
    lengths = {n for h in res["data"]["long_eval"]["passkey"] for n in h["lengths"]}
    assert all(a.images[0].get_array().shape == (2, len(lengths)) for a in grid.axes)  # key positions x lengths
