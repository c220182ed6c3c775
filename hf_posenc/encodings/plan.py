"""A plan: a different encoding per layer (``patch_model(model, ["rope", "rope", "rope", "nope"])``).

The recipes of recent long-context models mix encodings over the depth: SmolLM3 drops RoPE in every fourth
layer, Llama 4 and Gemma 3 interleave rotary layers with NoPE layers or with another base, RNoPE-SWA puts a
sliding window on the rotary layers only (Yang et al. 2025, "Rope to Nope and Back Again"). A plan states such
a recipe as a list of encodings, repeated over the depth (see `hf_posenc.config.coerce_plan`).

`PlanEncoding` holds one encoding module per distinct entry of the plan (``entries``), each built for
the layers it runs in only: an entry that runs in layers 0, 4 and 8 is built as a 3-layer encoding (its
per-layer parameters and per-layer model facts -- Gemma 3's layer bases, the sliding windows -- are those of
its own layers) and sees them as its layers 0, 1, 2. ``layer_entries`` maps each layer of the model to (entry,
local layer). An encoding that carries state from layer to layer (TAPE's position states) carries it through
its own layers, skipping the others.

The model's attention modules ask the per-forward context for their layer (`PosContext.at`), which
hands back a context of that layer's entry -- its own memo, so that two entries never share a cached bias --
and the entry's local layer index. The entry is fetched by calling the plan module (``plan("entry", i)``),
so that under PEFT's ``ModulesToSaveWrapper`` the copy that is trained is the one used.

Encodings that act on the embeddings (``sinusoidal``, ``learned``: one term added once, before the first
layer) have no meaning per layer; a plan that mixes them with other encodings is refused. A plan whose
entries are all the same is the plain encoding (no plan module is built).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from ..config import PosEncConfig
from .base import ModelInfo

__all__ = ["PlanEncoding", "entry_layers", "plan_groups", "layer_info"]


def plan_groups(configs: list[PosEncConfig]) -> tuple[list[PosEncConfig], list[tuple[int, int]]]:
    """(distinct entries in order of first use, per layer (entry index, local layer index))."""
    distinct: list[PosEncConfig] = []
    counts: list[int] = []
    layers: list[tuple[int, int]] = []
    for config in configs:
        index = next((i for i, c in enumerate(distinct) if c.to_dict() == config.to_dict()), None)
        if index is None:
            distinct.append(config)
            counts.append(0)
            index = len(distinct) - 1
        layers.append((index, counts[index]))
        counts[index] += 1
    return distinct, layers


def entry_layers(layer_entries: list[tuple[int, int]], index: int) -> list[int]:
    """The model layers in which entry ``index`` runs (``layer_entries`` as `plan_groups` gives them)."""
    return [layer for layer, (entry, _) in enumerate(layer_entries) if entry == index]


def layer_info(info: ModelInfo, layers: list[int]) -> ModelInfo:
    """The model description seen by an encoding that runs in ``layers`` only (model layer indices, in order):
    ``num_layers`` is their count and the per-layer facts are theirs."""

    def pick(values: tuple | None) -> tuple | None:
        return None if values is None else tuple(values[i] for i in layers)

    windows = pick(info.sliding_windows)
    return dataclasses.replace(
        info,
        num_layers=len(layers),
        layer_rope_parameters=pick(info.layer_rope_parameters),
        sliding_windows=windows if windows is not None and any(w is not None for w in windows) else None,
    )


class PlanEncoding(nn.Module):
    """The encoding module of a model patched with a plan (``<base>.posenc``); see the module docstring.

    Attributes:
        entries: one encoding module per distinct plan entry.
        layer_entries: per model layer, (entry index, the entry's local layer index).
        configs: per model layer, its resolved `PosEncConfig`.
    """

    name = "plan"
    # What the model asks of its encoding as a whole (every per-layer question goes to the layer's entry).
    adds_embeddings = False
    rotates_qk = False
    has_score_bias = False
    custom_attention = False
    prepares_qkv = False
    finishes_output = False
    kernel_kinds: tuple[str, ...] = ()

    def __init__(self, configs: list[PosEncConfig], info: ModelInfo, entries: list[nn.Module],
                 layer_entries: list[tuple[int, int]]) -> None:
        super().__init__()
        self.configs = list(configs)
        self.info = info
        self.entries = nn.ModuleList(entries)
        self.layer_entries = list(layer_entries)

    @property
    def relative(self) -> bool:
        """Shift invariance on text holds for the plan when it holds for every entry."""
        return all(getattr(e, "relative", False) for e in self.entries)

    @property
    def reads_mlp_output(self) -> bool:
        return any(getattr(e, "reads_mlp_output", False) for e in self.entries)

    def forward(self, op: str, *args: Any) -> Any:
        if op == "entry":
            (index,) = args
            return self.entries[index]
        raise ValueError(
            f"a plan of encodings answers only 'entry' (the model asks each layer's own encoding); got {op!r}"
        )

    def extra_repr(self) -> str:
        return "layers=[" + ", ".join(c.name for c in self.configs) + "]"
