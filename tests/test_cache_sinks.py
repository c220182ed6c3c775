"""The attention sinks at their cache positions (``sink_positions="cache"``, StreamingLLM) for the Toeplitz terms,
on every engine, against the reference and, there, against values by hand.

With a causal window of W keys (query qi sees qi − W < j <= qi) and k sinks (keys j < k seen besides it), a sink
the window no longer covers (qi − j >= W) takes the term at distance W + k − 1 − j instead of qi − j; every other
pair keeps qi − j (`hf_posenc.kernels._masks.CacheSinks`, the rule every engine reads). The reference
(``attention_reference``, ``term_bias``) is checked by hand at chosen pairs; every engine against the reference
(the tile engine's two CPU paths, the custom op of ``torch.compile``, whose masked reference
tests/test_sink_engines.py checks, FlexAttention without gradients on the CPU, the Triton kernel in Triton's
interpreter), forward and every gradient (q, k, v and the term's tensors), with odd shapes (L = 77, head_dim 40,
GQA 4:1, left padding), an int and a 0-d tensor offset, a chunk after a cache whose sinks form a key range of their
own and a prefill whose windows reach into the sinks; and the cache positions must matter (the result with the
sinks at their text positions differs). Through a model: an ALiBi Llama with window + sink +
``sink_positions="cache"`` decodes as its full forward, its reference path (``output_attentions``) gives the
engine's logits, a KERPLE Llama's training step the reference path's gradients, and the encodings whose term does
not depend on the distance alone refuse it.
"""
from __future__ import annotations

import pytest
import torch

import hf_posenc.attention as posenc_attention_module
from hf_posenc.kernels._masks import CacheSinks, cache_sinks
from hf_posenc.kernels.attention import (
    TOEPLITZ_KINDS, KernelTerm, attention_reference, flex_attention_term, term_bias, tiled_attention,
)
from hf_posenc.kernels.custom_ops import tiled_attention_op

from conftest import make_ids, make_model, tiered
from test_kernel_attention import SHAPE, SHAPE_CHUNK, make_inputs, make_term, rel_err, triton_attention
from test_sink_engines import _sink_case, engine_path  # noqa: F401 (engine_path: a fixture)
from test_window_kernels import interpreted  # noqa: F401 (a fixture)

CACHE = dict(sink_positions="cache")


# -- the rule and the reference, by hand ----------------------------------------------------------------------


def test_the_rule_by_hand():
    rule = CacheSinks(window=4, sink=2)
    qi, j = torch.tensor([[10], [4], [3]]), torch.arange(12)[None, :]
    delta = rule.delta(qi - j, j)
    assert delta[0, :2].tolist() == [5, 4]  # W + k − 1 − j: sink 0 at 5, sink 1 at 4 (just before key 7, at 3)
    assert delta[0, 2:].tolist() == (10 - j[0, 2:]).tolist()  # the other keys keep qi − j
    assert delta[1, :2].tolist() == [5, 3]  # query 4: sink 0 is outside its window (4 >= W), sink 1 inside
    assert delta[2, :2].tolist() == [3, 2]  # query 3: both inside
    assert cache_sinks(None, 4, 2, True) is None and cache_sinks("text", 4, 2, True) is None
    assert cache_sinks("cache", 4, 2, True) == rule


@pytest.mark.parametrize("kind", ["alibi", "kerple_log", "t5"])
def test_reference_bias_by_hand(kind):
    """term_bias at query 10 (W = 4, k = 2): sink 0 at distance 5, sink 1 at 4, key 8 at 2; query 4: sink 0 at 5,
    sink 1 (inside its window) at 3."""
    if kind == "alibi":
        slopes = torch.tensor([0.5, 0.25])
        term = KernelTerm.alibi(slopes)
        value = lambda h, d: -slopes[h] * d  # noqa: E731
    elif kind == "kerple_log":
        r1, r2 = torch.tensor([0.7, 1.3]), torch.tensor([0.4, 0.9])
        term = KernelTerm.kerple_log(r1, r2)
        value = lambda h, d: -r1[h] * torch.log1p(r2[h] * d)  # noqa: E731
    else:  # buckets of j − qi = −M .. M: the distance itself up to 7, then 7
        table = torch.randn(8, 2, generator=torch.Generator().manual_seed(0))
        term = KernelTerm.t5(table, (-torch.arange(-20, 21)).clamp(0, 7))
        value = lambda h, d: table[min(int(d), 7), h]  # noqa: E731
    bias = term_bias(term, None, 12, 12, 0, cache_sinks=CacheSinks(4, 2))[0]
    for h in range(2):
        for qi, j, d in [(10, 0, 5), (10, 1, 4), (10, 8, 2), (4, 0, 5), (4, 1, 3), (3, 0, 3)]:
            torch.testing.assert_close(bias[h, qi, j], torch.as_tensor(value(h, d), dtype=torch.float32))
    text = term_bias(term, None, 12, 12, 0)[0]
    assert not torch.equal(bias[:, 10, 0], text[:, 10, 0])


# -- the engines against the reference --------------------------------------------------------------------------


def _cache_case(fn, kind, shape, window, sink, tensor_offset=False, **extra):
    """``fn`` against the reference with the sinks at their cache positions (forward and every gradient), and the
    cache positions matter."""
    out, text = _sink_case(fn, kind, shape, True, window, sink, tensor_offset, **CACHE, **extra)
    assert rel_err(out, text) > 1e-4, f"{kind}: the sinks' cache positions change nothing"


@pytest.mark.parametrize("kind", TOEPLITZ_KINDS)
def test_tiled_chunk_after_cache(kind, engine_path):
    # 21 queries at keys 56..76, window 6, sinks 0..2 (every one outside every window): a key range of their own
    _cache_case(tiled_attention, kind, SHAPE_CHUNK, 6, 3, block_q=8, block_k=8)


@pytest.mark.parametrize("kind,window,tensor_offset", [
    ("alibi", 9, False), ("kerple_pow", 9, True), ("sandwich", 9, False), ("kerple_log", 9, False), ("dpb", 9, False),
    ("t5", 4, True),  # its example's buckets: one for every distance >= 7, so the sinks' cache distances stay below
])
def test_tiled_prefill(kind, window, tensor_offset, engine_path):
    # L = 77 from key 0: the early blocks' windows reach into the sinks (a sink inside some rows' windows and outside
    # others' in one tile), the later blocks' do not; batch row 1 left-padded by 5 keys (its sinks are padding)
    _cache_case(tiled_attention, kind, SHAPE, window, 4, tensor_offset, block_q=16, block_k=8)


def test_tiled_decoding_steps():
    # a few queries without gradients (tiled.FEW_QUERIES: one SDPA call with the term's reference values)
    shape = (2, 4, 2, 3, 60, 40)
    q, k, v, _, valid, g = make_inputs(shape, torch.float32, 2, True, device="cpu")
    term, _ = make_term("kerple_log", shape, 57, g, device="cpu")
    kw = dict(scale=0.2, causal=True, q_offset=57, key_valid=valid, window=5, sink=4)
    with torch.no_grad():
        out = tiled_attention(q, k, v, term, memo={}, **kw, **CACHE)
        ref = attention_reference(q, k, v, term, **kw, **CACHE)
        text = attention_reference(q, k, v, term, **kw)
    assert rel_err(out, ref) < 2e-6
    assert rel_err(text, ref) > 1e-3


@pytest.mark.parametrize("kind", ["kerple_log", "t5"])
def test_custom_op(kind):
    _cache_case(lambda *x, **kw: tiled_attention_op(*x, **kw), kind, SHAPE_CHUNK, 6, 3)


@pytest.mark.parametrize("kind", TOEPLITZ_KINDS)
def test_flex(kind):
    shape = (2, 4, 2, 21, 40, 16)
    q, k, v, _, valid, g = make_inputs(shape, torch.float32, 4, True, device="cpu")
    term, _ = make_term(kind, shape, 19, g, device="cpu")
    kw = dict(scale=0.25, causal=True, q_offset=19, key_valid=valid, window=6, sink=3)
    with torch.no_grad():
        out = flex_attention_term(q, k, v, term, **kw, **CACHE)
        ref = attention_reference(q, k, v, term, **kw, **CACHE)
        text = attention_reference(q, k, v, term, **kw)
    assert rel_err(out, ref) < 1e-5
    assert rel_err(text, ref) > 1e-4


@pytest.mark.parametrize("kind", tiered(TOEPLITZ_KINDS, fast=("kerple_log", "t5")))
def test_fused_attention(interpreted, kind):
    # the Triton kernel (SINK_CACHE) in the interpreter: 21 queries at keys 56..76, window 6, sinks 0..2
    _cache_case(triton_attention.fused_attention, kind, SHAPE_CHUNK, 6, 3)


def test_fused_attention_prefill_tensor_offset(interpreted):
    # windows that reach into the sinks, a 0-d tensor offset (the kernels load it), the custom op's Triton route
    _cache_case(triton_attention.fused_attention, "alibi", SHAPE, 9, 4, tensor_offset=True)
    _cache_case(lambda *x, **kw: tiled_attention_op(*x, engine="triton", **kw), "sandwich", SHAPE_CHUNK, 6, 3)


# -- refusals ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,kw,match", [
    ("fire", dict(causal=True, sink=2, sink_positions="cache"), "a pair term"),
    ("shaw", dict(causal=True, sink=2, sink_positions="cache"), "a pair term"),
    ("fox", dict(causal=True, sink=2, sink_positions="cache"), "a gate term"),
    ("alibi", dict(causal=False, sink=2, sink_positions="cache"), "causal attention only"),
    ("alibi", dict(causal=True, sink_positions="cache"), "needs attention sinks"),
    ("alibi", dict(causal=True, sink=2, sink_positions="elsewhere"), "sink_positions must be one of"),
])
def test_engines_refuse(kind, kw, match):
    shape = (1, 2, 1, 8, 8, 8)
    q, k, v, _, _, g = make_inputs(shape, torch.float32, 0, False, device="cpu")
    term = make_term(kind, shape, 0, g, device="cpu")[0]
    kw = dict(scale=1.0, window=3, **kw)
    calls = [attention_reference, tiled_attention, tiled_attention_op, flex_attention_term]
    if triton_attention is not None:
        calls.append(triton_attention.fused_attention)
    for call in calls:
        with pytest.raises(ValueError, match=match), torch.no_grad():
            call(q, k, v, term, **kw)


# -- through a model ---------------------------------------------------------------------------------------------


def test_model_decodes_as_its_full_forward(monkeypatch):
    """An ALiBi Llama with window + sinks at their cache positions: the engine runs with them (both layers), its
    cached decoding gives its full forward, its full-matrix reference (output_attentions: the encoding's
    score_bias) the engine's logits, and the cache positions change the logits."""
    window, sink, length = 3, 2, 20
    encoding = {"name": "alibi", "window": window, "sink": sink, "sink_positions": "cache"}
    model = make_model("llama", encoding=encoding, config_overrides={"num_hidden_layers": 2})
    calls = []
    inner = posenc_attention_module.tiled_attention
    monkeypatch.setattr(posenc_attention_module, "tiled_attention",
                        lambda *a, **kw: calls.append(kw.get("sink_positions")) or inner(*a, **kw))
    ids = make_ids(1, length)
    with torch.no_grad():
        full = model(ids).logits
        assert calls == ["cache", "cache"]
        reference = model(ids, output_attentions=True).logits
        text = make_model("llama", encoding={**encoding, "sink_positions": "text"},
                          config_overrides={"num_hidden_layers": 2})(ids).logits
        out = model.generate(ids[:, :17], max_new_tokens=5, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
        after = model(out.sequences).logits
    torch.testing.assert_close(reference, full, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(text, full, rtol=1e-3, atol=1e-3)
    for step, logits in enumerate(out.logits):
        torch.testing.assert_close(logits[0], after[0, 16 + step], rtol=1e-4, atol=1e-4)
    assert model.config.position_encoding["sink_positions"] == "cache"


def test_model_training_step_equals_the_reference():
    """A KERPLE Llama training on the tile engine gives the gradients (its r1, r2 included) of the full-matrix
    reference path (attention probabilities requested)."""
    encoding = {"name": "kerple", "window": 4, "sink": 2, "sink_positions": "cache"}
    model = make_model("llama", encoding=encoding, train=True, config_overrides={"num_hidden_layers": 2})
    ids = make_ids(1, 24)
    grads = []
    for weights in (False, True):
        model.zero_grad()
        model(ids, labels=ids, output_attentions=weights).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert any("r1" in n for n in grads[0]) and grads[0].keys() == grads[1].keys()
    for name, g in grads[0].items():
        torch.testing.assert_close(g, grads[1][name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("encoding", ["fire", "cope", "shaw", "fox", "rope+alibi"])
def test_other_encodings_refuse(encoding):
    with pytest.raises(ValueError, match="only encodings whose term depends on the distance alone: rotary and "
                                         "Toeplitz terms"):
        make_model("llama", encoding={"name": encoding, "window": 3, "sink": 2, "sink_positions": "cache"})


@pytest.mark.slow  # an inductor compilation of a training step: about a minute on a loaded 2-core VM
def test_compiled_step_equals_eager():
    """torch.compile(fullgraph=True) runs the engine's custom op with the sinks at their cache positions: the eager
    model's loss and gradients (KERPLE's r1 and r2 included)."""
    encoding = {"name": "kerple", "window": 6, "sink": 2, "sink_positions": "cache"}
    model = make_model("llama", encoding=encoding, train=True, config_overrides={"num_hidden_layers": 2})
    ids = make_ids(1, 40)
    model(ids, labels=ids).loss.backward()
    eager = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    torch.compile(model, fullgraph=True)(ids, labels=ids).loss.backward()
    for name, g in eager.items():
        torch.testing.assert_close(model.get_parameter(name).grad, g, rtol=1e-4, atol=1e-6, msg=name)
