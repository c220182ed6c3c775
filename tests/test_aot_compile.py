"""The compile gate: every Triton kernel compiles ahead of time for sm_90 (H100) and sm_80 (A100) with the
tiles, warps and stages its launcher picks, and fits the target's per-block shared memory.

No GPU is needed: ``hf_posenc.kernels.compile_check`` drives the launchers on CPU tensors with a stand-in
driver that reports a CUDA target and compiles each launch to a cubin with the ptxas Triton ships. It runs
in a subprocess because this suite sets ``TRITON_INTERPRET=1`` (the kernels would be interpreted, not
compiled). The default test compiles the ``gate`` matrix (the forward kernel of every family at head dim
128, each dtype once, CoPE in float32; about a minute of CPU); the ``soak`` tests (opt-in, ``make test-soak``)
compile the backward kernels of the same launches, the representative matrix (every term kind, forward
and backward) and the full one. Register spills are printed (a speed
defect to remove or to show harmless on a GPU), not failed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _unavailable() -> str | None:
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    from hf_posenc.kernels.compile_check import ptxas_available

    return ptxas_available()


def _compile(matrix: str, tmp_path: Path, timeout: int) -> dict:
    why = _unavailable()
    if why is not None:
        pytest.skip(f"no ahead-of-time compile: {why}")
    out = tmp_path / "compile.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "hf_posenc.kernels.compile_check", "--arch", "90", "80", "--matrix", matrix,
         "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )
    print(proc.stdout[-6000:])  # the spill report and the summary line (pytest -s shows it)
    assert out.exists(), (f"compile_check did not finish (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                          f"{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def _check(result: dict) -> None:
    recs = result["records"]
    failed = [f"sm_{r['arch']} {r['kernel']} {r['dtype']} {r['config']}: {r['error']}"
              for r in recs if r["status"] != "ok"]
    over = [f"sm_{r['arch']} {r['kernel']} {r['dtype']} {r['config']}: {r['shared']} B" for r in recs if r["over_smem"]]
    assert not failed, "compile errors:\n" + "\n".join(failed)
    assert not over, "over the per-block shared-memory limit (H100 232448 B, A100 166912 B):\n" + "\n".join(over)
    assert not result["launcher_errors"], "launchers failed:\n" + "\n".join(result["launcher_errors"])
    kernels = {r["kernel"] for r in recs}
    assert {r["arch"] for r in recs} == {90, 80}
    for r in recs:  # ptxas ran and its resource report was read
        assert r["regs"] is not None and r["spill_stores"] is not None, r
    return kernels


@pytest.mark.slow  # ptxas in a subprocess; `make compile-check` runs the same gate
def test_gate_compiles_every_kernel_family_for_sm90_and_sm80(tmp_path):
    """The forward kernel of every family (CoPE in float32: its shared-memory footprint), the remap engine's piece,
    the rotary kernel."""
    kernels = _check(_compile("gate", tmp_path, timeout=3600))
    assert kernels == {"_fwd_kernel", "_sba_fwd", "_cope_fwd", "_span_fwd_kernel", "_rotary_qk_kernel"}


@pytest.mark.soak
def test_gate_backward_kernels_compile(tmp_path):
    """The backward kernels of the gate's launches (CoPE float32, attention with FoX's term gradient, sba, remap)."""
    kernels = _check(_compile("gate-backward", tmp_path, timeout=7200))
    assert {"_bwd_delta_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel", "_sba_bwd_q", "_sba_bwd_kv", "_cope_bwd_q",
            "_cope_bwd_kv", "_span_bwd_dq_kernel", "_span_bwd_dkdv_kernel"} <= kernels


@pytest.mark.soak
def test_representative_matrix_compiles(tmp_path):
    """Every term kind, each dtype, head dims 128 and 40, decode (slow: tens of minutes on 2 cores)."""
    _check(_compile("representative", tmp_path, timeout=7200))


@pytest.mark.soak
def test_full_matrix_compiles(tmp_path):
    """Every term kind x dtype x head dim x mask option (slow: hours on 2 cores)."""
    _check(_compile("full", tmp_path, timeout=6 * 3600))
