"""Shared fixtures and factories for the hf_posenc test-suite: tiny, seeded models of every family.

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
import importlib.util
import inspect
import os
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch

if not torch.cuda.is_available():
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") is None:
        warnings.warn(
            "triton was imported before tests/conftest.py could set TRITON_INTERPRET=1; interpreted kernels "
            "that call triton.language library functions will fail. Set TRITON_INTERPRET=1 in the environment.",
            stacklevel=1,
        )
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The autotuner (hf_posenc.kernels.autotune) times exact engine paths on first use: the suite takes each site's
# fixed default instead, so that no test pays for timing and every run takes the same path. tests/test_autotune.py
# turns it on where it tests it, and checks there that every path gives the same numbers.
os.environ.setdefault("HF_POSENC_TUNE", "off")

# -- deprecation warnings: ours fail the run, a third party's are shown once ----------------------------------
# pyproject.toml's filterwarnings make a DeprecationWarning or FutureWarning an error when the module it is
# attributed to (the frame its ``stacklevel`` names) is hf_posenc or a test module, and show a third party's once.
# transformers' deprecated keyword arguments (``@deprecate_kwarg``: ``past_key_values=`` since 5.24) wrap a
# model's forward and warn with stacklevel=2, which names the frame that called the deprecation wrapper: torch's
# ``nn.Module.__call__``, or another of transformers' decorators around the forward (``can_return_tuple``, ...),
# never the code that called the model, so a test's ``model(past_key_values=...)`` would count as a third party's
# warning. The wrapper below skips the frames of that call plumbing (``_CALL_PLUMBING``), so that such a warning
# names the module's caller. Nothing else changes: other warnings, and the message and category of these, are
# passed on as they are.
#: Code objects of the frames between a model call and its forward: nn.Module's ``__call__``, and the decorators
#: around the forwards of the test models' classes (filled in once ``CLASSES`` is defined, below).
_CALL_PLUMBING: set = {torch.nn.Module._call_impl.__code__, torch.nn.Module._wrapped_call_impl.__code__}
_warn = warnings.warn


def _warn_naming_the_module_caller(message, category=None, stacklevel=1, source=None, **kwargs):
    """``warnings.warn``, but a DeprecationWarning or FutureWarning that names a frame of ``_CALL_PLUMBING`` names
    the first frame outside it, the code that called the model, instead."""
    level = max(int(stacklevel), 1)
    kind = type(message) if isinstance(message, Warning) else (category or UserWarning)
    if issubclass(kind, (DeprecationWarning, FutureWarning)) and not torch.compiler.is_compiling():
        try:
            frame = sys._getframe(level)  # frame 0 is this function: level names the frame warn would name
        except ValueError:  # a stacklevel past the outermost frame: warn names the module "sys"
            frame = None
        while frame is not None and frame.f_back is not None and frame.f_code in _CALL_PLUMBING:
            frame, level = frame.f_back, level + 1
    return _warn(message, category, level + 1, source, **kwargs)


warnings.warn = _warn_naming_the_module_caller

from typing import Any  # noqa: E402

import pytest  # noqa: E402
from transformers import (  # noqa: E402
    BertConfig,
    BertForMaskedLM,
    BertModel,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    Gemma3TextModel,
    GPT2Config,
    GPT2LMHeadModel,
    GPT2Model,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    GPTNeoXModel,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaModel,
    MistralConfig,
    MistralForCausalLM,
    MistralModel,
    Phi3Config,
    Phi3ForCausalLM,
    Phi3Model,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2Model,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3Model,
    ViTConfig,
    ViTForImageClassification,
    ViTModel,
)

import hf_posenc  # noqa: E402
from hf_posenc.registry import get_encoding  # noqa: E402

#: pytester runs the project's warning filters on an injected test file (tests/test_suite_hygiene.py).
pytest_plugins = ["pytester"]

# The models are tiny: intra-op threads only add synchronisation, and when the 2 cores are shared with
# another process, OpenMP barriers make every small op take milliseconds (a 50x slow-down, measured).
torch.set_num_threads(1)

#: The first three families run every encoding in every common test. The families added later run a few
#: encodings each (``FAMILY_SUBSETS``: their native kind, and one encoding of each kind of term spread over
#: them) with the first and last variant of each test's extra parametrisation (``combos``); the rest of their
#: sweep (every encoding, every variant) is marked ``soak`` (see "test tiers" below).
FAMILIES = ("llama", "gpt2", "vit", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3", "gpt_neox", "bert")
DECODERS = ("llama", "gpt2", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3", "gpt_neox")
FULL_SWEEP = ("llama", "gpt2", "vit")
NEW_DECODERS = tuple(f for f in DECODERS if f not in FULL_SWEEP)
ENCODINGS = tuple(hf_posenc.list_encodings())


def _family_subsets() -> dict[str, tuple[str, ...]]:
    """Encodings run on each later family outside the soak tier: the native kind (``rope`` on the decoders,
    ``learned`` on BERT) and one encoding of each kind of term spread over them (rotary, absolute, static and
    learned biases, MLP biases (fire, dpb), score + value, score mixing, data-dependent, stick-breaking, contextual)."""
    return {
        "mistral": ("rope", "alibi", "tape"),
        "qwen2": ("rope", "kerple", "cape", "dpb"),
        "qwen3": ("rope", "t5", "sba"),
        "gemma3_text": ("rope", "cope", "shaw", "fox", "xpos"),  # its 6-key window on the local layer meets each
        # term; xpos: rope's per-layer bases with the decay
        "phi3": ("rope", "fire", "sinusoidal", "xpos"),  # xpos: the decay on a partial rotary
        "gpt_neox": ("rope", "rope2d", "nope", "learned"),
        "bert": ("learned", "alibi", "t5", "rope", "fox", "sinusoidal", "dpb"),
    }


FAMILY_SUBSETS = _family_subsets()

VOCAB = 97
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
#: The same logits computed two ways at a few hundred tokens (a row padded or alone, later tokens changed or not),
#: where an encoding's term sums over the positions: FoX's bias is a cumulative sum of log-gates, which adds up
#: (linearly in the distance) the ~2e-6 that padding leaves in every layer's input (measured at 268 tokens: 1.2e-5
#: on the exact per-pair path, 2.0e-5 on the CPU fused one, whose logits sit in a block's frame, so that later
#: tokens' gates move the rounding of earlier rows: 1.6e-5 at 248 tokens, fox_pro; ALiBi 2.6e-6 at 268 tokens in
#: test_common, 1.3e-5 at 248 in tests/test_properties.py's larger draws: 4 heads of 16, 2 layers, a row of 248
#: tokens beside a row of 1, against it alone).
LONG_INPUT_ATOL = {"fox": 5e-5, "fox_pro": 5e-5}
#: The same for every other encoding at a few hundred tokens (test_properties' tile regime).
LONG_SAME_ATOL = 5e-5
MAX_POSITIONS = 64
IMAGE_SIZE, PATCH_SIZE, NUM_LABELS = 32, 8, 3
INIT_RANGE = 0.2

#: (head class, base class) per family.
CLASSES = {
    "llama": {"head": LlamaForCausalLM, "base": LlamaModel},
    "gpt2": {"head": GPT2LMHeadModel, "base": GPT2Model},
    "vit": {"head": ViTForImageClassification, "base": ViTModel},
    "mistral": {"head": MistralForCausalLM, "base": MistralModel},
    "qwen2": {"head": Qwen2ForCausalLM, "base": Qwen2Model},
    "qwen3": {"head": Qwen3ForCausalLM, "base": Qwen3Model},
    "gemma3_text": {"head": Gemma3ForCausalLM, "base": Gemma3TextModel},
    "phi3": {"head": Phi3ForCausalLM, "base": Phi3Model},
    "gpt_neox": {"head": GPTNeoXForCausalLM, "base": GPTNeoXModel},
    "bert": {"head": BertForMaskedLM, "base": BertModel},
}


def _forward_decorators(classes) -> set:
    """Code objects of the decorators wrapped around the ``forward`` of ``classes`` (``functools.wraps`` chains)."""
    codes = set()
    for cls in classes:
        fn = cls.forward
        while hasattr(fn, "__wrapped__") and hasattr(fn, "__code__"):
            codes.add(fn.__code__)
            fn = fn.__wrapped__
    return codes


_CALL_PLUMBING |= _forward_decorators(cls for pair in CLASSES.values() for cls in pair.values())

#: Keyword names of the tiny configs' maximum position count, per family.
MAX_POSITIONS_KEY = {fam: "max_position_embeddings" for fam in CLASSES} | {"gpt2": "n_positions", "vit": None}

#: The common part of the tiny Llama-shaped decoder configs (GQA: 4 query heads, 2 key/value heads).
_DECODER_KW = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=MAX_POSITIONS,
    pad_token_id=PAD_ID,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    initializer_range=INIT_RANGE,
    tie_word_embeddings=False,
)

#: What each later family's tiny config sets beyond ``_DECODER_KW``: the facts its patch must reproduce.
_FAMILY_KW: dict[str, dict[str, Any]] = {
    "mistral": {},  # sliding_window 4096 (the default): its cache layers are sliding ones
    "qwen2": {},  # biased q/k/v projections
    "qwen3": {"head_dim": 8},  # QK-norm
    # QK-norm; query_pre_attn_scalar != head_dim; a local layer with a 6-key window and its own base (10^4),
    # a global layer at 10^6; scaled embeddings
    "gemma3_text": {
        "head_dim": 8,
        "query_pre_attn_scalar": 12,
        "sliding_window": 6,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
    },
    "phi3": {"partial_rotary_factor": 0.5, "resid_pdrop": 0.0, "embd_pdrop": 0.0},  # fused qkv, partial rotary
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
    if family in _FAMILY_KW:
        kw = {**_DECODER_KW, **_FAMILY_KW[family]}
        kw.update(overrides)
        cls = {"mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "gemma3_text": Gemma3TextConfig,
               "phi3": Phi3Config}[family]
        return cls(**kw)
    if family == "gpt_neox":  # fused per-head qkv, partial rotary (rotary_pct 0.5), parallel residual
        kw = dict(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=MAX_POSITIONS,
            rotary_pct=0.5,
            use_parallel_residual=True,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            pad_token_id=PAD_ID,
            bos_token_id=BOS_ID,
            eos_token_id=EOS_ID,
            initializer_range=INIT_RANGE,
            tie_word_embeddings=False,
        )
        kw.update(overrides)
        return GPTNeoXConfig(**kw)
    if family == "bert":
        kw = dict(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=MAX_POSITIONS,
            type_vocab_size=2,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            pad_token_id=PAD_ID,
            initializer_range=INIT_RANGE,
        )
        kw.update(overrides)
        return BertConfig(**kw)
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


#: Encoding parameters a (family, encoding) pair's tiny model takes by default in ``make_model`` (an explicit
#: parameter wins). fope on ViT clips every frequency below 2π / (patches per axis at the config's image size): on
#: the 4x4 test grid (floor 2π/4 = 1.57) that is every one (head_dim 8: ω = 1 and 0.1 per axis), and fope is
#: exactly nope (difference 0.0). ``train_length=8`` (a model trained on an 8x8 grid, run on 4x4 images) puts the
#: floor at 2π/8 = 0.79, below ω = 1; the config and the images stay those of every other ViT test.
PAIR_PARAMS: dict[tuple[str, str], dict[str, Any]] = {("vit", "fope"): {"train_length": 8}}


def pair_params(family: str, encoding: Any) -> dict[str, Any]:
    """The ``PAIR_PARAMS`` of ``family`` with ``encoding`` (a name; a plan or composition has none): what a test
    that patches with ``hf_posenc.patch_model`` passes to get ``make_model``'s model."""
    return dict(PAIR_PARAMS.get((family, encoding), {})) if isinstance(encoding, str) else {}


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
        config_overrides: config keys to change.
        params: the encoding's parameters, on top of the pair's ``PAIR_PARAMS`` (these win).
    """
    cls = model_class(family, head)
    torch.manual_seed(seed)
    model = cls(make_config(family, **(config_overrides or {})))
    if encoding is not None:
        hf_posenc.patch_model(model, encoding, **{**pair_params(family, encoding), **params})
    if dtype is not None:
        model.to(dtype)
    model.train(train)
    return model


def supports(encoding: str, family: str) -> bool:
    return family in get_encoding(encoding).families


# -- test tiers -------------------------------------------------------------------------------------
# Three tiers, chosen by markers (registered in pyproject.toml, whose addopts deselects both by default; see
# docs/testing.md):
#   (no marker)  the fast tier: ``make test`` / plain ``pytest``. Every encoding on every family at least once,
#                and a representative share of each parametrised test.
#   ``slow``     the rest of what CI runs: ``make test-all`` (-m "not soak").
#   ``soak``     opt-in, tens of minutes to hours: ``make test-soak`` (-m soak).
# A parameter gets its tier from the helpers below (``combos``, ``tiered``) or from a mark on the test.

SLOW = pytest.mark.slow
SOAK = pytest.mark.soak


def sweep_only(family: str, encoding: str) -> bool:
    """A later family's encoding outside its ``FAMILY_SUBSETS``: that pair's common tests are in the soak tier."""
    return family in FAMILY_SUBSETS and encoding not in FAMILY_SUBSETS[family]


def rotation(family: str, encoding: str, n: int) -> int:
    """A fixed index in ``range(n)`` for the pair, different for neighbouring encodings and families: the fast
    tier's choice of one variant (or one in ``n`` pairs) rotates over them instead of always taking the first.
    Deterministic (no ``hash``), so that every pytest-xdist worker collects the same tiers."""
    return (FAMILIES.index(family) + ENCODINGS.index(encoding)) % n


def combos(families=FAMILIES, encodings=ENCODINGS, extra=None, extra_ids=None, *, fast: str | int = "all",
           every_pair: bool = False) -> list[Any]:
    """pytest params (family, encoding[, *extra]) with ids like ``llama-alibi-static``, for the pairs the registry
    supports (an unsupported pair is left out, not collected as a parameter that always skips; its refusal is
    tests/test_bad_inputs.py's).

    Tiers (see above): a later family's encodings outside its ``FAMILY_SUBSETS``, and its variants other than
    the first and last, are ``soak``. Of the rest, ``fast`` says what the fast tier runs, the others are ``slow``:

    * ``"all"``: every parameter (cheap tests);
    * ``"rotate"``: one variant of ``extra`` per pair, rotating over the pairs (``rotation``), so that every
      variant and every pair runs;
    * an int ``k``: one pair in ``k`` (rotating, so that each family takes different encodings), every variant.

    ``every_pair``: the first variant of every supported pair is in the fast tier, the later families' other
    encodings included (the fast tier's "every encoding on every family")."""
    if fast != "all" and fast != "rotate" and not (isinstance(fast, int) and fast >= 1):
        raise ValueError(f"fast must be 'all', 'rotate' or a positive int, not {fast!r}")
    out = []
    variants = [None] if extra is None else list(extra)
    for fam in families:
        for enc in encodings:
            if not supports(enc, fam):
                continue
            kept = [i for i in range(len(variants))
                    if fam not in FAMILY_SUBSETS or i in (0, len(variants) - 1)]  # soak: the later families' middle
            for i, e in enumerate(variants):
                if every_pair and i == 0:
                    tier = ()
                elif sweep_only(fam, enc) or i not in kept:
                    tier = (SOAK,)
                elif fast == "all":
                    tier = ()
                elif fast == "rotate":
                    tier = () if kept.index(i) == rotation(fam, enc, len(kept)) else (SLOW,)
                else:
                    tier = () if rotation(fam, enc, fast) == 0 else (SLOW,)
                marks = tier
                if e is None:
                    out.append(pytest.param(fam, enc, id=f"{fam}-{enc}", marks=marks))
                    continue
                values = e if isinstance(e, tuple) else (e,)
                tag = extra_ids[i] if extra_ids else "-".join(str(v) for v in values)
                out.append(pytest.param(fam, enc, *values, id=f"{fam}-{enc}-{tag}", marks=marks))
    return out


def tiered(params: Any, fast: Any, mark: pytest.MarkDecorator = SLOW) -> list[Any]:
    """``params`` (pytest.param objects or plain values / tuples), each whose id is not in ``fast`` given
    ``mark``: the fast tier keeps the named representatives of a parametrisation, the rest go to ``mark``'s tier.
    ``fast`` names ids (``pytest.param(..., id=...)``) or, for plain values, the values themselves; a name that
    matches nothing is an error (a renamed parameter would otherwise leave the fast tier without it)."""
    fast = set(fast)
    out, seen = [], set()
    for p in params:
        if not isinstance(p, type(pytest.param(None))):
            key = p
            p = pytest.param(*(p if isinstance(p, tuple) else (p,)))
        else:
            key = p.id
        keep = key in fast
        seen |= {key} & fast
        out.append(p if keep else pytest.param(*p.values, marks=(*p.marks, mark), id=p.id))
    if fast - seen:
        raise ValueError(f"tiered: {sorted(map(str, fast - seen))} match no parameter")
    return out


# -- inputs -----------------------------------------------------------------------------------------


def _cache_argument() -> str:
    """The keyword under which the installed transformers' models take (and return) the KV cache: ``cache`` where
    their forward has it (5.24: ``past_key_values`` is deprecated there, for removal in 5.40), ``past_key_values``
    before (5.17, the oldest version supported). The same name in every family of a release."""
    return "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"


#: The cache's keyword in a model call and its field in the output, for the installed transformers.
CACHE_ARG = _cache_argument()


def with_cache(cache: Any) -> dict[str, Any]:
    """``{name: cache}`` for a model call, under the name the installed transformers wants:
    ``model(ids, **with_cache(past), use_cache=True)``."""
    return {CACHE_ARG: cache}


def returned_cache(output: Any) -> Any:
    """The KV cache a model call returned (``output.cache``, or ``output.past_key_values`` before 5.24)."""
    return getattr(output, CACHE_ARG)


def enable_checkpointing(model: Any, kwargs: dict[str, Any] | None = None) -> None:
    """Activation (gradient) checkpointing on ``model`` (a PeftModel passes the call to its base model), under the
    installed transformers' name: ``activation_checkpointing_enable`` (5.24; ``gradient_checkpointing_enable`` is a
    deprecated alias there, for removal in 6), ``gradient_checkpointing_enable`` before."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


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


@pytest.fixture
def masked_tiles(monkeypatch):
    """The tiles the tile-wise attention engine masks, recorded as (q0, rows, k0, k1): its first query, number
    of query rows and key range (``hf_posenc.kernels.attention._tiles._apply_mask`` is wrapped, in each of the
    engine's modules that call it)."""
    from hf_posenc.kernels.attention import _tiled_function, _tiled_fused, _tiles

    seen: list[tuple[int, int, int, int]] = []
    real = _tiles._apply_mask

    def spy(s, plan, qi, q0, k0, k1, valid):
        seen.append((q0, s.shape[-2], k0, k1))
        return real(s, plan, qi, q0, k0, k1, valid)

    for module in (_tiles, _tiled_fused, _tiled_function):
        monkeypatch.setattr(module, "_apply_mask", spy)
    return seen


# -- Triton-only modules --------------------------------------------------------------------------------


def import_kernel_modules(*names: str) -> tuple[tuple[Any, ...], str | None]:
    """Import the hf_posenc modules ``names`` that need Triton: ``(modules, None)``, or ``(Nones, reason)`` when
    Triton itself is not installed, for the kernel tests to skip with that reason.

    Only an ``ImportError`` whose ``name`` is ``triton`` (or a submodule of it) means "no Triton". Any other one --
    raised inside hf_posenc's kernel modules, or by a dependency Triton needs -- propagates, so that a broken kernel
    module fails the test file at collection instead of silencing it as skips.
    """
    import importlib

    try:
        import triton  # noqa: F401
    except ImportError as exc:
        if exc.name is None or exc.name.split(".")[0] != "triton":
            raise
        return (None,) * len(names), f"triton is not installed ({exc})"
    return tuple(importlib.import_module(name) for name in names), None


# -- which engine ran -----------------------------------------------------------------------------------

#: The entry points counted by ``engine_calls``: (module, function, counter name), the engines' innermost public
#: functions. Their callers import them inside the call (``hf_posenc.kernels.attention.fused_attention`` and
#: ``flex_attention_term``, the SBA and CoPE dispatchers), so replacing the module attribute sees every call.
ENGINE_ENTRY_POINTS = (
    ("hf_posenc.kernels.attention.flex", "flex_attention_term", "flex"),
    ("hf_posenc.kernels.attention.triton_attention", "fused_attention", "triton"),
    ("hf_posenc.kernels.sba.triton_sba", "sba_triton", "triton"),
    ("hf_posenc.kernels.cope.triton_cope", "cope_triton", "triton"),
)


@pytest.fixture
def engine_calls(monkeypatch):
    """A ``collections.Counter`` of the calls that reached each accelerated engine: ``"flex"`` (FlexAttention with
    the term's score_mod) and ``"triton"`` (the fused-term, SBA and CoPE kernels). A test that compares a backend
    with another asserts that the backend it names ran: a silent fall-back to the PyTorch engine would otherwise
    compare torch with torch. (Without Triton installed, only ``"flex"`` is counted.)"""
    import collections
    import importlib

    counts: collections.Counter = collections.Counter()
    for module_name, name, backend in ENGINE_ENTRY_POINTS:
        if backend == "triton" and import_kernel_modules()[1] is not None:
            continue
        module = importlib.import_module(module_name)
        real = getattr(module, name)

        def spy(*args, _real=real, _backend=backend, **kwargs):
            counts[_backend] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    return counts


def tiny_byte_llama_checkpoint(path, max_positions: int = 256):
    """A tiny Llama checkpoint (2 layers, hidden 32, GQA) with a byte-level BPE tokenizer saved beside it, in
    ``path``: what the conversion study's tests load as a pretrained model. Returns ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(alphabet), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                      rope_theta=10000.0, initializer_range=0.2)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


# -- an example file's own terms and encodings ------------------------------------------------------------

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@contextmanager
def example_registered(stem: str = "custom_term"):
    """Import ``examples/<stem>.py`` as the module ``stem`` (it registers its terms and encodings, as a user's file
    does) and yield ``(module, new term kinds, new encoding names)``; afterwards undo every registration it made
    (the term and encoding registries, the derived ``KernelTerm`` constructors, cached compositions), so that no
    other test sees them (several test the registries' contents)."""
    from hf_posenc import registry
    from hf_posenc.encodings import compose
    from hf_posenc.kernels.attention.terms import TERMS, KernelTerm

    before_terms, before_encodings = set(TERMS), set(registry._REGISTRY)
    spec = importlib.util.spec_from_file_location(stem, EXAMPLES / f"{stem}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[stem] = module
    try:
        spec.loader.exec_module(module)
        yield module, [k for k in TERMS if k not in before_terms], [e for e in registry._REGISTRY
                                                                      if e not in before_encodings]
    finally:
        for kind in [k for k in TERMS if k not in before_terms]:
            del TERMS[kind]
            if kind in KernelTerm.__dict__:
                delattr(KernelTerm, kind)
        added = [e for e in registry._REGISTRY if e not in before_encodings]
        for name in added:
            del registry._REGISTRY[name]
        for name in [c for c in compose._CLASSES if set(c.split("+")) & set(added)]:
            del compose._CLASSES[name]
        sys.modules.pop(stem, None)
