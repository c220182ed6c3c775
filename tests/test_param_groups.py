"""hf_posenc.param_groups: the encoding's parameters in their own optimizer group, with plain PyTorch, accelerate,
the Trainer and PEFT (issue 44).

Adam's first step moves every element of a parameter by lr * g / (|g| + eps), i.e. by its group's learning rate
wherever the gradient is not tiny: the tests check that each group moved by its own rate.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_ids, make_model

import hf_posenc
from hf_posenc.training import ENCODING_LR, ENCODING_LRS

LR, ENC_LR = 1e-4, 3e-2


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 4, length: int = 12) -> None:
        self.ids = make_ids(n, length, seed=3)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


@pytest.fixture
def fresh_accelerate():
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def _snapshot(params) -> list[torch.Tensor]:
    return [p.detach().clone() for p in params]


def _largest_move(params, before) -> float:
    return max(float((p.detach() - b).abs().max()) for p, b in zip(params, before))


def _check_moves(groups_before: dict[str, tuple[list, list]], rates: dict[str, float]) -> None:
    """Each group's largest element change after one Adam step is its own learning rate (to 1 %)."""
    for name, (params, before) in groups_before.items():
        moved = _largest_move(params, before)
        assert moved == pytest.approx(rates[name], rel=1e-2), (name, moved, rates[name])


def test_groups_split_the_parameters():
    model = make_model("llama", encoding="rope+fire", init="identity", train=True)
    groups = hf_posenc.param_groups(model, lr=LR, encoding_lr=ENC_LR)
    assert [g["name"] for g in groups] == ["model", "encoding"]
    assert [g["lr"] for g in groups] == [LR, ENC_LR]
    assert groups[1]["weight_decay"] == 0.0 and "weight_decay" not in groups[0]
    enc = {id(p) for p in hf_posenc.encoding_module(model).parameters()}
    assert {id(p) for p in groups[1]["params"]} == enc
    rest = {id(p) for p in groups[0]["params"]}
    assert not rest & enc and rest | enc == {id(p) for p in model.parameters()}
    # defaults: the larger of lr and ENCODING_LR (fire has no rate of its own); the model group's weight decay
    groups = hf_posenc.param_groups(model, lr=LR, weight_decay=0.1)
    assert "fire" not in ENCODING_LRS and groups[1]["lr"] == ENCODING_LR and groups[0]["weight_decay"] == 0.1
    assert hf_posenc.param_groups(model, lr=0.5)[1]["lr"] == 0.5
    # frozen parameters are in no group
    model.lm_head.weight.requires_grad_(False)
    assert all(p is not model.lm_head.weight for g in hf_posenc.param_groups(model, lr=LR) for p in g["params"])


def test_plan_and_no_parameters():
    model = make_model("llama", encoding=[{"name": "rope+fox", "init": "identity"}, "kerple"], train=True)
    enc = hf_posenc.encoding_module(model)
    fox, kerple = enc.entries[0].term, enc.entries[1]
    # the default rates: fox's own (measured) and the generic one for kerple
    groups = hf_posenc.param_groups(model, lr=LR)
    assert [(g["name"], g["lr"]) for g in groups] == [("model", LR), ("encoding:fox", ENCODING_LRS["fox"]),
                                                      ("encoding", ENCODING_LR)]
    assert {id(p) for p in groups[1]["params"]} == {id(p) for p in fox.parameters()}
    assert {id(p) for p in groups[2]["params"]} == {id(p) for p in kerple.parameters()}
    # one rate given: one encoding group
    groups = hf_posenc.param_groups(model, lr=LR, encoding_lr=ENC_LR)
    assert {id(p) for p in groups[1]["params"]} == {id(p) for p in enc.parameters()} and len(groups) == 2
    groups = hf_posenc.param_groups(make_model("llama", encoding="rope"), lr=LR)  # rope has no parameters
    assert [g["name"] for g in groups] == ["model"]
    # inside torch.compile's wrapper (not compiled until called)
    compiled = torch.compile(model)
    sizes = [len(g["params"]) for g in hf_posenc.param_groups(model, lr=LR)]
    assert [len(g["params"]) for g in hf_posenc.param_groups(compiled, lr=LR)] == sizes


def test_bad_arguments():
    model = make_model("llama", encoding="kerple")
    with pytest.raises(ValueError, match="not patched"):
        hf_posenc.param_groups(make_model("llama"), lr=LR)
    with pytest.raises(ValueError, match="encoding_lr must be a finite number > 0"):
        hf_posenc.param_groups(model, lr=LR, encoding_lr=0.0)
    with pytest.raises(ValueError, match="lr must be a finite number > 0"):
        hf_posenc.param_groups(model, lr=float("nan"))
    with pytest.raises(ValueError, match="weight_decay must be a finite number >= 0"):
        hf_posenc.param_groups(model, lr=LR, weight_decay=-1.0)
    with pytest.raises(TypeError, match="lr must be a number"):
        hf_posenc.param_groups(model, lr="1e-4")


def test_plain_pytorch_each_group_moves_at_its_rate():
    model = make_model("llama", encoding="rope+fire", init="identity", train=True)
    groups = hf_posenc.param_groups(model, lr=LR, encoding_lr=ENC_LR)
    before = {g["name"]: (g["params"], _snapshot(g["params"])) for g in groups}
    opt = torch.optim.AdamW(groups, weight_decay=0.0)
    ids = make_ids(2, 12)
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    opt.step()
    _check_moves(before, {"model": LR, "encoding": ENC_LR})


def test_accelerate(fresh_accelerate):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = make_model("llama", encoding="rope+fox", init="identity", train=True)
    groups = hf_posenc.param_groups(model, lr=LR, encoding_lr=ENC_LR)
    before = {g["name"]: (g["params"], _snapshot(g["params"])) for g in groups}
    opt = torch.optim.AdamW(groups, weight_decay=0.0)
    loader = torch.utils.data.DataLoader(_Tokens(), batch_size=2)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    assert [g["lr"] for g in opt.param_groups] == [LR, ENC_LR]
    batch = next(iter(loader))
    accelerator.backward(model(**batch, use_cache=False).loss)
    opt.step()
    _check_moves(before, {"model": LR, "encoding": ENC_LR})


@pytest.mark.parametrize("how", ["optimizers", "optimizer_cls_and_kwargs"])
def test_trainer(tmp_path, fresh_accelerate, how):
    from transformers import Trainer, TrainingArguments

    model = make_model("llama", encoding="rope+fire", init="identity", train=True)
    groups = hf_posenc.param_groups(model, lr=LR, encoding_lr=ENC_LR)
    before = {g["name"]: (g["params"], _snapshot(g["params"])) for g in groups}
    # constant schedule: the one step runs at the groups' own rates
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, use_cpu=True,
                             report_to="none", save_strategy="no", lr_scheduler_type="constant", disable_tqdm=True,
                             remove_unused_columns=False)
    if how == "optimizers":
        kw = {"optimizers": (torch.optim.AdamW(groups, weight_decay=0.0), None)}
    else:
        kw = {"optimizer_cls_and_kwargs": (torch.optim.AdamW, {"params": groups, "weight_decay": 0.0})}
    trainer = Trainer(model=model, args=args, train_dataset=_Tokens(), **kw)
    trainer.train()
    assert [g["lr"] for g in trainer.optimizer.param_groups] == [LR, ENC_LR]
    _check_moves(before, {"model": LR, "encoding": ENC_LR})


def test_peft_trains_the_encodings_copy():
    from peft import LoraConfig, get_peft_model

    model = make_model("llama", encoding="rope+fire", init="identity", train=True)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
                        modules_to_save=hf_posenc.trainable_modules(model))
    peft_model = get_peft_model(model, config)
    groups = hf_posenc.param_groups(peft_model, lr=LR, encoding_lr=ENC_LR)
    wrapper = hf_posenc.encoding_module(peft_model.get_base_model())
    copy = list(wrapper.modules_to_save["default"].parameters())
    original = list(wrapper.original_module.parameters())
    assert {id(p) for p in groups[1]["params"]} == {id(p) for p in copy}
    names = {id(p): n for n, p in peft_model.named_parameters()}
    assert groups[0]["params"] and all("lora_" in names[id(p)] for p in groups[0]["params"])
    before = {g["name"]: (g["params"], _snapshot(g["params"])) for g in groups}
    frozen = _snapshot(original)
    opt = torch.optim.AdamW(groups, weight_decay=0.0)
    ids = make_ids(2, 12)
    peft_model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    opt.step()
    _check_moves(before, {"model": LR, "encoding": ENC_LR})
    assert _largest_move(original, frozen) == 0.0
