"""The real tier, issue 44: on SmolLM2-135M-Instruct, a composition started inert moves when it is fine-tuned by the
documented recipe (hf_posenc.param_groups' default rates, the conversion study's optimizer), where at the model's
own rate it stays inert. Minutes on a CPU: ``pytest -m "real and slow" tests/test_real_conversion.py``."""

from __future__ import annotations

import pytest
import torch

import hf_posenc
from hf_posenc.study.pretrained import PretrainedTextSource, load_pretrained, resolve_source, term_effect
from hf_posenc.study.train import StudyConfig, deterministic, fine_tune
from hf_posenc.testing import CheckpointUnavailable, smollm2

pytestmark = [pytest.mark.real, pytest.mark.slow]


@pytest.fixture(scope="module")
def data():
    try:
        smollm2()
    except CheckpointUnavailable as e:
        pytest.skip(f"SmolLM2 checkpoint unavailable: {e}")
    config = StudyConfig(source="smollm2", steps=12, batch=2, train_len=256, eval_tokens=1024, factors=[1],
                         out=None).resolved()
    return config, PretrainedTextSource(config, [256])


@pytest.mark.parametrize("term", ["fire", "fox"])
def test_an_inert_term_moves_with_its_own_learning_rate(data, term):
    """12 steps of 2 x 256 tokens, the model at 1e-4 and the term at param_groups' default: the term changes the
    logits by at least 0.5 (measured: fire 1.64, fox 1.60; docs/compositions.md)."""
    config, source = data
    with deterministic(torch.device("cpu"), 1):  # one thread: two stall on a busy 2-core VM
        torch.manual_seed(0)
        model = load_pretrained(resolve_source("smollm2"))
        hf_posenc.patch_model(model, f"rope+{term}", init="identity")
        fine_tune(model, source.train_batches(), config, config.steps, torch.device("cpu"))
        effect = term_effect(model, source.windows[256])
    assert effect["term_effect_max"] >= 0.5, effect
