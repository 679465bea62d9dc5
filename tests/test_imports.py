"""The package's import graph has no cycles: every import counts, at module level, under
``TYPE_CHECKING`` or inside a function (a cycle hidden in a function is still a cycle)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "fanfold"

ALLOWED: list[set[str]] = []
"""Cycles tolerated for now: none, and it stays that way."""


def module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def test_the_package_has_no_import_cycles():
    known = module_names()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    assert graph["fanfold.engine.core"], "the walk found no imports: it is broken"
    found = sorted(sorted(group) for group in cycles(graph) if group not in ALLOWED)
    assert found == [], f"import cycles: {found}"


def test_the_cycle_finder_finds_a_loop_and_not_what_leads_into_it():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [{"a", "b", "c"}]


# What only a backend may touch: the host's mounts, cgroups, namespaces and processes of a
# sandbox, the OCI runtime, CRIU, and the agent's binary and socket.
BELOW_THE_BACKEND = {
    "fanfold.host.cgroups", "fanfold.host.mounts", "fanfold.host.netns", "fanfold.host.setup", "fanfold.host.spawn",
    "fanfold.images.rootfs", "fanfold.runtime.oci", "fanfold.runtime.oci_backend", "fanfold.runtime.oci_sandbox",
    "fanfold.runtime.criu", "fanfold.runtime.fake", "fanfold.runtime.container", "fanfold._agent.build",
}


def test_the_engine_reaches_the_host_only_through_its_backend():
    known = module_names()
    reached = {
        name: sorted(imports(name, path, known) & BELOW_THE_BACKEND)
        for name, path in known.items() if name.startswith("fanfold.engine")
    }
    assert reached["fanfold.engine.core"] == [], reached
    assert {name: below for name, below in reached.items() if below} == {}
