"""The import graph of the non-test packages: no circle, and no arrow the design forbids.

The graph is built statically with `ast` from the source of `bus_schemas/`, `router/`,
`services/` and `gpu_worker/` (nothing is imported). Every `import` and `from ... import`
counts, wherever it stands: inside a function (a lazy import is still a dependency; it only
runs later) and under `if TYPE_CHECKING:` too (a type-only import is a dependency of the
design, and a circle through one is still a circle to a reader). `from a.b import c` is an
arrow to the module `a.b.c` when that is a module of ours, else to `a.b`; the package
`__init__` modules Python runs on the way (`a`, for `a.b`) are not counted as arrows.

Checked:
- no import circle among the modules (each one found is reported as a path with lines);
- DESIGN.md section 1's boundaries: `bus_schemas/` imports only the standard library and
  orjson (nats-py in `bus_schemas/connection.py` only) and nothing else of ours;
  `router/` imports of ours only `bus_schemas`, and never torch or triton; `gpu_worker/`
  imports nothing of `router/` or `services/` (and no HTTP: never aiohttp); `services/`
  never imports `router/`, and only `services/engine/` crosses into `gpu_worker`
  (`services/cli.py` in particular imports nothing from it, not even lazily);
- no upward arrow in `gpu_worker/`: its subpackages sit on the floors of `GPU_WORKER_LAYERS`
  and a module imports only from its own subpackage or from a lower floor (never sideways
  into another subpackage of its own floor).
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("bus_schemas", "router", "services", "gpu_worker")

# The floors of `gpu_worker/`, lowest first. A module imports only from its own subpackage
# or from a lower floor; the subpackages of one floor are independent (none imports
# another). Every subpackage (and top-level module) of `gpu_worker/` must be placed here.
GPU_WORKER_LAYERS: tuple[frozenset[str], ...] = (
    # leaves: the typed environment (`env.py`) and the Triton kernels with their references
    frozenset({"env", "kernels"}),
    # the parallel configuration, process groups and rank coordinates (TP, PP, CP)
    frozenset({"parallel"}),
    # KV pools and the page allocator (may learn page owners from `parallel`)
    frozenset({"memory"}),
    # the model; the storage (L3) backends; the rank consensus checker (over the groups)
    frozenset({"model", "storage", "consensus"}),
    # one rank's prefix cache: radix tree, host tier, transfers, the storage tier
    frozenset({"cache"}),
    # requests and the step scheduler; the executor it drives is a protocol of its own floor
    frozenset({"scheduler"}),
    # the engine: builds the model, executor, cache and scheduler of a rank, and the ranks
    frozenset({"engine"}),
)


@dataclass(frozen=True, slots=True)
class Arrow:
    """One import: `importer` imports `target` (a module of ours, or the top-level name of
    anything else) at `line` of the importer's file."""

    importer: str
    target: str
    line: int
    ours: bool

    def where(self) -> str:
        return f"{module_files()[self.importer].relative_to(ROOT)}:{self.line}"


@cache
def module_files() -> dict[str, Path]:
    """Every module of the packages, by dotted name (a package by its `__init__.py`)."""
    modules: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _resolve(importer: str, module: str | None, level: int) -> str:
    """The absolute name of a (possibly relative) `from` import's module."""
    if level == 0:
        return module or ""
    is_package = module_files()[importer].name == "__init__.py"
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, module] if module else base)


def _target(name: str) -> tuple[str, bool]:
    """The module of ours `name` is (or lies in: its longest prefix that is one), else the
    top-level name of a module not ours."""
    modules = module_files()
    parts = name.split(".")
    if parts[0] in PACKAGES:
        for n in range(len(parts), 0, -1):
            prefix = ".".join(parts[:n])
            if prefix in modules:
                return prefix, True
    return parts[0], False


def arrows_of(importer: str, source: str) -> list[Arrow]:
    """The imports of one module's source, wherever they stand, in source order."""
    found: dict[Arrow, None] = {}
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = _resolve(importer, node.module, node.level)
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                names.append(sub if sub in module_files() else module)
        for name in names:
            target, ours = _target(name)
            if target != importer:
                found[Arrow(importer, target, node.lineno, ours)] = None
    return sorted(found, key=lambda a: (a.line, a.target))


@cache
def arrows() -> tuple[Arrow, ...]:
    return tuple(a for m, path in module_files().items() for a in arrows_of(m, path.read_text()))


def graph() -> dict[str, dict[str, Arrow]]:
    """importer -> {imported module of ours -> its first arrow}."""
    edges: dict[str, dict[str, Arrow]] = {m: {} for m in module_files()}
    for a in sorted(arrows(), key=lambda a: (a.importer, a.line)):
        if a.ours:
            edges[a.importer].setdefault(a.target, a)
    return edges


def strongly_connected(edges: dict[str, dict[str, Arrow]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module (or a self-loop)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
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
            if len(component) > 1 or v in edges[v]:
                found.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 4 * len(edges)))
    try:
        for v in sorted(edges):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return found


def one_cycle(edges: dict[str, dict[str, Arrow]], component: list[str]) -> list[Arrow]:
    """A shortest circle through the component's first module (breadth first)."""
    inside = set(component)
    start = component[0]
    came: dict[str, Arrow] = {}
    frontier = [start]
    while frontier:
        following: list[str] = []
        for v in frontier:
            for w, arrow in edges[v].items():
                if w not in inside or w in came:
                    continue
                came[w] = arrow
                if w == start:
                    path = [arrow]
                    while path[0].importer != start:
                        path.insert(0, came[path[0].importer])
                    return path
                following.append(w)
        frontier = following
    raise AssertionError(f"no circle through {start} in {component}")


def describe(component: list[str], path: list[Arrow]) -> str:
    """The circle's modules, and one circle among them with the line of each arrow."""
    return f"{len(component)} modules {component}, e.g. " + " -> ".join(
        [path[0].importer] + [f"{a.target} ({a.where()})" for a in path]
    )


def test_the_graph_sees_every_kind_of_import() -> None:
    """A check of the checker: lazy, type-only, relative and `from package import module`
    imports are all arrows, each to the module it names."""
    source = """
from typing import TYPE_CHECKING
import gpu_worker.memory.allocator as allocator
from gpu_worker.storage import base, StorageConfig
from . import commands
from .rank import launch_engine
if TYPE_CHECKING:
    from gpu_worker.cache.radix import RadixTree
def lazy():
    import torch
    from services.engine.flags import add_engine_args
"""
    got = [(a.target, a.line, a.ours) for a in arrows_of("gpu_worker.engine.engine", source)]
    assert got == [
        ("typing", 2, False),
        ("gpu_worker.memory.allocator", 3, True),
        ("gpu_worker.storage", 4, True),
        ("gpu_worker.storage.base", 4, True),
        ("gpu_worker.engine.commands", 5, True),
        ("gpu_worker.engine.rank", 6, True),
        ("gpu_worker.cache.radix", 8, True),
        ("torch", 10, False),
        ("services.engine.flags", 11, True),
    ]


def test_no_import_circle() -> None:
    edges = graph()
    circles = [describe(c, one_cycle(edges, c)) for c in strongly_connected(edges)]
    assert not circles, "import circles:\n" + "\n".join(circles)


def _within(module: str, *packages: str) -> bool:
    """Whether `module` is one of `packages` or lies inside one."""
    return any(module == p or module.startswith(p + ".") for p in packages)


def _lines(bad: list[Arrow]) -> str:
    return "\n".join(f"{a.where()}: {a.importer} imports {a.target}" for a in bad)


def _from(package: str) -> list[Arrow]:
    return [a for a in arrows() if a.importer.split(".")[0] == package]


def test_bus_schemas_imports_only_the_stdlib_and_orjson() -> None:
    bad = []
    for a in _from("bus_schemas"):
        if a.ours:
            ok = a.target.split(".")[0] == "bus_schemas"
        elif a.target == "nats":
            ok = a.importer == "bus_schemas.connection"
        else:
            ok = a.target in sys.stdlib_module_names or a.target == "orjson"
        if not ok:
            bad.append(a)
    assert not bad, _lines(bad)


def test_router_imports_only_bus_schemas_of_ours_and_no_tensors() -> None:
    bad = [
        a
        for a in _from("router")
        if (a.ours and not _within(a.target, "router", "bus_schemas"))
        or (not a.ours and a.target in ("torch", "triton"))
    ]
    assert not bad, _lines(bad)


def test_gpu_worker_imports_neither_router_nor_services() -> None:
    bad = [
        a
        for a in _from("gpu_worker")
        if (a.ours and _within(a.target, "router", "services"))
        or (not a.ours and a.target == "aiohttp")
    ]
    assert not bad, _lines(bad)


def test_only_services_engine_crosses_into_gpu_worker() -> None:
    services = [a for a in _from("services") if a.ours]
    bad = [a for a in services if a.importer == "services.cli" and _within(a.target, "gpu_worker")]
    assert not bad, "services/cli.py imports gpu_worker:\n" + _lines(bad)
    bad = [
        a
        for a in services
        if _within(a.target, "router")
        or (_within(a.target, "gpu_worker") and not _within(a.importer, "services.engine"))
    ]
    assert not bad, _lines(bad)


def _unit(module: str) -> str | None:
    """The subpackage (or top-level module) of `gpu_worker` a module belongs to."""
    parts = module.split(".")
    return parts[1] if parts[0] == "gpu_worker" and len(parts) > 1 else None


def test_every_gpu_worker_subpackage_has_a_layer() -> None:
    units = {_unit(m) for m in module_files()} - {None}
    placed = [u for layer in GPU_WORKER_LAYERS for u in layer]
    assert len(placed) == len(set(placed)), "a subpackage placed twice"
    assert units == set(placed), (
        f"place in GPU_WORKER_LAYERS: {sorted(units - set(placed))}; "
        f"gone: {sorted(set(placed) - units)}"
    )


def test_no_upward_arrow_in_gpu_worker() -> None:
    floor = {u: i for i, layer in enumerate(GPU_WORKER_LAYERS) for u in layer}
    bad: dict[str, list[Arrow]] = defaultdict(list)
    for a in _from("gpu_worker"):
        src, dst = _unit(a.importer), _unit(a.target)
        if not a.ours or src is None or dst is None or src == dst:
            continue
        if floor[dst] > floor[src]:
            bad["upward"].append(a)
        elif floor[dst] == floor[src]:
            bad["sideways (one floor's subpackages are independent)"].append(a)
    assert not bad, "\n".join(f"{kind}:\n{_lines(found)}" for kind, found in bad.items())
