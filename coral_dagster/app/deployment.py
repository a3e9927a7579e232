"""Deploying a stored plan: node prices and instance types from the market snapshot the plan was made on."""

from __future__ import annotations

import pandas as pd

from coral_dagster.allocation.types import Plan
from coral_dagster.errors import CoralError
from coral_dagster.store.duck import Store


def snapshot_prices(store: Store, plan: Plan) -> tuple[pd.DataFrame, str]:
    """(price rows: region, node, instance type, on-demand and spot $/h; where they come from): the plan's own
    market snapshot when the store holds it; for a plan file whose snapshot was never stored, the current price
    table (bundled, or `--prices`), and the source says so."""
    if plan.snapshot_id and "market_snapshots" in store.tables():
        rows = store.query("SELECT region, node, gpu, gpus, instance_type, usd_per_hour, spot_usd_per_hour "
                           "FROM market_snapshots WHERE snapshot_id = ?", [plan.snapshot_id])
        if not rows.empty:
            return rows, f"market snapshot {plan.snapshot_id}"
    if plan.plan_id and not plan.plan_id.startswith("file-"):
        raise CoralError(f"market snapshot {plan.snapshot_id or '(none)'} of plan {plan.plan_id} is not in "
                         f"{store.path}.", "re-plan on a stored snapshot (`coral plan`), then deploy that plan.")
    from coral_dagster.catalog.prices import load_node_prices

    return load_node_prices(), (f"the current price table (plan file; its snapshot {plan.snapshot_id or '(none)'} "
                                "is not stored)")


def deploy(store: Store, plan: Plan, launcher) -> dict:
    """Hand the plan, priced from its own snapshot, to a launcher (`deploy(store, plan, prices) -> dict`); the
    report carries the plan's cost beside the deployment's full cost (`deploy.cost.DeploymentCost.as_dict`)."""
    from coral_dagster.deploy.cost import deployment_cost

    prices, source = snapshot_prices(store, plan)
    cost = deployment_cost(plan, plan.plan_id, prices, source)
    report = launcher.deploy(store, plan, prices)
    return {"plan_id": plan.plan_id, "method": plan.method, "priced_from": source,
            "plan_usd_per_hour": round(plan.cost_usd_per_hour, 4), **cost.as_dict(), **report}
