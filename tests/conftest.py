"""Shared fixtures and factories for the hf_posenc test-suite: tiny, seeded Llama, GPT-2 and ViT models.

Every model is built from a config (no downloads), seeded, in eval mode unless asked otherwise, with
every dropout at zero so that train mode is deterministic too. ``initializer_range`` is raised from
the transformers default (0.02) to 0.2: with the default, attention in a random tiny model is nearly
uniform and the logits barely depend on positions, so a broken encoding would go unnoticed.
"""

from __future__ import annotations

# -- Triton's interpreter on CPU-only machines: must come before anything imports triton -------------------
# Triton reads TRITON_INTERPRET when a function is decorated with @triton.jit, and its own library
# functions (tl.sum, tl.max, tl.zeros, ...) are decorated when triton is first imported. transformers
# imports triton when a model module is imported (this file imports LlamaForCausalLM below), so a
# kernel interpreted later, after a test sets the variable, finds those functions compiled and fails with
# "Cannot call @triton.jit'd outside of the scope of a kernel". Without a CUDA device every kernel test
# runs interpreted, so the whole suite sets the variable here, first. ``import torch`` does not import
# triton (checked below); tests that need the compiled mode's errors override it with monkeypatch.
import os
import sys
import warnings

import torch

if not torch.cuda.is_available():
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") is None:
        warnings.warn(
            "triton was imported before tests/conftest.py could set TRITON_INTERPRET=1; interpreted kernels "
            "that call triton.language library functions will fail. Set TRITON_INTERPRET=1 in the environment.",
            stacklevel=1,
        )
    os.environ.setdefault("TRITON_INTERPRET", "1")

from typing import Any  # noqa: E402

import pytest  # noqa: E402
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    GPT2Model,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaModel,
    ViTConfig,
    ViTForImageClassification,
    ViTModel,
)

import hf_posenc  # noqa: E402
from hf_posenc.registry import get_encoding  # noqa: E402

# The models are tiny: intra-op threads only add synchronisation, and when the 2 cores are shared with
# another process, OpenMP barriers make every small op take milliseconds (a 50x slow-down, measured).
torch.set_num_threads(1)

FAMILIES = ("llama", "gpt2", "vit")
DECODERS = ("llama", "gpt2")
ENCODINGS = tuple(hf_posenc.list_encodings())

VOCAB = 97
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
MAX_POSITIONS = 64
IMAGE_SIZE, PATCH_SIZE, NUM_LABELS = 32, 8, 3
INIT_RANGE = 0.2

#: (head class, base class) per family.
CLASSES = {
    "llama": {"head": LlamaForCausalLM, "base": LlamaModel},
    "gpt2": {"head": GPT2LMHeadModel, "base": GPT2Model},
    "vit": {"head": ViTForImageClassification, "base": ViTModel},
}


def make_config(family: str, **overrides: Any):
    """A fresh tiny config for ``family`` (a new object each call: patching never leaks between tests)."""
    if family == "llama":
        kw = dict(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,  # grouped-query attention
            max_position_embeddings=MAX_POSITIONS,
            pad_token_id=PAD_ID,
            bos_token_id=BOS_ID,
            eos_token_id=EOS_ID,
            initializer_range=INIT_RANGE,
            tie_word_embeddings=False,
        )
        kw.update(overrides)
        return LlamaConfig(**kw)
    if family == "gpt2":
        kw = dict(
            vocab_size=VOCAB,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=MAX_POSITIONS,
            n_inner=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            pad_token_id=PAD_ID,
            bos_token_id=BOS_ID,
            eos_token_id=EOS_ID,
            initializer_range=INIT_RANGE,
        )
        kw.update(overrides)
        return GPT2Config(**kw)
    if family == "vit":
        kw = dict(
            image_size=IMAGE_SIZE,
            patch_size=PATCH_SIZE,
            num_channels=3,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            num_labels=NUM_LABELS,
            initializer_range=INIT_RANGE,
        )
        kw.update(overrides)
        return ViTConfig(**kw)
    raise ValueError(f"unknown family {family!r}")


def model_class(family: str, head: str = "head"):
    """The transformers class for ``family``: ``head`` (LM / classification head) or ``base``."""
    head = {"lm": "head", "cls": "head"}.get(head, head)
    return CLASSES[family][head]


def make_model(
    family: str,
    head: str = "head",
    seed: int = 0,
    encoding: str | None = None,
    train: bool = False,
    dtype: torch.dtype | None = None,
    config_overrides: dict[str, Any] | None = None,
    **params: Any,
):
    """A seeded tiny model of ``family``; patched with ``encoding`` (and ``params``) when given.

    Args:
        head: "head" (alias "lm"/"cls": LlamaForCausalLM, GPT2LMHeadModel, ViTForImageClassification)
            or "base" (LlamaModel, GPT2Model, ViTModel).
        seed: the torch seed for the weights; the encoding's own parameters are drawn right after, so
            the same (family, head, seed, encoding) always gives the same model.
        train: train mode (dropouts are 0, so it is deterministic) instead of eval mode.
        dtype: cast after patching (``model.to(dtype)``).
    """
    cls = model_class(family, head)
    torch.manual_seed(seed)
    model = cls(make_config(family, **(config_overrides or {})))
    if encoding is not None:
        hf_posenc.patch_model(model, encoding, **params)
    if dtype is not None:
        model.to(dtype)
    model.train(train)
    return model


def supports(encoding: str, family: str) -> bool:
    return family in get_encoding(encoding).families


def combos(families=FAMILIES, encodings=ENCODINGS, extra=None, extra_ids=None):
    """pytest params (family, encoding[, *extra]) with ids like ``llama-alibi-static``; unsupported pairs skip."""
    out = []
    for fam in families:
        for enc in encodings:
            marks = () if supports(enc, fam) else (pytest.mark.skip(reason=f"{enc} does not support {fam}"),)
            if extra is None:
                out.append(pytest.param(fam, enc, id=f"{fam}-{enc}", marks=marks))
                continue
            for i, e in enumerate(extra):
                values = e if isinstance(e, tuple) else (e,)
                tag = extra_ids[i] if extra_ids else "-".join(str(v) for v in values)
                out.append(pytest.param(fam, enc, *values, id=f"{fam}-{enc}-{tag}", marks=marks))
    return out


# -- inputs -----------------------------------------------------------------------------------------


def make_ids(batch: int = 2, length: int = 10, seed: int = 1) -> torch.Tensor:
    """Random token ids (batch, length) that avoid the special tokens (pad/bos/eos)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=g)


def make_pixels(batch: int = 2, height: int = IMAGE_SIZE, width: int = IMAGE_SIZE, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, height, width, generator=g)


def left_pad(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad 1D id tensors into (input_ids, attention_mask)."""
    length = max(r.numel() for r in rows)
    ids = torch.full((len(rows), length), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, length - r.numel() :] = r
        mask[i, length - r.numel() :] = 1
    return ids, mask


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """position_ids as transformers' ``generate`` computes them: cumsum(mask) - 1, clamped at 0."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def model_inputs(family: str, batch: int = 2, length: int = 10, seed: int = 1) -> dict[str, torch.Tensor]:
    """Inputs for one forward: ``input_ids`` (text) or ``pixel_values`` (ViT)."""
    if family == "vit":
        return {"pixel_values": make_pixels(batch, seed=seed)}
    return {"input_ids": make_ids(batch, length, seed=seed)}


def main_output(out) -> torch.Tensor:
    """The tensor to compare: logits for head classes, last_hidden_state for base classes."""
    logits = getattr(out, "logits", None)
    return logits if logits is not None else out.last_hidden_state


def forward_and_loss(family: str, model, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(main output, scalar loss): the model's own loss for head classes (labels = the input ids, or
    ``arange(B) % NUM_LABELS`` for ViT), the mean square of the last hidden state for base classes."""
    kw = {} if family == "vit" else {"use_cache": False}
    if isinstance(model, model_class(family, "base")):
        out = main_output(model(**inputs, **kw))
        return out, out.float().pow(2).mean()
    if family == "vit":
        labels = torch.arange(inputs["pixel_values"].shape[0]) % NUM_LABELS
    else:
        labels = inputs["input_ids"]
    out = model(**inputs, labels=labels, **kw)
    return out.logits, out.loss


@pytest.fixture
def build():
    """The ``make_model`` factory as a fixture."""
    return make_model
