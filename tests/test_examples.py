"""The examples run as a user runs them: examples/convert.py on a tiny pretrained checkpoint (with a tokenizer),
given as a directory and as a hub id (from a local hub cache, offline); examples/finetune.py --base with a hub id."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TEXT = ("In Python, a decorator is a function that takes a function and returns another one. "
        "Lists, tuples and dictionaries are built-in types; a generator yields values lazily. ") * 20


def _tiny_checkpoint(path: Path) -> Path:
    """A tiny RoPE Llama with a byte-level BPE tokenizer trained on TEXT, saved as a pretrained checkpoint."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=320, special_tokens=["<eos>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=256, eos_token_id=tokenizer.eos_token_id))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _hub_cache(home: Path, repo_id: str, checkpoint: Path) -> None:
    """``repo_id`` in a Hugging Face hub cache under ``home``, as a download leaves it (one snapshot, refs/main)."""
    repo = home / "hub" / ("models--" + repo_id.replace("/", "--"))
    commit = "0" * 40
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for f in checkpoint.iterdir():
        (snapshot / f.name).write_bytes(f.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)


def _run(args: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **env}
    return subprocess.run([sys.executable, *args], cwd=tmp_path, env=environ, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.parametrize("given", ["directory", pytest.param("hub id", marks=pytest.mark.slow)])
def test_convert_example_on_a_tiny_checkpoint(tmp_path, given):
    checkpoint = _tiny_checkpoint(tmp_path / "tiny-llama")
    text = tmp_path / "text.txt"
    text.write_text(TEXT * 3)
    env = {}
    source = str(checkpoint)
    if given == "hub id":
        _hub_cache(tmp_path / "hf", "someone/tiny-llama", checkpoint)
        source = "someone/tiny-llama"
        env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    out = tmp_path / "out"
    done = _run([str(ROOT / "examples/convert.py"), "--from", source, "--data", str(text), "--steps", "4",
                 "--seq", "32", "--max-new-tokens", "6", "--threads", "1", "--out", str(out)], tmp_path, **env)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["encoding"]["name"] == "rope+fire" and summary["encoding"]["init"] == "identity"
    assert summary["step0_max_logit_change"] < 1e-4  # inert: the pretrained logits at step 0
    assert len(summary["train_losses"]) == 4 and summary["encoding_parameters_moved"] > 0
    assert summary["reloaded_class"] == "LlamaForCausalLM"  # the Auto class gives the family's class, patched
    assert summary["reload_logits_identical"] and summary["generation_identical"]
    assert json.loads((out / "config.json").read_text())["position_encoding"]["name"] == "rope+fire"
    assert "->" in done.stdout


def test_convert_example_says_what_is_wrong_with_a_directory_that_is_no_checkpoint(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("convert_example", ROOT / "examples/convert.py")
    convert = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(convert)
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="without config.json is not a checkpoint"):
        convert.resolve(str(tmp_path / "empty"))
    assert convert.resolve("someone/a-model") == "someone/a-model"  # a hub id goes to transformers as it is


@pytest.mark.slow
def test_finetune_example_takes_a_hub_id(tmp_path):
    checkpoint = _tiny_checkpoint(tmp_path / "tiny-llama")
    _hub_cache(tmp_path / "hf", "someone/tiny-llama", checkpoint)
    out = tmp_path / "out"
    done = _run([str(ROOT / "examples/finetune.py"), "--base", "someone/tiny-llama", "--encoding", "alibi",
                 "--steps", "2", "--eval-every", "1", "--eval-batches", "1", "--batch", "2", "--seq", "32",
                 "--out", str(out)], tmp_path, HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["base"] == "someone/tiny-llama" and summary["encoding"]["name"] == "alibi"
    assert all(summary["reload_checks"].values())
