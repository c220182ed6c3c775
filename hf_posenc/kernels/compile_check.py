"""Compile hf_posenc's Triton kernels ahead of time for NVIDIA targets, on a machine without a GPU.

    python -m hf_posenc.kernels.compile_check                 # sm_90 and sm_80, the representative matrix
    python -m hf_posenc.kernels.compile_check --matrix full --arch 90 --json out.json

The project's own launchers (``fused_attention``, ``sba_triton``, ``cope_triton``, ``rotary_qk`` /
``rotary_single``) are called on small CPU tensors, forward and backward, while a stand-in Triton driver
reports a CUDA target (``GPUTarget("cuda", arch, 32)``) and ``JITFunction.run`` only compiles
(``warmup=True``): every launch goes through Triton's own argument specialisation with the tiles, warps and
stages the launcher picks for that dtype and head dim, down to a cubin by the ptxas Triton ships. Nothing
runs on a device: this finds compile errors, shared memory over the target's per-block limit and register
spills (from the ``ptxas -v`` log), not wrong results or timings.

``TRITON_INTERPRET`` must be unset (run it in its own process: the test-suite sets it). The exit status is
1 when a compilation failed, went over the shared-memory limit, or a launcher raised; spills are reported.
Works with Triton 3.6 (the GPU machines') and later 3.x.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Callable

__all__ = ["MATRICES", "SMEM_LIMIT", "Record", "cases", "run", "main", "ptxas_available"]

#: per-block shared memory a kernel may opt in to, bytes (CUDA programming guide, "Technical Specifications").
SMEM_LIMIT = {90: 232448, 80: 166912}

#: constexpr arguments named in a record (tiles and dims).
_CONFIG_KEYS = ("TERM", "HEAD_D", "D", "BLOCK_D", "BD", "BLOCK_M", "BM", "BLOCK_N", "BN", "BLOCK_L", "S", "NP",
                "RP", "NHP", "PREC", "TPREC", "HAS_MASK", "HAS_VALID", "CAUSAL", "HAS_WINDOW", "HAS_SINK",
                "SINK_CACHE")


@dataclass
class Record:
    """One distinct compilation."""

    arch: int
    kernel: str
    dtype: str
    config: str
    warps: int | None
    stages: int | None
    case: str
    status: str = "ok"
    error: str = ""
    shared: int | None = None
    regs: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None

    @property
    def over_smem(self) -> bool:
        return self.shared is not None and self.shared > SMEM_LIMIT[self.arch]

    @property
    def spills(self) -> bool:
        return bool(self.spill_stores or self.spill_loads)


class _State:
    def __init__(self) -> None:
        self.arch = 90
        self.case = ""
        self.records: list[Record] = []
        self.seen: set = set()
        self.ptxas_logs: list[str] = []


def ptxas_available() -> str | None:
    """None when Triton and its bundled ptxas are present, else why not (a sentence)."""
    try:
        import triton
        from triton.backends.compiler import GPUTarget  # noqa: F401
    except ImportError as exc:
        return f"triton is not installed ({exc})"
    from pathlib import Path

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    env = os.environ.get("TRITON_PTXAS_PATH")
    if not ptxas.exists() and not (env and Path(env).exists()):
        return f"Triton's ptxas is missing ({ptxas}); set TRITON_PTXAS_PATH"
    return None


@contextlib.contextmanager
def _hooks(state: _State):
    """A driver that reports the CUDA target ``state.arch``, compile-only launches, the ptxas logs."""
    import torch
    import triton.backends.nvidia.compiler as nvc
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    class TargetOnlyDriver:
        def get_current_device(self):
            return state.arch  # one JIT cache per target

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", state.arch, 32)

        def is_active(self):
            return True

    real_run = JITFunction.run
    real_subprocess = nvc.subprocess

    def compile_only(self, *args, **kwargs):
        kwargs["warmup"] = True
        consts, dtype = {}, ""
        for i, p in enumerate(self.params):
            value = kwargs.get(p.name, args[i] if i < len(args) else None)
            if p.is_constexpr:
                consts[p.name] = value
            elif not dtype and isinstance(value, torch.Tensor):
                dtype = str(value.dtype).replace("torch.", "")
        config = ",".join(f"{k}={consts[k]}" for k in _CONFIG_KEYS if k in consts)
        flags = ",".join(f"{k}={v}" for k, v in sorted(consts.items()) if k not in _CONFIG_KEYS)
        rec = Record(state.arch, self.fn.__name__, dtype, config + (f" [{flags}]" if flags else ""),
                     kwargs.get("num_warps"), kwargs.get("num_stages"), state.case)
        state.ptxas_logs.clear()
        out, err = io.StringIO(), None
        with contextlib.redirect_stdout(out):
            try:
                kernel = real_run(self, *args, **kwargs)
            except Exception as exc:  # a compile error: record it, let the launcher go on
                kernel, err = None, exc
        if err is not None:
            text = f"{type(err).__name__}: {err}".splitlines()
            rec.status, rec.error = "FAIL", " | ".join(text[:3] + text[-2:] if len(text) > 5 else text)[:800]
        else:
            _resources(rec, kernel, "\n".join(state.ptxas_logs))
        key = (rec.arch, rec.kernel, rec.dtype, rec.config, rec.warps, rec.stages)
        if key not in state.seen:
            state.seen.add(key)
            state.records.append(rec)
        return None  # nothing launches

    class SubprocessProxy:
        def __getattr__(self, name):
            return getattr(real_subprocess, name)

        @staticmethod
        def run(cmd, *a, **kw):
            result = real_subprocess.run(cmd, *a, **kw)
            log = kw.get("stderr")
            if isinstance(cmd, (list, tuple)) and cmd and "ptxas" in os.path.basename(str(cmd[0])):
                with contextlib.suppress(OSError, TypeError):
                    with open(log.name) as f:
                        state.ptxas_logs.append(f.read())
            return result

    previous = getattr(driver, "_active", None)  # None on a machine without a GPU (no driver is active)
    driver.set_active(TargetOnlyDriver())
    JITFunction.run = compile_only
    nvc.subprocess = SubprocessProxy()
    try:
        yield
    finally:
        JITFunction.run = real_run
        nvc.subprocess = real_subprocess
        driver._active = previous


def _resources(rec: Record, kernel, log: str) -> None:
    md = kernel.metadata
    rec.shared = int(getattr(md, "shared", 0) or 0)
    rec.warps = getattr(md, "num_warps", rec.warps)
    rec.stages = getattr(md, "num_stages", rec.stages)
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if m:
        rec.spill_stores, rec.spill_loads = int(m.group(2)), int(m.group(3))
    m = re.search(r"Used (\d+) registers", log)
    if m:
        rec.regs = int(m.group(1))


# -- cases: the launchers on CPU tensors ---------------------------------------------------------------

B, H, HKV, L = 1, 4, 2, 128


def _rand(shape, dtype, grad):
    import torch

    return torch.randn(*shape).to(dtype).requires_grad_(grad)


def _attention(kind: str, dtype, d: int, causal=True, padded=True, hkv=HKV, lq=L, train=True, window=None,
               sink=None, sink_positions=None):
    import torch

    from .attention.terms import example_term
    from .attention.triton_attention import fused_attention

    def fn():
        # the term's registry example (random tensors of the term's shapes; gradients where it takes them)
        with torch.set_grad_enabled(train):
            term, _ = example_term(kind, (B, H, hkv, lq, L, d), L - lq, torch.Generator().manual_seed(0),
                                   realistic=True)
        q = _rand((B, H, lq, d), dtype, train)
        k, v = _rand((B, hkv, L, d), dtype, train), _rand((B, hkv, L, d), dtype, train)
        valid = torch.ones(B, L, dtype=torch.bool) if padded else None
        out = fused_attention(q, k, v, term, scale=d**-0.5, causal=causal, q_offset=L - lq, key_valid=valid,
                              window=window, sink=sink, sink_positions=sink_positions)
        if train:
            out.float().sum().backward()

    label = f"attention {kind} {dtype} D{d}{'' if causal else ' bidir'}{' padded' if padded else ''} G{H // hkv}"
    cache = " at cache positions" if sink_positions == "cache" else ""
    return label + f" Lq{lq}{'' if train else ' fwd'}{f' window{window}' if window else ''}{_sink(sink)}{cache}", fn


def _sink(sink) -> str:
    return f" sink{sink}" if sink else ""


def _sba(dtype, d: int, attend_current=False, remainder="discard", mask=True, train=True, lq=L, window=None,
         sink=None):
    import torch

    from .sba.triton_sba import sba_triton

    def fn():
        q = _rand((B, H, lq, d), dtype, train)
        k, v = _rand((B, HKV, L, d), dtype, train), _rand((B, HKV, L, d), dtype, train)
        m = torch.ones(B, 1, L, L, dtype=torch.bool).tril()[:, :, L - lq:] if mask else None
        bias = _rand((H, d), dtype, train) if remainder == "bias" else None
        out = sba_triton(q, k, v, m, d**-0.5, L - lq, attend_current, remainder, bias, window=window, sink=sink)
        if train:
            out.float().sum().backward()

    label = f"sba {dtype} D{d} ac={int(attend_current)} {remainder}{' mask' if mask else ''} Lq{lq}"
    return label + (f" window{window}" if window else "") + _sink(sink), fn


def _cope(dtype, d: int, npos=64, mask=True, train=True, lq=L, tf32=False, window=None, sink=None):
    import torch

    from .cope.triton_cope import cope_triton

    def fn():
        q = _rand((B, H, lq, d), dtype, train)
        k, v = _rand((B, HKV, L, d), dtype, train), _rand((B, HKV, L, d), dtype, train)
        table = _rand((d, npos), dtype, train)
        m = torch.ones(B, 1, L, L, dtype=torch.bool).tril()[:, :, L - lq:] if mask else None
        old = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = tf32
        try:
            out = cope_triton(q, k, v, table, m, d**-0.5, L - lq, window=window, sink=sink)
            if train:
                out.float().sum().backward()
        finally:
            torch.backends.cuda.matmul.allow_tf32 = old

    label = f"cope {dtype} D{d} npos{npos}{' mask' if mask else ''} Lq{lq}{' tf32' if tf32 else ''}"
    return label + (f" window{window}" if window else "") + _sink(sink), fn


def _rotary(dtype, d: int, s: int, learned: bool, single=False):
    import torch

    from .rotary.triton_rotary import rotary_qk, rotary_single

    def fn():
        rot = _rand((1, 1, L, d // s, s, s), torch.float32, learned)
        k = _rand((B, HKV, L, d), dtype, True)
        if single:
            rotary_single(k, rot).float().sum().backward()
        else:
            qo, ko = rotary_qk(_rand((B, H, L, d), dtype, True), k, rot)
            (qo.float().sum() + ko.float().sum()).backward()

    return f"rotary {dtype} D{d} s{s} {'learned' if learned else 'fixed'}{' single' if single else ''}", fn


def _remap(dtype, d: int, train=True, hkv=HKV, lq=L):
    """One piece of the remap engine (`remap.triton_span`): a random interval of keys per query."""
    import torch

    from .remap.triton_span import span_backward, span_forward

    def fn():
        q = _rand((B, H, lq, d), dtype, False)
        k, v = _rand((B, hkv, L, d), dtype, False), _rand((B, hkv, L, d), dtype, False)
        lo = torch.randint(0, L // 2, (B, lq), dtype=torch.int32)
        hi = torch.clamp(lo + L // 4, max=L).to(torch.int32)
        _, lse = span_forward(q, k, v, lo, hi, d**-0.5)
        if train:
            span_backward(q, q, k, v, lse, lse, lo, hi, d**-0.5)

    return f"remap {dtype} D{d} G{H // hkv} Lq{lq}{'' if train else ' fwd'}", fn


MATRICES = ("gate", "gate-backward", "representative", "full")


def cases(matrix: str = "representative") -> list[tuple[str, Callable[[], None]]]:
    """(label, function) of each launch to compile, for one of ``MATRICES``.

    * ``gate`` (the test-suite's default; about a minute of CPU): the forward kernel of every family at the
      largest head dim (128), each dtype once: CoPE in float32 (the largest shared-memory footprint), the
      attention kernel with FoX's term in bfloat16, stick-breaking in float16, the remap engine's piece in
      bfloat16; the rotary kernel forward and backward in bfloat16.
    * ``gate-backward``: the backward kernels of the same launches (several minutes of CPU).
    * ``representative``: every kernel and term kind at D = 128 forward and backward, each dtype at least
      once (float32 where it costs the most), head dim 40 (padded) once per family, decode (one query) once,
      and each family once with a sliding window (``HAS_WINDOW``; the size is a runtime argument) and once with a
      window and attention sinks (``HAS_SINK``; a runtime argument too); the Toeplitz terms with their own branch
      once more with the sinks at their cache positions (``SINK_CACHE``).
    * ``full``: every term kind x dtype x head dim (40, 64, 128) with and without padding / masks, MHA and
      decode, and the options of sba and cope.
    """
    import torch

    from .attention.terms import TERMS

    #: every term the Triton kernel runs, on its own branch or another's (dpb: t5's, with a table of 2L − 1 rows)
    triton_terms = tuple(kind for kind, spec in TERMS.items() if spec.triton is not None)
    #: those whose branch takes the sinks at their cache positions (SINK_CACHE): the Toeplitz terms
    toeplitz = tuple(kind for kind in triton_terms if TERMS[kind].form == "toeplitz")
    if matrix not in MATRICES:
        raise ValueError(f"matrix must be one of {MATRICES}, got {matrix!r}")
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    out = []
    if matrix == "gate":
        return [_cope(f32, 128, npos=256, train=False), _attention("fox", bf16, 128, train=False),
                _sba(f16, 128, train=False), _remap(bf16, 128, train=False), _rotary(bf16, 128, 8, True)]
    if matrix == "gate-backward":
        return [_cope(f32, 128, npos=256), _attention("fox", bf16, 128), _sba(f16, 128), _remap(bf16, 128)]
    if matrix == "representative":
        dtypes = {kind: [bf16] for kind in triton_terms}
        dtypes["none"] = [f32, bf16, f16]
        dtypes["fire"] = [bf16, f32]
        dtypes["shaw"] = [bf16, f32]
        for kind in triton_terms:
            for dt in dtypes[kind]:
                out.append(_attention(kind, dt, 128))
        out += [_attention("alibi", f16, 40, padded=False), _attention("none", bf16, 128, lq=1, train=False)]
        out += [_sba(f32, 128), _sba(bf16, 128, True, "bias"), _sba(f16, 40, False, "current", mask=False)]
        out += [_cope(f32, 128), _cope(f32, 128, npos=256), _cope(bf16, 128, npos=256), _cope(f16, 40, mask=False)]
        out += [_rotary(bf16, 128, 8, True), _rotary(f32, 128, 2, False), _rotary(f16, 40, 4, True, single=True)]
        out += [_remap(f32, 128), _remap(bf16, 128), _remap(f16, 40, hkv=H), _remap(bf16, 128, train=False, lq=1)]
        out += [_attention("fox", bf16, 128, window=64), _attention("t5", bf16, 128, causal=False, window=64),
                _sba(bf16, 128, window=64), _cope(bf16, 128, window=64)]
        out += [_attention("alibi", bf16, 128, window=64, sink=4),
                _attention("shaw", f32, 128, causal=False, window=64, sink=4),
                _sba(bf16, 128, window=64, sink=4), _cope(f32, 128, window=64, sink=4)]
        out += [_attention(kind, bf16, 128, window=64, sink=4, sink_positions="cache") for kind in toeplitz]
        return out
    for kind in triton_terms:
        for dt in (f32, bf16, f16):
            for d in (40, 64, 128):
                for causal, padded in ((True, True), (True, False), (False, True)):
                    out.append(_attention(kind, dt, d, causal, padded))
            out.append(_attention(kind, dt, 128, hkv=H))
            out.append(_attention(kind, dt, 128, lq=1, train=False))
            out.append(_attention(kind, dt, 128, window=64))
            out.append(_attention(kind, dt, 128, causal=False, window=64))
            out.append(_attention(kind, dt, 128, window=64, sink=4))
            if kind in toeplitz:
                out.append(_attention(kind, dt, 128, window=64, sink=4, sink_positions="cache"))
    for dt in (f32, bf16, f16):
        for d in (40, 64, 128):
            for ac, rem, mask in ((False, "discard", True), (True, "current", False), (False, "bias", True)):
                out.append(_sba(dt, d, ac, rem, mask))
            out.append(_sba(dt, d, lq=1, train=False))
            out.append(_sba(dt, d, window=64))
            out.append(_sba(dt, d, window=64, sink=4))
            for npos, mask in ((64, True), (256, False), (16, True)):
                out.append(_cope(dt, d, npos, mask))
            out.append(_cope(dt, d, lq=1, train=False))
            out.append(_cope(dt, d, window=64))
            out.append(_cope(dt, d, window=64, sink=4))
            if dt == f32:
                out.append(_cope(dt, d, tf32=True))
            out += [_remap(dt, d), _remap(dt, d, hkv=H), _remap(dt, d, train=False, lq=1)]
            for s in (2, 4, 8):
                out.append(_rotary(dt, d, s, True))
                out.append(_rotary(dt, d, s, False, single=True))
    return out


def run(archs=(90, 80), matrix: str = "representative", select: str | None = None, verbose: bool = False) -> dict:
    """Compile every case for every target; a dict with the records, launcher errors and a summary line."""
    if os.environ.get("TRITON_INTERPRET", "0").strip().lower() not in ("", "0", "false", "off", "no"):
        raise RuntimeError("TRITON_INTERPRET is set: unset it (this compiles the kernels)")
    why = ptxas_available()
    if why is not None:
        raise RuntimeError(why)
    import torch

    torch.manual_seed(0)
    state = _State()
    errors = []
    todo = [c for c in cases(matrix) if select is None or re.search(select, c[0])]
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="hf_posenc_aot_") as cache:
        old_cache = os.environ.get("TRITON_CACHE_DIR")
        os.environ["TRITON_CACHE_DIR"] = cache  # a fresh cache: ptxas runs, its log is read
        try:
            with _hooks(state):
                for arch in archs:
                    state.arch = arch
                    for label, fn in todo:
                        state.case = label
                        n = len(state.records)
                        try:
                            fn()
                        except Exception as exc:  # the launcher failed outside the compiler
                            errors.append(f"sm_{arch} {label}: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
                        if verbose:
                            for rec in state.records[n:]:
                                print(format_record(rec), flush=True)
        finally:
            if old_cache is None:
                os.environ.pop("TRITON_CACHE_DIR", None)
            else:
                os.environ["TRITON_CACHE_DIR"] = old_cache
    recs = state.records
    n_fail = sum(r.status != "ok" for r in recs)
    n_smem = sum(r.over_smem for r in recs)
    n_spill = sum(r.spills for r in recs)
    summary = (f"{len(recs) - n_fail} compiled, {n_fail} failed, {n_smem} over shared-memory limit, "
               f"{n_spill} with spills ({len(todo)} cases x {len(archs)} targets, {len(errors)} launcher errors, "
               f"{time.time() - t0:.0f}s)")
    return {"records": [asdict(r) | {"over_smem": r.over_smem, "spills": r.spills} for r in recs],
            "launcher_errors": errors, "summary": summary,
            "ok": not (n_fail or n_smem or errors)}


def format_record(r: Record) -> str:
    spill = f"{r.spill_stores}/{r.spill_loads}" if r.spill_stores is not None else "-"
    return (f"sm_{r.arch} {r.kernel:18s} {r.dtype:8s} w{r.warps} s{r.stages} {r.status:4s} "
            f"smem {r.shared}{'!' if r.over_smem else ''}/{SMEM_LIMIT[r.arch]} regs {r.regs} spill {spill:>9s}  "
            f"{r.config}  [{r.case}]" + (f"\n    error: {r.error}" if r.error else ""))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, nargs="+", default=[90, 80], choices=sorted(SMEM_LIMIT))
    p.add_argument("--matrix", default="representative", choices=MATRICES,
                   help="gate: 5 launches per target; gate-backward; representative (default); full: every combination")
    p.add_argument("--select", default=None, help="only the cases whose label matches this regular expression")
    p.add_argument("--json", default=None, help="write the records to this file")
    p.add_argument("-v", "--verbose", action="store_true", help="print each compilation as it is done")
    args = p.parse_args(argv)
    result = run(tuple(args.arch), args.matrix, args.select, args.verbose)
    recs = [Record(**{k: v for k, v in r.items() if k not in ("over_smem", "spills")}) for r in result["records"]]
    bad = [r for r in recs if r.status != "ok" or r.over_smem]
    if bad:
        print("# failed or over the shared-memory limit")
        for r in bad:
            print(format_record(r))
    spilling = sorted((r for r in recs if r.spills), key=lambda r: -(r.spill_stores or 0))
    if spilling:
        print("# register spills (bytes per thread, stores/loads)")
        for r in spilling:
            print(format_record(r))
    for e in result["launcher_errors"]:
        print("# launcher error:", e)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(result["summary"])
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
