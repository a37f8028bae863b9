"""No import cycles among meshrl's modules: module-level imports, and function-level ones too.

A function-level import that is there only to break a cycle still is one: the two modules depend on
each other, neither reads alone, and the import fails at call time instead of at start. So the
graph takes every import of a meshrl module wherever it is written (module level, in a function or
a class, under ``if __name__ == "__main__":``), and each strongly connected component of more than
one module, or a module that imports itself, is a cycle.

How an import becomes an edge (``import_graph``):

- ``import meshrl.a.b`` and ``from meshrl.a.b import name`` (or the relative spelling) go to
  ``meshrl.a.b``; ``from meshrl.a import b`` goes to ``meshrl.a.b`` when that is a module.
- ``from meshrl.a import Name`` otherwise goes to the module that defines ``Name`` when the package
  ``meshrl.a`` re-exports it: its ``__init__`` imports it (``from .sub import Name``, ``from
  meshrl.a.sub import Name``, under ``TYPE_CHECKING`` included) or maps it in a PEP 562 lazy table
  (a module-level dict literal ``{"Name": "meshrl.a.sub"}`` or ``{"Name": "sub"}``), followed
  through packages; else to ``meshrl.a`` itself. Without this, a package whose ``__init__``
  re-exports its submodules' names would form a trivial cycle with every submodule that imports a
  sibling through the package, though the sibling is what it depends on.
- A package's ``__init__`` is a module like any other: its own imports are edges. A submodule that
  imports a name *defined* in its package's ``__init__`` that imports it back is a real cycle.
- An import under ``if TYPE_CHECKING:`` is no edge (it never runs: annotations only), and neither is
  the implicit import of the packages above a module: Python runs ``meshrl/a/__init__.py`` before
  ``meshrl/a/b.py``, so that order never leaves a module half-initialised by itself.
- ``importlib.import_module`` calls are no edges: outside the lazy tables above, meshrl's import
  only what they are given at run time (a task's reward function).

``KNOWN_CYCLES`` lists the cycles known and not fixed yet; each entry must still be exactly one of
the cycles found, so the list only shrinks.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

KNOWN_CYCLES: list[frozenset[str]] = [
    # None left. An entry is the exact set of modules of one cycle, with why it stays and its imports:
    # frozenset({"meshrl.a", "meshrl.b"}),  # a.py:12 `from meshrl.b import x`; b.py:40 `from meshrl.a import y`
]
"""Cycles known and not fixed yet (#27 fixed the one among the server modules of ``meshrl.engines``)."""


class Edge:
    """One import of ``target`` in ``source``: where it is written, for the failure message."""

    def __init__(self, source: str, target: str, path: Path, line: int, text: str):
        self.source, self.target, self.path, self.line, self.text = source, target, path, line, text

    def __str__(self) -> str:
        return f"{self.source} -> {self.target}    ({self.path}:{self.line}: {self.text})"


def _modules(root: Path, package: str) -> dict[str, Path]:
    """Dotted name -> file of every module under ``root/package`` (a package's ``__init__.py`` is the package)."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module) -> list[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement of ``tree`` at any depth, and whether it is under ``if TYPE_CHECKING:``."""
    out: list[tuple[ast.Import | ast.ImportFrom, bool]] = []

    def walk(node: ast.AST, typing_only: bool) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append((node, typing_only))
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                walk(child, True)
            for child in node.orelse:
                walk(child, typing_only)
            return
        for child in ast.iter_child_nodes(node):
            walk(child, typing_only)

    walk(tree, False)
    return out


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module name of a ``from ... import`` (relative ones resolved against ``module``)."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _lazy_tables(tree: ast.Module, package: str, modules: dict[str, Path]) -> dict[str, str]:
    """Name -> module of the module-level dict literals of an ``__init__`` whose values name modules."""
    out = {}
    for node in tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if not isinstance(value, ast.Dict):
            continue
        for key, target in zip(value.keys, value.values):
            if not (isinstance(key, ast.Constant) and isinstance(key.value, str)
                    and isinstance(target, ast.Constant) and isinstance(target.value, str)):
                continue
            for name in (target.value, f"{package}.{target.value}"):
                if name in modules:
                    out[key.value] = name
                    break
    return out


def _parse(text: str, path: Path) -> ast.Module:
    """``ast.parse``, again on CPython's spurious "AST constructor recursion depth mismatch"
    (python/cpython#106905): the AST builder keeps its depth count in the interpreter's state, and
    another thread of the process that parses meanwhile (a test worker runs Ray's and torch's) can
    throw it off; this suite's CPython 3.11.7 raised it once in a full run."""
    for _ in range(4):
        try:
            return ast.parse(text, str(path))
        except SystemError as exc:
            if "recursion depth mismatch" not in str(exc):
                raise
    return ast.parse(text, str(path))  # a fifth time, whatever it raises


def import_graph(root: Path, package: str = "meshrl") -> dict[str, list[Edge]]:
    """Module -> its imports of modules of ``package`` (the rule: this file's docstring)."""
    modules = _modules(root, package)
    texts = {m: p.read_text() for m, p in modules.items()}
    trees = {m: _parse(texts[m], p) for m, p in modules.items()}
    is_package = {m: p.name == "__init__.py" for m, p in modules.items()}
    exports: dict[str, dict[str, str]] = {}  # package -> name -> module it comes from
    for m, tree in trees.items():
        if not is_package[m]:
            continue
        names = _lazy_tables(tree, m, modules)
        for node, _ in _imports(tree):
            if isinstance(node, ast.ImportFrom):
                source = _absolute(m, True, node)
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    names[alias.asname or alias.name] = sub if sub in modules else source
        exports[m] = {k: v for k, v in names.items() if v in modules and v != m}

    def defining(pkg: str, name: str, seen: frozenset[str] = frozenset()) -> str:
        """The module that defines ``pkg.name``: the package's re-export followed, else the package."""
        sub = f"{pkg}.{name}"
        if sub in modules:
            return sub
        target = exports.get(pkg, {}).get(name)
        if target is None or target in seen:
            return pkg
        return defining(target, name, seen | {pkg}) if is_package[target] else target

    graph: dict[str, list[Edge]] = {m: [] for m in modules}
    for m, tree in trees.items():
        path = modules[m].relative_to(root)
        for node, typing_only in _imports(tree):
            if typing_only:
                continue
            text = " ".join((ast.get_source_segment(texts[m], node) or ast.unparse(node)).split())
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                source = _absolute(m, is_package[m], node)
                if source != package and not source.startswith(package + "."):
                    continue
                targets = [defining(source, a.name) if source in modules else source for a in node.names]
            for target in dict.fromkeys(targets):  # (one edge per statement and module)
                while target not in modules and "." in target:  # e.g. `from meshrl.x.gone import y`
                    target = target.rsplit(".", 1)[0]
                if target in modules:
                    graph[m].append(Edge(m, target, path, node.lineno, text))
    return graph


def cycles(graph: dict[str, list[Edge]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module, and the modules that import themselves."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[frozenset[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm, recursive: meshrl's import chains are short
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for e in graph[v]:
            if e.target not in index:
                visit(e.target)
                low[v] = min(low[v], low[e.target])
            elif e.target in on_stack:
                low[v] = min(low[v], index[e.target])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1 or any(e.target == v for e in graph[v]):
                out.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out, key=sorted)


def describe(graph: dict[str, list[Edge]], component: frozenset[str]) -> str:
    """A cycle's modules, and the import lines that tie them together."""
    lines = [f"cycle of {len(component)} module(s): {', '.join(sorted(component))}"]
    lines += [f"    {e}" for m in sorted(component) for e in graph[m] if e.target in component]
    return "\n".join(lines)


@pytest.fixture(scope="module")
def meshrl_graph() -> dict[str, list[Edge]]:
    return import_graph(ROOT)


def test_meshrl_has_no_import_cycles_but_the_known_ones(meshrl_graph):
    new = [c for c in cycles(meshrl_graph) if c not in KNOWN_CYCLES]
    assert not new, ("import cycles among meshrl's modules (move what both sides need into a module that neither "
                     "imports, or pass it in):\n" + "\n".join(describe(meshrl_graph, c) for c in new))


def test_every_known_cycle_is_still_one(meshrl_graph):
    """An entry of ``KNOWN_CYCLES`` that is no longer exactly a cycle is stale: remove it (or correct it)."""
    found = cycles(meshrl_graph)
    stale = [sorted(c) for c in KNOWN_CYCLES if c not in found]
    assert not stale, f"KNOWN_CYCLES entries that are no longer cycles: {stale}; found: {[sorted(c) for c in found]}"


def _package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_rule_on_a_made_up_package(tmp_path):
    """The checker itself: re-exports followed, function-level and relative imports seen, typing-only
    imports and implicit parent imports not."""
    root = _package(tmp_path, {
        "pkg/__init__.py": "from pkg.a import A\nfrom .b import B\n_LAZY = {'L': 'pkg.lazy'}\n",
        "pkg/a.py": "from pkg import B\nA = 1\n",  # a sibling through the package: a -> b, no cycle with pkg
        "pkg/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import A\nB = 2\n",
        "pkg/lazy.py": "def f():\n    from pkg.sub import leaf\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/leaf.py": "def g():\n    from pkg import L\n",  # lazy name -> pkg.lazy: a cycle with it
        "pkg/own.py": "from . import own\n",  # imports itself
    })
    graph = import_graph(root, "pkg")
    assert {(e.source, e.target) for es in graph.values() for e in es} == {
        ("pkg", "pkg.a"), ("pkg", "pkg.b"), ("pkg.a", "pkg.b"), ("pkg.lazy", "pkg.sub.leaf"),
        ("pkg.sub.leaf", "pkg.lazy"), ("pkg.own", "pkg.own")}
    assert cycles(graph) == [frozenset({"pkg.lazy", "pkg.sub.leaf"}), frozenset({"pkg.own"})]
    assert "pkg/sub/leaf.py:2: from pkg import L" in describe(graph, cycles(graph)[0])
