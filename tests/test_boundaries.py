"""Import boundaries: the package's layers import downward only; domain code is free of Dagster and SkyPilot; the
GPU-node runtime of Dagster, PuLP, DuckDB and of the command line; the command line calls the application layer only."""

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


def _files(root: Path, skip: frozenset[str] | set[str] = frozenset()) -> list[Path]:
    return [p for p in root.rglob("*.py") if p.relative_to(root).parts[0] not in skip]


def test_domain_code_imports_neither_dagster_nor_sky():
    files = _files(PKG, EDGES)
    assert len(files) > 10
    offenders = {str(p.relative_to(ROOT)): sorted(n for n in _imports(p) if _top(n) in {"dagster", "sky"})
                 for p in files}
    assert {k: v for k, v in offenders.items() if v} == {}


def _reached(start: list[Path], follow) -> dict[str, set[str]]:
    """Every module name imported by the files in `start` and, transitively, by the coral files `follow(name)` gives
    for each coral module they import, per file."""
    seen: dict[str, set[str]] = {}
    todo = list(start)
    while todo:
        path = todo.pop()
        key = str(path.relative_to(ROOT))
        if key in seen:
            continue
        seen[key] = _imports(path)
        for name in seen[key]:
            if _top(name) == "coral_dagster":
                todo += follow(name)
    return seen


def _runtime_imports() -> dict[str, set[str]]:
    """Every module name imported by the runtime and by each coral module it imports (transitively), per file."""
    def files(name: str) -> list[Path]:
        target = ROOT.joinpath(*name.split("."))
        return [p for p in (target.with_suffix(".py"), target / "__init__.py") if p.exists()]

    return _reached(list((PKG / "runtime").rglob("*.py")), files)


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


#: The package's layers, bottom first: a part may import only parts of lower layers (lazy imports included), so
#: no import cycle runs between parts. A new module or subpackage must be placed here.
LAYERS: tuple[frozenset[str], ...] = tuple(frozenset(layer) for layer in (
    {"vocab", "errors", "paths"},               # names and errors everything shares; import nothing of the project
    {"layer_split", "store", "highs", "lifetimes", "files"},  # layer splits, DuckDB, HiGHS, child processes, files
    {"catalog", "routing"},                     # GPUs, models, markets, scenarios, traces; the routing policy
    {"profiles"},                               # the performance model
    {"templates"},                              # serving templates and their throughput T̂
    {"allocation"},                             # problems, methods, plans and their codec
    {"simulator", "runtime", "plots"},          # what runs a plan: simulated, or on GPU nodes
    {"deploy"},                                 # SkyPilot tasks and reconciliation
    {"app"},                                    # the use cases the CLI, the assets and the benches call
    {"reallocation"},                           # the re-plan policy the sensor applies
    {"day"},                                    # a simulated day: the re-plan loop over app, sensor and reconciler
    {"definitions"},                            # the Dagster definitions (`coral run` materializes them)
    {"cli"},                                    # the command line
    {"__main__", "__init__"},
))


def _part(path: Path, pkg: Path) -> str:
    return path.relative_to(pkg).parts[0].removesuffix(".py")


def _part_imports(pkg: Path) -> dict[str, set[str]]:
    """Per part of the package, the other parts it imports (`from coral_dagster import paths` included)."""
    out: dict[str, set[str]] = {}
    for path in pkg.rglob("*.py"):
        part = _part(path, pkg)
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [f"{node.module}.{a.name}" for a in node.names] if node.module == "coral_dagster" \
                    else [node.module]
            for name in names:
                bits = name.split(".")
                if bits[0] == "coral_dagster" and len(bits) > 1 and bits[1] != part:
                    out.setdefault(part, set()).add(bits[1])
    return out


def _upward(pkg: Path) -> set[str]:
    """`part -> other` for every import of a part of the same or a higher layer."""
    rank = {part: i for i, layer in enumerate(LAYERS) for part in layer}
    return {f"{part} -> {other}" for part, others in _part_imports(pkg).items() for other in others
            if rank.get(other, -1) >= rank.get(part, len(LAYERS))}


def test_every_part_of_the_package_has_a_layer():
    placed = set().union(*LAYERS)
    parts = {_part(p, PKG) for p in PKG.rglob("*.py")}
    assert parts - placed == set(), "place the new part in tests/test_boundaries.LAYERS"
    assert all(not a & b for i, a in enumerate(LAYERS) for b in LAYERS[i + 1:])


def test_parts_import_only_lower_layers():
    """Imports run downward only, so no cycle runs between parts (e.g. the catalog imports neither templates nor
    profiles; templates never import the simulator)."""
    assert _upward(PKG) == set()


def test_the_layering_check_reports_a_cycle(tmp_path):
    fake = tmp_path / "coral_dagster"
    for part in ("catalog", "templates"):
        (fake / part).mkdir(parents=True)
    (fake / "catalog" / "x.py").write_text("def f():\n    from coral_dagster.templates.types import Template\n")
    (fake / "templates" / "y.py").write_text("from coral_dagster.catalog import x\n")
    assert _upward(fake) == {"catalog -> templates"}


def test_no_code_edits_the_import_path():
    """`bench/` and the package import as packages (`python -m bench.x` from the root), never by editing sys.path."""
    edits = []
    for folder in ("coral_dagster", "bench", "assets", "resources", "sky_tasks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and \
                        node.value.attr == "path" and isinstance(node.value.value, ast.Name) and \
                        node.value.value.id == "sys" and node.attr in ("insert", "append", "extend"):
                    edits.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not edits, edits


#: What the command line may import of the package: the application layer and the parts above it that orchestrate
#: it (never a domain part below `app`), the shared names and errors, and its own modules.
CLI_DOORS = {"app", "reallocation", "day", "definitions", "vocab", "errors", "cli"}
#: What else of the package a command module may import: `coral serve` (whose module `main` imports only when it
#: runs) runs the GPU-node runtime, which a node without the planner installed imports.
CLI_BY_FILE = {"serve.py": {"runtime"}}
#: Third-party packages the command line may import: click, and what prints tables and progress; `coral run` checks
#: Dagster's instance configuration before it starts the job.
CLI_THIRD_PARTY = {"click", "pandas", "rich", "tqdm"}
CLI_THIRD_PARTY_BY_FILE = {"run.py": {"dagster", "yaml"}}


def _cli_offenders(cli: Path) -> dict[str, list[str]]:
    """Per command module, each import outside what the command line may import (`CLI_DOORS`, `CLI_LAZY`,
    `CLI_BY_FILE`, `CLI_THIRD_PARTY`, the standard library), with its line."""
    import sys

    out: dict[str, list[str]] = {}
    for path in sorted(cli.rglob("*.py")):
        doors = CLI_DOORS | CLI_BY_FILE.get(path.name, set())
        third = CLI_THIRD_PARTY | CLI_THIRD_PARTY_BY_FILE.get(path.name, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [f"{node.module}.{a.name}" for a in node.names] if node.module == "coral_dagster" \
                    else [node.module]
            else:
                continue
            for name in names:
                bits = name.split(".")
                if bits[0] == "coral_dagster":
                    ok = len(bits) > 1 and bits[1] in doors
                else:
                    ok = bits[0] in third or bits[0] in sys.stdlib_module_names or bits[0] == "__future__"
                if not ok:
                    out.setdefault(path.name, []).append(f"{node.lineno}: {name}")
    return out


def test_the_command_line_calls_the_application_layer_only():
    """`coral_dagster/cli` is one door onto `app`: no command reaches past it into a domain part (the catalog, the
    store, templates, allocation, the simulator, deploy), lazily or not."""
    assert len(list((PKG / "cli").glob("*.py"))) > 8
    assert _cli_offenders(PKG / "cli") == {}


def test_the_command_line_check_names_each_way_past_the_door(tmp_path):
    cli = tmp_path / "cli"
    cli.mkdir()
    (cli / "plan.py").write_text("import click\nfrom coral_dagster.app.make_plan import make_plan\n"
                                 "def f():\n    from coral_dagster.allocation.codec import plan_to_doc\n"
                                 "    from coral_dagster import store\n    import pulp\n")
    (cli / "serve.py").write_text("from coral_dagster.runtime.protocol import Env\n")
    (cli / "launch.py").write_text("def f():\n    from coral_dagster.runtime.roles import run_engine\n")
    assert _cli_offenders(cli) == {"plan.py": ["4: coral_dagster.allocation.codec", "5: coral_dagster.store",
                                               "6: pulp"],
                                   "launch.py": ["2: coral_dagster.runtime.roles"]}


def _module_files(name: str) -> list[Path]:
    """The files importing `name` runs: its own and each enclosing package's `__init__.py`."""
    bits = name.split(".")
    files = [ROOT.joinpath(*bits[:i], "__init__.py") for i in range(1, len(bits))]
    target = ROOT.joinpath(*bits)
    files += [target.with_suffix(".py"), target / "__init__.py"]
    return [p for p in files if p.exists()]


def test_coral_serve_imports_without_the_planner():
    """What `coral serve` imports (its module, the `coral` group, and each coral module they import, transitively,
    lazy imports included) stays free of the planner's stack, so a GPU node with the runtime alone runs it."""
    banned = {"dagster", "pulp", "duckdb", "sky", "highspy"}
    seen = _reached([PKG / "cli" / "serve.py", PKG / "cli" / "main.py"], _module_files)
    assert "coral_dagster/app/node.py" in seen and "coral_dagster/runtime/roles.py" in seen
    offenders = {k: sorted(n for n in names if _top(n) in banned) for k, names in seen.items()}
    assert {k: v for k, v in offenders.items() if v} == {}
