"""Scenario documents for tests of what enters through files: a scenario whose library builds in seconds, and a
setter for one field of a document."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import yaml
from click.testing import CliRunner

SMALL = {"name": "small", "description": "one model on two GPU types", "regions": ["aws:us-east-2"],
         "gpus": ["L40S", "L4"], "gpus_per_node": [1, 4],
         "models": [{"model": "phi-4", "prefill_slo_ms": 1200, "decode_slo_ms": 60, "trace": "azure-conv",
                     "rate_req_s": 0.25}],
         "availability": {"default_nodes": 32}, "templates": {"n_max": 3, "rho": 12},
         "allocation": {"headroom": 1.1, "replan_interval_min": 6, "node_startup_min": 10}}


def small(**changes) -> dict:
    """A copy of SMALL with top-level fields changed."""
    return {**json.loads(json.dumps(SMALL)), **changes}


def build_small(folder: Path, name: str = "small.yml") -> tuple[Path, Path]:
    """SMALL written to `folder/name` and its library built by `coral templates build` into `folder/c.duckdb`."""
    from coral_dagster.cli.main import main

    scenario, db = folder / name, folder / "c.duckdb"
    scenario.write_text(yaml.safe_dump(SMALL))
    res = CliRunner().invoke(main, ["templates", "build", "--scenario", str(scenario), "--db", str(db),
                                    "--processes", "1", "--json"])
    assert res.exit_code == 0, res.output
    return scenario, db


def copy_small(small_library: tuple[Path, Path], folder: Path) -> tuple[Path, Path]:
    """The scenario file and DuckDB file (with its write-ahead log, if any) copied into `folder`."""
    scenario, db = small_library
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy2(scenario, folder / scenario.name)
    for path in (db, db.with_name(db.name + ".wal")):
        if path.exists():
            shutil.copy2(path, folder / path.name)
    return folder / scenario.name, folder / db.name


def with_field(doc, dotted: str, value):
    """A deep copy of `doc` with the field at `dotted` (`a.b`, `models.0.x`) set, or removed for `...`; where a
    parent is not a container the copy is left as it is."""
    out = json.loads(json.dumps(doc))
    *parents, leaf = dotted.split(".")
    node = out
    for p in parents:
        if isinstance(node, list):
            if not p.isdigit() or int(p) >= len(node):
                return out
            node = node[int(p)]
        elif isinstance(node, dict):
            node = node.setdefault(p, {})
        else:
            return out
    if isinstance(node, list) and leaf.isdigit() and int(leaf) < len(node):
        node[int(leaf)] = value
    elif isinstance(node, dict) and value is ...:
        node.pop(leaf, None)
    elif isinstance(node, dict):
        node[leaf] = value
    return out


def day_scenario(tmp: Path, day: dict, nodes: int = 1000, interval_min: float = 60.0, series: dict | None = None):
    """SMALL with a `day` section, `nodes` of each node configuration (an availability `series` over them) and
    re-plan windows of `interval_min`, written under `tmp` and loaded."""
    from coral_dagster.catalog.scenarios import load_scenario

    availability = {"default_nodes": nodes, **({"series": series} if series else {})}
    doc = small(day=day, availability=availability,
                allocation={"headroom": 1.1, "replan_interval_min": interval_min, "node_startup_min": 10})
    path = tmp / f"day-{abs(hash(yaml.safe_dump(doc))) % 10**8}.yml"
    path.write_text(yaml.safe_dump(doc))
    return load_scenario(path)
