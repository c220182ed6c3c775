"""The config half of hf_posenc's own model types (below `hf_posenc.api`, which calls it).

For every family ``F`` (``hf_posenc.registry.FAMILIES``) this module builds ``<Config>WithPosEnc``
(``LlamaConfigWithPosEnc``): a subclass of the family's config class whose ``model_type`` is ``posenc_<F>``
(``posenc_llama``, ``posenc_gpt2``, ...). It adds nothing to the config's fields; ``position_encoding`` rides
along as before. It also names the loaders: `loader_heads` lists, for every ``AutoModel*`` class that
transformers maps to the family, the family's head class, and `loader_name` the name of the loader class
that `hf_posenc.auto` builds for it (what `mark_config` writes into ``auto_map``).

``hf_posenc.patch_model`` gives the patched model's own config copy the class ``<Config>WithPosEnc``
(`mark_config`); `check_config_class` refuses a config class that cannot be swapped. The loader
classes themselves (which call ``hf_posenc.from_pretrained`` / ``patch_model``) and the registration with the
Auto classes live in `hf_posenc.auto`, above `hf_posenc.api`.
"""

from __future__ import annotations

from typing import Any

from .config import CONFIG_KEY
from .registry import FAMILIES

__all__ = [
    "PREFIX", "LOADER_MODULE", "family_of", "config_class", "loader_heads", "loader_name", "check_config_class",
    "mark_config", "built_classes", "native_config_class",
]

#: ``model_type`` of the registered types: ``PREFIX + family``.
PREFIX = "posenc_"
#: the module written beside every checkpoint (its file name is what ``auto_map`` names).
LOADER_MODULE = "hf_posenc.hf_posenc_loader"

_CONFIGS: dict[str, type] = {}  # family -> PosEnc config class
_HEADS: dict[str, dict[str, type]] = {}  # family -> {Auto class name: the family's head class}
_BUILT: dict[str, type] = {}  # every class built for hf_posenc_loader, by name (configs here, loaders in auto)


def family_of(model_type: Any) -> Any:
    """``llama`` for ``posenc_llama``; any other value unchanged."""
    if isinstance(model_type, str) and model_type.startswith(PREFIX) and model_type[len(PREFIX):] in FAMILIES:
        return model_type[len(PREFIX):]
    return model_type


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


def native_config_class(family: str) -> type:
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[family]


def config_class(family: str) -> type:
    """``<Config>WithPosEnc`` for ``family`` (built once)."""
    if family not in _CONFIGS:
        native = native_config_class(family)
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


def loader_heads(family: str) -> dict[str, type]:
    """``{Auto class name: head class}`` for every ``AutoModel*`` class of transformers that maps ``family``
    to one of the family's own head classes (the classes `hf_posenc.auto` builds a loader for)."""
    if family not in _HEADS:
        import transformers

        heads: dict[str, type] = {}
        for auto_name, _, names in _auto_classes():
            head_name = names.get(family)
            if isinstance(head_name, (list, tuple)):
                head_name = head_name[0] if head_name else None
            head = getattr(transformers, head_name, None) if isinstance(head_name, str) else None
            if head is None or getattr(head, "config_class", None) is not native_config_class(family):
                continue  # (a few mappings list another model's class under a family's key)
            heads[auto_name] = head
        _HEADS[family] = heads
    return dict(_HEADS[family])


def loader_name(head: type) -> str:
    """``<Head>WithPosEnc``: the name of the loader class built for ``head`` (the name ``auto_map`` holds)."""
    return f"{head.__name__}WithPosEnc"


def built_classes() -> dict[str, type]:
    """The classes built so far for `hf_posenc.hf_posenc_loader`, by name (one shared table: the configs
    are added here, the loaders by `hf_posenc.auto`)."""
    return _BUILT


def _rope_is_native(config: Any, params: dict) -> bool:
    """rope computes Llama's own function: the ``half`` layout (transformers' ``rotate_half``) and a ``theta``
    that is None (the model's own, scaled rotary) or the config's ``rope_theta`` with default (unscaled) rotary;
    no sliding window, no scaling and no partial rotary of its own."""
    if params.get("layout", "half") != "half":
        return False
    if any(params.get(key) is not None for key in ("window", "sink", "length_scale", "scaling",
                                                    "partial_rotary_factor")):
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
    native, ours = native_config_class(family), config_class(family)
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
    native, ours = native_config_class(family), config_class(family)
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
    for auto_name, head in loader_heads(family).items():
        auto_map[auto_name] = f"{loader_file}.{loader_name(head)}"
    config.auto_map = auto_map
