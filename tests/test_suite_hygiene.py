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


# -- deprecation warnings: ours fail the run ---------------------------------------------------------------------

#: A test file run by ``test_deprecations_from_our_code_fail_the_run`` with the project's pytest configuration. The
#: ``ours_*`` tests each make a deprecated call from a test module or from a module of hf_posenc (a function whose
#: module is named ``hf_posenc._injected``: warnings are attributed by module name); ``theirs_*`` make the same kinds
#: of call from a third party's module (``vendor_lib``, beside it). ``{token}`` makes the messages unique to the run.
INJECTED = '''
import types
import warnings

from transformers import DynamicCache

import vendor_lib
from conftest import make_ids, make_model, with_cache


def _in_hf_posenc(source):
    module = types.ModuleType("hf_posenc._injected")
    exec(source, module.__dict__)
    return module.call


def _model_and_cache():
    model = make_model("llama")
    return model, make_ids(1, 4), DynamicCache(config=model.config)


def test_ours_deprecation_in_a_test():
    warnings.warn("{token}: a test's deprecated call", DeprecationWarning)


def test_ours_future_warning_in_a_test():
    warnings.warn("{token}: a test's call of a changing API", FutureWarning)


def test_ours_deprecation_in_hf_posenc():
    _in_hf_posenc("import warnings\\ndef call():\\n    warnings.warn('{token}: in hf_posenc', DeprecationWarning)\\n")()


def test_ours_old_cache_name_in_a_test():
    model, ids, cache = _model_and_cache()
    model(ids, past_key_values=cache)


def test_ours_old_cache_name_in_hf_posenc():
    model, ids, cache = _model_and_cache()
    _in_hf_posenc("def call(model, ids, cache):\\n    return model(ids, past_key_values=cache)\\n")(model, ids, cache)


def test_theirs_deprecation_twice():
    vendor_lib.deprecated_inside()
    vendor_lib.deprecated_inside()


def test_theirs_deprecation_again():
    vendor_lib.deprecated_inside()


def test_theirs_old_cache_name():
    vendor_lib.call_with_old_cache_name(*_model_and_cache())


def test_the_cache_name_of_the_installed_transformers():
    model, ids, cache = _model_and_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        warnings.simplefilter("error", FutureWarning)
        model(ids, **with_cache(cache))
'''

VENDOR = '''
import warnings


def deprecated_inside():
    warnings.warn("{token}: vendor_lib's own deprecation", DeprecationWarning)


def call_with_old_cache_name(model, ids, cache):
    return model(ids, past_key_values=cache)
'''


def test_deprecations_from_our_code_fail_the_run(pytester):
    """pyproject.toml's filterwarnings, run in-process on `INJECTED`: a DeprecationWarning or FutureWarning from
    a test or from hf_posenc fails its test, transformers' deprecated ``past_key_values=`` included when a test or
    hf_posenc calls a model with it (where the installed transformers deprecates it); a third party's deprecation
    passes and is reported: once per test however often it is raised there, and its text once in the summary."""
    from conftest import CACHE_ARG

    token = f"injected-{pytester.path.name}"
    pytester.makepyfile(vendor_lib=VENDOR.replace("{token}", token),
                        test_injected=INJECTED.replace("{token}", token))
    pytester.syspathinsert()
    result = pytester.runpytest_inprocess("-c", str(TESTS.parent / "pyproject.toml"), "--rootdir", str(pytester.path),
                                          "-p", "no:cacheprovider", "test_injected.py")
    run = result.reprec
    outcomes = {r.nodeid.split("::")[-1]: r for r in run.getreports("pytest_runtest_logreport") if r.when == "call"}
    deprecated = CACHE_ARG == "cache"  # transformers >= 5.24: past_key_values is deprecated
    ours = [f"test_ours_{case}" for case in ("deprecation_in_a_test", "future_warning_in_a_test",
                                             "deprecation_in_hf_posenc")]
    ours += [f"test_ours_old_cache_name_in_{where}" for where in ("a_test", "hf_posenc") if deprecated]
    assert sorted(n for n, r in outcomes.items() if r.failed) == sorted(ours)
    assert len(outcomes) == 9 and all(r.passed for n, r in outcomes.items() if n not in ours)
    for name in ours:
        kind = "FutureWarning" if "future" in name or "cache" in name else "DeprecationWarning"
        assert kind in outcomes[name].longreprtext, (name, outcomes[name].longreprtext[-500:])
    recorded = [(c.nodeid.split("::")[-1], str(c.warning_message.message))
                for c in run.getcalls("pytest_warning_recorded") if token in str(c.warning_message.message)]
    message = f"{token}: vendor_lib's own deprecation"
    assert recorded == [("test_theirs_deprecation_twice", message), ("test_theirs_deprecation_again", message)]
    assert result.stdout.str().count(f"DeprecationWarning: {message}") == 1  # the summary groups the tests
