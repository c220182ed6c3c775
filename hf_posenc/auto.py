"""Model types of hf_posenc's own, registered with transformers' Auto classes (public registration API only).

For every family ``F`` (``hf_posenc.registry.FAMILIES``) this module builds

- ``<Config>WithPosEnc`` (``LlamaConfigWithPosEnc``): a subclass of the family's config class whose
  ``model_type`` is ``posenc_<F>``
  (``posenc_llama``, ``posenc_gpt2``, ...). It adds nothing to the config's fields; ``position_encoding``
  rides along as before.
- ``<Head>WithPosEnc`` for every head class that transformers maps to the family in one of its ``AutoModel*``
  classes (``LlamaForCausalLMWithPosEnc``, ``ViTForImageClassificationWithPosEnc``, ...): loaders whose
  ``from_pretrained`` is :func:`hf_posenc.from_pretrained` with the family's head class, and whose
  ``_from_config`` (``AutoModel*.from_config``) builds the family's head and patches it from
  ``config.position_encoding``. What they return is the family's own class, patched (``type(model)`` is
  ``LlamaForCausalLM``), exactly what ``hf_posenc.patch_model`` gives.

:func:`register` (run by ``import hf_posenc``) registers them with ``AutoConfig.register``,
``AutoModel*.register``, ``AutoTokenizer.register`` / ``AutoImageProcessor.register`` (the family's own
tokenizer or image processor) and adds PEFT's default LoRA targets for the new model types (new keys in PEFT's
tables, the family's entry copied; no existing entry changes).

``hf_posenc.patch_model`` gives the patched model's own config copy the class ``<Config>WithPosEnc``
(:func:`mark_config`): ``save_pretrained`` then writes ``model_type: posenc_<F>``, an ``auto_map`` naming the
loaders, and the small module :mod:`hf_posenc.hf_posenc_loader` beside the weights (transformers' custom-code
mechanism, ``custom_object_save``). A checkpoint saved this way is never read as the unpatched family:
without ``import hf_posenc`` transformers does not know ``posenc_<F>`` and stops (asking for
``trust_remote_code=True``); with ``trust_remote_code=True`` the module imports hf_posenc, or raises
ImportError asking to ``pip install hf_posenc``.

rope on Llama at the model's own frequencies adds nothing to the model (no weight, same function): its config
keeps ``LlamaConfig`` and the checkpoint stays a plain Llama checkpoint (``position_encoding`` is still
written, so ``hf_posenc.from_pretrained`` restores the patch).
"""

from __future__ import annotations

import logging
from typing import Any

from .config import CONFIG_KEY
from .registry import FAMILIES

logger = logging.getLogger(__name__)

__all__ = [
    "PREFIX", "LOADER_MODULE", "family_of", "config_class", "loader_classes", "check_config_class", "mark_config",
    "register",
]

#: ``model_type`` of the registered types: ``PREFIX + family``.
PREFIX = "posenc_"
#: the module written beside every checkpoint (its file name is what ``auto_map`` names).
LOADER_MODULE = "hf_posenc.hf_posenc_loader"

_CONFIGS: dict[str, type] = {}  # family -> PosEnc config class
_HEADS: dict[str, dict[str, type]] = {}  # family -> {Auto class name: loader class}
_BUILT: dict[str, type] = {}  # every class built here, by name (what hf_posenc_loader exports)


def family_of(model_type: Any) -> Any:
    """``llama`` for ``posenc_llama``; any other value unchanged."""
    if isinstance(model_type, str) and model_type.startswith(PREFIX) and model_type[len(PREFIX):] in FAMILIES:
        return model_type[len(PREFIX):]
    return model_type


def _camel(name: str) -> str:
    return "".join(part[:1].upper() + part[1:] for part in name.split("_"))


def _auto_classes() -> list[tuple[str, type, str]]:
    """``(Auto class name, Auto class, names mapping)`` for every ``AutoModel*`` class of transformers."""
    import transformers.models.auto.modeling_auto as modeling_auto

    found = []
    for name in sorted(dir(modeling_auto)):
        auto = getattr(modeling_auto, name)
        mapping = getattr(auto, "_model_mapping", None)
        if name.startswith("AutoModel") and isinstance(auto, type) and hasattr(mapping, "_model_mapping"):
            found.append((name, auto, mapping._model_mapping))
    return found


def _native_config_class(family: str) -> type:
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[family]


def config_class(family: str) -> type:
    """``<Config>WithPosEnc`` for ``family`` (built once)."""
    if family not in _CONFIGS:
        native = _native_config_class(family)
        cls = type(
            f"{native.__name__}WithPosEnc",
            (native,),
            {
                "model_type": PREFIX + family,
                # config.save_pretrained copies the loader module and writes auto_map["AutoConfig"]
                "_auto_class": "AutoConfig",
                "__module__": LOADER_MODULE,
                "__doc__": f"{native.__name__} of a model patched by hf_posenc (model_type {PREFIX + family!r}).",
            },
        )
        _CONFIGS[family] = cls
        _BUILT[cls.__name__] = cls
    return _CONFIGS[family]


def _loader_class(head: type, config_cls: type) -> type:
    """``<Head>WithPosEnc``: ``from_pretrained`` / ``_from_config`` give ``head`` patched by hf_posenc."""

    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, config=None, **kwargs):
        from .api import from_pretrained as load

        if model_args:
            raise TypeError(
                f"{cls.__name__}.from_pretrained takes no positional model arguments, got {len(model_args)}"
            )
        kwargs.pop("trust_remote_code", None)  # already resolved by the Auto class that called us
        if config is not None and not isinstance(config, config_cls):
            raise ValueError(
                f"{cls.__name__} takes a {config_cls.__name__} (model_type {config_cls.model_type!r}), "
                f"got {type(config).__name__}"
            )
        return load(pretrained_model_name_or_path, model_class=head, config=config, **kwargs)

    def _from_config(cls, config, **kwargs):
        from .api import patch_model

        stored = getattr(config, CONFIG_KEY, None)
        if stored is None:
            raise ValueError(
                f"{cls.__name__}.from_config needs config.{CONFIG_KEY} (which encoding to build); this config has none"
            )
        return patch_model(head._from_config(config, **kwargs), None)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError(
            f"{type(self).__name__} is a loader registered by hf_posenc, not a model class to build: use "
            f"AutoModel*.from_pretrained / from_config, hf_posenc.from_pretrained, or "
            f"hf_posenc.patch_model({head.__name__}(config), ...)"
        )

    return type(
        f"{head.__name__}WithPosEnc",
        (head,),
        {
            "config_class": config_cls,
            "from_pretrained": classmethod(from_pretrained),
            "_from_config": classmethod(_from_config),
            "__init__": __init__,
            "__module__": LOADER_MODULE,
            "__doc__": f"Loads {head.__name__} checkpoints of model type {config_cls.model_type!r}, patched.",
        },
    )


def loader_classes(family: str) -> dict[str, type]:
    """``{Auto class name: <Head>WithPosEnc}`` for every head class transformers maps to ``family``."""
    if family not in _HEADS:
        import transformers

        config_cls = config_class(family)
        heads: dict[str, type] = {}
        built: dict[str, type] = {}
        for auto_name, _, names in _auto_classes():
            head_name = names.get(family)
            if isinstance(head_name, (list, tuple)):
                head_name = head_name[0] if head_name else None
            head = getattr(transformers, head_name, None) if isinstance(head_name, str) else None
            if head is None or getattr(head, "config_class", None) is not _native_config_class(family):
                continue  # (a few mappings list another model's class under a family's key)
            if head_name not in built:
                built[head_name] = _loader_class(head, config_cls)
            heads[auto_name] = built[head_name]
        _HEADS[family] = heads
        for cls in built.values():
            _BUILT[cls.__name__] = cls
    return _HEADS[family]


def all_classes() -> dict[str, type]:
    """Every class built here, by name (every family's config and loaders)."""
    for family in FAMILIES:
        loader_classes(family)
    return dict(_BUILT)


def _rope_is_native(config: Any, params: dict) -> bool:
    """rope computes Llama's own function: the ``half`` layout (transformers' ``rotate_half``) and a ``theta``
    that is None (the model's own, scaled rotary) or the config's ``rope_theta`` with default (unscaled) rotary;
    no sliding window, no scaling and no partial rotary of its own."""
    if params.get("layout", "half") != "half":
        return False
    if any(params.get(key) is not None for key in ("window", "scaling", "partial_rotary_factor")):
        return False
    theta = params.get("theta")
    if theta is None:
        return True
    rope = getattr(config, "rope_parameters", None) or {}
    if not isinstance(rope, dict):
        return False
    native_theta = rope.get("rope_theta", getattr(config, "rope_theta", None))
    if rope.get("rope_type", "default") != "default" or native_theta is None:
        return False
    return float(native_theta) == float(theta)


def check_config_class(config: Any) -> None:
    """``ValueError`` unless ``config`` is the family's own config class or ``<Config>WithPosEnc``: the class of
    any other (a subclass from remote code, ...) cannot be swapped without losing what it adds, and its
    checkpoint would load unpatched. Called by ``patch_model`` before it changes anything."""
    family = family_of(getattr(config, "model_type", None))
    if family not in FAMILIES:
        return
    native, ours = _native_config_class(family), config_class(family)
    if type(config) not in (native, ours):
        raise ValueError(
            f"hf_posenc patches {family} models whose config is a {native.__name__}; this one is a "
            f"{type(config).__name__} (config subclasses are not supported: build the model from a {native.__name__})"
        )


def mark_config(config: Any) -> None:
    """Give a patched model's own config (already un-shared) the class ``<Config>WithPosEnc`` and the ``auto_map``
    of the family's loaders, or, for rope on Llama at its own frequencies, the family's plain config class.
    Instance-level: the config object's class changes, no class does."""
    family = family_of(getattr(config, "model_type", None))
    if family not in FAMILIES:
        return
    native, ours = _native_config_class(family), config_class(family)
    stored = getattr(config, CONFIG_KEY, None) or {}
    plain = (
        family == "llama" and isinstance(stored, dict) and stored.get("name") == "rope"
        and _rope_is_native(config, stored)
    )
    loader_file = LOADER_MODULE.rsplit(".", 1)[-1]
    auto_map = dict(getattr(config, "auto_map", None) or {})
    auto_map = {k: v for k, v in auto_map.items() if not (isinstance(v, str) and v.startswith(loader_file + "."))}
    if plain:
        if type(config) is ours:
            config.__class__ = native
        if auto_map:
            config.auto_map = auto_map
        elif "auto_map" in vars(config):
            delattr(config, "auto_map")  # written only when set: a plain Llama checkpoint has none
        return
    check_config_class(config)
    if type(config) is native:
        config.__class__ = ours
    for auto_name, cls in loader_classes(family).items():
        auto_map[auto_name] = f"{loader_file}.{cls.__name__}"
    config.auto_map = auto_map


_REGISTERED = False


def register() -> None:
    """Register every family's model type with transformers' Auto classes (idempotent)."""
    global _REGISTERED
    if _REGISTERED:
        return
    import transformers.models.auto.modeling_auto as modeling_auto
    from transformers import AutoConfig

    for family in FAMILIES:
        config_cls = config_class(family)
        AutoConfig.register(config_cls.model_type, config_cls, exist_ok=True)
        for auto_name, cls in loader_classes(family).items():
            getattr(modeling_auto, auto_name).register(config_cls, cls, exist_ok=True)
        _register_preprocessor(family, config_cls)
    _register_peft_targets()
    _REGISTERED = True


def _register_preprocessor(family: str, config_cls: type) -> None:
    """The family's own tokenizer (text) or image processor (ViT) for the new config class, so that
    ``AutoTokenizer`` / ``AutoImageProcessor`` find it when the saved files name no class."""
    from transformers import AutoTokenizer
    from transformers.models.auto import tokenization_auto

    names = getattr(tokenization_auto, "TOKENIZER_MAPPING_NAMES", {}).get(family)
    if isinstance(names, (list, tuple)):
        names = next((n for n in reversed(names) if n), None)  # (slow, fast) in older releases: the fast one
    if isinstance(names, str):
        tokenizer = tokenization_auto.tokenizer_class_from_name(names)
        if tokenizer is not None:
            AutoTokenizer.register(config_cls, tokenizer_class=tokenizer, exist_ok=True)
    if family == "vit":
        from transformers import AutoImageProcessor
        from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING

        from transformers.utils import logging as hf_logging

        level = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # "requires torchvision ... falling back to the PIL processor"
        try:
            native = IMAGE_PROCESSOR_MAPPING[_native_config_class(family)]
        finally:
            hf_logging.set_verbosity(level)
        try:
            if isinstance(native, dict):
                AutoImageProcessor.register(config_cls, image_processor_classes=native, exist_ok=True)
            elif isinstance(native, (list, tuple)):
                AutoImageProcessor.register(config_cls, *native, exist_ok=True)
            else:
                AutoImageProcessor.register(config_cls, slow_image_processor_class=native, exist_ok=True)
        except ImportError as e:
            # transformers 5.17 without torchvision: AutoImageProcessor itself is unusable (each of its methods
            # raises this ImportError), for the plain ViT too; nothing to register into.
            logger.debug("AutoImageProcessor not registered for %s: %s", config_cls.model_type, e)


def _register_peft_targets() -> None:
    """PEFT's default target modules are keyed by ``model_type``: add ``posenc_<F>`` with ``F``'s entry to every
    such table of PEFT (new keys only)."""
    try:
        import peft.utils.constants as constants
    except Exception as e:  # noqa: BLE001  (PEFT is optional)
        logger.debug("PEFT default targets not registered: %s", e)
        return
    for name in dir(constants):
        table = getattr(constants, name)
        if name.startswith("TRANSFORMERS_MODELS_TO_") and isinstance(table, dict):
            for family in FAMILIES:
                if family in table:
                    table.setdefault(PREFIX + family, table[family])
