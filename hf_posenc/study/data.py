"""Data for ``hf-posenc study``: a byte corpus, the CoPE paper's synthetic tasks, and an image set.

Everything here is deterministic: the corpus is read from sorted paths with a fixed train/validation
selection, and every random draw comes from a generator seeded by the caller.

* `load_corpus` -- real text that needs no download: the Python standard library's own source
  files (or a user's file or folder), read as bytes (vocabulary 256), split into train and validation by
  file.
* `Passkey` -- passkey retrieval (Mohtashami and Jaggi, 2023), at token level.
* `FlipFlop`, `SelectiveCopy`, `Counting` -- the three synthetic tasks of
  "Contextual Position Encoding: Learning to Count What's Important" (Golovneva et al., 2024,
  https://arxiv.org/abs/2405.18719). Each docstring states the exact generator. The generators follow the
  papers' task descriptions; they are this project's own code, not the papers' data files.
* `load_digits_images` -- scikit-learn's bundled 8x8 digits (ships inside the PyPI package),
  upscaled bilinearly to any side, for the ViT study.
"""

from __future__ import annotations

import hashlib
import math
import os
import random
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch

__all__ = [
    "IN_DISTRIBUTION",
    "TASKS",
    "Corpus",
    "Counting",
    "Digits",
    "FlipFlop",
    "Passkey",
    "SelectiveCopy",
    "Task",
    "eval_windows",
    "get_task",
    "load_corpus",
    "load_digits_images",
    "stdlib_files",
    "task_batch",
]

#: Every ``VALIDATION_EVERY``-th file (in sorted order, starting with the first) goes to validation.
VALIDATION_EVERY = 10
#: A single text file (or a folder with one file) is split by bytes: this final fraction is validation.
VALIDATION_FRACTION = 0.1
#: Between two files of a split.
FILE_SEPARATOR = b"\n\n"


# -- text corpus ----------------------------------------------------------------------------------------


@dataclass
class Corpus:
    """A byte corpus split into train and validation.

    Attributes:
        train, val: 1-D int64 tensors of byte values (0..255).
        source: ``"stdlib"`` or the user's path.
        train_files, val_files: the files of each split, relative to the source root (sorted).
        split: how the split was made, in words.
    """

    train: torch.Tensor
    val: torch.Tensor
    source: str
    train_files: list[str]
    val_files: list[str]
    split: str

    def describe(self) -> dict:
        """JSON-ready description: source, files, sizes and SHA-256 of each split (for reproducibility)."""

        def digest(t: torch.Tensor) -> str:
            return hashlib.sha256(t.to(torch.uint8).numpy().tobytes()).hexdigest()

        return {
            "source": self.source,
            "split": self.split,
            "train_files": len(self.train_files),
            "val_files": len(self.val_files),
            "train_bytes": int(self.train.numel()),
            "val_bytes": int(self.val.numel()),
            "train_sha256": digest(self.train),
            "val_sha256": digest(self.val),
            "val_file_names": list(self.val_files),
        }


def stdlib_files() -> tuple[Path, list[str]]:
    """The Python standard library directory and its top-level ``*.py`` files, sorted by name.

    The corpus therefore depends on the Python version (its stdlib); ``results.json`` records the
    version and a SHA-256 of each split.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():  # pragma: no cover - unusual Python builds
        root = Path(os.__file__).parent
    names = sorted(p.name for p in root.glob("*.py") if p.is_file())
    if not names:  # pragma: no cover
        raise RuntimeError(f"no *.py files found in the standard library directory {root}; pass --data PATH")
    return root, names


def _is_binary(path: Path) -> bool:
    with open(path, "rb") as f:
        return b"\0" in f.read(8192)


def _folder_files(root: Path) -> list[str]:
    """Regular files under ``root`` (recursive, sorted relative POSIX paths), skipping hidden entries and
    binary files (a NUL byte in the first 8 KiB)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in filenames:
            if name.startswith("."):
                continue
            p = Path(dirpath) / name
            if p.is_file() and not p.is_symlink() and not _is_binary(p):
                out.append(p.relative_to(root).as_posix())
    return sorted(out)


def _to_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long() if data else torch.zeros(0, dtype=torch.long)


def _split_bytes(data: bytes) -> tuple[bytes, bytes]:
    """Last ``VALIDATION_FRACTION`` of the bytes to validation, cut after a newline when there is one."""
    cut = int(len(data) * (1 - VALIDATION_FRACTION))
    nl = data.rfind(b"\n", 0, cut)
    if nl > cut // 2:
        cut = nl + 1
    return data[:cut], data[cut:]


def load_corpus(path: str | os.PathLike | None = None) -> Corpus:
    """Read a byte corpus and split it into train and validation.

    Args:
        path: ``None`` for the default corpus: the standard library's top-level ``*.py`` files (sorted by
            name). Else a text file or a folder (all non-hidden, non-binary files under it, recursively,
            sorted by relative path).

    With two or more files, every ``VALIDATION_EVERY``-th file (indices 0, 10, 20, ... of the sorted list)
    is validation and the rest is train; the files of a split are concatenated in order, separated by
    ``FILE_SEPARATOR``. A single file is split by bytes: the last ``VALIDATION_FRACTION`` (cut after a
    newline) is validation.

    Returns:
        a `Corpus` (train and val as 1-D int64 tensors of bytes).
    """
    if path is None:
        root, files = stdlib_files()
        source = "stdlib"
    else:
        p = Path(path)
        if p.is_file():
            root, files, source = p.parent, [p.name], str(p)
        elif p.is_dir():
            root, files, source = p, _folder_files(p), str(p)
            if not files:
                raise ValueError(f"--data {path}: the folder holds no readable text files")
        else:
            raise ValueError(f"--data {path}: no such file or folder")
    if len(files) >= 2:
        val_files = files[::VALIDATION_EVERY]
        train_files = [f for i, f in enumerate(files) if i % VALIDATION_EVERY]
        train = FILE_SEPARATOR.join((root / f).read_bytes() for f in train_files)
        val = FILE_SEPARATOR.join((root / f).read_bytes() for f in val_files)
        split = f"by file: every {VALIDATION_EVERY}th file of the sorted list (from the first) is validation"
    else:
        train_files = val_files = list(files)
        train, val = _split_bytes((root / files[0]).read_bytes())
        split = f"one file: the last {VALIDATION_FRACTION:.0%} of its bytes (cut after a newline) is validation"
    return Corpus(_to_tensor(train), _to_tensor(val), source, train_files, val_files, split)


def eval_windows(data: torch.Tensor, lengths: list[int], tokens: int) -> dict[int, torch.Tensor]:
    """The same validation bytes cut into windows of every evaluation length.

    Chunks of ``C`` bytes, ``C`` the least common multiple of the lengths (the longest length when each
    divides it, as with the default 1x, 2x, 4x, 8x), are taken at evenly spaced, non-overlapping offsets of
    ``data``: ``n = max(1, tokens // C)`` of them. Each chunk is cut into consecutive windows of each length,
    so every length scores exactly the same bytes (each predicted from the context inside its own window).

    Returns:
        ``{length: (n * C // length, length) int64 tensor}``.
    """
    chunk = math.lcm(*lengths)
    if chunk > 16 * max(lengths):
        raise ValueError(
            f"evaluation lengths {lengths} have no small common multiple (least {chunk}); pick factors whose "
            "lengths divide the longest one, such as 1 2 4 8"
        )
    if data.numel() < chunk:
        raise ValueError(
            f"the validation split has {data.numel()} bytes, fewer than the {chunk} needed to evaluate at lengths "
            f"{lengths}; use more data or a shorter --train-len"
        )
    n = max(1, min(tokens // chunk, data.numel() // chunk))
    stride = (data.numel() - chunk) // n if n > 1 else 0
    chunks = torch.stack([data[i * stride : i * stride + chunk] for i in range(n)])
    return {length: chunks.reshape(-1, length).contiguous() for length in lengths}


# -- synthetic tasks (CoPE paper) ------------------------------------------------------------------------

#: The name of every task's training distribution among its evaluation splits.
IN_DISTRIBUTION = "in-distribution"

#: What each split means (recorded in ``results.json`` beside its parameters).
SPLIT_MEANINGS: dict[tuple[str, str], str] = {
    ("flip-flop", IN_DISTRIBUTION): "FFL(0.8): p(ignore) 0.8, p(write) = p(read) = 0.1, as in training",
    ("flip-flop", "sparse"): "FFL(0.98), Liu et al.'s sparse split: p(ignore) 0.98, p(write) = p(read) = 0.01; "
    "reads sit far from their writes",
    ("flip-flop", "dense"): "FFL(0.1), Liu et al.'s dense split: p(ignore) 0.1, p(write) = p(read) = 0.45; "
    "many reads and writes close together",
    ("selective-copy", IN_DISTRIBUTION): "the training blank density",
    ("selective-copy", "dense"): "the CoPE paper's dense split: half the blanks of training, same symbols to copy "
    "(the paper: 64 instead of 128 blanks for 128 symbols)",
    ("selective-copy", "sparse"): "the CoPE paper's sparse split: twice the blanks of training, same symbols "
    "(the paper: 256 instead of 128 blanks for 128 symbols)",
    ("counting", IN_DISTRIBUTION): "episodes as in training",
    ("counting", "ood"): "out of distribution: the same episodes and counts, each stretched to 4x its no-ops, so "
    "the increments to count lie further apart and further from the query",
    ("passkey", IN_DISTRIBUTION): "the key at a uniform random depth, as in training",
    ("passkey", "depth"): "the key at this fixed depth: 0 = at the start of the filler, 1 = right before the question",
}


class Task:
    """A synthetic sequence task: a token vocabulary and a seeded generator of (tokens, answer positions).

    ``generate(rng, length)`` returns a list of ``length`` token ids and the sorted positions whose tokens
    are answers: the model is trained (cross-entropy) and scored (argmax accuracy, teacher-forced) only on
    those tokens, each predicted from the tokens before it.
    """

    name: ClassVar[str] = ""
    tokens: tuple[str, ...] = ()

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def token_id(self, name: str) -> int:
        return self.tokens.index(name)

    def min_length(self) -> int:
        raise NotImplementedError

    def check_length(self, length: int) -> None:
        if length < self.min_length():
            raise ValueError(f"task {self.name!r} needs sequences of at least {self.min_length()} tokens, got {length}")

    def generate(self, rng: random.Random, length: int) -> tuple[list[int], list[int]]:
        raise NotImplementedError

    def sequence_length(self, length: int) -> int:
        """Tokens of a sequence that ``generate(rng, length)`` returns: ``length``, except for splits that
        stretch or shrink the sequence (selective copy's blank density, counting's OOD split)."""
        return length

    def splits(self) -> dict[str, Task]:
        """The evaluation splits: ``{name: task}``, ``"in-distribution"`` (this task) first. Each other split
        is this task with documented parameters changed (see the subclass docstrings)."""
        return {IN_DISTRIBUTION: self}

    def decode(self, ids: list[int]) -> str:
        """Token names joined by spaces (for docs and tests)."""
        return " ".join(self.tokens[i] for i in ids)

    def describe(self) -> dict:
        d = {k: v for k, v in vars(self).items() if not k.startswith("_") and k != "tokens"}
        return {"task": self.name, "vocab": list(self.tokens), **d}

    def describe_splits(self) -> dict[str, dict]:
        """``{split: its parameters and meaning}`` for ``results.json``."""
        out = {}
        for name, task in self.splits().items():
            d = {k: v for k, v in task.describe().items() if k not in ("task", "vocab")}
            out[name] = {**d, "meaning": SPLIT_MEANINGS.get((self.name, name.split(" ")[0]), "")}
        return out


@dataclass
class FlipFlop(Task):
    """Flip-flop language modelling (Liu et al., 2023, https://arxiv.org/abs/2306.00946; the CoPE paper, §5.1).

    Vocabulary: ``0 1 w r i`` (two bits and three instructions). A sequence of ``length`` tokens (even) is
    ``length / 2`` instruction-bit pairs ``o_1 b_1 o_2 b_2 ...``:

    * ``o_1 = w`` and ``o_last = r``; every other instruction is drawn i.i.d.: ``w`` with probability
      ``p_write``, ``r`` with probability ``p_read``, else ``i`` (ignore). Defaults 0.1 / 0.1 / 0.8, the
      paper's FFL(0.8).
    * after ``w`` or ``i`` the bit is uniform in {0, 1}; after ``r`` it is the bit of the most recent ``w``.

    Answers: the bit after every ``r`` (the only deterministic tokens). Longer evaluation sequences come
    from the same distribution, so the distance from a read back to its write has the same distribution at
    every length: only the absolute and relative positions seen are new.

    Splits (`splits`): ``sparse`` FFL(0.98) and ``dense`` FFL(0.1), Liu et al.'s out-of-distribution
    test sets ("Exposing Attention Glitches with Flip-Flop Language Modeling", NeurIPS 2023: FFL(p) writes and
    reads with probability (1 - p) / 2 each and ignores with probability p; trained on FFL(0.8), tested on the
    sparse tail FFL(0.98) and the dense FFL(0.1)).
    """

    name: ClassVar[str] = "flip-flop"
    tokens: ClassVar[tuple[str, ...]] = ("0", "1", "w", "r", "i")
    p_write: float = 0.1
    p_read: float = 0.1

    #: Liu et al.'s evaluation splits FFL(p_i) with p_w = p_r = (1 - p_i) / 2: ``{name: p_ignore}``.
    SPLIT_P_IGNORE: ClassVar[dict[str, float]] = {"sparse": 0.98, "dense": 0.1}

    @property
    def p_ignore(self) -> float:
        return 1.0 - self.p_write - self.p_read

    def splits(self) -> dict[str, Task]:
        """In distribution, and Liu et al.'s (2023, §3.1 and §4) sparse and dense splits, which the CoPE paper
        (§5.1) evaluates too: FFL(0.98) (``sparse``: p_w = p_r = 0.01) and FFL(0.1) (``dense``: p_w = p_r =
        0.45), at the same lengths."""
        out: dict[str, Task] = {IN_DISTRIBUTION: self}
        for name, p in self.SPLIT_P_IGNORE.items():
            q = round((1.0 - p) / 2, 10)
            out[name] = FlipFlop(p_write=q, p_read=q)
        return out

    def describe(self) -> dict:
        return {**super().describe(), "p_ignore": round(self.p_ignore, 10)}

    def min_length(self) -> int:
        return 4

    def check_length(self, length: int) -> None:
        super().check_length(length)
        if length % 2:
            raise ValueError(f"flip-flop sequences are instruction-bit pairs: the length must be even, got {length}")

    def generate(self, rng: random.Random, length: int) -> tuple[list[int], list[int]]:
        self.check_length(length)
        w, r, i = self.token_id("w"), self.token_id("r"), self.token_id("i")
        n = length // 2
        ids: list[int] = []
        answers: list[int] = []
        memory = 0
        for k in range(n):
            if k == 0:
                op = w
            elif k == n - 1:
                op = r
            else:
                u = rng.random()
                op = w if u < self.p_write else r if u < self.p_write + self.p_read else i
            if op == r:
                bit = memory
                answers.append(2 * k + 1)
            else:
                bit = rng.randrange(2)
                if op == w:
                    memory = bit
            ids += [op, bit]  # bit tokens are ids 0 and 1
        return ids, answers


@dataclass
class SelectiveCopy(Task):
    """Selective copy (Gu and Dao, 2023, https://arxiv.org/abs/2312.00752; the CoPE paper, §5.2).

    Vocabulary: ``num_symbols`` data symbols ``a b c ...``, the blank ``_`` and the separator ``|``.
    A sequence of ``length`` tokens is a context of ``N = length - 1 - num_copy`` cells, then ``|``, then
    the ``num_copy`` data symbols of the context in their order:

    * ``num_copy`` distinct context cells are drawn uniformly (sorted); each holds a symbol drawn uniformly
      from the ``num_symbols`` data symbols; every other cell is blank.

    Answers: the ``num_copy`` tokens after ``|`` (the j-th answer is predicted from the context, ``|`` and
    the j - 1 answers before it). Longer evaluation sequences keep ``num_copy`` and add blanks: the
    symbols are sparser and further from the answers.

    ``blank_scale`` (default 1) scales the blanks: a sequence of nominal length ``L`` has
    ``B = L - 1 - 2 * num_copy`` blanks in distribution and ``round(blank_scale * B)`` here, so its true length
    is `sequence_length`. Splits (`splits`), the CoPE paper's (§5.2: trained on 128 blanks
    among 128 symbols, tested on a dense split of 64 blanks and a sparse split of 256): ``dense``
    (``blank_scale`` 0.5) and ``sparse`` (``blank_scale`` 2), relative to the training blanks at every length.
    """

    name: ClassVar[str] = "selective-copy"
    num_symbols: int = 8
    num_copy: int = 8
    blank_scale: float = 1.0

    #: The CoPE paper's splits as multiples of the training blanks (64 / 128 and 256 / 128).
    SPLIT_BLANK_SCALE: ClassVar[dict[str, float]] = {"dense": 0.5, "sparse": 2.0}

    def splits(self) -> dict[str, Task]:
        out: dict[str, Task] = {IN_DISTRIBUTION: self}
        for name, scale in self.SPLIT_BLANK_SCALE.items():
            out[name] = SelectiveCopy(num_symbols=self.num_symbols, num_copy=self.num_copy, blank_scale=scale)
        return out

    def blanks(self, length: int) -> int:
        """Blanks in a sequence of nominal length ``length``."""
        return round(self.blank_scale * (length - 1 - 2 * self.num_copy))

    def sequence_length(self, length: int) -> int:
        return 2 * self.num_copy + 1 + self.blanks(length)

    def __post_init__(self) -> None:
        if not 1 <= self.num_symbols <= 26:
            raise ValueError(f"num_symbols must be in 1..26, got {self.num_symbols}")
        if self.num_copy < 1:
            raise ValueError(f"num_copy must be >= 1, got {self.num_copy}")
        if not self.blank_scale > 0:
            raise ValueError(f"blank_scale must be > 0, got {self.blank_scale}")
        self.tokens = tuple("abcdefghijklmnopqrstuvwxyz"[: self.num_symbols]) + ("_", "|")

    def min_length(self) -> int:
        return 2 * self.num_copy + 1

    def generate(self, rng: random.Random, length: int) -> tuple[list[int], list[int]]:
        self.check_length(length)
        n_ctx = self.num_copy + self.blanks(length)
        length = self.sequence_length(length)
        cells = sorted(rng.sample(range(n_ctx), self.num_copy))
        symbols = [rng.randrange(self.num_symbols) for _ in range(self.num_copy)]
        ctx = [self.token_id("_")] * n_ctx
        for c, s in zip(cells, symbols):
            ctx[c] = s
        ids = ctx + [self.token_id("|")] + symbols
        return ids, list(range(n_ctx + 1, length))


@dataclass
class Counting(Task):
    """Counting (the CoPE paper, §5.3): how many times was a variable incremented since it was last reset?

    Vocabulary: the counts ``0 .. max_count``, the no-op ``.``, and per variable ``v`` (named ``a``, ``b``,
    ...) the operations ``v=`` (reset v to 0), ``v+`` (increment v) and ``v?`` (query v; the next token is
    v's value).

    A sequence of ``length`` tokens is ``episodes`` episodes of ``length / episodes`` tokens (the last one
    takes the remainder). An episode is ``v= body v? n``:

    * the queried variable ``v`` is uniform over the ``num_vars`` variables;
    * the body holds ``n`` tokens ``v+`` with ``n`` uniform in ``0 .. max_count``, and (when there are
      other variables) ``d`` distractor increments ``u+``, ``d`` uniform in ``0 .. max_count``, each ``u``
      uniform over the other variables; the rest of the body is ``.``; the order is a uniform shuffle.

    Answers: the count token ``n`` after each ``v?``. Longer evaluation sequences keep ``episodes`` and the
    count range, so the bodies are longer and sparser: the increments to count lie further from the query.

    ``stretch`` (default 1) multiplies every episode's length (a sequence of nominal length ``L`` has
    ``stretch * L`` tokens, `sequence_length`): the same episodes and counts among ``stretch`` times the
    no-ops. Split ``ood`` (`splits`, ``stretch`` 4): the CoPE paper's out-of-distribution test of
    counting (§5.3) as this project reads it, the same counts with the increments spread over a longer
    context than in training.
    """

    name: ClassVar[str] = "counting"
    num_vars: int = 1
    max_count: int = 8
    episodes: int = 4
    stretch: int = 1

    #: ``{split: stretch}``.
    SPLIT_STRETCH: ClassVar[dict[str, int]] = {"ood": 4}

    def splits(self) -> dict[str, Task]:
        out: dict[str, Task] = {IN_DISTRIBUTION: self}
        for name, k in self.SPLIT_STRETCH.items():
            out[name] = Counting(num_vars=self.num_vars, max_count=self.max_count, episodes=self.episodes, stretch=k)
        return out

    def sequence_length(self, length: int) -> int:
        return self.stretch * length

    def __post_init__(self) -> None:
        if not 1 <= self.num_vars <= 26:
            raise ValueError(f"num_vars must be in 1..26, got {self.num_vars}")
        if self.max_count < 1 or self.episodes < 1 or self.stretch < 1:
            raise ValueError("max_count, episodes and stretch must be >= 1")
        names = "abcdefghijklmnopqrstuvwxyz"[: self.num_vars]
        self.tokens = tuple(str(c) for c in range(self.max_count + 1)) + (".",) + tuple(
            f"{v}{op}" for v in names for op in ("=", "+", "?")
        )

    def min_length(self) -> int:
        body = self.max_count * (2 if self.num_vars > 1 else 1)
        return self.episodes * (body + 3)

    def generate(self, rng: random.Random, length: int) -> tuple[list[int], list[int]]:
        self.check_length(length)
        length = self.sequence_length(length)
        names = "abcdefghijklmnopqrstuvwxyz"[: self.num_vars]
        ids: list[int] = []
        answers: list[int] = []
        base = length // self.episodes
        for e in range(self.episodes):
            size = base if e < self.episodes - 1 else length - base * (self.episodes - 1)
            v = rng.randrange(self.num_vars)
            n = rng.randint(0, self.max_count)
            body = [self.token_id(f"{names[v]}+")] * n
            if self.num_vars > 1:
                others = [u for u in range(self.num_vars) if u != v]
                d = rng.randint(0, self.max_count)
                body += [self.token_id(f"{names[rng.choice(others)]}+") for _ in range(d)]
            body += [self.token_id(".")] * (size - 3 - len(body))
            rng.shuffle(body)
            ids += [self.token_id(f"{names[v]}=")] + body + [self.token_id(f"{names[v]}?")]
            answers.append(len(ids))
            ids.append(self.token_id(str(n)))
        return ids, answers


@dataclass
class Passkey(Task):
    """Passkey retrieval (Mohtashami and Jaggi, 2023, "Landmark Attention", https://arxiv.org/abs/2305.16300,
    §4.2), at token level.

    Vocabulary: the digits ``0``-``9``, four filler tokens ``a b c d``, the key marker ``K`` ("the pass key
    is") and the question ``?`` ("what is the pass key?"). A sequence of ``length`` tokens is filler with the
    key block ``K d_1 .. d_n`` inserted, then ``? d_1 .. d_n`` at the end:

    * the passkey is ``n = digits`` (default 5) digits, each uniform in 0-9;
    * the filler is ``F = length - 2 * (digits + 1)`` tokens of the repeating pattern ``a b c d a b ...`` (the
      paper repeats a fixed filler sentence);
    * the key block goes after filler token ``j``: ``j = round(depth * F)`` for a fixed ``depth`` in [0, 1],
      else (``depth=None``, training and the in-distribution split) ``j`` uniform in ``0 .. F``. Depth 0 puts
      the key at the start, depth 1 right before the question.

    Answers: the ``n`` digits after ``?``. A sequence counts as retrieved when all of them are the argmax
    (teacher-forced, which is the same as greedy decoding). Splits (`splits`): in distribution, and one
    per depth in ``DEPTHS``: accuracy per length and per depth, the paper's depth x length picture.
    """

    name: ClassVar[str] = "passkey"
    digits: int = 5
    depth: float | None = None

    #: The fixed depths of the evaluation splits.
    DEPTHS: ClassVar[tuple[float, ...]] = (0.0, 0.25, 0.5, 0.75, 1.0)
    FILLER: ClassVar[tuple[str, ...]] = ("a", "b", "c", "d")

    def __post_init__(self) -> None:
        if self.digits < 1:
            raise ValueError(f"digits must be >= 1, got {self.digits}")
        if self.depth is not None and not 0.0 <= self.depth <= 1.0:
            raise ValueError(f"depth must be in [0, 1] or None, got {self.depth}")
        self.tokens = tuple("0123456789") + self.FILLER + ("K", "?")

    def splits(self) -> dict[str, Task]:
        out: dict[str, Task] = {IN_DISTRIBUTION: self}
        for d in self.DEPTHS:
            out[f"depth {d:.2f}"] = Passkey(digits=self.digits, depth=d)
        return out

    def min_length(self) -> int:
        return 2 * (self.digits + 1) + 1

    def key_offset(self, rng: random.Random, filler: int) -> int:
        """Filler tokens before the key block."""
        if self.depth is None:
            return rng.randint(0, filler)
        return round(self.depth * filler)

    def generate(self, rng: random.Random, length: int) -> tuple[list[int], list[int]]:
        self.check_length(length)
        n = self.digits
        filler = length - 2 * (n + 1)
        key = [rng.randrange(10) for _ in range(n)]  # digit tokens are ids 0..9
        j = self.key_offset(rng, filler)
        pattern = [self.token_id(t) for t in self.FILLER]
        fill = [pattern[k % len(pattern)] for k in range(filler)]
        ids = fill[:j] + [self.token_id("K")] + key + fill[j:] + [self.token_id("?")] + key
        return ids, list(range(length - n, length))


TASKS: dict[str, type[Task]] = {
    "flip-flop": FlipFlop, "selective-copy": SelectiveCopy, "counting": Counting, "passkey": Passkey,
}


def get_task(name: str) -> Task:
    """A task instance with its default parameters; ``ValueError`` naming the tasks otherwise."""
    try:
        return TASKS[name]()
    except KeyError:
        raise ValueError(f"unknown task {name!r}; synthetic tasks: {', '.join(TASKS)}") from None


def task_batch(task: Task, rng: random.Random, batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` sequences from ``task``: (input_ids, labels), each (batch, length) int64.

    ``labels`` holds the token at answer positions and -100 elsewhere (transformers' causal LM loss shifts
    them: the logits at position t - 1 predict the answer at t). ``length`` is the nominal length: the
    tensors have ``task.sequence_length(length)`` columns.
    """
    n = task.sequence_length(length)
    ids = torch.empty(batch, n, dtype=torch.long)
    labels = torch.full((batch, n), -100, dtype=torch.long)
    for b in range(batch):
        seq, answers = task.generate(rng, length)
        ids[b] = torch.tensor(seq)
        labels[b, answers] = ids[b, answers]
    return ids, labels


# -- images (ViT) ----------------------------------------------------------------------------------------


@dataclass
class Digits:
    """scikit-learn's digits: 1797 grey 8x8 images of the digits 0-9 (values 0..16), shipped in the package.

    Split by index: every 5th image (indices 0, 5, 10, ...) is the test set (360 images), the rest train
    (1437). ``images(split, side)`` returns them upscaled bilinearly to ``side`` x ``side`` and normalised
    with the training set's mean and standard deviation.
    """

    train_x: torch.Tensor  # (N, 8, 8) float32, 0..16
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    _cache: dict = field(default_factory=dict, repr=False)

    def images(self, split: str, side: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(N, 1, side, side) float32 normalised images and (N,) int64 labels."""
        key = (split, side)
        if key not in self._cache:
            x, y = (self.train_x, self.train_y) if split == "train" else (self.test_x, self.test_y)
            mean, std = self.train_x.mean(), self.train_x.std()
            up = torch.nn.functional.interpolate(x[:, None], size=(side, side), mode="bilinear", align_corners=False)
            self._cache[key] = (((up - mean) / std).contiguous(), y)
        return self._cache[key]

    def describe(self) -> dict:
        return {
            "source": "sklearn.datasets.load_digits (8x8, 10 classes), upscaled bilinearly",
            "split": "every 5th image (from index 0) is the test set",
            "train_images": int(self.train_y.numel()),
            "test_images": int(self.test_y.numel()),
        }


def load_digits_images() -> Digits:
    """Load `Digits` from scikit-learn (``pip install scikit-learn``, in the ``study`` extra)."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the ViT study uses scikit-learn's bundled digits: pip install scikit-learn "
            '(or pip install -e ".[study]")'
        ) from e
    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32)
    y = torch.tensor(d.target, dtype=torch.long)
    test = torch.arange(len(y)) % 5 == 0
    return Digits(x[~test], y[~test], x[test], y[test])
