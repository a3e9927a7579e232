"""Finding stored plans: a scenario's latest plan of a method, a plan by id or file, and the problem it answered."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pandas as pd

from coral_dagster.allocation.problem import AllocationProblem
from coral_dagster.allocation.storage import load_plan as load_plan
from coral_dagster.allocation.types import Plan
from coral_dagster.catalog.scenarios import Scenario, load_scenario, scenario_names as scenario_names
from coral_dagster.errors import CoralError
from coral_dagster.routing import admission_shares as admission_shares
from coral_dagster.store.duck import Store as Store

LATEST = "latest"


def latest_plan(store: Store, scenario: Scenario | str, method: str = "coral") -> Plan:
    """The newest stored plan of the scenario (a `Scenario`, a bundled name or a file) made by `method` (Coral
    unless asked otherwise). Plans are found by the scenario's contents (`scenario_key`), so a user file named
    like a bundled scenario never sees the bundled scenario's plans, nor they its."""
    scn = scenario if isinstance(scenario, Scenario) else load_scenario(scenario)
    fix = f"make one with `coral plan --scenario {scn.ref} --method {method}` (or `coral run`)."
    if "plans" not in store.tables():
        raise CoralError(f"no plans are stored in {store.path}.", fix)
    rows = store.query("SELECT plan_id FROM plans WHERE scenario_key = ? AND method = ? "
                       "ORDER BY created_at DESC, plan_id DESC LIMIT 1", [scn.scenario_key, method]) \
        if "scenario_key" in store.columns("plans") else pd.DataFrame()
    if rows.empty:
        raise CoralError(f"no {method} plan of scenario {scn.ref} is stored in {store.path}.", fix)
    return load_plan(store, str(rows["plan_id"].iloc[0]))


def find_plan(store: Store, scenario: Scenario | str, method: str = "coral") -> Plan | None:
    """`latest_plan`, or None when the scenario has no stored plan of that method."""
    try:
        return latest_plan(store, scenario, method)
    except CoralError:
        return None


def _inputs(store: Store, plan: Plan) -> dict:
    """What the plan recorded it was asked for and made from (`app.make_plan.plan_inputs`: scenario file, engine,
    …; old rows read in that shape); every field None for an unstored plan."""
    from coral_dagster.app.make_plan import read_inputs

    rows = store.query("SELECT inputs_json FROM plans WHERE plan_id = ?", [plan.plan_id]) \
        if plan.plan_id and "plans" in store.tables() else None
    return read_inputs(json.loads(rows["inputs_json"].iloc[0]) if rows is not None and not rows.empty else {})


def plan_engine(store: Store, plan: Plan) -> str:
    """The serving engine a plan was made for (its deployment runs PD templates through it): as recorded, else the
    scenario's; `coral`, the runtime that runs every template, for a plan file whose scenario is not at hand."""
    recorded = _inputs(store, plan).get("engine")
    if recorded:
        return recorded
    try:
        return scenario_of(store, plan).engine
    except CoralError:
        return "coral"


def scenario_of(store: Store, plan: Plan) -> Scenario:
    """The scenario a plan was made for: the file it was planned from (or the bundled one of its name), with the
    engine it was planned for; raises when that file now holds other settings than the plan's."""
    inputs = _inputs(store, plan)
    path = inputs.get("scenario_path") or ""
    scn = load_scenario(path if path and Path(path).is_file() else plan.scenario)
    if plan.scenario_key and scn.scenario_key != plan.scenario_key:
        raise CoralError(f"plan {plan.plan_id or '(unstored)'} was made for scenario {plan.scenario} with other "
                         f"settings than {scn.path or 'the bundled file'} holds now (key {plan.scenario_key}, "
                         f"now {scn.scenario_key}).",
                         "restore the scenario file it was planned from, or re-plan with `coral plan`.")
    return replace(scn, engine=inputs.get("engine") or scn.engine)


def resolve_plan(store: Store, ref: str, scenario: Scenario | str, method: str = "coral",
                 prices: pd.DataFrame | None = None) -> Plan:
    """A plan named on the command line: `latest` (the scenario's newest plan of `method`), a stored plan id, or a
    JSON file as `coral plan --json` prints it (checked against the price table `prices`, default
    `load_node_prices()`)."""
    from coral_dagster.app.plan_files import is_plan_file, load_plan_file

    if ref == LATEST:
        return latest_plan(store, scenario, method)
    if is_plan_file(ref):
        return load_plan_file(Path(ref), store, prices)
    return load_plan(store, ref)


def plan_problem(store: Store, plan: Plan) -> AllocationProblem:
    """The allocation problem a stored plan answered: its snapshot and library, and the demand it recorded."""
    from coral_dagster.allocation.inputs import scenario_problem
    from coral_dagster.catalog.market import market_from_frame
    from coral_dagster.templates.library import load_library

    scenario = scenario_of(store, plan)
    snap = market_from_frame(store.query("SELECT * FROM market_snapshots WHERE snapshot_id = ?", [plan.snapshot_id]))
    problem = scenario_problem(scenario, load_library(store, scenario), snap)
    return replace(problem, demand_tokens_per_s=dict(plan.demand_tokens_per_s))


def plan_label(plan: Plan) -> str:
    """How headers name a plan: its method and id (or 'unstored')."""
    return f"{plan.method} plan {plan.plan_id or '(unstored)'}"
