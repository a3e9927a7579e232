"""Finding stored plans: a scenario's latest plan of a method, a plan by id or file, and the problem it answered."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from coral_dagster.allocation.problem import AllocationProblem
from coral_dagster.allocation.storage import load_plan
from coral_dagster.allocation.types import Plan
from coral_dagster.errors import CoralError
from coral_dagster.store.duck import Store

LATEST = "latest"


def latest_plan(store: Store, scenario: str, method: str = "coral") -> Plan:
    """The newest stored plan of the scenario made by `method` (Coral unless asked otherwise)."""
    if "plans" not in store.tables():
        raise CoralError(f"no plans are stored in {store.path}.", f"make one with `coral plan --scenario {scenario}`.")
    rows = store.query("SELECT plan_id FROM plans WHERE scenario = ? AND method = ? "
                       "ORDER BY created_at DESC, plan_id DESC LIMIT 1", [scenario, method])
    if rows.empty:
        raise CoralError(f"no {method} plan of scenario {scenario} is stored in {store.path}.",
                         f"make one with `coral plan --scenario {scenario} --method {method}` (or `coral run`).")
    return load_plan(store, str(rows["plan_id"].iloc[0]))


def find_plan(store: Store, scenario: str, method: str = "coral") -> Plan | None:
    """`latest_plan`, or None when the scenario has no stored plan of that method."""
    try:
        return latest_plan(store, scenario, method)
    except CoralError:
        return None


def resolve_plan(store: Store, ref: str, scenario: str, method: str = "coral") -> Plan:
    """A plan named on the command line: `latest` (the scenario's newest plan of `method`), a stored plan id, or a
    JSON file as `coral plan --json` prints it."""
    if ref == LATEST:
        return latest_plan(store, scenario, method)
    path = Path(ref)
    if path.suffix == ".json" or path.is_file():
        return plan_file(path, store)
    return load_plan(store, ref)


def plan_file(path: Path, store: Store) -> Plan:
    """A plan file: instances with their stages are read as they are; otherwise its plan_id is looked up."""
    if not path.is_file():
        raise CoralError(f"plan file {path} does not exist.", "give the JSON `coral plan --json` printed.")
    try:
        doc = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CoralError(f"plan file {path} is not JSON ({exc}).", "give the JSON `coral plan --json` printed.")
    rows = doc.get("instances") if isinstance(doc, dict) else None
    if not isinstance(rows, list):
        raise CoralError(f"plan file {path} has no instances list.", "give the JSON `coral plan --json` printed.")
    if all(isinstance(r, dict) and ("stages" in r or "stages_json" in r) for r in rows):
        return plan_from_json(doc, path)
    if not doc.get("plan_id"):
        raise CoralError(f"plan file {path} lists instances without their stages and has no plan_id.",
                         "store the plan (`coral plan` without --no-store) and pass its plan_id or the file.")
    return load_plan(store, doc["plan_id"])


def plan_from_json(doc: dict, source: Path | str = "plan JSON") -> Plan:
    """A Plan from a JSON document whose instances carry their stages (`stages` or `stages_json`); demand and served
    tokens/s are read back from its `served` table so routing weights are the plan's own."""
    from coral_dagster.allocation.types import PlannedInstance
    from coral_dagster.catalog.nodes import NodeConfig, NodeMultiset
    from coral_dagster.templates.types import Stage, Template

    instances = []
    try:
        for row in doc.get("instances", []):
            raw = row.get("stages", row.get("stages_json"))
            raw = json.loads(raw) if isinstance(raw, str) else raw
            stages = tuple(Stage(int(s["start"]), int(s["end"]), tuple(NodeConfig.parse(n) for n in s["nodes"]),
                                 tuple(float(x) for x in s["shares"])) for s in raw)
            count = int(row["count"])
            # `coral plan --json` prints tokens/s and $/h of all `count` instances together.
            template = Template(row["model"], row["phase"], float(row.get("slo_ms", 0.0)),
                                NodeMultiset.of([n for s in stages for n in s.nodes]), stages,
                                float(row["tokens_per_s"]) / max(count, 1), row.get("bound", "compute"))
            instances.append(PlannedInstance(template, row["region"], count,
                                             float(row["usd_per_hour"]) / max(count, 1)))
        served = doc.get("served") or {}
        demand = {tuple(k.rsplit("/", 1)): float(v["demand_tokens_per_s"]) for k, v in served.items()}
        supplied = {tuple(k.rsplit("/", 1)): float(v["served_tokens_per_s"]) for k, v in served.items()}
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CoralError(f"{source}: an instance or served entry is malformed ({type(exc).__name__}: {exc}).",
                         "give the JSON `coral plan --json` printed, unedited.")
    return Plan(doc.get("scenario", ""), doc.get("method", "coral"), doc.get("status", "optimal"),
                float(doc.get("cost_usd_per_hour") or 0.0), float(doc.get("lp_bound_usd_per_hour") or 0.0),
                float(doc.get("gap") or 0.0), float(doc.get("solve_s") or 0.0), tuple(instances), demand, supplied,
                snapshot_id=str(doc.get("snapshot_id") or ""), plan_id=str(doc.get("plan_id") or ""))


def plan_problem(store: Store, plan: Plan) -> AllocationProblem:
    """The allocation problem a stored plan answered: its snapshot and library, and the demand it recorded."""
    from coral_dagster.allocation.inputs import scenario_problem
    from coral_dagster.catalog.market import market_from_frame
    from coral_dagster.catalog.scenarios import load_scenario
    from coral_dagster.templates.library import load_library

    scenario = load_scenario(plan.scenario)
    snap = market_from_frame(store.query("SELECT * FROM market_snapshots WHERE snapshot_id = ?", [plan.snapshot_id]))
    problem = scenario_problem(scenario, load_library(store, scenario), snap)
    return replace(problem, demand_tokens_per_s=dict(plan.demand_tokens_per_s))


def plan_label(plan: Plan) -> str:
    """How headers name a plan: its method and id (or 'unstored')."""
    return f"{plan.method} plan {plan.plan_id or '(unstored)'}"
