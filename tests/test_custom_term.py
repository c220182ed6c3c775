"""examples/custom_term.py: a term and its encoding defined outside hf_posenc, through the public API only
(``register_term``, ``TermEncoding``, ``register_encoding``), on all ten families.

The oracle of its bias is the formula itself, −w_h · log(1 + |i − j|), written out here (on ViT at the patches'
Euclidean distance, 0 on CLS pairs). Against the full-matrix reference (the path of ``output_attentions``): the
tile engine's logits and every gradient (the learned w included) on a left-padded batch in train mode, and
FlexAttention's logits (the CPU has no Flex backward: forward only). Decoding with a DynamicCache or a StaticCache
gives the full forward's logits; save/load restores every weight and records the defining module, and loading
without that module registered says which module to import; ``rope+log_distance`` runs every engine, and with
``init="identity"`` gives the unpatched model's logits where RoPE is the family's own encoding. The example's
registrations are undone after this module (``conftest.example_registered``).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import DynamicCache, StaticCache

import hf_posenc
from hf_posenc import attention as attention_module
from hf_posenc import registry
from hf_posenc.encodings.base import PosContext
from hf_posenc.encodings.compose import ComposedEncoding
from conftest import (
    DECODERS,
    FAMILIES,
    example_registered,
    forward_and_loss,
    left_pad,
    main_output,
    make_ids,
    make_model,
    model_inputs,
    positions_from_mask,
    with_cache,
)

NAME = "log_distance"
#: families whose own position encoding is RoPE: ``rope+log_distance`` with ``init="identity"`` is the unpatched model
#: (Gemma 3 too, since a composition rotates each layer with its own base: it was 0.11 off with layer 0's everywhere).
ROPE_NATIVE = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3", "gpt_neox")


@pytest.fixture(scope="module", autouse=True)
def example():
    with example_registered("custom_term") as (module, kinds, encodings):
        assert kinds == [NAME] and encodings == [NAME], (kinds, encodings)
        yield module


def _perturbed(model):
    """w moved away from its start, its own value per head and layer (so that a wrong layer or head shows)."""
    enc = hf_posenc.encoding_module(model)
    if isinstance(enc, ComposedEncoding):  # a composition: its term part
        enc = enc.term
    with torch.no_grad():
        enc.w.copy_(torch.rand(enc.w.shape, generator=torch.Generator().manual_seed(3)) * 1.5 + 0.1)
    return model


def _inputs(family: str) -> dict[str, torch.Tensor]:
    """ViT: pixels; text: a left-padded batch (its first row 4 tokens shorter) with its mask and positions."""
    if family == "vit":
        return model_inputs("vit")
    ids, mask = left_pad([make_ids(1, 6, seed=2)[0], make_ids(1, 10, seed=3)[0]])
    kw = {"input_ids": ids, "attention_mask": mask}
    if family != "bert":
        kw["position_ids"] = positions_from_mask(mask)
    return kw


def _loss_and_grads(family, model, inputs, **kw):
    model.zero_grad(set_to_none=True)
    out, loss = forward_and_loss(family, model, {**inputs, **kw})
    loss.backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _valid(family, inputs, out):
    """The output rows of real tokens (padding rows see no key and differ by path)."""
    return out if family == "vit" else out[inputs["attention_mask"].bool()]


def test_the_bias_is_the_formula():
    """score_bias (the term's reference bias) against −w_h · log(1 + |i − j|) on text, after a cache of 2, and at
    the Euclidean patch distance on ViT (0 on CLS pairs)."""
    model = _perturbed(make_model("llama", encoding=NAME))
    enc = hf_posenc.encoding_module(model)
    w = enc.w.detach()
    ctx = PosContext(encoding=enc, info=enc.info, q_offset=2)
    bias = enc.score_bias(ctx, 3, 5, torch.device("cpu"), layer=1)
    i = torch.arange(3)[:, None] + 2
    j = torch.arange(5)[None, :]
    want = -w[1][:, None, None] * torch.log1p((i - j).abs().float())
    torch.testing.assert_close(bias[0], want)

    vit = _perturbed(make_model("vit", encoding=NAME))
    enc = hf_posenc.encoding_module(vit)
    grid = (3, 2)
    ctx = PosContext(encoding=enc, info=enc.info, grid=grid)
    n = 1 + grid[0] * grid[1]
    bias = enc.score_bias(ctx, n, n, torch.device("cpu"), layer=0)[0]
    coords = [(r, c) for r in range(grid[0]) for c in range(grid[1])]
    for a in range(n):
        for b in range(n):
            if a == 0 or b == 0:
                want = torch.zeros(enc.info.num_heads)
            else:
                d = math.dist(coords[a - 1], coords[b - 1])
                want = -enc.w[0].detach() * math.log1p(d)
            torch.testing.assert_close(bias[:, a, b], want)


@pytest.mark.parametrize("family", FAMILIES)
def test_engines_match_the_reference(monkeypatch, family):
    """Train mode, a left-padded batch: the default path (the tile engine on text; ViT's grid runs the reference
    bias) gives the reference's logits and every gradient, w included; FlexAttention (forced, no gradient on the
    CPU) its logits."""
    monkeypatch.delenv("HF_POSENC_BACKEND", raising=False)
    model = _perturbed(make_model(family, encoding=NAME, train=True))
    inputs = _inputs(family)
    calls = []
    real = attention_module.tiled_attention
    monkeypatch.setattr(attention_module, "tiled_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    out, grads = _loss_and_grads(family, model, inputs)
    assert bool(calls) == (family != "vit"), "the tile engine runs on text (and ViT's grid takes the reference)"
    ref, ref_grads = _loss_and_grads(family, model, inputs, output_attentions=True)
    assert (_valid(family, inputs, out) - _valid(family, inputs, ref)).abs().max() < 1e-5
    assert grads.keys() == ref_grads.keys() and any(n.endswith("posenc.w") for n in grads)
    scale = max(g.abs().max() for g in ref_grads.values())
    for name in grads:
        assert (grads[name] - ref_grads[name]).abs().max() <= 1e-4 * scale, name
    if family == "vit":  # the engines take no 2D term; forcing Flex there raises (test_kernel_attention's concern)
        return
    monkeypatch.setenv("HF_POSENC_BACKEND", "flex")
    with torch.no_grad():
        flex = main_output(model(**inputs, **({} if family == "bert" else {"use_cache": False})))
    assert (_valid(family, inputs, flex) - _valid(family, inputs, ref)).abs().max() < 1e-4


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("family", DECODERS)
def test_cache_decoding_matches_the_full_forward(family, cache):
    """A prefill of 5, single tokens and a chunk of two through the cache: the full forward's logits."""
    model = _perturbed(make_model(family, encoding=NAME))
    ids = make_ids(2, 10)
    steps = (5, 1, 1, 2, 1)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        past = DynamicCache(config=model.config) if cache == "dynamic" else StaticCache(config=model.config,
                                                                                         max_cache_len=16)
        start, pieces = 0, []
        for n in steps:
            pieces.append(model(ids[:, start : start + n], **with_cache(past), use_cache=True).logits)
            start += n
    assert (torch.cat(pieces, dim=1) - full).abs().max() < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_save_and_load_record_the_defining_module(family, tmp_path, monkeypatch):
    """save_pretrained writes the module that defines the encoding beside its parameters; from_pretrained restores
    every weight and the logits; without the encoding registered, loading names the module to import."""
    model = _perturbed(make_model(family, encoding=NAME))
    inputs = model_inputs(family)
    with torch.no_grad():
        before = main_output(model(**inputs))
    model.save_pretrained(tmp_path)
    stored = json.loads((tmp_path / "config.json").read_text())["position_encoding"]
    assert stored == {"name": NAME, "init": 0.5, "modules": {NAME: "custom_term"}}
    loaded = hf_posenc.from_pretrained(tmp_path)
    assert torch.equal(hf_posenc.encoding_module(loaded).w, hf_posenc.encoding_module(model).w)
    with torch.no_grad():
        assert torch.equal(main_output(loaded(**inputs)), before)
    monkeypatch.delitem(registry._REGISTRY, NAME)  # as in a process that has not imported custom_term
    with pytest.raises(ValueError, match="'log_distance' is defined by the module 'custom_term'.*import custom_term"):
        hf_posenc.from_pretrained(tmp_path)


@pytest.mark.parametrize("family", DECODERS + ("bert",))
def test_rope_composition(monkeypatch, family):
    """``rope+log_distance``: the engines carry both (the tile engine's logits and gradients equal the
    reference's); with ``init="identity"`` (w = 0) the unpatched model's logits where RoPE is the family's own."""
    monkeypatch.delenv("HF_POSENC_BACKEND", raising=False)
    model = _perturbed(make_model(family, encoding=f"rope+{NAME}", train=True))
    assert model.config.position_encoding["name"] == f"rope+{NAME}"
    assert model.config.position_encoding["modules"] == {NAME: "custom_term"}
    inputs = _inputs(family)
    out, grads = _loss_and_grads(family, model, inputs)
    ref, ref_grads = _loss_and_grads(family, model, inputs, output_attentions=True)
    assert (_valid(family, inputs, out) - _valid(family, inputs, ref)).abs().max() < 1e-5
    scale = max(g.abs().max() for g in ref_grads.values())
    assert any(n.endswith("term.w") for n in grads)
    for name in grads:
        assert (grads[name] - ref_grads[name]).abs().max() <= 1e-4 * scale, name
    if family not in ROPE_NATIVE:
        return
    inert = make_model(family, encoding=f"rope+{NAME}", init="identity")
    plain = make_model(family)
    ids = make_ids(2, 10)
    with torch.no_grad():
        assert (inert(ids, use_cache=False).logits - plain(ids, use_cache=False).logits).abs().max() < 1e-5


def test_listed_and_checked_by_the_doctor(monkeypatch, capsys):
    """``hf-posenc --import examples/custom_term.py list`` shows it; the doctor has a case for its term, which passes
    on the tile engine and FlexAttention (forward only on the CPU) and skips Triton (no branch) saying so."""
    from hf_posenc import cli, diagnostics

    assert NAME in hf_posenc.list_encodings() and NAME in hf_posenc.list_terms()
    assert NAME in [c.name for c in diagnostics.cases()]
    report = hf_posenc.doctor(device="cpu", cases=NAME, timing=False, verbose=False)
    rows = {r["engine"]: r for r in report["rows"]}
    assert rows["tiled"]["status"] == "pass" and rows["tiled"]["checked"] == ["out", "dq", "dk", "dv", "dw"]
    assert rows["flex"]["status"] == "pass" and rows["flex"]["checked"] == ["out"]
    assert rows["triton"]["status"] == "skip" and "no Triton branch" in rows["triton"]["note"]
    assert report["ok"]
    monkeypatch.setenv("HF_POSENC_IMPORT", "")  # --import sets it (for child processes): unset again after the test
    assert cli.main(["--import", "custom_term", "list"]) == 0
    assert NAME in capsys.readouterr().out
    assert cli.main(["--import", "no_such_module_here", "list"]) == 2
    assert "--import no_such_module_here: No module named" in capsys.readouterr().err
