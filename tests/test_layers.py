"""Freight's import graph, read from the source (pure: nothing is imported or started).

Every module of the layered packages (scheduler < storage < workers < api) and of the support
packages (migrations, infra) is parsed; each import, deferred ones inside functions included and
``if TYPE_CHECKING:`` ones excluded, is resolved to the longest Freight module it names. The graph
must have no cycle, no import against the layer order, a scheduler that imports nothing else of
Freight's, and support packages that build on storage and scheduler only."""

from __future__ import annotations

import ast
import functools
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAYERS = ("scheduler", "storage", "workers", "api")  # each may import only those before it
RANK = {package: i for i, package in enumerate(LAYERS)}
SUPPORT = ("migrations", "infra")  # may import storage and scheduler (and themselves)
SUPPORT_MAY_IMPORT = ("storage", "scheduler")
PACKAGES = (*LAYERS, *SUPPORT)


def find_modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file of the checked packages under ``root``."""
    found = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement under ``node``, at any depth, except the body of ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for other in child.orelse:
                yield from _imports_in(other)
            continue
        yield from _imports_in(child)


def _imports_in(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    if isinstance(node, ast.Import | ast.ImportFrom):
        yield node
    yield from _imports(node)


def imported_names(tree: ast.Module, module: str, is_package: bool) -> Iterator[str]:
    """The dotted names a module's imports name: ``import a.b`` gives ``a.b``; ``from a import b``
    gives ``a`` (its ``__init__`` runs) and ``a.b`` (in case ``b`` is a submodule)."""
    for node in _imports(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:  # relative: from the module's own package, up level - 1 packages
            package = module.split(".") if is_package else module.split(".")[:-1]
            anchor = package[: len(package) - (node.level - 1)]
            base = ".".join([*anchor, *([base] if base else [])])
        if base:
            yield base
        yield from (f"{base}.{alias.name}".lstrip(".") for alias in node.names if alias.name != "*")


def resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest Freight module that ``name`` names or lies in; None for outside imports."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the other Freight modules it imports."""
    modules = find_modules(root)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        targets = (
            resolve(name, modules) for name in imported_names(tree, module, path.name == "__init__.py")
        )
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, without recursion),
    each sorted, in sorted order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph.get(succ, ())))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return sorted(found)


def _package(module: str) -> str:
    return module.partition(".")[0]


def _edges(graph: dict[str, set[str]]) -> Iterator[tuple[str, str]]:
    for source in sorted(graph):
        for target in sorted(graph[source]):
            yield source, target


@dataclass
class LayerReport:
    modules: int
    edges: int
    cycles: list[list[str]]  # (a) modules of each import cycle
    upward: list[str]  # (b) "a -> b" against scheduler < storage < workers < api
    impure_scheduler: list[str]  # (c) "a -> b": scheduler importing any other Freight package
    support: list[str]  # (d) "a -> b": migrations/infra importing beyond storage and scheduler


@functools.cache
def check_layers(root: Path) -> LayerReport:
    graph = import_graph(root)
    edges = list(_edges(graph))
    upward, impure, support = [], [], []
    for a, b in edges:
        pa, pb = _package(a), _package(b)
        if pa in RANK and pb in RANK and RANK[pa] < RANK[pb]:
            upward.append(f"{a} -> {b}")
        if pa == "scheduler" and pb != "scheduler":
            impure.append(f"{a} -> {b}")
        if pa in SUPPORT and pb not in (pa, *SUPPORT_MAY_IMPORT):
            support.append(f"{a} -> {b}")
    return LayerReport(len(graph), len(edges), cycles(graph), upward, impure, support)


# -- Freight's own tree ---------------------------------------------------------------------------


def test_the_graph_covers_freight() -> None:
    report = check_layers(REPO)
    graph = import_graph(REPO)
    assert report.modules > 50 and report.edges > 100, report
    # the walk sees the imports it should: module level, deferred ones, and support packages
    assert "storage.settings" in graph["migrations.env"]
    assert any(_package(b) == "workers" for b in graph["api.services.console"])
    assert "storage.migrate" in graph["infra.processes"]  # imported inside a function


def test_no_import_cycles() -> None:
    found = check_layers(REPO).cycles
    assert not found, "import cycles:\n" + "\n".join("  " + ", ".join(c) for c in found)


def test_no_import_against_the_layer_order() -> None:
    found = check_layers(REPO).upward
    assert not found, "imports against scheduler < storage < workers < api:\n" + "\n".join(
        f"  {u}" for u in found
    )


def test_scheduler_imports_nothing_else_of_freights() -> None:
    found = check_layers(REPO).impure_scheduler
    assert not found, "scheduler imports other Freight packages:\n" + "\n".join(f"  {u}" for u in found)


def test_migrations_and_infra_build_on_storage_and_scheduler_only() -> None:
    found = check_layers(REPO).support
    assert not found, "migrations/infra import beyond storage and scheduler:\n" + "\n".join(
        f"  {u}" for u in found
    )


# -- the checker catches what it is for ----------------------------------------------------------


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_a_cycle_and_imports_against_the_layers_are_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = _tree(
        tmp_path,
        {
            "scheduler/__init__.py": "",
            "scheduler/plan.py": "from storage.db import Database\n",  # upward, impure, cycle
            "storage/__init__.py": "",
            "storage/db.py": "import scheduler.plan\n",
            "storage/typed.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from api import app\n",
            "workers/__init__.py": "",
            "workers/task.py": "def run():\n    from api.app import create_app\n",  # deferred, upward
            "workers/rel.py": "from . import task\nfrom .task import run\n",
            "api/__init__.py": "",
            "api/app.py": "import json\nfrom workers import task\n",  # cycle with workers.task
            "migrations/env.py": "from storage.db import Database\nfrom workers.task import run\n",
            "infra/__init__.py": "",
            "infra/up.py": "from infra import other\n\ndef go():\n    import api.app\n",
            "infra/other.py": "import scheduler\n",
        },
    )
    report = check_layers(root)
    assert report.cycles == [["api.app", "workers.task"], ["scheduler.plan", "storage.db"]]
    assert report.upward == ["scheduler.plan -> storage.db", "workers.task -> api.app"]
    assert report.impure_scheduler == ["scheduler.plan -> storage.db"]
    assert report.support == ["infra.up -> api.app", "migrations.env -> workers.task"]
    graph = import_graph(root)
    assert graph["storage.typed"] == set()  # TYPE_CHECKING imports do not count
    assert graph["workers.rel"] == {"workers", "workers.task"}  # relative imports resolve

    # the tests above, pointed at this tree, fail and name the culprits
    monkeypatch.setattr(sys.modules[__name__], "REPO", root)
    for check, named in (
        (test_no_import_cycles, "api.app, workers.task"),
        (test_no_import_against_the_layer_order, "workers.task -> api.app"),
        (test_scheduler_imports_nothing_else_of_freights, "scheduler.plan -> storage.db"),
        (test_migrations_and_infra_build_on_storage_and_scheduler_only, "migrations.env -> workers.task"),
    ):
        with pytest.raises(AssertionError, match=re.escape(named)):
            check()
