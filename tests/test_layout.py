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


@lru_cache(maxsize=None)
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(_tree(path)):
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


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@lru_cache(maxsize=1)
def module_graph() -> dict[str, dict[str, set[str]]]:
    """``{module: {module it imports: {"-"}}}`` over every module of the three packages, relative, lazy and
    ``TYPE_CHECKING`` imports included (a type-only import is still a reader's dependency). A package's
    ``__init__`` importing its own modules, and a module importing its own package, are not edges: Python runs
    the package first either way."""
    paths = {_module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}
    graph: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(_tree(path)):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in paths else base for alias in node.names]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            for target in targets:
                while target and target not in paths:
                    target = target.rpartition(".")[0]
                if target and target != name and not name.startswith(target + ".") \
                        and not target.startswith(name + "."):
                    graph[name][target].add(str(path.relative_to(ROOT)))
    return graph


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


@pytest.fixture(scope="module")
def modules() -> dict[str, dict[str, set[str]]]:
    """The module-level import graph, built in setup (as ``graph``)."""
    return module_graph()


def test_no_module_level_import_loop(modules):
    """Modules import in one direction inside a folder too: a loop means neither module can be read alone (and a
    lazy import that hides one from Python is still one here)."""
    loops = [" -> ".join(component) for component in cycles(modules)]
    assert loops == []


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


# -- sizes a reader can hold, and a map that names every module -------------------------------------------------------
MAX_MODULE_LINES, MAX_CLASS_LINES, MAX_FUNCTION_LINES, MAX_PUBLIC_PARAMETERS = 400, 200, 80, 12
# Public functions whose parameters are a command's options by design: the click commands, the Python call of each
# stage (issue 43: "a documented Python function for each stage with the CLI's options") and ``make_loader``, which
# takes DataLoader's own keywords so a PyTorch user's spelling works or is refused by name.
MANY_PARAMETERS_BY_DESIGN = {
    "train/cli.py:train_command", "train/api.py:train_config", "train/api.py:train_from_shards",
    "preprocess/pack/cli.py:pack_shards_command", "preprocess/pack/api.py:pack_shards",
    "preprocess/features/cli.py:precompute_features_command", "preprocess/features/api.py:precompute_features",
    "preprocess/adopt/cli.py:index_command", "shards/cli/main.py:plan_command", "shards/cli/main.py:inspect_command",
    "shards/loader/loader.py:make_loader",
}


def _modules() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py") if "__pycache__" not in p.parts)


def _over_limits(paths: list[Path], root: Path = ROOT) -> list[str]:
    found = []
    for path in paths:
        rel = path.relative_to(root).as_posix()
        source = path.read_text()
        if source.count("\n") > MAX_MODULE_LINES:
            found.append(f"{rel}: {source.count(chr(10))} lines")
        for node in ast.walk(ast.parse(source)):
            lines = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, ast.ClassDef) and lines > MAX_CLASS_LINES:
                found.append(f"{rel}:{node.name}: a class of {lines} lines")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if lines > MAX_FUNCTION_LINES:
                    found.append(f"{rel}:{node.name}: a function of {lines} lines")
                args = node.args
                named = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs if a.arg not in ("self", "cls")]
                if (not node.name.startswith("_") and len(named) > MAX_PUBLIC_PARAMETERS
                        and f"{rel}:{node.name}" not in MANY_PARAMETERS_BY_DESIGN):
                    found.append(f"{rel}:{node.name}: {len(named)} parameters")
    return found


@pytest.mark.slow  # over half a second in the quick loop
def test_no_module_class_or_function_outgrows_what_a_reader_holds():
    assert _over_limits(_modules()) == []


def test_the_size_check_sees_each_kind_of_overgrowth(tmp_path):
    long_module = tmp_path / "long.py"
    long_module.write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    wide = tmp_path / "wide.py"
    wide.write_text(f"def wide({', '.join(f'a{i}' for i in range(MAX_PUBLIC_PARAMETERS + 1))}):\n    pass\n"
                    "def _private(" + ", ".join(f"a{i}" for i in range(20)) + "):\n    pass\n"
                    "def long():\n" + "    x = 1\n" * MAX_FUNCTION_LINES)
    found = _over_limits([long_module, wide], tmp_path)
    assert found == ["long.py: 401 lines", f"wide.py:wide: {MAX_PUBLIC_PARAMETERS + 1} parameters",
                     f"wide.py:long: a function of {MAX_FUNCTION_LINES + 1} lines"]


def test_every_module_has_its_line_in_docs_architecture_md():
    text = (ROOT / "docs" / "architecture.md").read_text()
    missing = [p.relative_to(ROOT).as_posix() for p in _modules()
               if p.name != "__init__.py" and f"`{p.relative_to(ROOT).as_posix()}`" not in text]
    assert missing == []
