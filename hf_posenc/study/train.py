"""Train one small model per encoding and evaluate it at several lengths: the engine of ``hf-posenc study``.

`run_study` takes a `StudyConfig` and returns a JSON-ready dict (see ``report.py`` for the
table, the JSON file and the plot). For each encoding it seeds torch with the study seed, builds the same
model (same initial weights for everything but the encoding), patches it, trains it on the same batches
in the same order, and evaluates it on the same evaluation data at every length. A model's numbers
therefore do not depend on which other encodings are in the run.

Three kinds of study:

* ``text`` (Llama or GPT-2): next-byte prediction on a byte corpus (default: the Python standard
  library's source). Metric: validation perplexity per byte, over the same validation bytes at every
  evaluation length (``eval_tokens`` bytes, cut into windows of each length).
* ``flip-flop``, ``selective-copy``, ``counting`` (Llama or GPT-2): the CoPE paper's synthetic tasks
  (``data.py``). Metric: accuracy on the answer tokens, teacher-forced, over ``eval_sequences`` fresh
  sequences per length, in distribution (``eval``) and on each out-of-distribution split of the task
  (``splits``: flip-flop sparse and dense, selective-copy dense and sparse, counting ood).
* ``passkey`` (Llama or GPT-2): a key hidden in filler, repeated at the end. Metric: retrieval (every key
  digit right), in distribution and at fixed depths (one split per depth).

Seeds: ``seeds`` (default ``[seed]``) trains every encoding once per seed; each seed has its own initial
weights, training batches and evaluation sets. ``jobs`` > 1 trains independent (encoding, seed) runs in
spawned worker processes, with the same numbers.
* ``digits`` (ViT): classification of scikit-learn's 8x8 digits upscaled to ``train_len`` pixels a side,
  patch size 4; evaluated on the test images upscaled to larger sides. Metric: accuracy.

Lengths: text and tasks are evaluated at ``factors`` (default 1, 2, 4, 8) times ``train_len`` tokens; ViT
at sides ``patch * round(train_len * sqrt(f) / patch)``, i.e. about ``f`` times the training number of
patches (16 px: 16, 24, 32, 44 px = 16, 36, 64, 121 patches).

``learned`` on text gets a table of ``max(eval lengths)`` rows; the rows past ``train_len`` are never
trained (training sequences are ``train_len`` long), so they keep their initial values: its numbers past
1x show what an absolute table does beyond its training length, and the table marks them. On ViT the
table is interpolated bicubically to the larger grids (``interpolate_pos_encoding=True``, as
transformers does).
"""

from __future__ import annotations

import copy
import math
import os
import platform
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any

import torch
from torch import nn

from .. import encoding_module, patch_model
from ..config import PosEncConfig
from ..machine import cpu_id
from ..training import param_groups
from . import data as D
from .config import DEFAULT_ENCODINGS, TEXT_TASKS, VIT_PATCH, StudyConfig, split_encodings
from .pretrained import PretrainedTextSource, checkpoint_record, load_pretrained, native_export_record, resolve_source
from .recipes import StudyEntry, apply_eval_scaling, parse_study_entry
from .sources import DataSource, make_source

__all__ = [
    "DEFAULT_ENCODINGS", "TEXT_TASKS", "MissingDependencyError", "StudyConfig", "check_dependencies", "eval_lengths",
    "parse_encoding", "run_study", "split_encodings",
]

#: the version of results.json's layout (``--resume`` continues only its own)
SCHEMA_VERSION = 1


def parse_encoding(spec: str) -> PosEncConfig:
    """``"name"`` or ``"name:key=value,key=value"`` -> a validated ``PosEncConfig`` (one encoding; plans and
    ``eval_scaling``: `hf_posenc.study.recipes.parse_study_entry`).

    Values are read as Python literals when they parse (``true``/``false`` too), else as strings:
    ``kerple:variant=power``, ``rope:theta=500000``, ``fire:per_layer=true``.
    """
    entry = parse_study_entry(spec)
    if entry.is_plan or entry.eval_scaling is not None:
        raise ValueError(f"--encodings {spec!r} is a plan or has eval_scaling; read it with parse_study_entry")
    return entry.encoding


def eval_lengths(config: StudyConfig) -> list[int]:
    """Evaluation lengths: tokens (text, tasks) or image sides in pixels (vit), one per factor."""
    c = config
    if c.family == "vit":
        sides = [VIT_PATCH * max(1, round(c.train_len * math.sqrt(f) / VIT_PATCH)) for f in c.factors]
        return sorted(set(sides))
    lengths = sorted({round(c.train_len * f) for f in c.factors})
    if c.task == "flip-flop":
        lengths = sorted({n + n % 2 for n in lengths})
    return lengths


# -- environment, determinism --------------------------------------------------------------------------


def resolve_device(name: str) -> torch.device:
    """``auto``: CUDA when available, else CPU. Anything else goes to ``torch.device`` (validated)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"--device {name!r}: {e}; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch reports no CUDA device here; use --device cpu or auto")
    return device


@contextmanager
def deterministic(device: torch.device, threads: int) -> Iterator[None]:
    """Deterministic algorithms (strict on CPU, warn-only on GPUs, where a few ops have no deterministic
    kernel) and ``threads`` intra-op CPU threads; restores the previous settings on exit."""
    prev = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    prev_threads = torch.get_num_threads()
    prev_cudnn = torch.backends.cudnn.benchmark
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True, warn_only=device.type != "cpu")
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev[0], warn_only=prev[1])
        torch.set_num_threads(prev_threads)
        torch.backends.cudnn.benchmark = prev_cudnn


def environment(device: torch.device, threads: int) -> dict[str, Any]:
    """Versions and machine, for ``results.json``."""
    import numpy
    import transformers

    from .. import __version__

    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": cpu_id(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "hf_posenc": __version__,
        "numpy": numpy.__version__,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_id(),
        "torch_threads": threads if device.type == "cpu" else None,
        "deterministic_algorithms": "strict" if device.type == "cpu" else "warn_only",
        "hf_posenc_backend": os.environ.get("HF_POSENC_BACKEND"),
    }
    for mod in ("matplotlib", "sklearn"):
        try:
            env[mod] = __import__(mod).__version__
        except ImportError:
            env[mod] = None
    try:
        env["load_average_at_start"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover - not on every platform
        env["load_average_at_start"] = None
    return env


# -- models ---------------------------------------------------------------------------------------------


def _make_source(config: StudyConfig, lengths: list[int], seed: int | None = None) -> DataSource:
    """The study's data: English text in the checkpoint's tokens for a conversion study, else the task's source."""
    if config.source is not None:
        return PretrainedTextSource(config, lengths, seed)
    return make_source(config, lengths, seed)


def build_model(config: StudyConfig, vocab_size: int) -> nn.Module:
    """The unpatched model of the study (seed torch first). Text: a causal LM whose own maximum position
    is ``train_len`` (what it is trained on); ViT: a classifier for 1-channel images of ``train_len`` px."""
    c = config
    if c.source is not None:  # a conversion study: the pretrained model
        return load_pretrained(resolve_source(c.source))
    if c.family == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(
            vocab_size=vocab_size, hidden_size=c.hidden, intermediate_size=4 * c.hidden, num_hidden_layers=c.layers,
            num_attention_heads=c.heads, num_key_value_heads=c.heads, max_position_embeddings=c.train_len,
            bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
        )
        return LlamaForCausalLM(cfg)
    if c.family == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(
            vocab_size=vocab_size, n_embd=c.hidden, n_inner=4 * c.hidden, n_layer=c.layers, n_head=c.heads,
            n_positions=c.train_len, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            bos_token_id=None, eos_token_id=None,
        )
        model = GPT2LMHeadModel(cfg)
        model.loss_type = "ForCausalLM"  # transformers cannot infer it from the class name and warns
        return model
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(
        image_size=c.train_len, patch_size=VIT_PATCH, num_channels=1, hidden_size=c.hidden,
        num_hidden_layers=c.layers, num_attention_heads=c.heads, intermediate_size=4 * c.hidden,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=10,
    )
    return ViTForImageClassification(cfg)


def study_encoding(
    spec: str, config: StudyConfig, max_len: int
) -> tuple[PosEncConfig | list, list[str], StudyEntry]:
    """The encoding config the study patches with (a list for a plan), notes for the report, and the parsed
    entry (its label and evaluation-time scaling)."""
    entry = parse_study_entry(spec)
    notes: list[str] = []
    if entry.eval_scaling is not None:
        factor = f"L/{config.train_len}" if entry.eval_factor is None else f"{entry.eval_factor:g}"
        notes.append(f"trained with plain rope; at each length L > {config.train_len} rope is re-patched with "
                     f"{entry.eval_scaling} scaling of factor {factor} (not retrained)")
    if entry.is_plan:
        return entry.encoding, notes, entry
    enc = entry.encoding
    if enc.name == "learned" and config.family != "vit":
        if enc.params.get("max_positions") is None:
            enc = enc.replace(max_positions=max_len)
            notes.append(
                f"table of {max_len} rows; rows {config.train_len}..{max_len - 1} are never trained "
                "(training sequences are shorter), so past 1x it runs on initial values"
            )
    elif enc.name == "learned":
        notes.append("table interpolated bicubically to larger grids (interpolate_pos_encoding=True)")
    return enc, notes, entry


# -- training and evaluation ----------------------------------------------------------------------------


def _lr_lambda(steps: int):
    warmup = max(1, steps // 10)

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    return f


def make_optimizer(model: nn.Module, config: StudyConfig) -> tuple[torch.optim.Optimizer, Any]:
    """The study's optimizer and schedule: AdamW (betas 0.9, 0.95, no weight decay) over
    ``hf_posenc.param_groups`` (the encoding at ``config.encoding_lr``, None: param_groups' defaults per
    encoding; the rest at ``config.lr``) of a patched model, linear warm-up over the first 10 % of
    ``config.steps`` then cosine to 0."""
    groups = param_groups(model, lr=config.lr, encoding_lr=config.encoding_lr)
    opt = torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95), weight_decay=0.0)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(config.steps))


def fine_tune(model: nn.Module, batches: Iterator[tuple[dict[str, torch.Tensor], int]], config: StudyConfig,
              steps: int, device: torch.device, on_step: Any = None) -> list[float]:
    """Train ``model`` for ``steps`` of ``batches`` (the study's recipe: ``make_optimizer``, gradients clipped to
    norm 1.0); returns the training losses. ``on_step(loss)`` is called after each step."""
    opt, sched = make_optimizer(model, config)
    losses: list[float] = []
    model.train()
    for step, (batch, _) in enumerate(batches):
        if step >= steps:
            break
        batch = {k: v.to(device) for k, v in batch.items()}
        loss = model(**batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(losses[-1])
    return losses


def _train_and_eval(
    spec: str, index: int, total: int, config: StudyConfig, data: DataSource, device: torch.device
) -> dict[str, Any]:
    c = config
    lengths = data.lengths
    max_len = max(lengths)
    enc, notes, entry = study_encoding(spec, c, max_len)
    configs = enc if isinstance(enc, list) else [enc]
    result: dict[str, Any] = {"encoding": spec, "label": entry.label, "name": "plan" if entry.is_plan else enc.name,
                              "notes": notes, "seed": data.seed}
    for one in configs:
        if c.family not in one.spec.families:
            result.update(status="not_applicable",
                          reason=f"{one.name} does not support {c.family} (it supports {', '.join(one.spec.families)})")
            return result
    result["seed"] = data.seed
    torch.manual_seed(data.seed)
    model = build_model(c, data.vocab_size)
    if entry.fills_depth:  # a plan ending in /...: one entry per layer of this model
        entry = entry.to_depth(model.config.num_hidden_layers)
        enc = entry.encoding
    patch_model(model, enc)
    model.to(device)
    result["position_encoding"] = copy.deepcopy(model.config.position_encoding)
    result["parameters"] = sum(p.numel() for p in model.parameters())
    result["encoding_parameters"] = sum(p.numel() for p in encoding_module(model).parameters())

    def at_length(n: int) -> dict[str, Any]:
        """What evaluating at length ``n`` ran with: rope re-patched for ``n`` under eval_scaling."""
        if entry.eval_scaling is None:
            return {}
        return {"eval_position_encoding": apply_eval_scaling(model, entry, c.train_len, n)}

    # A conversion study evaluates the pretrained model right after the swap too; its eval-time recipes
    # (rope:eval_scaling=yarn) and its zero_shot entries are baselines that are not trained.
    train_steps = 0 if (c.source is not None and (entry.eval_scaling is not None or entry.zero_shot)) else c.steps
    if c.source is not None:
        result["eval_start"] = [{"length": n, **at_length(n), **data.evaluate(model, n, device)} for n in lengths]
        if train_steps == 0:
            notes.append("evaluated at each length without training (zero-shot)" if entry.zero_shot else
                         "a baseline evaluated at each length without training")

    from tqdm.auto import tqdm

    seeded = f" seed {data.seed}" if len(c.seeds or ()) > 1 else ""
    bar = tqdm(total=train_steps, desc=f"[{index}/{total}] {spec}{seeded}", unit="step", disable=not c.progress,
               mininterval=0.5, file=sys.stderr, dynamic_ncols=True)
    t0, cpu0 = time.perf_counter(), time.process_time()
    try:
        def shown(loss: float) -> None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", refresh=False)

        losses = fine_tune(model, data.train_batches(), c, train_steps, device, on_step=shown)
        train_s, train_cpu = time.perf_counter() - t0, time.process_time() - cpu0
        if c.out is not None:  # what the model learned, before any evaluation-time re-patching
            result["profile"] = _write_profile(model, data, c, spec)
        evals = []
        t1, cpu1 = time.perf_counter(), time.process_time()
        last = f"loss={losses[-1]:.3f}" if losses else "not trained"
        for n in lengths:
            bar.set_postfix_str(f"{last} eval {n}", refresh=True)
            scaled = at_length(n)
            evals.append({"length": n, **data.evaluate(model, n, device), **scaled})
        other_splits: dict[str, list[dict[str, Any]]] = {}
        for split in data.splits:
            if split != D.IN_DISTRIBUTION:
                bar.set_postfix_str(f"{last} eval {split}", refresh=True)
                other_splits[split] = []
                for n in lengths:
                    scaled = at_length(n)
                    other_splits[split].append({"length": n, **data.evaluate(model, n, device, split), **scaled})
        eval_s, eval_cpu = time.perf_counter() - t1, time.process_time() - cpu1
        shown = " ".join(_fmt_metric(e["metric"], c.task) for e in evals)
        bar.set_postfix_str(f"{last} | {shown}", refresh=True)
    finally:
        bar.close()
    if c.long_eval:
        result["long_eval"] = long_evaluation(model, entry, data, device, f"[{index}/{total}] {spec}")
    k = max(1, len(losses) // 20)
    result.update(
        status="ok",
        train={"loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
               "loss_last_10pct": sum(losses[-k * 2 :]) / len(losses[-k * 2 :]) if losses else None,
               "steps": len(losses), "losses": losses,
               "seconds": round(train_s, 3), "cpu_seconds": round(train_cpu, 3)},
        eval=evals,
        eval_seconds=round(eval_s, 3),
        eval_cpu_seconds=round(eval_cpu, 3),
    )
    if other_splits:
        result["splits"] = other_splits
    if c.source is not None:  # a conversion: does the converted model leave hf_posenc (a stock architecture)?
        result["native_export"] = native_export_record(model)
    return result


def long_evaluation(model: nn.Module, entry: StudyEntry, data: DataSource, device: torch.device,
                    label: str = "") -> dict[str, Any]:
    """An entry's evaluation past the pretrained context P (``hf_posenc.study.long``); an entry with scaling at
    evaluation (``rope:eval_scaling=yarn``) is re-patched for FP first (factor F, the long factor, or its own
    ``eval_factor``; ``original_max_position_embeddings`` P) and the result records the ``position_encoding`` it ran
    with."""
    long = data.long
    extra = {}
    if entry.eval_scaling is not None:
        extra["eval_position_encoding"] = apply_eval_scaling(model, entry, long.context, long.factor * long.context)
    return {**data.evaluate_long(model, device, label), **extra}


def _profile_slug(spec: str, seed: int) -> str:
    """A file name for a run's profile: the spec with every character outside [A-Za-z0-9._-] as '_'."""
    import re

    return re.sub(r"[^A-Za-z0-9._-]", "_", spec) + f"_seed{seed}"


def _write_profile(model: nn.Module, data: DataSource, c: StudyConfig, spec: str) -> str:
    """Write the trained model's position profile (`hf_posenc.position_profile`) to
    ``<out>/profiles/<spec>_seed<k>.json``; returns that path relative to ``out``."""
    import json
    from pathlib import Path

    from ..profile import position_profile

    profile = position_profile(model, length=c.train_len if c.family != "vit" else 8,
                               input_ids=data.profile_sample())
    rel = f"profiles/{_profile_slug(spec, data.seed)}.json"
    path = Path(c.out) / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile))
    return rel


def _fmt_metric(v: float | None, task: str | None) -> str:
    if v is None:
        return "inf"
    return f"{v:.2f}" if task == "text" else f"{100 * v:.1f}%"


class MissingDependencyError(ImportError):
    """An optional dependency of the study (the ``study`` extra) is not installed."""


#: optional dependencies: (import name, pip name, what needs it).
_OPTIONAL = {"matplotlib": ("matplotlib", "the plot study.png"), "sklearn": ("scikit-learn", "the ViT digits")}


def check_dependencies(config: StudyConfig) -> None:
    """Raise `MissingDependencyError` before any training if an optional dependency that this study
    needs is missing: matplotlib when it writes files (``out``), scikit-learn for ``--family vit``."""
    import importlib.util

    needed = (["matplotlib"] if config.out is not None else []) + (["sklearn"] if config.family == "vit" else [])
    missing = [m for m in needed if importlib.util.find_spec(m) is None]
    if missing:
        what = ", ".join(f"{_OPTIONAL[m][0]} (for {_OPTIONAL[m][1]})" for m in missing)
        raise MissingDependencyError(
            f"hf-posenc study needs {what}, which is not installed; install the study extra: "
            'pip install "hf_posenc[study]"'
        )


#: settings that may differ between a study and its ``--resume``: what to run, where, and how it shows.
_RESUME_FREE = ("encodings", "out", "progress", "resume", "seed", "seeds", "jobs")


def _load_previous(config: StudyConfig, device: torch.device) -> dict[str, Any]:
    """The ``results.json`` that ``--resume`` continues; ``ValueError`` if it is missing, unreadable or was
    made with other settings (named, with both values)."""
    import json

    path = os.path.join(config.out, "results.json")
    try:
        with open(path) as f:
            prev = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"--resume: there is no {path} to continue; run without --resume first") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"--resume: cannot read {path}: {e}") from None
    if not isinstance(prev, dict) or prev.get("schema_version") != SCHEMA_VERSION or "settings" not in prev:
        raise ValueError(f"--resume: {path} is not a results.json of this hf_posenc version (schema {SCHEMA_VERSION})")
    now = {**asdict(config), "device_resolved": str(device)}
    then = prev["settings"]
    # settings that a results.json written before they existed ran with
    then = {"long_eval": False, "passkey_lengths": None, "passkey_positions": None, "encoding_lr": then.get("lr"),
            "long_factor": 2 if then.get("long_eval") else None, **then}
    diff = [f"{k} {then.get(k)!r} (now {v!r})" for k, v in now.items()
            if k not in _RESUME_FREE and _jsonish(then.get(k)) != _jsonish(v)]
    if diff:
        raise ValueError(
            f"--resume: {path} was made with other settings: {'; '.join(diff)}. Resume with the same settings "
            "(only --encodings and the progress display may change), or write to another --out"
        )
    return prev


def _jsonish(x: Any) -> Any:
    """A value as it reads back from JSON (tuples become lists), to compare settings."""
    import json

    return json.loads(json.dumps(x))


def _assemble(c: StudyConfig, device: torch.device, lengths: list[int], env: dict[str, Any], data: DataSource,
              results: list[dict[str, Any]], t0: float, complete: bool, kept: list[str],
              conversion: dict[str, Any] | None = None) -> dict[str, Any]:
    vit = c.family == "vit"
    out: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "complete": complete,
        "study": {
            "family": c.family,
            "task": c.task,
            "metric": "perplexity" if c.task == "text" else "accuracy",
            "higher_is_better": c.task != "text",
            "length_unit": "image side (pixels)" if vit else "tokens",
            "train_length": c.train_len,
            "eval_lengths": lengths,
            "eval_factors": [round((n / c.train_len) ** (2 if vit else 1), 4) for n in lengths],
        },
        "settings": {**asdict(c), "device_resolved": str(device), "optimizer": "AdamW(betas=(0.9, 0.95), "
                     "weight_decay=0) over hf_posenc.param_groups (the encoding at encoding_lr), linear warmup over "
                     "the first 10% of steps then cosine to 0, grad clip 1.0",
                     "intermediate_size": 4 * c.hidden, "vit_patch_size": VIT_PATCH if vit else None},
        "environment": env,
        "data": data.describe(),
        **(conversion or {}),
        "results": results,
        "errors": sum(r["status"] == "error" for r in results),
        "wall_seconds": round(time.perf_counter() - t0, 2),
    }
    if kept:
        out["resumed"] = {"kept_from_results_json": kept}
    try:
        out["environment"]["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover
        pass
    from . import report

    out["table"] = report.markdown_table(out)
    return out


def _error_record(spec: str, seed: int, e: BaseException) -> dict[str, Any]:
    print(f"hf-posenc study: {spec} (seed {seed}) failed: {type(e).__name__}: {e}", file=sys.stderr)
    try:
        label = parse_study_entry(spec).label
    except (ValueError, TypeError):
        label = spec
    return {"encoding": spec, "label": label, "name": spec.partition(":")[0], "seed": seed, "status": "error",
            "reason": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}


#: The data source of a worker process, per seed (built once per seed and process).
_WORKER_DATA: dict[int, DataSource] = {}


def _worker_run(spec: str, seed: int, index: int, total: int, config: StudyConfig, lengths: list[int],
                device_name: str) -> dict[str, Any]:
    """One (encoding, seed) run in a worker process of ``--jobs``: the same settings, data and code as in
    the parent, so the same numbers (tested)."""
    device = torch.device(device_name)
    with deterministic(device, config.threads):
        try:
            if seed not in _WORKER_DATA:
                _WORKER_DATA[seed] = _make_source(config, lengths, seed)
            return _train_and_eval(spec, index, total, config, _WORKER_DATA[seed], device)
        except Exception as e:  # noqa: BLE001 - recorded, reported and counted by the parent
            return _error_record(spec, seed, e)


def _run_key(r: dict[str, Any], default_seed: int) -> tuple[str, int]:
    """(encoding, seed) of a run; runs of results.json files written before ``--seeds`` have no seed."""
    return r["encoding"], r.get("seed", default_seed)


def run_study(config: StudyConfig) -> dict[str, Any]:
    """Run a study and return its results (a JSON-ready dict); with ``config.out`` also write
    ``results.json`` and ``table.md`` there after every model (so an exception, Ctrl-C or a failing plot
    keeps every finished model; ``"complete": false`` until the last one), then ``study.png``.

    Every encoding is trained once per seed of ``config.seeds`` (a run); ``results["results"]`` holds every
    run, in the order encoding, then seed. A run's numbers depend only on its encoding, seed and the
    settings: not on the other runs, and not on ``config.jobs``, which trains up to that many runs at once
    in worker processes (``spawn``; each with ``config.threads`` torch threads).

    Optional dependencies (matplotlib for the plot, scikit-learn for ViT) are checked before the first
    step (`MissingDependencyError`). With ``config.resume`` the runs that ``out/results.json``
    holds (status ok or n/a, same settings, same data) are kept and not trained again; failed ones are.

    An encoding that raises while training or evaluating is recorded with ``status: "error"`` and its
    traceback, and the study goes on; ``results["errors"]`` counts them. A plot that fails is recorded
    as ``results["plot_error"]`` (results.json and table.md are written already).
    """
    from . import report

    c = config.resolved()
    device = resolve_device(c.device)
    check_dependencies(c)
    lengths = eval_lengths(c)
    prev = _load_previous(c, device) if c.resume else None
    t0 = time.perf_counter()
    runs = [(spec, seed) for spec in c.encodings for seed in c.seeds]
    with deterministic(device, c.threads):
        env = environment(device, c.threads)
        datas: dict[int, DataSource] = {c.seeds[0]: _make_source(c, lengths, c.seeds[0])}

        def data_for(seed: int) -> DataSource:
            if seed not in datas:
                datas[seed] = _make_source(c, lengths, seed)
            return datas[seed]

        conversion = None
        if c.source is not None:  # the checkpoint, and the pretrained model before any swap (once)
            path = resolve_source(c.source)
            record = checkpoint_record(path)
            if prev is not None and prev.get("checkpoint", {}).get("weights_sha256") != record["weights_sha256"]:
                raise ValueError(f"--resume: {c.out}/results.json was made from other weights than {path}")
            before = (prev or {}).get("before")
            if before is None:
                print(f"hf-posenc study: evaluating {record['name']} before any swap", file=sys.stderr)
                base = build_model(c, 0).to(device)
                before = [{"length": n, **datas[c.seeds[0]].evaluate(base, n, device)} for n in lengths]
                del base
            conversion = {"checkpoint": record, "before": before}
            if c.long_eval and (prev or {}).get("before_long_eval") is not None:
                conversion["before_long_eval"] = prev["before_long_eval"]
        done: dict[tuple[str, int], dict[str, Any]] = {}
        if prev is not None:
            now_data, then_data = _jsonish(datas[c.seeds[0]].describe()), _jsonish(prev.get("data"))
            if isinstance(then_data, dict) and "splits" not in then_data:
                now_data.pop("splits", None)  # a results.json from before the splits: its runs lack them only
            then_long = then_data.get("long_eval") if isinstance(then_data, dict) else None
            if isinstance(then_long, dict) and "factor" not in then_long and "long_eval" in now_data:
                # a results.json from before --long-factor (factor 2, as its settings say): the same data, described
                # without the factor, the bin of the kept losses (its runs lack them) and the new wording
                for key in ("factor", "nll_bin_tokens", "how"):
                    now_data["long_eval"].pop(key, None)
                    then_long.pop(key, None)
            if now_data != then_data:
                raise ValueError(f"--resume: the data differ from those of {c.out}/results.json (another --data "
                                 "file, or it changed); resume on the same data, or write to another --out")
            old_seed = prev["settings"].get("seed", 0)
            done = {_run_key(r, old_seed): {"seed": old_seed, **r} for r in prev["results"]
                    if r.get("status") in ("ok", "not_applicable")}
        # Runs of the previous study that this one does not ask for stay in results.json, after the others.
        extra = [r for key, r in done.items() if key not in runs]
        finished: dict[int, dict[str, Any]] = {}
        kept: list[str] = []

        def snapshot(complete: bool) -> dict[str, Any]:
            results = [finished[i] for i in sorted(finished)] + extra
            out = _assemble(c, device, lengths, env, datas[c.seeds[0]], results, t0, complete, kept, conversion)
            if c.out is not None:
                out["files"] = report.write_results(out, c.out)
            return out

        def label(spec: str, seed: int) -> str:
            return f"{spec} seed {seed}" if len(c.seeds) > 1 else spec

        todo: list[int] = []
        for i, (spec, seed) in enumerate(runs):
            if (spec, seed) in done:
                finished[i] = done[spec, seed]
                kept.append(label(spec, seed))
                print(f"[{i + 1}/{len(runs)}] {label(spec, seed)}: kept from results.json (--resume)", file=sys.stderr)
            else:
                todo.append(i)
        if c.long_eval:  # the estimate, then the unpatched model past its context (once)
            _start_long_eval(c, datas[c.seeds[0]], device, conversion, len(todo))
            snapshot(complete=False)
        try:
            if c.jobs > 1 and len(todo) > 1:
                _run_parallel(c, runs, todo, lengths, device, finished, snapshot, label)
            else:
                for i in todo:
                    spec, seed = runs[i]
                    try:
                        finished[i] = _train_and_eval(spec, i + 1, len(runs), c, data_for(seed), device)
                    except Exception as e:  # noqa: BLE001 - recorded, reported and counted: never silent
                        finished[i] = _error_record(spec, seed, e)
                    snapshot(complete=False)
        except BaseException:  # Ctrl-C, SystemExit: keep what is done, then let it through
            snapshot(complete=False)
            raise
    out = snapshot(complete=True)
    if c.out is not None:
        report.write_plot(out, c.out)
        report.write_profiles_figure(out, c.out)
    return out


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def _start_long_eval(c: StudyConfig, data: DataSource, device: torch.device, conversion: dict[str, Any],
                     entries: int) -> None:
    """Print the long evaluation's estimated cost (timed on the unpatched model) and evaluate the unpatched model
    past its context, unless ``conversion`` holds it already (``--resume``); both recorded in ``conversion``."""
    from .long import estimate_seconds

    long = data.long
    base = build_model(c, 0).to(device)
    est = estimate_seconds(base, long, device)
    before = conversion.get("before_long_eval") is None
    todo = entries + before
    wall = est["per_entry_seconds"] * (before + math.ceil(entries / max(1, c.jobs)))
    lengths = sorted({n for h in long.haystacks for n in h.lengths})
    bands = " ".join(f"[{lo}, {hi})" for lo, hi in long.bands[1:])
    print(
        f"hf-posenc study: long evaluation (--long-eval) past the pretrained context P = {long.context} up to "
        f"{long.factor}P (--long-factor {long.factor}): perplexity on {bands} of {long.window.numel()} "
        f"held-out tokens, passkey at {', '.join(map(str, lengths))} tokens in them; {est['passes_per_entry']} "
        f"prefill(s) of {est['pass_tokens']} tokens per entry (chunks of {long.chunk}). Timed on the unpatched model "
        f"(first chunks {est['chunk_seconds']} s): about {_minutes(est['per_entry_seconds'])} per entry, "
        f"{_minutes(wall)} for the {todo} to evaluate here ({c.jobs} at a time), plus each entry's fine-tune; "
        "encodings with a term inside the attention run hf_posenc's tile engine and take longer",
        file=sys.stderr, flush=True)
    conversion["long_eval_estimate"] = {**est, "evaluations": todo, "wall_seconds": round(wall, 1)}
    if conversion.get("before_long_eval") is None:
        conversion["before_long_eval"] = data.evaluate_long(base, device, "unpatched")
    del base


def _run_parallel(c: StudyConfig, runs: list[tuple[str, int]], todo: list[int], lengths: list[int],
                  device: torch.device, finished: dict[int, dict[str, Any]], snapshot: Any, label: Any) -> None:
    """Train the runs ``todo`` in ``c.jobs`` spawned worker processes; record each as it finishes."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    worker_config = StudyConfig(**{**asdict(c), "progress": False})
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(c.jobs, len(todo)), mp_context=ctx) as pool:
        futures = {pool.submit(_worker_run, runs[i][0], runs[i][1], i + 1, len(runs), worker_config, lengths,
                               str(device)): i for i in todo}
        try:
            for fut in as_completed(futures):
                i = futures[fut]
                finished[i] = fut.result()
                r = finished[i]
                shown = " ".join(_fmt_metric(e["metric"], c.task) for e in r.get("eval", []))
                print(f"[{i + 1}/{len(runs)}] {label(*runs[i])}: {r['status']} {shown} "
                      f"({r.get('train', {}).get('seconds', 0):.0f} s training)", file=sys.stderr)
                snapshot(complete=False)
        except BaseException:
            for fut in futures:
                fut.cancel()
            raise
