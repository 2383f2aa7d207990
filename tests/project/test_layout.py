"""The layout shows the architecture: no module imports itself through others, and no
package depends on one that depends on it (``router.edge`` on ``router.routing`` and
never the other way). Imports for type checking alone do not count: they never run."""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("router", "policies", "bench")
# router/'s parts, each importing only those before it (docs/ARCHITECTURE.md's table).
ROUTER_LAYERS = (
    "wire", "errors", "config", "config_loader", "clock", "backoff", "auth", "planning",
    "index", "apis", "observability", "fleet", "tokens", "routing", "replication",
    "kv_events", "state", "edge", "discovery", "app", "server", "processes", "cli",
)  # fmt: skip


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for top in PACKAGES for p in (ROOT / top).rglob("*.py")}


def imported(path: Path, known: Mapping[str, Path]) -> set[str]:
    """The known modules ``path`` imports, anywhere in it but under ``TYPE_CHECKING``."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(node)
        for branch in ast.walk(tree)
        if isinstance(branch, ast.If) and "TYPE_CHECKING" in ast.unparse(branch.test)
        for node in ast.walk(branch)
    }
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in known else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name in known}


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                on_stack.discard(other)
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in list(graph):
        if node not in index:
            visit(node)
    return found


def package_of(name: str, known: Mapping[str, Path]) -> str:
    return name if known[name].name == "__init__.py" else name.rpartition(".")[0]


def import_graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    known = modules()
    by_module = {name: imported(path, known) - {name} for name, path in known.items()}
    by_package: dict[str, set[str]] = {}
    for name, targets in by_module.items():
        for target in targets:
            a, b = package_of(name, known), package_of(target, known)
            # A package and the packages inside it are one concern, not two layers.
            if a != b and not a.startswith(b + ".") and not b.startswith(a + "."):
                by_package.setdefault(a, set()).add(b)
    return by_module, by_package


def test_the_cycle_finder_finds_a_cycle_and_only_cycles() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_through_others() -> None:
    by_module, _ = import_graph()
    assert len(by_module) > 250  # every module was read
    assert cycles(by_module) == []


def test_no_package_depends_on_one_that_depends_on_it() -> None:
    _, by_package = import_graph()
    assert "router.routing" in by_package["router.edge"]  # the edge relays, routing decides
    assert cycles(by_package) == []


def test_each_part_of_the_router_imports_only_the_parts_below_it() -> None:
    by_module, _ = import_graph()
    rank = {f"router.{part}": i for i, part in enumerate(ROUTER_LAYERS)}

    def part(name: str) -> str:
        return ".".join(name.split(".")[:2])

    parts = {part(name) for name in by_module if name.startswith("router.")}
    assert parts == set(rank)  # every part has its place, and no place is empty
    upward = sorted(
        f"{name} -> {target}"
        for name, targets in by_module.items()
        if name.startswith("router.")
        for target in targets
        if target.startswith("router.") and rank[part(target)] > rank[part(name)]
    )
    assert upward == []
