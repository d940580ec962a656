"""The house's layout as rules a change cannot break silently: packages by concern, no import running back up.

A folder-level import graph is built from every ``import`` in the source (inside functions too: a lazy import is
still a dependency) and must have no cycle, so each folder sits on a layer below the ones that use it
(docs/architecture.md draws it). ``shards`` imports neither job package; ``preprocess`` and ``train`` never import
each other. Folders stay small enough to read: a folder past the limit holds more than one concern.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("shards", "preprocess", "train")
MAX_MODULES = 14  # per folder, __init__ not counted
MAX_TOP_LEVEL = 10  # modules at the top of shards/: the contracts, errors and process-shared primitives


def _node(module: str) -> str | None:
    """The folder (``shards.order``) or top-level module (``shards.manifest``) a dotted module name belongs to."""
    parts = module.split(".")
    if parts[0] not in PACKAGES:
        return None
    if len(parts) == 1:
        return parts[0]
    first = ROOT / parts[0] / parts[1]
    if first.is_dir() and len(parts) > 2 and (first / parts[2]).is_dir():
        return ".".join(parts[:3])  # a sub-folder (preprocess.pack.sources) is its own node
    return ".".join(parts[:2])


def _source_node(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return _node(".".join(parts)) or parts[0]


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def _existing(module: str) -> bool:
    path = ROOT / module.replace(".", "/")
    return path.is_dir() or path.with_suffix(".py").exists()


@lru_cache(maxsize=1)
def folder_graph() -> dict[str, dict[str, set[str]]]:
    """``{from node: {to node: {source files}}}`` over every module of the three packages (built once per
    session: callers must not change it)."""
    graph: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            source = _source_node(path)
            for module in _imports(path):
                target = _node(module)
                if target is None or target == source or not _existing(target):
                    continue
                if source.startswith(target + ".") or target.startswith(source + "."):
                    continue  # a package's __init__ and its own sub-folders
                graph[source][target].add(str(path.relative_to(ROOT)))
    return graph


def cycles(graph: dict[str, dict[str, set[str]]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, {}):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, dict[str, set[str]]]:
    """The import graph, built in setup: the parse is shared by the tests below, not the cost of whichever runs
    first (the quick loop times calls, tests/quick_limit.py)."""
    return folder_graph()


def test_no_folder_level_import_runs_back_up(graph):
    problems = []
    for component in cycles(graph):
        edges = [f"{a} -> {b} ({', '.join(sorted(graph[a][b]))})" for a in component for b in component
                 if b in graph.get(a, {})]
        problems.append("cycle: " + "; ".join(edges))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("package, forbidden", [("shards", ("train", "preprocess")), ("preprocess", ("train",)),
                                                ("train", ("preprocess",))])
def test_packages_import_only_downwards(graph, package, forbidden):
    wrong = sorted(f"{source} -> {target} ({', '.join(sorted(files))})" for source, targets in graph.items()
                   if source.split(".")[0] == package for target, files in targets.items()
                   if target.split(".")[0] in forbidden)
    assert not wrong, "\n".join(wrong)


def test_the_cycle_check_sees_a_planted_back_edge(graph):
    planted = {k: dict(v) for k, v in graph.items()}
    planted.setdefault("shards.errors", {})["shards.stream"] = {"planted.py"}
    assert any("shards.errors" in c and "shards.stream" in c for c in cycles(planted))


def _folders() -> list[Path]:
    return sorted(p for package in PACKAGES for p in [ROOT / package, *(ROOT / package).rglob("*")]
                  if p.is_dir() and (p / "__init__.py").exists())


@pytest.mark.parametrize("folder", _folders(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_folder_holds_more_than_a_few_concerns(folder):
    modules = sorted(p.name for p in folder.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    limit = MAX_TOP_LEVEL if folder == ROOT / "shards" else MAX_MODULES
    assert len(modules) <= limit, f"{folder.relative_to(ROOT)} holds {len(modules)} modules: {modules}"
