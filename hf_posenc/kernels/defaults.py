"""The default backend of each kernel kind on CUDA: the one table the dispatchers read.

``HF_POSENC_BACKEND`` unset and the tensors on a CUDA device, an op runs the backend named here for its
kind, when that backend supports the inputs (else the PyTorch reference, as on the CPU):

* ``"triton"``: hf_posenc's Triton kernel;
* ``"flex"``: torch's FlexAttention with the term as a score_mod (attention terms of ``FLEX_KINDS`` only);
* ``"torch"``: the PyTorch reference (SDPA with the bias for the bias terms; the encoding's ``attend``).

Where the entries come from. "Defaults come from measurement" (issue 13): each entry should be the backend
that passed ``pytest -m gpu`` and was fastest in ``make gpu-check`` (benchmarks/results/gpu_check_<GPU>.*)
on an H100 / H200. **As of this writing no GPU has run these kernels: every entry is unmeasured, and is
"triton" by design** (the kernels exist to be the default). The GPU session that runs ``make gpu-check``
sets an entry below the derived defaults (``CUDA_DEFAULT_BACKEND[kind] = ...``) -- and only there -- with the result it came from in ``MEASURED``.
"""

from __future__ import annotations

from .attention.terms import TERM_KINDS, TERMS

__all__ = ["CUDA_DEFAULT_BACKEND", "MEASURED", "KINDS", "cuda_default_backend"]

#: attention terms (the term registry, ``kernels.attention.terms.TERM_KINDS``), the attentions with their own
#: kernels and the rotary kernel.
KINDS = (*TERM_KINDS, "sba", "cope", "rotary")

#: which backends each kind has on CUDA: triton where it has a Triton branch (its own or another term's), flex
#: where a score_mod can say it (shaw's value term cannot), torch everywhere.
_AVAILABLE = {kind: ("triton", "torch") for kind in ("sba", "cope", "rotary")}
for _kind, _spec in TERMS.items():
    _AVAILABLE[_kind] = (("triton",) if _spec.triton is not None else ()) + (("flex",) if _spec.flex else ()) + (
        "torch",)

#: kind -> default backend on CUDA. Unmeasured (no GPU yet): triton by design wherever a kind has a Triton
#: branch, see the module docstring; a measured entry replaces its default here, with its source in MEASURED.
CUDA_DEFAULT_BACKEND: dict[str, str] = {kind: backends[0] for kind, backends in _AVAILABLE.items()}

#: kind -> the measurement an entry came from (GPU, benchmark file, ratio to the runner-up). Empty: unmeasured.
MEASURED: dict[str, str] = {}


def _validate(table: dict[str, str]) -> None:
    missing = set(KINDS) - set(table)
    if missing:
        raise ValueError(f"CUDA_DEFAULT_BACKEND lacks the kinds {sorted(missing)}")
    for kind, backend in table.items():
        if kind not in _AVAILABLE:
            raise ValueError(f"CUDA_DEFAULT_BACKEND names an unknown kind {kind!r}; allowed: {', '.join(KINDS)}")
        if backend not in _AVAILABLE[kind]:
            raise ValueError(
                f"CUDA_DEFAULT_BACKEND[{kind!r}] = {backend!r}; {kind} can run on {', '.join(_AVAILABLE[kind])}"
            )


_validate(CUDA_DEFAULT_BACKEND)


def cuda_default_backend(kinds: str | tuple[str, ...] | list[str]) -> str:
    """The default CUDA backend of a kind (``"triton"``, ``"flex"`` or ``"torch"``), read from the table now.

    ``kinds`` may list several kinds (an encoding whose instances produce one of them, e.g. kerple's
    ``("kerple_log", "kerple_pow")``): they must share one entry.

    Raises:
        ValueError: an unknown kind, or kinds of one encoding with different entries.
    """
    kinds = (kinds,) if isinstance(kinds, str) else tuple(kinds)
    if not kinds:
        raise ValueError("cuda_default_backend needs at least one kind")
    for kind in kinds:
        if kind not in CUDA_DEFAULT_BACKEND:
            raise ValueError(f"unknown kernel kind {kind!r}; allowed: {', '.join(KINDS)}")
    choices = {CUDA_DEFAULT_BACKEND[kind] for kind in kinds}
    if len(choices) > 1:
        raise ValueError(
            f"CUDA_DEFAULT_BACKEND gives the kinds {kinds} of one encoding different backends {sorted(choices)}; "
            "give them one entry"
        )
    return choices.pop()
