"""Checkpoints of patched models load patched through transformers' Auto classes, or not at all (issue 20).

Fresh processes are what a user who downloads a checkpoint has: one subprocess loads every checkpoint after
``import hf_posenc``; another first tries every checkpoint without the import (an error), then with
hf_posenc hidden (ImportError asking for ``pip install hf_posenc``), then with ``trust_remote_code=True``
(the patched model), for every encoding on every family.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import FAMILIES, ENCODINGS, main_output, make_model, model_inputs, supports

import hf_posenc
from hf_posenc.auto import loader_classes

ROOT = Path(__file__).resolve().parents[1]

#: The Auto class that loads each family's head class of the tiny models.
_AUTO = {"vit": "AutoModelForImageClassification", "bert": "AutoModelForMaskedLM"}

_CHILD = r"""
import importlib.abc, json, sys, traceback
import torch
cases = json.load(open(sys.argv[2]))
mode = sys.argv[1]
out = {}

def logits_close(model, case):
    data = torch.load(case["data"])
    model.eval()
    with torch.no_grad():
        got = model(**data["inputs"])
    got = got.logits if hasattr(got, "logits") else got[0]
    return bool(torch.allclose(got, data["logits"], atol=1e-5, rtol=1e-5)), float((got - data["logits"]).abs().max())

def load(case, **kw):
    import transformers
    return getattr(transformers, case["auto"]).from_pretrained(case["path"], **kw)

if mode == "import":
    import hf_posenc
    for c in cases:
        m = load(c)
        out[c["path"]] = {"type": type(m).__name__, "logits": logits_close(m, c)}
else:
    for c in cases:  # no import, no trust_remote_code: an error, never a model
        try:
            m = load(c)
            out[c["path"]] = {"loaded": type(m).__name__}
        except Exception as e:
            out[c["path"]] = {"error": type(e).__name__, "message": str(e)}

    class Hide(importlib.abc.MetaPathFinder):  # hf_posenc not installed
        def find_spec(self, name, path=None, target=None):
            if name == "hf_posenc" or name.startswith("hf_posenc."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    hide = Hide()
    sys.meta_path.insert(0, hide)
    try:
        load(cases[0], trust_remote_code=True)
        out["absent"] = {"loaded": True}
    except Exception as e:
        out["absent"] = {"error": type(e).__name__, "message": str(e)}
    sys.meta_path.remove(hide)
    for c in cases:
        m = load(c, trust_remote_code=True)
        out[c["path"]]["trusted"] = {"type": type(m).__name__, "logits": logits_close(m, c)}
print("RESULT " + json.dumps(out))
"""


def _auto_name(family: str) -> str:
    name = _AUTO.get(family, "AutoModelForCausalLM")
    assert name in loader_classes(family)
    return name


def _save(tmp_path: Path, family: str, encoding: str) -> dict:
    """A tiny patched model with its encoding's weights moved off their initial values, saved; its logits."""
    model = make_model(family, encoding=encoding)
    with torch.no_grad():
        g = torch.Generator().manual_seed(3)
        for p in hf_posenc.encoding_module(model).parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    path = tmp_path / f"{family}-{encoding}"
    model.save_pretrained(path)
    inputs = model_inputs(family)
    with torch.no_grad():
        logits = main_output(model(**inputs))
    torch.save({"inputs": inputs, "logits": logits}, path / "expected.pt")
    return {"path": str(path), "data": str(path / "expected.pt"), "auto": _auto_name(family), "family": family,
            "encoding": encoding}


def _run(tmp_path: Path, mode: str, cases: list[dict]) -> dict:
    spec = tmp_path / f"cases-{mode}.json"
    spec.write_text(json.dumps(cases))
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_MODULES_CACHE=str(tmp_path / "modules"), OMP_NUM_THREADS="1",
               TRANSFORMERS_VERBOSITY="error", HF_HUB_DISABLE_PROGRESS_BARS="1", TQDM_DISABLE="1")
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, mode, str(spec)], env=env, stdin=subprocess.DEVNULL, capture_output=True,
        text=True, timeout=900,
    )
    # (transformers' trust_remote_code prompt goes to stdout with no newline: the result may share its line)
    lines = [ln.split("RESULT ", 1)[1] for ln in proc.stdout.splitlines() if "RESULT " in ln]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1])


def _check(tmp_path: Path, pairs: list[tuple[str, str]]) -> None:
    cases = [_save(tmp_path, fam, enc) for fam, enc in pairs]
    patched = [c for c in cases if not (c["family"] == "llama" and c["encoding"] == "rope")]
    for c in cases:
        config = json.loads((Path(c["path"]) / "config.json").read_text())
        plain = c not in patched
        assert config["model_type"] == (c["family"] if plain else "posenc_" + c["family"]), c
        assert (Path(c["path"]) / "hf_posenc_loader.py").is_file() != plain
    with_import = _run(tmp_path, "import", cases)
    for c in cases:
        got = with_import[c["path"]]
        assert got["logits"][0], (c, got)
    without = _run(tmp_path, "none", patched)
    for c in patched:
        got = without[c["path"]]
        assert "error" in got, (c, got)  # never the unpatched model
        assert "trust_remote_code=True" in got["message"]
        assert got["trusted"]["logits"][0], (c, got)
    assert without["absent"]["error"] in ("ImportError", "ModuleNotFoundError"), without["absent"]
    assert "pip install hf_posenc" in without["absent"]["message"]


@pytest.mark.slow  # every Auto class; the fast tier loads each head class below
def test_auto_classes_load_patched_or_refuse(tmp_path):
    """Every encoding on every family (about 20 s on the 2-core CPU VM: one subprocess per mode)."""
    _check(tmp_path, [(fam, enc) for fam in FAMILIES for enc in ENCODINGS if supports(enc, fam)])


# -- in-process checks (hf_posenc imported) ------------------------------------------------------------


def _logits(model, family):
    with torch.no_grad():
        return main_output(model.eval()(**model_inputs(family)))


def test_rope_on_llama_stays_a_llama_checkpoint(tmp_path):
    from transformers import LlamaForCausalLM

    model = make_model("llama", encoding="rope")
    model.save_pretrained(tmp_path / "rope")
    config = json.loads((tmp_path / "rope" / "config.json").read_text())
    assert config["model_type"] == "llama" and "auto_map" not in config
    plain = LlamaForCausalLM.from_pretrained(tmp_path / "rope")
    torch.testing.assert_close(_logits(plain, "llama"), _logits(model, "llama"))
    # at another base, or in the paper's interleaved layout, rope changes the model: hf_posenc's model type
    for i, params in enumerate(({"theta": 500.0}, {"layout": "interleaved"})):
        other = make_model("llama", encoding="rope", **params)
        other.save_pretrained(tmp_path / f"other{i}")
        assert json.loads((tmp_path / f"other{i}" / "config.json").read_text())["model_type"] == "posenc_llama"
    # switching a model back to rope at its own base makes it a plain Llama again
    hf_posenc.patch_model(other, "rope")
    other.save_pretrained(tmp_path / "back")
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["model_type"] == "llama" and "auto_map" not in config


def test_old_format_still_loads_and_saves_new_format(tmp_path):
    model = make_model("gpt2", encoding="learned")
    model.save_pretrained(tmp_path / "new")
    old = tmp_path / "old"
    old.mkdir()
    config = json.loads((tmp_path / "new" / "config.json").read_text())
    config["model_type"] = "gpt2"  # what hf_posenc 0.1 wrote: the family's type plus position_encoding
    del config["auto_map"]
    (old / "config.json").write_text(json.dumps(config))
    (old / "model.safetensors").write_bytes((tmp_path / "new" / "model.safetensors").read_bytes())
    loaded = hf_posenc.from_pretrained(old)
    torch.testing.assert_close(_logits(loaded, "gpt2"), _logits(model, "gpt2"))
    loaded.save_pretrained(tmp_path / "again")
    assert json.loads((tmp_path / "again" / "config.json").read_text())["model_type"] == "posenc_gpt2"
    from transformers import AutoModelForCausalLM

    again = AutoModelForCausalLM.from_pretrained(tmp_path / "again")
    torch.testing.assert_close(_logits(again, "gpt2"), _logits(model, "gpt2"))


def test_from_config_builds_the_patched_model():
    from transformers import AutoModelForCausalLM

    model = make_model("llama", encoding="alibi")
    built = AutoModelForCausalLM.from_config(model.config)
    assert hf_posenc.describe(built)["encoding"] == "alibi"
    assert type(built).__name__ == "LlamaForCausalLM"


def _tokenizer(path: Path) -> None:
    """A word-level tokenizer over the tiny vocabulary, saved with no tokenizer class named in its files."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, 97)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)
    cfg_file = path / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.pop("tokenizer_class", None)
    cfg_file.write_text(json.dumps(cfg))


@pytest.mark.parametrize("family", ["llama", "gpt2", "bert"])
def test_tokenizer_of_the_family_when_its_files_name_none(tmp_path, family):
    """AutoTokenizer picks the tokenizer by config class when tokenizer_config.json names none: a patched
    checkpoint gets what the unpatched family gets."""
    from transformers import AutoTokenizer

    enc = "alibi"
    got = {}
    for name, model in (("patched", make_model(family, encoding=enc)), ("plain", make_model(family))):
        model.save_pretrained(tmp_path / name)
        _tokenizer(tmp_path / name)
        got[name] = AutoTokenizer.from_pretrained(tmp_path / name)
    assert json.loads((tmp_path / "patched" / "config.json").read_text())["model_type"] == "posenc_" + family
    assert type(got["patched"]) is type(got["plain"])
    text = "w5 w6 w7 <s>"
    assert got["patched"](text)["input_ids"] == got["plain"](text)["input_ids"]


def test_pipeline_and_generate(tmp_path):
    from transformers import pipeline

    model = make_model("llama", encoding="alibi")
    model.save_pretrained(tmp_path)
    _tokenizer(tmp_path)
    pipe = pipeline("text-generation", model=str(tmp_path))
    assert hf_posenc.describe(pipe.model)["encoding"] == "alibi"
    ids = torch.tensor([[5, 6, 7]])
    want = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    got = pipe.model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(want, got)
    text = pipe("w5 w6 w7", max_new_tokens=4, do_sample=False, return_full_text=False)[0]["generated_text"]
    assert text.split() == [f"w{int(i)}" for i in want[0, 3:] if i >= 3]  # special tokens (ids < 3) are not shown


def test_peft_default_targets_and_adapter_round_trip(tmp_path):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    model = make_model("llama", encoding="kerple")
    model.save_pretrained(tmp_path / "base")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    assert base.config.model_type == "posenc_llama"
    lora = peft.get_peft_model(
        base, peft.LoraConfig(r=2, init_lora_weights=False, modules_to_save=hf_posenc.trainable_modules(base))
    )
    assert sorted(lora.peft_config["default"].target_modules) == ["q_proj", "v_proj"]  # PEFT's Llama default
    lora.save_pretrained(tmp_path / "adapter")
    want = _logits(lora, "llama")
    again = hf_posenc.load_adapter(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "adapter")
    torch.testing.assert_close(_logits(again, "llama"), want)
    # PEFT's own Auto loader builds the base with the class it recorded (LlamaForCausalLM, directly: unpatched);
    # hf_posenc's adapter check stops it instead of a silently wrong model
    auto_mapping = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["auto_mapping"]
    assert auto_mapping["base_model_class"] == "LlamaForCausalLM"
    with pytest.raises(ValueError, match="not patched"):
        peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter")


def test_every_head_class_builds_saves_and_loads_patched(tmp_path):
    """Every head class registered for every family: AutoModel*.from_config builds it patched, and the Auto
    class loads its checkpoint back with the same weights (the encoding's included)."""
    import transformers

    count = 0
    for family in FAMILIES:
        config = make_model(family, encoding="alibi").config
        for auto_name, loader in loader_classes(family).items():
            auto = getattr(transformers, auto_name)
            torch.manual_seed(0)
            built = auto.from_config(config)
            assert isinstance(built, loader.__bases__[0]) and not isinstance(built, loader)
            assert hf_posenc.describe(built)["encoding"] == "alibi"
            path = tmp_path / f"{family}-{auto_name}"
            built.save_pretrained(path)
            assert json.loads((path / "config.json").read_text())["auto_map"][auto_name] == (
                f"hf_posenc_loader.{loader.__name__}"
            )
            loaded = auto.from_pretrained(path)
            assert type(loaded) is type(built) and hf_posenc.describe(loaded)["encoding"] == "alibi"
            want, got = built.state_dict(), loaded.state_dict()
            assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
            count += 1
    assert count >= 2 * len(FAMILIES)


def test_trainer_load_best_model_at_end(tmp_path):
    from accelerate.state import AcceleratorState
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from conftest import make_ids

    class Tokens(torch.utils.data.Dataset):
        ids = make_ids(8, 12, seed=3)

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        model = make_model("llama", encoding="kerple", train=True)
        args = TrainingArguments(
            output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, learning_rate=1e-2, use_cpu=True,
            report_to="none", eval_strategy="steps", eval_steps=1, save_steps=1, load_best_model_at_end=True,
            metric_for_best_model="loss", greater_is_better=False, remove_unused_columns=False, disable_tqdm=True,
            save_only_model=True,
        )
        trainer = Trainer(model=model, args=args, train_dataset=Tokens(), eval_dataset=Tokens())
        trainer.train()
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    best = Path(trainer.state.best_model_checkpoint)
    assert json.loads((best / "config.json").read_text())["model_type"] == "posenc_llama"
    assert hf_posenc.describe(trainer.model)["encoding"] == "kerple"
    loaded = AutoModelForCausalLM.from_pretrained(best)
    torch.testing.assert_close(_logits(loaded, "llama"), _logits(trainer.model, "llama"), rtol=0, atol=0)


def test_image_processor_of_the_family_when_its_files_name_none(tmp_path):
    from transformers import AutoImageProcessor, ViTImageProcessor

    got = {}
    for name, model in (("plain", make_model("vit")), ("patched", make_model("vit", encoding="rope2d"))):
        model.save_pretrained(tmp_path / name)
        ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(tmp_path / name)
        cfg_file = tmp_path / name / "preprocessor_config.json"
        cfg = json.loads(cfg_file.read_text())
        del cfg["image_processor_type"]  # the class then comes from the config class
        cfg_file.write_text(json.dumps(cfg))
        try:
            got[name] = AutoImageProcessor.from_pretrained(tmp_path / name)
        except ImportError as e:  # transformers 5.17 without torchvision: no AutoImageProcessor for ViT at all
            assert name == "plain", e
            pytest.skip(f"AutoImageProcessor is unusable here: {e}")
    assert type(got["patched"]) is type(got["plain"])


def test_config_subclass_is_refused_before_anything_changes():
    from transformers import LlamaConfig, LlamaForCausalLM

    from conftest import make_config

    class MyLlamaConfig(LlamaConfig):
        pass

    model = LlamaForCausalLM(MyLlamaConfig(**make_config("llama").to_dict()))
    with pytest.raises(ValueError, match="config subclasses are not supported"):
        hf_posenc.patch_model(model, "alibi")
    assert not hasattr(model.model, "posenc") and "position_encoding" not in model.config.to_dict()
