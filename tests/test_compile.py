"""Patched models under ``torch.compile(fullgraph=True)``: one graph, the eager numbers, no host sync.

``fullgraph=True`` makes any graph break an error, so a test that compiles proves the forward is one graph;
:class:`torch._dynamo.testing.CompileCounterWithBackend` counts the graphs (one per compiled call, none
recompiled per decoded token). Three checks, each against the same model in eager mode:

* forward: logits (ViT: classification logits);
* one training step: the loss and every parameter's gradient, relative to the model's largest gradient;
* transformers' fast decoding recipe: the forward compiled with ``fullgraph=True`` by ``generate(...,
  cache_implementation="static")`` itself (``CompileConfig``; ``_compile_all_devices = True`` makes it
  compile on CPU too), on a left-padded batch: the greedy tokens of eager decoding with a DynamicCache.

What runs where (compiles cost 1-15 s each on CPU with backend "eager", 30-200 s with inductor on a shared
2-core machine):

* default suite: the graph-capture matrix with backend ``"eager"`` (Dynamo traces the whole model into one
  graph and runs it as is; this is what proves "one graph") for the forward of every encoding on Llama and
  GPT-2 and of the rotary and absolute encodings on ViT; static-cache decoding for a representative set
  (a static bias, FIRE's position-dependent normaliser, FoX's cached gates, CoPE's custom attention); one
  training step with ``"aot_eager"`` (AOTAutograd traces the backward too); and inductor, the default
  backend, on a subset: a forward, a training step through the tile engine's custom op, and static-cache
  decoding of the two encodings that failed under inductor (liere's data-dependent number of distinct
  positions, fox_pro's guard on the mask object). The custom ops (``hf_posenc.kernels.custom_ops``): the
  compiled graph holds the tile engine's op, not the reference; ``torch.library.opcheck``; one graph for
  lengths 256, 384 and 512 with ``dynamic=True`` and with ``mark_dynamic``; a mask of another form runs the
  reference inside the op, logged.
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
from conftest import EOS_ID, PAD_ID, combos, make_ids, make_model, make_pixels, supports, tiered, with_cache
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


@pytest.mark.slow  # inductor compiles take a minute each on 2 cores
@pytest.mark.parametrize("family,encoding", [("llama", "fire")])
def test_inductor_training_step_default(family, encoding):
    """One training step through inductor: the tile engine's forward and backward ops inside the compiled
    forward and backward graphs; the eager loss and gradients."""
    check_training_step(family, encoding, "inductor")


@pytest.mark.slow  # inductor compiles take a minute each on 2 cores
@pytest.mark.parametrize("family,encoding", [("llama", "liere"), ("gpt2", "fox_pro")])
def test_inductor_static_decoding_default(family, encoding):
    """Static-cache greedy decoding compiled by inductor: liere (one rotation per token under compile, no
    data-dependent number of distinct positions) and fox_pro (no guard on the mask object: one graph for every
    decode step)."""
    check_static_decode(family, encoding, "inductor")


# -- custom ops: the tile engine stays in the compiled graph -------------------------------------------


TILE_OP = "hf_posenc.tiled_attention"
ENGINE_OP = "hf_posenc.engine"


class OpRecorder:
    """A Dynamo backend that records the custom ops of each captured graph and runs it as is (``"eager"``)."""

    def __init__(self) -> None:
        self.graphs: list[set[str]] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        ops = set()
        for node in gm.graph.nodes:
            if node.op == "call_function":
                name = str(getattr(node.target, "_name", getattr(node.target, "__name__", node.target)))
                ops.add(name.replace("::", ".").split(".default")[0])
        self.graphs.append(ops)
        return gm.forward


@pytest.mark.parametrize("family,encoding,op", [
    ("llama", "alibi", TILE_OP), ("gpt2", "fire", TILE_OP), ("llama", "fox_pro", TILE_OP), ("gpt2", "shaw", TILE_OP),
    ("llama", "cope", ENGINE_OP), ("gpt2", "sba", ENGINE_OP), ("llama", "cape", ENGINE_OP),
    ("llama", {"name": "alibi", "window": 3, "sink": 2}, TILE_OP),
    ("llama", {"name": "cope", "window": 3, "sink": 2}, ENGINE_OP)], ids=str)
def test_compiled_graph_runs_the_tile_engine(family, encoding, op, caplog):
    """The compiled forward of an encoding with a tile engine holds the engine's custom op (the engine eager
    runs), and nothing is logged as falling back to the reference."""
    model = make_model(family, encoding=encoding)
    recorder = OpRecorder()
    compiled = torch.compile(model, fullgraph=True, backend=recorder)
    with caplog.at_level("DEBUG", logger="hf_posenc"), torch.no_grad():
        got = compiled(**inputs(family)).logits
        ref = model(**inputs(family)).logits
    assert len(recorder.graphs) == 1 and op in recorder.graphs[0], recorder.graphs
    assert not [r for r in caplog.records if "reference" in r.getMessage()], caplog.text
    assert (got - ref).abs().max() <= LOGIT_ATOL


def _op_inputs(kind: str, length: int = 40, seed: int = 0):
    from hf_posenc.kernels.attention.terms import KernelTerm

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, length, 8, generator=g)
    k, v = torch.randn(2, 2, length, 8, generator=g), torch.randn(2, 2, length, 8, generator=g)
    terms = {
        "alibi": lambda: KernelTerm("alibi", {"slopes": torch.rand(4, generator=g)}),
        "kerple_log": lambda: KernelTerm("kerple_log", {"r1": torch.rand(4, generator=g),
                                                        "r2": torch.rand(4, generator=g)}),
        "shaw": lambda: KernelTerm.shaw(torch.randn(7, 8, generator=g), torch.randn(7, 8, generator=g)),
    }
    return q, k, v, terms[kind]()


@pytest.mark.parametrize("kind,engine", [("alibi", "torch"), ("kerple_log", "torch"), ("shaw", "torch"),
                                         ("kerple_log", "triton")])
def test_tile_op_opcheck(kind, engine):
    """torch.library.opcheck of the forward op (schema, fake tensor, autograd registration), with a causal +
    padding mask and with a mask of another form (the reference inside the op); the op with the Triton kernels
    inside (in Triton's interpreter here)."""
    from hf_posenc.kernels.custom_ops import _tiled_attention

    q, k, v, term = _op_inputs(kind)
    mask = torch.ones(2, 1, 40, 40, dtype=torch.bool).tril()
    mask[1, ..., :3] = False
    other = mask.clone()
    other[0, 0, 20, 5] = False
    ints = ",".join(f"{n}={int(x)}" for n, x in term.ints.items())
    tensors = [t.clone().requires_grad_() for t in term.tensors.values()]
    cases = [(mask, None, None, None), (other, None, None, None), (None, None, None, None), (mask, 6, 2, None)]
    if term.spec.form == "toeplitz":  # the sinks at their cache positions (tests/test_cache_sinks.py)
        cases += [(mask, 6, 2, "cache"), (other, 6, 2, "cache")]
    for m, window, sink, sink_positions in cases:
        args = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), m, None, None, tensors, kind,
                ",".join(term.tensors), ints, 0.3, True, 0, 16, 8, window, sink, sink_positions, None, engine)
        torch.library.opcheck(_tiled_attention, args)


@pytest.mark.parametrize("encoding,module,launcher,eager_calls,compiled_calls", [
    # eager calls the attention kernels directly, not through custom_ops; the op: forward, and the backward's
    # recomputed forward
    ("alibi", "custom_ops", "fused_attention", 0, 2),
    ("fire", "custom_ops", "fused_attention", 0, 2),
    ("cope", "cope.triton_cope", "_forward", 1, 2),
    ("sba", "sba.triton_sba", "_forward", 1, 2),
    # every rotary launch: eager forward and backward; the op's forward, recomputed forward and backward
    ("rope2d", "rotary.triton_rotary", "_launch", 2, 3),
])
def test_compiled_model_runs_the_triton_kernels(monkeypatch, encoding, module, launcher, eager_calls,
                                                compiled_calls):
    """The ``triton`` backend (CUDA's default; forced here, the kernels in Triton's interpreter) under
    torch.compile: the Triton kernels run inside custom ops (``hf_posenc::tiled_attention`` for the attention
    terms, ``hf_posenc::engine`` for CoPE and stick-breaking, ``hf_posenc::rotary`` for the rotations), forward
    and backward (on a recomputed forward), the mask checked there, on a left-padded batch, with eager's loss and
    gradients (eager runs the kernels too). Before, a compiled model ran the tile engine (a mask's form cannot be
    read while tracing) or, for CoPE, stick-breaking and the rotations, failed to trace the kernels' dispatch
    (Triton's mode switch)."""
    import importlib

    target = importlib.import_module(f"hf_posenc.kernels.{module}")
    calls = []
    real = getattr(target, launcher)
    monkeypatch.setattr(target, launcher, lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setenv("HF_POSENC_BACKEND", "triton")
    model = make_model("llama", encoding=encoding, train=True, config_overrides={"num_hidden_layers": 1})
    x = inputs("llama")
    ref_loss, ref = _step(model, model, x, "llama")
    assert len(calls) == eager_calls
    counter = CompileCounterWithBackend("aot_eager")
    loss, got = _step(torch.compile(model, fullgraph=True, backend=counter), model, x, "llama")
    assert counter.frame_count == 1
    assert len(calls) == eager_calls + compiled_calls
    assert abs(loss - ref_loss) <= 1e-5 * max(1.0, abs(ref_loss))
    scale = max(g.abs().max() for g in ref.values())
    assert max((got[n] - ref[n]).abs().max() / scale for n in ref) <= GRAD_RTOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_ops_opcheck(dtype):
    """torch.library.opcheck of the spectral rotation's ops (``hf_posenc::skew_exp``: LieRE on text;
    ``hf_posenc::spectral_rotation``: ComRoPE and per-layer LieRE), gradients wanted for every input or for the
    inputs alone, low-precision q and k (their rows in float32 are an output of their own)."""
    from hf_posenc.kernels.rotary.skew_exp import _skew_exp_op
    from hf_posenc.kernels.rotary.spectral import _rotation_op

    g = torch.Generator().manual_seed(0)
    P = torch.randn(2, 3, 4, 4, generator=g)
    skew = P - P.mT
    for need in (True, False):
        torch.library.opcheck(_skew_exp_op, (skew.clone().requires_grad_(need),
                                             torch.randn(7, 3, generator=g).requires_grad_(True)))
        q = torch.randn(2, 4, 5, 12, generator=g).to(dtype).requires_grad_(True)
        k = torch.randn(2, 2, 5, 12, generator=g).to(dtype).requires_grad_(True)
        torch.library.opcheck(_rotation_op, (q, k, skew.clone().requires_grad_(need),
                                             torch.randn(1, 5, 3, generator=g).requires_grad_(need)))


@pytest.mark.slow
@pytest.mark.parametrize("encoding", ["liere", "comrope"])
def test_spectral_rotation_training_step_compiles(encoding):
    """A training step of LieRE and ComRoPE through AOTAutograd: the spectral rotation's backward (data-dependent
    steps: the float64 switch, the rows with close eigenvalues) runs inside its custom op, so it compiles as one
    graph with eager's loss and gradients (before: GuardOnDataDependentSymNode, and inside the op PyTorch dropped
    the lazy conjugation: a forward 3.8 away from eager's)."""
    check_training_step("llama", encoding, "aot_eager")


@pytest.mark.parametrize("name", ["cope", "sba", "cape"])
def test_engine_op_equals_engine(name):
    """CoPE, stick-breaking and CAPE through ``hf_posenc::engine`` (as a compiled model calls them): the eager
    engine's output and gradients (left padding, a tensor offset for CoPE), and torch.library.opcheck."""
    from hf_posenc.kernels.cape.tiled import cape_attention_tiled
    from hf_posenc.kernels.cope.tiled import cope_tiled
    from hf_posenc.kernels.custom_ops import _engine
    from hf_posenc.kernels.sba.tiled import sba_tiled

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, h, 70, 8, generator=g).requires_grad_() for h in (4, 2, 2))
    mask = torch.ones(2, 1, 70, 70, dtype=torch.bool).tril()
    mask[1, ..., :4] = False
    if name == "cope":
        table = torch.randn(8, 16, generator=g).requires_grad_()
        leaves = [q, k, v, table]

        def run():
            return cope_tiled(q, k, v, table, mask, 0.3, torch.tensor(0), block_m=32, block_n=16)
    elif name == "sba":
        bias = torch.randn(4, 8, generator=g).requires_grad_()
        leaves = [q, k, v, bias]

        def run():
            return sba_tiled(q, k, v, mask, 0.3, 0, remainder="bias", bias=bias, block_m=32, block_n=16)
    else:
        mlp = [torch.randn(6, 8, generator=g), torch.randn(6, generator=g), torch.randn(4, 6, generator=g),
               torch.randn(4, generator=g)]
        r = [torch.rand(4, generator=g), torch.rand(4, generator=g)]
        leaves = [q, k, v, *(t.requires_grad_() for t in mlp + r)]

        def run():
            return cape_attention_tiled(q, k, v, *mlp, "kerple_log", tuple(r), mask, 0.3, 0, block_q=32, block_k=16)

    want = run()
    want_grads = torch.autograd.grad(want.pow(2).sum(), leaves)
    recorder = OpRecorder()
    got = torch.compile(run, fullgraph=True, backend=recorder)()  # the op runs (eager) inside the graph
    assert len(recorder.graphs) == 1 and ENGINE_OP in recorder.graphs[0], recorder.graphs
    got_grads = torch.autograd.grad(got.pow(2).sum(), leaves)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    if name == "cope":  # opcheck: schema, fake tensor, autograd registration
        from hf_posenc.kernels.custom_ops import _encode

        spec = {"scale": 0.3, "block_m": 32, "block_n": 16, "window": None, "sink": None, "n_slots": 6,
                "slots": [0, 1, 2, 3, 4]}
        torch.library.opcheck(_engine, ("cope", [q, k, v, table, mask], _encode(spec), 0))


@pytest.mark.parametrize("kind", ["alibi", "shaw"])
def test_tile_op_equals_engine_and_reference(kind, caplog):
    """Through the op: the engine's output and gradients (causal + padding mask), and the full-matrix
    reference's under a mask of another form, which is logged."""
    from hf_posenc.kernels.attention import attention_reference, tiled_attention
    from hf_posenc.kernels.custom_ops import tiled_attention_op

    q, k, v, term = _op_inputs(kind, length=300)
    mask = torch.ones(2, 1, 300, 300, dtype=torch.bool).tril()
    mask[1, ..., :7] = False
    leaves = [q, k, v, *term.tensors.values()]
    for t in leaves:
        t.requires_grad_()

    def grads(out):
        return torch.autograd.grad(out.pow(2).sum(), leaves)

    got = tiled_attention_op(q, k, v, term, scale=0.3, causal=True, mask=mask)
    want = tiled_attention(q, k, v, term, scale=0.3, causal=True, key_valid=mask[:, 0].any(-2))
    assert torch.equal(got, want)
    for a, b in zip(grads(got), grads(want)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    other = mask.clone()
    other[0, 0, 200:, 100:150] = False  # a hole: not causal + key padding
    with caplog.at_level("DEBUG", logger="hf_posenc.kernels.custom_ops"):
        got = tiled_attention_op(q, k, v, term, scale=0.3, causal=True, mask=other)
    assert "the attention mask is not causal + key padding" in caplog.text
    # the reference with that mask: key_valid cannot express the hole, so compare to an explicit softmax
    from hf_posenc.kernels.attention.naive import term_bias
    from hf_posenc.ops import expand_kv

    scores = q @ expand_kv(k, 2).transpose(-1, -2)
    bias = term_bias(term, q, 300, 300)
    scores = (scores + bias) * 0.3 if kind == "shaw" else scores * 0.3 + bias
    probs = scores.masked_fill(~other, float("-inf")).softmax(-1).nan_to_num(0.0)  # padding rows see no key: 0
    want = probs @ expand_kv(v, 2)
    if kind == "shaw":
        rel = (torch.arange(300)[None] - torch.arange(300)[:, None]).clamp(-3, 3) + 3
        want = want + probs.new_zeros(2, 4, 300, 7).scatter_add(-1, rel.expand(2, 4, 300, 300), probs) @ \
            term.tensors["value_table"]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads(got), grads(want)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert attention_reference is not None


@pytest.mark.parametrize("how", ["dynamic", "mark_dynamic"])
@pytest.mark.parametrize("encoding", [None, "alibi"], ids=["sdpa", "alibi"])
def test_no_recompile_per_length(encoding, how):
    """A compiled model that sees lengths 256, 384 and 512 does not recompile per length: with ``dynamic=True``
    (or the length marked dynamic) one graph serves them all, as for the unpatched model (SDPA); the loops over
    tiles run inside the op. The logits equal eager's."""
    model = make_model("llama", encoding=encoding, config_overrides={"num_hidden_layers": 1,
                                                                      "max_position_embeddings": 1024})
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(model, fullgraph=True, backend=counter, dynamic=True if how == "dynamic" else None)
    with torch.no_grad():
        for length in (256, 384, 512):
            ids = make_ids(1, length, seed=length)
            if how == "mark_dynamic":
                torch._dynamo.mark_dynamic(ids, 1)
            got = compiled(input_ids=ids).logits
            assert (got - model(input_ids=ids).logits).abs().max() <= LOGIT_ATOL
    assert counter.frame_count == 1, f"{counter.frame_count} graphs for 3 lengths"


@pytest.mark.parametrize("encoding", ["sandwich", "dpb", "liere", "rope2d", "fope", "tape"])
def test_no_length_in_a_memo_key(encoding):
    """Encodings that memoise per-forward tables (sandwich's and dpb's distance tables, the rotations of liere,
    rope2d and fope) or format lengths (the reference memory check, tape): a symbolic length in a dict key or a string makes
    Dynamo specialise the graph to it, which ``mark_dynamic`` turns into an error; one graph for three lengths."""
    model = make_model("llama", encoding=encoding, config_overrides={"num_hidden_layers": 2,
                                                                      "max_position_embeddings": 1024})
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    with torch.no_grad():
        for length in (256, 384, 512):
            ids = make_ids(1, length, seed=length)
            torch._dynamo.mark_dynamic(ids, 1)
            got = compiled(input_ids=ids).logits
            assert (got - model(input_ids=ids).logits).abs().max() <= LOGIT_ATOL
    assert counter.frame_count == 1, f"{counter.frame_count} graphs for 3 lengths"


def test_compiled_reference_is_logged_and_one_graph(caplog):
    """Where a compiled model must run the full-matrix reference (fire on BERT: its kernel term is causal), it is
    one graph and says so in the debug log, written while the graph is traced (a Logger call inside traced code
    broke the graph of every encoding without a kernel term on BERT)."""
    model = make_model("bert", encoding="fire")
    x = inputs("bert")
    counter = CompileCounterWithBackend("eager")
    with caplog.at_level("DEBUG", logger="hf_posenc"), torch.no_grad():
        got = torch.compile(model, fullgraph=True, backend=counter)(**x).logits
        assert (got - model(**x).logits).abs().max() <= LOGIT_ATOL
    assert counter.frame_count == 1
    assert "the full-matrix reference runs layer 0" in caplog.text, caplog.text


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
                       **with_cache(cache)).logits
        token = logits[:, -1].argmax(-1, keepdim=True)
        out = [token]
        with sync_check() if sync_check is not None else nullcontext():
            for t in range(length, length + n - 1):
                logits = step(token, attention_mask=full_mask[:, : length + n], position_ids=positions[:, t : t + 1],
                              **with_cache(cache)).logits
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


def test_backend_choice_traces_under_compile(monkeypatch):
    """The CUDA dispatch asks whether Triton imports (``triton_import_error``) inside the compiled forward.
    Dynamo cannot trace an import: on an H100 (torch 2.11) every patched model's first compiled decoding step
    failed with ``Unsupported: ... import_module``. Here on the CPU: the question asked for a CUDA device, from a
    fullgraph-compiled function, with the answer not yet cached."""
    import hf_posenc.attention as attention_module
    import hf_posenc.kernels._common as common

    monkeypatch.delenv("HF_POSENC_BACKEND", raising=False)
    monkeypatch.setattr(common, "_IMPORT_ERRORS", {})
    encoding = make_model("llama", encoding="alibi").model.posenc
    eager = attention_module.attention_backend(encoding, "cuda")
    monkeypatch.setattr(common, "_IMPORT_ERRORS", {})
    torch._dynamo.reset()

    def pick(x):
        backend = attention_module.attention_backend(encoding, "cuda")
        return x + (1.0 if backend == eager else -1.0)

    out = torch.compile(pick, fullgraph=True, backend="eager")(torch.zeros(2))
    assert torch.equal(out, torch.ones(2))
    assert eager == "triton"  # Triton imports here (the test extra); the default CUDA entry for alibi


@pytest.mark.parametrize("family,encoding,kwargs,match", [
    ("bert", "cope", {}, "CoPE kernels are causal"),
    ("llama", "sba", {"output_attentions": True}, "attention weights were requested"),
])
def test_forced_triton_raises_under_compile_as_in_eager(monkeypatch, family, encoding, kwargs, match):
    """``HF_POSENC_BACKEND=triton`` with inputs no kernel takes, decided by Python flags (a bidirectional CoPE,
    output_attentions): a compiled model raises the ValueError eager mode raises, instead of running the
    full-matrix reference inside the graph."""
    monkeypatch.setenv("HF_POSENC_BACKEND", "triton")
    model = make_model(family, encoding=encoding, config_overrides={"num_hidden_layers": 1})
    x = inputs(family)
    with pytest.raises(ValueError, match=match):
        model(**x, **kwargs)
    torch._dynamo.reset()
    with pytest.raises(ValueError, match=match):
        torch.compile(model, backend="eager")(**x, **kwargs)
