"""``torch.autograd.gradcheck`` in float64 of every encoding's reference, at the attention level.

One test, parametrised over every registered encoding and two families (Llama with grouped-query heads
and a left-padded batch; ViT on a 2x3 patch grid with its CLS token): the encoding module is cast to
float64 and every one of its parameters becomes a gradcheck input, with q, k, v and the attention input
(what data-dependent encodings read). The function checked is what a patched attention layer runs, for
every layer of the model in turn: ``PosContext.prepare`` (q/k transforms, state channels) ->
``posenc_attention`` (score biases, or the encoding's own ``attend``) -> ``PosContext.finish`` (output
gates); absolute encodings add their ``embed`` term. Model-level gradchecks are pointless on Llama (its
RMSNorm computes in float32 even for float64 inputs), so nothing outside the attention is involved.

Per-encoding test files check the same gradients on hand-picked pieces (a bias, a rotation); this one
checks the whole attention-level path of every encoding with one harness, so a new encoding is covered
without writing anything.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call

from hf_posenc.attention import posenc_attention
from hf_posenc.encodings.base import PosContext, unwrap
from hf_posenc.patches import get_family
from conftest import ENCODINGS, make_model, positions_from_mask, supports, tiered

#: parameters that keep the encodings' tables small (gradcheck perturbs every element), and that switch
#: on the optional learned parts (fope's coefficients, sba's remainder vector, liere per head and layer).
SMALL = {
    "cape": {"mlp_hidden": 3},
    "cope": {"npos_max": 5},
    "fire": {"mlp_hidden": 3, "init_threshold": 2.5},  # L = 2.5: both sides of max(L, i) are used
    "fope": {"learnable": True, "train_length": 8},
    "liere": {"per_head": True, "per_layer": True},
    "rope2d": {"variant": "mixed"},
    "sba": {"remainder": "bias"},
    "shaw": {"max_relative_position": 2},
    "t5": {"num_buckets": 8, "max_distance": 16, "per_layer": True},
    "tape": {"position_size": 2},
    "fox": {"rope": True},
}

LLAMA = dict(hidden_size=8, intermediate_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             max_position_embeddings=16)
VIT = dict(hidden_size=8, intermediate_size=8, num_hidden_layers=2, num_attention_heads=2, patch_size=4,
           image_size=[8, 12])


class AttentionLayers(nn.Module):
    """Every patched attention layer of a model, at the attention level: prepare -> attention -> finish (and,
    for an encoding that reads each layer's MLP output, that output)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        family = get_family(model.config.model_type)
        base = family.base_model(model)
        self.enc = base.posenc
        self.info = base.posenc_info
        names = set(base.posenc_layers)
        # the attention modules are borrowed for their attributes (scaling, is_causal, layer index); not
        # registered, so that only the encoding's parameters are named here
        object.__setattr__(self, "layers", [m for n, m in base.named_modules() if n in names])

    def forward(self, q, k, v, hidden, mask, position_ids, grid):
        ctx = PosContext(encoding=self.enc, info=self.info, position_ids=position_ids, grid=grid)
        outs = []
        for attn in self.layers:
            qq, kk, vv = ctx.prepare(attn.posenc_layer, hidden, q, k, v)
            out, _ = posenc_attention(attn, qq, kk, vv, mask, scaling=attn.scaling, posenc_ctx=ctx)
            outs.append(ctx.finish(attn.posenc_layer, hidden, out))
            if getattr(unwrap(self.enc), "reads_mlp_output", False):  # tape: the MLP hook's call, ``hidden`` as
                ctx.encoding("mlp_output", ctx, attn.posenc_layer, hidden)  # the layer's MLP output
        if getattr(unwrap(self.enc), "adds_embeddings", False):
            outs.append(ctx.encoding("embed", ctx, torch.float64, q.device))
        return tuple(outs)


def inputs(family: str, heads: int, kv_heads: int, head_dim: int, hidden: int):
    """q (B, H, L, D), k, v (B, Hkv, L, D), the attention input (B, L, C), the mask, position_ids, grid."""
    g = torch.Generator().manual_seed(0)
    if family == "vit":
        batch, length, grid = 1, 2 * 3 + 1, (2, 3)
        mask = position_ids = None
    else:
        batch, length, grid = 2, 5, None
        pad = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])  # row 0 left-padded by one token
        position_ids = positions_from_mask(pad)
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        mask = causal[None] & pad.bool()[:, None, :]
        mask = mask | torch.eye(length, dtype=torch.bool)[None]  # a padded query sees itself: no empty row
        mask = mask[:, None]

    def rand(*shape):
        return (torch.randn(*shape, generator=g, dtype=torch.float64)).requires_grad_(True)

    q = rand(batch, heads, length, head_dim)
    k = rand(batch, kv_heads, length, head_dim)
    v = rand(batch, kv_heads, length, head_dim)
    x = rand(batch, length, hidden)
    return (q, k, v, x), mask, position_ids, grid


GRADCHECK_CASES = [
    pytest.param(fam, enc, id=f"{fam}-{enc}", marks=() if supports(enc, fam) else pytest.mark.skip(reason="unsupported"))
    for fam in ("llama", "vit")
    for enc in ENCODINGS
]


#: the fast tier's share: a static bias, an MLP bias, stick-breaking, contextual positions, a 2D rotation, a table
GRADCHECK_FAST = ["llama-alibi", "llama-kerple", "vit-sba", "llama-cope", "llama-rope2d", "vit-learned"]


@pytest.mark.parametrize("family,encoding", tiered(GRADCHECK_CASES, fast=GRADCHECK_FAST))
def test_attention_level_gradcheck(family, encoding):
    """Gradients w.r.t. q, k, v, the attention input and every parameter of the encoding match finite
    differences in float64 (through every layer's prepare -> attention -> finish)."""
    model = make_model(family, seed=3, encoding=encoding, config_overrides=LLAMA if family == "llama" else VIT,
                       **SMALL.get(encoding, {}))
    layers = AttentionLayers(model).double()
    cfg = model.config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = cfg.hidden_size // heads
    tensors, mask, position_ids, grid = inputs(family, heads, kv_heads, head_dim, cfg.hidden_size)
    names = [n for n, _ in layers.named_parameters()]
    params = tuple(p.detach().clone().requires_grad_(True) for _, p in layers.named_parameters())
    for name, p in zip(names, params):
        assert p.dtype == torch.float64, f"{name} is {p.dtype}"

    def fn(*args):
        q, k, v, x, *ps = args
        return functional_call(layers, dict(zip(names, ps)), (q, k, v, x, mask, position_ids, grid))

    outs = fn(*tensors, *params)
    for out in outs:
        assert out.dtype == torch.float64, f"the attention-level output is {out.dtype}, not float64"
    # not vacuous: every parameter reaches the output (else gradcheck would compare zeros with zeros)
    weights = [torch.randn(o.shape, generator=torch.Generator().manual_seed(1), dtype=o.dtype) for o in outs]
    total = sum((o * w).sum() for o, w in zip(outs, weights))
    grads = torch.autograd.grad(total, params, allow_unused=True) if params else ()
    unused = [n for n, g in zip(names, grads) if g is None or not g.abs().sum() > 0]
    assert not unused, f"parameters that do not reach the attention output: {unused}"
    assert torch.autograd.gradcheck(fn, (*tensors, *params), eps=1e-6, atol=1e-6, rtol=1e-4)
