"""The package's import structure: no import cycle between hf_posenc's modules, and the kernels never import
the encodings (DESIGN.md: a kernel takes tensors; the encodings sit above the kernels).

The graph is read from the source with :mod:`ast` (nothing is imported). An edge ``A -> B`` means that
running module ``A`` imports module ``B``:

- ``import hf_posenc.x.y`` and ``from hf_posenc.x import y`` (absolute or relative, resolved against ``A``'s
  package) give an edge to the module that is named; ``from P import name`` gives an edge to ``P.name`` where
  that is a module of the package (a submodule import), and to ``P`` otherwise;
- importing ``P.Q.m`` also runs the packages ``P`` and ``P.Q``; an edge goes to each of them that does not
  enclose ``A`` itself (a module's own enclosing packages are already being imported when it runs, so the
  import statement adds nothing there);
- imports under ``if TYPE_CHECKING:`` never run and are left out of ``test_no_import_cycles``; they are edges
  all the same for ``test_no_cycles_even_for_type_checkers`` (issue 54: ``study.train`` imported
  ``study.pretrained`` and ``study.sources``, which imported ``StudyConfig`` back from it under ``TYPE_CHECKING``:
  a circle in the design, for readers and type checkers, that only the import order hid);
- **imports inside functions count** like module-level ones. A function-level import that exists to break
  a module-level cycle is still a cycle in the design (the two modules still need each other); it only moves
  the failure from import time to call time. The one exception is :data:`LAZY_ALLOWED`: imports inside a
  function that are named there, each with the reason it must stay lazy. Every entry is checked to still
  exist, so the list cannot go stale.

Only modules of hf_posenc are nodes; imports of other packages (torch, transformers, triton) are left out, and so
is ``hf_posenc.kernels._common.triton_import_error``'s ``importlib`` probe of a kernel module (a name in a string).

``test_shared_things_are_defined_once`` also reads the source: the window check, the mask helpers, the kernel
dtypes, the head-dim limit, the Triton probe and the cache-state packing are each defined in one module.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = "hf_posenc"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE

# (importing module, imported module) pairs whose import inside a function is allowed to close a cycle,
# with the reason. Empty: no lazy import inside the package is needed to break a cycle.
LAZY_ALLOWED: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Edge:
    """One import of module ``target`` by module ``source`` at ``line``; ``lazy`` when inside a function,
    ``typing`` when under ``if TYPE_CHECKING:`` (it never runs)."""

    source: str
    target: str
    line: int
    lazy: bool
    typing: bool = False


def _modules(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Every module of the package: dotted name -> file (a package's name maps to its ``__init__.py``)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join([package, *parts])] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, type_checking: bool = False):
    """Yield (import node, inside a function, under ``if TYPE_CHECKING:``) for every import that runs, and with
    ``type_checking`` also for those under ``if TYPE_CHECKING:`` (skipped otherwise)."""

    def walk(node: ast.AST, lazy: bool, typing: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                if type_checking:
                    for other in child.body:
                        yield from walk_one(other, lazy, True)
                for other in child.orelse:
                    yield from walk_one(other, lazy, typing)
                continue
            yield from walk_one(child, lazy, typing)

    def walk_one(child: ast.AST, lazy: bool, typing: bool):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, lazy, typing
        inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        yield from walk(child, inner, typing)

    yield from walk(tree, False, False)


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph(root: Path = ROOT, package: str = PACKAGE, type_checking: bool = False) -> list[Edge]:
    """Every import edge between the modules of ``package`` (its source under ``root``); with ``type_checking``
    also the imports under ``if TYPE_CHECKING:``."""
    modules = _modules(root, package)
    edges = []
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        # The package that relative imports start from: the module's own for a package's __init__.
        base = name.split(".") if is_package else name.split(".")[:-1]
        own = set(_ancestors(name))
        for node, lazy, typing in _imports(ast.parse(path.read_text(), filename=str(path)), type_checking):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    if node.level - 1 > len(base) - 1:
                        raise AssertionError(f"{path}:{node.lineno}: relative import above the package")
                    prefix = base[: len(base) - (node.level - 1)]
                    parent = ".".join(prefix + ([node.module] if node.module else []))
                else:
                    parent = node.module or ""
                for alias in node.names:
                    sub = f"{parent}.{alias.name}"
                    targets.append(sub if sub in modules else parent)
            for target in targets:
                if target != package and not target.startswith(package + "."):
                    continue
                if target not in modules:
                    raise AssertionError(f"{path}:{node.lineno}: imports {target}, which is not a module of {package}")
                for module in [*_ancestors(target), target]:
                    if module in modules and module not in own and module != name:
                        edges.append(Edge(name, module, node.lineno, lazy, typing))
    return edges


def find_cycles(edges: list[Edge]) -> list[list[str]]:
    """The strongly connected components of more than one module (or a module importing itself), each
    sorted; Tarjan's algorithm, iterative."""
    graph: dict[str, set[str]] = {}
    for edge in edges:
        graph.setdefault(edge.source, set()).add(edge.target)
        graph.setdefault(edge.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph[node]:
                    components.append(sorted(component))
    return sorted(components)


def _describe(component: list[str], edges: list[Edge]) -> str:
    inside = set(component)
    lines = [
        f"  {e.source} -> {e.target} (line {e.line}{', inside a function' if e.lazy else ''}"
        f"{', under TYPE_CHECKING' if e.typing else ''})"
        for e in edges
        if e.source in inside and e.target in inside
    ]
    return "cycle among " + ", ".join(component) + ":\n" + "\n".join(sorted(set(lines)))


def _counted(edges: list[Edge]) -> list[Edge]:
    return [e for e in edges if not (e.lazy and (e.source, e.target) in LAZY_ALLOWED)]


def test_no_import_cycles():
    edges = _counted(import_graph())
    cycles = find_cycles(edges)
    assert not cycles, "import cycles:\n" + "\n".join(_describe(c, edges) for c in cycles)


def test_no_cycles_even_for_type_checkers():
    """Imports under ``if TYPE_CHECKING:`` never run, but a circle through them is still one in the design: what
    two modules share belongs in a module below both (``hf_posenc.study.config`` holds ``StudyConfig``)."""
    edges = _counted(import_graph(type_checking=True))
    cycles = find_cycles(edges)
    assert not cycles, "import cycles, counting TYPE_CHECKING imports:\n" + "\n".join(
        _describe(c, edges) for c in cycles)


def test_kernels_never_import_encodings():
    bad = [
        e
        for e in import_graph()
        if e.source.startswith(f"{PACKAGE}.kernels") and e.target.startswith(f"{PACKAGE}.encodings")
    ]
    assert not bad, "kernels importing encodings:\n" + "\n".join(
        sorted({f"  {e.source} -> {e.target} (line {e.line}{', inside a function' if e.lazy else ''})" for e in bad})
    )


def test_lazy_allowances_are_used():
    """Every entry of LAZY_ALLOWED still names a lazy import that exists (the list cannot go stale)."""
    lazy = {(e.source, e.target) for e in import_graph() if e.lazy}
    stale = sorted(set(LAZY_ALLOWED) - lazy)
    assert not stale, f"LAZY_ALLOWED names imports that no longer exist: {stale}"


# Names with one definition in the package (issue 32: each had two to seven copies that drifted apart).
SINGLE_DEFINITIONS = {
    "check_window": "hf_posenc.kernels._masks",
    "band_allowed": "hf_posenc.kernels._masks",
    "allowed_keys": "hf_posenc.kernels._masks",
    "windowed_allowed": "hf_posenc.kernels._masks",
    "MAX_HEAD_DIM": "hf_posenc.kernels._common",
    "KERNEL_DTYPES": "hf_posenc.kernels._common",
    "triton_import_error": "hf_posenc.kernels._common",
    "compute_dtype": "hf_posenc.kernels._common",
    "pack_state": "hf_posenc.encodings.cache_state",
    "unpack_state": "hf_posenc.encodings.cache_state",
    "state_width": "hf_posenc.encodings.cache_state",
}


def _definitions(root: Path = ROOT, package: str = PACKAGE) -> dict[str, list[str]]:
    """name -> the modules that define it at module level (a def, a class or an assignment), and every module
    that assigns a tuple of the three kernel dtypes, under the name ``(float32, bfloat16, float16)``."""
    found: dict[str, list[str]] = {}
    for name, path in _modules(root, package).items():
        for node in ast.parse(path.read_text()).body:
            names = []
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names = [node.name]
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [t.id for t in targets if isinstance(t, ast.Name)]
                value = node.value
                if isinstance(value, ast.Tuple) and sorted(
                    e.attr for e in value.elts if isinstance(e, ast.Attribute)
                ) == ["bfloat16", "float16", "float32"]:
                    names.append("(float32, bfloat16, float16)")
            for defined in names:
                found.setdefault(defined, []).append(name)
    return found


def test_shared_things_are_defined_once():
    defs = _definitions()
    wrong = {
        name: defs.get(name, [])
        for name, module in {**SINGLE_DEFINITIONS, "(float32, bfloat16, float16)": "hf_posenc.kernels._common"}.items()
        if defs.get(name, []) != [module]
    }
    assert not wrong, f"defined elsewhere or more than once (name: modules): {wrong}"


# The checker itself, on small packages written to a temporary folder: it must find what it is for.


def _write(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_checker_finds_a_module_level_cycle(tmp_path):
    root = _write(tmp_path, {"__init__.py": "", "a.py": "from .b import x\n", "b.py": "from . import a\nx = 1\n"})
    assert find_cycles(import_graph(root, "pkg")) == [["pkg.a", "pkg.b"]]


def test_checker_counts_an_import_inside_a_function(tmp_path):
    root = _write(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "from .b import x\n",
            "b.py": "x = 1\ndef f():\n    from .a import y\n",
            "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .d import z\n",
            "d.py": "from .c import w\n",
        },
    )
    edges = import_graph(root, "pkg")
    assert [e.lazy for e in edges if e.source == "pkg.b"] == [True]
    # The TYPE_CHECKING import of c never runs: no c <-> d cycle.
    assert find_cycles(edges) == [["pkg.a", "pkg.b"]]
    # ... but counted for type checkers, it closes one.
    typed = import_graph(root, "pkg", type_checking=True)
    assert [(e.target, e.typing) for e in typed if e.source == "pkg.c"] == [("pkg.d", True)]
    assert find_cycles(typed) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"]]


def test_checker_follows_enclosing_packages_and_relative_levels(tmp_path):
    root = _write(
        tmp_path,
        {
            "__init__.py": "",
            "k/__init__.py": "from .m import f\n",
            "k/m.py": "from ..e.n import g\n",
            "e/__init__.py": "from ..k import m\n",
            "e/n.py": "g = 1\n",
        },
    )
    edges = import_graph(root, "pkg")
    # k.m -> e.n also runs the package e, whose __init__ imports k.m.
    assert ("pkg.k.m", "pkg.e") in {(e.source, e.target) for e in edges}
    assert find_cycles(edges) == [["pkg.e", "pkg.k", "pkg.k.m"]]


@pytest.mark.parametrize("package", [PACKAGE])
def test_graph_sees_the_package(package):
    """The graph reads the real package: the known edges are there (the tests above are not vacuous)."""
    pairs = {(e.source, e.target) for e in import_graph()}
    assert (f"{package}.api", f"{package}.config") in pairs
    assert (f"{package}.encodings.cope", f"{package}.kernels.cope") in pairs
