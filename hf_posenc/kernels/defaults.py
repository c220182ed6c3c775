"""The default backend of each kernel kind on CUDA: the one table the dispatchers read.

``HF_POSENC_BACKEND`` unset and the tensors on a CUDA device, an op runs the backend named here for its
kind, when that backend supports the inputs (else the PyTorch reference, as on the CPU):

* ``"triton"``: hf_posenc's Triton kernel;
* ``"flex"``: torch's FlexAttention with the term as a score_mod (attention terms of ``FLEX_KINDS`` only);
* ``"torch"``: the PyTorch reference (SDPA with the bias for the bias terms; the encoding's ``attend``).

Where the entries come from. "Defaults come from measurement" (issue 13): each entry should be the backend
that passed ``pytest -m gpu`` and was fastest in ``make gpu-check`` (benchmarks/results/gpu_check_<GPU>.*).
**Measured on one H100 (torch 2.11, Triton 3.6; benchmarks/results/gpu_check_nvidia-h100-80gb-hbm3*.md): the
Triton kernels were correct and the fastest backend of every kind timed** (FlexAttention 2-85x slower or not
compiling; the references 3-20x slower), so the entries stay "triton", each with its measurement in
``MEASURED``; none met the design target of 1.10x SDPA flash. ``dpb`` (no benchmark row) and ``remap`` (the remap
engine's kernels, `hf_posenc.kernels.remap.triton_span`, written after that session) are unmeasured.
A term registered later (a user's, through the public registry) has no entry here: its default is derived from its
registry entry when asked (`cuda_default_backend`): ``triton`` where it has a Triton branch (its own or
another's), else ``torch`` (the tile engine; FlexAttention only when forced, until measured).
Float32 CoPE is the exception, per call rather than per kind: its kernel failed on the H100
(``hf_posenc.kernels.cope.FLOAT32_ON_CUDA``), so the CoPE dispatch runs float32 inputs on the PyTorch engine.
A GPU session that measures otherwise sets an entry below the derived defaults
(``CUDA_DEFAULT_BACKEND[kind] = ...``) -- and only there -- with the result it came from in ``MEASURED``.
"""

from __future__ import annotations

from .attention.terms import TERMS, term_kinds

__all__ = ["CUDA_DEFAULT_BACKEND", "MEASURED", "KINDS", "cuda_default_backend"]

#: the attentions with their own kernels and the rotary kernel (the attention terms come from the term registry).
_OWN_KERNELS = ("sba", "cope", "rotary", "remap")
#: attention terms (the term registry's built-in kinds, ``kernels.attention.terms.term_kinds()`` when this module was
#: imported), the attentions with their own kernels and the rotary kernel.
KINDS = (*term_kinds(), *_OWN_KERNELS)


def _available(kind: str) -> tuple[str, ...]:
    """The backends ``kind`` has on CUDA: triton where it has a Triton branch (its own or another term's), flex where
    a score_mod can say it (shaw's value term cannot), torch everywhere; () for an unknown kind."""
    if kind in _OWN_KERNELS:
        return ("triton", "torch")
    spec = TERMS.get(kind)
    if spec is None:
        return ()
    return (("triton",) if spec.triton is not None else ()) + (("flex",) if spec.flex else ()) + ("torch",)


def _derived_default(kind: str) -> str:
    """The default of a kind without a measured one: triton where it has a Triton branch, else the tile engine."""
    return "triton" if "triton" in _available(kind) else "torch"


#: kind -> default backend on CUDA: triton wherever a kind has a Triton branch (measured fastest on an H100 for
#: every kind timed, see the module docstring); a measured change replaces its default here, with its source in
#: MEASURED. Kinds registered later take `_derived_default` (see `cuda_default_backend`).
CUDA_DEFAULT_BACKEND: dict[str, str] = {kind: _derived_default(kind) for kind in KINDS}

#: kind -> the measurement an entry came from (GPU, benchmark file, ratio to the runner-up). Absent: unmeasured.
_H100 = "H100, bf16, L = 1024, H = 32, D = 128, forward+backward; benchmarks/results/gpu_check_nvidia-h100-80gb-hbm3"
MEASURED: dict[str, str] = {
    "none": f"triton 1.33 ms, flex 2.93, reference 10.5, SDPA flash 0.72 ({_H100}, B = 4)",
    "alibi": f"triton 1.32 ms, flex 3.03, reference 11.2, SDPA flash 0.72 ({_H100}, B = 4)",
    "kerple_log": f"triton 1.47 ms, flex 126, reference 13.1, SDPA flash 0.72 ({_H100}, B = 4)",
    "kerple_pow": f"triton 1.76 ms, flex 126, reference 12.9, SDPA flash 0.72 ({_H100}, B = 4)",
    "sandwich": f"triton 1.59 ms, flex 3.43, reference 11.6, SDPA flash 0.72 ({_H100}, B = 4)",
    "t5": f"triton 3.35 ms, flex did not compile (shared memory), reference 79.6, SDPA flash 0.72 ({_H100}, B = 4)",
    "fire": f"triton 16.1 ms, flex did not compile (shared memory), reference 152, SDPA flash 0.72 ({_H100}, B = 4)",
    "shaw": f"triton 4.86 ms, no flex form, reference 53.9, SDPA flash 0.72 ({_H100}, B = 4)",
    "fox": f"triton 1.42 ms, flex did not compile, reference 12.4, SDPA flash 0.72 ({_H100}, B = 4)",
    "sba": f"triton 1.39 ms, reference 4.47, SDPA flash 0.38 ({_H100}_run1.json, B = 1)",
    "cope": f"triton 1.99 ms, reference 8.85, SDPA flash 0.38 ({_H100}_run1.json, B = 1); float32: PyTorch "
            "(hf_posenc.kernels.cope.FLOAT32_ON_CUDA)",
    "rotary": f"triton 1.05 ms, compiled PyTorch 1.16, PyTorch 1.42 (s = 2, B = 1; {_H100}_run1.json)",
}


def _validate(table: dict[str, str]) -> None:
    missing = set(KINDS) - set(table)
    if missing:
        raise ValueError(f"CUDA_DEFAULT_BACKEND lacks the kinds {sorted(missing)}")
    for kind, backend in table.items():
        available = _available(kind)
        if not available:
            raise ValueError(f"CUDA_DEFAULT_BACKEND names an unknown kind {kind!r}; allowed: {', '.join(KINDS)}")
        if backend not in available:
            raise ValueError(
                f"CUDA_DEFAULT_BACKEND[{kind!r}] = {backend!r}; {kind} can run on {', '.join(available)}"
            )


_validate(CUDA_DEFAULT_BACKEND)


def cuda_default_backend(kinds: str | tuple[str, ...] | list[str]) -> str:
    """The default CUDA backend of a kind (``"triton"``, ``"flex"`` or ``"torch"``), read from the table now (a term
    registered after this module was imported, with no entry there: derived from its registry entry).

    ``kinds`` may list several kinds (an encoding whose instances produce one of them, e.g. kerple's
    ``("kerple_log", "kerple_pow")``): they must share one entry.

    Raises:
        ValueError: an unknown kind, or kinds of one encoding with different entries.
    """
    kinds = (kinds,) if isinstance(kinds, str) else tuple(kinds)
    if not kinds:
        raise ValueError("cuda_default_backend needs at least one kind")
    for kind in kinds:
        if kind not in CUDA_DEFAULT_BACKEND and not _available(kind):
            raise ValueError(f"unknown kernel kind {kind!r}; allowed: {', '.join((*term_kinds(), *_OWN_KERNELS))}")
    choices = {CUDA_DEFAULT_BACKEND.get(kind) or _derived_default(kind) for kind in kinds}
    if len(choices) > 1:
        raise ValueError(
            f"CUDA_DEFAULT_BACKEND gives the kinds {kinds} of one encoding different backends {sorted(choices)}; "
            "give them one entry"
        )
    return choices.pop()
