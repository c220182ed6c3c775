"""Patched models under ``torch.compile(fullgraph=True)``: one graph, the eager numbers, no host sync.

``fullgraph=True`` makes any graph break an error, so a test that compiles proves the forward is one graph;
:class:`torch._dynamo.testing.CompileCounterWithBackend` counts the graphs (one per compiled call, none
recompiled per decoded token). Three checks, each against the same model in eager mode:

* forward: logits (ViT: classification logits);
* one training step: the loss and every parameter's gradient, relative to the model's largest gradient;
* transformers' fast decoding recipe: the forward compiled with ``fullgraph=True`` by ``generate(...,
  cache_implementation="static")`` itself (``CompileConfig``; ``_compile_all_devices = True`` makes it
  compile on CPU too), on a left-padded batch: the greedy tokens of eager decoding with a DynamicCache.

What runs where (compiles cost 1-15 s each on CPU):

* default suite: the graph-capture matrix with backend ``"eager"`` (Dynamo traces the whole model into one
  graph and runs it as is; this is what proves "one graph") for the forward of every encoding on Llama and
  GPT-2 and of the rotary and absolute encodings on ViT; static-cache decoding for a representative set
  (a static bias, FIRE's position-dependent normaliser, FoX's cached gates, CoPE's custom attention); one
  training step with ``"aot_eager"`` (AOTAutograd traces the backward too); one run each through inductor.
* ``@pytest.mark.soak`` (opt-in, ``make test-soak``): the full matrix through inductor (forward,
  training step, static-cache decoding, every encoding, Llama and GPT-2; forward and training step of the
  rotary and absolute encodings on ViT).
* ``@pytest.mark.gpu`` (skipped without CUDA): static-cache ``generate`` of every encoding under
  ``torch.cuda.set_sync_debug_mode("error")`` (transformers compiles the decode step with mode
  "reduce-overhead", CUDA graphs): no host sync may happen.
"""

from __future__ import annotations


import pytest
import torch
from conftest import EOS_ID, PAD_ID, combos, make_ids, make_model, make_pixels, supports, tiered
from test_common import padded_prompts
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters
from transformers import CompileConfig


CUDA = torch.cuda.is_available()

#: encodings that act on the embeddings or rotate q/k (the ones that ViT's tests here cover).
VIT_ENCODINGS = tuple(
    name for name in ("nope", "sinusoidal", "learned", "rope", "rope2d", "liere", "comrope", "fope")
    if supports(name, "vit")
)
#: static-cache decoding in the default suite: a static bias, cached gates, a position-normalised bias, custom
#: attention.
DECODE_DEFAULT = [("llama", "alibi"), ("llama", "fox"), ("gpt2", "fire"), ("gpt2", "cope")]
NEW_TOKENS = 4
LOGIT_ATOL = 1e-5
GRAD_RTOL = 1e-5  # gradient error / the model's largest gradient (inductor fuses and reorders float sums)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test compiles from scratch (no graph of an earlier model is reused)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def inputs(family: str) -> dict[str, torch.Tensor]:
    if family == "vit":
        return {"pixel_values": make_pixels()}
    ids, mask = padded_prompts()
    return {"input_ids": ids, "attention_mask": mask}


def check_forward(family: str, encoding: str, backend: str) -> None:
    model = make_model(family, encoding=encoding)
    x = inputs(family)
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    with torch.no_grad():
        ref = model(**x).logits
        got = compiled(**x).logits
        again = compiled(**x).logits
    assert counter.frame_count == 1, f"{counter.frame_count} graphs for two identical calls"
    assert (got - ref).abs().max() <= LOGIT_ATOL
    assert torch.equal(got, again)


def _loss(out, x: dict[str, torch.Tensor], family: str) -> torch.Tensor:
    if family == "vit":
        return out.logits.float().pow(2).mean()
    # the loss is taken outside the model: transformers' loss_function logs a warning_once that Dynamo
    # cannot trace (the same for an unpatched model)
    logits, ids, mask = out.logits[:, :-1], x["input_ids"][:, 1:], x["attention_mask"][:, 1:]
    per_token = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids.flatten(), reduction="none")
    return (per_token * mask.flatten()).sum() / mask.sum()


def _step(call, model, x, family):
    model.zero_grad(set_to_none=True)
    loss = _loss(call(**x), x, family)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def check_training_step(family: str, encoding: str, backend: str) -> None:
    model = make_model(family, encoding=encoding, train=True)
    x = inputs(family)
    ref_loss, ref = _step(model, model, x, family)
    counter = CompileCounterWithBackend(backend)
    loss, got = _step(torch.compile(model, fullgraph=True, backend=counter), model, x, family)
    assert counter.frame_count == 1
    assert got.keys() == ref.keys()
    assert abs(loss - ref_loss) <= 1e-5 * max(1.0, abs(ref_loss))
    scale = max(g.abs().max() for g in ref.values())
    worst = max(((got[n] - ref[n]).abs().max() / scale, n) for n in ref)
    assert worst[0] <= GRAD_RTOL, f"gradient of {worst[1]}: error {worst[0]:.1e} of the largest gradient"


def static_generate(model, ids, mask, backend) -> torch.Tensor:
    """Greedy ``generate`` with a static cache; the forward of each decode step compiled (fullgraph) by
    transformers' own automatic compile."""
    config = CompileConfig(fullgraph=True, backend=backend, mode="default" if backend == "inductor" else None)
    config._compile_all_devices = True  # transformers compiles only on accelerators unless told (see CompileConfig)
    return model.generate(
        ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
        pad_token_id=PAD_ID, cache_implementation="static", compile_config=config,
    )


def check_static_decode(family: str, encoding: str, backend: str) -> None:
    model = make_model(family, encoding=encoding)
    ids, mask = padded_prompts()
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False, pad_token_id=PAD_ID)  # eager, DynamicCache
    counters.clear()  # generate deep-copies its CompileConfig (and a counting backend with it): count here
    got = static_generate(model, ids, mask, backend)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == 1, f"{graphs} graphs for {NEW_TOKENS - 1} decode steps (want 1)"
    assert torch.equal(got, ref), f"compiled static decoding {got[:, ids.shape[1]:]} != eager {ref[:, ids.shape[1]:]}"
    assert EOS_ID not in got[:, ids.shape[1]:]


#: the families added after Llama, GPT-2 and ViT (the decoders that share patches/decoder.py, and BERT).
NEW_FAMILIES = ("mistral", "qwen2", "qwen3", "gemma3_text", "phi3", "gpt_neox", "bert")
FORWARD = combos(("llama", "gpt2")) + combos(("vit",), VIT_ENCODINGS)
#: the default suite's forward matrix: every encoding on Llama and GPT-2, three kinds of ViT encoding, and one
#: encoding of a different kind on each newer family (their whole matrix runs under the slow marker).
FORWARD_DEFAULT = (
    combos(("llama", "gpt2")) + combos(("vit",), ("learned", "rope2d", "liere"))
    + [pytest.param(f, e, id=f"{f}-{e}") for f, e in (
        ("mistral", "alibi"), ("qwen2", "fox"), ("qwen3", "rope"), ("gemma3_text", "cope"), ("phi3", "learned"),
        ("gpt_neox", "kerple"), ("bert", "t5"))]
)


# -- default suite -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "family,encoding", tiered(FORWARD_DEFAULT, fast=["llama-rope", "llama-cope", "gpt2-kerple", "vit-learned"])
)
def test_forward_is_one_graph(family, encoding):
    """The patched forward is captured as one graph (backend "eager": the captured ops, run as they are)
    and gives the eager logits; a second call reuses the graph."""
    check_forward(family, encoding, "eager")


@pytest.mark.slow  # test_decode_loop_matches_generate below is the fast tier's compiled decoding
@pytest.mark.parametrize("family,encoding", DECODE_DEFAULT)
def test_static_cache_decoding_is_one_graph(family, encoding):
    """generate(cache_implementation="static") compiles the decode step as one graph (the query offset is
    the StaticCache's tensor) and gives the greedy tokens of eager decoding with a DynamicCache."""
    check_static_decode(family, encoding, "eager")


@pytest.mark.slow
@pytest.mark.parametrize("family,encoding", [("llama", "cope")])
def test_training_step_is_one_graph(family, encoding):
    """Forward + backward through AOTAutograd (backend "aot_eager"): the eager loss and gradients."""
    check_training_step(family, encoding, "aot_eager")


@pytest.mark.slow
@pytest.mark.parametrize("family,encoding", [("llama", "kerple")])
def test_inductor_forward_default(family, encoding):
    """One forward through inductor (generated C++ code), the backend a user gets by default."""
    check_forward(family, encoding, "inductor")


def test_value_checks_step_aside_under_compile():
    """The eager-mode range check of token ids raises a ValueError; under torch.compile it reads no value
    (it would break the graph), so the compiled forward of valid ids is one graph (checked above) and the
    learned table's check does not run either."""
    model = make_model("gpt2", encoding="learned")
    bad = make_ids(1, 5)
    bad[0, 2] = 10_000
    with pytest.raises(ValueError, match="outside the embedding table"):
        model(input_ids=bad)
    with pytest.raises(ValueError, match="outside the learned table"):
        model(input_ids=make_ids(1, 5), position_ids=torch.tensor([[0, 1, 2, 3, 999]]))
    # torch.compiler.is_compiling() is what the checks consult
    from hf_posenc.ops import eager_value_checks

    assert eager_value_checks(bad)
    compiled = torch.compile(lambda t: t + 1 if eager_value_checks(t) else t - 1, fullgraph=True, backend="eager")
    assert torch.equal(compiled(bad), bad - 1)  # the compiled branch: the check stepped aside
    assert not eager_value_checks(torch.empty(0, device="meta"))


# -- slow: the inductor matrix -------------------------------------------------------------------------


@pytest.mark.soak
@pytest.mark.parametrize("family,encoding", combos(NEW_FAMILIES))
def test_forward_is_one_graph_on_every_family(family, encoding):
    """The graph-capture check of the default suite for every encoding on each newer family."""
    check_forward(family, encoding, "eager")


@pytest.mark.soak
@pytest.mark.parametrize("family,encoding", FORWARD)
def test_inductor_forward(family, encoding):
    check_forward(family, encoding, "inductor")


@pytest.mark.soak
@pytest.mark.parametrize("family,encoding", FORWARD)
def test_inductor_training_step(family, encoding):
    check_training_step(family, encoding, "inductor")


@pytest.mark.soak
@pytest.mark.parametrize("family,encoding", combos(("llama", "gpt2")))
def test_inductor_static_decoding(family, encoding):
    check_static_decode(family, encoding, "inductor")


@pytest.mark.soak
@pytest.mark.parametrize("family,encoding", combos(("llama", "gpt2")))
def test_eager_backend_static_decoding(family, encoding):
    """The decode-graph capture of every encoding (backend "eager"; the default suite runs four)."""
    check_static_decode(family, encoding, "eager")


# -- GPU: no host sync ---------------------------------------------------------------------------------


def decode_loop(model, ids: torch.Tensor, mask: torch.Tensor, n: int, step, sync_check=None) -> torch.Tensor:
    """Greedy decoding with a StaticCache and no host read in the decode steps: the eager prefill, then ``n - 1``
    calls of ``step`` (the compiled forward), each fed the previous argmax on the device. The 2D attention
    mask covers the final length from the start (positions after the current token are causal-masked), so every
    step has the same shapes. ``sync_check`` wraps the decode steps (e.g. CUDA's sync debug mode)."""
    from contextlib import nullcontext

    from transformers import StaticCache

    b, length = ids.shape
    cache = StaticCache(config=model.config, max_cache_len=length + n)
    full_mask = torch.cat([mask, mask.new_ones(b, n)], dim=1)
    positions = (full_mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        logits = model(ids, attention_mask=full_mask[:, :length], position_ids=positions[:, :length],
                       past_key_values=cache).logits
        token = logits[:, -1].argmax(-1, keepdim=True)
        out = [token]
        with sync_check() if sync_check is not None else nullcontext():
            for t in range(length, length + n - 1):
                logits = step(token, attention_mask=full_mask[:, : length + n], position_ids=positions[:, t : t + 1],
                              past_key_values=cache).logits
                token = logits[:, -1].argmax(-1, keepdim=True)
                out.append(token)
    return torch.cat([ids, *out], dim=1)


def test_decode_loop_matches_generate():
    """The GPU test's decode loop (compiled, one graph for every step) gives generate()'s greedy tokens."""
    model = make_model("llama", encoding="alibi")
    ids, mask = padded_prompts()
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False, pad_token_id=PAD_ID)
    counter = CompileCounterWithBackend("eager")
    got = decode_loop(model, ids, mask, NEW_TOKENS, torch.compile(model, fullgraph=True, backend=counter))
    assert counter.frame_count == 1
    assert torch.equal(got, ref)


class _SyncDebugError:
    """CUDA's sync debug mode "error" for a block: any device-to-host synchronisation raises."""

    def __enter__(self):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode("default")
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "family,encoding",
    [pytest.param(f, None, id=f"{f}-unpatched") for f in ("llama", "gpt2")] + combos(("llama", "gpt2")),
)
def test_static_decoding_never_syncs(family, encoding):
    """On CUDA the decode step of a StaticCache, compiled as one graph with mode "reduce-overhead" (CUDA
    graphs, what generate() does by itself there), reads nothing on the host: under sync debug mode "error"
    a ``.item()``, ``int(t)`` or Python ``if`` on a tensor raises. generate()'s own loop reads its stopping
    criteria on the host, so the steps run in :func:`decode_loop`; the tokens equal eager generate()'s. The
    unpatched models are the control."""
    model = make_model(family, encoding=encoding).cuda()
    ids, mask = (t.cuda() for t in padded_prompts())
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False, pad_token_id=PAD_ID)
    step = torch.compile(model, fullgraph=True, mode="reduce-overhead")
    decode_loop(model, ids, mask, NEW_TOKENS, step)  # compile and record the CUDA graph outside the check
    got = decode_loop(model, ids, mask, NEW_TOKENS, step, sync_check=_SyncDebugError)
    assert torch.equal(got, ref), encoding
