"""``hf_posenc.export_native`` and ``hf-posenc export``: a patched model as the stock architecture it equals.

Every row of the mapping table (:data:`hf_posenc.export.EXPORT_ROUTES`) is exported from a tiny model, untrained and
after a short fine-tune, and loaded in one fresh process that never imports hf_posenc (``tests/_export_worker.py``):
its logits must be the patched model's (float32, within 1e-5) and its greedy generation the same tokens. Every
encoding and option with no stock equivalent raises a ValueError naming the part and the nearest recipe that
exports. The ``real`` tier does the same on SmolLM2-135M for the 3:1 rope/nope plan, all-nope, a rope window plan and
rope with YaRN.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import IMAGE_SIZE, NUM_LABELS, VOCAB, make_model

import hf_posenc
from hf_posenc.config import PosEncConfig
from hf_posenc.export import EXPORT_ROUTES, export_native, export_table, native_export

WORKER = Path(__file__).with_name("_export_worker.py")
#: The bound of the issue: the exported model's logits are the patched model's within 1e-5 (float32). Measured:
#: 0.0 on every tiny row below and on SmolLM2 (the same kernels run the same operations).
ATOL = 1e-5

FOUR = {"num_hidden_layers": 4}


@dataclass(frozen=True)
class Case:
    """One export: a tiny model of ``family`` patched with ``encoding`` must export as ``architecture``."""

    id: str
    family: str
    encoding: Any
    architecture: str
    params: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)
    length: int = 24  # forward length (past every window below)
    prompt: int = 8  # generation: prompt length, then `new` greedy tokens
    new: int = 10


YARN = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32}
CASES = [
    # Llama: its own rotary, or any one rotary (theta, scaling) -> Llama's rope_parameters
    Case("llama-rope", "llama", "rope", "LlamaForCausalLM"),
    Case("llama-rope-theta", "llama", "rope", "LlamaForCausalLM", {"theta": 500.0}),
    Case("llama-rope-yarn", "llama", "rope", "LlamaForCausalLM", {"scaling": YARN}),
    Case("llama-rope-linear", "llama", "rope", "LlamaForCausalLM", {"scaling": {"rope_type": "linear", "factor": 3.0}}),
    # dynamic NTK past max_position_embeddings (64): the prefill and each decoding step recompute the frequencies
    Case("llama-rope-dynamic", "llama", "rope", "LlamaForCausalLM",
         {"scaling": {"rope_type": "dynamic", "factor": 2.0}}, length=84, prompt=66, new=12),
    # one window on every layer -> Mistral's sliding_window
    Case("llama-rope-window", "llama", "rope", "MistralForCausalLM", {"window": 6}),
    Case("mistral-rope", "mistral", "rope", "MistralForCausalLM", config={"sliding_window": 7}),
    Case("mistral-rope-narrower", "mistral", "rope", "MistralForCausalLM", {"window": 5}, {"sliding_window": 9}),
    # rope and nope layers, windows -> SmolLM3
    Case("llama-3to1", "llama", ["rope", "rope", "rope", "nope"], "SmolLM3ForCausalLM", config=FOUR),
    Case("llama-nope", "llama", "nope", "SmolLM3ForCausalLM"),
    Case("llama-nope-window", "llama", "nope", "SmolLM3ForCausalLM", {"window": 5}),
    Case("llama-rnope-swa", "llama", [{"name": "rope", "window": 6}] * 3 + ["nope"], "SmolLM3ForCausalLM", config=FOUR),
    Case("llama-some-windows", "llama", ["rope", {"name": "rope", "window": 5}], "SmolLM3ForCausalLM"),
    Case("llama-biased-window", "llama", "rope", "SmolLM3ForCausalLM", {"window": 6},
         {"attention_bias": True, "mlp_bias": True}),
    Case("llama-3to1-yarn", "llama", [{"name": "rope", "scaling": YARN}] * 3 + ["nope"], "SmolLM3ForCausalLM",
         config=FOUR),
    Case("mistral-plan", "mistral", ["rope", "nope"], "SmolLM3ForCausalLM", config={"sliding_window": 7}),
    # Qwen2 / Qwen3: windows per layer -> layer_types
    Case("qwen2-rope", "qwen2", "rope", "Qwen2ForCausalLM"),
    Case("qwen2-layer-windows", "qwen2", [{"name": "rope", "window": 5}, "rope"], "Qwen2ForCausalLM"),
    Case("qwen3-layer-windows", "qwen3", ["rope", {"name": "rope", "window": 6}], "Qwen3ForCausalLM"),
    # Gemma 3: its own local (6-key window, base 1e4) and global layers (1e6), or a narrower local window
    Case("gemma3-rope", "gemma3_text", "rope", "Gemma3ForCausalLM"),
    Case("gemma3-narrower", "gemma3_text", [{"name": "rope", "window": 4}, "rope"], "Gemma3ForCausalLM"),
    Case("gemma3-one-rotary", "gemma3_text", "rope", "Gemma3ForCausalLM", {"theta": 3000.0}),
    # Phi-3 (partial rotary 0.5, fused qkv) and GPT-NeoX (partial rotary, fused per head)
    Case("phi3-rope", "phi3", "rope", "Phi3ForCausalLM"),
    Case("phi3-rope-window", "phi3", "rope", "Phi3ForCausalLM", {"window": 5}),
    Case("phi3-rope-partial", "phi3", "rope", "Phi3ForCausalLM", {"partial_rotary_factor": 0.25}),
    Case("gpt-neox-rope", "gpt_neox", "rope", "GPTNeoXForCausalLM"),
    Case("gpt-neox-rope-linear", "gpt_neox", "rope", "GPTNeoXForCausalLM",
         {"scaling": {"rope_type": "linear", "factor": 2.0}}),
    # a learned table -> the family's own
    Case("gpt2-learned", "gpt2", "learned", "GPT2LMHeadModel", {"max_positions": 40}),
    Case("bert-learned", "bert", "learned", "BertForMaskedLM", new=0),
    Case("vit-learned", "vit", "learned", "ViTForImageClassification", new=0),
]
AUTO = {"bert": "AutoModelForMaskedLM", "vit": "AutoModelForImageClassification"}


def _inputs(case: Case) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    if case.family == "vit":
        return {"forward": {"pixel_values": torch.randn(2, 3, IMAGE_SIZE, IMAGE_SIZE, generator=g)}}
    ids = torch.randint(3, VOCAB, (1, case.length), generator=g)
    out: dict[str, Any] = {"forward": {"input_ids": ids}}
    if case.new:
        out["prompt"] = ids[:, :case.prompt]
    return out


def _fine_tune(model, case: Case, steps: int = 3) -> None:
    """A few AdamW steps on random data (lr 1e-2: every weight moves well past rounding)."""
    g = torch.Generator().manual_seed(2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(steps):
        if case.family == "vit":
            batch = {"pixel_values": torch.randn(2, 3, IMAGE_SIZE, IMAGE_SIZE, generator=g),
                     "labels": torch.randint(0, NUM_LABELS, (2,), generator=g)}
        else:
            ids = torch.randint(3, VOCAB, (2, 20), generator=g)
            batch = {"input_ids": ids, "labels": ids}
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.eval()


def _expected(model, case: Case, inputs: dict[str, Any]) -> dict[str, Any]:
    with torch.no_grad():
        generated = None
        if case.new:
            generated = model.generate(inputs["prompt"], max_new_tokens=case.new, min_new_tokens=case.new,
                                       do_sample=False)
        output = model(**inputs["forward"]).logits
    return {"output": output, "generated": generated}


def run_worker(jobs: list[dict[str, Any]], tmp: Path) -> None:
    """Run tests/_export_worker.py on ``jobs`` in a fresh interpreter, from a directory where no hf_posenc is."""
    jobs_file = tmp / "jobs.json"
    jobs_file.write_text(json.dumps(jobs))
    done = subprocess.run([sys.executable, str(WORKER), str(jobs_file)], cwd=tmp, capture_output=True, text=True,
                          timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _build_exports(root: Path) -> dict[str, tuple[dict, dict, dict]]:
    """Every case, untrained and fine-tuned, exported under ``root`` and loaded there by the worker:
    {"<id>-fresh|tuned": (expected, got, config.json)}."""
    jobs, expected = [], {}
    for case in CASES:
        for trained in (False, True):
            key = f"{case.id}-{'tuned' if trained else 'fresh'}"
            model = make_model(case.family, encoding=case.encoding, config_overrides=dict(case.config),
                               **case.params)
            if trained:
                _fine_tune(model, case)
            inputs = _inputs(case)
            expected[key] = _expected(model, case, inputs)
            target = export_native(model, root / key)
            assert target.architecture == case.architecture, (case.id, target.architecture)
            torch.save(inputs, root / f"{key}.inputs.pt")
            jobs.append({"dir": str(root / key), "auto": AUTO.get(case.family, "AutoModelForCausalLM"),
                         "inputs": str(root / f"{key}.inputs.pt"), "out": str(root / f"{key}.out.pt"),
                         "new_tokens": case.new})
    run_worker(jobs, root)
    return {key: (want, torch.load(root / f"{key}.out.pt", weights_only=True),
                  json.loads((root / key / "config.json").read_text())) for key, want in expected.items()}


@pytest.fixture(scope="session")
def exported(tmp_path_factory):
    """`_build_exports`, built once per pytest run (13.5 s of CPU, measured on the 2-core AMD EPYC) and shared.

    Session-scoped, so that a worker does not rebuild it each time it comes back to these tests (pytest tears a
    module-scoped fixture down whenever the next test is another file's, and pytest-xdist hands a worker its
    tests in several runs). The pytest-xdist workers of a run share one build: the first to ask builds it in
    their common temporary directory, under a lock (filelock, a dependency of huggingface_hub), and the others
    read its results from there. (``xdist_group`` cannot keep these tests on one worker: with pytest 9.2 and
    pytest-xdist 3.8 it groups nothing, as xdist sets ``item._nodeid``, which pytest 9 no longer reads.)"""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "export"
    results = root / "results.pt"
    with FileLock(f"{root}.lock"):
        if not results.is_file():
            root.mkdir(exist_ok=True)
            torch.save(_build_exports(root), root / "results.tmp")
            (root / "results.tmp").replace(results)
    return torch.load(results, weights_only=True)


@pytest.mark.parametrize("trained", [False, True], ids=["fresh", "tuned"])
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_export_equals_the_patched_model_without_hf_posenc(exported, case, trained):
    """Loaded in a process without hf_posenc: the architecture of the table, float32, the patched model's logits
    within 1e-5 and its greedy tokens; nothing of hf_posenc in config.json."""
    want, got, config = exported[f"{case.id}-{'tuned' if trained else 'fresh'}"]
    assert got["class"] == case.architecture and config["architectures"] == [case.architecture]
    assert got["dtype"] == "torch.float32"
    assert "position_encoding" not in config and "auto_map" not in config
    assert not config["model_type"].startswith("posenc_")
    diff = float((got["output"] - want["output"]).abs().max())
    assert diff <= ATOL, f"{case.id}: max |logit difference| {diff}"
    if case.new:
        assert torch.equal(got["generated"], want["generated"]), (got["generated"], want["generated"])


def test_every_route_has_a_case():
    """Every row of the mapping table is exercised above (by its target architecture and family)."""
    covered = {(c.family, native_export(make_model(c.family, encoding=c.encoding, config_overrides=dict(c.config),
                                                   **c.params)).route.target) for c in CASES}
    for route in EXPORT_ROUTES:
        assert any((family, route.target) in covered for family in route.families), route


def test_the_docs_page_holds_the_table():
    """docs/export.md shows the table as export_table() renders it from EXPORT_ROUTES."""
    page = (Path(__file__).parent.parent / "docs" / "export.md").read_text()
    assert export_table() in page


# -- what does not export --------------------------------------------------------------------------------------

NOT_EXPORTABLE = [name for name in hf_posenc.list_encodings() if name not in ("rope", "nope", "learned")]


@pytest.mark.parametrize("name", NOT_EXPORTABLE)
def test_every_other_encoding_raises_naming_it(name):
    """Each encoding without a stock equivalent: ValueError naming it, why, and the nearest recipe (rope, the
    model's own rotary, which itself exports)."""
    model = make_model("llama", encoding=name)
    with pytest.raises(ValueError, match=rf"^cannot export this Llama model .*: {re.escape(name)}: no stock "
                                         r"Llama-family architecture .*Nearest exportable recipe: rope \(exports as "
                                         r"LlamaForCausalLM\)$"):
        native_export(model)


def _error(family: str, encoding: Any, config: dict | None = None, **params: Any) -> str:
    model = make_model(family, encoding=encoding, config_overrides=config or {}, **params)
    with pytest.raises(ValueError) as info:
        native_export(model)
    return str(info.value)


@pytest.mark.parametrize("family, encoding, params, config, part, nearest", [
    ("llama", "alibi", {}, {}, "alibi: no stock Llama-family architecture adds a score bias", "rope (exports as "
     "LlamaForCausalLM)"),
    ("llama", "rope+fox", {"init": "identity"}, {}, "rope+fox: no stock Llama-family architecture adds fox's "
     "data-dependent term beside the rotary", "rope (exports as LlamaForCausalLM)"),
    ("llama", ["rope", "rope", "rope", "kerple"], {}, FOUR, "kerple: no stock Llama-family architecture adds a "
     "score bias (on layer 3 of 4)", "[rope, rope, rope, nope] (exports as SmolLM3ForCausalLM)"),
    ("llama", "rope", {"layout": "interleaved"}, {}, "rope(layout='interleaved'): transformers rotates the "
     "half-split pairs", "rope (exports as LlamaForCausalLM)"),
    ("llama", "rope", {"partial_rotary_factor": 0.5}, {}, "rope(partial_rotary_factor=0.5): Llama's stock rotary "
     "turns every dim of the head (8), not 4", "rope (exports as LlamaForCausalLM)"),
    ("llama", [{"name": "rope", "window": 4}, {"name": "rope", "window": 8}], {}, {}, "windows of 2 sizes (4, 8): "
     "the architecture has one sliding_window", "rope(window=4) (exports as MistralForCausalLM)"),
    ("llama", ["rope", {"name": "rope", "theta": 500.0}], {}, {}, "the rope layers use 2 different rotaries",
     "rope (exports as LlamaForCausalLM)"),
    ("qwen2", ["rope", "nope"], {}, {}, "nope: no stock Qwen2-family architecture has layers without a rotary",
     "rope (exports as Qwen2ForCausalLM)"),
    ("qwen3", "nope", {}, {}, "nope: no stock Qwen3-family architecture has layers without a rotary",
     "rope (exports as Qwen3ForCausalLM)"),
    ("gemma3_text", "rope", {"window": 4}, {}, "the windowed layers use 2 different rotaries: Gemma 3 has one rotary "
     "per layer type", "rope (exports as Gemma3ForCausalLM)"),
    ("gpt_neox", "rope", {"window": 4}, {}, "a sliding window on every layer: the architecture has none",
     "rope (exports as GPTNeoXForCausalLM)"),
    ("phi3", ["rope", {"name": "rope", "window": 4}], {}, {}, "windows that differ between layers",
     "rope (exports as Phi3ForCausalLM)"),
    ("gpt2", "rope", {}, {}, "rope: no stock GPT-2-family architecture applies rope's transform",
     "learned (exports as GPT2LMHeadModel)"),
    ("gpt2", "nope", {}, {}, "nope: no stock GPT-2-family architecture runs without its position table",
     "learned (exports as GPT2LMHeadModel)"),
    ("gpt2", "learned", {"window": 8}, {}, "window=8: GPT-2's learned table has no sliding window",
     "learned (exports as GPT2LMHeadModel)"),
], ids=lambda v: v if isinstance(v, str) and len(v) < 20 else None)
def test_parts_without_a_stock_equivalent(family, encoding, params, config, part, nearest):
    """The error names the part (and where a plan has it), why, and the nearest recipe, with its architecture."""
    message = _error(family, encoding, config, **params)
    assert part in message, message
    assert message.endswith(f"Nearest exportable recipe: {nearest}"), message


def _layer_option_supported(**options: Any) -> bool:
    try:
        PosEncConfig("rope", window=8, **options)
    except TypeError:
        return False
    return True


@pytest.mark.parametrize("option, value", [("sink", 2), ("length_scale", "logn")])
def test_layer_options_without_a_stock_equivalent(option, value):
    """Attention sinks and a length-scaled softmax (layer options beside window) have no stock form; the nearest
    recipe drops them and keeps the window."""
    if not _layer_option_supported(**{option: value}):
        pytest.skip(f"this hf_posenc has no layer option {option!r} yet")
    message = _error("llama", "rope", window=8, **{option: value})
    assert f"{option}={value!r}: no stock architecture has it" in message, message
    assert message.endswith("Nearest exportable recipe: rope(window=8) (exports as MistralForCausalLM)"), message


@pytest.mark.parametrize("param, value", [("qk_norm", "qk"), ("softmax_scale", 2.0)])
def test_nope_options_without_a_stock_equivalent(param, value):
    """DroPE's NoPE options (a learned QK-norm, a softmax scale): no stock NoPE layer has them; nearest: plain nope."""
    if param not in PosEncConfig("nope").params:
        pytest.skip(f"this hf_posenc's nope has no {param!r} yet")
    message = _error("llama", "nope", **{param: value})
    assert "no stock architecture with NoPE layers has" in message and param in message, message
    assert message.endswith("Nearest exportable recipe: nope (exports as SmolLM3ForCausalLM)"), message


def test_unpatched_model_is_refused():
    with pytest.raises(ValueError, match="not patched"):
        native_export(make_model("llama"))


def test_native_export_writes_nothing_and_leaves_the_model(tmp_path):
    """native_export only says where; export_native leaves the patched model as it was (weights, config)."""
    model = make_model("llama", encoding=["rope", "nope"])
    before = copy.deepcopy(model.state_dict())
    config = model.config.to_dict()
    found = native_export(model)
    assert found.architecture == "SmolLM3ForCausalLM" and found.config.no_rope_layers == [1, 0]
    assert [layer.rotary is not None for layer in found.layers] == [True, False]
    export_native(model, tmp_path / "out")
    assert model.config.to_dict() == config
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "generation_config.json",
                                                                    "model.safetensors"]


def test_a_check_that_fails_writes_nothing(tmp_path, monkeypatch):
    """If the target computed something else (here a route that gives a wrong base), the probe catches it before
    anything is written."""
    import dataclasses

    import hf_posenc.export as export

    wrong = tuple(dataclasses.replace(r, overrides=lambda plan: {"rope_parameters": {"rope_type": "default",
                                                                                     "rope_theta": 77.0}})
                  if r.target == "llama" else r for r in EXPORT_ROUTES)
    monkeypatch.setattr(export, "EXPORT_ROUTES", wrong)
    model = make_model("llama", encoding="rope")
    with pytest.raises(RuntimeError, match="LlamaForCausalLM gives outputs .* nothing was written"):
        export_native(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    export_native(model, tmp_path / "unchecked", check=False)  # the same mistake, unchecked, is written
    assert (tmp_path / "unchecked" / "config.json").is_file()


def test_base_model_exports_as_the_targets_base(tmp_path):
    """A patched base model (LlamaModel) exports as the target's base model."""
    model = make_model("llama", head="base", encoding="nope")
    assert native_export(model).architecture == "SmolLM3Model"


# -- the tokenizer and the command ------------------------------------------------------------------------------


def _tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def test_cli_exports_a_saved_checkpoint_with_its_tokenizer(tmp_path, capsys):
    """hf-posenc export CHECKPOINT OUT: the patched checkpoint (saved with a tokenizer) becomes SmolLM3, the
    tokenizer is copied and encodes alike; an encoding without a stock equivalent exits 2 naming it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_posenc.cli import main

    model = make_model("llama", encoding=["rope", "rope", "rope", "nope"], config_overrides=FOUR)
    ckpt = tmp_path / "patched"
    model.save_pretrained(ckpt)
    _tiny_tokenizer().save_pretrained(ckpt)
    assert main(["export", str(ckpt), str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert "SmolLM3ForCausalLM (no_rope_layers, layer_types" in printed and "tokenizer copied from" in printed
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(loaded).__name__ == "SmolLM3ForCausalLM"
    ids = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model.eval()(ids).logits)
    text = "w5 w17 w42 w3"
    assert AutoTokenizer.from_pretrained(tmp_path / "out")(text)["input_ids"] == _tiny_tokenizer()(text)["input_ids"]

    make_model("llama", encoding="alibi").save_pretrained(tmp_path / "alibi")
    assert main(["export", str(tmp_path / "alibi"), str(tmp_path / "out2")]) == 2
    err = capsys.readouterr().err
    assert "hf-posenc export: error: cannot export this Llama model" in err and "alibi: no stock" in err
    assert not (tmp_path / "out2").exists()


def test_tokenizer_object_is_saved(tmp_path):
    model = make_model("gpt2", encoding="learned")
    export_native(model, tmp_path, tokenizer=_tiny_tokenizer())
    assert (tmp_path / "tokenizer.json").is_file()


# -- the conversion study's record -----------------------------------------------------------------------------


def test_conversion_study_records_whether_each_entry_exports(tmp_path):
    """hf-posenc study --from: every entry's result says whether the converted (fine-tuned) model exports, to which
    architecture, or why not (the export's own message)."""
    pytest.importorskip("matplotlib")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from hf_posenc.study import StudyConfig, run_study

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(tmp_path / "ckpt")
    make_model("llama", config_overrides={"vocab_size": len(alphabet), "max_position_embeddings": 256}).save_pretrained(
        tmp_path / "ckpt")
    res = run_study(StudyConfig(source=str(tmp_path / "ckpt"), out=str(tmp_path / "out"), steps=2, train_len=16,
                                batch=2, eval_tokens=128, progress=False,
                                encodings=["rope", "rope/nope", "alibi", "rope:eval_scaling=yarn"]))
    records = {r["encoding"]: r["native_export"] for r in res["results"]}
    assert records["rope"] == {"exports": True, "architecture": "LlamaForCausalLM"}
    assert records["rope/nope"] == {"exports": True, "architecture": "SmolLM3ForCausalLM"}
    assert records["rope:eval_scaling=yarn"] == {"exports": True, "architecture": "LlamaForCausalLM"}
    assert not records["alibi"]["exports"] and "alibi: no stock Llama-family" in records["alibi"]["reason"]


# -- the real tier: SmolLM2-135M ------------------------------------------------------------------------------

#: SmolLM3's NoPE every 4th layer over SmolLM2's 30 layers (layers 3, 7, ..., 27), as SmolLM3Config builds it.
THREE_TO_ONE = (["rope"] * 3 + ["nope"]) * 7 + ["rope"] * 2
REAL = {
    "3to1": (THREE_TO_ONE, {}, "SmolLM3ForCausalLM"),
    "nope": ("nope", {}, "SmolLM3ForCausalLM"),
    "window": ("rope", {"window": 16}, "MistralForCausalLM"),
    "yarn": ("rope", {"scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}},
             "LlamaForCausalLM"),
    # RNoPE-SWA: the 3:1 plan with a 16-key window on the rope layers
    "rnope-swa": ([{"name": "rope", "window": 16} if e == "rope" else e for e in THREE_TO_ONE], {},
                  "SmolLM3ForCausalLM"),
}
REAL_TEXT = ("The river rises in the hills to the north and flows slowly through the town, where an old stone bridge "
             "carries the main road over it. In spring the water is high and brown with mud from the fields. ") * 2
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def real_exports(pytestconfig, tmp_path_factory):
    """SmolLM2 patched with each recipe of REAL, exported, and loaded by the worker in one fresh process:
    {name: (expected, got, export directory)}."""
    import contextlib

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_posenc.testing import CheckpointUnavailable, smollm2

    capture = pytestconfig.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
        try:
            path = smollm2()
        except CheckpointUnavailable as e:
            pytest.skip(f"SmolLM2 checkpoint unavailable: {e}")
    base = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer(REAL_TEXT, return_tensors="pt")["input_ids"][:, :48]
    prompt = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)["input_ids"]
    inputs = {"forward": {"input_ids": ids}, "prompt": prompt}
    root = tmp_path_factory.mktemp("real-export")
    torch.save(inputs, root / "inputs.pt")
    jobs, expected = [], {}
    for name, (encoding, params, architecture) in REAL.items():
        model = hf_posenc.patch_model(copy.deepcopy(base), encoding, **params).eval()
        with torch.no_grad():
            generated = model.generate(prompt, max_new_tokens=10, min_new_tokens=10, do_sample=False)
            expected[name] = {"output": model(ids).logits, "generated": generated}
        target = export_native(model, root / name)
        assert target.architecture == architecture
        del model
        jobs.append({"dir": str(root / name), "auto": "AutoModelForCausalLM", "inputs": str(root / "inputs.pt"),
                     "out": str(root / f"{name}.out.pt"), "new_tokens": 10})
    run_worker(jobs, root)
    return {name: (want, torch.load(root / f"{name}.out.pt", weights_only=True), root / name)
            for name, want in expected.items()}


@pytest.mark.real
@pytest.mark.parametrize("name", list(REAL))
def test_smollm2_exports_exactly(real_exports, name):
    """SmolLM2-135M converted with the 3:1 rope/nope plan, all-nope, a 16-key rope window, rope with YaRN and
    RNoPE-SWA: the export, loaded without hf_posenc, gives the patched model's logits within 1e-5 (measured: 0.0)
    and its greedy chat answer; the tokenizer (and its chat template) comes with it."""
    from transformers import AutoTokenizer

    from hf_posenc.testing import smollm2

    want, got, directory = real_exports[name]
    assert got["class"] == REAL[name][2] and got["dtype"] == "torch.float32"
    diff = float((got["output"] - want["output"]).abs().max())
    assert diff <= ATOL, f"{name}: max |logit difference| {diff}"
    assert torch.equal(got["generated"], want["generated"])
    original, copied = AutoTokenizer.from_pretrained(smollm2()), AutoTokenizer.from_pretrained(directory)
    assert copied.apply_chat_template(CHAT, add_generation_prompt=True) == original.apply_chat_template(
        CHAT, add_generation_prompt=True)
    assert copied(REAL_TEXT)["input_ids"] == original(REAL_TEXT)["input_ids"]


def test_a_lora_model_exports_once_merged(tmp_path):
    """Under PEFT the export asks for the merged model; merged, the trained LoRA weights are in the export."""
    from peft import LoraConfig, get_peft_model

    model = make_model("llama", encoding=["rope", "nope"])
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    with pytest.raises(ValueError, match="PEFT layers .*merge_and_unload"):
        native_export(peft_model)
    merged = peft_model.merge_and_unload()
    ids = torch.randint(3, VOCAB, (1, 16), generator=torch.Generator().manual_seed(0))
    export_native(merged, tmp_path)
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        assert torch.equal(AutoModelForCausalLM.from_pretrained(tmp_path)(ids).logits, merged.eval()(ids).logits)


@pytest.mark.parametrize("head", ["LlamaForSequenceClassification", "LlamaForQuestionAnswering",
                                  "LlamaForTokenClassification"])
def test_other_heads_export_as_the_targets_head(tmp_path, head):
    """A head other than the LM's goes to the target's same head (the Auto class that maps both), weights and all."""
    import transformers
    from conftest import make_config

    torch.manual_seed(0)
    model = getattr(transformers, head)(make_config("llama", num_hidden_layers=4, pad_token_id=0)).eval()
    hf_posenc.patch_model(model, ["rope", "rope", "rope", "nope"])
    target = export_native(model, tmp_path)
    assert target.architecture == head.replace("Llama", "SmolLM3")
    loaded = getattr(transformers, target.architecture).from_pretrained(tmp_path).eval()
    ids = torch.randint(3, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = model(ids, use_cache=False), loaded(ids, use_cache=False)
    assert list(want.keys()) == list(got.keys())
    for key, value in want.items():
        assert torch.equal(got[key], value), key
