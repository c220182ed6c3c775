"""The conversion study (``hf-posenc study --from CHECKPOINT``): what swapping a pretrained model's position
encoding costs, and how much a short fine-tune heals it.

For each entry the pretrained model is patched (a plain swap such as ``alibi``, or a composition that keeps the
model's rotary, ``rope+fox:init=identity``) and fine-tuned for ``--steps`` on English text at ``--train-len``
tokens. Perplexity per token is evaluated at each ``--factors`` multiple of the fine-tuning length (default 1x,
2x, 4x) at three points: before the swap (the unpatched model, once per study), right after it (step 0), and
after fine-tuning. Baselines: ``rope`` (the unpatched model, since ``rope`` reproduces it, fine-tuned the same
way) and ``rope:eval_scaling=yarn`` (the unpatched model with YaRN at evaluation only: it is not trained).

The text: ``--data`` if given, else the English documentation that ships with Python (``pydoc_data.topics``: the
language reference's topics, about 110 thousand SmolLM2 tokens), tokenised with the checkpoint's tokenizer; the
first 90 % trains, the last 10 % evaluates. No download beyond the checkpoint itself: ``--from smollm2`` builds
the cached SmolLM2-135M-Instruct checkpoint (`hf_posenc.testing.smollm2`).

The run records the checkpoint's name and SHA-256 hashes of its config.json and its weight files.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from . import data as D
from .config import CONVERSION_ENCODINGS, StudyConfig
from .sources import TextSource, subseed

__all__ = ["CONVERSION_ENCODINGS", "PretrainedTextSource", "checkpoint_record", "load_pretrained",
           "native_export_record", "resolve_source", "term_effect"]

#: the fraction of the text's tokens that trains (the rest evaluates).
TRAIN_FRACTION = 0.9

_LOADED: dict[str, nn.Module] = {}


#: (hub id, Hub cache directory) already resolved to a snapshot directory in this process
_RESOLVED: dict[tuple[str, str], Path] = {}


def resolve_source(source: str) -> Path:
    """The checkpoint directory of ``--from``: a directory with config.json; ``smollm2`` (the cached
    SmolLM2-135M-Instruct, built on first use by ``hf_posenc.testing.smollm2``); or a Hugging Face Hub id
    (``org/name``), resolved by transformers' own loading (``cached_file``): the local Hub cache is used first
    (``HF_HOME``, ``HF_HUB_CACHE``; offline too, with ``HF_HUB_OFFLINE=1``), what it lacks is downloaded. The
    config, the safetensors weights (one file or the shards of ``model.safetensors.index.json``) and the tokenizer
    are fetched into the cache, and their snapshot directory is returned.

    Raises:
        ValueError: a directory without config.json, a path that does not exist and is no hub id, or a hub id
            that neither the cache nor the network can provide (the reason, and what to do, in the message).
    """
    if source == "smollm2":
        from ..testing import smollm2

        return Path(smollm2())
    path = Path(source).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"--from {source!r}: not a checkpoint directory (no config.json)")
        return path
    from huggingface_hub import constants

    key = (source, str(constants.HF_HUB_CACHE))
    if key not in _RESOLVED:
        _RESOLVED[key] = _hub_snapshot(source)
    return _RESOLVED[key]


def _looks_like_hub_id(source: str) -> bool:
    """``name`` or ``org/name`` of letters, digits and ``-_.`` (the Hub's rule), not a path."""
    import re

    name = r"[A-Za-z0-9][A-Za-z0-9._-]*"
    return bool(re.fullmatch(rf"{name}(/{name})?", source)) and ".." not in source


def _hub_snapshot(repo_id: str) -> Path:
    """The Hub cache's snapshot directory of ``repo_id`` with its config, safetensors weights and tokenizer."""
    if not _looks_like_hub_id(repo_id):
        raise ValueError(f"--from {repo_id!r}: no such directory, and not a Hugging Face Hub id (org/name); give a "
                         "checkpoint directory (with config.json), a hub id, or 'smollm2'")
    from transformers import AutoTokenizer
    from transformers.utils import cached_file

    try:
        config = Path(cached_file(repo_id, "config.json"))
        index = cached_file(repo_id, "model.safetensors.index.json", _raise_exceptions_for_missing_entries=False)
        if index is not None:
            shards = sorted(set(json.loads(Path(index).read_text())["weight_map"].values()))
        else:
            shards = ["model.safetensors"]
        for shard in shards:
            cached_file(repo_id, shard)
        AutoTokenizer.from_pretrained(repo_id)  # its files into the same snapshot
    except OSError as e:
        from huggingface_hub import constants

        first = (str(e).strip().splitlines() or [type(e).__name__])[0].rstrip(".")
        offline = ("HF_HUB_OFFLINE is set and the local cache does not hold it" if constants.HF_HUB_OFFLINE else
                   "neither the local cache nor the Hub gave it (no network, no such repository, or no safetensors "
                   "weights)")
        raise ValueError(
            f"--from {repo_id!r}: no such directory, and the Hugging Face Hub checkpoint could not be loaded: "
            f"{offline}. Looked in the cache {constants.HF_HUB_CACHE} (set HF_HOME or HF_HUB_CACHE to use another). "
            f"transformers said: {first}. Download it where there is network (hf download {repo_id}; a conversion "
            "study needs config.json, safetensors weights and the tokenizer), or give a checkpoint directory."
        ) from None
    return config.parent


def _sha256(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
    return h.hexdigest()


def checkpoint_record(path: Path) -> dict[str, Any]:
    """Name, model type, and SHA-256 of config.json and of the weight files (in name order)."""
    config = json.loads((path / "config.json").read_text())
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        raise ValueError(f"{path} holds no *.safetensors weights (hf_posenc loads safetensors only)")
    record = {
        "path": str(path),
        "name": config.get("_model_name_or_path") or config.get("_name_or_path") or path.name,
        "model_type": config.get("model_type"),
        "config_sha256": _sha256([path / "config.json"]),
        "weights_sha256": _sha256(weights),
        "weight_files": [w.name for w in weights],
    }
    hub = [source for (source, _), v in _RESOLVED.items() if v == path]
    if hub:  # a Hub checkpoint: its id and the commit of its snapshot
        record.update(name=hub[0], hub_id=hub[0], revision=path.name)
    return record


def load_pretrained(path: Path) -> nn.Module:
    """A fresh copy of the checkpoint's causal LM in float32 (loaded once per process, then deep-copied)."""
    key = str(path)
    if key not in _LOADED:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
        model.config.use_cache = False
        _LOADED[key] = model
    return copy.deepcopy(_LOADED[key])


def _english_text() -> tuple[str, str]:
    import pydoc_data.topics as topics

    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    return text, "pydoc_data.topics (the Python language reference's topics, shipped with Python)"


class PretrainedTextSource(TextSource):
    """Next-token prediction with the checkpoint's tokenizer on English text (see the module docstring);
    metric: perplexity per token. Batches and evaluation windows as `TextSource` builds them."""

    def __init__(self, config: StudyConfig, lengths: list[int], seed: int | None = None) -> None:
        from transformers import AutoTokenizer

        self.config, self.lengths = config, lengths
        self.seed = config.seed if seed is None else seed
        path = resolve_source(config.source)
        tokenizer = AutoTokenizer.from_pretrained(path)
        if config.data is not None:
            if not Path(config.data).is_file():
                raise ValueError(f"--data {config.data!r}: a conversion study reads one text file")
            text, what = Path(config.data).read_text(encoding="utf-8", errors="replace"), str(config.data)
        else:
            text, what = _english_text()
        ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
        cut = int(ids.numel() * TRAIN_FRACTION)
        self.long = None
        if config.long_eval:  # the last FP tokens are held out for the long evaluation (and the short one)
            from transformers import AutoConfig

            from .long import context_length, make_long_eval

            context, factor = context_length(AutoConfig.from_pretrained(path)), config.long_factor
            cut = min(cut, ids.numel() - factor * context)
            if cut <= config.train_len:
                raise ValueError(
                    f"--long-eval holds out the last {factor}P = {factor * context} tokens of the text (P = {context}, "
                    f"the checkpoint's max_position_embeddings; --long-factor {factor}), and the text has "
                    f"{ids.numel()} tokens in this checkpoint's tokenizer: too few left to fine-tune on; give a longer "
                    "--data"
                )
            self.long = make_long_eval(tokenizer, ids[cut:], context, subseed(self.seed, "passkey"),
                                       config.passkey_lengths, config.passkey_positions, factor)
        self.corpus = SimpleNamespace(train=ids[:cut], val=ids[cut:], source=what)
        if self.corpus.train.numel() <= config.train_len:
            raise ValueError(f"the training split has {self.corpus.train.numel()} tokens: too few for --train-len")
        self.windows = D.eval_windows(self.corpus.val, lengths, config.eval_tokens)
        self.vocab_size = len(tokenizer)
        self.tokenizer_name = type(tokenizer).__name__

    def describe(self) -> dict[str, Any]:
        first = next(iter(self.windows.values()))
        return {
            "source": self.corpus.source,
            "unit": "token",
            "tokenizer": self.tokenizer_name,
            "train_tokens": int(self.corpus.train.numel()),
            "val_tokens": int(self.corpus.val.numel()),
            "eval_tokens_per_length": int(first.numel()),
            "eval": "the same validation tokens at every length, cut into windows; every token but each window's "
            "first is predicted from the tokens before it in its window",
            **({"long_eval": self.long.describe()} if self.long is not None else {}),
        }

    def evaluate_long(self, model: nn.Module, device: torch.device, label: str = "") -> dict[str, Any]:
        """The evaluation past the pretrained context (``hf_posenc.study.long.evaluate_long``)."""
        from .long import evaluate_long

        if self.long is None:
            raise ValueError("this study has no long evaluation (--long-eval)")
        return evaluate_long(model, self.long, device, progress=self.config.progress, label=label)

    def evaluate(self, model: nn.Module, length: int, device: torch.device, split: str = D.IN_DISTRIBUTION
                 ) -> dict[str, Any]:
        out = super().evaluate(model, length, device, split)
        out["bits_per_token"] = out.pop("bits_per_byte")
        return out


@torch.no_grad()
def term_effect(model: nn.Module, windows: torch.Tensor) -> dict[str, float]:
    """What the term of a composition (``rope+fire``, ``rope+fox``, ...) contributes to a model: its logits on
    ``windows`` (N, L) token ids, one window at a time, against those of the same model with the term set back to
    inert (its ``start_inert``; the model is left so).

    Returns:
        ``term_effect_max`` and ``term_effect_mean``: the largest and the mean |logit| difference;
        ``perplexity`` and ``perplexity_term_inert``: per token over the windows, before and after resetting.

    Raises:
        ValueError: the model's encoding is not a composition, or its term has no inert start.
    """
    from ..api import encoding_module
    from ..encodings.base import unwrap

    term = getattr(unwrap(encoding_module(model)), "term", None)
    if term is None:
        raise ValueError("term_effect measures a composition's term (e.g. 'rope+fire'); this model has none")

    def logits() -> torch.Tensor:
        model.eval()
        return torch.cat([model(input_ids=windows[i : i + 1]).logits.float() for i in range(windows.shape[0])])

    def ppl(x: torch.Tensor) -> float:
        return math.exp(float(nn.functional.cross_entropy(x[:, :-1].reshape(-1, x.shape[-1]),
                                                          windows[:, 1:].reshape(-1))))

    trained = logits()
    term.start_inert()
    inert = logits()
    diff = (trained - inert).abs()
    return {"term_effect_max": float(diff.max()), "term_effect_mean": float(diff.mean()),
            "perplexity": ppl(trained), "perplexity_term_inert": ppl(inert)}


def perplexity(loss: float) -> float | None:
    return math.exp(loss) if loss < 700 else None


def native_export_record(model: nn.Module) -> dict[str, Any]:
    """Whether a converted model exports to a stock transformers architecture (`hf_posenc.export_native`), as
    the study records it: ``{"exports": True, "architecture": "SmolLM3ForCausalLM"}``, or ``{"exports": False,
    "reason": ...}`` with the export's message (the part with no stock equivalent, the nearest recipe)."""
    from ..export import native_export

    try:
        return {"exports": True, "architecture": native_export(model).architecture}
    except ValueError as e:
        return {"exports": False, "reason": str(e)}
