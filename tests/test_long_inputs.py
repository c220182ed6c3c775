"""Long inputs: every encoding's PyTorch reference at L = 4096 on the CPU runs, or a clear error names the memory
it would need.

A small model (1 layer, hidden 64, 4 heads, batch 1), as the references' O(L^2) intermediates, not the
model, are what grows. Two forms:

* in CI (``make test-all``; the fast tier takes rope and alibi on Llama, rope2d on ViT): Llama, every
  encoding, L = 4096, forward under ``no_grad``, finite and causal (its first 256 positions are the 256-token
  input's); ViT, every encoding, a 32x32 patch grid (L = 1025), forward under ``no_grad``, finite.
* ``@pytest.mark.soak``, opt-in with ``make test-soak``: Llama, GPT-2 and ViT (a 64x64 grid, L = 4097), every
  encoding, forward and backward at L = 4096, finite outputs and gradients.

Speed and memory are not asserted here: ``benchmarks/bench_reference_memory.py`` measures the peak resident memory
of the same forwards (``--backward``: and backwards) and checks it against the 24 GiB budget and against the
estimate behind the memory pre-check (``PositionEncoding.reference_bytes``, hf_posenc.memory). The budget is set to
24 GiB here too (``HF_POSENC_MEMORY_BUDGET``), so that whether the pre-check lets a test's reference run does not
depend on what else the machine is running.
"""

from __future__ import annotations

import pytest
import torch

from hf_posenc.memory import ReferenceMemoryError
from conftest import ENCODINGS, VOCAB, make_model, supports, tiered

L = 4096
#: the causal prefix compared with a run of its own (its reference costs (L/16)^2 of the long one's)
PREFIX = 256


def small_model(family: str, encoding: str, train: bool = False, grid: int = 64):
    """1 layer, hidden 64, 4 heads; text models sized for L positions (learned's table, liere, fope)."""
    if family == "llama":
        over = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                    num_key_value_heads=4, max_position_embeddings=L)
    elif family == "gpt2":
        over = dict(n_embd=64, n_inner=128, n_layer=1, n_head=4, n_positions=L)
    else:
        over = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, patch_size=4,
                    image_size=4 * grid)
    return make_model(family, "base", encoding=encoding, train=train, config_overrides=over)


def inputs(family: str, grid: int = 64) -> dict:
    g = torch.Generator().manual_seed(0)
    if family == "vit":
        return {"pixel_values": torch.randn(1, 3, 4 * grid, 4 * grid, generator=g)}
    return {"input_ids": torch.randint(3, VOCAB, (1, L), generator=g), "use_cache": False}


@pytest.fixture(autouse=True)
def budget(monkeypatch):
    monkeypatch.setenv("HF_POSENC_MEMORY_BUDGET", "24GiB")


@pytest.mark.parametrize("encoding", tiered(ENCODINGS, fast=["rope", "alibi"]))
def test_llama_forward_at_4096(encoding):
    """Every encoding's reference runs at L = 4096 (forward, no_grad), with finite outputs whose first 256
    positions are those of the 256-token input (causal: what the longer input adds does not reach back)."""
    model = small_model("llama", encoding)
    x = inputs("llama")
    with torch.no_grad():
        out = model(**x).last_hidden_state
        prefix = model(input_ids=x["input_ids"][:, :PREFIX], use_cache=False).last_hidden_state
    assert out.shape == (1, L, 64) and torch.isfinite(out).all()
    torch.testing.assert_close(out[:, :PREFIX], prefix, rtol=0, atol=1e-4)


@pytest.mark.parametrize("encoding", tiered([e for e in ENCODINGS if supports(e, "vit")], fast=["rope2d"]))
def test_vit_forward_at_1025(encoding):
    """The ViT (2D grid) references at a 32x32 grid (L = 1025), forward, no_grad; L = 4097 is in the soak test."""
    model = small_model("vit", encoding, grid=32)
    with torch.no_grad():
        out = model(**inputs("vit", grid=32)).last_hidden_state
    assert out.shape == (1, 32 * 32 + 1, 64) and torch.isfinite(out).all()


def test_over_the_budget_is_refused_with_the_amount(monkeypatch):
    """Where the reference would not fit, it is refused before allocating, naming what it would need (cape's
    text attention runs tile by tile: its full-matrix reference runs when the probabilities are requested)."""
    monkeypatch.setenv("HF_POSENC_MEMORY_BUDGET", "1GiB")
    model = small_model("llama", "cape")
    with pytest.raises(ReferenceMemoryError, match=r"cape: .* would need about 6.0 GiB .* over the memory budget of 1.0 GiB"):
        with torch.no_grad():
            model(**inputs("llama"), output_attentions=True)
    with torch.no_grad():  # the tile-wise engine needs no such budget
        assert torch.isfinite(model(**inputs("llama")).last_hidden_state).all()


@pytest.mark.soak
@pytest.mark.parametrize(
    "family,encoding",
    [pytest.param(f, e, id=f"{f}-{e}") for f in ("llama", "gpt2", "vit") for e in ENCODINGS if supports(e, f)],
)
def test_forward_backward_at_4096(family, encoding):
    """Forward and backward at L = 4096 (ViT: a 64x64 grid, L = 4097): finite outputs and gradients."""
    model = small_model(family, encoding, train=True)
    out = model(**inputs(family)).last_hidden_state
    out.float().pow(2).mean().backward()
    assert torch.isfinite(out).all()
    bad = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
    assert not bad, f"non-finite gradients: {bad}"
