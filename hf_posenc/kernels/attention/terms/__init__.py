"""Position terms of the attention engines: the term registry, and what an encoding hands over.

Each term is stated ONCE, as a ``TermSpec`` registered with ``register_term``: its tensors (names,
shapes, which may carry a gradient), its *form* and its value. Every engine derives from that entry:

* the reference bias (``naive.term_bias``, the oracle) evaluates the value on broadcast index tensors
  (B, H, Lq, Lk);
* the FlexAttention ``score_mod`` (``flex.score_mod_for``) evaluates the same function on FlexAttention's
  0-d indices, ``score + value(b, h, q_idx, kv_idx)``;
* the tile engine (``tiled.py``) takes a Toeplitz term's per-distance values F (H, N) from ``distance`` (one
  call per forward, each tile a strided view of them; its gradient by autograd through ``distance`` from the
  per-distance sums of dS), a gate's per-token ``c`` from its tensor, a pair term's tiles from its ``tiles``;
* the Triton kernel (``triton_attention.py``, one compile-time branch per entry of ``TRITON_BRANCHES``) takes
  its term id from ``triton_id`` and what its host code passes (tensors, sizes, gradient reductions) from the
  entry's ``TritonHooks``; an entry without its own branch names an existing one (``triton``) and how to
  express itself there (``lower``), or none;
* CAPE's tiles take a base bias's values from the same entry, the doctor its checks (``example``).

The logit of query i (key index ``qi = q_offset + i``) and key j is ``scale * q_i . k_j + B_h(i, j)`` with,
for δ = qi − j (the built-in terms, one module each beside this file):

==============  ===========  ====================================================================================
kind            form         B_h(i, j)
==============  ===========  ====================================================================================
``none``        none         0
``alibi``       toeplitz     −slopes[h] · |δ|
``kerple_log``  toeplitz     −r1[h] · log(1 + r2[h] · |δ|)
``kerple_pow``  toeplitz     −r1[h] · |δ|^r2[h]   (0 at δ = 0)
``sandwich``    toeplitz     table[h, min(|δ|, T − 1)]                      table (H, T): the cosine sum per distance
``t5``          toeplitz     table[buckets[clip(j − qi, −M, M) + M], h]      table (NB, H), buckets (2M + 1,) int
``fire``        pair         interp(table[h], u),  u = log(1 + c·max(δ, 0)) · inv_norm[b, i] · (N − 1) / x_max
                                                                              table (H, N): f_θ at x = k·x_max/(N − 1)
``shaw``        pair         scale · q_i . key_table[clip(j − qi, −K, K) + K]  and the value term
                             out_i += Σ_j α_ij value_table[clip(j − qi, −K, K) + K]          tables (2K + 1, D)
``fox``         gate         c[b, h, qi] − c[b, h, j]                         c (B, H, Lk) cumulative log forget gates
``dpb``         toeplitz     table[h, clip(δ, −M, M) + M]                    table (H, 2M + 1): the DPB MLP per signed δ
==============  ===========  ====================================================================================

Forms: ``toeplitz``, a function of (h, δ) alone (``distance``); ``pair``, of (b, h, i, qi, j) (``pair``); ``gate``,
c[qi] − c[j] of a per-token vector c (``pair`` too; the tile engine carries c as a key channel). Text positions
only (1D): the encodings return no term on ViT's 2D grid (their ``score_bias`` gives the grid's form there).

Tensors marked ``grad=False`` (``alibi``'s slopes, ``sandwich``'s table, the t5 ``buckets``, FIRE's ``x_max``)
take no gradient in the Triton kernel (it refuses them when they require one); every other tensor may (learned
parameters, or functions of them built in PyTorch: the engines return the gradient of each term tensor, and
autograd carries it on to the encoding's parameters).

Adding a term (a user's own file, or a built-in module here): one ``register_term`` call (its tensors, form,
value; optionally its example), then an encoding returns ``KernelTerm.build(kind, ...)`` (or
``KernelTerm.<kind>(...)``); see ``hf_posenc.TermEncoding`` and docs/adding-an-encoding.md. The reference,
FlexAttention, the tile engine (for a Toeplitz or gate term) and the doctor need nothing more; a pair term needs its
tiles for the tile engine; the Triton kernel needs a branch of its own (kernel code: built-ins only), or an existing
one through ``lower``. The kind lists (``term_kinds``, ``kernel_kinds``, ``flex_kinds``; the module
attributes ``TERM_KINDS``, ``KERNEL_KINDS``, ``FLEX_KINDS``, ``TILED_KINDS``, ``TOEPLITZ_KINDS``) are read from the
registry when asked, so a term registered later takes part.
"""

from __future__ import annotations

from .. import term_spec as _term_spec
from ..term_spec import *  # noqa: F401,F403 (the registry's public names, re-exported: term_spec.__all__)

# the built-in terms, one module each (registered in this order: the order of term_kinds())
from . import none as _none  # noqa: E402,F401
from . import alibi as _alibi  # noqa: E402,F401
from . import kerple as _kerple  # noqa: E402,F401
from . import sandwich as _sandwich  # noqa: E402,F401
from . import t5 as _t5  # noqa: E402,F401
from . import fire as _fire  # noqa: E402,F401
from . import shaw as _shaw  # noqa: E402,F401
from . import fox as _fox  # noqa: E402,F401
from . import dpb as _dpb  # noqa: E402,F401
from .t5 import T5_BRANCH_MAX_ROWS  # noqa: E402


#: the kind lists, computed from the registry when read (``terms.TERM_KINDS`` ...), so that a term registered after
#: this package was imported takes part.
_LAZY = {"TERM_KINDS": term_kinds, "KERNEL_KINDS": kernel_kinds, "FLEX_KINDS": flex_kinds,
         "TILED_KINDS": tiled_kinds, "TOEPLITZ_KINDS": toeplitz_kinds}


__all__ = [*_term_spec.__all__, *_LAZY, "T5_BRANCH_MAX_ROWS"]


def __getattr__(name: str):
    if name in _LAZY:
        return _LAZY[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
