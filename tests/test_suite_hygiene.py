"""The test suite checks itself for tests that cannot fail (issue 45).

Read from the source (``ast``), not collected: a test whose body is only its docstring passes whatever the package
does, and a second ``def test_x`` in one module silently replaces the first (pytest collects the last). Both
happened: ``test_spectral_rotation_bad_inputs`` lost its body to the next test, which then ran its cases twice.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def _is_inert(stmt: ast.stmt) -> bool:
    """A statement that does nothing: a docstring or other bare constant (``...``), or ``pass``."""
    return isinstance(stmt, ast.Pass) or (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant))


def empty_tests(source: str) -> list[str]:
    """Names of the test functions (``test_*``, at module level or in a class) whose body does nothing."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            if all(_is_inert(stmt) for stmt in node.body):
                out.append(node.name)
    return out


def redefined_tests(source: str) -> list[str]:
    """Names of the test functions defined twice in one scope (module or class): pytest keeps only the last."""
    out = []
    scopes = [ast.parse(source)] + [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef)]
    for scope in scopes:
        seen = set()
        for stmt in scope.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name.startswith("test"):
                if stmt.name in seen:
                    out.append(stmt.name)
                seen.add(stmt.name)
    return out


def _test_files() -> list[Path]:
    return sorted(TESTS.glob("test_*.py"))


@pytest.mark.parametrize("check", [empty_tests, redefined_tests], ids=["empty", "redefined"])
def test_no_test_that_cannot_fail(check):
    files = _test_files()
    assert len(files) > 40  # the glob sees the suite
    found = {f.name: names for f in files if (names := check(f.read_text()))}
    assert not found, f"{check.__name__}: {found}"


def test_the_checks_find_what_they_look_for():
    """Each check on a small source that has the fault, and on one that does not."""
    src = (
        "def test_a():\n    '''only a docstring'''\n\n"
        "def test_b():\n    pass\n\n"
        "def test_c():\n    '''doc'''\n    ...\n\n"
        "def test_d():\n    assert 1\n\n"
        "class TestX:\n    def test_e(self):\n        '''doc'''\n\n    def test_e(self):\n        assert 1\n\n"
        "def test_d():\n    assert 2\n\n"
        "def helper():\n    pass\n"
    )
    assert empty_tests(src) == ["test_a", "test_b", "test_c", "test_e"]
    assert redefined_tests(src) == ["test_d", "test_e"]


def test_kernel_modules_skip_only_without_triton(monkeypatch, tmp_path):
    """``conftest.import_kernel_modules``: an ImportError raised inside a kernel module propagates (the kernel test
    file fails at collection); only Triton itself missing gives a skip reason."""
    import sys

    from conftest import import_kernel_modules

    (tmp_path / "hf_posenc_broken_kernel.py").write_text("from hf_posenc.kernels import _no_such_helper\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError, match="_no_such_helper"):
        import_kernel_modules("hf_posenc_broken_kernel")
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now raises ImportError(name="triton")
    modules, reason = import_kernel_modules("hf_posenc_broken_kernel")
    assert modules == (None,) and reason.startswith("triton is not installed")
