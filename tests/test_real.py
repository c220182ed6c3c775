"""The ``real`` tier: hf_posenc on a real pretrained checkpoint, SmolLM2-135M-Instruct (issue 34).

Every other test runs on tiny random models. These run on SmolLM2-135M-Instruct (a Llama: 30 layers, hidden
576, 9 query heads and 3 key/value heads of dimension 64, RoPE at base 1e5), built once into a cache directory
by :func:`hf_posenc.testing.smollm2` (see docs/real-checkpoint.md). Without network or without the package the
whole module skips with a one-line reason; it never fails for that reason.

Run with ``make test-real`` or ``pytest -m real tests/test_real.py``. One model is loaded per module and shared;
every test that patches or trains works on a deep copy. Sequences are short (batch 1, at most 32 tokens).
"""

from __future__ import annotations

import contextlib
import copy
import json

import pytest
import torch

import hf_posenc
from hf_posenc.testing import CheckpointUnavailable, check_smollm2_config, smollm2
from conftest import returned_cache, with_cache

pytestmark = pytest.mark.real

ENCODINGS = tuple(hf_posenc.list_encodings())
#: English text of our own, for the forwards and the training steps (tokenised to about 40 tokens; cut to 32).
TEXT = (
    "The river rises in the hills to the north and flows slowly through the town, where an old stone bridge "
    "carries the main road over it. In spring the water is high and brown with mud from the fields."
)
MAX_LEN = 32
#: The cache == full forward tolerance on the logits, in float32. SmolLM2's logits reach 20-35 here, and 30
#: layers of float32 rounding in a different order (the prefill and each decode step reduce over different
#: lengths) move them: measured (the generated text below, 8 steps) at most 2e-4 for most encodings, and 5.4e-3
#: at one step for fox, where the float32 full forward itself is 1.3e-2 from a float64 one and the float64
#: cache and full forwards agree to 1.4e-6 -- rounding, not the cache. 3e-2 is about 1e-3 of the logits' size;
#: a cache that gets a position or a past key wrong moves them by O(1).
CACHE_ATOL = 3e-2
#: The chat prompt whose greedy answer the unpatched model and the rope patch must give.
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def checkpoint(pytestconfig):
    """The checkpoint directory (built on first use, with its progress shown through pytest's capture)."""
    capture = pytestconfig.pluginmanager.getplugin("capturemanager")
    shown = capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext()
    with shown:
        try:
            return smollm2()
        except CheckpointUnavailable as e:
            pytest.skip(f"SmolLM2 checkpoint unavailable: {e}")


@pytest.fixture(scope="module")
def base(checkpoint):
    """The unpatched model, loaded once and shared (eval mode). Tests never change it: they deep-copy it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    check_smollm2_config(model.config)
    return model


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def ids(tokenizer) -> torch.Tensor:
    """(1, 32) token ids of :data:`TEXT`."""
    out = tokenizer(TEXT, return_tensors="pt")["input_ids"][:, :MAX_LEN]
    assert out.shape == (1, MAX_LEN)
    return out


@pytest.fixture(scope="module")
def base_logits(base, ids) -> torch.Tensor:
    with torch.no_grad():
        return base(ids, use_cache=False).logits


def patched(base, encoding, seed: int = 0, **params):
    """A deep copy of ``base`` patched with ``encoding`` (the encoding's own parameters drawn from ``seed``)."""
    model = copy.deepcopy(base)
    torch.manual_seed(seed)
    return hf_posenc.patch_model(model, encoding, **params).eval()


def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(ids, use_cache=False).logits


def chat_ids(tokenizer) -> torch.Tensor:
    out = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    return out["input_ids"]


# -- the checkpoint ------------------------------------------------------------------------------------------


def test_checkpoint_is_a_plain_llama(checkpoint, base, tokenizer):
    """The cached checkpoint is SmolLM2-135M's shape, with no quantization_config, and loads as a plain Llama."""
    config = json.loads((checkpoint / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"
    assert type(base).__name__ == "LlamaForCausalLM" and base.dtype == torch.float32
    assert sum(p.numel() for p in base.parameters()) == 134_515_008  # SmolLM2-135M, tied embeddings
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template


def test_rope_is_exactly_the_unpatched_model(base, tokenizer, ids, base_logits):
    """rope at the model's own base: bit-equal logits, and the same greedy chat answer (which is right)."""
    model = patched(base, "rope")
    assert model.config.model_type == "llama"  # nothing is added: it stays a plain Llama
    assert torch.equal(logits_of(model, ids), base_logits)
    prompt = chat_ids(tokenizer)
    kw = dict(max_new_tokens=10, do_sample=False)
    with torch.no_grad():
        want = base.generate(prompt, **kw)
        got = model.generate(prompt, **kw)
    assert torch.equal(got, want)
    answer = tokenizer.decode(want[0, prompt.shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer  # the converted checkpoint is the real, working model


# -- every encoding ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_every_encoding_trains_and_decodes(base, ids, encoding):
    """Each encoding patches the real model; a forward and backward give finite gradients reaching the
    encoding's parameters and the first layer; greedy decoding with the cache gives the full forward's logits."""
    model = patched(base, encoding)
    assert hf_posenc.describe(model)["encoding"] == encoding
    model.train()
    loss = model(ids, labels=ids, use_cache=False).loss
    assert torch.isfinite(loss), loss
    loss.backward()
    first = model.model.layers[0].self_attn.q_proj.weight.grad
    assert first is not None and torch.isfinite(first).all() and first.abs().sum() > 0
    own = list(hf_posenc.encoding_module(model).parameters())
    for p in own:
        assert p.grad is not None and torch.isfinite(p.grad).all()
    if own:
        assert sum(float(p.grad.abs().sum()) for p in own) > 0
    model.zero_grad(set_to_none=True)

    model.eval()
    prompt, new = ids[:, :12], 8
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
        full = model(out.sequences, use_cache=False).logits
    assert out.sequences.shape == (1, 12 + new)
    diffs = [float((step[0] - full[0, 11 + i]).abs().max()) for i, step in enumerate(out.logits)]
    assert max(diffs) < CACHE_ATOL, f"cache != full forward, max |diff| per step {diffs}"


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_every_encoding_saves_and_loads_through_auto(base, ids, encoding, tmp_path):
    """save_pretrained, then transformers' AutoModelForCausalLM loads it patched with the same logits (the
    encoding's parameters moved off their initial values first, so they must come from the checkpoint); rope
    at SmolLM2's own base saves as the plain Llama it is."""
    from transformers import AutoModelForCausalLM

    model = patched(base, encoding)
    with torch.no_grad():
        g = torch.Generator().manual_seed(3)
        for p in hf_posenc.encoding_module(model).parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    want = logits_of(model, ids)
    model.save_pretrained(tmp_path)
    del model
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == ("llama" if encoding == "rope" else "posenc_llama")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    if encoding == "rope":  # at the model's own base nothing is added: it saves and loads as a plain Llama
        assert "auto_map" not in config and type(loaded).__name__ == "LlamaForCausalLM"
    else:
        assert hf_posenc.describe(loaded)["encoding"] == encoding
    assert torch.equal(logits_of(loaded, ids), want)


# -- a plan over the 30 layers -------------------------------------------------------------------------------

PLAN = ["rope", "rope", "nope", "rope", "kerple"]  # repeated 6 times over the 30 layers


def test_plan_over_the_thirty_layers(base, ids, tmp_path):
    """rope, rope, nope, rope, kerple repeated over the 30 layers: one entry per layer is stored; the first two
    layers' hidden states are the unpatched model's (bit-equal), the third's differ; a backward reaches the
    kerple entry; the cache gives the full forward; it saves and loads back through the Auto class."""
    from transformers import AutoModelForCausalLM

    model = patched(base, PLAN)
    stored = model.config.position_encoding
    assert [e["name"] for e in stored] == PLAN * 6
    layers = hf_posenc.api.layer_encodings(model)
    assert [type(e).__name__ for e, _ in layers] == [type(e).__name__ for e, _ in layers[:5]] * 6
    with torch.no_grad():
        want = base(ids, output_hidden_states=True, use_cache=False).hidden_states
        got = model(ids, output_hidden_states=True, use_cache=False).hidden_states
    assert len(got) == 31
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    assert not torch.allclose(got[3], want[3])

    model.train()
    model(ids, labels=ids, use_cache=False).loss.backward()
    kerple = [p for p in hf_posenc.encoding_module(model).parameters()]
    assert kerple and all(p.grad is not None and p.grad.abs().sum() > 0 for p in kerple)
    model.zero_grad(set_to_none=True)

    model.eval()
    with torch.no_grad():
        out = model.generate(ids[:, :12], max_new_tokens=6, min_new_tokens=6, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
        full = model(out.sequences, use_cache=False).logits
    for i, step in enumerate(out.logits):
        assert float((step[0] - full[0, 11 + i]).abs().max()) < CACHE_ATOL, i

    want_logits = logits_of(model, ids)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.config.position_encoding == stored
    assert torch.equal(logits_of(loaded, ids), want_logits)


# -- RoPE scaling --------------------------------------------------------------------------------------------

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}


def test_rope_yarn_equals_native_rope_parameters(checkpoint, base, ids, base_logits):
    """rope with a YaRN ``scaling`` == SmolLM2 loaded by transformers with those rope_parameters in its config
    (and differs from the unscaled model: YaRN changes the frequencies and the attention scale at every
    position)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(checkpoint)
    config.rope_parameters = {"rope_theta": config.rope_parameters["rope_theta"], **YARN}
    native = AutoModelForCausalLM.from_pretrained(checkpoint, config=config).eval()
    want = logits_of(native, ids)
    del native
    model = patched(base, "rope", scaling=dict(YARN))
    got = logits_of(model, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert (got - base_logits).abs().max() > 1e-2


# -- PEFT ----------------------------------------------------------------------------------------------------


def test_lora_trains_and_reloads(base, ids, tmp_path):
    """LoRA on the real model patched with FIRE (its MLP trained beside the adapter, ``trainable_modules``):
    a few steps lower the loss; the saved adapter reloads onto a freshly patched base with the same logits,
    through PeftModel.from_pretrained and hf_posenc.load_adapter."""
    from peft import LoraConfig, PeftModel, get_peft_model

    model = patched(base, "fire")
    names = hf_posenc.trainable_modules(model)
    assert names == ["model.posenc"]
    pm = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                          modules_to_save=names))
    trainable = [p for p in pm.parameters() if p.requires_grad]
    assert 0 < sum(p.numel() for p in trainable) < 0.01 * sum(p.numel() for p in pm.parameters())
    opt = torch.optim.AdamW(trainable, lr=1e-3)
    pm.train()
    losses = []
    for _ in range(4):
        loss = pm(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    want = logits_of(pm, ids)
    pm.save_pretrained(tmp_path / "adapter")
    assert not (tmp_path / "adapter" / "model.safetensors").exists()  # an adapter, not the model
    size = sum(f.stat().st_size for f in (tmp_path / "adapter").iterdir())
    assert size < 20e6, size

    fresh = patched(base, "fire", seed=1)  # other encoding weights: the adapter carries the trained ones
    assert torch.equal(logits_of(PeftModel.from_pretrained(fresh, tmp_path / "adapter"), ids), want)
    fresh = patched(base, "fire", seed=2)
    assert torch.equal(logits_of(hf_posenc.load_adapter(fresh, tmp_path / "adapter"), ids), want)


#: Compositions with an inert start (hf_posenc.encodings.compose): exact ones to float32 rounding, FoX within its
#: stated bound (4.54e-5 per token of distance on each attention logit, over 30 layers). Measured on these 32
#: tokens (AMD EPYC, torch 2.13): t5, fire, shaw 0.0; cope 4.5e-5 (its own attention kernel); fox 3.4e-3.
INERT = {"rope+t5": 1e-4, "rope+fire": 1e-4, "rope+shaw": 1e-4, "rope+cope": 1e-3, "rope+fox": 2e-2}


@pytest.mark.parametrize("name", sorted(INERT))
def test_inert_start_gives_the_pretrained_logits(base, ids, base_logits, name):
    """``patch_model(model, "rope+X", init="identity")``: the model's own rotary kept, the term inert; step 0
    gives the unpatched logits (SmolLM2's logits reach 20-35; the exact terms differ only by rounding)."""
    model = patched(base, name, init="identity")
    diff = (logits_of(model, ids) - base_logits).abs().max().item()
    assert diff <= INERT[name], f"{name}: max |logit difference| {diff}"
    if name == "rope+fox":
        assert diff > 0  # the gates only approach 1


def test_composition_trains_and_decodes(base, ids):
    """rope+fox on the real model: a training step moves the term, and the cache equals the full forward."""
    model = patched(base, "rope+fox", init="identity").train()
    model(input_ids=ids, labels=ids).loss.backward()
    term = hf_posenc.encoding_module(model).term
    assert term.gate_weight.grad.abs().sum() > 0
    model.eval()
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :24], use_cache=True)
        past, pieces = returned_cache(out), [out.logits]
        for t in range(24, MAX_LEN):
            out = model(ids[:, t : t + 1], **with_cache(past), use_cache=True)
            past, pieces = returned_cache(out), pieces + [out.logits]
    assert (torch.cat(pieces, 1) - full).abs().max() < CACHE_ATOL
