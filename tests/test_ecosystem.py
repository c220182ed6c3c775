"""Training in the ecosystem: PEFT (LoRA + the encoding via trainable_modules), adapter checks, the Trainer,
accelerate, DDP over 2 CPU processes (gloo) and torch.compile."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from conftest import enable_checkpointing, make_ids, make_model, make_pixels, model_class

import hf_posenc
from hf_posenc.training import ADAPTER_MARKER

peft = pytest.importorskip("peft")
from peft import LoraConfig, PeftModel, get_peft_model

TESTS = Path(__file__).resolve().parent
LORA_TARGETS = {"llama": ["q_proj", "v_proj"], "gpt2": ["c_attn"], "vit": ["q_proj", "v_proj"]}


def inputs(family: str) -> dict[str, torch.Tensor]:
    return {"pixel_values": make_pixels()} if family == "vit" else {"input_ids": make_ids()}


def loss_of(family: str, model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    labels = torch.arange(2) % 3 if family == "vit" else batch["input_ids"]
    kw = {} if family == "vit" else {"use_cache": False}
    return model(**batch, labels=labels, **kw).loss


@torch.no_grad()
def logits(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    model.eval()
    return model(**batch).logits


def lora(model, family: str, **kw):
    config = LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS[family], init_lora_weights=False, **kw)
    return get_peft_model(model, config)


@torch.no_grad()
def shifted_encoding(model):
    """``model`` with every parameter of its encoding shifted by 0.25 (in place)."""
    for p in hf_posenc.encoding_module(model).parameters():
        p.add_(0.25)
    return model


@pytest.fixture
def fresh_accelerate():
    """accelerate keeps process-wide state (mixed precision, device): reset it around each test that uses it."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


# -- PEFT --------------------------------------------------------------------------------------------


def test_trainable_modules_names():
    assert hf_posenc.trainable_modules(make_model("llama", encoding="kerple")) == ["model.posenc"]
    assert hf_posenc.trainable_modules(make_model("llama", "base", encoding="kerple")) == ["posenc"]
    assert hf_posenc.trainable_modules(make_model("gpt2", encoding="t5")) == ["transformer.posenc"]
    assert hf_posenc.trainable_modules(make_model("vit", encoding="learned")) == ["vit.posenc"]
    # fope keeps fixed random coefficients as buffers: state an adapter must carry too
    assert hf_posenc.trainable_modules(make_model("llama", encoding="fope")) == ["model.posenc"]
    for name in ("alibi", "rope", "nope", "sinusoidal"):
        assert hf_posenc.trainable_modules(make_model("llama", encoding=name)) == []
    with pytest.raises(ValueError, match="not patched"):
        hf_posenc.trainable_modules(make_model("llama"))


@pytest.mark.parametrize(
    "family,encoding,params",
    [("llama", "kerple", {}), ("gpt2", "fire", {}), ("vit", "t5", {}), ("llama", "fox", {})],
    ids=["llama-kerple", "gpt2-fire", "vit-t5", "llama-fox"],
)
def test_lora_trains_encoding_and_reloads(tmp_path, family, encoding, params):
    model = make_model(family, encoding=encoding, train=True, **params)
    names = hf_posenc.trainable_modules(model)
    assert names
    pm = lora(model, family, modules_to_save=names)
    wrapper = hf_posenc.encoding_module(pm.get_base_model())
    copy, original = wrapper.modules_to_save["default"], wrapper.original_module
    original_before = {k: v.clone() for k, v in original.state_dict().items()}
    copy_before = {k: v.clone() for k, v in copy.state_dict().items()}
    pm.train()
    batch = inputs(family)
    loss_of(family, pm, batch).backward()
    # the model calls the wrapper, which routes to the trained copy: the copy gets gradients, the original none
    assert all(p.grad is None for p in original.parameters())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in copy.parameters())
    torch.optim.SGD([p for p in pm.parameters() if p.requires_grad], lr=0.1).step()
    assert all(not torch.equal(v, copy_before[k]) for k, v in copy.state_dict().items() if v.is_floating_point())
    assert all(torch.equal(v, original_before[k]) for k, v in original.state_dict().items())
    expected = logits(pm, batch)

    pm.save_pretrained(tmp_path / "adapter")
    marker = json.loads((tmp_path / "adapter" / ADAPTER_MARKER).read_text())
    assert marker["encoding_weights"] == "adapter" and marker["position_encoding"]["name"] == encoding
    # the recipe: patch the base first, then PeftModel.from_pretrained. The adapter carries the encoding, so
    # the base's own encoding weights do not matter: shift them.
    base = shifted_encoding(make_model(family, encoding=encoding, **params))
    assert torch.equal(logits(PeftModel.from_pretrained(base, tmp_path / "adapter"), batch), expected)
    # the same through hf_posenc.load_adapter, from a base checkpoint directory
    shifted_encoding(make_model(family, encoding=encoding, **params)).save_pretrained(tmp_path / "base")
    assert torch.equal(logits(hf_posenc.load_adapter(tmp_path / "base", tmp_path / "adapter"), batch), expected)
    # merged into a plain patched model: save_pretrained + hf_posenc.from_pretrained restore it
    merged = pm.merge_and_unload()
    assert not any(type(m).__module__.startswith("peft") for m in merged.modules())
    merged_logits = logits(merged, batch)
    torch.testing.assert_close(merged_logits, expected, atol=1e-5, rtol=1e-5)  # W + BA vs Wx + B(Ax): rounding
    merged.save_pretrained(tmp_path / "merged")
    assert torch.equal(logits(hf_posenc.from_pretrained(tmp_path / "merged"), batch), merged_logits)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_lora_gradient_checkpointing(reentrant):
    """The encoding copy's gradients are the same with gradient checkpointing (a bias shared between layers
    under PEFT broke both modes: a recomputation mismatch, or no gradient at all)."""

    def grads(checkpointing: bool) -> dict[str, torch.Tensor]:
        model = make_model("llama", encoding="kerple", train=True)
        pm = lora(model, "llama", modules_to_save=hf_posenc.trainable_modules(model))
        if checkpointing:
            enable_checkpointing(pm, {"use_reentrant": reentrant})
            pm.enable_input_require_grads()
        pm.train()
        loss_of("llama", pm, inputs("llama")).backward()
        return {n: p.grad for n, p in pm.named_parameters() if p.requires_grad}

    ref, got = grads(False), grads(True)
    assert any("posenc" in n for n in ref)
    for name, g in ref.items():
        assert got[name] is not None, name
        torch.testing.assert_close(got[name], g, atol=1e-6, rtol=1e-5, msg=name)


def _save_adapter(tmp_path: Path, encoding: str, modules_to_save: bool = True, **params) -> tuple[Path, torch.Tensor]:
    model = make_model("llama", encoding=encoding, train=True, **params)
    pm = lora(model, "llama", modules_to_save=hf_posenc.trainable_modules(model) if modules_to_save else None)
    path = tmp_path / f"adapter-{encoding}-{int(modules_to_save)}"
    pm.save_pretrained(path)
    return path, logits(pm, inputs("llama"))


def test_adapter_on_unpatched_base_is_detected(tmp_path):
    path, _ = _save_adapter(tmp_path, "kerple")
    # plain PeftModel.from_pretrained: the marker is checked before any weight is loaded
    with pytest.raises(ValueError, match="not patched"):
        PeftModel.from_pretrained(make_model("llama"), path)
    with pytest.raises(ValueError, match="not patched"):
        hf_posenc.load_adapter(make_model("llama"), path)
    # a base loaded with plain transformers from a patched checkpoint: config says patched, model is not
    make_model("llama", encoding="kerple").save_pretrained(tmp_path / "patched")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = model_class("llama").from_pretrained(tmp_path / "patched")
    with pytest.raises(ValueError, match="hf_posenc.from_pretrained"):
        PeftModel.from_pretrained(plain, path)
    # without the marker: the adapter's encoding weights find no module and are reported after loading
    bare = tmp_path / "no-marker"
    shutil.copytree(path, bare)
    (bare / ADAPTER_MARKER).unlink()
    with pytest.raises(ValueError, match="position-encoding weights"):
        PeftModel.from_pretrained(make_model("llama"), bare)
    with pytest.raises(ValueError, match=ADAPTER_MARKER):
        hf_posenc.load_adapter(make_model("llama", encoding="kerple"), bare)
    # an encoding without parameters: nothing in the weights, the marker alone tells
    path, expected = _save_adapter(tmp_path, "alibi")
    assert not json.loads((path / "adapter_config.json").read_text())["modules_to_save"]
    with pytest.raises(ValueError, match="not patched"):
        PeftModel.from_pretrained(make_model("llama"), path)
    assert torch.equal(logits(PeftModel.from_pretrained(make_model("llama", encoding="alibi"), path), inputs("llama")), expected)


def test_adapter_on_other_encoding_or_weights_is_detected(tmp_path):
    path, _ = _save_adapter(tmp_path, "kerple")
    with pytest.raises(ValueError, match="patched with"):
        PeftModel.from_pretrained(make_model("llama", encoding="alibi"), path)
    with pytest.raises(ValueError, match="patched with"):
        PeftModel.from_pretrained(make_model("llama", encoding="kerple", variant="power"), path)
    # the encoding left out of the adapter (no modules_to_save): the base's own encoding weights must match
    path, expected = _save_adapter(tmp_path, "fire", modules_to_save=False)
    assert json.loads((path / ADAPTER_MARKER).read_text())["encoding_weights"] == "base"
    with pytest.raises(ValueError, match="does not carry the encoding"):
        PeftModel.from_pretrained(shifted_encoding(make_model("llama", encoding="fire")), path)
    assert torch.equal(logits(PeftModel.from_pretrained(make_model("llama", encoding="fire"), path), inputs("llama")), expected)
    # an adapter trained on an unpatched model, loaded onto a patched one: a warning
    pm = lora(make_model("llama"), "llama")
    pm.save_pretrained(tmp_path / "native")
    assert not (tmp_path / "native" / ADAPTER_MARKER).exists()
    with pytest.warns(UserWarning, match="did not patch"):
        PeftModel.from_pretrained(make_model("llama", encoding="alibi"), tmp_path / "native")


def test_patching_under_peft_raises():
    model = make_model("llama", encoding="kerple")
    pm = lora(model, "llama", modules_to_save=hf_posenc.trainable_modules(model))
    with pytest.raises(TypeError, match="patch the base model first"):
        hf_posenc.patch_model(pm, "alibi")
    with pytest.raises(ValueError, match="already holds PEFT layers"):
        hf_posenc.patch_model(pm.get_base_model(), "alibi")
    with pytest.raises(ValueError, match="already holds PEFT layers"):  # LoRA injected into an unpatched model
        hf_posenc.patch_model(lora(make_model("llama"), "llama").get_base_model(), "alibi")
    merged = pm.merge_and_unload()  # merged: a plain patched model again, which can be re-patched
    hf_posenc.patch_model(merged, "alibi")
    assert hf_posenc.describe(merged)["encoding"] == "alibi"


# -- Trainer, accelerate --------------------------------------------------------------------------------


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 8, length: int = 12) -> None:
        self.ids = make_ids(n, length, seed=3)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def test_trainer_trains_and_checkpoint_reloads(tmp_path, fresh_accelerate):
    from transformers import Trainer, TrainingArguments

    model = make_model("llama", encoding="kerple", train=True)
    before = {k: v.clone() for k, v in hf_posenc.encoding_module(model).state_dict().items()}
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, learning_rate=1e-2, use_cpu=True,
        report_to="none", save_steps=3, logging_steps=1, remove_unused_columns=False, disable_tqdm=True,
        save_only_model=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=_Tokens())
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    after = hf_posenc.encoding_module(model).state_dict()
    assert all(not torch.equal(after[k], v) for k, v in before.items())
    reloaded = hf_posenc.from_pretrained(tmp_path / "checkpoint-3")
    assert reloaded.config.position_encoding == model.config.position_encoding
    assert torch.equal(logits(reloaded, inputs("llama")), logits(model, inputs("llama")))


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_accelerate_round_trip(tmp_path, fresh_accelerate, precision):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, mixed_precision=precision)
    model = make_model("llama", encoding="t5", train=True)
    before = {k: v.clone() for k, v in hf_posenc.encoding_module(model).state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(_Tokens(), batch_size=4)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    for batch in loader:
        loss = model(**batch, use_cache=False).loss
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
    assert torch.isfinite(loss)
    unwrapped = accelerator.unwrap_model(model, keep_fp32_wrapper=False)  # without bf16 autocast, to compare
    after = hf_posenc.encoding_module(unwrapped).state_dict()
    assert all(not torch.equal(after[k], v) for k, v in before.items())
    unwrapped.save_pretrained(tmp_path / "model")
    reloaded = hf_posenc.from_pretrained(tmp_path / "model")
    assert torch.equal(logits(reloaded, inputs("llama")), logits(unwrapped, inputs("llama")))
    # accelerator.save_model writes the weights only (no config.json): hf_posenc says how to save instead
    accelerator.save_model(model, tmp_path / "weights-only")
    assert not (tmp_path / "weights-only" / "config.json").exists()
    with pytest.raises(ValueError, match="unwrap_model"):
        hf_posenc.from_pretrained(tmp_path / "weights-only")


# -- DDP ------------------------------------------------------------------------------------------------


@pytest.mark.slow  # two processes
def test_ddp_two_cpu_processes_keep_encoding_in_sync(tmp_path):
    """Two gloo processes, one SGD step each on different batches and from different initial weights: the
    encoding's parameters come out bit-identical on both ranks and equal to one step on both batches."""
    import _ddp_worker as worker
    from safetensors.torch import load_file

    env = dict(os.environ, WORLD_SIZE="2", OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(TESTS.parent), os.environ.get("PYTHONPATH", "")]))
    if Path("/sys/class/net/lo").exists():
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = tmp_path / "store"
    # Each rank writes to its own log file, not a pipe: read one after the other, a full pipe of one rank
    # would block it while the other waits for it in a collective.
    logs = [tmp_path / f"rank{rank}.log" for rank in range(2)]
    procs = []
    for rank in range(2):
        with open(logs[rank], "w") as log:
            procs.append(subprocess.Popen(
                [sys.executable, str(TESTS / "_ddp_worker.py"), str(store), str(tmp_path)],
                env=dict(env, RANK=str(rank)), stdout=log, stderr=subprocess.STDOUT, text=True,
            ))
    try:
        for p in procs:
            p.wait(timeout=240)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    outs = [log.read_text() for log in logs]
    for rank, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {rank} failed:\n{out[-3000:]}"
    r0, r1 = (load_file(tmp_path / f"rank{r}.safetensors") for r in range(2))
    assert r0.keys() == r1.keys()
    for name, params in worker.ENCODINGS:
        assert not torch.equal(r0[f"{name}.loss"], r1[f"{name}.loss"])  # the ranks did see different data
        model = worker.build(name, params, seed=0)  # DDP broadcast rank 0's initial weights
        before = {k: v.clone() for k, v in hf_posenc.encoding_module(model).state_dict().items()}
        x = torch.cat([worker.batch(0), worker.batch(1)])
        model(input_ids=x, labels=x, use_cache=False).loss.backward()
        torch.optim.SGD(model.parameters(), lr=worker.LR).step()
        for key, value in hf_posenc.encoding_module(model).state_dict().items():
            assert torch.equal(r0[f"{name}.{key}"], r1[f"{name}.{key}"]), f"{name}.{key} differs across ranks"
            assert not torch.equal(r0[f"{name}.{key}"], before[key]), f"{name}.{key} did not train"
            torch.testing.assert_close(r0[f"{name}.{key}"], value, atol=1e-6, rtol=1e-5)


# -- torch.compile --------------------------------------------------------------------------------------


@pytest.mark.slow  # inductor; tests/test_compile.py's fast tier captures graphs with the "eager" backend
@pytest.mark.parametrize(
    "encoding", ["learned", "rope", "kerple", "fox"], ids=["absolute", "qk-transform", "score-bias", "data-dependent"]
)
def test_torch_compile_matches_eager(encoding):
    """One encoding of each kind, forward and backward. Backend ``aot_eager``: dynamo captures the graphs
    and AOTAutograd traces forward and backward (functionalised), run without code generation. Inductor
    gives the same result but compiles for about 2 minutes per model on a 2-core CPU; ``rope`` stands for the
    q/k transforms because the learned ones (liere, comrope) take 15-20 s here under aot_eager too."""
    torch._dynamo.reset()
    ids = make_ids()
    model = make_model("llama", encoding=encoding, train=True)
    eager = model(input_ids=ids, labels=ids, use_cache=False)
    eager.loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    compiled = torch.compile(model, backend="aot_eager")
    out = compiled(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    torch.testing.assert_close(out.logits, eager.logits, atol=1e-5, rtol=1e-5)
    assert any("posenc" in n for n in ref) == (encoding != "rope")  # the encoding's own gradients are compared too
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[name], atol=1e-5, rtol=1e-4, msg=name)
    torch._dynamo.reset()
