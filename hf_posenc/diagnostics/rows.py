"""Running one row of the doctor: an engine's forward and gradients against the float64 reference, and its time
against SDPA's."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable

import torch

from .cases import Case, Problem, _sdpa, _window, build_problem

__all__ = ["GRAD_FLOOR", "TOLERANCE", "check_row"]

#: largest relative error ||engine − reference|| / ||reference|| allowed, per input dtype, for the output and
#: every gradient. float32: the engines sum in another order (the term gradients are sums over all pairs;
#: on a GPU the kernels' float32 dots are 3xTF32). bfloat16 / float16: inputs, probabilities and gradients
#: are rounded to 8 / 11 bits of mantissa inside the engines.
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 1e-2}
#: the error of a gradient is relative to its reference's norm, or to this fraction of the largest reference
#: gradient norm of the row when that is larger (gradients that vanish in exact arithmetic).
GRAD_FLOOR = 1e-2
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

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


def check_row(case: Case, engine: str, dtype_name: str, shape, device: torch.device, seed: int, timing: bool,
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
        problem = build_problem(case, shape, dtype, device, g)
        names = [name for name, _ in problem.inputs]
        tensors = [t.detach().requires_grad_() for _, t in problem.inputs]
    except Exception as exc:  # noqa: BLE001 - e.g. CUDA errors while building the inputs: a finding too
        row.update(status="error", note=f"setting up the inputs: {type(exc).__name__}: {exc}"[:2000])
        return row
    try:
        why = problem.unsupported(engine, tensors)
    except Exception as exc:  # noqa: BLE001 - e.g. a kernel module that fails to import (KernelImportError)
        row.update(status="error", note=f"asking whether {engine} runs here: {type(exc).__name__}: {exc}"[:2000])
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
