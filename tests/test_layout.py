"""The package's layout (docs/architecture.md): sub-packages in the order of the passes, no
import cycle, no import running back up that order, and each sub-package naming its entry points."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "pipec"
# A module may import from its own sub-package and from those of a lower rank. The entry points
# (cli, driver, the inspect and compare tools) sit on top; calibration and codegen are siblings.
RANKS = {"base": 0, "frontend": 1, "cost": 2, "planning": 3, "calibration": 4, "codegen": 4,
         "tools": 5}
BASE = {"pipec", "pipec.errors", "pipec.units", "pipec.torchcompat", "pipec.host_allocator"}
SUB_PACKAGES = ("frontend", "cost", "planning", "calibration", "codegen")
MAX_TOP_LEVEL_MODULES = 12


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """The pipec modules ``path`` imports, at any depth (TYPE_CHECKING blocks included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        found |= {name for name in names if name in known}
    return found


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    known = set(paths)
    return {name: imported_modules(path, known) - {name} for name, path in paths.items()}


def layer(module: str) -> str:
    if module in BASE:
        return "base"
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or parts[-1] in SUB_PACKAGES else "tools"


def test_no_import_runs_back_up_the_passes() -> None:
    upward = [(module, imported) for module, imports in import_graph().items()
              for imported in imports
              if layer(imported) != layer(module)
              and RANKS[layer(imported)] >= RANKS[layer(module)]]
    assert upward == []


def test_no_import_cycle() -> None:
    graph = import_graph()
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, " -> ".join((*path, module))
        if module in done:
            return
        for imported in sorted(graph[module]):
            visit(imported, (*path, module))
        done.add(module)

    for module in sorted(graph):
        visit(module, ())


def test_top_level_keeps_entry_points_only() -> None:
    modules = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(modules) <= MAX_TOP_LEVEL_MODULES, modules


@pytest.mark.parametrize("sub_package", SUB_PACKAGES)
def test_sub_package_names_its_entry_points(sub_package: str) -> None:
    package = importlib.import_module(f"pipec.{sub_package}")
    assert package.__doc__
    assert package.__all__
    assert all(hasattr(package, name) for name in package.__all__)
    # Its table lists every module it holds.
    for path in (PACKAGE / sub_package).glob("[!_]*.py"):
        assert f"``{path.name}``" in package.__doc__, path.name


def test_layer_of_a_module() -> None:
    assert layer("pipec.frontend.trace") == "frontend"
    assert layer("pipec.cli") == "tools"
    assert layer("pipec.planning") == "planning"
    assert RANKS[layer("pipec.planning.planner")] > RANKS[layer("pipec.frontend.normalization")]
