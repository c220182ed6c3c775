"""``hf-posenc doctor`` / ``hf_posenc.doctor()``: check every engine on this machine against the reference.

What it does, on the machine it runs on (the installed package; no repository needed):

1. prints the versions (Python, torch, CUDA, Triton, transformers, hf_posenc), the device and its compute
   capability;
2. runs every engine available there on small shapes, forward **and** gradients (q, k, v and the term's
   parameter tensors), against the package's full-matrix references computed in float64 from the same
   (rounded) inputs:

   * ``triton``: the Triton kernels (CUDA; on the CPU only in Triton's interpreter, with tiny shapes, when
     ``TRITON_INTERPRET=1`` is set or ``--interpret`` asks for it);
   * ``flex``: torch's FlexAttention with the term as a score_mod (attention terms but shaw; on the CPU it
     has no backward, so the row checks the forward only and says so);
   * ``tiled``: the tile-wise PyTorch engines (any device), with small tiles so that every cross-tile carry
     is exercised;

   over the attention terms (alibi, t5, kerple log and power, sandwich, fire, shaw, fox), stick-breaking
   attention (SBA), CoPE, CAPE, the rotary kernel (block sizes 2 and 8) and windowed launches (alibi, SBA,
   CoPE with a sliding window). Each row gives the relative error of the output and of every gradient
   (||engine − reference|| / ||reference||), pass or fail against the tolerance of its dtype
   (:data:`TOLERANCE`), and the time of the engine's forward+backward against SDPA's (causal, no bias) on
   the same shape;
3. says which backend each registered encoding uses by default on this device, and why
   (:func:`default_backends`).

The report (:func:`doctor`'s return value, ``--out PATH``) is one JSON object, schema :data:`SCHEMA`;
``make gpu-check`` commits the same object (with a ``benchmarks`` key added) as
``benchmarks/results/gpu_check_<gpu>.json``. The exit status of the command is 1 when any row fails or
errors. See docs/doctor.md.

The module is not named ``doctor`` because ``hf_posenc.doctor`` is the function.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch.nn import functional as F

from .backend import forced_backend
from .encodings.alibi import alibi_slopes
from .encodings.t5 import t5_relative_position_bucket
from .kernels._attn_dispatch import common_unsupported
from .kernels.attention import (
    KernelTerm,
    attention_reference,
    flex_attention_term,
    flex_unsupported,
    fused_attention,
    kernel_unsupported,
    term_bias,
    tiled_attention,
    tiled_unsupported,
)
from .kernels.cape import cape_attention_reference, cape_attention_tiled
from .kernels.cope import cope_reference, cope_tiled
from .kernels.cope import triton_unsupported as cope_triton_unsupported
from .kernels.rotary import _kernel_unsupported as rotary_unsupported
from .kernels.rotary import apply_qk_rotation_reference
from .kernels.sba import sba_reference, sba_tiled
from .machine import cpu_name

__all__ = ["CASES", "ENGINES", "SCHEMA", "TOLERANCE", "default_backends", "doctor", "environment", "format_report",
           "merge_reports"]

#: the report's schema id (bumped when a field changes meaning or disappears).
SCHEMA = "hf_posenc.doctor/1"
#: engines in the order they run (the most important first: a run cut short keeps those rows).
ENGINES = ("triton", "tiled", "flex")
#: largest relative error ||engine − reference|| / ||reference|| allowed, per input dtype, for the output and
#: every gradient. float32: the engines sum in another order (the term gradients are sums over all pairs;
#: on a GPU the kernels' float32 dots are 3xTF32). bfloat16 / float16: inputs, probabilities and gradients
#: are rounded to 8 / 11 bits of mantissa inside the engines.
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 1e-2}
#: the error of a gradient is relative to its reference's norm, or to this fraction of the largest reference
#: gradient norm of the row when that is larger (gradients that vanish in exact arithmetic).
GRAD_FLOOR = 1e-2
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "float32": "float32",
                  "bfloat16": "bfloat16", "float16": "float16"}
#: (B, H, Hkv, L, D): GQA 2:1, an odd length, a head_dim that is not a power of two.
SHAPE = (2, 4, 2, 77, 40)
#: Triton's interpreter (CPU): one Python step per program and tile, so a tiny shape.
SHAPE_INTERPRETED = (2, 2, 1, 17, 16)
#: query and key tile sizes of the tile-wise engines here: several tiles along L, so the carries between
#: tiles are checked (the engines' defaults cover short sequences with a single tile).
TILES = (16, 32)


# -- environment -----------------------------------------------------------------------------------------


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except ImportError:
        return None
    except Exception as exc:  # a broken install: say so in the report  # noqa: BLE001
        return f"import failed: {type(exc).__name__}: {exc}"


def _interpreting() -> bool:
    from .kernels._jit import interpreting

    try:
        return interpreting()
    except Exception:  # noqa: BLE001 - triton missing or broken: not interpreting
        return False


def environment(device: torch.device | str) -> dict[str, Any]:
    """Versions, the device (name, compute capability, SMs, memory) and the variables that steer the engines."""
    from . import __version__

    device = torch.device(device)

    versions = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
                "triton": _version("triton"), "transformers": _version("transformers"), "hf_posenc": __version__}
    dev: dict[str, Any] = {"type": device.type}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        dev.update(name=props.name, capability=f"{props.major}.{props.minor}", sm_count=props.multi_processor_count,
                   memory_gib=round(props.total_memory / 2**30, 1))
    else:
        dev.update(name=cpu_name(), capability=None, threads=torch.get_num_threads())
    env = {name: os.environ.get(name) for name in ("HF_POSENC_BACKEND", "TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES")}
    return {"versions": versions, "device": dev, "platform": platform.platform(), "environment": env,
            "triton_interpreter": _interpreting()}


# -- default backends ------------------------------------------------------------------------------------


def default_backends(device: torch.device | str) -> list[dict[str, str | None]]:
    """Which backend each registered encoding uses by default on ``device``, and why.

    The decisions are the package's own (:func:`hf_posenc.attention.attention_backend`, the dispatchers of
    ``sba``, ``cope`` and the rotary kernel, the table in :mod:`hf_posenc.kernels.defaults`, and
    ``HF_POSENC_BACKEND``), asked on this device; this function only explains them. A call may still fall
    back to ``torch`` for inputs an engine does not take (e.g. ``output_attentions``, dropout in training).

    Returns:
        one dict per encoding: ``encoding``, ``kind`` (the registry's), ``attention`` (``triton``,
        ``flex``, ``torch``, or ``error``), ``rotation`` (the rotary kernel's backend, for encodings whose
        rotations go through it, else None) and ``why`` (a sentence).
    """
    from .attention import attention_backend
    from .kernels import defaults
    from .kernels.cope import cope_backend
    from .kernels.sba import sba_backend
    from .kernels.rotary import rotation_backend
    from .registry import get_encoding, list_encodings

    device = torch.device(device)
    on_cuda = device.type == "cuda"
    forced = None
    try:
        forced = forced_backend()
    except ValueError as exc:
        return [{"encoding": name, "kind": get_encoding(name).kind, "attention": "error", "rotation": None,
                 "why": str(exc)} for name in list_encodings()]
    probe = torch.zeros(1, 1, 1, 8, device=device)
    rows = []
    for name in list_encodings():
        spec = get_encoding(name)
        cls = spec.cls
        kinds = tuple(getattr(cls, "kernel_kinds", ()))
        own_kernels = tuple(getattr(cls, "attention_kernels", ()))
        row: dict[str, str | None] = {"encoding": name, "kind": spec.kind, "attention": None, "rotation": None}
        try:
            if own_kernels:  # sba, cope: the encoding's attend dispatches to its own kernels
                ask = sba_backend if name == "sba" else cope_backend
                backend = ask(probe, probe, probe)
                why = _why_own(name, backend, forced, on_cuda, defaults)
            else:
                backend = attention_backend(cls, device)
                why = _why_attention(cls, kinds, backend, forced, on_cuda, defaults)
        except ValueError as exc:
            backend, why = "error", str(exc)
        row["attention"], row["why"] = backend, why
        if getattr(cls, "uses_rotary_kernel", False):
            try:
                rot = rotation_backend(None, probe, 2)
                row["rotation"] = rot
                row["why"] += " Rotations: " + (
                    "the Triton rotary kernel (block sizes 2, 4, 8; other sizes rotate in PyTorch)." if rot == "triton"
                    else _why_rotation(forced, on_cuda, defaults))
            except ValueError as exc:
                row["rotation"] = "error"
                row["why"] += f" Rotations: {exc}"
        rows.append(row)
    return rows


def _measured(defaults, kind: str) -> str:
    note = defaults.MEASURED.get(kind)
    return f"measured: {note}" if note else "not yet measured on a GPU (the kernels are the default by design)"


def _why_attention(cls, kinds, backend, forced, on_cuda, defaults) -> str:
    in_attention = getattr(cls, "has_score_bias", False) or getattr(cls, "custom_attention", False)
    if not in_attention:
        return "No term inside the attention: transformers' own SDPA."
    if forced is not None:
        return f"HF_POSENC_BACKEND={forced} forces it."
    if not kinds:
        if cls.name == "cape":
            return "CAPE has no Triton kernel: its tile-wise PyTorch engine (O(L·block) memory)."
        return "No kernel for this attention: the encoding's own PyTorch attention."
    if not on_cuda:
        return ("Not a CUDA device: the tile-wise PyTorch engine (the Triton kernels need CUDA; FlexAttention "
                "only when forced).")
    table = defaults.cuda_default_backend(kinds)
    if backend == "torch" and table == "triton":
        from .kernels.attention import _triton_import_error

        return f"Triton is not usable here ({_triton_import_error()}): the tile-wise PyTorch engine."
    return (f"CUDA default for {'/'.join(kinds)} in hf_posenc/kernels/defaults.py: {table} "
            f"({_measured(defaults, kinds[0])}).")


def _why_own(name, backend, forced, on_cuda, defaults) -> str:
    if forced is not None:
        return f"HF_POSENC_BACKEND={forced} gives {backend} (the tile-wise engine for torch and flex)."
    if backend == "triton":
        return f"CUDA default for {name}: triton ({_measured(defaults, name)})."
    if not on_cuda:
        return "Not a CUDA device: the tile-wise PyTorch engine (the Triton kernels need CUDA)."
    if defaults.cuda_default_backend(name) != "triton":
        return f"CUDA default for {name} in hf_posenc/kernels/defaults.py: torch ({_measured(defaults, name)})."
    from .kernels._attn_dispatch import triton_import_error

    return f"Triton is not usable here ({triton_import_error(f'{name}.triton_{name}')}): the tile-wise engine."


def _why_rotation(forced, on_cuda, defaults) -> str:
    if forced is not None:
        return f"PyTorch (HF_POSENC_BACKEND={forced})."
    if not on_cuda:
        return "PyTorch (not a CUDA device)."
    if defaults.cuda_default_backend("rotary") != "triton":
        return "PyTorch (the CUDA default for rotary in hf_posenc/kernels/defaults.py)."
    from .kernels.rotary import _triton_import_error

    return f"PyTorch (Triton is not usable here: {_triton_import_error()})."


# -- the problems ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    """One check: a family (``attention``, ``sba``, ``cope``, ``cape``, ``rotary``), its variant and window."""

    name: str
    family: str
    variant: str
    engines: tuple[str, ...]
    window: bool = False


_ATTENTION_ENGINES = ("triton", "tiled", "flex")
#: every check, in the order it runs.
CASES: tuple[Case, ...] = (
    *(Case(kind, "attention", kind, _ATTENTION_ENGINES)  # shaw's flex row: skipped, with the reason
      for kind in ("alibi", "t5", "kerple_log", "kerple_pow", "sandwich", "fire", "shaw", "fox")),
    Case("alibi_window", "attention", "alibi", _ATTENTION_ENGINES, window=True),
    Case("sba", "sba", "bias", ("triton", "tiled")),
    Case("sba_window", "sba", "bias", ("triton", "tiled"), window=True),
    Case("cope", "cope", "", ("triton", "tiled")),
    Case("cope_window", "cope", "", ("triton", "tiled"), window=True),
    Case("cape", "cape", "kerple_log", ("tiled",)),
    Case("rotary_s2", "rotary", "2", ("triton",)),
    Case("rotary_s8", "rotary", "8", ("triton",)),
)
#: ``--quick``: one case of each family, the window included.
QUICK_CASES = ("alibi", "fire", "fox", "alibi_window", "sba", "cope_window", "cape", "rotary_s2")


@dataclasses.dataclass
class Problem:
    """Inputs of one case and how each engine and the reference compute it.

    ``inputs``: (name, leaf tensor) whose gradients are checked; q, k, v come first (in the row's dtype),
    then the term's parameters (float32). ``run(engine, *inputs)`` returns the output, or a tuple of outputs;
    ``reference(*inputs)`` the same from float64 copies. ``grad_out``: the incoming gradient(s)."""

    inputs: list[tuple[str, torch.Tensor]]
    run: Callable[..., Any]
    reference: Callable[..., Any]
    grad_out: tuple[torch.Tensor, ...]
    unsupported: Callable[[str, list[torch.Tensor]], str | None]
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _leaf(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.to(device).requires_grad_()


def _qkv(shape, dtype, device, g) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (B, H, L, D) as transformers lays it out (a transposed view), k, v (B, Hkv, L, D), the incoming gradient."""
    b, h, hkv, n, d = shape
    q = torch.randn(b, n, h, d, generator=g).transpose(1, 2)
    k = torch.randn(b, hkv, n, d, generator=g)
    v = torch.randn(b, hkv, n, d, generator=g)
    gout = torch.randn(b, h, n, d, generator=g)
    return tuple(t.to(device=device, dtype=dtype) for t in (q, k, v, gout))


def _key_valid(shape, device) -> torch.Tensor:
    """(B, L) bool: the last batch row left-padded (its first queries see no key at all)."""
    b, _, _, n, _ = shape
    valid = torch.ones(b, n, dtype=torch.bool)
    if b > 1:
        valid[-1, : n // 8 + 1] = False
    return valid.to(device)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The yardstick of the timings: SDPA, causal, no bias, on the same q, k, v."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


def _window(case: Case, shape) -> int | None:
    return max(2, shape[3] // 3) if case.window else None


def _attention_term(kind: str, params: dict[str, torch.Tensor], fixed: dict[str, torch.Tensor], q_len: int
                    ) -> KernelTerm:
    """The term of ``kind`` built from its leaves (any float dtype: the reference passes float64 copies)."""
    if kind == "alibi":
        return KernelTerm.alibi(fixed["slopes"])
    if kind in ("kerple_log", "kerple_pow"):
        return KernelTerm.build(kind, r1=params["r1"], r2=params["r2"])
    if kind == "sandwich":
        return KernelTerm.sandwich(fixed["table"])
    if kind == "t5":
        return KernelTerm.t5(params["table"], fixed["buckets"])
    if kind == "fire":
        c, inv_norm = params["c"], params["inv_norm"]
        q_idx = torch.arange(q_len, dtype=inv_norm.dtype, device=inv_norm.device)
        # the grid's extent a little past the largest visible pair: no pair sits on the clamp at the grid's end,
        # where float32 and the float64 reference could round to different sides of the kink
        x_max = (torch.log1p(c.detach() * q_idx)[None] * inv_norm.detach()).max().clamp_min(1.0) * 1.05
        return KernelTerm.fire(params["table"], c, inv_norm, x_max)
    if kind == "shaw":
        return KernelTerm.shaw(params["key_table"], params["value_table"])
    if kind == "fox":
        return KernelTerm.fox(params["log_f"].cumsum(-1))
    raise ValueError(f"unknown attention term {kind!r}")


def _attention_params(kind: str, shape, device, g) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(leaves whose gradients are checked, fixed tensors) of a term, float32, shaped as the encodings build them."""
    b, h, _, n, d = shape
    if kind == "alibi":
        return {}, {"slopes": alibi_slopes(h).to(device)}
    if kind in ("kerple_log", "kerple_pow"):
        r1 = torch.rand(h, generator=g) * 2 + 0.05
        r2 = torch.rand(h, generator=g) * (1.9 if kind == "kerple_pow" else 1.0) + 0.05
        return {"r1": _leaf(r1, device), "r2": _leaf(r2, device)}, {}
    if kind == "sandwich":  # a table shorter than the distances: the last column is reused
        return {}, {"table": torch.randn(h, max(2, n // 2), generator=g).to(device)}
    if kind == "t5":
        buckets = t5_relative_position_bucket(torch.arange(-20, 21), False, 8, 20)
        return {"table": _leaf(torch.randn(8, h, generator=g), device)}, {"buckets": buckets.to(device)}
    if kind == "fire":
        return {"table": _leaf(torch.randn(h, 24, generator=g), device), "c": _leaf(torch.tensor(0.3), device),
                "inv_norm": _leaf(torch.rand(b, n, generator=g) * 0.2 + 0.2, device)}, {}
    if kind == "shaw":
        return {"key_table": _leaf(torch.randn(11, d, generator=g) * 0.3, device),
                "value_table": _leaf(torch.randn(11, d, generator=g) * 0.3, device)}, {}
    if kind == "fox":
        return {"log_f": _leaf(F.logsigmoid(torch.randn(b, h, n, generator=g) + 2.0), device)}, {}
    raise ValueError(f"unknown attention term {kind!r}")


def _attention_problem(case: Case, shape, dtype, device, g) -> Problem:
    q, k, v, gout = _qkv(shape, dtype, device, g)
    params, fixed = _attention_params(case.variant, shape, device, g)
    valid = _key_valid(shape, device)
    window = _window(case, shape)
    n = shape[3]
    names = list(params)
    kw = dict(scale=shape[4] ** -0.5, causal=True, q_offset=0, key_valid=valid, window=window)
    flex_memo: dict = {}

    def split(tensors):
        return tensors[:3], dict(zip(names, tensors[3:]))

    def run(engine, *tensors):
        (q_, k_, v_), p = split(tensors)
        term = _attention_term(case.variant, p, fixed, n)
        if engine == "triton":
            return fused_attention(q_, k_, v_, term, **kw)
        if engine == "tiled":
            return tiled_attention(q_, k_, v_, term, block_q=TILES[0], block_k=TILES[1], **kw)
        if engine == "flex":  # the block mask built once, as a model builds it once per forward for every layer
            return flex_attention_term(q_, k_, v_, term, memo=flex_memo, **kw)
        raise ValueError(engine)

    def reference(*tensors):
        (q_, k_, v_), p = split(tensors)
        fixed64 = {name: (t.double() if t.is_floating_point() else t) for name, t in fixed.items()}
        return attention_reference(q_, k_, v_, _attention_term(case.variant, p, fixed64, n), **kw)

    def unsupported(engine, tensors):
        (q_, k_, v_), p = split(tensors)
        term = _attention_term(case.variant, p, fixed, n)
        check = {"triton": kernel_unsupported, "tiled": tiled_unsupported, "flex": flex_unsupported}[engine]
        return check(q_, k_, v_, term)

    inputs = [("q", q), ("k", k), ("v", v), *params.items()]
    return Problem(inputs, run, reference, (gout,), unsupported, (q, k, v))


def _padding_mask(shape, device) -> torch.Tensor:
    valid = _key_valid(shape, device)
    n = shape[3]
    return valid[:, None, None, :].expand(shape[0], 1, n, n).contiguous()


def _sba_problem(case: Case, shape, dtype, device, g) -> Problem:
    b, h, _, n, d = shape
    q, k, v, gout = _qkv(shape, dtype, device, g)
    bias = _leaf(torch.randn(h, d, generator=g) * 0.3, device)
    mask = _padding_mask(shape, device)
    window = _window(case, shape)
    scale = d**-0.5

    def run(engine, q_, k_, v_, bias_):
        if engine == "triton":
            from .kernels.sba.triton_sba import sba_triton

            return sba_triton(q_, k_, v_, mask, scale, 0, False, "bias", bias_, window=window)
        return sba_tiled(q_, k_, v_, mask, scale, 0, False, "bias", bias_, block_m=TILES[0], block_n=TILES[1],
                         window=window)

    def reference(q_, k_, v_, bias_):
        return sba_reference(q_, k_, v_, mask, scale, 0, False, "bias", bias_, window=window)

    def unsupported(engine, tensors):
        if engine == "triton":
            return common_unsupported("sba", "sba.triton_sba", q, k, v, mask, 0, False, 0.0, False)
        return None

    return Problem([("q", q), ("k", k), ("v", v), ("bias", bias)], run, reference, (gout,), unsupported,
                   (q, k, v))


def _cope_problem(case: Case, shape, dtype, device, g) -> Problem:
    b, h, _, n, d = shape
    q, k, v, gout = _qkv(shape, dtype, device, g)
    table = _leaf(torch.randn(d, 16, generator=g) * 0.3, device)
    mask = _padding_mask(shape, device)
    window = _window(case, shape)
    scale = d**-0.5

    def run(engine, q_, k_, v_, table_):
        if engine == "triton":
            from .kernels.cope.triton_cope import cope_triton

            return cope_triton(q_, k_, v_, table_, mask, scale, 0, window=window)
        return cope_tiled(q_, k_, v_, table_, mask, scale, 0, block_m=TILES[0], block_n=TILES[1], window=window)

    def reference(q_, k_, v_, table_):
        return cope_reference(q_, k_, v_, table_, mask, scale, 0, window=window)

    def unsupported(engine, tensors):
        if engine == "triton":  # float32 on CUDA refused: it broke the CUDA context on an H100
            return cope_triton_unsupported(q, k, v, mask, 0)
        return None

    return Problem([("q", q), ("k", k), ("v", v), ("table", table)], run, reference, (gout,), unsupported,
                   (q, k, v))


def _cape_problem(case: Case, shape, dtype, device, g) -> Problem:
    """CAPE over KERPLE's log bias: the tile-wise engine against ``cape_attention_reference`` with the bias of
    the attention reference's ``term_bias``."""
    b, h, _, n, d = shape
    q, k, v, gout = _qkv(shape, dtype, device, g)
    hidden = 8
    params = {"w1": torch.randn(hidden, 2 * h, generator=g) * 0.3, "b1": torch.randn(hidden, generator=g) * 0.1,
              "w2": torch.randn(h, hidden, generator=g) * 0.3, "b2": torch.randn(h, generator=g) * 0.1,
              "r1": torch.rand(h, generator=g) * 2 + 0.05, "r2": torch.rand(h, generator=g) + 0.05}
    params = {name: _leaf(t, device) for name, t in params.items()}
    causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    mask = _padding_mask(shape, device) & causal
    scale = d**-0.5

    def run(engine, q_, k_, v_, w1, b1, w2, b2, r1, r2):
        return cape_attention_tiled(q_, k_, v_, w1, b1, w2, b2, case.variant, (r1, r2), mask, scale, 0, causal=True,
                                    block_q=TILES[0], block_k=TILES[1])

    def reference(q_, k_, v_, w1, b1, w2, b2, r1, r2):
        bias = term_bias(KernelTerm.kerple_log(r1, r2), None, n, n)
        return cape_attention_reference(q_, k_, v_, bias, w1, b1, w2, b2, mask, scale)[0]

    return Problem([("q", q), ("k", k), ("v", v), *params.items()], run, reference, (gout,),
                   lambda engine, tensors: None, (q, k, v))


def _rotary_problem(case: Case, shape, dtype, device, g) -> Problem:
    """The rotary kernel (q and k in one pass) against ``apply_qk_rotation_reference``; rotations per kv head."""
    b, h, hkv, n, d = shape
    s = int(case.variant)
    q, k, v, gq = _qkv(shape, dtype, device, g)
    gk = torch.randn(b, hkv, n, d, generator=g).to(device=device, dtype=dtype)
    rot = _leaf(torch.randn(1, hkv, n, d // s, s, s, generator=g), device)

    def run(engine, q_, k_, rot_):
        from .kernels.rotary.triton_rotary import rotary_qk

        return rotary_qk(q_, k_, rot_)

    def reference(q_, k_, rot_):
        return apply_qk_rotation_reference(q_, k_, rot_)

    def unsupported(engine, tensors):
        return rotary_unsupported(q, k, rot)

    return Problem([("q", q), ("k", k), ("rot", rot)], run, reference, (gq, gk), unsupported, (q, k, v))


_BUILDERS = {"attention": _attention_problem, "sba": _sba_problem, "cope": _cope_problem, "cape": _cape_problem,
             "rotary": _rotary_problem}


# -- running one row -------------------------------------------------------------------------------------


def _rel_err(got: torch.Tensor | None, want: torch.Tensor | None, floor: float = 0.0) -> float:
    """||got − want|| / max(||want||, floor); inf when ``got`` is missing or not finite."""
    if got is None or want is None:
        return math.inf if (got is None) != (want is None) else 0.0
    got, want = got.double(), want.double()
    if not torch.isfinite(got).all():
        return math.inf
    return ((got - want).norm() / max(want.norm().item(), floor, 1e-30)).item()


def _as_tuple(x) -> tuple[torch.Tensor, ...]:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _forward_backward(fn: Callable[..., Any], inputs: list[torch.Tensor], grad_out, backward: bool):
    outs = _as_tuple(fn(*inputs))
    if not backward:
        return outs, None
    grads = torch.autograd.grad(outs, inputs, tuple(g.to(o.dtype) for g, o in zip(grad_out, outs)),
                                allow_unused=True)
    return outs, grads


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_pair(engine: Callable[[], Any], sdpa: Callable[[], Any], device: torch.device) -> tuple[float, float]:
    """Median milliseconds of ``engine`` and of ``sdpa``, run alternately (engine, SDPA, engine, ...) so that
    both see the same machine load: at least 2 pairs (5 on CUDA, after one warm-up call of each: compiles and
    autotuning), more while the budget lasts (0.05 s on the CPU, 0.2 s on CUDA; at most 4 / 20 pairs)."""
    min_pairs, max_pairs, budget_s = (5, 20, 0.2) if device.type == "cuda" else (2, 4, 0.05)
    if device.type == "cuda":  # on the CPU the first call was the correctness check
        engine(), sdpa()
        _sync(device)
    times: tuple[list[float], list[float]] = ([], [])
    start = time.perf_counter()
    while len(times[0]) < max_pairs and (len(times[0]) < min_pairs or time.perf_counter() - start < budget_s):
        for fn, out in ((engine, times[0]), (sdpa, times[1])):
            t0 = time.perf_counter()
            fn()
            _sync(device)
            out.append((time.perf_counter() - t0) * 1e3)
    return tuple(sorted(t)[len(t) // 2] for t in times)


def _timed_call(problem: Problem, fn, inputs, backward: bool):
    """A closure running forward (and backward) of ``fn`` on fresh leaves of ``inputs``."""
    leaves = [t.detach().requires_grad_(backward) for t in inputs]

    def call():
        if backward:
            _forward_backward(fn, leaves, problem.grad_out, True)
        else:
            with torch.no_grad():
                fn(*leaves)

    return call


def _check_row(case: Case, engine: str, dtype_name: str, shape, device: torch.device, seed: int, timing: bool,
               interpreted: bool) -> dict[str, Any]:
    dtype = _DTYPES[dtype_name]
    b, h, hkv, n, d = shape
    row: dict[str, Any] = {
        "case": case.name, "family": case.family, "engine": engine, "dtype": dtype_name,
        "shape": {"B": b, "H": h, "Hkv": hkv, "L": n, "D": d}, "window": _window(case, shape),
        "status": None, "tolerance": TOLERANCE[dtype_name], "max_error": None, "errors": {}, "checked": [],
        "engine_ms": None, "sdpa_ms": None, "ratio_vs_sdpa": None, "timed": None, "note": None,
        "interpreted": interpreted,
    }
    g = torch.Generator().manual_seed(seed)
    try:
        problem = _BUILDERS[case.family](case, shape, dtype, device, g)
        names = [name for name, _ in problem.inputs]
        tensors = [t.detach().requires_grad_() for _, t in problem.inputs]
        why = problem.unsupported(engine, tensors)
    except Exception as exc:  # noqa: BLE001 - e.g. CUDA errors while building the inputs: a finding too
        row.update(status="error", note=f"setting up the inputs: {type(exc).__name__}: {exc}"[:2000])
        return row
    backward = True
    if why is not None:
        if engine == "flex" and "no backward" in why:  # FlexAttention on the CPU: the forward only, said so
            backward = False
            row["note"] = f"forward only: {why}"
        else:
            row.update(status="skip", note=why)
            return row
    try:
        with torch.set_grad_enabled(backward):
            outs, grads = _forward_backward(lambda *x: problem.run(engine, *x), tensors, problem.grad_out, backward)
        ref64 = [t.detach().double().requires_grad_() for t in tensors]
        refs, ref_grads = _forward_backward(problem.reference, ref64, problem.grad_out, backward)
    except Exception as exc:  # noqa: BLE001 - a crash is a finding: report it in the row, fail the run
        row.update(status="error", note=f"{type(exc).__name__}: {exc}"[:2000])
        return row
    errors = {}
    out_names = ["out"] if len(outs) == 1 else [f"out_{name}" for name in names[: len(outs)]]
    for name, got, want in zip(out_names, outs, refs):
        if got.shape != want.shape or got.dtype != dtype:
            row.update(status="fail", note=f"{name}: {tuple(got.shape)} {got.dtype}, expected "
                                             f"{tuple(want.shape)} {dtype}")
            return row
        errors[name] = _rel_err(got, want)
    if backward:
        # a gradient that is zero in exact arithmetic (e.g. a bias added to every logit of a head) is measured
        # against a floor: 1e-2 of the largest gradient of the row
        floor = GRAD_FLOOR * max((g.double().norm().item() for g in ref_grads if g is not None), default=0.0)
        for name, got, want in zip(names, grads, ref_grads):
            errors[f"d{name}"] = _rel_err(got, want, floor)
    row["errors"] = {name: (None if math.isinf(e) else e) for name, e in errors.items()}
    row["checked"] = list(errors)
    row["max_error"] = max(errors.values())
    if math.isinf(row["max_error"]):
        bad = [name for name, e in errors.items() if math.isinf(e)]
        row["max_error"] = None
        row["note"] = ((row["note"] + "; ") if row["note"] else "") + f"not finite or missing: {', '.join(bad)}"
    ok = row["max_error"] is not None and row["max_error"] <= row["tolerance"]
    row["status"] = "pass" if ok else "fail"
    if timing and not interpreted:
        row["timed"] = "fwd+bwd" if backward else "fwd"
        try:
            sdpa = dataclasses.replace(problem, grad_out=problem.grad_out[:1])
            row["engine_ms"], row["sdpa_ms"] = _time_pair(
                _timed_call(problem, lambda *x: problem.run(engine, *x), tensors, backward),
                _timed_call(sdpa, _sdpa, list(problem.qkv), backward), device)
            row["ratio_vs_sdpa"] = row["engine_ms"] / row["sdpa_ms"] if row["sdpa_ms"] else None
        except Exception as exc:  # noqa: BLE001 - timing is informative; its failure is noted, not failed
            row["note"] = ((row["note"] + "; ") if row["note"] else "") + f"timing failed: {type(exc).__name__}: {exc}"
    elif interpreted:
        row["note"] = ((row["note"] + "; ") if row["note"] else "") + "Triton's interpreter: not timed"
    return row


# -- the run ---------------------------------------------------------------------------------------------


def _parse_list(value: str | Sequence[str] | None, allowed: Sequence[str], what: str) -> list[str] | None:
    if value is None:
        return None
    items = [x.strip() for x in (value.split(",") if isinstance(value, str) else value) if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise ValueError(f"unknown {what} {bad or items!r}; allowed: {', '.join(allowed)}")
    return items


def _dtype_names(dtypes: str | Sequence[str] | None, device: torch.device, quick: bool) -> list[str]:
    if dtypes is None:
        if device.type != "cuda":
            return ["float32"]
        return ["bfloat16"] if quick else ["float32", "bfloat16"]
    items = [x.strip() for x in (dtypes.split(",") if isinstance(dtypes, str) else dtypes) if x.strip()]
    bad = [x for x in items if x not in _DTYPE_ALIASES]
    if bad or not items:
        raise ValueError(f"unknown dtypes {bad or items!r}; allowed: {', '.join(_DTYPE_ALIASES)}")
    return list(dict.fromkeys(_DTYPE_ALIASES[x] for x in items))


def _plan(cases: list[Case], engines: list[str], dtypes: list[str]) -> list[tuple[Case, str, str]]:
    return [(case, engine, dtype) for engine in ENGINES if engine in engines for case in cases
            if engine in case.engines for dtype in dtypes]


def _summary(rows: list[dict]) -> dict[str, int]:
    counts = {status: sum(r["status"] == status for r in rows) for status in ("pass", "fail", "error", "skip")}
    counts["forward_only"] = sum(r["status"] == "pass" and r["timed"] != "fwd+bwd" and "dq" not in r["checked"]
                                 for r in rows)
    counts["rows"] = len(rows)
    return counts


class _Progress:
    """tqdm on stderr when asked for, else nothing."""

    def __init__(self, total: int, enabled: bool) -> None:
        self._bar = None
        if enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc="hf-posenc doctor", unit="check", file=sys.stderr, leave=False,
                             dynamic_ncols=True)

    def step(self, label: str) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(label, refresh=False)
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def doctor(
    *,
    device: str | torch.device | None = None,
    dtypes: str | Sequence[str] | None = None,
    engines: str | Sequence[str] | None = None,
    cases: str | Sequence[str] | None = None,
    quick: bool = False,
    timing: bool = True,
    out: str | os.PathLike | None = None,
    progress: bool = False,
    verbose: bool = True,
    seed: int = 0,
) -> dict[str, Any]:
    """Check every engine available here against the reference; return the report (and write it to ``out``).

    Args:
        device: where to run (default: ``cuda`` when available, else ``cpu``).
        dtypes: input dtypes (``float32``/``fp32``, ``bfloat16``/``bf16``, ``float16``/``fp16``; a list or a
            comma-separated string). Default: float32 and bfloat16 on CUDA (bfloat16 with ``quick``), float32
            on the CPU.
        engines: a subset of :data:`ENGINES` (default: all).
        cases: a subset of the names in :data:`CASES` (default: all, or :data:`QUICK_CASES` with ``quick``).
        quick: fewer cases (one per family) and, on CUDA, one dtype.
        timing: time each row's engine against SDPA (rows run in Triton's interpreter are never timed).
        out: a path; the JSON report is written there after every row (a run cut short leaves the rows done,
            with ``complete: false``).
        progress: show a progress bar (tqdm, on stderr).
        verbose: print the report as a text summary when done (stdout).
        seed: seed of the random inputs.

    Returns:
        the report (see docs/doctor.md): ``schema``, ``ok``, ``complete``, ``versions``, ``device``,
        ``environment``, ``settings``, ``rows``, ``summary``, ``defaults``, ``seconds``.

    Raises:
        ValueError: an unknown device, dtype, engine or case.
    """
    t0 = time.time()
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device} was asked for, but torch.cuda.is_available() is False")
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"the doctor runs on cuda or cpu, got {device}")
    engine_list = _parse_list(engines, ENGINES, "engines") or list(ENGINES)
    names = [c.name for c in CASES]
    case_names = _parse_list(cases, names, "cases") or (list(QUICK_CASES) if quick else names)
    case_list = [c for c in CASES if c.name in case_names]
    dtype_list = _dtype_names(dtypes, device, quick)
    interpreted = device.type != "cuda" and _interpreting()
    env = environment(device)
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "ok": None,
        "complete": False,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **env,
        "settings": {"device": str(device), "dtypes": dtype_list, "engines": engine_list, "cases": case_names,
                     "shape": _shape_dict(SHAPE), "shape_interpreted": _shape_dict(SHAPE_INTERPRETED),
                     "tiles": list(TILES), "tolerance": dict(TOLERANCE), "timing": timing, "seed": seed,
                     "reference": "float64, the package's full-matrix references, on the same rounded inputs"},
        "rows": [],
        "summary": {},
        "defaults": default_backends(device),
        "seconds": None,
    }
    plan = _plan(case_list, engine_list, dtype_list)
    bar = _Progress(len(plan), progress)
    tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # float32 means float32
    # FlexAttention compiles once per term kind, dtype and window on CUDA: more than dynamo's default limit of
    # recompilations (past it, flex would run uncompiled and be timed so)
    dynamo = torch._dynamo.config
    limit_name = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"
    limit = getattr(dynamo, limit_name)
    setattr(dynamo, limit_name, max(limit, 8 * len(plan)))
    try:
        for case, engine, dtype in plan:
            shape = SHAPE_INTERPRETED if (engine == "triton" and interpreted) else SHAPE
            # the same inputs for every engine of a case and dtype, whatever else was selected
            case_seed = seed + 1000 * CASES.index(case) + list(_DTYPES).index(dtype)
            row = _check_row(case, engine, dtype, shape, device, case_seed, timing,
                             engine == "triton" and interpreted)
            report["rows"].append(row)
            report["summary"] = _summary(report["rows"])
            report["seconds"] = round(time.time() - t0, 1)
            bar.step(f"{case.name} {engine} {dtype}: {row['status']}")
            if out is not None:
                _write(report, out)
    finally:
        bar.close()
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
        setattr(dynamo, limit_name, limit)
    report["summary"] = _summary(report["rows"])
    report["ok"] = report["summary"]["fail"] == 0 and report["summary"]["error"] == 0
    report["complete"] = True
    report["seconds"] = round(time.time() - t0, 1)
    if out is not None:
        _write(report, out)
    if verbose:
        print(format_report(report))
    return report


def merge_reports(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One report from the reports of separate runs (e.g. one process per case, so that a kernel that corrupts
    the CUDA context -- an illegal memory access -- costs only its own case's rows): the rows concatenated, the
    summary recomputed, ``ok`` and ``complete`` only if every part was, ``settings['cases']`` joined."""
    if not reports:
        raise ValueError("merge_reports needs at least one report")
    merged = copy.deepcopy(reports[0])
    merged["rows"] = [row for r in reports for row in r.get("rows", [])]
    merged["settings"]["cases"] = [c for r in reports for c in r.get("settings", {}).get("cases", [])]
    merged["summary"] = _summary(merged["rows"])
    merged["complete"] = all(r.get("complete") for r in reports)
    merged["ok"] = bool(all(r.get("ok") for r in reports) and merged["summary"]["fail"] == 0
                        and merged["summary"]["error"] == 0)
    merged["seconds"] = round(sum(r.get("seconds") or 0.0 for r in reports), 1)
    return merged


def _shape_dict(shape) -> dict[str, int]:
    return dict(zip(("B", "H", "Hkv", "L", "D"), shape))


def _write(report: dict, out: str | os.PathLike) -> None:
    path = Path(out)
    if path.parent != Path(""):
        path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, allow_nan=False) + "\n")
    tmp.replace(path)


# -- text ------------------------------------------------------------------------------------------------


def _fmt(x: float | None, spec: str) -> str:
    """``x`` formatted with ``spec`` (e.g. ``"9.2e"``), or a dash of the same width for None."""
    width = int(spec.split(".")[0] or 0)
    return "-".rjust(width) if x is None else format(x, spec)


def format_report(report: dict) -> str:
    """The report as text: versions and device, one line per row run, skipped engines, default backends."""
    v, dev = report["versions"], report["device"]
    lines = ["hf-posenc doctor", ""]
    lines.append("versions: " + ", ".join(f"{k} {v[k] or '-'}" for k in v))
    cap = f", compute capability {dev['capability']}, {dev['sm_count']} SMs, {dev['memory_gib']} GiB" \
        if dev["type"] == "cuda" else f", {dev.get('threads')} threads"
    lines.append(f"device: {dev['type']} ({dev['name']}{cap})")
    env = {k: val for k, val in report["environment"].items() if val is not None}
    lines.append("environment: " + (", ".join(f"{k}={val}" for k, val in env.items()) or "-")
                 + f"; Triton interpreter: {'on' if report['triton_interpreter'] else 'off'}")
    lines += ["", "checks: relative error of the output and of every gradient against the float64 reference (max err); "
                  "median ms", "of forward+backward, alternating with SDPA (causal, no bias) on the same shape:", ""]
    header = f"{'case':14s} {'engine':7s} {'dtype':9s} {'L':>4s} {'max err':>9s} {'tol':>7s} {'status':6s} " \
             f"{'ms':>8s} {'sdpa ms':>8s} {'x sdpa':>7s}  note"
    lines += [header, "-" * len(header)]
    skipped: dict[tuple[str, str], list[str]] = {}
    for r in report["rows"]:
        if r["status"] == "skip":
            skipped.setdefault((r["engine"], r["note"]), []).append(f"{r['case']} {r['dtype']}")
            continue
        status = r["status"].upper() if r["status"] != "pass" else "pass"
        worst = ""
        if r["status"] == "fail" and r["errors"]:
            bad = [k for k, e in r["errors"].items() if e is None or e > r["tolerance"]]
            worst = "over tolerance: " + ", ".join(bad)
        note = r["note"] or ""
        if note.startswith("forward only") and r["engine"] == "flex":
            note = f"forward only (FlexAttention has no backward on {report['device']['type']})"
        note = "; ".join(x for x in (worst, note) if x)
        lines.append(f"{r['case']:14s} {r['engine']:7s} {r['dtype']:9s} {r['shape']['L']:>4d} "
                     f"{_fmt(r['max_error'], '9.2e')} {r['tolerance']:7.0e} {status:6s} {_fmt(r['engine_ms'], '8.2f')} "
                     f"{_fmt(r['sdpa_ms'], '8.2f')} {_fmt(r['ratio_vs_sdpa'], '7.2f')}  {note}")
    for (engine, why), which in skipped.items():
        lines.append(f"skipped {engine} ({len(which)} checks): {why}")
    lines += ["", f"default backends on {report['device']['type']} (HF_POSENC_BACKEND="
                  f"{report['environment'].get('HF_POSENC_BACKEND') or 'unset'}):", ""]
    for d in report["defaults"]:
        rot = f", rotation {d['rotation']}" if d["rotation"] else ""
        lines.append(f"{d['encoding']:11s} {d['attention']}{rot}: {d['why']}")
    s = report["summary"]
    verdict = "OK" if report["ok"] else ("FAILED" if report["ok"] is False else "INCOMPLETE")
    lines += ["", f"{verdict}: {s.get('pass', 0)} passed ({s.get('forward_only', 0)} forward only), "
                  f"{s.get('fail', 0)} failed, {s.get('error', 0)} errors, {s.get('skip', 0)} skipped "
                  f"in {report['seconds']} s"]
    if not report["ok"]:
        lines.append("Please attach the JSON report (hf-posenc doctor --out report.json) to a bug report.")
    return "\n".join(lines)


# -- command line ----------------------------------------------------------------------------------------

DESCRIPTION = """\
Check hf_posenc's engines on this machine: every engine available here (Triton kernels on CUDA,
FlexAttention, the tile-wise PyTorch engines) against the package's float64 references on small shapes,
forward and gradients, timed against SDPA; then which backend each encoding uses here by default, and why.
The exit status is 1 when a check fails. Attach the --out report to bug reports."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``hf-posenc doctor`` (also ``python -m hf_posenc doctor``)."""
    p.add_argument("--out", metavar="PATH", help="write the JSON report here (rewritten after every check)")
    p.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    p.add_argument("--dtype", dest="dtypes", metavar="DTYPES",
                   help="comma-separated: float32 (fp32), bfloat16 (bf16), float16 (fp16); default fp32,bf16 on "
                        "CUDA, fp32 on the CPU")
    p.add_argument("--engines", metavar="LIST", help=f"comma-separated subset of {','.join(ENGINES)}")
    p.add_argument("--cases", metavar="LIST", help="comma-separated subset of " + ",".join(c.name for c in CASES))
    p.add_argument("--quick", action="store_true", help="one case per family (and one dtype on CUDA)")
    p.add_argument("--no-timing", dest="timing", action="store_false", help="skip the timings against SDPA")
    p.add_argument("--interpret", action="store_true",
                   help="CPU: run the Triton kernels in Triton's interpreter (tiny shapes; slow). The doctor "
                        "re-runs itself with TRITON_INTERPRET=1 when triton was already imported without it")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")


def _argv_of(args: argparse.Namespace) -> list[str]:
    """The command-line options that give ``args`` (to re-run the doctor in a child process)."""
    argv = []
    for name in ("out", "device", "dtypes", "engines", "cases"):
        value = getattr(args, name)
        if value is not None:
            argv += [f"--{'dtype' if name == 'dtypes' else name}", str(value)]
    argv += ["--seed", str(args.seed)]
    argv += [flag for flag, on in (("--quick", args.quick), ("--no-timing", not args.timing),
                                   ("--interpret", args.interpret), ("--no-progress", not args.progress)) if on]
    return argv


def run_cli(args: argparse.Namespace) -> int:
    """Run the doctor from parsed arguments; 0 when every check passed, 1 otherwise, 2 on bad arguments."""
    on_cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    if args.interpret and on_cuda:
        print("hf-posenc doctor: --interpret runs the Triton kernels in Triton's CPU interpreter; with a CUDA "
              "device they run compiled (give --device cpu to interpret them)", file=sys.stderr)
        return 2
    if args.interpret and not _interpreter_ready():
        if os.environ.get("_HF_POSENC_DOCTOR_CHILD"):
            print("hf-posenc doctor: TRITON_INTERPRET=1 did not take effect", file=sys.stderr)
            return 2
        cmd = [sys.executable, "-m", "hf_posenc", "doctor", *_argv_of(args)]
        env = dict(os.environ, TRITON_INTERPRET="1", _HF_POSENC_DOCTOR_CHILD="1")
        return subprocess.run(cmd, env=env).returncode
    try:
        report = doctor(device=args.device, dtypes=args.dtypes, engines=args.engines, cases=args.cases,
                        quick=args.quick, timing=args.timing, out=args.out, progress=args.progress, seed=args.seed)
    except ValueError as exc:
        print(f"hf-posenc doctor: {exc}", file=sys.stderr)
        return 2
    if args.out:
        print(f"report written to {args.out}")
    return 0 if report["ok"] else 1


def _interpreter_ready() -> bool:
    """Whether Triton's interpreter can run every kernel now: TRITON_INTERPRET was set before triton's import."""
    if not _interpreting():
        return False
    from .kernels.attention import _triton_import_error

    if _triton_import_error() is not None:
        return True  # no triton: nothing to interpret, the rows say so
    from .kernels.attention.triton_attention import stdlib_matches_mode

    return stdlib_matches_mode()
