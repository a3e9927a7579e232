"""Plans in DuckDB: `plans` (one row a plan), `plan_instances` (one row a template in a region) and `plan_routes`
(the share of each model's requests each region receives under the routing policy), written together.

`plan_instances.usd_per_hour` and `.tokens_per_s` are per instance (the views multiply by `count`); `stages_json`
keeps each template's placement so a loaded plan can be deployed or re-planned against. `plans.detail_json`
holds demand and served tokens/s, bottlenecks, pruning counts, timings and notes.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime, timezone
from typing import Any, Mapping

import pandas as pd

from coral_dagster.allocation.types import Bottleneck, PlannedInstance, Plan
from coral_dagster.catalog.nodes import NodeMultiset
from coral_dagster.errors import CoralError
from coral_dagster.templates.types import Template, stages_doc, stages_from_doc

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


def _key(k: tuple[str, str]) -> str:
    return f"{k[0]}/{k[1]}"


def _unkey(s: str) -> tuple[str, str]:
    model, phase = s.rsplit("/", 1)
    return model, phase


def plan_frames(plan: Plan, plan_id: str, run_id: str, inputs: Mapping[str, Any],
                created_at: datetime) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The two rows-sets `store_plan` writes (typed even when the plan has no instances)."""
    detail = {
        "demand_tokens_per_s": {_key(k): v for k, v in sorted(plan.demand_tokens_per_s.items())},
        "served_tokens_per_s": {_key(k): v for k, v in sorted(plan.served_tokens_per_s.items())},
        "bottlenecks": [b.as_dict() for b in plan.bottlenecks], "pruning": plan.pruning,
        "timings_s": dict(plan.timings_s), "notes": list(plan.notes),
        "capacity_factors": {_key(k): v for k, v in sorted(plan.capacity_factors.items())},
        "admit_req_s": dict(plan.admit_req_s), "admit_depth_req": dict(plan.admit_depth_req),
        "admit_peak": {m: list(v) for m, v in plan.admit_peak.items()},
        "expected_attainment": dict(plan.expected_attainment),
        "expected_from": plan.expected_from,
    }
    row = {"plan_id": plan_id, "run_id": run_id, "created_at": pd.Timestamp(created_at),
           "scenario": plan.scenario, "method": plan.method, "status": plan.status,
           "cost_usd_per_hour": plan.cost_usd_per_hour, "lp_bound_usd_per_hour": plan.lp_bound_usd_per_hour,
           "gap": plan.gap, "solve_s": plan.solve_s, "demand_scale": plan.demand_scale,
           "snapshot_id": plan.snapshot_id, "inputs_json": json.dumps(dict(inputs), sort_keys=True, default=str),
           "churn_usd_per_hour": plan.churn_usd_per_hour, "mip_bound_usd_per_hour": plan.mip_bound_usd_per_hour,
           "detail_json": json.dumps(detail, sort_keys=True), "scenario_key": plan.scenario_key}
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
    digest = hashlib.sha1(json.dumps(plan.as_dict(), sort_keys=True, default=str).encode()).hexdigest()[:8]
    return f"{plan.scenario}-{plan.method}-{created_at:%Y%m%dT%H%M%S%f}-{digest}"


def store_plan(store, plan: Plan, run_id: str, inputs: Mapping[str, Any]) -> Plan:
    """Write the plan, its instances and its routes in one transaction; returns the plan with its new plan_id."""
    from dataclasses import replace

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
    row = rows.iloc[0]
    inst = store.query("SELECT * FROM plan_instances WHERE plan_id = ? ORDER BY model, phase, region, template_id",
                       [row["plan_id"]])
    instances = []
    for r in inst.itertuples(index=False):
        stages = stages_from_doc(json.loads(r.stages_json))
        template = Template(r.model, r.phase, float(r.slo_ms), NodeMultiset.parse(r.nodes), stages,
                            float(r.tokens_per_s), r.bound)
        instances.append(PlannedInstance(template, r.region, int(r.count), float(r.usd_per_hour)))
    detail = json.loads(row["detail_json"])
    return Plan(
        scenario=row["scenario"], method=row["method"], status=row["status"],
        cost_usd_per_hour=float(row["cost_usd_per_hour"]), lp_bound_usd_per_hour=float(row["lp_bound_usd_per_hour"]),
        gap=float(row["gap"]), solve_s=float(row["solve_s"]), instances=tuple(instances),
        demand_tokens_per_s={_unkey(k): v for k, v in detail["demand_tokens_per_s"].items()},
        served_tokens_per_s={_unkey(k): v for k, v in detail["served_tokens_per_s"].items()},
        demand_scale=float(row["demand_scale"]), notes=tuple(detail["notes"]),
        churn_usd_per_hour=float(row["churn_usd_per_hour"]),
        mip_bound_usd_per_hour=float(row["mip_bound_usd_per_hour"]),
        bottlenecks=tuple(Bottleneck(b["kind"], b["name"], b["region"], b["needed"], b["available"])
                          for b in detail["bottlenecks"]),
        pruning=detail["pruning"], snapshot_id=row["snapshot_id"], timings_s=detail["timings_s"],
        plan_id=str(row["plan_id"]),
        capacity_factors={_unkey(k): v for k, v in detail.get("capacity_factors", {}).items()},
        admit_req_s=detail.get("admit_req_s", {}), admit_depth_req=detail.get("admit_depth_req", {}),
        admit_peak={m: tuple(v) for m, v in detail.get("admit_peak", {}).items()},
        expected_attainment=detail.get("expected_attainment", {}),
        expected_from=detail.get("expected_from", ""),
        scenario_key="" if pd.isna(row.get("scenario_key")) else str(row.get("scenario_key")),
    )

