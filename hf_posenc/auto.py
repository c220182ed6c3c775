"""Model types of hf_posenc's own, registered with transformers' Auto classes (public registration API only).

For every family ``F`` (``hf_posenc.registry.FAMILIES``) there are

- ``<Config>WithPosEnc`` (``LlamaConfigWithPosEnc``): a subclass of the family's config class whose
  ``model_type`` is ``posenc_<F>``
  (``posenc_llama``, ``posenc_gpt2``, ...), built by `hf_posenc.auto_config` (below
  `hf_posenc.api`, which calls it; re-exported here). It adds nothing to the config's fields;
  ``position_encoding`` rides along as before.
- ``<Head>WithPosEnc``, built here, for every head class that transformers maps to the family in one of its ``AutoModel*``
  classes (``LlamaForCausalLMWithPosEnc``, ``ViTForImageClassificationWithPosEnc``, ...): loaders whose
  ``from_pretrained`` is `hf_posenc.from_pretrained` with the family's head class, and whose
  ``_from_config`` (``AutoModel*.from_config``) builds the family's head and patches it from
  ``config.position_encoding``. What they return is the family's own class, patched (``type(model)`` is
  ``LlamaForCausalLM``), exactly what ``hf_posenc.patch_model`` gives.

`register` (run by ``import hf_posenc``) registers them with ``AutoConfig.register``,
``AutoModel*.register``, ``AutoTokenizer.register`` / ``AutoImageProcessor.register`` (the family's own
tokenizer or image processor) and adds PEFT's default LoRA targets for the new model types (new keys in PEFT's
tables, the family's entry copied; no existing entry changes).

``hf_posenc.patch_model`` gives the patched model's own config copy the class ``<Config>WithPosEnc``
(`mark_config`): ``save_pretrained`` then writes ``model_type: posenc_<F>``, an ``auto_map`` naming the
loaders, and the small module `hf_posenc.hf_posenc_loader` beside the weights (transformers' custom-code
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

from .api import from_pretrained as load_patched, patch_model
from .auto_config import (
    LOADER_MODULE,
    PREFIX,
    native_config_class,
    built_classes,
    check_config_class,
    config_class,
    family_of,
    loader_heads,
    loader_name,
    mark_config,
)
from .config import CONFIG_KEY
from .registry import FAMILIES

logger = logging.getLogger(__name__)

__all__ = [
    "PREFIX", "LOADER_MODULE", "family_of", "config_class", "loader_classes", "check_config_class", "mark_config",
    "register", "all_classes",
]

_LOADERS: dict[str, dict[str, type]] = {}  # family -> {Auto class name: loader class}


def _loader_class(head: type, config_cls: type) -> type:
    """``<Head>WithPosEnc``: ``from_pretrained`` / ``_from_config`` give ``head`` patched by hf_posenc."""

    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, config=None, **kwargs):
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
        return load_patched(pretrained_model_name_or_path, model_class=head, config=config, **kwargs)

    def _from_config(cls, config, **kwargs):
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
        loader_name(head),
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
    if family not in _LOADERS:
        config_cls = config_class(family)
        built: dict[str, type] = {}
        loaders: dict[str, type] = {}
        for auto_name, head in loader_heads(family).items():
            if head.__name__ not in built:
                built[head.__name__] = _loader_class(head, config_cls)
            loaders[auto_name] = built[head.__name__]
        _LOADERS[family] = loaders
        for cls in built.values():
            built_classes()[cls.__name__] = cls
    return _LOADERS[family]


def all_classes() -> dict[str, type]:
    """Every class built here, by name (every family's config and loaders)."""
    for family in FAMILIES:
        loader_classes(family)
    return dict(built_classes())


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
            native = IMAGE_PROCESSOR_MAPPING[native_config_class(family)]
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
