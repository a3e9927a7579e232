"""Finding stored plans: a scenario's latest plan of a method, a plan by id or file, and the problem it answered."""

from __future__ import annotations

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
    from coral_dagster.app.plan_files import is_plan_file, load_plan_file

    if ref == LATEST:
        return latest_plan(store, scenario, method)
    if is_plan_file(ref):
        return load_plan_file(Path(ref), store)
    return load_plan(store, ref)


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
