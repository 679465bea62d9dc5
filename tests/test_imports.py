"""The package's import graph has no cycles: every import counts, at module level, under
``TYPE_CHECKING`` or inside a function (a cycle hidden in a function is still a cycle)."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "fanfold"

ALLOWED: list[set[str]] = []
"""Cycles tolerated for now: none, and it stays that way."""


@cache
def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


@cache
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
    for node in ast.walk(parsed(path)):
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
    "fanfold.host.stepnet", "fanfold.store.rootfs", "fanfold.runtime.oci", "fanfold.runtime.oci_backend",
    "fanfold.runtime.oci_sandbox", "fanfold.runtime.criu", "fanfold.runtime.fake", "fanfold.runtime.container",
    "fanfold.runtime.seccomp", "fanfold._agent.build",
}


def test_the_engine_reaches_the_host_only_through_its_backend():
    known = module_names()
    reached = {
        name: sorted(imports(name, path, known) & BELOW_THE_BACKEND)
        for name, path in known.items() if name.startswith("fanfold.engine")
    }
    assert reached["fanfold.engine.core"] == [], reached
    assert {name: below for name, below in reached.items() if below} == {}


# -- packages ------------------------------------------------------------------------------------
# The stack, top to bottom: a package (a top-level subpackage or module of fanfold; ``fanfold`` is the
# facade, ``fanfold/__init__.py``) may import only packages of the layers below its own. A new package
# takes its place here, where its imports put it.
LAYERS: list[set[str]] = [
    {"cli", "fanfold"},
    {"server"},                      # fanfold serve: the app, fanfold's own routes, and the integrations' mounted
    {"integrations", "cluster"},     # drop-in integrations; the Ray cluster
    {"rl"},                          # envs, agents, trajectories
    {"web"},                         # what every HTTP route shares: tenancy, statuses, bodies, the rollout service
    {"client"},                      # the SDK, over the in-process engine or an HTTP transport
    {"compose"},                     # Compose files read and planned as groups (the SDK's compose_up drives them)
    {"engine"},
    {"wire"},                        # the JSON forms of fanfold's data
    {"images"},                      # building and pulling images (build steps run in the runtime)
    {"runtime"},                     # the backends: crun, runsc, fake
    {"store", "net"},                # layers and images on disk; sandbox networks and the egress proxy
    {"host", "transport", "_agent", "tools", "groups"},
    {"spec", "models", "config", "_extras", "ssh"},
    {"refs", "ids", "errors", "gpu_request", "__version__"},
]


def package_of(module: str) -> str:
    """``fanfold.engine.core`` -> ``engine``; the facade ``fanfold`` is its own package."""
    return module.split(".")[1] if "." in module else module


def package_imports() -> list[tuple[str, str, str, str]]:
    """(package, module, imported module, imported package) for each import between two packages."""
    known = module_names()
    found = []
    for name, path in known.items():
        for target in imports(name, path, known):
            if package_of(target) != package_of(name):
                found.append((package_of(name), name, target, package_of(target)))
    return sorted(found)


def test_the_packages_import_one_another_without_a_circle():
    graph: dict[str, set[str]] = {package_of(name): set() for name in module_names()}
    for package, _, _, other in package_imports():
        graph[package].add(other)
    assert graph["engine"] and graph["client"], "the walk found no imports between packages: it is broken"
    assert cycles(graph) == [], f"packages that import one another: {cycles(graph)}"


def test_every_package_imports_only_the_layers_below_it():
    rank = {package: depth for depth, layer in enumerate(LAYERS) for package in layer}
    assert sum(map(len, LAYERS)) == len(rank), "a package is listed twice in LAYERS"
    unplaced = {package_of(name) for name in module_names()} - set(rank)
    assert not unplaced, f"packages with no place in LAYERS: {sorted(unplaced)}"
    upward = [
        f"{module} imports {target}: {package} may import only the layers below its own"
        for package, module, target, other in package_imports() if rank[other] <= rank[package]
    ]
    assert upward == [], "\n".join(upward)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_imports() -> list[str]:
    """Imports of a name or module that another package keeps private (``from ..client._h1 import Client``,
    ``from ..server.images import _scoped_spec``). A package named with ``_`` (``_agent``) is fanfold's own,
    shared by the others; what is private is what starts with ``_`` inside another package."""
    known = module_names()
    found = []
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(parsed(path)):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                targets = [f"{base}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            for target in targets:
                parts = target.split(".")
                if parts[0] == "fanfold" and len(parts) > 2 and parts[1] != package_of(name) \
                        and any(map(_private, parts[2:])):
                    found.append(f"{name} imports {target}")
    return sorted(found)


def private_attributes() -> dict[str, set[str]]:
    """Per package, the private attributes its classes set on ``self`` and their private methods."""
    owned: dict[str, set[str]] = {}
    for name, path in module_names().items():
        mine = owned.setdefault(package_of(name), set())
        for node in ast.walk(parsed(path)):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _private(node.attr) \
                    and isinstance(node.value, ast.Name) and node.value.id == "self":
                mine.add(node.attr)
            elif isinstance(node, ast.ClassDef):
                mine.update(item.name for item in node.body
                            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(item.name))
    return owned


def private_reaches() -> list[str]:
    """``thing._attr`` outside ``self`` and ``cls``, where ``_attr`` is private to another package's
    classes and not a name of the reaching package's own (a heuristic: what the object is, a static
    walk cannot tell)."""
    owned = private_attributes()
    found = []
    for name, path in module_names().items():
        own = owned.get(package_of(name), set())
        others = set().union(*(attrs for package, attrs in owned.items() if package != package_of(name)))
        for node in ast.walk(parsed(path)):
            if isinstance(node, ast.Attribute) and _private(node.attr) and node.attr in others - own \
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append(f"{name}:{node.lineno} reaches {ast.unparse(node)}")
    return sorted(found)


def test_no_package_imports_what_another_keeps_private():
    assert private_imports() == []


def test_no_package_reaches_into_another_s_private_attributes():
    assert private_reaches() == []
