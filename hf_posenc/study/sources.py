"""What a study trains and evaluates on: one data source per task.

`make_source` picks the source of a study's task:

* `TextSource` (``--task text``): next-byte prediction on a byte corpus (`data.load_corpus`);
  metric: validation perplexity per byte over the same validation bytes at every length.
* `TaskSource` (``flip-flop``, ``selective-copy``, ``counting``, ``passkey``): a synthetic task of
  `hf_posenc.study.data` with its out-of-distribution splits; metric: answer accuracy (passkey:
  retrieval, the share of sequences whose every key digit is right).
* `DigitsSource` (``digits``, ViT): scikit-learn's 8x8 digits upscaled; metric: test accuracy.

Each source is built once per seed and shared by every encoding of a study; every random draw comes from a
generator seeded by `subseed` from the seed and a purpose, so the training batches and evaluation
sets are the same for every encoding, and the same in worker processes (``--jobs``).
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from . import data as D
from .config import VIT_PATCH, StudyConfig

__all__ = ["VIT_PATCH", "DataSource", "DigitsSource", "TaskSource", "TextSource", "make_source", "subseed"]

def subseed(seed: int, *parts: Any) -> int:
    """A stable 63-bit seed from the study seed and a purpose (no Python ``hash``, which is salted)."""
    h = hashlib.sha256(repr((seed, *parts)).encode()).digest()
    return int.from_bytes(h[:8], "little") >> 1


def _exp(x: float) -> float | None:
    return math.exp(x) if x < 700 else None


class DataSource:
    """The data of one study and one seed: training batches, evaluation at each length, a description.

    Attributes:
        config: the resolved `StudyConfig`.
        lengths: the evaluation lengths (tokens; ViT: image sides in pixels).
        seed: the seed of this source's batches and evaluation sets.
        vocab_size: the model's vocabulary (0 on ViT).
        splits: the evaluation splits, `data.IN_DISTRIBUTION` first (only tasks have others).
    """

    vocab_size: int
    splits: tuple[str, ...] = (D.IN_DISTRIBUTION,)

    def __init__(self, config: StudyConfig, lengths: list[int], seed: int | None = None) -> None:
        self.config, self.lengths = config, lengths
        self.seed = config.seed if seed is None else seed

    def profile_sample(self) -> torch.Tensor | None:
        """(1, train_len) token ids on which the data-dependent encodings' profiles are drawn, or None (ViT:
        the profile draws an image of its own)."""
        return None

    def describe(self) -> dict[str, Any]:
        """JSON-ready description of the data (for ``results.json``; ``--resume`` compares it)."""
        raise NotImplementedError

    def train_batches(self) -> Iterator[tuple[dict[str, torch.Tensor], int]]:
        """``config.steps`` training batches (model keyword arguments, number of tokens or images): the same
        sequence for every encoding of a study."""
        raise NotImplementedError

    def evaluate(self, model: nn.Module, length: int, device: torch.device,
                 split: str = D.IN_DISTRIBUTION) -> dict[str, Any]:
        """Metrics of ``model`` at one evaluation length on one split; ``"metric"`` is the study's number."""
        raise NotImplementedError


class TextSource(DataSource):
    """Next-byte prediction (vocabulary 256) on ``config.data`` or the standard library's source.

    Training: ``steps`` batches of ``batch`` windows of ``train_len`` bytes at random offsets of the training
    split. Evaluation at length n: the same ``eval_tokens`` validation bytes cut into windows of n
    (`data.eval_windows`); every byte but each window's first is predicted from the bytes before it.
    """

    vocab_size = 256

    def __init__(self, config: StudyConfig, lengths: list[int], seed: int | None = None) -> None:
        super().__init__(config, lengths, seed)
        self.corpus = D.load_corpus(config.data)
        if self.corpus.train.numel() <= config.train_len:
            raise ValueError(f"the training split has {self.corpus.train.numel()} bytes: too few for --train-len")
        self.windows = D.eval_windows(self.corpus.val, lengths, config.eval_tokens)

    def profile_sample(self) -> torch.Tensor:
        """The first ``train_len`` validation bytes, shape (1, train_len)."""
        return self.corpus.val[: self.config.train_len][None].long()

    def describe(self) -> dict[str, Any]:
        first = next(iter(self.windows.values()))
        return {
            **self.corpus.describe(),
            "eval_bytes_per_length": int(first.numel()),
            "eval": "the same validation bytes at every length, cut into windows; every byte but each "
            "window's first is predicted from the bytes before it in its window",
        }

    def train_batches(self) -> Iterator[tuple[dict[str, torch.Tensor], int]]:
        c = self.config
        gen = torch.Generator().manual_seed(subseed(self.seed, "train"))
        data = self.corpus.train
        for _ in range(c.steps):
            starts = torch.randint(0, data.numel() - c.train_len + 1, (c.batch,), generator=gen)
            x = torch.stack([data[s : s + c.train_len] for s in starts.tolist()])
            yield {"input_ids": x, "labels": x}, x.numel()

    @torch.no_grad()
    def evaluate(self, model: nn.Module, length: int, device: torch.device,
                 split: str = D.IN_DISTRIBUTION) -> dict[str, Any]:
        """``loss``, ``perplexity`` (the metric), ``bits_per_byte`` and ``tokens``; with positions past
        ``train_len`` also ``loss_beyond_train_len`` and ``perplexity_beyond_train_len`` (targets at positions
        >= train_len only)."""
        if split != D.IN_DISTRIBUTION:
            raise ValueError(f"the text study has no split {split!r}")
        model.eval()
        windows = self.windows[length]
        per_batch = max(1, 4096 // length)
        total = tail = 0.0
        n_total = n_tail = 0
        for i in range(0, windows.shape[0], per_batch):
            x = windows[i : i + per_batch].to(device)
            logits = model(input_ids=x).logits.float()
            nll = nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="none"
            ).view(x.shape[0], -1)
            total += nll.sum().item()
            n_total += nll.numel()
            beyond = nll[:, self.config.train_len - 1 :]  # targets at positions >= train_len
            tail += beyond.sum().item()
            n_tail += beyond.numel()
        loss = total / n_total
        out = {"loss": loss, "perplexity": _exp(loss), "bits_per_byte": loss / math.log(2), "tokens": n_total}
        if n_tail:
            out["loss_beyond_train_len"] = tail / n_tail
            out["perplexity_beyond_train_len"] = _exp(tail / n_tail)
        out["metric"] = out["perplexity"]
        return out


class TaskSource(DataSource):
    """A synthetic task (`data.get_task`): training batches drawn fresh from its generator, and
    ``eval_sequences`` fixed evaluation sequences per length and split (trained and scored on the answer
    tokens only)."""

    def __init__(self, config: StudyConfig, lengths: list[int], seed: int | None = None) -> None:
        super().__init__(config, lengths, seed)
        c = config
        self.task = D.get_task(c.task)
        for n in (c.train_len, *lengths):
            self.task.check_length(n)
        self.vocab_size = self.task.vocab_size
        self.split_tasks = self.task.splits()
        self.splits = tuple(self.split_tasks)
        self.eval_sets: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
        for split, task in self.split_tasks.items():
            for n in lengths:
                # The in-distribution sets keep the seeds they had before splits existed (same numbers).
                key = (self.seed, "eval", n) if split == D.IN_DISTRIBUTION else (self.seed, "eval", split, n)
                rng = random.Random(subseed(*key))
                self.eval_sets[split, n] = D.task_batch(task, rng, c.eval_sequences, n)

    def profile_sample(self) -> torch.Tensor:
        """The first in-distribution evaluation sequence at the training length (or the shortest evaluation
        length), shape (1, n): e.g. on selective copy one sees whether CoPE counts the non-blank tokens."""
        c = self.config
        n = c.train_len if (D.IN_DISTRIBUTION, c.train_len) in self.eval_sets else min(self.lengths)
        return self.eval_sets[D.IN_DISTRIBUTION, n][0][:1]

    def describe(self) -> dict[str, Any]:
        return {**self.task.describe(), "eval_sequences_per_length": self.config.eval_sequences,
                "splits": self.task.describe_splits()}

    def train_batches(self) -> Iterator[tuple[dict[str, torch.Tensor], int]]:
        c = self.config
        rng = random.Random(subseed(self.seed, "train"))
        for _ in range(c.steps):
            x, y = D.task_batch(self.task, rng, c.batch, c.train_len)
            yield {"input_ids": x, "labels": y}, x.numel()

    @torch.no_grad()
    def evaluate(self, model: nn.Module, length: int, device: torch.device,
                 split: str = D.IN_DISTRIBUTION) -> dict[str, Any]:
        """``accuracy`` (answer tokens), ``sequence_accuracy`` (sequences whose every answer is the argmax: for
        passkey the retrieved keys, since teacher forcing then equals greedy decoding), ``loss``, ``answers``
        and ``sequence_length`` (the split's true length; ``length`` is the nominal one). The metric is the
        accuracy, for passkey the sequence accuracy (retrieval, as in Mohtashami and Jaggi, 2023)."""
        model.eval()
        x_all, y_all = self.eval_sets[split, length]
        per_batch = max(1, 8192 // x_all.shape[1])
        correct = count = seq_ok = 0
        loss_sum = 0.0
        for i in range(0, x_all.shape[0], per_batch):
            x, y = x_all[i : i + per_batch].to(device), y_all[i : i + per_batch].to(device)
            logits = model(input_ids=x).logits[:, :-1].float()
            target = y[:, 1:]
            mask = target != -100
            pred = logits.argmax(-1)
            right = (pred == target) & mask
            correct += right.sum().item()
            count += mask.sum().item()
            seq_ok += (right.sum(1) == mask.sum(1)).sum().item()
            loss_sum += nn.functional.cross_entropy(logits[mask], target[mask], reduction="sum").item()
        acc = correct / count
        return {"accuracy": acc, "loss": loss_sum / count, "answers": count,
                "sequence_accuracy": seq_ok / x_all.shape[0], "sequence_length": int(x_all.shape[1]),
                "metric": seq_ok / x_all.shape[0] if self.config.task == "passkey" else acc}


class DigitsSource(DataSource):
    """scikit-learn's 8x8 digits (`data.load_digits_images`) for the ViT study: training images upscaled
    to ``train_len`` pixels a side, test images to each evaluation side."""

    vocab_size = 0

    def __init__(self, config: StudyConfig, lengths: list[int], seed: int | None = None) -> None:
        super().__init__(config, lengths, seed)
        self.digits = D.load_digits_images()

    def describe(self) -> dict[str, Any]:
        return {**self.digits.describe(), "patch_size": VIT_PATCH}

    def train_batches(self) -> Iterator[tuple[dict[str, torch.Tensor], int]]:
        c = self.config
        gen = torch.Generator().manual_seed(subseed(self.seed, "train"))
        x_all, y_all = self.digits.images("train", c.train_len)
        for _ in range(c.steps):
            idx = torch.randint(0, y_all.numel(), (c.batch,), generator=gen)
            yield {"pixel_values": x_all[idx], "labels": y_all[idx]}, idx.numel()

    @torch.no_grad()
    def evaluate(self, model: nn.Module, length: int, device: torch.device,
                 split: str = D.IN_DISTRIBUTION) -> dict[str, Any]:
        """``accuracy`` (the metric), ``loss``, ``images`` and ``patches`` on the test images of side
        ``length`` pixels (the position table interpolated: ``interpolate_pos_encoding=True``)."""
        if split != D.IN_DISTRIBUTION:
            raise ValueError(f"the digits study has no split {split!r}")
        model.eval()
        x_all, y_all = self.digits.images("test", length)
        correct = 0
        loss_sum = 0.0
        for i in range(0, y_all.numel(), 128):
            x, y = x_all[i : i + 128].to(device), y_all[i : i + 128].to(device)
            logits = model(pixel_values=x, interpolate_pos_encoding=True).logits.float()
            correct += (logits.argmax(-1) == y).sum().item()
            loss_sum += nn.functional.cross_entropy(logits, y, reduction="sum").item()
        n = y_all.numel()
        grid = length // VIT_PATCH
        return {"accuracy": correct / n, "loss": loss_sum / n, "images": n, "patches": grid * grid,
                "metric": correct / n}


def make_source(config: StudyConfig, lengths: list[int], seed: int | None = None) -> DataSource:
    """The data source of ``config.task`` (a resolved config) for ``seed`` (default ``config.seed``)."""
    if config.task == "text":
        return TextSource(config, lengths, seed)
    if config.task == "digits":
        return DigitsSource(config, lengths, seed)
    if config.task in D.TASKS:
        return TaskSource(config, lengths, seed)
    raise ValueError(f"unknown study task {config.task!r}; tasks: text, digits, {', '.join(D.TASKS)}")
