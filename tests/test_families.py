"""The families beyond Llama, GPT-2 and ViT: Mistral, Qwen2, Qwen3, Gemma 3 (text), Phi-3, GPT-NeoX, BERT.

The common property tests (tests/test_common.py, tests/test_properties.py) run on these families too, with a
subset of encodings (``FAMILY_SUBSETS`` in conftest.py); every encoding runs in the fast tier's forward and
backward and in the ``soak`` tier (docs/testing.md). Here: each family's native kind reproduces the unpatched
model exactly (``rope`` on every decoder, ``learned`` on BERT with token types), sliding windows, the support
declarations, PEFT.
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import BertForSequenceClassification, DynamicCache, MistralForCausalLM, MistralModel

import hf_posenc
from conftest import (
    DECODERS,
    ENCODINGS,
    FAMILIES,
    left_pad,
    make_config,
    make_ids,
    make_model,
    positions_from_mask,
    with_cache,
)
from hf_posenc.registry import FAMILY_KINDS, get_encoding

NEW_DECODERS = ("mistral", "qwen2", "qwen3", "gemma3_text", "phi3", "gpt_neox")


def padded_prompts() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return left_pad([torch.randint(3, 97, (n,), generator=g) for n in (14, 9)])


# -- identity: the native kind reproduces the unpatched model ------------------------------------------------


@pytest.mark.parametrize("family", ("llama", *NEW_DECODERS))
@pytest.mark.parametrize("head", ("head", "base"))
def test_rope_reproduces_native_decoder(family, head):
    """rope == the unpatched model, bit for bit, on a left-padded batch: Qwen3's and Gemma 3's QK-norm,
    GPT-NeoX's partial rotary (0.5 here), Phi-3's fused qkv and partial rotary, Gemma 3's query scaling,
    scaled embeddings, 6-key window on its local layer, and local/global bases (10^4 plain, 10^6 with linear
    scaling)."""
    native = make_model(family, head)
    patched = make_model(family, head, encoding="rope")
    ids, mask = padded_prompts()
    kw = dict(attention_mask=mask, position_ids=positions_from_mask(mask), use_cache=False)
    with torch.no_grad():
        want, got = native(ids, **kw), patched(ids, **kw)
    attr = "logits" if head == "head" else "last_hidden_state"
    want, got = getattr(want, attr)[mask.bool()], getattr(got, attr)[mask.bool()]
    assert torch.equal(got, want), f"max diff {(got - want).abs().max().item()}"


@pytest.mark.parametrize("family", NEW_DECODERS)
def test_rope_generation_matches_native(family):
    """Greedy generation with the KV cache (DynamicCache, left padding) gives the native tokens and scores."""
    native = make_model(family)
    patched = make_model(family, encoding="rope")
    ids, mask = padded_prompts()
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, output_scores=True,
              return_dict_in_generate=True)
    with torch.no_grad():
        want, got = native.generate(ids, **kw), patched.generate(ids, **kw)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.scores, want.scores):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head", ("base", "mlm", "seqcls"))
def test_learned_reproduces_native_bert(head):
    """learned (adopting BERT's table) == the unpatched BERT, bit for bit, with token types and padding."""
    cls = {"base": "base", "mlm": "head"}.get(head)

    def build():
        torch.manual_seed(0)
        if cls is None:
            return BertForSequenceClassification(make_config("bert", num_labels=3)).eval()
        return make_model("bert", cls)

    native, patched = build(), hf_posenc.patch_model(build(), "learned")
    ids, mask = padded_prompts()
    token_types = (torch.arange(ids.shape[1]) >= 8).long().expand_as(ids)
    with torch.no_grad():
        want = native(ids, attention_mask=mask, token_type_ids=token_types)
        got = patched(ids, attention_mask=mask, token_type_ids=token_types)
    attr = "last_hidden_state" if head == "base" else "logits"
    assert torch.equal(getattr(got, attr), getattr(want, attr))


def test_gemma3_scaled_global_rotary_and_static_cache():
    """Gemma 3 with linear scaling (factor 8, as its larger checkpoints) on the global layer only: rope uses each
    layer's own rotary; greedy generation with a StaticCache (its local layer's sliding cache layer becomes a
    full one, and the mask generate built for it is rebuilt) gives the native tokens."""
    over = {"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}}
    native = make_model("gemma3_text", config_overrides=over)
    patched = make_model("gemma3_text", config_overrides=over, encoding="rope")
    ids, mask = padded_prompts()
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0, cache_implementation="static",
              output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        pos = positions_from_mask(mask)
        want = native(ids, attention_mask=mask, position_ids=pos, use_cache=False).logits[mask.bool()]
        got = patched(ids, attention_mask=mask, position_ids=pos, use_cache=False).logits[mask.bool()]
        assert torch.equal(got, want)
        want, got = native.generate(ids, **kw), patched.generate(ids, **kw)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.scores, want.scores):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_gpt_neox_sequential_residual_and_full_rotary():
    """GPT-NeoX with use_parallel_residual=False and rotary_pct=1: still the native model."""
    over = {"use_parallel_residual": False, "rotary_pct": 1.0}
    native = make_model("gpt_neox", config_overrides=over)
    patched = make_model("gpt_neox", config_overrides=over, encoding="rope")
    ids = make_ids(2, 12)
    with torch.no_grad():
        assert torch.equal(patched(ids, use_cache=False).logits, native(ids, use_cache=False).logits)


# -- sliding windows ---------------------------------------------------------------------------------------

WINDOW = 4
#: one term of each kind: rotary, absolute, static bias, learned bias, MLP bias, score + value, score mix,
#: data-dependent bias, contextual counts, stick-breaking, contextual states. (FoX Pro is not here: its token
#: shift mixes the key before the window into the first key in it, so a window of W reaches W + 1 tokens back per
#: layer; test_fox_pro_shift_reads_the_key_before_a_native_window.)
WINDOW_ENCODINGS = ("rope", "learned", "alibi", "t5", "fire", "shaw", "cape", "fox", "cope", "sba", "tape")


def windowed_mistral(encoding: str | None, layers: int = 1):
    torch.manual_seed(0)
    model = MistralForCausalLM(make_config("mistral", sliding_window=WINDOW, num_hidden_layers=layers)).eval()
    return hf_posenc.patch_model(model, encoding) if encoding else model


@pytest.mark.parametrize("encoding", WINDOW_ENCODINGS)
def test_keys_beyond_the_window_have_no_influence(encoding):
    """One layer, window 4: the last token's logits ignore every token more than 3 positions back, in a full
    forward and when decoding with the cache (which keeps every key); a token inside the window matters.
    Decoding with the cache equals the full forward."""
    model = windowed_mistral(encoding)
    ids = make_ids(1, 12)
    changed_far = ids.clone()
    changed_far[0, : 12 - WINDOW] = torch.randint(3, 97, (12 - WINDOW,), generator=torch.Generator().manual_seed(5))
    changed_near = ids.clone()
    changed_near[0, 12 - WINDOW + 1] = (ids[0, 12 - WINDOW + 1] + 1 - 3) % 94 + 3
    with torch.no_grad():
        last = model(ids, use_cache=False).logits[:, -1]
        assert torch.allclose(model(changed_far, use_cache=False).logits[:, -1], last, atol=1e-5, rtol=0)
        assert not torch.allclose(model(changed_near, use_cache=False).logits[:, -1], last, atol=1e-3, rtol=0)
        full = model(ids, use_cache=False).logits
        for seq in (ids, changed_far):
            cache = DynamicCache(config=model.config)
            steps = [model(seq[:, :5], **with_cache(cache), use_cache=True).logits]
            for t in range(5, 12):
                steps.append(model(seq[:, t : t + 1], **with_cache(cache), use_cache=True).logits)
            cached = torch.cat(steps, dim=1)
            torch.testing.assert_close(cached[:, -1], last, atol=1e-4, rtol=0)
            if seq is ids:
                torch.testing.assert_close(cached, full, atol=1e-4, rtol=0)


@pytest.mark.parametrize("encoding", ("alibi", "t5", "fox"))
def test_native_window_runs_the_tile_engine(monkeypatch, encoding):
    """A model's own sliding window reaches the tile engine as its ``window`` (it skips the key tiles outside it,
    no (Lq, Lk) mask): the engine runs on every windowed layer, with a left-padded batch, and its output and
    gradients (the term's parameters included) equal the full-matrix reference's."""
    import hf_posenc.attention as dispatch

    ids, mask = left_pad([make_ids(1, 12)[0], make_ids(1, 9, seed=2)[0]])
    pos = positions_from_mask(mask)

    def run(engine: bool):
        model = make_model("mistral", encoding=encoding, train=True,
                           config_overrides=dict(sliding_window=WINDOW, num_hidden_layers=2))
        windows = []
        real = dispatch.tiled_attention

        def spy(*args, **kwargs):
            windows.append(kwargs.get("window"))
            return real(*args, **kwargs)

        with monkeypatch.context() as m:
            m.setattr(dispatch, "tiled_attention", spy)
            if not engine:
                m.setattr(dispatch, "_tiled_torch_attention", lambda *a, **k: None)
            out = model(ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
            out[mask.bool()].square().mean().backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        return out, grads, windows

    out, grads, windows = run(engine=True)
    assert windows == [WINDOW, WINDOW]
    ref_out, ref_grads, ref_windows = run(engine=False)
    assert ref_windows == []
    real = mask.bool()
    torch.testing.assert_close(out[real], ref_out[real], atol=1e-5, rtol=1e-4)
    assert grads.keys() == ref_grads.keys() and any("posenc" in n for n in grads) == (encoding != "alibi")
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_fox_pro_shift_reads_the_key_before_a_native_window():
    """FoX Pro's token shift mixes each key with the one before it, a property of the token, not of the queries
    that see it. transformers' own sliding window bands the mask, so when decoding, no new query sees the key
    just before its window; the shift must still use it: left-padded batch, 2D mask, decoding == full forward,
    on Mistral (every layer windowed) and Gemma 3 (its local layer)."""
    for family, overrides in (("mistral", dict(sliding_window=WINDOW, num_hidden_layers=2)), ("gemma3_text", {})):
        model = make_model(family, encoding="fox_pro", config_overrides=overrides)
        rows = make_ids(2, 12)
        ids, mask = left_pad([rows[0], rows[1, :9]])
        with torch.no_grad():
            full = model(ids, attention_mask=mask, position_ids=positions_from_mask(mask), use_cache=False).logits
            cache, steps = DynamicCache(config=model.config), []
            for start, stop in ((0, 5), *((t, t + 1) for t in range(5, 9)), (9, 12)):
                steps.append(model(ids[:, start:stop], attention_mask=mask[:, :stop], **with_cache(cache),
                                   position_ids=positions_from_mask(mask)[:, start:stop], use_cache=True).logits)
        real = mask.bool()
        torch.testing.assert_close(torch.cat(steps, dim=1)[real], full[real], atol=1e-4, rtol=0)


def test_window_rope_matches_transformers_mistral():
    """rope on Mistral with a 4-key window == transformers' Mistral (its sliding-window cache) with the same
    weights: a full forward, and greedy generation past the window."""
    native, patched = windowed_mistral(None, layers=2), windowed_mistral("rope", layers=2)
    ids = make_ids(2, 10)
    with torch.no_grad():
        assert torch.equal(patched(ids, use_cache=False).logits, native(ids, use_cache=False).logits)
        kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
        want, got = native.generate(ids, **kw), patched.generate(ids, **kw)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.scores, want.scores):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_window_in_model_info_and_static_cache_refused():
    model = windowed_mistral("alibi", layers=2)
    assert model.model.posenc_info.sliding_windows == (WINDOW, WINDOW)
    gemma = make_model("gemma3_text", encoding="alibi")
    assert gemma.model.posenc_info.sliding_windows == (6, None)
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=16)  # every layer sliding, longer than the window
    with pytest.raises(ValueError, match="StaticCache whose sliding-window layers are shorter"):
        model(make_ids(1, 3), **with_cache(cache), use_cache=True)


# -- support declarations, refusals ------------------------------------------------------------------------


def test_support_follows_the_family_kinds():
    """An encoding supports every family of each kind it declares; BERT follows ViT (a bidirectional form)."""
    assert set(FAMILIES) == set(FAMILY_KINDS)
    for name in ENCODINGS:
        families = get_encoding(name).families
        assert set(DECODERS) <= set(families), name  # every encoding works on every causal decoder
        assert ("bert" in families) == ("vit" in families), name
    table = hf_posenc.support_matrix().splitlines()[0]
    assert all(f" {fam} " in table for fam in FAMILIES)


def test_unsupported_encoding_on_bert_lists_the_families():
    """An encoding registered for causal text only (xpos; here a test one) is refused on BERT, naming its families."""
    from dataclasses import dataclass

    from hf_posenc.encodings.alibi import Alibi
    from hf_posenc.registry import _REGISTRY, register_encoding

    @register_encoding("_causal_only_alibi", params=dataclass(type("P", (), {})), kind="score bias", summary="test",
                       paper="none", families=DECODERS)
    class CausalOnly(Alibi):
        pass

    try:
        allowed = ", ".join(get_encoding("_causal_only_alibi").families)
        with pytest.raises(ValueError, match=rf"encoding '_causal_only_alibi' does not support bert; it supports: {allowed}"):
            hf_posenc.patch_model(make_model("bert"), "_causal_only_alibi")
    finally:
        _REGISTRY.pop("_causal_only_alibi", None)


def test_refused_configurations():
    with pytest.raises(ValueError, match="soft-capping"):
        make_model("gemma3_text", encoding="alibi", config_overrides={"attn_logit_softcapping": 50.0})
    with pytest.raises(ValueError, match="as an encoder"):
        make_model("bert", encoding="alibi", config_overrides={"is_decoder": True})


@pytest.mark.parametrize("family", ("mistral", "gemma3_text", "phi3", "gpt_neox", "bert"))
def test_patched_layers_and_base_classes(family):
    model = make_model(family, encoding="alibi")
    info = hf_posenc.describe(model)
    assert info["family"] == family and len(info["layers"]) == 2
    base = make_model(family, "base", encoding="alibi")
    assert hf_posenc.describe(base)["layers"] == info["layers"]
    assert isinstance(make_model("mistral", "base"), MistralModel)


# -- PEFT --------------------------------------------------------------------------------------------------

LORA_TARGETS = {"phi3": ["qkv_proj"], "gpt_neox": ["query_key_value"], "bert": ["query", "value"],
                "gemma3_text": ["q_proj", "v_proj"]}


@pytest.mark.parametrize("family,encoding", [("phi3", "kerple"), ("gpt_neox", "t5"), ("bert", "fire"),
                                             ("gemma3_text", "fox")])
def test_lora_with_trainable_modules_reloads(tmp_path, family, encoding):
    """LoRA on the family's own projection names + the encoding in modules_to_save: the trained encoding copy
    gets gradients, and the saved adapter reproduces the model on a freshly patched base."""
    model = make_model(family, encoding=encoding, train=True)
    names = hf_posenc.trainable_modules(model)
    assert names == [f"{ {'gpt_neox': 'gpt_neox', 'bert': 'bert'}.get(family, 'model') }.posenc"]
    config = LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS[family], init_lora_weights=False,
                        modules_to_save=names)
    pm = get_peft_model(model, config)
    ids = make_ids()
    out = pm(input_ids=ids, labels=ids, **({} if family == "bert" else {"use_cache": False}))
    out.loss.backward()
    wrapper = hf_posenc.encoding_module(pm.get_base_model())
    assert all(p.grad is not None for p in wrapper.modules_to_save["default"].parameters())
    torch.optim.SGD([p for p in pm.parameters() if p.requires_grad], lr=0.1).step()
    pm.eval()
    with torch.no_grad():
        expected = pm(input_ids=ids).logits
    pm.save_pretrained(tmp_path / "adapter")
    base = make_model(family, encoding=encoding)
    with torch.no_grad():
        got = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()(input_ids=ids).logits
    assert torch.equal(got, expected)



# -- BERT: every encoding in its bidirectional form ------------------------------------------------------


@pytest.mark.parametrize("encoding", [e for e in ENCODINGS if "bert" in get_encoding(e).families])
def test_bert_is_bidirectional(encoding):
    """Every encoding BERT takes: the first token's output depends on a later token (no causal order), and the
    output is finite. The bidirectional 1D forms are in each encoding's docstring."""
    model = make_model("bert", "base", encoding=encoding)
    ids = make_ids(1, 10)
    later = ids.clone()
    later[0, 7] = (ids[0, 7] + 1 - 3) % 94 + 3
    with torch.no_grad():
        a, b = model(ids).last_hidden_state, model(later).last_hidden_state
    assert torch.isfinite(a).all()
    assert (a[0, 0] - b[0, 0]).abs().max() > 1e-4


def test_fire_and_cope_bidirectional_text_forms():
    """FIRE on BERT: f(psi(|i - j|) / psi(max(L, n - 1))), symmetric in i and j and varying with the distance
    (the causal form would give every later key distance 0). CoPE on BERT: a second table for keys after the
    query, which gets a gradient."""
    from hf_posenc.encodings.base import PosContext

    fire = hf_posenc.encoding_module(make_model("bert", encoding="fire"))
    ctx = PosContext(encoding=fire, info=fire.info, position_ids=torch.arange(6)[None])
    bias = fire.score_bias(ctx, 6, 6, torch.device("cpu"))[0]  # (H, L, L)
    assert torch.equal(bias, bias.transpose(-1, -2))
    assert not torch.allclose(bias[:, 0, 1], bias[:, 0, 4])
    model = make_model("bert", encoding="cope", train=True)
    ids = make_ids(2, 8)
    model(input_ids=ids, labels=ids).loss.backward()
    cope = hf_posenc.encoding_module(model)
    assert cope.pos_emb_after.grad is not None and cope.pos_emb_after.grad.abs().sum() > 0
