"""``position_profile``: what each layer's position encoding does, as plain numbers (the JSON of ``hf-posenc show``).

Every number is read from the encoding's own operations -- its ``bias``, ``rotate``/``prepare``, ``embed`` and,
for the data-dependent encodings, the quantities it computes inside a real forward -- never from a copy of its
formula, so the profile of a trained model shows what that model computes. One entry per layer (from
`hf_posenc.api.layer_encodings`, so a plan with a different encoding per layer gets each layer's own),
each with ``"encoding"`` (the layer's encoding name), ``"kind"`` and the fields of its kind:

``"score_bias"`` (alibi, t5, kerple, sandwich, fire: a term of the logits that depends on positions only)
    Text: ``"distance"`` = [0, 1, ..., N-1] and ``"bias"`` (heads x N): the term for a query at position N-1
    and a key at position N-1-d, from ``encoding("bias", ctx, 1, N, ...)`` with the query at N-1.
    ViT: ``"grid"`` (rows, cols), ``"centre"`` (row, col), ``"distance"`` (rows x cols Euclidean distances
    from the centre patch) and ``"bias"`` (heads x rows x cols): the term from the centre patch's query to
    every patch's key (CLS left out: it takes no positional term).

``"qk_transform"`` (rope, rope2d, liere, comrope, fope: a linear map T_p applied to queries and keys)
    ``"distance"`` as above and ``"similarity"``: per head, trace(T^q_{N-1}^T T^k_{N-1-d}) / head_dim, the
    score q^T k that a query and a key with equal unit content would keep, averaged over directions. T_p is
    read column by column by feeding the identity basis e_1 .. e_D through the encoding's own transform at
    position p (exact for every transform; dimensions left unrotated, as under partial rotary, add 1 at every
    distance); with grouped-query attention query head h pairs with key/value
    head h // (H / Hkv), as in the attention. One entry (``"shared": true``) when every head has the same
    values. For plain RoPE it is mean_k cos(d * theta_k). ViT: from the centre patch to every patch
    (heads x rows x cols), as for score biases.

``"absolute"`` (sinusoidal, learned: a vector added to the embeddings)
    ``"similarity"``: the N x N cosine similarities between the position vectors of positions 0 .. N-1 (ViT: of
    the patches, in raster order), from the encoding's own ``embed``.

``"data_dependent"`` (fox, fox_pro, cope, sba, cape, tape, shaw: the term depends on the input)
    From one forward of the patched model on ``input_ids`` (text) or a fixed seeded random image (ViT), with
    ``output_attentions=True``: ``"attention"`` (heads x queries x keys, the layer's attention weights) and the
    encoding's own quantities, captured by a forward hook on the encoding module as the model calls it:

    * fox, fox_pro: ``"forget_gates"`` (heads x tokens) f_t = sigma(w_h . x_t + b_h) from ``Fox.log_gates`` on the
      layer's attention input x_t, and ``"decay_last_query"`` (heads x keys) F_{N-1,j} = prod_{l=j+1..N-1} f_l,
      the multiplicative decay the last query applies to key j (``forget_bias``; causal models). On ViT also
      ``"backward_gates"`` (the second gate set of the bidirectional generalisation).
    * cope: ``"positions_last_query"`` (heads x keys) the contextual positions p_ij = sum_{k=j..i} g_ik of the
      last query i, g_ik = sigma(s q_i . k_k) over the keys it may see (``allowed_keys``, ``cope_positions``);
      the encoding clips them at ``"npos_max"`` - 1 when it looks up its table.
    * sba: ``"stick_weights"`` (heads x queries x keys) A_ij, the weights ``attend`` returns (with
      ``remainder="current"`` the diagonal also carries the rest of the stick), and ``"breaks_last_query"``
      (heads x keys) beta_ij = sigma(s q_i . k_j), the fraction of the remaining stick each key breaks off for the
      last query (0 on keys that are no breakpoints).
    * cape, tape, shaw: the attention weights only (their terms mix learned functions of positions with the
      input; the weights are what they do).

    The profile's top level then holds ``"tokens"``: the token ids (text) and ``"token_text"`` where a
    tokenizer (or bytes) was given.

``"none"`` (nope): no position signal; no other field.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .api import _patched_base, layer_encodings
from .encodings.base import PosContext
from .ops import expand_kv
from .registry import get_encoding

__all__ = ["PROFILE_KINDS", "default_sample", "position_profile", "profile_kind"]

#: The kinds of layer entries, in the order the docstring above describes them.
PROFILE_KINDS = ("score_bias", "qk_transform", "absolute", "data_dependent", "none")

#: Registry kinds whose term is a function of positions alone.
_STATIC_KINDS = {"score bias": "score_bias", "q/k transform": "qk_transform"}

#: The default text of ``position_profile(input_ids=None)``: bytes of this sentence, repeated to the length.
DEFAULT_TEXT = "The quick brown fox jumps over the lazy dog; the dog sleeps on, and the fox counts the trees. "

#: Positions per call when key transforms are read (bounds the (D, Hkv, chunk, D) basis tensor).
_CHUNK = 256


def profile_kind(encoding: nn.Module) -> str:
    """The profile kind of an (unwrapped) encoding module, from its registered kind and what it adds:
    ``score bias`` -> ``score_bias``, ``q/k transform`` -> ``qk_transform``, an absolute encoding that adds
    embeddings -> ``absolute``, one that adds nothing (nope) -> ``none``, every other kind (data-dependent,
    score mixing, score + value, stick-breaking, contextual states) -> ``data_dependent``."""
    kind = get_encoding(encoding.name).kind
    if kind in _STATIC_KINDS:
        return _STATIC_KINDS[kind]
    if kind == "absolute":
        return "absolute" if getattr(encoding, "adds_embeddings", False) else "none"
    return "data_dependent"


def default_sample(length: int, vocab_size: int) -> torch.Tensor:
    """(1, length) int64: the UTF-8 bytes of `DEFAULT_TEXT` repeated to ``length`` (modulo ``vocab_size``
    for vocabularies under 256), the input of the data-dependent entries when no ``input_ids`` are given."""
    data = torch.tensor(list(DEFAULT_TEXT.encode()), dtype=torch.long)
    ids = data.repeat(length // data.numel() + 1)[:length]
    return (ids % vocab_size)[None]


def _check_length(length: Any) -> int:
    if isinstance(length, bool) or not isinstance(length, int):
        raise TypeError(f"length must be an int >= 1, got {type(length).__name__}")
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    return length


def _check_ids(input_ids: Any, vocab_size: int | None) -> torch.Tensor:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.int64, torch.int32):
        what = input_ids.dtype if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise TypeError(f"input_ids must be an int64 tensor of shape (length,) or (1, length), got {what}")
    ids = input_ids[None] if input_ids.dim() == 1 else input_ids
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] < 1:
        raise ValueError(f"input_ids must have shape (length,) or (1, length) with length >= 1, got {tuple(input_ids.shape)}")
    if vocab_size is not None and ((ids < 0).any() or (ids >= vocab_size).any()):
        raise ValueError(f"input_ids must lie in [0, {vocab_size}) (the model's vocabulary)")
    return ids.long()


# -- static kinds ----------------------------------------------------------------------------------------


def _centre(grid: tuple[int, int]) -> tuple[int, int, int]:
    """(row, col, token index) of the centre patch (CLS is token 0)."""
    rows, cols = grid
    r, c = rows // 2, cols // 2
    return r, c, 1 + r * cols + c


def _grid_distance(grid: tuple[int, int]) -> list[list[float]]:
    rows, cols = grid
    r0, c0, _ = _centre(grid)
    r = torch.arange(rows, dtype=torch.float64)[:, None] - r0
    c = torch.arange(cols, dtype=torch.float64)[None, :] - c0
    return torch.sqrt(r.square() + c.square()).tolist()


def _score_bias(enc: nn.Module, layer: int, length: int, device: torch.device) -> dict[str, Any]:
    grid = enc.info.grid
    with torch.no_grad():
        if grid is None:
            # the query is token N-1 (its own logical position N-1), the keys are tokens 0 .. N-1
            ctx = PosContext(
                encoding=enc, info=enc.info, q_offset=length - 1,
                position_ids=torch.full((1, 1), length - 1, dtype=torch.long, device=device),
            )
            bias = enc("bias", ctx, 1, length, device, layer)  # (B|1, H, 1, N)
            row = bias[0, :, 0, :].flip(-1)  # index d: key N-1-d
            return {"distance": list(range(length)), "bias": row.double().tolist()}
        rows, cols = grid
        tokens = 1 + rows * cols
        ctx = PosContext(encoding=enc, info=enc.info, grid=grid)
        bias = enc("bias", ctx, tokens, tokens, device, layer)  # (1, H, T, T)
        r0, c0, centre = _centre(grid)
        maps = bias[0, :, centre, 1:].reshape(-1, rows, cols)
    return {
        "grid": [rows, cols], "centre": [r0, c0], "distance": _grid_distance(grid), "bias": maps.double().tolist(),
    }


def _transform(enc: nn.Module, layer: int, ctx: PosContext, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The encoding's own q/k transform, through ``prepare`` (which carries the layer) where it has one."""
    if getattr(enc, "prepares_qkv", False):
        hidden = q.new_zeros(q.shape[0], q.shape[2], enc.info.hidden_size)
        q, k, _ = enc("prepare", ctx, layer, hidden, q, k, k)
        return q, k[..., : q.shape[-1]]
    return enc("rotate", ctx, q, k)


def _basis(dim: int, heads: int, length: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(D, heads, length, D): batch row b holds the unit vector e_b at every head and position."""
    eye = torch.eye(dim, dtype=dtype, device=device)
    return eye[:, None, None, :].expand(dim, heads, length, dim).contiguous()


def _text_maps(enc: nn.Module, layer: int, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """T^q and T^k at the given logical positions: (D, H, P, D) and (D, Hkv, P, D) float64, entry [b, h, p, :]
    = column b of the map (the image of e_b)."""
    info = enc.info
    d, h, hkv = info.head_dim, info.num_heads, info.num_kv_heads
    qs, ks = [], []
    for start in range(0, positions.numel(), _CHUNK):
        pos = positions[start : start + _CHUNK]
        ctx = PosContext(encoding=enc, info=info, position_ids=pos[None], q_offset=int(pos[0]))
        q, k = _transform(enc, layer, ctx, _basis(d, h, pos.numel(), dtype, pos.device), _basis(d, hkv, pos.numel(), dtype, pos.device))
        qs.append(q.double())
        ks.append(k.double())
    return torch.cat(qs, dim=2), torch.cat(ks, dim=2)


def _per_head(values: torch.Tensor) -> tuple[list, bool]:
    """(H, ...) -> (list over heads, or a one-entry list when every head has the same values; shared)."""
    shared = bool(torch.allclose(values, values[:1].expand_as(values), rtol=0.0, atol=1e-7))
    return (values[:1] if shared else values).tolist(), shared


def _qk_transform(enc: nn.Module, layer: int, length: int, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    info = enc.info
    d, groups = info.head_dim, info.num_heads // info.num_kv_heads
    with torch.no_grad():
        if info.grid is None:
            tq, _ = _text_maps(enc, layer, torch.tensor([length - 1], device=device), dtype)
            _, tk = _text_maps(enc, layer, torch.arange(length, device=device), dtype)
            tk = expand_kv(tk, groups)  # query head h pairs with key/value head h // groups
            sim = torch.einsum("bhe,bhne->hn", tq[:, :, 0], tk).flip(-1) / d  # (H, N), index d: key N-1-d
            values, shared = _per_head(sim)
            return {"distance": list(range(length)), "similarity": values, "shared": shared}
        rows, cols = info.grid
        tokens = 1 + rows * cols
        ctx = PosContext(encoding=enc, info=info, grid=info.grid)
        q, k = _transform(enc, layer, ctx, _basis(d, info.num_heads, tokens, dtype, device),
                          _basis(d, info.num_kv_heads, tokens, dtype, device))
        r0, c0, centre = _centre(info.grid)
        k = expand_kv(k.double(), groups)
        sim = torch.einsum("bhe,bhne->hn", q.double()[:, :, centre], k[:, :, 1:]) / d
        values, shared = _per_head(sim.reshape(-1, rows, cols))
    return {
        "grid": [rows, cols], "centre": [r0, c0], "distance": _grid_distance(info.grid),
        "similarity": values, "shared": shared,
    }


def _absolute(enc: nn.Module, length: int, device: torch.device) -> dict[str, Any]:
    info = enc.info
    with torch.no_grad():
        if info.grid is None:
            ctx = PosContext(encoding=enc, info=info, position_ids=torch.arange(length, device=device)[None])
            vectors = enc("embed", ctx, torch.float32, device)[0]  # (N, C)
            out: dict[str, Any] = {"positions": list(range(length))}
        else:
            ctx = PosContext(encoding=enc, info=info, grid=info.grid)
            vectors = enc("embed", ctx, torch.float32, device)[0, 1:]  # the patches, without CLS
            out = {"grid": list(info.grid)}
        unit = nn.functional.normalize(vectors.double(), dim=-1)
        out["similarity"] = (unit @ unit.T).tolist()
    return out


# -- data-dependent kinds: one forward with hooks ------------------------------------------------------------


def _last_query_gates(ctx: PosContext, query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None,
                      scaling: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """sigma(s q_i . k_j) of the last query (H, Lk) float64 over the keys it may see (0 elsewhere; cope's
    ``allowed_keys``), and that allowed row (H|1, Lk) bool. Batch row 0."""
    from .kernels._masks import allowed_keys

    q_len, k_len = query.shape[2], key.shape[2]
    k = expand_kv(key[..., : query.shape[-1]], query.shape[1] // key.shape[1]).double()
    logits = (query[:, :, -1:].double() @ k.transpose(-1, -2)) * scaling  # (B, H, 1, Lk)
    offset = ctx.q_offset + q_len - 1
    row_mask = mask[:, :, -1:] if mask is not None else None
    allowed = allowed_keys(row_mask, 1, k_len, offset, causal, query.device)
    gates = torch.sigmoid(logits)
    if allowed is not None:
        gates = gates.masked_fill(~allowed, 0.0)
    else:
        allowed = torch.ones(1, 1, 1, k_len, dtype=torch.bool, device=query.device)
    return gates[0, :, 0], allowed[0, :, 0]


#: The encodings whose own quantities are recorded, and the operation of theirs that the hooks read.
_RECORDED = {"fox": "prepare", "fox_pro": "prepare", "cope": "attend", "sba": "attend"}


class _Recorder:
    """Forward hooks on the encoding modules: the quantities of the data-dependent encodings, per layer."""

    def __init__(self) -> None:
        self.found: dict[tuple[int, int], dict[str, Any]] = {}
        self.handles: list[Any] = []

    def attach(self, enc: nn.Module) -> None:
        name = enc.name
        if name in ("fox", "fox_pro"):
            self.handles.append(enc.register_forward_pre_hook(self._fox))
        elif name == "cope":
            self.handles.append(enc.register_forward_pre_hook(self._cope))
        elif name == "sba":
            self.handles.append(enc.register_forward_pre_hook(self._sba_pre))
            self.handles.append(enc.register_forward_hook(self._sba_post))

    def detach(self) -> None:
        for h in self.handles:
            h.remove()

    def _slot(self, enc: nn.Module, layer: int) -> dict[str, Any]:
        return self.found.setdefault((id(enc), int(layer)), {})

    def _fox(self, enc: nn.Module, args: tuple) -> None:
        if not args or args[0] != "prepare":
            return
        from .encodings.fox import forget_bias

        layer, hidden = args[2], args[3]
        log_gates = enc.log_gates(layer, hidden)[0].double()  # (L, S, H)
        slot = self._slot(enc, layer)
        slot["forget_gates"] = log_gates[:, 0].exp().T.tolist()  # (H, L)
        if log_gates.shape[1] > 1:
            slot["backward_gates"] = log_gates[:, 1].exp().T.tolist()
        else:
            n = log_gates.shape[0]
            valid = torch.ones(1, n, dtype=torch.bool, device=hidden.device)
            q_index = torch.tensor([n - 1], device=hidden.device)
            decay = forget_bias(log_gates[:, 0].T[None], valid, q_index)  # (1, H, 1, L)
            slot["decay_last_query"] = decay[0, :, 0].exp().tolist()

    def _cope(self, enc: nn.Module, args: tuple) -> None:
        if not args or args[0] != "attend":
            return
        from .kernels.cope.naive import cope_positions

        ctx, layer, query, key, _value, mask, scaling = args[1:8]
        gates, _ = _last_query_gates(ctx, query, key, mask, scaling, enc.info.causal)
        if ctx.grid is not None:  # the CLS key is never counted
            gates = gates.clone()
            gates[:, 0] = 0.0
        slot = self._slot(enc, layer)
        slot["positions_last_query"] = cope_positions(gates, "before").tolist()
        slot["npos_max"] = int(enc.npos_max)

    def _sba_pre(self, enc: nn.Module, args: tuple) -> None:
        if not args or args[0] != "attend":
            return
        ctx, layer, query, key, _value, mask, scaling = args[1:8]
        gates, _ = _last_query_gates(ctx, query, key, mask, scaling, enc.info.causal)
        # breakpoints: the keys the query may see (causal: those before it), its own key only with attend_current
        last = ctx.q_offset + query.shape[2] - 1
        idx = torch.arange(key.shape[2], device=key.device)
        if enc.info.causal:
            breaks = (idx <= last) if enc.attend_current else (idx < last)
        else:
            breaks = torch.ones_like(idx, dtype=torch.bool) if enc.attend_current else (idx != last)
        gates = gates.masked_fill(~breaks[None], 0.0)
        self._slot(enc, layer)["breaks_last_query"] = gates.tolist()

    def _sba_post(self, enc: nn.Module, args: tuple, output: Any) -> None:
        if not args or args[0] != "attend":
            return
        weights = output[1]
        if weights is not None:
            self._slot(enc, args[2])["stick_weights"] = weights[0].double().tolist()


def _model_inputs(model: nn.Module, base: nn.Module, input_ids: torch.Tensor | None, length: int,
                  device: torch.device, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The forward's inputs and what the profile records of them."""
    info = base.posenc_info
    if info.grid is not None:
        if input_ids is not None:
            raise ValueError("input_ids were given for a ViT model; its data-dependent profile uses a fixed image")
        rows, cols = info.grid
        ph, pw = info.patch_size if isinstance(info.patch_size, tuple) else (info.patch_size, info.patch_size)
        channels = int(getattr(model.config, "num_channels", 3))
        g = torch.Generator().manual_seed(0)
        pixels = torch.randn(1, channels, rows * ph, cols * pw, generator=g).to(device=device, dtype=dtype)
        return {"pixel_values": pixels}, {"input": "a seeded random image (torch.Generator seed 0, standard normal)"}
    vocab = getattr(model.config, "vocab_size", None)
    ids = default_sample(length, vocab) if input_ids is None else _check_ids(input_ids, vocab)
    note = {"tokens": ids[0].tolist()}
    if input_ids is None:
        note["input"] = "default sample: the bytes of hf_posenc.profile.DEFAULT_TEXT repeated to the length"
    return {"input_ids": ids.to(device)}, note


def _data_dependent(model: nn.Module, base: nn.Module, layers: list[tuple[nn.Module, int]], dd: list[int],
                    input_ids: torch.Tensor | None, length: int, device: torch.device,
                    dtype: torch.dtype) -> tuple[dict[int, dict[str, Any]], dict[str, Any]]:
    inputs, note = _model_inputs(model, base, input_ids, length, device, dtype)
    recorder = _Recorder()
    for enc in {id(layers[i][0]): layers[i][0] for i in dd}.values():
        recorder.attach(enc)
    try:
        with torch.no_grad():
            out = model(**inputs, output_attentions=True)
    finally:
        recorder.detach()
    attentions = getattr(out, "attentions", None)
    if attentions is None or len(attentions) != len(layers):
        raise ValueError(
            f"{type(model).__name__} returned no attention weights per layer with output_attentions=True; "
            "position_profile needs them for data-dependent encodings"
        )
    entries = {}
    for i in dd:
        enc, local = layers[i]
        entry = {"attention": attentions[i][0].double().tolist()}
        found = recorder.found.get((id(enc), local), {})
        if enc.name in _RECORDED and not found:
            raise RuntimeError(
                f"layer {i} ({enc.name}): the forward never called the encoding module with this layer's "
                f"{_RECORDED[enc.name]!r} operation, so its quantities could not be recorded"
            )
        entry.update(found)
        entries[i] = entry
    return entries, note


# -- the profile -----------------------------------------------------------------------------------------------


def position_profile(model: nn.Module, length: int = 64, input_ids: torch.Tensor | None = None) -> dict[str, Any]:
    """The position profile of a patched model: a JSON-ready dict (the module docstring gives every field).

    Args:
        model: a model patched by hf_posenc (any family, one encoding or a plan).
        length: N, the number of positions of the curves and matrices (text; ViT uses its patch grid).
        input_ids: (N',) or (1, N') int64 token ids for the data-dependent layers (text models); None: the
            `default_sample` of length N.

    Returns:
        ``{"family", "length", "layers": [{"layer", "encoding", "kind", ...}, ...]}``, plus ``"tokens"`` (and
        ``"input"``) when some layer is data-dependent.

    Raises:
        ValueError/TypeError: an unpatched model, a length below 1, malformed input_ids.
    """
    base = _patched_base(model)
    length = _check_length(length)
    layers = layer_encodings(model)
    param = next((p for p in model.parameters() if p.is_floating_point()), None)
    device = param.device if param is not None else torch.device("cpu")
    dtype = param.dtype if param is not None else torch.float32
    kinds = [profile_kind(enc) for enc, _ in layers]
    was_training = model.training
    model.eval()
    try:
        entries: list[dict[str, Any]] = []
        for i, ((enc, local), kind) in enumerate(zip(layers, kinds)):
            entry: dict[str, Any] = {"layer": i, "encoding": enc.name, "kind": kind}
            if kind == "score_bias":
                entry.update(_score_bias(enc, local, length, device))
            elif kind == "qk_transform":
                entry.update(_qk_transform(enc, local, length, device, dtype))
            elif kind == "absolute":
                entry.update(_absolute(enc, length, device))
            entries.append(entry)
        profile: dict[str, Any] = {"family": base.posenc_info.family, "length": length}
        dd = [i for i, k in enumerate(kinds) if k == "data_dependent"]
        if dd:
            found, note = _data_dependent(model, base, layers, dd, input_ids, length, device, dtype)
            profile.update(note)
            for i, entry in found.items():
                entries[i].update(entry)
        profile["layers"] = entries
    finally:
        model.train(was_training)
    return profile
