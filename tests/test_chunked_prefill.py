"""Chunked prefill (``generate(..., prefill_chunk_size=4)``) with a static and a dynamic cache equals
unchunked generation, with every encoding on every decoder.

With ``prefill_chunk_size`` transformers allocates the ``StaticCache`` eagerly from the config's
``head_dim``; fox, fox_pro and tape store state channels with the keys (and values), so the patched
model answers ``_get_static_cache_init_shape`` itself (``hf_posenc/patches/generation.py``).
"""

from __future__ import annotations

import pytest
import torch
from conftest import DECODERS, combos, left_pad, make_ids, make_model

from hf_posenc.patches.generation import cached_kv_widths

NEW = 4
CHUNK = 4


def _generate(model, ids, mask, **kw):
    out = model.generate(
        ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0,
        return_dict_in_generate=True, output_logits=True, **kw,
    )
    return out.sequences, torch.stack(out.logits, dim=1)


@pytest.mark.parametrize("family,encoding", combos(DECODERS))
def test_chunked_prefill_equals_unchunked(family, encoding):
    """A left-padded batch (prompts of 6 and 11 tokens: chunks of 4, 4, 3): static cache + chunks, dynamic
    cache + chunks and static cache unchunked all give the tokens and logits of unchunked dynamic generation."""
    model = make_model(family, encoding=encoding)
    ids, mask = left_pad([make_ids(1, 6, seed=3)[0], make_ids(1, 11, seed=4)[0]])
    with torch.no_grad():
        ref_ids, ref_logits = _generate(model, ids, mask)
        for kw in (
            dict(cache_implementation="static", prefill_chunk_size=CHUNK),
            dict(prefill_chunk_size=CHUNK),
            dict(cache_implementation="static"),
        ):
            got_ids, got_logits = _generate(model, ids, mask, **kw)
            assert torch.equal(got_ids, ref_ids), kw
            torch.testing.assert_close(got_logits, ref_logits, atol=1e-5, rtol=1e-4, msg=lambda m: f"{kw}: {m}")


@pytest.mark.parametrize("encoding,widens", [("fox", True), ("fox_pro", True), ("tape", True), ("rope", False),
                                             ("fope", False), ("alibi", False)])
def test_static_cache_shape_answer(encoding, widens):
    """The instance-level hook: None (allocate from the first keys) exactly for the encodings that store
    state channels; otherwise transformers' own (num_kv_heads, head_dim). The class is untouched."""
    model = make_model("llama", encoding=encoding)
    base = model.model
    k, v = cached_kv_widths(base)
    assert ((k, v) != (base.posenc_info.head_dim,) * 2) == widens
    shape = model._get_static_cache_init_shape()
    native = type(model)._get_static_cache_init_shape(model)
    assert shape == (None if widens else native)
    assert "_get_static_cache_init_shape" not in vars(type(model))
