"""Training in the Hugging Face ecosystem: PEFT adapters on patched models, and the checks that keep them honest.

The encoding of a patched model is one submodule, ``<base model>.posenc``, that the model always *calls*
(never reaches into), so PEFT's ``ModulesToSaveWrapper`` routes every call to the copy being trained:

```python
from peft import LoraConfig, PeftModel, get_peft_model
import hf_posenc

hf_posenc.patch_model(model, "kerple")                       # patch FIRST, then wrap with PEFT
peft_model = get_peft_model(model, LoraConfig(target_modules=["q_proj", "v_proj"],
                                              modules_to_save=hf_posenc.trainable_modules(model)))
...                                                          # train: LoRA and the encoding's parameters
peft_model.save_pretrained("adapter")                        # + hf_posenc_adapter.json (see below)

base = hf_posenc.from_pretrained("base")                     # or: base = ...; hf_posenc.patch_model(base, ...)
peft_model = PeftModel.from_pretrained(base, "adapter")      # identical logits
peft_model = hf_posenc.load_adapter(base, "adapter")         # the same, with every check made explicit
```

What catches an adapter loaded onto the wrong base (which PEFT itself loads silently, with wrong logits):

* Importing hf_posenc wraps ``peft.PeftModel.save_pretrained`` and ``peft.PeftModel.load_adapter`` (which
  ``PeftModel.from_pretrained`` calls). Saving an adapter of a patched model also writes
  ``hf_posenc_adapter.json`` beside ``adapter_config.json``: the encoding config, whether the adapter
  carries the encoding's weights, and a fingerprint of the base's encoding weights when it does not.
  Loading then raises ``ValueError`` before any weight is loaded when the base is not patched, is patched
  with another encoding or other parameters, or (same dtype) holds other encoding weights than the adapter
  was trained with; and, whether or not the marker is there, after loading when the adapter holds
  encoding weights (``...posenc...`` keys) that the base has no module for.
* Not caught: a process that never imports hf_posenc (nothing of hf_posenc runs there); an adapter on
  the Hub (the marker is read from local directories only; the key check still runs); adapters loaded
  through transformers' own PEFT integration (``model.load_adapter``, ``AutoModelForCausalLM.from_pretrained``
  on an adapter directory), which bypasses ``PeftModel``. An adapter without the marker loaded onto a
  patched base (trained on an unpatched model, or saved another way) gets a warning, not an error: it is
  right when the patch reproduces the native encoding (``rope`` on Llama).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import logging
import math
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .config import CONFIG_KEY
from .encodings.base import unwrap
from .patches import get_family

logger = logging.getLogger(__name__)

__all__ = ["ADAPTER_MARKER", "ENCODING_LR", "ENCODING_LRS", "check_adapter", "encoding_parameters", "load_adapter",
           "param_groups", "trainable_modules"]

#: The file written beside ``adapter_config.json`` when an adapter of a patched model is saved.
ADAPTER_MARKER = "hf_posenc_adapter.json"
_MARKER_FORMAT = 1


# -- locating the encoding -------------------------------------------------------------------------


def _transformers_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a PEFT model (``get_base_model()``), else ``model`` itself."""
    if type(model).__module__.split(".")[0] == "peft" and hasattr(model, "get_base_model"):
        return model.get_base_model()
    return model


def _encoding_slot(model: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """(base model, module at ``<base>.posenc``: the encoding or its PEFT wrapper), or None if unpatched."""
    model = _transformers_model(model)
    config = getattr(model, "config", None)
    try:
        family = get_family(getattr(config, "model_type", None))
        base = family.base_model(model)
    except ValueError:
        return None
    enc = getattr(base, "posenc", None)
    return (base, enc) if isinstance(enc, nn.Module) else None


def _has_state(encoding: nn.Module) -> bool:
    """Whether the encoding holds parameters or persistent buffers (state that a checkpoint must carry)."""
    return len(unwrap(encoding).state_dict()) > 0


def trainable_modules(model: nn.Module) -> list[str]:
    """The module names to pass as PEFT ``modules_to_save`` so that the encoding trains alongside LoRA.

    Args:
        model: a patched model (call it before ``get_peft_model``, on the model you pass to it); a
            ``PeftModel`` is accepted too (its base model is used).

    Returns:
        ``["<base attr>.posenc"]`` (e.g. ``["model.posenc"]`` on ``LlamaForCausalLM``, ``["posenc"]`` on a
        bare ``LlamaModel``) when the encoding holds parameters or persistent buffers, ``[]`` when it holds
        none (``alibi``, ``rope``, ...). With the name in ``modules_to_save`` PEFT trains a copy of the
        encoding and stores it in the adapter, so the adapter reproduces the model on any base patched
        with the same encoding, whatever that base's own encoding weights are.

    Raises:
        ValueError: the model is not patched by hf_posenc.
    """
    model = _transformers_model(model)
    slot = _encoding_slot(model)
    if slot is None:
        raise ValueError(
            f"{type(model).__name__} is not patched by hf_posenc; call hf_posenc.patch_model before get_peft_model"
        )
    _, enc = slot
    if not _has_state(enc):
        return []
    for name, module in model.named_modules():
        if module is enc:
            return [name]
    raise ValueError("the encoding module is not reachable from the model")  # unreachable for a patched model


# -- the encoding's own learning rate ---------------------------------------------------------------

#: The default learning rate of an encoding's parameters in ``param_groups`` (an absolute rate, not a multiple
#: of the model's: Adam moves a parameter by about its learning rate per step whatever the gradient's scale, and a
#: term started inert has a fixed distance to travel). Measured on SmolLM2-135M-Instruct for FIRE (the best held-out
#: perplexity after the fine-tune): docs/compositions.md, ``benchmarks/encoding_lr.py``.
ENCODING_LR = 1e-2
#: Encodings whose parameters need another default rate, measured the same way. FoX's inert gates sit at σ(10): the
#: bias is a log-scale decay rate (-log f ≈ exp(-b)), so a gate that forgets must travel several units, and at 1e-2
#: the term moved the logits by 0.14 where at 3e-2 it moved them by 1.6 with the best held-out perplexity.
ENCODING_LRS: dict[str, float] = {"fox": 3e-2}
def _unwrapped(model: nn.Module) -> nn.Module:
    """The model inside DDP/DataParallel (``.module``) and ``torch.compile`` (``._orig_mod``) wrappers."""
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        else:
            return model


def encoding_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The trainable parameters of a patched model's encoding (those with ``requires_grad``).

    Args:
        model: a patched model; also a ``PeftModel`` (the encoding's trained copy, when
            ``modules_to_save=hf_posenc.trainable_modules(model)`` put one there: the frozen original is not
            trainable), or a model inside DDP, ``DataParallel`` or ``torch.compile``.

    Returns:
        The parameters of the module at ``<base model>.posenc`` (the encoding, every part of a composition,
        every entry of a plan, and the layer options' own parameters) that require a gradient; ``[]`` when the
        encoding has none (``rope``, ``alibi``, ...).

    Raises:
        ValueError: the model is not patched by hf_posenc.
    """
    inner = _unwrapped(model)
    slot = _encoding_slot(inner)
    if slot is None:
        raise ValueError(f"{type(inner).__name__} is not patched by hf_posenc: it has no encoding parameters; "
                         "call hf_posenc.patch_model first")
    return [p for p in slot[1].parameters() if p.requires_grad]


def _default_rates(slot: nn.Module) -> dict[int, tuple[str, float]]:
    """Parameter id -> (encoding name, default rate): each parameter takes the rate of the innermost encoding that
    holds it (``ENCODING_LRS``, else ``ENCODING_LR``; a composition's or a plan's own parameters, such as
    the layer options', the generic one)."""
    from .encodings.base import PositionEncoding

    rates: dict[int, tuple[str, float]] = {}
    for module in slot.modules():  # parents before children: the innermost encoding's rate wins
        if isinstance(module, PositionEncoding):
            for p in module.parameters():
                rates[id(p)] = (module.name, ENCODING_LRS.get(module.name, ENCODING_LR))
    return rates


def param_groups(
    model: nn.Module,
    lr: float,
    encoding_lr: float | None = None,
    *,
    weight_decay: float | None = None,
    encoding_weight_decay: float = 0.0,
) -> list[dict[str, Any]]:
    """Optimizer parameter groups with the encoding's parameters apart, at their own learning rate.

    A term started inert (``init="identity"``) sits at zero (FIRE's last layer, a T5 table) or on a flat
    sigmoid (FoX's gates at σ(10)); Adam moves a parameter by about its learning rate per step, so at a
    pretrained model's fine-tuning rate (1e-4) the term stays where it started. Give it its own rate:

    ```python
    opt = torch.optim.AdamW(hf_posenc.param_groups(model, lr=1e-4), betas=(0.9, 0.95))
    ```

    Every optimizer that takes parameter groups takes them (a scheduler scales each group's rate by the same
    factor); with accelerate, build the optimizer from them before ``accelerator.prepare``; with the ``Trainer``,
    ``optimizers=(torch.optim.AdamW(groups), None)`` or
    ``optimizer_cls_and_kwargs=(torch.optim.AdamW, {"params": groups})``; with PEFT, call it on the
    ``PeftModel`` (the encoding's group is its trained copy, from
    ``modules_to_save=hf_posenc.trainable_modules(model)``; LoRA's parameters are in the model group). See
    docs/training.md.

    Args:
        model: a patched model (or a ``PeftModel`` of one, or one inside DDP, ``DataParallel`` or
            ``torch.compile``).
        lr: the learning rate of every other trainable parameter.
        encoding_lr: one rate for all the encoding's parameters. Default: per encoding, the larger of ``lr`` and
            its measured default (``ENCODING_LRS``: ``fox`` 3e-2; every other ``ENCODING_LR``, 1e-2;
            measured on SmolLM2-135M, docs/compositions.md).
        weight_decay: the other parameters' weight decay; None leaves it to the optimizer's default.
        encoding_weight_decay: the encoding's weight decay (default 0: decay would pull an inert FoX gate bias
            towards 0, i.e. towards forgetting half of each step, and a learned table towards no position).

    Returns:
        ``[{"name": "model", "params": [...], "lr": lr, ...}, {"name": "encoding", "params": [...],
        "lr": encoding_lr, "weight_decay": encoding_weight_decay}]``: only parameters that require a gradient,
        each in one group; a group with no parameters is left out (an encoding without parameters gives the model
        group alone). With the default rates, an encoding whose rate differs from the others (``fox`` in
        ``rope+fox``, or in a plan beside ``fire``) gets a group of its own, ``"name": "encoding:fox"``.

    Raises:
        ValueError: the model is not patched, or a rate or decay is not a finite number >= 0 (rates > 0).
        TypeError: a rate or decay is not a number.
    """
    for name, value, positive in (("lr", lr, True), ("encoding_lr", encoding_lr, True),
                                  ("weight_decay", weight_decay, False),
                                  ("encoding_weight_decay", encoding_weight_decay, False)):
        if value is None and name in ("encoding_lr", "weight_decay"):
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"param_groups: {name} must be a number, got {value!r}")
        if not math.isfinite(value) or not (value > 0 if positive else value >= 0):
            raise ValueError(f"param_groups: {name} must be a finite number {'> 0' if positive else '>= 0'}, "
                             f"got {value!r}")
    encoding = encoding_parameters(model)
    ids = {id(p) for p in encoding}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in ids]
    groups: list[dict[str, Any]] = []
    if rest:
        group: dict[str, Any] = {"name": "model", "params": rest, "lr": float(lr)}
        if weight_decay is not None:
            group["weight_decay"] = float(weight_decay)
        groups.append(group)
    if encoding:
        if encoding_lr is not None:
            by_label = {"encoding": (float(encoding_lr), encoding)}
        else:
            defaults = _default_rates(_encoding_slot(_unwrapped(model))[1])
            by_label = {}
            for p in encoding:
                owner, rate = defaults.get(id(p), ("", ENCODING_LR))
                label = f"encoding:{owner}" if owner in ENCODING_LRS else "encoding"
                by_label.setdefault(label, (max(float(lr), rate), []))[1].append(p)
        for label, (rate, params) in by_label.items():
            groups.append({"name": label, "params": params, "lr": rate,
                           "weight_decay": float(encoding_weight_decay)})
    if not groups:
        raise ValueError(f"{type(_unwrapped(model)).__name__} has no parameter that requires a gradient")
    return groups


# -- the adapter marker ----------------------------------------------------------------------------


def _encoding_names(stored: Any) -> str:
    """The encoding name of a stored ``position_encoding`` (a dict), or the plan's names (a list of dicts)."""
    if isinstance(stored, list):
        return "plan [" + ", ".join(str(e.get("name")) if isinstance(e, dict) else repr(e) for e in stored) + "]"
    return repr(stored.get("name")) if isinstance(stored, dict) else repr(stored)


def _normalise(value: Any) -> Any:
    """JSON round trip, so that tuples and lists (and int/float keys) compare equal."""
    return json.loads(json.dumps(value, sort_keys=True))


def _fingerprint(module: nn.Module) -> dict[str, Any]:
    """sha256 over the module's state (names, dtypes, shapes and bytes), and the dtypes it was taken in."""
    h = hashlib.sha256()
    dtypes = set()
    for name, tensor in sorted(module.state_dict().items()):
        t = tensor.detach().to("cpu").contiguous()
        dtypes.add(str(t.dtype).removeprefix("torch."))
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return {"sha256": h.hexdigest(), "dtypes": sorted(dtypes)}


def _carries_encoding(enc: nn.Module, adapter_name: str) -> bool:
    """Whether ``enc`` is a PEFT ModulesToSaveWrapper with a trained copy for ``adapter_name``."""
    copies = getattr(enc, "modules_to_save", None)
    return hasattr(enc, "original_module") and isinstance(copies, nn.ModuleDict) and adapter_name in copies


def _marker(peft_model: nn.Module, adapter_name: str) -> dict[str, Any] | None:
    """The marker contents for one adapter of ``peft_model``, or None when its base is not patched."""
    slot = _encoding_slot(peft_model)
    if slot is None:
        return None
    base, enc = slot
    inner = unwrap(enc)
    carries = _carries_encoding(enc, adapter_name)
    if carries:
        state = "adapter"
    elif _has_state(inner):
        state = "base"
    else:
        state = "none"
    marker = {
        "format": _MARKER_FORMAT,
        "model_type": base.config.model_type,
        CONFIG_KEY: _normalise(getattr(base.config, CONFIG_KEY, None) or inner.posenc_config.to_dict()),
        "encoding_weights": state,
    }
    if state == "base":
        marker["base_encoding_fingerprint"] = _fingerprint(inner)
    return marker


def _write_markers(peft_model: nn.Module, save_directory: str | os.PathLike, selected: Any) -> None:
    names = list(getattr(peft_model, "peft_config", {}) or {})
    if selected is not None:
        names = [n for n in names if n in selected]
    for name in names:
        marker = _marker(peft_model, name)
        # PEFT writes the default adapter to save_directory, every other one to save_directory/<name>.
        out = Path(save_directory) if name == "default" else Path(save_directory) / name
        if marker is None:
            (out / ADAPTER_MARKER).unlink(missing_ok=True)  # a stale marker must not outlive a re-save
            continue
        if out.is_dir():
            (out / ADAPTER_MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")


def _read_marker(adapter_dir: Path) -> dict[str, Any] | None:
    file = adapter_dir / ADAPTER_MARKER
    if not file.is_file():
        return None
    try:
        marker = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(marker, dict) or marker.get("format") != _MARKER_FORMAT:
        raise ValueError(f"{file}: unknown format {marker.get('format') if isinstance(marker, dict) else marker!r}")
    return marker


# -- the checks ------------------------------------------------------------------------------------


def check_adapter(model: nn.Module, adapter_dir: str | os.PathLike) -> None:
    """Raise ``ValueError`` when the adapter saved in ``adapter_dir`` would not reproduce its model on ``model``.

    Args:
        model: the base model the adapter is about to be loaded onto (a transformers model or a ``PeftModel``).
        adapter_dir: a local directory written by ``PeftModel.save_pretrained``.

    Reads ``hf_posenc_adapter.json`` (see the module docstring). Raises when the adapter was trained on a
    patched model and ``model`` is not patched, is patched with another encoding or other parameters, or
    (when the adapter does not carry the encoding's weights) holds other encoding weights than the base it
    was trained on. Without the marker: warns when ``model`` is patched (the adapter was trained on an
    unpatched model, or saved without hf_posenc); nothing to check when it is not.
    """
    adapter_dir = Path(adapter_dir)
    marker = _read_marker(adapter_dir)
    slot = _encoding_slot(model)
    target = type(_transformers_model(model)).__name__
    if marker is None:
        if slot is not None:
            warnings.warn(
                f"{adapter_dir} has no {ADAPTER_MARKER}: it was saved from a model that hf_posenc did not patch "
                f"(or without hf_posenc), and is loaded onto {target} patched with "
                f"{getattr(slot[0].config, CONFIG_KEY, None)}; its weights were trained with another position "
                "encoding unless the patch reproduces the native one",
                stacklevel=3,
            )
        return
    wanted = marker.get(CONFIG_KEY)
    if slot is None:
        stored = getattr(getattr(_transformers_model(model), "config", None), CONFIG_KEY, None)
        hint = (
            "its config has position_encoding but the model is not patched: it was loaded with plain transformers, "
            "which drops the encoding; load it with hf_posenc.from_pretrained(path)"
            if stored is not None
            else f"patch it first: hf_posenc.patch_model(base, {wanted!r}) (or load a patched checkpoint with "
            "hf_posenc.from_pretrained)"
        )
        raise ValueError(
            f"the adapter in {adapter_dir} was trained on a {marker.get('model_type')} model patched by hf_posenc "
            f"with {wanted}, but the base model ({target}) is not patched: PEFT would load it silently with "
            f"wrong logits. {hint}, then load the adapter."
        )
    base, enc = slot
    have = _normalise(getattr(base.config, CONFIG_KEY, None) or unwrap(enc).posenc_config.to_dict())
    if have != wanted:
        raise ValueError(
            f"the adapter in {adapter_dir} was trained with position encoding {wanted}, but the base model "
            f"({target}) is patched with {have}: re-patch it with hf_posenc.patch_model(base, {wanted!r}) first"
        )
    expected = marker.get("base_encoding_fingerprint")
    if marker.get("encoding_weights") == "base" and expected is not None:
        got = _fingerprint(unwrap(enc))
        if got["sha256"] == expected.get("sha256"):
            return
        if got["dtypes"] != expected.get("dtypes"):
            warnings.warn(
                f"cannot check the base model's encoding weights against the adapter in {adapter_dir}: they are "
                f"{got['dtypes']}, the base it was trained on had {expected.get('dtypes')}. The adapter does not "
                "carry the encoding's weights, so it reproduces its model only if they are the same up to the cast",
                stacklevel=3,
            )
            return
        raise ValueError(
            f"the adapter in {adapter_dir} does not carry the encoding's weights (it was trained without "
            f"modules_to_save=hf_posenc.trainable_modules(model)), and the base model's {_encoding_names(wanted)} "
            "weights differ from those of the model it was trained on: load that base model (saved with "
            "save_pretrained, restored with hf_posenc.from_pretrained), or train with trainable_modules so that "
            "the adapter stores the encoding"
        )


def _check_loaded_keys(model: nn.Module, adapter: str, load_result: Any) -> None:
    """After PEFT loaded an adapter: encoding weights in it that the base had no module for were dropped."""
    unexpected = list(getattr(load_result, "unexpected_keys", None) or [])
    lost = [k for k in unexpected if "posenc" in k.split(".")]
    if lost:
        raise ValueError(
            f"the adapter {adapter} holds position-encoding weights ({lost[:3]}{' ...' if len(lost) > 3 else ''}) "
            f"that the base model ({type(_transformers_model(model)).__name__}) has no hf_posenc encoding for: "
            "it was trained on a model patched by hf_posenc. Patch the base first (hf_posenc.patch_model with the "
            "same encoding, or hf_posenc.from_pretrained for a patched checkpoint), then load the adapter."
        )


def load_adapter(
    base: nn.Module | str | os.PathLike, adapter_dir: str | os.PathLike, adapter_name: str = "default", **kwargs: Any
):
    """Load a PEFT adapter saved from a patched model onto ``base``, checking that ``base`` runs its encoding.

    Args:
        base: the base model (patched, e.g. by ``hf_posenc.from_pretrained`` or ``patch_model``), or the
            directory of a patched checkpoint (loaded with ``hf_posenc.from_pretrained``).
        adapter_dir: a local directory written by ``PeftModel.save_pretrained`` from a patched model.
        adapter_name: the name of the adapter in the returned model.
        **kwargs: passed to ``peft.PeftModel.from_pretrained`` (``is_trainable``, ...).

    Returns:
        The ``PeftModel``; its logits equal those of the model the adapter was saved from.

    Raises:
        ValueError: ``adapter_dir`` holds no adapter, or no ``hf_posenc_adapter.json`` (it was not saved
            from a patched model: load it with ``PeftModel.from_pretrained``), or the checks of
            `check_adapter` fail.
    """
    from peft import PeftModel

    from .api import from_pretrained

    if isinstance(base, (str, os.PathLike)):
        base = from_pretrained(base)
    adapter_dir = Path(adapter_dir)
    if not (adapter_dir / "adapter_config.json").is_file():
        raise ValueError(f"{adapter_dir} holds no adapter_config.json: not a directory saved by PeftModel.save_pretrained")
    if not (adapter_dir / ADAPTER_MARKER).is_file():
        raise ValueError(
            f"{adapter_dir} holds no {ADAPTER_MARKER}: it was not saved from a model patched by hf_posenc; load "
            "it with peft.PeftModel.from_pretrained onto the model it was trained on"
        )
    check_adapter(base, adapter_dir)
    return PeftModel.from_pretrained(base, str(adapter_dir), adapter_name=adapter_name, **kwargs)


# -- the PEFT hooks --------------------------------------------------------------------------------


def _local_adapter_dir(model_id: Any, subfolder: Any) -> Path | None:
    try:
        path = Path(model_id)
    except TypeError:
        return None
    if subfolder:
        path = path / str(subfolder)
    return path if path.is_dir() else None


def install_peft_hooks() -> bool:
    """Wrap ``peft.PeftModel.save_pretrained`` (writes the marker) and ``.load_adapter`` (runs the checks).

    Called when hf_posenc is imported; idempotent. Returns False when PEFT cannot be imported. The
    wrappers call PEFT's own methods with the same arguments and act only on adapters of patched models
    or adapters loaded onto a patched base (or carrying encoding weights).
    """
    try:
        from peft import PeftModel
    except Exception as e:  # noqa: BLE001  (a missing or broken PEFT must not break ``import hf_posenc``)
        logger.debug("PEFT hooks not installed: %s", e)
        return False
    if getattr(PeftModel.load_adapter, "_hf_posenc_hook", False):
        return True
    orig_save = PeftModel.save_pretrained
    orig_load = PeftModel.load_adapter
    save_sig = inspect.signature(orig_save)
    load_sig = inspect.signature(orig_load)

    @functools.wraps(orig_save)
    def save_pretrained(self, *args: Any, **kwargs: Any):
        result = orig_save(self, *args, **kwargs)
        try:
            bound = save_sig.bind(self, *args, **kwargs).arguments
        except TypeError:
            return result
        if bound.get("is_main_process", True) and bound.get("save_directory") is not None:
            _write_markers(self, bound["save_directory"], bound.get("selected_adapters"))
        return result

    @functools.wraps(orig_load)
    def load_adapter(self, *args: Any, **kwargs: Any):
        try:
            bound = load_sig.bind(self, *args, **kwargs).arguments
        except TypeError:
            bound = {}
        model_id = bound.get("model_id")
        extra = bound.get("kwargs") or {}
        adapter_dir = _local_adapter_dir(model_id, extra.get("subfolder"))
        if adapter_dir is not None:
            check_adapter(self, adapter_dir)
        result = orig_load(self, *args, **kwargs)
        _check_loaded_keys(self, str(model_id), result)
        return result

    save_pretrained._hf_posenc_hook = True
    load_adapter._hf_posenc_hook = True
    PeftModel.save_pretrained = save_pretrained
    PeftModel.load_adapter = load_adapter
    return True
