"""Lazy, per-mode ``triton.jit`` for kernel modules whose kernels call helper functions.

``triton.jit`` decides when it decorates a function whether the result is compiled or interpreted
(``TRITON_INTERPRET=1``), and an interpreted kernel cannot call a *compiled* ``@jit`` function ("Cannot call
@triton.jit'd outside of the scope of a kernel"). Triton's own library functions (``tl.sum``, ``tl.max``,
``tl.cumsum``, ``tl.sigmoid``, ``tl.zeros``, ``tl.cdiv``...) are decorated when triton is first imported, so a
kernel that calls them only runs in the interpreter when ``TRITON_INTERPRET=1`` was set before that import
(in this test-suite transformers imports triton first).

The kernels of ``sba`` and ``cope`` therefore use only builtins of ``triton.language`` (``tl.reduce`` and
``tl.associative_scan`` with their own combine functions instead of ``tl.sum`` / ``tl.cumsum``), and every
function they call -- the combine functions, the shared tile helpers and the kernels themselves -- is
written undecorated and jitted here, on first use, in the mode then in force. `bind` installs the
jitted functions into the kernel module's globals under their own names (a kernel finds its helpers by
global name when it is traced or interpreted), so the module works whether or not the variable was set
before triton's import, and a CPU process may run the interpreter after importing the module.
"""

from __future__ import annotations

import os
from typing import Callable

__all__ = ["interpreting", "LazyJit"]


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``), read now."""
    try:
        from triton import knobs

        return bool(knobs.runtime.interpret)
    except (ImportError, AttributeError):  # triton < 3.4 has no knobs
        return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


class LazyJit:
    """Jit a module's undecorated kernels and helpers once per mode and bind them into its globals.

    Args:
        namespace: the kernel module's ``globals()``.
        helpers: the undecorated device functions the kernels call (combine functions included).
        kernels: the undecorated kernels. All are bound under their ``__name__``.
        interpreter_combines: {name of a combine function in ``functions``: name of the equivalent function
            of ``triton.language.standard``} bound instead in the interpreter (see ``bind``).
    """

    def __init__(
        self,
        namespace: dict,
        helpers: list[Callable],
        kernels: list[Callable],
        interpreter_combines: dict[str, str] | None = None,
    ) -> None:
        self._namespace = namespace
        self._helpers = list(helpers)
        self._kernels = list(kernels)
        self._combines = dict(interpreter_combines or {})
        self._built: dict[bool, dict[str, object]] = {}

    def bind(self) -> dict[str, object]:
        """The jitted functions for the current mode (built on first use), installed in the module's globals."""
        import triton

        mode = interpreting()
        table = self._built.get(mode)
        if table is None:
            table = {fn.__name__: triton.jit(fn) for fn in self._kernels}
            if not mode:
                table.update({fn.__name__: triton.jit(fn) for fn in self._helpers})
            else:
                # In the interpreter a kernel is plain Python running on patched ``triton.language``: helpers
                # are called as plain functions (an interpreted @jit helper re-patches the language on every
                # call, ~3 ms each). tl.reduce / tl.associative_scan use numpy only when the combine function
                # *is* one of triton's own (an identity check; it is not called) and call any other one
                # element by element in Python (~1000x slower): bind triton's where it has them.
                import triton.language as tl

                table.update({fn.__name__: fn for fn in self._helpers})
                for name, std in self._combines.items():
                    fn = getattr(tl.standard, std, None)
                    if fn is not None:
                        table[name] = fn
            self._built[mode] = table
        self._namespace.update(table)
        return table
