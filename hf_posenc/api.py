"""The public functions: ``patch_model``, ``from_pretrained``, ``describe``, ``support_matrix``."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from .auto_config import check_config_class, mark_config
from .backend import forced_backend
from .attention import ATTN_IMPLEMENTATION, attention_backend, register_with_transformers
from .config import CONFIG_KEY, PosEncConfig, coerce_plan, is_plan
from .encodings.base import ModelInfo, unwrap
from .encodings.plan import PlanEncoding, entry_layers, layer_info, plan_groups
from .patches import get_family
from .patches.base import tap_mlp_outputs, unshare_config
from .patches.generation import install_static_cache_shape
from .registry import FAMILIES, get_encoding, list_encodings

logger = logging.getLogger(__name__)

__all__ = ["patch_model", "from_pretrained", "describe", "support_matrix", "encoding_module", "layer_encodings"]


def _check_not_peft(model: Any) -> None:
    """Patching under PEFT would replace modules PEFT wraps or tracks: the adapter would silently lose the
    encoding (or its trained copy). Patch the base model first, then wrap it."""
    fix = (
        "patch the base model first, then wrap it with PEFT: hf_posenc.patch_model(model, ...); "
        "get_peft_model(model, LoraConfig(..., modules_to_save=hf_posenc.trainable_modules(model))) "
        "(or PeftModel.from_pretrained(model, adapter_dir) onto the patched model)"
    )
    if type(model).__module__.split(".")[0] == "peft":
        raise TypeError(f"patch_model got a PEFT model ({type(model).__name__}); {fix}")
    for name, module in model.named_modules():
        if type(module).__module__.split(".")[0] == "peft":
            raise ValueError(
                f"patch_model got a model that already holds PEFT layers ({name}: {type(module).__name__}); {fix}. "
                "To re-patch a fine-tuned model, merge first (peft_model.merge_and_unload())."
            )


def _check_model(model: Any) -> None:
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"patch_model expects a transformers PreTrainedModel, got {type(model).__name__}")


def patch_model(
    model: nn.Module, name: "str | Mapping[str, Any] | PosEncConfig | list | None" = None, **params: Any
) -> nn.Module:
    """Swap the position encoding of ``model`` in place and return it.

    Args:
        model: a transformers model of a supported family (``hf_posenc.registry.FAMILIES``; base model or any
            head class).
        name: the encoding: a registered name, a dict ``{"name": ..., **params}`` or a ``PosEncConfig``; or a
            plan, a list of those, one per layer, repeated over the depth (its length must divide the number
            of layers): ``["rope", "rope", "rope", "nope"]`` (see `hf_posenc.encodings.plan`).
            With None, ``model.config.position_encoding`` is read: the config key drives the swap.
        **params: the encoding's parameters (see ``hf_posenc.list_encodings()`` and the README); with a plan,
            give them per entry instead. Every encoding also takes ``window`` (a sliding window: each query
            sees its last ``window`` keys, itself included).

    The validated config, every parameter with its default filled in, is written to
    ``model.config.position_encoding``: a dict for one encoding, a list of one dict per layer for a plan (a
    plan whose entries are all the same is the plain encoding, stored as a dict). Encodings that act on the
    embeddings (``sinusoidal``, ``learned``) act once per model and cannot be mixed with others in a plan.
    Patching a patched model again switches it to the new encoding.
    The model's config becomes ``<Config>WithPosEnc`` (``model_type`` ``posenc_<family>``, see
    `hf_posenc.auto`), so that ``save_pretrained`` writes a checkpoint that transformers' Auto classes load
    patched (after ``import hf_posenc`` or with ``trust_remote_code=True``) and never as the unpatched family;
    rope on Llama at the model's own frequencies keeps ``LlamaConfig`` (nothing is added to the model).
    The model gets its own copy of its config, so other models built from the same config are untouched.
    Under PEFT, patch the base model before wrapping it: a ``PeftModel`` raises ``TypeError``, a model that
    already holds PEFT layers ``ValueError``.
    """
    if isinstance(model, nn.Module):
        _check_not_peft(model)
    _check_model(model)
    family = get_family(getattr(model.config, "model_type", None))
    stored = False
    if name is None:
        name = getattr(model.config, CONFIG_KEY, None)
        if name is None:
            raise ValueError(
                f"no encoding given and model.config.{CONFIG_KEY} is not set; pass one of: {', '.join(list_encodings())}"
            )
        if params:
            raise ValueError("parameters were given without an encoding name; pass the name too")
        stored = True
        if isinstance(name, Mapping):  # a stored config, maybe from a newer hf_posenc: unknown keys warn
            name = PosEncConfig.from_dict(name, unknown="warn")
    base = family.base_model(model)
    check_config_class(model.config)
    info = family.info(model.config)
    if info.num_kv_heads < 1 or info.num_heads % info.num_kv_heads:
        raise ValueError(
            f"the model has {info.num_heads} query heads and {info.num_kv_heads} key/value heads; grouped-query "
            "attention needs the query heads to be a multiple of the key/value heads"
        )
    if is_plan(name):
        if params:
            raise ValueError(
                f"parameters ({', '.join(sorted(params))}) were given beside a plan; give them in its entries, "
                "e.g. [{'name': 'rope', 'theta': 1e6}, 'nope']"
            )
        configs = coerce_plan(name, info.num_layers, unknown="warn" if stored else "error")
    else:
        configs = [PosEncConfig.coerce(name, **params)] * info.num_layers
    for config in configs:
        if family.family not in config.spec.families:
            raise ValueError(
                f"encoding {config.name!r} does not support {family.family}; it supports: "
                f"{', '.join(config.spec.families)}"
            )
    configs = _resolve_plan(configs, info)
    distinct, layer_entries = plan_groups(configs)
    unshare_config(model)
    if len(distinct) == 1:
        config = distinct[0]
        encoding = config.spec.cls(config, info)
        if not isinstance(getattr(base, "posenc", None), nn.Module):
            encoding.adopt_native(family.native_weights(base))
        reads_mlp = [getattr(encoding, "reads_mlp_output", False)] * info.num_layers
        stored_config: Any = config.to_dict()
    else:
        embedding = sorted({c.name for c in distinct if getattr(c.spec.cls, "adds_embeddings", False)})
        if embedding:
            raise ValueError(
                f"{', '.join(map(repr, embedding))} act(s) on the token embeddings, once per model, not per layer, so "
                "it cannot be mixed with other encodings in a plan; use it alone, or a relative encoding per layer"
            )
        entries = []
        for index, config in enumerate(distinct):
            entries.append(config.spec.cls(config, layer_info(info, entry_layers(layer_entries, index))))
        encoding = PlanEncoding(configs, info, entries, layer_entries)
        reads_mlp = [getattr(entries[e], "reads_mlp_output", False) for e, _ in layer_entries]
        stored_config = [c.to_dict() for c in configs]
    reference = next((p for p in base.parameters() if p.is_floating_point()), None)
    if reference is not None:
        encoding.to(device=reference.device, dtype=reference.dtype)
    encoding.train(model.training)  # a model patched after .eval() gets an encoding in eval mode too
    layers = family.install(base)
    tap_mlp_outputs(base, [(i, layer) for i, layer in enumerate(layers) if reads_mlp[i]])
    base.posenc = encoding
    base.posenc_info = info
    base.posenc_layers = layers
    register_with_transformers()
    setattr(model.config, CONFIG_KEY, stored_config)
    mark_config(model.config)  # save_pretrained writes model_type posenc_<family> (rope on Llama: plain Llama)
    model.config._attn_implementation = ATTN_IMPLEMENTATION
    if getattr(base, "_attn_implementation", None) is not None:
        base._attn_implementation = ATTN_IMPLEMENTATION
    install_static_cache_shape(model)  # state channels in a StaticCache allocated early (prefill_chunk_size)
    return model


def _resolve_one(config: PosEncConfig, info: ModelInfo) -> PosEncConfig:
    """``config`` with the parameters left to the model filled in (``resolve``), its layer options kept."""
    resolved = config.spec.cls.resolve(config, info)
    if resolved.layer_options() != config.layer_options():
        resolved = dataclasses.replace(resolved, **config.layer_options())
    return resolved


def _resolve_plan(configs: list[PosEncConfig], info: ModelInfo) -> list[PosEncConfig]:
    """Per layer, the resolved config: each distinct entry is resolved against the layers it runs in. Entries
    that resolve to the same config (``"rope"`` and ``{"name": "rope", "theta": <the model's>}``) become one, so
    the stored plan rebuilds the same modules; they are then resolved again together."""
    for _ in range(3):
        distinct, layer_entries = plan_groups(configs)
        resolved = []
        for index, config in enumerate(distinct):
            own = layer_info(info, entry_layers(layer_entries, index)) if len(distinct) > 1 else info
            resolved.append(_resolve_one(config, own))
        new = [resolved[e] for e, _ in layer_entries]
        if len(plan_groups(new)[0]) == len(distinct):
            return new
        configs = new
    return new


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


def layer_encodings(model: nn.Module) -> list[tuple[nn.Module, int]]:
    """Per layer of a patched model, in layer order: ``(encoding, local_layer)``.

    ``encoding`` is the (unwrapped) encoding module that runs in that layer and ``local_layer`` the index
    that this encoding gives the layer (its per-layer parameters are indexed by it). With a single encoding
    that is ``(model's encoding, i)`` for layer ``i``; with a plan (a list of encodings, see
    `patch_model`) each layer gets its entry's encoding, and the entry counts only its own layers.
    """
    base = _patched_base(model)
    enc = unwrap(base.posenc)
    entries = getattr(enc, "layer_entries", None)
    if entries is None:
        return [(enc, i) for i in range(base.posenc_info.num_layers)]
    return [(unwrap(enc.entries[group]), local) for group, local in entries]


def describe(model: nn.Module) -> dict[str, Any]:
    """Which encoding a patched model runs, where, with which backend, and how many parameters it added.

    Returns a dict with keys ``encoding``, ``params``, ``kind``, ``family``, ``layers`` (names of the
    patched attention modules, relative to the base model), ``backend`` and ``parameters`` (the number of
    parameters the encoding holds); ``window`` when the encoding has a sliding window. For a plan, ``encoding``
    and ``kind`` are ``"plan"``, ``params`` is empty and ``plan`` lists, per layer, its ``layer`` (module name),
    ``encoding``, ``params``, ``window`` and ``backend``.
    """
    base = _patched_base(model)
    enc = base.posenc
    inner = unwrap(enc)
    device = next((p.device for p in base.parameters()), torch.device("cpu"))
    out: dict[str, Any] = {"family": base.posenc_info.family, "layers": list(base.posenc_layers),
                           "parameters": sum(p.numel() for p in enc.parameters())}
    if isinstance(inner, PlanEncoding):
        per_layer = []
        for name, (module, _) in zip(base.posenc_layers, layer_encodings(model)):
            config = module.posenc_config
            per_layer.append({"layer": name, "encoding": config.name, "params": dict(config.params),
                              **config.layer_options(), "backend": _backend_summary(module, device)})
        backends = sorted({entry["backend"] for entry in per_layer})
        return {"encoding": "plan", "params": {}, "kind": "plan", **out, "backend": ", ".join(backends),
                "plan": per_layer}
    spec = get_encoding(inner.name)
    out = {"encoding": spec.name, "params": dict(inner.posenc_config.params), "kind": spec.kind, **out,
           "backend": _backend_summary(inner, device)}
    out.update({k: v for k, v in inner.posenc_config.layer_options().items() if v is not None})
    return out


def _backend_summary(encoding: nn.Module, device: torch.device) -> str:
    """``torch`` when every op runs its PyTorch reference, else which ops run which kernel."""
    attention = attention_backend(encoding, device)
    own = getattr(unwrap(encoding), "attention_kernels", ())
    if "triton" in own and attention == "torch" and forced_backend() != "torch":
        # sba, cope: their ``attend`` runs their own Triton kernel where kernel_preferred says so (CUDA, or forced)
        from .kernels._attn_dispatch import kernel_preferred

        inner = unwrap(encoding)
        name = getattr(getattr(inner, "term_cls", type(inner)), "name", None)  # a composition's: its term's
        if name in ("sba", "cope") and kernel_preferred(name, f"{name}.triton_{name}", device):
            if forced_backend() == "triton":  # (it raises for inputs the kernel does not take)
                return "triton (its own attention kernel)"
            return "triton (its own attention kernel; PyTorch for inputs it does not take)"
    if not getattr(encoding, "uses_rotary_kernel", False) or device.type != "cuda":
        return attention
    from .kernels.rotary import _triton_import_error

    if forced_backend() in ("torch", "flex") or _triton_import_error() is not None:
        return attention
    return f"{attention} (attention), triton (rotation)"


def support_matrix() -> str:
    """The README's support matrix, generated from the registry (markdown): one row per encoding with its
    kind, the families it supports, its parameters and its paper.

    The families column says ``all`` when the encoding supports every family of `FAMILIES` (named in
    the header), else ``all but ...`` naming the ones it does not support, or the list of the ones it does
    when that is shorter. Every supported family also compiles as one graph
    (``torch.compile(model, fullgraph=True)``: no forward path reads a tensor on the host;
    tests/test_compile.py checks it against eager mode)."""
    header = f"| encoding | kind | families; all = {' '.join(FAMILIES)} | parameters | paper |"
    rows = [header, "|---|---|---|---|---|"]
    for name in list_encodings():
        spec = get_encoding(name)
        missing = [fam for fam in FAMILIES if fam not in spec.families]
        supported = [fam for fam in FAMILIES if fam in spec.families]
        if not missing:
            families = "all"
        elif len(missing) <= len(supported):
            families = "all but " + ", ".join(missing)
        else:
            families = ", ".join(supported) or "none"
        params = ", ".join(f"`{p}`" for p in spec.param_names()) or "none"
        rows.append(f"| `{name}` | {spec.kind} | {families} | {params} | {spec.paper} |")
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


#: weight files that would need unpickling: never loaded.
_PICKLED = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl", "*.bin.index.json")


def _safetensors_files(path: Path) -> list[Path]:
    """The safetensors weight files of a checkpoint directory (the shards of an index, or model.safetensors)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, AttributeError, TypeError) as e:
            raise ValueError(f"{index} is not a safetensors index (a JSON object with a 'weight_map'): {e}") from None
        absent = [s for s in shards if not (path / s).is_file()]
        if absent:
            raise ValueError(f"{path}: shards named in model.safetensors.index.json are missing: {absent}")
        return [path / s for s in shards]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    pickled = sorted({f.name for pattern in _PICKLED for f in path.glob(pattern)})
    found = f"; found {', '.join(pickled)}, which hf_posenc never loads (unpickling can run code)" if pickled else ""
    raise ValueError(
        f"{path} holds no model.safetensors (nor model.safetensors.index.json): hf_posenc loads safetensors "
        f"checkpoints only{found}. Re-save the model with save_pretrained (safetensors is its default)"
    )


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
    from transformers import PreTrainedModel

    if model_class is not None:
        if not (isinstance(model_class, type) and issubclass(model_class, PreTrainedModel)):
            raise TypeError(
                f"model_class must be a transformers model class (e.g. LlamaForCausalLM), got {model_class!r}"
            )
        want = getattr(model_class, "config_class", None)
        if want is not None and not isinstance(config, want):
            raise ValueError(
                f"model_class {model_class.__name__} takes a {want.__name__}, but the checkpoint's config is a "
                f"{type(config).__name__} (model_type {getattr(config, 'model_type', None)!r}); pass a class of that "
                "family, or None for the architecture the config names"
            )
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


def from_pretrained(path: str | os.PathLike, model_class: type | None = None, config: Any = None, **kwargs: Any):
    """Load a checkpoint saved from a patched model: patched again, every weight restored.

    Args:
        path: a local directory written by ``save_pretrained`` of a patched model (safetensors).
        model_class: the transformers class to build (default: the one named in the config).
        config: the checkpoint's config, already loaded (default: read from ``path``).
        **kwargs: passed to ``model_class.from_pretrained`` (``dtype``, ``device_map``, ...).
            With ``output_loading_info=True`` returns ``(model, info)``, where ``info`` lists the keys
            missing from or unexpected in the checkpoint once the encoding is restored (empty when all match).

    Reads both formats: ``model_type`` ``posenc_<family>`` (what hf_posenc writes now) and the family's own
    ``model_type`` plus ``position_encoding`` (checkpoints of hf_posenc 0.1); the model it returns saves in the
    new format.

    Safetensors only: a directory with only pickled weights (``pytorch_model.bin``, ...) and
    ``use_safetensors=False`` are refused, and nothing is ever unpickled. A checkpoint that does not match its
    config (a missing or misshapen weight of the model or of the encoding) raises ``ValueError`` naming the
    keys, before anything is returned; the partly loaded model is dropped. Parameters in the stored
    ``position_encoding`` that this version does not know (a checkpoint from a newer hf_posenc) give a
    ``UserWarning`` naming them and are ignored.
    """
    from transformers import AutoConfig

    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a local directory (str or os.PathLike), got {type(path).__name__}")
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{path} is not a directory saved by save_pretrained")
    if not (path / "config.json").is_file():
        hint = (
            " (accelerate's save_model writes the weights only: save with "
            "accelerator.unwrap_model(model).save_pretrained(path))"
            if any(path.glob("*.safetensors"))
            else ""
        )
        raise ValueError(f"{path} holds no config.json, so it does not say which encoding to restore{hint}")
    want_info = bool(kwargs.pop("output_loading_info", False))
    if kwargs.pop("use_safetensors", True) is False:
        raise ValueError(
            "use_safetensors=False: hf_posenc loads safetensors checkpoints only and never unpickles weights"
        )
    # Before transformers sees the directory: a checkpoint with only pickled weights is refused here.
    files = _safetensors_files(path)
    if config is None:
        config = AutoConfig.from_pretrained(path)
    stored = getattr(config, CONFIG_KEY, None)
    if stored is None:
        raise ValueError(
            f"{path}: the config has no {CONFIG_KEY!r}; it was not saved from a model patched by hf_posenc "
            "(load it with transformers, then call hf_posenc.patch_model)"
        )
    family = get_family(getattr(config, "model_type", None))
    try:
        # keys a newer hf_posenc wrote warn and are dropped; an unknown encoding or a bad value is an error
        if is_plan(stored):
            pe_config: Any = coerce_plan(stored, family.info(config).num_layers, unknown="warn")
        else:
            pe_config = PosEncConfig.from_dict(stored, unknown="warn")
    except (ValueError, TypeError) as e:
        raise type(e)(f"{path}: the checkpoint's {CONFIG_KEY} cannot be used by this hf_posenc: {e}") from None
    cls = _model_class(config, model_class)
    try:
        model = _load_checked(path, files, config, pe_config, family, cls, kwargs)
    except BaseException as e:
        # Nothing half-loaded stays reachable: the frames that the traceback keeps alive drop their locals
        # (the model built so far), here and in every chained exception.
        seen = set()
        while e is not None and id(e) not in seen:
            seen.add(id(e))
            traceback.clear_frames(e.__traceback__)
            e = e.__cause__ or e.__context__
        raise
    if want_info:
        return model, {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "error_msgs": []}
    return model


def _state_problems(expected: Mapping[str, torch.Tensor], found: Mapping[str, torch.Tensor]) -> list[str]:
    """What differs between the state an encoding module expects and the one a checkpoint holds (keys, shapes,
    float-ness), as phrases naming the keys; empty when they match."""
    problems = []
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    if missing or unexpected:
        problems.append(f"missing {missing}, unexpected {unexpected}")
    for key in sorted(set(expected) & set(found)):
        want, got = expected[key], found[key]
        if tuple(got.shape) != tuple(want.shape):
            problems.append(f"{key!r} has shape {tuple(got.shape)} in the checkpoint, {tuple(want.shape)} expected")
        elif want.is_floating_point() and not got.is_floating_point():
            problems.append(f"{key!r} is {got.dtype} in the checkpoint, a floating-point tensor expected")
    return problems


def _load_checked(path: Path, files: list[Path], config: Any, pe_config: Any, family: Any, cls: type,
                  kwargs: dict[str, Any]) -> nn.Module:
    """Build ``cls`` from the checkpoint, patch it and restore the encoding's weights; ``ValueError`` naming the
    keys when the checkpoint does not match its config (the model is then dropped, never returned)."""
    # transformers raises on mismatched shapes only after logging a report (silenced here): ask it to report
    # them to us instead, and raise with the keys and shapes. ignore_mismatched_sizes=True from the caller
    # keeps transformers' meaning (those weights are newly initialised, with a warning).
    tolerate = bool(kwargs.pop("ignore_mismatched_sizes", False))
    with _quiet_transformers():
        model, info = cls.from_pretrained(
            path, config=config, output_loading_info=True, use_safetensors=True, ignore_mismatched_sizes=True, **kwargs
        )
    expected_missing = family.native_keys
    rest_missing = [k for k in info["missing_keys"] if not any(k == n or k.endswith("." + n) for n in expected_missing)]
    mismatched = sorted(info.get("mismatched_keys", []), key=lambda m: str(m[0]))
    shapes = [f"{k!r}: {tuple(a)} in the checkpoint, {tuple(b)} in the model" for k, a, b in mismatched]
    if mismatched and tolerate:
        logger.warning("%s: re-initialised (ignore_mismatched_sizes=True): %s", path, "; ".join(shapes))
        shapes = []
    if rest_missing or shapes:
        found = ([f"missing {sorted(rest_missing)}"] if rest_missing else []) + (
            [f"mismatched [{'; '.join(shapes)}]"] if shapes else []
        )
        raise ValueError(f"{path}: the checkpoint does not match {cls.__name__} as its config describes it: {', '.join(found)}")
    patch_model(model, pe_config)
    module = encoding_module(model)
    state = _encoding_state(path)
    problems = _state_problems(module.state_dict(), state)
    if problems:
        what = (f"{pe_config.name!r} as its config describes it ({pe_config.params})"
                if isinstance(pe_config, PosEncConfig) else f"the plan {[c.name for c in pe_config]}")
        raise ValueError(f"{path}: the encoding weights do not match {what}: {'; '.join(problems)}")
    module.load_state_dict(state)
    # Weights the class does not use (a head, when loading the base model of a causal-LM checkpoint) are
    # left out, as transformers does.
    rest_unexpected = sorted(k for k in info["unexpected_keys"] if "posenc" not in k.split("."))
    if rest_unexpected:
        logger.info("%s: weights not used by %s: %s", path, cls.__name__, rest_unexpected)
    model.eval()
    return model
