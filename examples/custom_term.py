"""Bring your own encoding: a learned log-distance bias, defined outside hf_posenc, in one file.

    B_h(i, j) = −w_h · log(1 + |i − j|),    w learned per head and layer

The term is stated once (``register_term``); hf_posenc derives the reference, the tile engine (O(L) memory,
forward and backward), FlexAttention, every model family, the KV cache, ``rope+log_distance``, save/load and
``hf-posenc doctor`` from it. ``python examples/custom_term.py`` trains a few steps; ``hf-posenc --import
examples/custom_term.py doctor --cases log_distance`` checks every engine on this machine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

import hf_posenc

hf_posenc.register_term(hf_posenc.TermSpec(
    "log_distance", "toeplitz", "−w[h] · log(1 + |δ|)",  # δ = qi − j; a function of (head, δ): Toeplitz
    tensors=(hf_posenc.TensorSpec("w", ("H",)),),
    distance=lambda t, h, delta: -t["w"][h] * torch.log1p(delta.abs().to(t["w"].dtype)),
))


@dataclass
class LogDistanceParams:
    init: float = hf_posenc.param(0.5, "initial w of every head and layer", type=float, ge=0.0)


@hf_posenc.register_encoding("log_distance", params=LogDistanceParams, kind="score bias",
                             summary="learned −w_h · log(1 + |i − j|) per head and layer (examples/custom_term.py)",
                             paper="examples/custom_term.py")
class LogDistance(hf_posenc.TermEncoding):
    kernel_kinds = ("log_distance",)  # the registered term(s) term() returns
    grid_distance = "euclidean"  # ViT: the term at the Euclidean distance between two patches
    inert_zero = ("w",)  # w = 0 adds nothing: init="identity" in "rope+log_distance"
    relative = True  # a function of i − j alone

    def __init__(self, config: hf_posenc.PosEncConfig, info: hf_posenc.ModelInfo) -> None:
        super().__init__(config, info)
        self.w = nn.Parameter(torch.full((info.num_layers, info.num_heads), config.params["init"]))

    def term(self, ctx, layer, q_len, k_len, device) -> hf_posenc.KernelTerm:
        return hf_posenc.KernelTerm.log_distance(self.w[layer])


if __name__ == "__main__":
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    model = hf_posenc.patch_model(LlamaForCausalLM(cfg), "log_distance")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0))
    for step in range(20):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    print(f"loss {loss.item():.3f}, w of layer 0: {model.model.posenc.w[0].tolist()}")
