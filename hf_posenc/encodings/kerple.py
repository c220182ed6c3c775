"""``kerple``: kernelized relative positional embedding.

"KERPLE: Kernelized Relative Positional Embedding for Length Extrapolation", Chi et al. 2022,
https://arxiv.org/abs/2205.09921. Each head h of each layer adds a conditionally positive definite
kernel of the distance to its logits:

    log variant:    B_h(i, j) = -r1_h * log(1 + r2_h * |i - j|),    r1_h, r2_h > 0
    power variant:  B_h(i, j) = -r1_h * |i - j| ** r2_h,            r1_h > 0, 0 < r2_h <= 2

The constraints are kept by a reparametrisation, never by clamping in place (the authors' code clamps
``.data`` to [1e-2, ...] before each use, which stops gradients at the bound):
r1 = 1e-2 + softplus(a1), r2 = 1e-2 + softplus(a2) (log) and r2 = 2 * sigmoid(a2) (power), so that
r1, r2 >= 1e-2 as in that code.

Defaults, from the authors' GPT-NeoX code (github.com/chijames/KERPLE):

* Initial values (``megatron/mpu/layers.py``, ``get_parameter(scale, 'uniform')`` = U(0, scale)):
  log (``ParallelKerpleLog``: ``-bias_p * log(1 + bias_a * diff)``): the scale r1 = ``bias_p`` ~ U(0, 2),
  r2 = ``bias_a`` ~ U(0, 1); power (``ParallelKerplePower``: ``-bias_a * diff ** bias_p``): the scale
  r1 = ``bias_a`` ~ U(0, 1), the exponent r2 = ``bias_p`` ~ U(0, 2). Drawn per head from torch's
  generator at patch time; values below 1e-2 are raised to 0.011 (power's r2 < 2 is kept below 2 - 1e-6
  so that its logit is finite).
* One kernel shared by every layer (``per_layer=False``): ``megatron/model/gpt2_model.py``
  (``GPT2ModelPipe.init_specs``) builds a single ``rpe_emb`` and passes that module as ``rpe`` to every
  ``ParallelTransformerLayerPipe``. ``per_layer=True`` gives each layer its own (r1, r2), an option the
  paper's text does not rule out but its code does not use.

Distances are built in float32 (bfloat16 cannot tell 256 from 257).

On ViT (bidirectional): |i - j| is the Euclidean distance between the two patches on the 2D patch
grid; every pair involving the CLS token gets no bias.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from ..config import PosEncConfig
from ..ops import upcast
from ..kernels.attention.terms import KernelTerm
from ..registry import param, register_encoding
from .base import ModelInfo, PosContext
from .term import TermEncoding

__all__ = ["Kerple"]

_EPS = 1e-2


def _inv_softplus(y: torch.Tensor) -> torch.Tensor:
    return y + torch.log(-torch.expm1(-y))


@dataclass
class KerpleParams:
    variant: str = param("log", "kernel: 'log' (-r1 log(1 + r2 d)) or 'power' (-r1 d^r2)", type=str,
                         choices=("log", "power"))
    per_layer: bool = param(
        False,
        "a kernel per layer, or one shared by all layers (default, as the authors' megatron/model/gpt2_model.py)",
        type=bool,
    )


@register_encoding(
    "kerple",
    params=KerpleParams,
    kind="score bias",
    summary="learned log or power kernel of the distance per head; Euclidean patch distance on ViT",
    paper="https://arxiv.org/abs/2205.09921",
)
class Kerple(TermEncoding):
    """KERPLE; see the module docstring for the formula and the reparametrisation (the formula is stated once, by
    the ``kerple_log`` / ``kerple_pow`` terms: ``score_bias`` is the term's reference bias; on ViT, the term at the
    patches' Euclidean distance)."""

    no_inert_reason = "r1 and r2 are kept >= 0.01 by its reparametrisation, so its bias never vanishes"

    relative = True  # a kernel of |i - j| (key/query indices); position_ids are never read
    reference_footprint = (3.0, 8.0)  # float32 (B, H, Lq, Lk) tensors (hf_posenc.memory)
    kernel_kinds = ("kerple_log", "kerple_pow")
    grid_distance = "euclidean"

    def __init__(self, config: PosEncConfig, info: ModelInfo) -> None:
        super().__init__(config, info)
        self.variant = config.params["variant"]
        self.bias_per_layer = config.params["per_layer"]
        n = info.num_layers if self.bias_per_layer else 1
        # the authors' megatron/mpu/layers.py: the log kernel's scale ~ U(0, 2) and rate ~ U(0, 1); the power
        # kernel's scale ~ U(0, 1) and exponent ~ U(0, 2)
        scale_hi, r2_hi = (2.0, 1.0) if self.variant == "log" else (1.0, 2.0)
        r1 = (torch.rand(n, info.num_heads) * scale_hi).clamp_min(_EPS * 1.1)
        r2 = (torch.rand(n, info.num_heads) * r2_hi).clamp_min(_EPS * 1.1)
        if self.variant == "power":
            r2 = r2.clamp_max(2.0 - 1e-6)
        self.r1_raw = nn.Parameter(_inv_softplus(r1 - _EPS))
        if self.variant == "log":
            self.r2_raw = nn.Parameter(_inv_softplus(r2 - _EPS))
        else:
            self.r2_raw = nn.Parameter(torch.logit(r2 / 2))

    def kernel_params(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(r1, r2), each (layers or 1, H) float32, inside their constraints."""
        r1 = _EPS + F.softplus(upcast(self.r1_raw))
        if self.variant == "log":
            r2 = _EPS + F.softplus(upcast(self.r2_raw))
        else:
            r2 = 2 * torch.sigmoid(upcast(self.r2_raw))
        return r1, r2

    def term(self, ctx: PosContext, layer: int, q_len: int, k_len: int, device: torch.device) -> KernelTerm:
        """The ``kerple_log`` or ``kerple_pow`` term: r1, r2 (H,) of ``layer`` (gradients flow to the raw
        parameters)."""
        idx = layer if self.bias_per_layer else 0
        # without gradients once per forward (PositionEncoding.layer_slice): a shared kernel is then the same tensor
        # in every layer, and a decoding step's engine evaluates its bias once (tiled._layer_shared_bias)
        r1 = self.layer_slice(ctx, "kerple_r1", idx, lambda i: self.kernel_params()[0][i])
        r2 = self.layer_slice(ctx, "kerple_r2", idx, lambda i: self.kernel_params()[1][i])
        return KernelTerm.build("kerple_log" if self.variant == "log" else "kerple_pow", r1=r1, r2=r2)
