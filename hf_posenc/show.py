"""``hf-posenc show TARGET --out DIR``: write DIR/profile.json (`hf_posenc.position_profile`) and DIR/profile.png.

TARGET is one of:

* an encoding name (``hf-posenc list``): patched onto a small, seeded, untrained model of ``--family``
  (default llama; `small_model` gives its size), so the picture is the encoding's initial state;
* a plan, a comma-separated list of names (``rope,rope,rope,nope``) or the study's plan syntax
  (``rope:window=16*3/nope``, see `hf_posenc.study.recipes`): one entry per layer, repeated over the depth,
  as `hf_posenc.patch_model` takes a list; an encoding with parameters as ``name:key=value,...``;
* a checkpoint directory saved from a patched model: loaded with `hf_posenc.from_pretrained`.

``--text`` gives the input of the data-dependent encodings: its UTF-8 bytes on a byte-level model (the
small models here, the study's models: vocabulary 256), or the checkpoint's own tokenizer where the
directory holds one. Bad input is reported in one line on stderr with exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .registry import FAMILIES

__all__ = ["add_arguments", "main", "small_model", "tokenize"]

DESCRIPTION = __doc__.split("\n\n", 1)[1]

#: The small default models: width, depth, heads, vocabulary (bytes), ViT image and patch size.
HIDDEN, LAYERS, HEADS, VOCAB = 64, 2, 4, 256
IMAGE_SIZE, PATCH_SIZE = 32, 4


def small_model(family: str, length: int, layers: int = LAYERS, seed: int = 0) -> nn.Module:
    """A seeded, untrained model of ``family`` (hidden 64, ``layers`` layers, 4 heads, byte vocabulary 256, a
    maximum position count of ``length`` on text; ViT: 32 x 32 images in 4 x 4 patches, an 8 x 8 grid)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; allowed: {', '.join(FAMILIES)}")
    import transformers as tf

    common = {"hidden_size": HIDDEN, "num_hidden_layers": layers, "num_attention_heads": HEADS,
              "intermediate_size": 4 * HIDDEN}
    text = dict(common, vocab_size=VOCAB, max_position_embeddings=length)
    decoder = dict(text, num_key_value_heads=HEADS, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                   tie_word_embeddings=False)
    builders = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, decoder),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM, decoder),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, decoder),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, dict(decoder, head_dim=HIDDEN // HEADS)),
        "gemma3_text": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM, dict(decoder, head_dim=HIDDEN // HEADS)),
        "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM, decoder),
        "gpt_neox": (tf.GPTNeoXConfig, tf.GPTNeoXForCausalLM,
                     dict(text, bos_token_id=None, eos_token_id=None, tie_word_embeddings=False)),
        "bert": (tf.BertConfig, tf.BertForMaskedLM, dict(text, pad_token_id=0)),
        "gpt2": (tf.GPT2Config, tf.GPT2LMHeadModel,
                 {"vocab_size": VOCAB, "n_embd": HIDDEN, "n_layer": layers, "n_head": HEADS, "n_inner": 4 * HIDDEN,
                  "n_positions": length, "bos_token_id": None, "eos_token_id": None}),
        "vit": (tf.ViTConfig, tf.ViTForImageClassification,
                dict(common, image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, num_channels=3, num_labels=2)),
    }
    config_cls, model_cls, kw = builders[family]
    torch.manual_seed(seed)
    return model_cls(config_cls(**kw)).eval()


def _tokenizer(path: Path) -> Any:
    """The checkpoint's own tokenizer, if the directory holds one; else None."""
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def tokenize(text: str, model: nn.Module, tokenizer: Any = None) -> tuple[torch.Tensor, list[str]]:
    """(1, L) token ids of ``text`` and each token as text: the tokenizer's, or UTF-8 bytes on a model whose
    vocabulary holds the 256 byte values. ValueError when ``text`` gives no token or the model takes neither."""
    if tokenizer is not None:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        pieces = [str(t) for t in tokenizer.convert_ids_to_tokens(ids)]
    else:
        vocab = getattr(model.config, "vocab_size", 0) or 0
        if vocab < 256:
            raise ValueError(
                f"--text needs a tokenizer in the checkpoint directory or a byte-level model (vocab_size >= 256); "
                f"this model has vocab_size {vocab} and no tokenizer"
            )
        data = text.encode("utf-8")
        ids = list(data)
        pieces = [bytes([b]).decode("latin-1") for b in data]
    if not ids:
        raise ValueError(f"--text {text!r} tokenizes to nothing; give some text")
    return torch.tensor([ids], dtype=torch.long), pieces


def _load_target(args: argparse.Namespace) -> tuple[nn.Module, Any, dict[str, Any]]:
    """The patched model, its tokenizer (or None) and what the JSON records about the target."""
    from . import from_pretrained
    from .api import patch_model

    target = args.target
    path = Path(target)
    if path.is_dir():
        if args.family is not None:
            raise ValueError("--family applies to encoding names and plans; a checkpoint brings its own model")
        model = from_pretrained(path).eval()
        return model, _tokenizer(path), {"target": target, "checkpoint": str(path)}
    from .study.recipes import parse_study_entry

    # a comma-separated list of plain names is a plan too (one name per layer)
    spec = target.replace(",", "/") if "," in target and ":" not in target else target
    try:
        entry = parse_study_entry(spec)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{target!r} is neither a directory nor an encoding spec or plan: {e}") from None
    family = args.family or "llama"
    # the small model's maximum position count: the curves' length, and the byte length of --text
    positions = max(args.length, len(args.text.encode("utf-8")) if args.text else 0)
    if family not in FAMILIES:
        raise ValueError(f"unknown --family {family!r}; allowed: {', '.join(FAMILIES)}")
    if entry.eval_scaling is not None:
        raise ValueError("eval_scaling is a study setting (applied at each evaluation length); give rope's scaling")
    if entry.is_plan:
        model = small_model(family, positions, layers=max(LAYERS, len(entry.encoding)))
    else:
        model = small_model(family, positions)
    patch_model(model, entry.encoding)
    return model.eval(), None, {"target": target, "family": family, "model": "small untrained default (seed 0)"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", help="an encoding name (name:key=value,... with parameters), a plan (comma-separated "
                   "names, or rope*3/nope) or a checkpoint directory")
    p.add_argument("--out", required=True, help="output directory for profile.json and profile.png")
    p.add_argument("--length", type=int, default=64, help="N, the positions of the curves and matrices (default 64)")
    p.add_argument("--text", default=None, help="input of the data-dependent encodings (default: a fixed sample)")
    p.add_argument("--family", default=None,
                   help=f"model family for an encoding name or plan (default llama): {', '.join(FAMILIES)}")


def main(args: argparse.Namespace) -> int:
    """Run ``hf-posenc show``; 0 on success, 2 with a one-line error on bad input."""
    from .profile import position_profile

    try:
        if args.length < 1:
            raise ValueError(f"--length must be >= 1, got {args.length}")
        model, tokenizer, source = _load_target(args)
        input_ids, pieces = None, None
        if args.text is not None:
            if getattr(model.config, "model_type", "").endswith("vit"):
                raise ValueError("--text does not apply to a ViT model (its data-dependent profile uses a fixed image)")
            input_ids, pieces = tokenize(args.text, model, tokenizer)
        profile = position_profile(model, length=args.length, input_ids=input_ids)
        if pieces is not None:
            profile["token_text"] = pieces
        profile = {"source": source, **profile}
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "profile.json").write_text(json.dumps(profile) + "\n")
        from .profile_plot import draw_profile

        draw_profile(profile, out / "profile.png")
    except (ValueError, TypeError, ImportError, OSError) as e:
        print(f"hf-posenc show: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out / 'profile.json'} and {out / 'profile.png'}")
    return 0
