"""``hf-posenc study``: how do position encodings behave beyond the training length?

Trains one small model per encoding (same initial weights, same batches) and evaluates each at 1x, 2x, 4x
and 8x the training length; prints a markdown table and writes ``results.json``, ``table.md`` and
``study.png``. Modules: ``data`` (corpus, synthetic tasks, digits), ``sources`` (one data source per task:
training batches and evaluation), ``recipes`` (plans and evaluation-time scaling), ``train`` (models,
training, `run_study`), ``report`` (table, JSON, plots).

From Python::

    from hf_posenc.study import StudyConfig, run_study
    results = run_study(StudyConfig(encodings=["rope", "alibi"], steps=100, out="out/study"))
"""

from __future__ import annotations

import argparse
import sys

from .config import CONVERSION_ENCODINGS, CONVERSION_STEPS, DEFAULT_ENCODINGS, TEXT_TASKS, StudyConfig
from .train import MissingDependencyError, run_study

__all__ = [
    "DEFAULT_ENCODINGS",
    "DESCRIPTION",
    "MissingDependencyError",
    "StudyConfig",
    "add_arguments",
    "config_from_args",
    "main",
    "run_study",
]

DESCRIPTION = """\
Train one small model per position encoding and evaluate it at 1x, 2x, 4x and 8x the training length.
Prints a markdown table; writes results.json and table.md to --out after every model (an interrupted study
keeps what it finished; --resume continues it), then study.png. Needs the study extra for the plot and
ViT: pip install "hf_posenc[study]".
Text (default): byte-level language modelling on the Python standard library's own source (no download),
metric validation perplexity per byte. --task flip-flop|selective-copy|counting: the CoPE paper's synthetic
tasks, metric answer accuracy, also on the papers' out-of-distribution splits (flip-flop: sparse and dense;
selective-copy: dense and sparse blanks; counting: ood). --task passkey: a key hidden at a depth in filler,
repeated at the end; accuracy per length and per depth. --seeds 0 1 2: every encoding once per seed, mean
and range. --family vit: scikit-learn's 8x8 digits upscaled, evaluated at larger image sizes, metric test
accuracy."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``hf-posenc study``."""
    d = StudyConfig()
    p.add_argument("--encodings", nargs="+", default=None, metavar="ENC",
                   help="encodings to compare, separated by spaces or commas: names, 'name:key=value,...' for "
                   "parameters (e.g. rope,alibi kerple:variant=power,per_layer=true,fire), or 'all'. After a "
                   "comma, a piece with '=' and no ':' is another parameter of the encoding before it, "
                   f"anything else a new encoding. Plans: entries joined by '/', '*K' repeats one (rope:window=16*3/nope); "
                   "rope:eval_scaling=yarn|linear scales rope at evaluation only (hf_posenc/study/recipes.py); the "
                   "default's two recipes join where they fit (the hybrid when --layers is a multiple of 4, YaRN on "
                   "text). "
                   f"Default: {' '.join(DEFAULT_ENCODINGS)}; with --from: {' '.join(CONVERSION_ENCODINGS)}")
    p.add_argument("--family", choices=("llama", "gpt2", "vit"), default=d.family, help="model family (default llama)")
    p.add_argument("--task", choices=(*TEXT_TASKS, "digits"), default=None,
                   help="text (default on llama/gpt2), flip-flop, selective-copy, counting, passkey; digits (vit, the "
                   "default there)")
    p.add_argument("--train-len", type=int, default=None,
                   help="training length: tokens (default 64), or the image side in pixels on vit (default 16)")
    p.add_argument("--steps", type=int, default=None,
                   help=f"training steps per model (default 300; with --from {CONVERSION_STEPS})")
    p.add_argument("--layers", type=int, default=d.layers, help=f"layers (default {d.layers})")
    p.add_argument("--hidden", type=int, default=d.hidden, help=f"hidden size (default {d.hidden})")
    p.add_argument("--heads", type=int, default=None, help="attention heads (default hidden / 16)")
    p.add_argument("--batch", type=int, default=None, help="batch size (default 16; 64 on vit)")
    p.add_argument("--lr", type=float, default=None, help="peak AdamW learning rate (default 3e-3; with --from 1e-4)")
    p.add_argument("--encoding-lr", type=float, default=None,
                   help="the encoding's own learning rate (hf_posenc.param_groups: its parameters in their own AdamW "
                   "group). Default: --lr; with --from param_groups' measured defaults, the larger of --lr and 1e-2 "
                   "(fox: 3e-2; docs/compositions.md), so that a term started inert (init=identity) moves")
    p.add_argument("--seed", type=int, default=d.seed, help=f"seed: same seed, same numbers (default {d.seed})")
    p.add_argument("--seeds", type=int, nargs="+", default=None, metavar="S",
                   help="several seeds (e.g. 0 1 2): every encoding is trained once per seed; the table gives the "
                   "mean and the range (min-max), the plot the mean with a band, results.json every run. "
                   "Replaces --seed")
    p.add_argument("--jobs", type=int, default=d.jobs,
                   help="worker processes for the independent (encoding, seed) runs (default 1); each uses "
                   "--threads torch threads. Same numbers with or without")
    p.add_argument("--device", default=d.device, help="auto (CUDA when available, else CPU), cpu, cuda, cuda:N")
    p.add_argument("--threads", type=int, default=d.threads,
                   help="torch CPU threads (default 1: tiny models gain little, and on small shared VMs two "
                   "OpenMP threads stall whenever the other core is busy)")
    p.add_argument("--out", default=d.out, metavar="DIR", help=f"output folder (default {d.out})")
    p.add_argument("--data", default=None, metavar="PATH",
                   help="text file or folder to use instead of the standard library's source (--task text)")
    p.add_argument("--factors", nargs="+", type=float, default=None, metavar="F",
                   help="evaluation lengths as multiples of --train-len (default 1 2 4 8; with --from 1 2 4; on vit, "
                   "of the patch count)")
    p.add_argument("--eval-tokens", type=int, default=None,
                   help="text: validation bytes (tokens with --from) scored at every length (default 16384; with "
                   "--from 1024)")
    p.add_argument("--from", dest="source", default=None, metavar="CHECKPOINT",
                   help="a conversion study: fine-tune this pretrained causal LM (a checkpoint directory, a Hugging "
                   "Face Hub id such as HuggingFaceTB/SmolLM2-135M, loaded through the local Hub cache first, or "
                   "'smollm2' for the cached SmolLM2-135M-Instruct) after each swap, on English text, and evaluate "
                   "it before the swap, right after it and after fine-tuning (hf_posenc/study/pretrained.py)")
    p.add_argument("--long-eval", action="store_true",
                   help="with --from: also evaluate every entry (and the unpatched model) past the checkpoint's "
                   "pretrained context P (its max_position_embeddings): perplexity on [P/2, P), [P, 2P), ... up to "
                   "FP (--long-factor) held-out tokens, by band and by position (long_eval.png), and passkey "
                   "retrieval at lengths up to FP. Minutes per entry on a CPU (prints its estimate first; "
                   "docs/study.md); --resume continues it")
    p.add_argument("--long-factor", type=int, default=None, metavar="F",
                   help="--long-eval: evaluate up to F x P tokens, F a power of two (default 2; 4 adds the band "
                   "[2P, 4P) and passkey lengths 3P and 4P)")
    p.add_argument("--passkey-lengths", type=float, nargs="+", default=None, metavar="F",
                   help="--long-eval: passkey lengths as fractions of P, up to the long factor (default 0.5 1 1.5 2, "
                   "then 3 4, 6 8, ... up to it)")
    p.add_argument("--passkey-positions", type=float, nargs="+", default=None, metavar="F",
                   help="--long-eval: the key's position as fractions of P, one prefill of FP tokens each (default "
                   "0.25); with several, passkey.png draws retrieval by key position and length")
    p.add_argument("--eval-sequences", type=int, default=d.eval_sequences,
                   help=f"synthetic tasks: evaluation sequences per length (default {d.eval_sequences})")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--resume", action="store_true",
                   help="continue the study in --out from its results.json: the models it holds are kept, the "
                   "others trained (same settings required; --encodings may add more)")


def config_from_args(args: argparse.Namespace) -> StudyConfig:
    """A `StudyConfig` from parsed ``hf-posenc study`` arguments."""
    return StudyConfig(
        encodings=args.encodings, family=args.family, task=args.task, train_len=args.train_len, steps=args.steps,
        layers=args.layers, hidden=args.hidden, heads=args.heads, batch=args.batch, lr=args.lr,
        encoding_lr=args.encoding_lr, seed=args.seed,
        seeds=args.seeds, jobs=args.jobs, device=args.device, threads=args.threads, out=args.out, data=args.data,
        factors=args.factors, eval_tokens=args.eval_tokens, eval_sequences=args.eval_sequences, progress=not args.no_progress,
        resume=args.resume, source=args.source, long_eval=args.long_eval, long_factor=args.long_factor,
        passkey_lengths=args.passkey_lengths, passkey_positions=args.passkey_positions,
    )


def main(args: argparse.Namespace) -> int:
    """Run the study from parsed arguments: table on stdout, files in ``--out``. Exit status 1 if an
    encoding or the plot failed (recorded in results.json), 2 for invalid options, settings that
    ``--resume`` cannot continue, or a missing optional dependency, 130 on Ctrl-C (finished models kept)."""
    try:
        config = config_from_args(args).resolved()
    except (ValueError, TypeError) as e:
        print(f"hf-posenc study: error: {e}", file=sys.stderr)
        return 2
    try:
        results = run_study(config)
    except (ValueError, MissingDependencyError) as e:  # bad data/lengths, --resume, optional dependency
        print(f"hf-posenc study: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        where = f"{config.out}/results.json" if config.out else "nowhere (no --out)"
        print(f"\nhf-posenc study: interrupted; the finished models are in {where}; continue with --resume",
              file=sys.stderr)
        return 130
    print(results["table"])
    print()
    files = results.get("files", {})
    print(f"wrote {files.get('json')}, {files.get('table')}, {files.get('plot')} "
          f"({results['wall_seconds']:.0f} s)")
    return 1 if results["errors"] or results.get("plot_error") else 0
