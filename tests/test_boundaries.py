"""Import boundaries: domain code is free of Dagster and SkyPilot; the GPU-node runtime of Dagster, PuLP, DuckDB
and of the command line."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "coral_dagster"
EDGES = {"definitions.py", "cli", "deploy"}


def _imports(path: Path) -> set[str]:
    """Top-level module names imported anywhere in a file (lazy imports inside functions included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _top(name: str) -> str:
    return name.split(".")[0]


def _files(root: Path, skip: set[str] = frozenset()) -> list[Path]:
    return [p for p in root.rglob("*.py") if p.relative_to(root).parts[0] not in skip]


def test_domain_code_imports_neither_dagster_nor_sky():
    files = _files(PKG, EDGES)
    assert len(files) > 10
    offenders = {str(p.relative_to(ROOT)): sorted(n for n in _imports(p) if _top(n) in {"dagster", "sky"})
                 for p in files}
    assert {k: v for k, v in offenders.items() if v} == {}


def _runtime_imports() -> dict[str, set[str]]:
    """Every module name imported by the runtime and by each coral module it imports (transitively), per file."""
    seen: dict[str, set[str]] = {}
    todo = list((PKG / "runtime").rglob("*.py"))
    while todo:
        path = todo.pop()
        key = str(path.relative_to(ROOT))
        if key in seen:
            continue
        seen[key] = _imports(path)
        for name in seen[key]:
            if _top(name) == "coral_dagster":
                target = ROOT.joinpath(*name.split("."))
                todo += [p for p in (target.with_suffix(".py"), target / "__init__.py") if p.exists()]
    return seen


def test_runtime_imports_neither_dagster_pulp_nor_duckdb():
    """The runtime, and every coral module it imports (transitively), stays free of the planner's stack."""
    banned = {"dagster", "pulp", "duckdb"}
    offenders = {k: sorted(n for n in names if _top(n) in banned) for k, names in _runtime_imports().items()}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_runtime_never_imports_the_command_line():
    """What runs on a node is the runtime's own code: `coral_dagster.cli` calls the runtime, never the reverse."""
    reached = _runtime_imports()
    assert "coral_dagster/runtime/local.py" in reached and "coral_dagster/runtime/roles.py" in reached
    offenders = {k: sorted(n for n in names if n == "coral_dagster.cli" or n.startswith("coral_dagster.cli."))
                 for k, names in reached.items()}
    assert {k: v for k, v in offenders.items() if v} == {}
