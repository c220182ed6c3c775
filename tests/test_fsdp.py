"""FSDP across 2 CPU processes (gloo): FSDP2 ``fully_shard`` by hand and accelerate's FSDP plugin, with
encodings that hold parameters (kerple, fox, cope, t5). One launch of ``_fsdp_worker.py`` (2 processes)
serves every test here; see that file for what each rank does.

* The encoding's parameters (from the gathered full state dict) are identical on both ranks and equal a
  single-process run of the same steps on both ranks' batches.
* A full state dict saved with ``save_pretrained`` loads with ``hf_posenc.from_pretrained`` with identical logits.
* accelerate: ``save_state`` writes a sharded checkpoint (one file per rank), and a new accelerator that
  ``load_state``s it takes the next step exactly as the run that never stopped.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hf_posenc

TESTS = Path(__file__).parent


#: Every test here reads the one two-process run of ``fsdp_run`` (tens of seconds): the slow tier, and one
#: pytest-xdist worker for the module (--dist loadgroup), so that the run is not repeated on each worker.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("fsdp")]


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    """Run the 2-process worker once; its output folder."""
    out = tmp_path_factory.mktemp("fsdp")
    env = dict(os.environ, WORLD_SIZE="2", OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(TESTS.parent), os.environ.get("PYTHONPATH", "")]))
    if Path("/sys/class/net/lo").exists():
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    procs = [
        subprocess.Popen(
            [sys.executable, str(TESTS / "_fsdp_worker.py"), str(out / "store"), str(out)],
            env=dict(env, RANK=str(rank)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in range(2)
    ]
    try:
        logs = [p.communicate(timeout=400)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {rank} failed:\n{log[-4000:]}"
    return out


def _reference(name: str, params: dict, steps: int):
    """The single-process run: the same SGD steps on both ranks' batches at once."""
    import _fsdp_worker as worker

    model = worker.build(name, params)
    opt = torch.optim.SGD(model.parameters(), lr=worker.LR)
    for i in range(steps):
        x = torch.cat([worker.batch(0, i), worker.batch(1, i)])
        model(input_ids=x, labels=x, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad()
    return model


def _encodings():
    import _fsdp_worker as worker

    return [pytest.param(name, params, id=name) for name, params in worker.ENCODINGS]


@pytest.mark.parametrize("name,params", _encodings())
def test_fsdp2_matches_single_process_and_saves(fsdp_run, name, params):
    import _fsdp_worker as worker
    from safetensors.torch import load_file

    d = fsdp_run / name
    r0, r1 = (load_file(d / f"fsdp2_rank{r}.safetensors") for r in range(2))
    assert r0.keys() == r1.keys() and r0, "no encoding parameters in the gathered state dict"
    before = worker.build(name, params).state_dict()
    ref = _reference(name, params, worker.STEPS).state_dict()
    for key in r0:
        assert torch.equal(r0[key], r1[key]), f"{key} differs across ranks"
        assert not torch.equal(r0[key], before[key]), f"{key} did not train"
        torch.testing.assert_close(r0[key], ref[key], atol=1e-5, rtol=1e-4, msg=lambda m: f"{key}: {m}")
    # The gathered full state dict, saved with save_pretrained, loads with hf_posenc.from_pretrained.
    reloaded = hf_posenc.from_pretrained(d / "model").eval()
    assert reloaded.config.position_encoding["name"] == name
    with torch.no_grad():
        logits = reloaded(input_ids=worker.probe()).logits
    assert torch.equal(logits, load_file(d / "logits.safetensors")["logits"])


@pytest.mark.parametrize("name,params", _encodings())
def test_accelerate_fsdp_sharded_checkpoint_resumes(fsdp_run, name, params):
    import _fsdp_worker as worker
    from safetensors.torch import load_file

    d = fsdp_run / name
    if (d / "accelerate_skipped.txt").exists():
        pytest.skip((d / "accelerate_skipped.txt").read_text())
    files = (d / "accelerate_files.txt").read_text()
    assert "pytorch_model_fsdp_0: ['.metadata', '__0_0.distcp', '__1_0.distcp']" in files  # one shard per rank
    r0, r1 = (load_file(d / f"accelerate_rank{r}.safetensors") for r in range(2))
    ref = _reference(name, params, worker.STEPS + 1).state_dict()
    continued = {k.split(".", 1)[1]: v for k, v in r0.items() if k.startswith("continued.")}
    assert continued.keys() == ref.keys()
    for key, value in continued.items():
        assert torch.equal(r0[f"resumed.{key}"], value), f"{key}: the resumed run differs"
        assert torch.equal(r1[f"continued.{key}"], value) and torch.equal(r1[f"resumed.{key}"], value), key
        torch.testing.assert_close(value, ref[key], atol=1e-5, rtol=1e-4, msg=lambda m: f"{key}: {m}")
