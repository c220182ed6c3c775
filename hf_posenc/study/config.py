"""A study's settings: `StudyConfig` (every option of ``hf-posenc study``, validated by `StudyConfig.resolved`), the
default entries, and `split_encodings` (``--encodings`` arguments to entry specs).

The modules that run a study (``sources``, ``pretrained``, ``train``) all read the config, so it sits below them:
it imports only ``data``, ``recipes`` and ``long`` of the study (and hf_posenc's registry), never the modules
that use it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..registry import list_encodings
from . import data as D
from .long import DEFAULT_LONG_FACTOR, DEFAULT_PASSKEY_POSITIONS, check_long_factor, default_passkey_lengths
from .recipes import parse_study_entry

__all__ = [
    "CONVERSION_BATCH", "CONVERSION_ENCODINGS", "CONVERSION_STEPS", "CONVERSION_TRAIN_LEN", "DEFAULT_ENCODINGS",
    "StudyConfig", "TEXT_TASKS", "VIT_PATCH", "VIT_TASKS", "split_encodings",
]

#: The ViT study's patch size (pixels).
VIT_PATCH = 4


#: The default entries of a conversion study: the baselines, plain swaps, and compositions that start inert.
CONVERSION_ENCODINGS: tuple[str, ...] = (
    "rope", "rope:eval_scaling=yarn", "nope", "alibi", "fire", "rope+fox:init=identity", "rope+fire:init=identity",
)
#: The representative default set: one or two of each kind.
DEFAULT_ENCODINGS: tuple[str, ...] = (
    "nope", "sinusoidal", "learned", "rope", "alibi", "kerple", "fire", "fox", "cope", "sba",
    # recipes (hf_posenc.study.recipes): SmolLM3's rope/nope 3:1 hybrid, and rope extended with YaRN at evaluation
    "rope*3/nope", "rope:eval_scaling=yarn",
)
#: Tasks for the text families (llama, gpt2); ``digits`` is the ViT task.
TEXT_TASKS: tuple[str, ...] = ("text", *D.TASKS)
VIT_TASKS: tuple[str, ...] = ("digits",)
#: A conversion study's defaults (``--from``; hf_posenc.study.pretrained): on SmolLM2-135M the default entries took
#: 11 min 52 s with ``--jobs 2`` on the 2-core AMD EPYC VM (about 4 s per step; docs/study.md), so about 20 minutes
#: with the default one job.
CONVERSION_STEPS = 40
CONVERSION_TRAIN_LEN = 128
CONVERSION_BATCH = 2


@dataclass
class StudyConfig:
    """Every setting of a study run (all recorded in ``results.json``).

    ``None`` fields take a per-family default in `resolved`.
    """

    encodings: list[str] | None = None  # default: DEFAULT_ENCODINGS (a conversion study: CONVERSION_ENCODINGS)
    family: str = "llama"
    task: str | None = None  # text families: "text" (default) or a synthetic task; vit: "digits"
    train_len: int | None = None  # tokens (text, tasks: default 64) or image side in pixels (vit: default 16)
    # steps: 300 (make demo, this default study with --jobs 2, in under 3 minutes on 2 cores: docs/study.md); a
    # conversion study: CONVERSION_STEPS
    steps: int | None = None
    layers: int = 4  # a multiple of 4: the default rope*3/nope hybrid repeats over the depth
    hidden: int = 64
    heads: int | None = None  # default hidden // 16
    batch: int | None = None  # default 16 (text, tasks), 64 (vit)
    lr: float | None = None  # 3e-3 (a conversion study: 1e-4)
    #: the encoding's own learning rate (hf_posenc.param_groups); default: lr; a conversion study keeps None:
    #: param_groups' measured defaults per encoding (hf_posenc.training.ENCODING_LR(S)), so that a term started
    #: inert moves
    encoding_lr: float | None = None
    seed: int = 0
    seeds: list[int] | None = None  # several seeds: every encoding once per seed (default: [seed])
    jobs: int = 1  # worker processes for independent (encoding, seed) runs
    device: str = "auto"
    threads: int = 1
    out: str | None = "out/study"
    data: str | None = None
    factors: list[float] | None = None  # 1 2 4 8 (a conversion study: 1 2 4)
    #: a conversion study (``--from``): a checkpoint directory, a Hub id, or "smollm2" (hf_posenc.study.pretrained)
    source: str | None = None
    eval_tokens: int | None = None  # 16384 (a conversion study: 1024)
    eval_sequences: int = 128
    #: a conversion study: also evaluate past the pretrained context P (hf_posenc.study.long): perplexity on
    #: [P/2, P), [P, 2P), ... up to long_factor x P, passkey at passkey_lengths (fractions of P) with the key at
    #: passkey_positions
    long_eval: bool = False
    long_factor: int | None = None  # default long.DEFAULT_LONG_FACTOR (2): a power of two
    passkey_lengths: list[float] | None = None  # default long.default_passkey_lengths(long_factor)
    passkey_positions: list[float] | None = None  # default long.DEFAULT_PASSKEY_POSITIONS
    progress: bool = True
    resume: bool = False  # continue from out/results.json (same settings), skipping the models it holds

    def resolved(self) -> StudyConfig:
        """A validated copy with every default filled in; ``ValueError`` naming what is allowed otherwise."""
        c = StudyConfig(**asdict(self))
        convert = c.source is not None
        if convert:
            if not isinstance(c.source, str) or not c.source:
                raise TypeError(f"--from must be a checkpoint directory, a hub id or 'smollm2', got {c.source!r}")
            if c.family != "llama" and c.family != "gpt2":
                raise ValueError(f"--from fine-tunes a pretrained causal LM; --family {c.family} does not apply")
            if c.task not in (None, "text"):
                raise ValueError(f"--from runs the text task (English text, perplexity per token); got --task {c.task}")
        if not isinstance(c.long_eval, bool):
            raise TypeError(f"long_eval must be True or False, got {c.long_eval!r}")
        if c.long_eval:
            if not convert:
                raise ValueError("--long-eval evaluates past a pretrained checkpoint's context: it needs --from")
            c.long_factor = check_long_factor(DEFAULT_LONG_FACTOR if c.long_factor is None else c.long_factor)
            f_max = c.long_factor
            for name, default, ok, bounds in (
                    ("passkey_lengths", default_passkey_lengths(f_max), lambda f: 0 < f <= f_max, f"(0, {f_max}]"),
                    ("passkey_positions", DEFAULT_PASSKEY_POSITIONS, lambda f: 0 <= f < f_max, f"[0, {f_max})")):
                value = list(default) if getattr(c, name) is None else getattr(c, name)
                if (not isinstance(value, (list, tuple)) or not value
                        or not all(isinstance(f, (int, float)) and not isinstance(f, bool) and ok(f) for f in value)):
                    raise ValueError(f"--{name.replace('_', '-')} must be fractions of the pretrained context in "
                                     f"{bounds} (--long-factor {f_max}), got {value!r}")
                setattr(c, name, sorted({float(f) for f in value}))
        elif c.passkey_lengths is not None or c.passkey_positions is not None or c.long_factor is not None:
            raise ValueError("--long-factor, --passkey-lengths and --passkey-positions apply with --long-eval only")
        if c.encodings is None:
            c.encodings = list(CONVERSION_ENCODINGS if convert else DEFAULT_ENCODINGS)
        if c.steps is None:
            c.steps = CONVERSION_STEPS if convert else 300
        if c.lr is None:
            c.lr = 1e-4 if convert else 3e-3
        if c.factors is None:
            c.factors = [1, 2, 4] if convert else [1, 2, 4, 8]
        if c.eval_tokens is None:
            c.eval_tokens = 1024 if convert else 16384
        if c.family not in ("llama", "gpt2", "vit"):
            raise ValueError(f"--family must be one of llama, gpt2, vit; got {c.family!r}")
        vit = c.family == "vit"
        if c.task is None:
            c.task = "digits" if vit else "text"
        allowed = VIT_TASKS if vit else TEXT_TASKS
        if c.task not in allowed:
            raise ValueError(f"--task {c.task!r} does not fit --family {c.family}; allowed: {', '.join(allowed)}")
        if c.data is not None and c.task != "text":
            raise ValueError("--data is the text corpus; it only applies to --task text")
        if c.train_len is None:
            c.train_len = CONVERSION_TRAIN_LEN if convert else 16 if vit else 64
        if c.batch is None:
            c.batch = CONVERSION_BATCH if convert else 64 if vit else 16
        if c.heads is None:
            c.heads = max(1, c.hidden // 16)
        for name in ("steps", "layers", "hidden", "heads", "batch", "threads", "eval_tokens", "eval_sequences", "jobs"):
            if not isinstance(getattr(c, name), int) or getattr(c, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {getattr(c, name)!r}")
        if c.hidden % c.heads or (c.hidden // c.heads) % 2:
            raise ValueError(f"--hidden {c.hidden} must be divisible by --heads {c.heads} into an even head size")
        if not c.lr > 0:
            raise ValueError(f"--lr must be > 0, got {c.lr}")
        if c.encoding_lr is None and not convert:
            c.encoding_lr = c.lr
        if c.encoding_lr is not None and (isinstance(c.encoding_lr, bool) or not isinstance(c.encoding_lr, (int, float))
                                          or not c.encoding_lr > 0):
            raise ValueError(f"--encoding-lr must be a number > 0, got {c.encoding_lr!r}")
        if c.seeds is None:
            c.seeds = [c.seed]
        if isinstance(c.seeds, int) or not isinstance(c.seeds, (list, tuple)) or not c.seeds:
            raise TypeError(f"--seeds must be a non-empty list of integers, got {c.seeds!r}")
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in c.seeds):
            raise ValueError(f"--seeds must be integers >= 0, got {c.seeds!r}")
        if not isinstance(c.seed, int) or c.seed < 0:
            raise ValueError(f"--seed must be an integer >= 0, got {c.seed!r}")
        c.seeds = list(dict.fromkeys(c.seeds))  # in order, without repeats
        c.seed = c.seeds[0]
        if not c.factors or any(not f >= 1 for f in c.factors):
            raise ValueError(f"--factors must be numbers >= 1, got {c.factors}")
        c.factors = sorted({float(f) for f in c.factors})
        if vit:
            if c.train_len % VIT_PATCH or c.train_len < VIT_PATCH:
                raise ValueError(f"--train-len is the image side on vit: a multiple of the patch size {VIT_PATCH}")
        elif c.train_len < 4:
            raise ValueError(f"--train-len must be >= 4 tokens, got {c.train_len}")
        elif c.task in D.TASKS:
            task = D.get_task(c.task)
            if c.train_len < task.min_length():
                raise ValueError(f"--train-len {c.train_len} is below the minimum of --task {c.task}: sequences of at "
                                 f"least {task.min_length()} tokens")
        if isinstance(c.encodings, str):
            c.encodings = [c.encodings]
        if not isinstance(c.encodings, (list, tuple)) or not all(isinstance(e, str) for e in c.encodings):
            raise TypeError(f"encodings must be a list of strings, got {c.encodings!r}")
        if not c.encodings:
            raise ValueError("--encodings: give at least one encoding")
        if not isinstance(c.resume, bool):
            raise TypeError(f"resume must be True or False, got {c.resume!r}")
        if c.resume and c.out is None:
            raise ValueError("--resume continues the results.json in --out; give --out")
        expanded: list[str] = []
        # The default list's recipes join where they fit: the 3:1 hybrid when --layers is a multiple of its
        # length, rope + YaRN at evaluation on the text families. Given explicitly, a misfit is an error.
        defaulted = list(c.encodings) in (list(DEFAULT_ENCODINGS), list(CONVERSION_ENCODINGS))
        for e in split_encodings(c.encodings):
            if e == "all":
                expanded += [n for n in list_encodings() if n not in expanded]
            elif e not in expanded:
                entry = parse_study_entry(e)  # validates the names and parameters
                # a conversion study's depth is the checkpoint's (patch_model checks the plan against it)
                plan_misfit = (entry.is_plan and not entry.fills_depth and not convert
                               and c.layers % len(entry.encoding))
                misfit = plan_misfit or (entry.eval_scaling is not None and c.family == "vit")
                if defaulted and misfit:
                    continue
                if entry.zero_shot and not convert:
                    raise ValueError(f"--encodings {e!r}: zero_shot evaluates a pretrained model without fine-tuning; "
                                     "it applies to a conversion study (--from)")
                if plan_misfit:
                    raise ValueError(
                        f"--encodings {e!r}: a plan of {len(entry.encoding)} layers is repeated over the depth, so "
                        f"its length must divide --layers ({c.layers})"
                    )
                if entry.eval_scaling is not None and c.family == "vit":
                    raise ValueError(f"--encodings {e!r}: eval_scaling applies to text families (llama, gpt2)")
                expanded.append(e)
        c.encodings = expanded
        return c


def split_encodings(items: list[str]) -> list[str]:
    """``--encodings`` arguments -> encoding specs. Each argument may hold several specs separated by commas.

    The rule: an argument is cut at its commas; a piece that holds ``=`` but no ``:`` (``key=value``)
    continues the parameters of the spec before it, any other piece starts a new spec. So
    ``rope,alibi`` is two specs, ``kerple:variant=power,per_layer=true`` one, and
    ``kerple:variant=power,per_layer=true,rope,fire`` three. Parameter values never contain commas
    (``parse_encoding`` splits the parameters at commas too), so no spec is split two ways. Empty pieces
    (``rope,,alibi``, a trailing comma) and parameters with no spec before them are ``ValueError``.
    """
    specs: list[str] = []
    for item in items:
        current: str | None = None
        for piece in item.split(","):
            piece = piece.strip()
            if not piece:
                raise ValueError(f"--encodings {item!r}: empty name between commas; write e.g. rope,alibi")
            if "=" in piece and ":" not in piece:
                if current is None or ":" not in current:
                    raise ValueError(
                        f"--encodings {item!r}: parameter {piece!r} has no encoding before it; write name:key=value"
                    )
                current += "," + piece
                specs[-1] = current
                continue
            current = piece
            specs.append(current)
    return specs
