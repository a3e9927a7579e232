"""Simulating a plan (stored, a file, or made now) on a scenario's traffic, its plots, and recording what a stored plan
attained, keyed by the plan id."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Mapping

import pandas as pd

from coral_dagster.allocation.storage import load_plan
from coral_dagster.simulator.simulate import TRAFFIC as TRAFFIC
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


def plan_to_simulate(plan_ref: str, scenario: str, *, method: str = "coral", fresh: bool = False,
                     closed_loop: bool = True, scenario_given: bool = True, db_path: str | None = None,
                     prices_path: str | None = None):
    """(label, Plan, Scenario, note): a fresh plan of `method` made as `coral plan` makes it (`app.make_plan`), or
    a stored plan (`latest` of the scenario and method, an id, or a JSON file), with the scenario whose traffic it
    serves: the one it was planned for unless `scenario_given` names another (then `note` says so; else '')."""
    from coral_dagster.app.make_plan import PlanRequest, make_plan
    from coral_dagster.app.plans import plan_label, resolve_plan, scenario_of
    from coral_dagster.catalog.scenarios import load_scenario

    scn = load_scenario(scenario)
    if fresh:
        made = make_plan(PlanRequest(scn, method, closed_loop=closed_loop, db_path=db_path, prices_path=prices_path))
        return f"fresh {method} plan (unstored)", made.plan, scn, ""
    store = Store(db_path)
    plan = resolve_plan(store, plan_ref, scn, method)
    if plan.scenario_key and plan.scenario_key != scn.scenario_key:
        if not scenario_given:
            return plan_label(plan), plan, scenario_of(store, plan), ""
        return plan_label(plan), plan, scn, (f"{plan_label(plan)} was planned for scenario {plan.scenario} with other "
                                             f"settings; simulating it on {scn.ref}'s traffic as asked.")
    return plan_label(plan), plan, scn, ""


def simulate(plan, scenario, **options):
    """The plan serving the scenario's traffic in the event-driven simulator (`simulator.simulate_plan`)."""
    from coral_dagster.simulator.simulate import simulate_plan

    return simulate_plan(plan, scenario, **options)


def write_plots(result, plots_dir: str) -> dict[str, str]:
    """The simulation's latency CDF and goodput plots, written into `plots_dir`; their paths by name."""
    from coral_dagster.files import make_dir
    from coral_dagster.simulator.plots import PLOTS_FIX, plot_goodput, plot_latency_cdf

    out = make_dir(plots_dir, PLOTS_FIX)
    return {"latency_cdf": str(plot_latency_cdf(result, out / "latency_cdf.png")),
            "goodput": str(plot_goodput(result, out / "goodput.png"))}


def record_simulation(db_path: str | None, plan, scenario, result, traffic: str) -> str:
    """Append the simulation to the store's `simulations` when it is the stored plan serving its own scenario's
    traces (what the plan's SLO attainment means); says where it went, or why it was not recorded."""
    if not plan.plan_id or plan.plan_id.startswith("file-"):
        return "not recorded: the plan is not stored"
    if traffic != "scenario" or plan.scenario_key and plan.scenario_key != scenario.scenario_key:
        return "not recorded: only a plan serving its own scenario's traces is recorded"
    store = Store(db_path)
    store_simulation(store, plan.plan_id, result, {m.model: m.attainment_target for m in scenario.models})
    return f"recorded in {store.path} (table simulations, plan {plan.plan_id})"
