"""streamer's imports form no cycle: neither between modules nor between its packages.

Read from the source with `ast`, nothing is imported. Every import counts, also one inside
a function (an import put off to break a cycle still is one), except those under
`if TYPE_CHECKING:`, which only annotations see. Between packages, streamer.engine.*
counts as streamer.engine (and so on); top-level modules (config, messages, staging,
diagnostics, ...) count as themselves, and streamer/__init__.py as `streamer`.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "streamer"


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _runtime_nodes(tree: ast.AST):
    """Every node of tree except what sits under `if TYPE_CHECKING:`."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and ast.unparse(child.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
                todo.extend(child.orelse)
                continue
            todo.append(child)


def import_graph() -> dict[str, set[str]]:
    mods = modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        targets: set[str | None] = set()
        for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {resolve(a.name) for a in node.names if a.name.split(".")[0] == "streamer"}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                if base.split(".")[0] != "streamer":
                    continue
                for a in node.names:  # `from streamer.engine import scheduler` imports a module
                    full = f"{base}.{a.name}"
                    targets.add(full if full in mods else resolve(base))
        graph[mod] = {t for t in targets if t is not None and t != mod}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def package_of(mod: str) -> str:
    parts = mod.split(".")
    if len(parts) >= 2 and (PACKAGE / parts[1]).is_dir():
        return ".".join(parts[:2])
    return mod


def test_the_modules_import_each_other_without_a_cycle():
    assert cycles(import_graph()) == []


def test_the_packages_import_each_other_without_a_cycle():
    between: dict[str, set[str]] = {}
    for mod, targets in import_graph().items():
        a = package_of(mod)
        between.setdefault(a, set()).update(b for b in map(package_of, targets) if b != a)
    assert cycles(between) == []


def test_the_walk_sees_imports_inside_functions_and_resolves_relative_ones():
    graph = import_graph()
    assert "streamer.sampling.grammar_build" in graph["streamer.sampling.grammar_worker"]  # in a function
    assert "streamer.engine.scheduler.policy" in graph["streamer.engine.scheduler"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
