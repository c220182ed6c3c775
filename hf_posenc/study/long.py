"""The evaluation past the pretrained context of a conversion study (``hf-posenc study --from CKPT --long-eval``).

What users convert a pretrained model for is context beyond the length P it was trained at (the checkpoint
config's ``max_position_embeddings``). With ``--long-eval`` every entry of a conversion study (and the unpatched
model, once) is also measured there, after its fine-tune:

The evaluation reaches F x P tokens, F the *long factor* (``--long-factor``, a power of two, default 2):

* **Perplexity per position band** on real text: one window of FP held-out tokens (the end of the study's text,
  which the fine-tune never sees), every token predicted from all the tokens before it in the window; the mean
  loss over the targets at positions [0, P/2), [P/2, P) (inside the context), then [P, 2P), [2P, 4P), ... up to
  FP (beyond it). The per-token losses are kept too, as means over bins of ``nll_bin(P)`` target positions
  (P/32, at most 512 tokens; ``nll_bins`` in the result), for the picture of perplexity by position.
* **Passkey retrieval** in the checkpoint's own tokens (Mohtashami and Jaggi 2023, as the YaRN and LongLoRA
  papers run it): a five-digit key in the sentence "The pass key is 12345. Remember it. 12345 is the pass key." at
  position ``f * P`` (``passkey_positions``, default 0.25) of a haystack of filler sentences ("The grass is green.
  The sky is blue. ..."), and at each length L of ``passkey_lengths`` (fractions of P; default
  `default_passkey_lengths`: P/2, P, 3P/2, 2P, then 3P, 4P, 6P, 8P, ... up to FP) the question "What is the pass
  key? The pass key is" with the key as its answer, ending at token L. Retrieved when the argmax at every answer
  token is the key's token (teacher-forced, the same as greedy decoding); the answer's log-probability is recorded
  too. Filler, not the held-out text, is the haystack: measured on
  SmolLM2-135M (unpatched, 2 threads), a key 3.5k tokens before the question in the Python documentation was not
  retrieved (answer log-probability -8.9) where the same key 3.5k tokens back in filler (without the opening
  sentence) was (-1.0), both inside its 8k context.

Each is one chunked prefill of FP tokens with a ``DynamicCache`` (``chunk`` tokens at a time, P/8 up to 1024):
the memory is O(L) for the cache plus O(chunk * L) for one chunk's attention, whichever engine runs (the unpatched
model's SDPA gets a (chunk, L) mask; hf_posenc's attention runs its tile engine with the query offset), and the
logits are (chunk, vocabulary), never (L, vocabulary). At each passkey length the question and its answer run on
top of the cache of the first L - q tokens, are scored, and are cropped off again (``DynamicCache.crop``), so one
prefill answers every length, each answer exactly that of a standalone prompt of L tokens. An entry with YaRN at
evaluation (``rope:eval_scaling=yarn``) runs the whole long evaluation with factor F (FP / P; "YaRN x2" by
default), or with its own ``eval_factor`` (``rope:eval_scaling=yarn,eval_factor=4``: "YaRN x4"; see
`hf_posenc.study.recipes`).

Cost: (1 + number of key positions) prefills of FP tokens per entry (two by default). ``estimate_seconds`` times
the first chunks of the band window on the unpatched model and extrapolates (a chunk's time grows linearly with
the keys it sees); the study prints it before the first long evaluation. Each entry's result records its wall and
CPU time and its peak memory (`PeakMemory`).
"""

from __future__ import annotations

import math
import random
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = [
    "DEFAULT_LONG_FACTOR", "DEFAULT_PASSKEY_LENGTHS", "DEFAULT_PASSKEY_POSITIONS", "LongEvalData", "PeakMemory",
    "band_edges", "check_long_factor", "context_length", "default_passkey_lengths", "estimate_seconds",
    "evaluate_long", "make_long_eval", "nll_bin",
]

#: the evaluation reaches DEFAULT_LONG_FACTOR x P tokens unless told otherwise (``--long-factor``).
DEFAULT_LONG_FACTOR = 2
#: passkey lengths, as fractions of the pretrained context P, at the default long factor (2).
DEFAULT_PASSKEY_LENGTHS: tuple[float, ...] = (0.5, 1.0, 1.5, 2.0)
#: the key's position in its haystack, as fractions of P (one haystack of FP tokens each).
DEFAULT_PASSKEY_POSITIONS: tuple[float, ...] = (0.25,)
#: the longest chunk of the prefill (tokens).
MAX_CHUNK = 1024

_INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. Find it and memorize "
          "it. I will quiz you about it later.\n")
_FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
_KEY = "\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
_QUESTION = "\nWhat is the pass key? The pass key is"


def check_long_factor(factor: Any) -> int:
    """``factor`` if it is a power of two >= 2 (an int), else ``ValueError`` (``TypeError`` for a non-integer)."""
    if isinstance(factor, bool) or not isinstance(factor, int):
        raise TypeError(f"--long-factor must be an integer (a power of two >= 2), got {factor!r}")
    if factor < 2 or factor & (factor - 1):
        raise ValueError(f"--long-factor must be a power of two >= 2 (the evaluation reaches F x P tokens: 2, 4, 8, "
                         f"...), got {factor}")
    return factor


def default_passkey_lengths(factor: int = DEFAULT_LONG_FACTOR) -> tuple[float, ...]:
    """The default passkey lengths up to ``factor`` x P, as fractions of P: P/2 and P, then the middle and the end
    of each band past P (1.5, 2; 3, 4; 6, 8; ...). Factor 2 gives `DEFAULT_PASSKEY_LENGTHS`."""
    lengths, lo = [0.5, 1.0], 1
    while lo < check_long_factor(factor):
        lengths += [1.5 * lo, 2.0 * lo]
        lo *= 2
    return tuple(lengths)


def band_edges(context: int, factor: int = DEFAULT_LONG_FACTOR) -> list[tuple[int, int]]:
    """The position bands of the perplexity: [0, P/2), [P/2, P), then [P, 2P), [2P, 4P), ... up to ``factor`` x P."""
    bands, lo = [(0, context // 2), (context // 2, context)], 1
    while lo < check_long_factor(factor):
        bands.append((lo * context, 2 * lo * context))
        lo *= 2
    return bands


def nll_bin(context: int) -> int:
    """The bin of the per-token losses kept for the picture of perplexity by position: P/32 tokens (256 on an
    8k context), at least 1 and at most 512."""
    return max(1, min(512, context // 32))


def context_length(config: Any) -> int:
    """P: the checkpoint config's ``max_position_embeddings`` (GPT-2's ``n_positions``); ``ValueError`` without."""
    p = getattr(config, "max_position_embeddings", None)
    if not isinstance(p, int) or p < 8:
        raise ValueError(f"--long-eval needs the checkpoint's pretrained context (config.max_position_embeddings), "
                         f"got {p!r}")
    return p


@dataclass
class Haystack:
    """One passkey haystack: ``ids`` (FP,), filler with the key sentence at ``key_at``, the key, and per length L
    the question + answer ids (``question``) that follow the first ``L - len(question)`` tokens; ``answer`` is the
    number of answer tokens at the end of ``question``."""

    ids: torch.Tensor
    key: int
    key_at: int
    question: torch.Tensor
    answer: int
    lengths: list[int]


@dataclass
class LongEvalData:
    """What the long evaluation runs on (built once per study, the same for every entry)."""

    context: int  # P
    window: torch.Tensor  # (FP,) held-out tokens
    haystacks: list[Haystack]
    chunk: int
    bands: list[tuple[int, int]] = field(default_factory=list)
    factor: int = DEFAULT_LONG_FACTOR  # F
    bin: int = 1  # target positions per bin of the kept per-token losses

    def describe(self) -> dict[str, Any]:
        return {
            "context": self.context,
            "factor": self.factor,
            "window_tokens": int(self.window.numel()),
            "bands": [list(b) for b in self.bands],
            "nll_bin_tokens": self.bin,
            "chunk": self.chunk,
            "passkey": [{"key_at": h.key_at, "lengths": h.lengths, "key": h.key} for h in self.haystacks],
            "how": f"chunked prefills with a DynamicCache; perplexity per band of target positions over {self.factor}P "
            "held-out tokens, and per bin of nll_bin_tokens positions; passkey in filler, teacher-forced on the answer "
            "tokens, each question run on the cache and cropped off again (hf_posenc/study/long.py)",
        }

    def passes(self) -> int:
        """Prefills of FP tokens per entry: the band window and one per key position."""
        return 1 + len(self.haystacks)


def _ids(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def make_long_eval(tokenizer: Any, held_out: torch.Tensor, context: int, seed: int,
                   lengths: tuple[float, ...] | list[float] | None = None,
                   positions: tuple[float, ...] | list[float] = DEFAULT_PASSKEY_POSITIONS,
                   factor: int = DEFAULT_LONG_FACTOR) -> LongEvalData:
    """The band window (the last FP tokens of ``held_out``, F = ``factor``) and one passkey haystack of FP tokens
    per key position; ``lengths`` None: `default_passkey_lengths` of ``factor``.

    Raises:
        ValueError: F not a power of two >= 2, fewer than FP held-out tokens, or a length or position outside
            (0, F] / [0, F).
    """
    check_long_factor(factor)
    total = factor * context
    if lengths is None:
        lengths = default_passkey_lengths(factor)
    if held_out.numel() < total:
        raise ValueError(f"--long-eval needs {factor}P = {total} held-out tokens of text (P = {context}, the "
                         f"checkpoint's max_position_embeddings); the text gives {held_out.numel()}: give a longer "
                         "--data")
    if not lengths or any(not 0 < f <= factor for f in lengths):
        raise ValueError(f"passkey lengths are fractions of P in (0, {factor}], got {list(lengths)}")
    if not positions or any(not 0 <= f < factor for f in positions):
        raise ValueError(f"passkey key positions are fractions of P in [0, {factor}), got {list(positions)}")
    chunk = max(1, min(MAX_CHUNK, context // 8))
    bands = band_edges(context, factor)
    rng = random.Random(seed)
    intro, filler, question = _ids(tokenizer, _INTRO), _ids(tokenizer, _FILLER), _ids(tokenizer, _QUESTION)
    haystacks = []
    for f in positions:
        key = rng.randint(10000, 99999)
        sentence, answer = _ids(tokenizer, _KEY.format(key=key)), _ids(tokenizer, f" {key}")
        q = len(question) + len(answer)
        key_at = max(len(intro), round(f * context))
        n_fill = total - len(intro) - len(sentence)
        fill = (filler * (n_fill // len(filler) + 1))[:n_fill]
        ids = intro + fill[: key_at - len(intro)] + sentence + fill[key_at - len(intro) :]
        # a length needs the whole key sentence before its question
        kept = sorted({round(x * context) for x in lengths if round(x * context) - q >= key_at + len(sentence)})
        if not kept:
            raise ValueError(f"passkey key position {f} P leaves no room for a question at lengths {list(lengths)} P")
        haystacks.append(Haystack(torch.tensor(ids[:total]), key, key_at, torch.tensor(question + answer),
                                  len(answer), kept))
    return LongEvalData(context, held_out[-total:].clone(), haystacks, chunk, bands, factor, nll_bin(context))


def _forward(model: nn.Module, ids: torch.Tensor, cache: Any, device: torch.device) -> torch.Tensor:
    """Logits (n, V) float32 of ``ids`` (n,) on top of ``cache`` (which grows by n)."""
    with warnings.catch_warnings():  # transformers >= 5.24 renames the argument; the old name works in every 5.x
        warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated", category=FutureWarning)
        out = model(input_ids=ids[None].to(device), past_key_values=cache, use_cache=True)
    return out.logits[0].float()


def _cache(model: nn.Module) -> Any:
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def _bounds(total: int, chunk: int, stops: list[int]) -> list[tuple[int, int]]:
    """Prefill segments of at most ``chunk`` tokens, cut at every position of ``stops`` too."""
    cuts = sorted({*range(0, total, chunk), *stops, total})
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


@torch.no_grad()
def _pass(model: nn.Module, ids: torch.Tensor, chunk: int, device: torch.device, tick: Any,
          nll: torch.Tensor | None = None, hay: Haystack | None = None) -> list[dict[str, Any]]:
    """One chunked prefill of ``ids``: into ``nll`` (when given) the loss of every target (``nll[t - 1]`` for the
    token at position t); with a haystack, its passkey results (the prefill then stops at the last question)."""
    cache = _cache(model)
    q = hay.question.numel() if hay is not None else 0
    stops = [n - q for n in hay.lengths] if hay is not None else []
    end = max(stops) if nll is None and stops else ids.numel()
    results = []
    for a, b in _bounds(end, chunk, stops):
        logits = _forward(model, ids[a:b], cache, device)
        if nll is not None:
            targets = ids[a + 1 : b + 1].to(logits.device)  # the last token of the window has no target
            nll[a : a + targets.numel()] = nn.functional.cross_entropy(
                logits[: targets.numel()], targets, reduction="none").double().cpu()
        del logits
        tick(b - a)
        if hay is not None and b in stops:
            logits = _forward(model, hay.question, cache, device)
            answer = hay.question[-hay.answer :].to(logits.device)
            scores = logits[-hay.answer - 1 : -1].log_softmax(-1)
            results.append({
                "length": b + q, "key": hay.key, "key_at": hay.key_at, "distance": b + q - hay.key_at,
                "retrieved": bool((scores.argmax(-1) == answer).all()),
                "answer_logprob": float(scores.gather(-1, answer[:, None]).sum()),
            })
            cache.crop(-q)  # remove the question and answer again (a negative count: every transformers 5.x)
    return results


def _nll_bins(nll: torch.Tensor, size: int) -> list[float | None]:
    """Mean loss per bin of ``size`` target positions: bin k holds the targets at positions [k size, (k + 1) size)
    (the target at position t is ``nll[t - 1]``; position 0 has none, so the first bin holds size - 1 of them, and
    None when that is none)."""
    by_position = torch.cat([nll.new_full((1,), float("nan")), nll])
    return [None if part.isnan().all() else round(float(part.nanmean()), 5) for part in by_position.split(size)]


def _status_bytes(field_name: str) -> int:
    """A memory figure of this process from ``/proc/self/status`` (``VmRSS``, ``VmHWM``), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1]) * 1024  # kB
    raise ValueError(f"/proc/self/status has no {field_name}")


class PeakMemory:
    """The peak memory of the code inside ``with PeakMemory(device) as peak:``. On CUDA: the peak of
    ``torch.cuda.max_memory_allocated`` (its counter reset at the start). Elsewhere: the process's peak resident
    set (Linux's ``VmHWM``, reset to the current resident set through ``/proc/self/clear_refs`` at the start), which
    counts the model's weights and everything else the process holds.

    `record` gives ``peak_memory_mib`` (the peak), ``peak_memory_growth_mib`` (the peak less the memory at the
    start: what the code added) and ``memory_measure`` (what was measured). Where neither can be read (not Linux,
    ``/proc/self/clear_refs`` not writable) both numbers are None and ``memory_measure`` says why."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.start: int | None = None
        self.peak: int | None = None
        self.how = ""

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start = torch.cuda.memory_allocated(self.device)
            self.how = "torch.cuda.max_memory_allocated, reset at the start"
            return self
        try:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
            self.start = _status_bytes("VmRSS")
            self.how = "the process's peak resident set (VmHWM, reset through /proc/self/clear_refs at the start)"
        except (OSError, ValueError) as e:
            self.how = f"not measured: the peak resident set cannot be read here ({type(e).__name__}: {e})"
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.start is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self.peak = _status_bytes("VmHWM")

    def record(self) -> dict[str, Any]:
        """``peak_memory_mib``, ``peak_memory_growth_mib`` and ``memory_measure`` (see the class docstring)."""
        def mib(n: int | None) -> float | None:
            return None if n is None else round(n / 2**20, 1)

        grown = None if self.peak is None or self.start is None else self.peak - self.start
        return {"peak_memory_mib": mib(self.peak), "peak_memory_growth_mib": mib(grown), "memory_measure": self.how}


def _bands(data: LongEvalData, nll: torch.Tensor) -> list[dict[str, Any]]:
    """Perplexity per band of target positions (the target at position t is ``nll[t - 1]``)."""
    out = []
    for lo, hi in data.bands:
        part = nll[max(lo, 1) - 1 : hi - 1]
        loss = float(part.mean())
        out.append({"band": [lo, hi], "tokens": int(part.numel()), "loss": loss,
                    "perplexity": math.exp(loss) if loss < 700 else None})
    return out


def evaluate_long(model: nn.Module, data: LongEvalData, device: torch.device, progress: bool = True,
                  label: str = "") -> dict[str, Any]:
    """The long evaluation of ``model`` (see the module docstring): ``bands`` (perplexity per band), ``nll_bins``
    (``tokens`` per bin and the mean ``loss`` of each bin of target positions, from position 0 to FP), ``passkey``
    (per key position and length), ``retrieved`` (the share of passkey questions answered), ``seconds``,
    ``cpu_seconds`` and the peak memory (`PeakMemory`); a progress bar over the tokens prefilled (on stderr) unless
    ``progress`` is False."""
    from tqdm.auto import tqdm

    total = data.window.numel() + sum(max(h.lengths) - h.question.numel() for h in data.haystacks)
    bar = tqdm(total=total, desc=f"long eval {label}".strip(), unit="tok", unit_scale=True, disable=not progress,
               mininterval=1.0, file=sys.stderr, dynamic_ncols=True)
    model.eval()
    t0, cpu0 = time.perf_counter(), time.process_time()
    nll = torch.empty(data.window.numel() - 1, dtype=torch.float64)
    try:
        with PeakMemory(device) as peak:
            _pass(model, data.window, data.chunk, device, bar.update, nll=nll)
            passkey = [r for h in data.haystacks for r in _pass(model, h.ids, data.chunk, device, bar.update, hay=h)]
    finally:
        bar.close()
    return {
        "context": data.context,
        "factor": data.factor,
        "bands": _bands(data, nll),
        "nll_bins": {"tokens": data.bin, "loss": _nll_bins(nll, data.bin)},
        "passkey": passkey,
        "retrieved": sum(r["retrieved"] for r in passkey) / len(passkey),
        "seconds": round(time.perf_counter() - t0, 1),
        "cpu_seconds": round(time.process_time() - cpu0, 1),
        **peak.record(),
    }


@torch.no_grad()
def estimate_seconds(model: nn.Module, data: LongEvalData, device: torch.device, chunks: int = 4) -> dict[str, Any]:
    """Time the first ``chunks`` chunks of the band window's prefill on ``model`` and extrapolate to one entry's
    long evaluation: a chunk that sees k chunks of keys takes about a + b * k (a least-squares fit), so a pass of
    n chunks about n * a + b * n (n + 1) / 2, and an entry ``data.passes()`` passes."""
    ids = data.window
    cache = _cache(model)
    times = []
    model.eval()
    for a, b in _bounds(ids.numel(), data.chunk, [])[:chunks]:
        t = time.perf_counter()
        _forward(model, ids[a:b], cache, device)
        times.append(time.perf_counter() - t)
    ks = list(range(1, len(times) + 1))
    mk, mt = sum(ks) / len(ks), sum(times) / len(times)
    var = sum((k - mk) ** 2 for k in ks)
    slope = max(0.0, sum((k - mk) * (t - mt) for k, t in zip(ks, times)) / var) if var else 0.0
    intercept = max(0.0, mt - slope * mk)
    n = math.ceil(ids.numel() / data.chunk)
    per_pass = n * intercept + slope * n * (n + 1) / 2
    return {"chunk_seconds": [round(t, 2) for t in times], "per_pass_seconds": round(per_pass, 1),
            "per_entry_seconds": round(per_pass * data.passes(), 1), "passes_per_entry": data.passes(),
            "pass_tokens": int(ids.numel())}
