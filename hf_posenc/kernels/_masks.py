"""Which keys each query may see: the window check and the boolean masks shared by the references, the engines,
the encodings and the configuration (one definition each; the kernels themselves skip tiles, they build no mask).

Query i is key ``q_offset + i`` throughout (its own key index, ``qi``).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

__all__ = [
    "SINK_POSITIONS", "CacheSinks", "allowed_keys", "band_allowed", "cache_sinks", "check_sink",
    "check_sink_positions", "check_window", "memo_per_mask", "query_indices", "windowed_allowed",
]

#: where ``sink_positions`` puts the attention sinks for the position encoding: at their own positions (``"text"``),
#: or at their cache positions (``"cache"``, StreamingLLM's, `CacheSinks`).
SINK_POSITIONS = ("text", "cache")


def check_window(window: object, where: str = "window") -> int | None:
    """``window`` validated: None (no window) or an int >= 1, the number of keys each query sees, itself included
    (a numpy integer is taken as the int it holds; a bool, a float or a string is refused).

    Args:
        window: the value to check.
        where: how the error message names it (``"window"``, ``"window of encoding 'alibi'"``).

    Returns:
        None or the window as a Python int.

    Raises:
        TypeError: not None and not an int (a bool included).
        ValueError: an int below 1.
    """
    if window is None:
        return None
    if type(window) not in (bool, int, float, str):  # a numpy (or other ``numbers``) scalar: the value it holds
        if isinstance(window, numbers.Integral):
            window = int(window)
        elif isinstance(window, numbers.Real):
            window = float(window)
    if isinstance(window, bool) or not isinstance(window, int):
        raise TypeError(
            f"{where} must be an int >= 1 (keys each query sees, itself included) or None, got "
            f"{type(window).__name__} ({window!r})"
        )
    if window < 1:
        raise ValueError(f"{where} must be >= 1 (keys each query sees, itself included), got {window}")
    return window


def check_sink(sink: object, window: int | None, where: str = "sink") -> int | None:
    """``sink`` validated: None (no attention sinks) or an int >= 1, the first keys every query sees beside its
    sliding ``window`` (a numpy integer is taken as the int it holds), and only with a window (without one every key
    is visible already).

    Raises:
        TypeError: not None and not an int (a bool included).
        ValueError: an int below 1, or a sink without a window.
    """
    if sink is None:
        return None
    if type(sink) not in (bool, int) and isinstance(sink, numbers.Integral):  # a numpy integer: the int it holds
        sink = int(sink)
    if isinstance(sink, bool) or not isinstance(sink, int):
        raise TypeError(f"{where} must be an int >= 1 (the first keys every query sees) or None, got "
                        f"{type(sink).__name__} ({sink!r})")
    if sink < 1:
        raise ValueError(f"{where} must be >= 1 (the first keys every query sees) or None, got {sink}")
    if window is None:
        raise ValueError(f"{where} ({sink}) needs a sliding window: without window= every query sees every key already")
    return sink


def check_sink_positions(value: object, sink: int | None, where: str = "sink_positions") -> str | None:
    """``sink_positions`` validated: None (the sinks at their text positions), ``"text"`` or ``"cache"``; set only
    with sinks (ValueError otherwise)."""
    if value is None:
        return None
    if not isinstance(value, str) or value not in SINK_POSITIONS:
        raise ValueError(f"{where} must be one of {list(SINK_POSITIONS)} or None, got {value!r}")
    if sink is None:
        raise ValueError(f"{where}={value!r} needs attention sinks (sink=k with a window)")
    return value


@dataclass(frozen=True)
class CacheSinks:
    """The attention sinks at their cache positions (``sink_positions="cache"``; StreamingLLM, Xiao et al. 2023,
    arXiv:2309.17453): the one statement of the rule, read by the references, every engine of the position terms and
    the rotary remap (the Triton kernel's ``SINK_CACHE`` branch writes the same two lines in kernel code).

    With a causal sliding window of ``window`` keys (query qi sees qi − W < j <= qi) and ``sink`` sinks (the keys
    j < sink, seen besides it), a sink the window no longer covers (δ = qi − j >= W) sits just before the window's
    oldest key, at distance W + sink − 1 − j (sink − 1 at W, sink 0 at W + sink − 1) instead of δ; every other
    pair keeps δ. Which keys are sinks goes by cache index, as the window's sinks."""

    window: int
    sink: int

    def far(self, delta: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        """Which pairs at distance ``delta`` = qi − j with key (cache index) ``j`` are sinks outside the window
        (broadcasting tensors -> bool)."""
        return (delta >= self.window) & (j < self.sink)

    def distance(self, j: torch.Tensor) -> torch.Tensor:
        """The distance W + sink − 1 − j at which sink ``j`` sits when the window no longer covers it."""
        return self.window + self.sink - 1 - j

    def delta(self, delta: torch.Tensor, j: torch.Tensor, j_pos: torch.Tensor | None = None) -> torch.Tensor:
        """``delta`` (= qi − j, broadcasting with ``j``) with the far sinks (`far`) at their cache distance
        (`distance`; of ``j_pos``, the sinks' positions where they differ from their cache indices ``j``)."""
        return torch.where(self.far(delta, j), self.distance(j if j_pos is None else j_pos), delta)


def cache_sinks(sink_positions: object, window: int | None, sink: int | None, causal: bool,
                where: str = "sink_positions") -> CacheSinks | None:
    """The `CacheSinks` of an engine call (``window`` and ``sink`` already checked), or None where the sinks sit at
    their text positions: ``sink_positions`` None, ``"text"`` or ``"cache"`` (`check_sink_positions`); ``"cache"``
    only with sinks and causal attention (ValueError otherwise)."""
    if check_sink_positions(sink_positions, sink, where) != "cache":
        return None
    if not causal:
        raise ValueError(f"{where}='cache' is defined on causal attention only (the sinks move to just before the "
                         "window's oldest key, which a bidirectional window does not have)")
    return CacheSinks(window, sink)


def band_allowed(
    q_idx: torch.Tensor, k_idx: torch.Tensor, causal: bool, window: int | None, sink: int | None = None
) -> torch.Tensor:
    """(Lq, Lk) bool: True where the query at key index ``q_idx[i]`` may see key ``k_idx[j]`` by position.

    causal: j <= qi, and with a window qi − window < j (the last ``window`` keys, the query's own included:
    transformers' ``sliding_window``); bidirectional with a window: |qi − j| < window; otherwise all. ``sink``
    (with a window): the keys j < sink are seen besides the band (by the queries at or after them when causal)."""
    delta = q_idx[:, None] - k_idx[None, :]
    allowed = torch.ones(delta.shape, dtype=torch.bool, device=delta.device)
    if causal:
        allowed = delta >= 0
    if window is not None:
        band = (delta < window) & (delta > -window)
        if sink:
            band = band | (k_idx[None, :] < sink)
        allowed = allowed & band
    return allowed


def query_indices(q_len: int, q_offset: int | torch.Tensor, device: torch.device) -> torch.Tensor:
    """(Lq,) long: the key index of each query (query i is key ``q_offset + i``); a tensor offset (a StaticCache's)
    is moved to ``device``, never read as a number."""
    offset = q_offset.to(device) if isinstance(q_offset, torch.Tensor) else q_offset
    return torch.arange(q_len, device=device) + offset


def allowed_keys(
    mask: torch.Tensor | None,
    q_len: int,
    k_len: int,
    q_offset: int | torch.Tensor,
    causal: bool,
    device: torch.device,
) -> torch.Tensor | None:
    """(B|1, 1, Lq, Lk) bool: the keys each query may see -- the attention mask, and on causal models also
    key index <= query index (query i is key ``q_offset + i``), so an absent mask never exposes future or
    empty cache slots. None when every query sees every key."""
    if causal:
        q_idx = query_indices(q_len, q_offset, device)[:, None]
        causal_mask = (q_idx >= torch.arange(k_len, device=device)[None, :])[None, None]
        return causal_mask if mask is None else (mask & causal_mask)
    return mask


def windowed_allowed(
    allowed: torch.Tensor, lq: int, lk: int, q_offset: int | torch.Tensor, window: int | None, sink: int | None = None
) -> torch.Tensor:
    """(B|1, 1, Lq, Lk) bool: ``allowed`` (causal, from `allowed_keys`) and, with a ``window``, the band
    j > qi − window (query i is key ``q_offset + i``), with the ``sink`` first keys besides it. The encodings'
    references treat a key the mask removes as absent: no weight, no CoPE gate, no stick-breaking break; so does
    the window. TypeError / ValueError for a window that is neither None nor an int >= 1."""
    window = check_window(window)
    if window is None:
        return allowed
    qi = query_indices(lq, q_offset, allowed.device)
    return allowed & band_allowed(qi, torch.arange(lk, device=allowed.device), True, window, sink)[None, None]


def mask_key_validity(
    mask: torch.Tensor, causal: bool, q_len: int, k_len: int, q_offset: int | torch.Tensor, band: int | None = None,
    rows: int = 1024,
) -> tuple[torch.Tensor | None, str | None]:
    """The engines' form of a bool ``mask`` (B|1, 1, Lq, Lk) (True = attend): (key_valid (B|1, Lk) or None when
    every key is valid, None) when it is causal at ``q_offset`` (if ``causal``) + key padding (+ the sliding
    ``band``), else (None, the reason). Reads the mask's values, ``rows`` query rows at a time (no (B, Lq, Lk)
    temporaries at long L)."""
    if mask.dim() != 4 or mask.shape[1] != 1:
        return None, f"the kernels take no per-head attention mask (got shape {tuple(mask.shape)})"
    m = mask[:, 0].expand(mask.shape[0], q_len, k_len)
    valid = m.any(dim=-2)  # (B|1, Lk): some query may see the key
    k_idx = torch.arange(k_len, device=mask.device)
    for start in range(0, q_len, rows):
        stop = min(start + rows, q_len)
        expected = valid[:, None, :]
        q_idx = torch.arange(start, stop, device=mask.device) + q_offset
        if causal or band is not None:
            expected = expected & band_allowed(q_idx, k_idx, causal, band)
        if not torch.equal(m[:, start:stop], expected.expand(m.shape[0], stop - start, k_len)):
            form = "causal + key padding" if band is None else f"causal + key padding + the model's {band}-key window"
            return None, (f"the attention mask is not {form} (e.g. packed sequences or a custom 4D mask); the kernels "
                          "take a per-batch key-valid vector")
    return (None if bool(valid.all()) else valid), None


def memo_per_mask(memo: dict | None, tag: str, mask: torch.Tensor | None, extra: tuple, build):
    """``build()``, computed once per forward for each mask (None included) and ``extra`` and shared by the layers
    that get it, in the per-forward ``memo`` (``PosContext.memo``). The memo holds the mask too, so no other mask
    can take its address while the forward runs. Eager mode only: under ``torch.compile`` the key (the mask's
    address) cannot be traced, and ``build()`` runs at each call."""
    if memo is None or torch.compiler.is_compiling():
        return build()
    key = (tag, None if mask is None else (mask.data_ptr(), tuple(mask.shape), mask.stride()), *extra)
    if key not in memo:
        memo[key] = (mask, build())
    return memo[key][1]
