"""The package's import contract: a declared layer order, and no import circles.

Every import of a ``torchtitan_rl`` module (at module level, inside functions and under
``TYPE_CHECKING`` alike) must point to the importer's own unit or to a unit in a lower layer.
A unit is a package or module named in ``LAYERS``; the longest name that prefixes a module is its
unit. Print the graph's upward arrows and circles with ``python -m tests.test_import_layers``.
"""

from __future__ import annotations

import ast
import pathlib
import sys
from collections.abc import Iterator

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "torchtitan_rl"

LAYERS: list[list[str]] = [
    # entry points
    ["eval"],
    ["train", "worker"],
    # the job: root config, run, restart, resume, spawning the parts
    ["controller.torchrun"],
    ["controller.job"],
    ["controller.trainer_restart"],
    ["controller.resume", "controller.spawn"],
    ["controller.resolved_job"],
    # the controller's concerns
    ["controller.loop"],
    ["controller.fleet", "controller.rollout_workers"],
    ["controller.checkpoint", "controller.hosts"],
    ["controller.supervision"],
    # the actors' code and what they run
    ["trainer"],
    ["generator", "rollout"],
    ["envs", "weight_sync", "metrics", "assets"],
    ["task"],
    ["rollout.message_env", "models", "tls"],
    ["config", "types", "faults", "batched_calls", "threads", "monarch_failures"],
    ["console"],
]
"""Top to bottom: a unit may import its own modules and any unit of a lower layer, never one of
its own layer or above."""

_LAYER_OF = {f"torchtitan_rl.{unit}": i for i, units in enumerate(LAYERS) for unit in units}


def unit_of(module: str) -> str:
    """The longest unit name in LAYERS that is ``module`` or a package above it."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        name = ".".join(parts[:n])
        if name in _LAYER_OF:
            return name
    raise KeyError(module)


def modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imports(path: pathlib.Path, known: dict[str, pathlib.Path], *,
            runtime_only: bool = False) -> Iterator[tuple[int, str]]:
    """(line, module) for every project module ``path`` imports (a ``from package import
    module`` names the module); ``runtime_only``: not those under ``if TYPE_CHECKING``."""
    tree = ast.parse(path.read_text(), str(path))
    type_only: set[ast.AST] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            type_only.update(n for child in node.body for n in ast.walk(child))
    for node in ast.walk(tree):
        if runtime_only and node in type_only:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("torchtitan_rl."):
                    yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and (
                node.module.startswith("torchtitan_rl.")):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                yield node.lineno, sub if sub in known else node.module


def upward_arrows() -> list[str]:
    known = modules()
    found = []
    for name, path in known.items():
        if name == "torchtitan_rl" or name == "torchtitan_rl.controller":
            continue
        source = unit_of(name)
        for line, target in imports(path, known):
            target_unit = unit_of(target)
            if target_unit != source and _LAYER_OF[target_unit] <= _LAYER_OF[source]:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {source} imports "
                             f"{target} ({target_unit}, layer {_LAYER_OF[target_unit]} <= "
                             f"{_LAYER_OF[source]})")
    return found


def import_circles() -> list[list[str]]:
    """The runtime import graph's strongly connected components of more than one module
    (Tarjan). Importing ``a.b.c`` runs the packages ``a`` and ``a.b`` first: an import is an
    arrow to each package above its target that is not above the importer too."""
    known = modules()

    def targets(name: str, path: pathlib.Path) -> set[str]:
        found = set()
        for _, target in imports(path, known, runtime_only=True):
            parts = target.split(".")
            for n in range(1, len(parts) + 1):
                above = ".".join(parts[:n])
                if above in known and not (name == above or name.startswith(f"{above}.")):
                    found.add(above)
        return found

    graph = {name: sorted(targets(name, path)) for name, path in known.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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
                circles.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for name in graph:
        if name not in index:
            visit(name)
    return circles


def test_every_module_belongs_to_a_declared_layer() -> None:
    missing = []
    for name in modules():
        if name in ("torchtitan_rl", "torchtitan_rl.controller"):
            continue
        try:
            unit_of(name)
        except KeyError:
            missing.append(name)
    assert not missing, f"modules in no unit of LAYERS (add them): {missing}"


def test_no_import_points_up_the_layers() -> None:
    arrows = upward_arrows()
    assert not arrows, "imports against the layer order:\n" + "\n".join(arrows)


def test_the_module_graph_has_no_circles() -> None:
    assert import_circles() == []


if __name__ == "__main__":
    arrows, circles = upward_arrows(), import_circles()
    print("\n".join(arrows + [" -> ".join(c) for c in circles]))
    print(f"modules={len(modules())} upward_arrows={len(arrows)} circles={len(circles)}")
