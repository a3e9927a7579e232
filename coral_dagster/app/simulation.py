"""Simulating a stored plan on its scenario's traffic and recording what it attained, keyed by the plan id."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Mapping

import pandas as pd

from coral_dagster.allocation.storage import load_plan
from coral_dagster.store.duck import Store, write_frame


def simulate_plan_id(store: Store, plan_id: str, *, duration_s: float = 120.0, seed: int = 0,
                     trace: str | None = None, attainment_target: float = 0.95, rate_scale: float = 1.0):
    """Simulate the stored plan on its scenario's traces (at `rate_scale` × their rates) and append the per-model
    figures to `simulations`; returns (result, stored rows)."""
    from coral_dagster.app.plans import scenario_of
    from coral_dagster.simulator.simulate import simulate_plan

    plan = load_plan(store, plan_id)
    result = simulate_plan(plan, scenario_of(store, plan), trace=trace, duration_s=duration_s, seed=seed,
                           rate_scale=rate_scale)
    return result, store_simulation(store, plan_id, result, attainment_target)


def store_simulation(store: Store, plan_id: str, result,
                     attainment_target: float | Mapping[str, float]) -> pd.DataFrame:
    """Append one simulation's per-model figures to `simulations` (`attainment_target` one for all models, or per
    model); returns them."""
    table = result.by_model.copy()
    table.insert(0, "plan_id", plan_id)
    table["simulated_at"] = datetime.now(timezone.utc)
    table["duration_s"] = result.duration_s
    table["seed"] = result.seed
    table["rate_scale"] = result.rate_scale
    table["attainment_target"] = (table["model"].map(attainment_target).astype(float)
                                  if isinstance(attainment_target, Mapping) else attainment_target)
    with store.transaction() as con:
        write_frame(con, "simulations", table)
    return table


def plan_simulation(store: Store, plan_id: str) -> pd.DataFrame:
    """The newest simulation's per-model rows of one plan (empty when it was never simulated)."""
    if "simulations" not in store.tables():
        return pd.DataFrame()
    return store.query("""SELECT * FROM simulations WHERE plan_id = ? AND simulated_at = (
                            SELECT max(simulated_at) FROM simulations WHERE plan_id = ?) ORDER BY model""",
                       [plan_id, plan_id])
