"""Deploying a stored plan: node prices and instance types from the market snapshot the plan was made on."""

from __future__ import annotations

import pandas as pd

from coral_dagster.allocation.types import Plan
from coral_dagster.errors import CoralError
from coral_dagster.store.duck import Store


def snapshot_prices(store: Store, plan: Plan) -> pd.DataFrame:
    """The price rows (region, node, instance type, on-demand and spot $/h) of the plan's own market snapshot."""
    if not plan.snapshot_id:
        raise CoralError(f"{plan.method} plan {plan.plan_id or '(unstored)'} names no market snapshot.",
                         "deploy a plan stored by `coral plan` or `coral run`, which record their snapshot.")
    if "market_snapshots" not in store.tables():
        raise CoralError(f"no market snapshot is stored in {store.path}.", "materialize `market_snapshot` first.")
    rows = store.query("SELECT region, node, gpu, gpus, instance_type, usd_per_hour, spot_usd_per_hour "
                       "FROM market_snapshots WHERE snapshot_id = ?", [plan.snapshot_id])
    if rows.empty:
        raise CoralError(f"market snapshot {plan.snapshot_id} of plan {plan.plan_id} is not in {store.path}.",
                         "re-plan on a stored snapshot (`coral plan`), then deploy that plan.")
    return rows


def deploy(store: Store, plan: Plan, launcher) -> dict:
    """Hand the plan, priced from its own snapshot, to a launcher (`deploy(store, plan, prices) -> dict`); the
    report carries the plan's cost beside the deployment's."""
    report = launcher.deploy(store, plan, snapshot_prices(store, plan))
    return {"plan_id": plan.plan_id, "method": plan.method,
            "plan_usd_per_hour": round(plan.cost_usd_per_hour, 4), **report}
