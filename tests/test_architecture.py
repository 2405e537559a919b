"""The package's shape: layers import only downwards, and no two modules import each other.

The layers, bottom to top, are the subpackages of ``dflash2_mlx`` (docs/architecture.md draws
them). A module may import its own layer and the layers below it, never a layer above: a cycle
or an upward import is how a codebase stops being readable one folder at a time. Every import
counts: module-level, lazy (inside a function) and type-only (inside ``if TYPE_CHECKING:``).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "dflash2_mlx"

# Bottom to top. `assets` is data (the embedded pair) any layer above the backend may read.
LAYERS = [
    "backend",
    "assets",
    "kernels",
    "fastpaths",
    "caches",
    "models",
    "constraints",
    "text",
    "policies",
    "decoding",
    "diagnostics",
    "server",
    "training",
    "cli",
]
# Top-level modules that are not layers: the public API re-exports from every layer, and
# `python -m dflash2_mlx` runs the CLI.
TOP = {"dflash2_mlx": len(LAYERS), "dflash2_mlx.__main__": len(LAYERS)}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def module_imports(source: str, name: str, package: str, files: set[str]) -> set[str]:
    """The package modules that the module ``name`` (source text ``source``) imports: at module
    level, inside functions (a lazy import is still an import) and inside ``if TYPE_CHECKING:``
    (a type-only import still ties the two modules together for a reader)."""
    targets: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            if node.module == "dflash2_mlx" and [a.name for a in node.names] == ["__version__"]:
                continue  # the version string, defined before the API: no dependency on a layer
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            submodules = [f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in files]
            # `from pkg import sub` imports the module sub; `from mod import name` imports mod
            candidates = submodules if len(submodules) == len(node.names) else [module, *submodules]
        elif isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        else:
            continue
        for candidate in candidates:
            while candidate and candidate not in files:  # a name inside a module -> the module
                candidate = candidate.rpartition(".")[0]
            if candidate:
                targets.add(candidate)
    return targets - {name}


def import_graph() -> dict[str, set[str]]:
    """Every module of the package -> the package modules it imports (``module_imports``)."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        graph[name] = module_imports(path.read_text(), name, package, set(files))
    return graph


def layer_of(module: str) -> int:
    if module in TOP:
        return TOP[module]
    return LAYERS.index(module.split(".")[1])


def test_every_subpackage_is_a_known_layer():
    subpackages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert subpackages == set(LAYERS)
    loose = {p.name for p in PACKAGE.glob("*.py")} - {"__init__.py", "__main__.py"}
    assert not loose, f"modules outside any layer: {sorted(loose)}"


def test_no_module_imports_a_higher_layer():
    upward = [
        f"{module} ({LAYERS[layer_of(module)] if layer_of(module) < len(LAYERS) else 'top'}) imports "
        f"{target} ({LAYERS[layer_of(target)] if layer_of(target) < len(LAYERS) else 'top'})"
        for module, targets in import_graph().items()
        for target in targets
        if layer_of(target) > layer_of(module)
    ]
    assert not upward, "\n".join(sorted(upward))


def test_no_import_cycle():
    graph = import_graph()
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_the_graph_sees_lazy_and_relative_imports():
    """The walker itself: a function-level import and a relative import are both edges (a test
    that found nothing because it saw nothing would pass)."""
    graph = import_graph()
    assert "dflash2_mlx.models.target" in graph["dflash2_mlx.models.loading"]
    assert any(t.startswith("dflash2_mlx.models") for t in graph["dflash2_mlx.cli.app"])


def test_type_only_and_lazy_imports_count_for_the_no_mutual_imports_rule():
    """An ``if TYPE_CHECKING:`` import and a function-level import are edges, so two modules that
    refer to each other only through them still make a cycle (the package's own prefix cache
    names the disk cache for annotations only: that edge is seen)."""
    files = {"dflash2_mlx.caches.a", "dflash2_mlx.caches.b"}
    a = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dflash2_mlx.caches.b import B\n"
    b = "def f():\n    from dflash2_mlx.caches import a\n    return a\n"
    assert module_imports(a, "dflash2_mlx.caches.a", "dflash2_mlx.caches", files) == {"dflash2_mlx.caches.b"}
    assert module_imports(b, "dflash2_mlx.caches.b", "dflash2_mlx.caches", files) == {"dflash2_mlx.caches.a"}
    assert "dflash2_mlx.caches.disk" in import_graph()["dflash2_mlx.caches.prefix"]
