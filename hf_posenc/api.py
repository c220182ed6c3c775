"""The public functions: ``patch_model``, ``from_pretrained``, ``describe``, ``support_matrix``."""

from __future__ import annotations

import json
import logging
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from .attention import ATTN_IMPLEMENTATION, attention_backend, register_with_transformers
from .config import CONFIG_KEY, PosEncConfig
from .encodings.base import unwrap
from .patches import get_family
from .patches.base import unshare_config
from .registry import FAMILIES, get_encoding, list_encodings

logger = logging.getLogger(__name__)

__all__ = ["patch_model", "from_pretrained", "describe", "support_matrix", "encoding_module"]


def _check_model(model: Any) -> None:
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"patch_model expects a transformers PreTrainedModel, got {type(model).__name__}")


def patch_model(
    model: nn.Module, name: "str | Mapping[str, Any] | PosEncConfig | None" = None, **params: Any
) -> nn.Module:
    """Swap the position encoding of ``model`` in place and return it.

    Args:
        model: a Llama, GPT-2 or ViT model from transformers (base model or any head class).
        name: the encoding: a registered name, a dict ``{"name": ..., **params}`` or a ``PosEncConfig``.
            With None, ``model.config.position_encoding`` is read: the config key drives the swap.
        **params: the encoding's parameters (see ``hf_posenc.list_encodings()`` and the README).

    The validated config, every parameter with its default filled in, is written to
    ``model.config.position_encoding``. Patching a patched model again switches it to the new encoding.
    The model gets its own copy of its config, so other models built from the same config are untouched.
    """
    _check_model(model)
    family = get_family(getattr(model.config, "model_type", None))
    if name is None:
        name = getattr(model.config, CONFIG_KEY, None)
        if name is None:
            raise ValueError(
                f"no encoding given and model.config.{CONFIG_KEY} is not set; pass one of: {', '.join(list_encodings())}"
            )
        if params:
            raise ValueError("parameters were given without an encoding name; pass the name too")
    config = PosEncConfig.coerce(name, **params)
    spec = config.spec
    if family.family not in spec.families:
        raise ValueError(
            f"encoding {spec.name!r} does not support {family.family}; it supports: {', '.join(spec.families)}"
        )
    base = family.base_model(model)
    unshare_config(model)
    info = family.info(model.config)
    config = spec.cls.resolve(config, info)
    encoding = spec.cls(config, info)
    if not isinstance(getattr(base, "posenc", None), nn.Module):
        encoding.adopt_native(family.native_weights(base))
    reference = next((p for p in base.parameters() if p.is_floating_point()), None)
    if reference is not None:
        encoding.to(device=reference.device, dtype=reference.dtype)
    layers = family.install(base)
    base.posenc = encoding
    base.posenc_info = info
    base.posenc_layers = layers
    register_with_transformers()
    setattr(model.config, CONFIG_KEY, config.to_dict())
    model.config._attn_implementation = ATTN_IMPLEMENTATION
    if getattr(base, "_attn_implementation", None) is not None:
        base._attn_implementation = ATTN_IMPLEMENTATION
    return model


def _patched_base(model: nn.Module) -> nn.Module:
    _check_model(model)
    family = get_family(getattr(model.config, "model_type", None))
    base = family.base_model(model)
    if not isinstance(getattr(base, "posenc", None), nn.Module):
        raise ValueError(f"{type(model).__name__} is not patched by hf_posenc; call hf_posenc.patch_model first")
    return base


def encoding_module(model: nn.Module) -> nn.Module:
    """The encoding module of a patched model (``<base>.posenc``)."""
    return _patched_base(model).posenc


def describe(model: nn.Module) -> dict[str, Any]:
    """Which encoding a patched model runs, where, with which backend, and how many parameters it added.

    Returns a dict with keys ``encoding``, ``params``, ``kind``, ``family``, ``layers`` (names of the
    patched attention modules, relative to the base model), ``backend`` and ``parameters`` (the number of
    parameters the encoding holds).
    """
    base = _patched_base(model)
    enc = base.posenc
    inner = unwrap(enc)
    spec = get_encoding(inner.name)
    device = next((p.device for p in base.parameters()), torch.device("cpu"))
    return {
        "encoding": spec.name,
        "params": dict(inner.posenc_config.params),
        "kind": spec.kind,
        "family": base.posenc_info.family,
        "layers": list(base.posenc_layers),
        "backend": _backend_summary(inner, device),
        "parameters": sum(p.numel() for p in enc.parameters()),
    }


def _backend_summary(encoding: nn.Module, device: torch.device) -> str:
    """``torch`` when every op runs its PyTorch reference, else which ops run which kernel."""
    attention = attention_backend(encoding)
    if not getattr(encoding, "uses_rotary_kernel", False) or device.type != "cuda":
        return attention
    from .backend import forced_backend
    from .kernels.rotary import _triton_import_error

    if forced_backend() in ("torch", "flex") or _triton_import_error() is not None:
        return attention
    return f"{attention} (attention), triton (rotation)"


def support_matrix() -> str:
    """The README's support matrix, generated from the registry (markdown)."""
    header = "| encoding | kind | " + " | ".join(FAMILIES) + " | parameters | paper |"
    rule = "|" + "---|" * (len(FAMILIES) + 4)
    rows = [header, rule]
    for name in list_encodings():
        spec = get_encoding(name)
        marks = " | ".join("yes" if fam in spec.families else "no" for fam in FAMILIES)
        params = ", ".join(f"`{p}`" for p in spec.param_names()) or "none"
        rows.append(f"| `{name}` | {spec.kind} | {marks} | {params} | {spec.paper} |")
    return "\n".join(rows)


# -- loading ----------------------------------------------------------------------------------------


@contextmanager
def _quiet_transformers():
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise ValueError(f"{path} holds no model.safetensors: hf_posenc loads safetensors checkpoints only")


def _encoding_state(path: Path) -> dict[str, torch.Tensor]:
    """The tensors stored under ``posenc.`` in the checkpoint, keyed relative to the encoding module."""
    from safetensors import safe_open

    state: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                parts = key.split(".")
                if "posenc" in parts:
                    state[".".join(parts[parts.index("posenc") + 1 :])] = f.get_tensor(key)
    return state


def _model_class(config: Any, model_class: type | None) -> type:
    if model_class is not None:
        return model_class
    import transformers

    names = getattr(config, "architectures", None) or []
    if not names:
        raise ValueError("the checkpoint's config names no architecture; pass model_class")
    name = names[0].removeprefix("PosEnc")
    cls = getattr(transformers, name, None)
    if cls is None:
        raise ValueError(f"the checkpoint names architecture {names[0]!r}, which transformers does not have")
    return cls


def from_pretrained(path: str | os.PathLike, model_class: type | None = None, **kwargs: Any):
    """Load a checkpoint saved from a patched model: patched again, every weight restored.

    Args:
        path: a local directory written by ``save_pretrained`` of a patched model (safetensors).
        model_class: the transformers class to build (default: the one named in the config).
        **kwargs: passed to ``model_class.from_pretrained`` (``dtype``, ``device_map``, ...).
            With ``output_loading_info=True`` returns ``(model, info)``, where ``info`` lists the keys
            missing from or unexpected in the checkpoint once the encoding is restored (empty when all match).
    """
    from transformers import AutoConfig

    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{path} is not a directory saved by save_pretrained")
    want_info = bool(kwargs.pop("output_loading_info", False))
    config = AutoConfig.from_pretrained(path)
    stored = getattr(config, CONFIG_KEY, None)
    if stored is None:
        raise ValueError(
            f"{path}: the config has no {CONFIG_KEY!r}; it was not saved from a model patched by hf_posenc "
            "(load it with transformers, then call hf_posenc.patch_model)"
        )
    try:
        pe_config = PosEncConfig.from_dict(stored)
    except (ValueError, TypeError) as e:
        raise type(e)(f"{path}: the checkpoint's {CONFIG_KEY} cannot be used by this hf_posenc: {e}") from None
    family = get_family(getattr(config, "model_type", None))
    cls = _model_class(config, model_class)
    kwargs.setdefault("use_safetensors", True)
    with _quiet_transformers():
        model, info = cls.from_pretrained(path, config=config, output_loading_info=True, **kwargs)
    patch_model(model, pe_config)
    state = _encoding_state(path)
    module = encoding_module(model)
    missing, unexpected = module.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"{path}: the encoding weights do not match {pe_config.name!r}: missing {sorted(missing)}, "
            f"unexpected {sorted(unexpected)}"
        )
    expected_missing = family.native_keys
    rest_missing = [k for k in info["missing_keys"] if not any(k == n or k.endswith("." + n) for n in expected_missing)]
    mismatched = list(info.get("mismatched_keys", []))
    if rest_missing or mismatched:
        raise ValueError(
            f"{path}: the checkpoint does not match {cls.__name__}: missing {sorted(rest_missing)}, "
            f"mismatched {mismatched}"
        )
    # Weights the class does not use (a head, when loading the base model of a causal-LM checkpoint) are
    # left out, as transformers does.
    rest_unexpected = sorted(k for k in info["unexpected_keys"] if "posenc" not in k.split("."))
    if rest_unexpected:
        logger.info("%s: weights not used by %s: %s", path, cls.__name__, rest_unexpected)
    model.eval()
    if want_info:
        return model, {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "error_msgs": []}
    return model
