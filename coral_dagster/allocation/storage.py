"""Plans in DuckDB: `plans` (one row a plan), `plan_instances` (one row a template in a region) and `plan_routes`
(the share of each model's requests each region receives under the routing policy), written together.

`plans.detail_json` holds the whole plan in the plan codec's form (`allocation.codec`, the form `coral plan --json`
prints), which is what `load_plan` reads; the other columns and tables are there to be queried.
`plan_instances.usd_per_hour` and `.tokens_per_s` are per instance (the views multiply by `count`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from datetime import datetime, timezone
from typing import Any, Mapping

import pandas as pd

from coral_dagster.allocation.codec import parse_plan_text, plan_from_doc, plan_to_doc, plan_to_json
from coral_dagster.allocation.types import Plan
from coral_dagster.errors import CoralError
from coral_dagster.templates.types import stages_doc

PLAN_COLUMNS = {
    "plan_id": "object", "run_id": "object", "created_at": "datetime64[us, UTC]", "scenario": "object",
    "method": "object", "status": "object", "cost_usd_per_hour": "float64", "lp_bound_usd_per_hour": "float64",
    "gap": "float64", "solve_s": "float64", "demand_scale": "float64", "snapshot_id": "object",
    "inputs_json": "object", "churn_usd_per_hour": "float64", "mip_bound_usd_per_hour": "float64",
    "detail_json": "object", "scenario_key": "object",
}
INSTANCE_COLUMNS = {
    "plan_id": "object", "template_id": "object", "model": "object", "phase": "object", "region": "object",
    "nodes": "object", "count": "int64", "tokens_per_s": "float64", "usd_per_hour": "float64",
    "slo_ms": "float64", "bound": "object", "pp_partition": "object", "stages_json": "object",
}

ROUTE_COLUMNS = {"plan_id": "object", "model": "object", "region": "object", "share": "float64"}


def plan_frames(plan: Plan, plan_id: str, run_id: str, inputs: Mapping[str, Any],
                created_at: datetime) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The two rows-sets `store_plan` writes (typed even when the plan has no instances)."""
    row = {"plan_id": plan_id, "run_id": run_id, "created_at": pd.Timestamp(created_at),
           "scenario": plan.scenario, "method": plan.method, "status": plan.status,
           "cost_usd_per_hour": plan.cost_usd_per_hour, "lp_bound_usd_per_hour": plan.lp_bound_usd_per_hour,
           "gap": plan.gap, "solve_s": plan.solve_s, "demand_scale": plan.demand_scale,
           "snapshot_id": plan.snapshot_id, "inputs_json": json.dumps(dict(inputs), sort_keys=True, default=str),
           "churn_usd_per_hour": plan.churn_usd_per_hour, "mip_bound_usd_per_hour": plan.mip_bound_usd_per_hour,
           "detail_json": plan_to_json(replace(plan, plan_id=plan_id)), "scenario_key": plan.scenario_key}
    plans = pd.DataFrame([row]).astype(PLAN_COLUMNS)
    rows = [{"plan_id": plan_id, "template_id": i.template.template_id, "model": i.template.model,
             "phase": i.template.phase, "region": i.region, "nodes": str(i.template.nodes), "count": i.count,
             "tokens_per_s": i.template.tokens_per_s, "usd_per_hour": i.usd_per_hour, "slo_ms": i.template.slo_ms,
             "bound": i.template.bound, "pp_partition": i.template.pp_partition,
             "stages_json": json.dumps(stages_doc(i.template.stages))} for i in plan.instances]
    instances = pd.DataFrame(rows, columns=list(INSTANCE_COLUMNS)).astype(INSTANCE_COLUMNS)
    return plans, instances


def route_frame(plan: Plan, plan_id: str) -> pd.DataFrame:
    """One row per (model, region) the plan routes requests to, with its share."""
    rows = [{"plan_id": plan_id, "model": m, "region": r, "share": float(x)}
            for m, by_region in plan.routing_shares.items() for r, x in by_region.items()]
    return pd.DataFrame(rows, columns=list(ROUTE_COLUMNS)).astype(ROUTE_COLUMNS)


def new_plan_id(plan: Plan, created_at: datetime) -> str:
    digest = hashlib.sha1(json.dumps(plan_to_doc(plan), sort_keys=True).encode()).hexdigest()[:8]
    return f"{plan.scenario}-{plan.method}-{created_at:%Y%m%dT%H%M%S%f}-{digest}"


def store_plan(store, plan: Plan, run_id: str, inputs: Mapping[str, Any]) -> Plan:
    """Write the plan, its instances and its routes in one transaction; returns the plan with its new plan_id."""
    from coral_dagster.store.duck import write_frame

    created_at = datetime.now(timezone.utc)
    plan_id = new_plan_id(plan, created_at)
    plans, instances = plan_frames(plan, plan_id, run_id, inputs, created_at)
    with store.transaction() as con:
        write_frame(con, "plans", plans)
        write_frame(con, "plan_instances", instances)
        write_frame(con, "plan_routes", route_frame(plan, plan_id))
    return replace(plan, plan_id=plan_id)


def load_plan(store, plan_id: str) -> Plan:
    """A stored plan by its id (`coral_dagster.app.plans.latest_plan` finds the newest of a scenario and method)."""
    if "plans" not in store.tables():
        raise CoralError(f"no plans are stored in {store.path}.", "make one with `coral plan --scenario core`.")
    rows = store.query("SELECT * FROM plans WHERE plan_id = ?", [plan_id])
    if rows.empty:
        known = store.query("SELECT plan_id FROM plans ORDER BY created_at DESC LIMIT 5")["plan_id"].tolist()
        raise CoralError(f"plan {plan_id!r} is not in {store.path}.",
                         f"use `latest` or one of the newest: {', '.join(known) or 'none'}.")
    detail = parse_plan_text(rows["detail_json"].iloc[0], f"plan {plan_id} in {store.path}")
    if "instances" not in detail:
        raise CoralError(f"plan {plan_id!r} in {store.path} was stored by an earlier Coral, in a form this one "
                         "does not read.", "make the plan again with `coral plan` (or `coral run`).")
    return plan_from_doc(detail, f"plan {plan_id} in {store.path}", catalog=False)
