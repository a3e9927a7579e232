"""One re-planning round over the store: demand snapshots in, a stored plan (Coral or a baseline) out."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone

import pandas as pd

from coral_dagster.allocation.capacity import ATTAINMENT_WINDOW_S
from coral_dagster.allocation.inputs import scenario_rates, scenario_traces
from coral_dagster.allocation.problem import AllocationProblem
from coral_dagster.allocation.types import Plan
from coral_dagster.catalog.scenarios import Scenario
from coral_dagster.highs import DEFAULT_MAX_NODES, SAFETY_NET_S
from coral_dagster.store.duck import Store, newest_snapshot, write_frame
from coral_dagster.store.views import create_views


def demand_rates(scenario: Scenario, demand_mix: str = "uniform", follow_trace: bool = False,
                 now: datetime | None = None) -> dict[str, float]:
    """Request rate per model: the scenario's (under a mix), optionally following each trace's 6-minute windows
    so that the re-plan window at `now` sees the trace's burst or lull."""
    from coral_dagster.allocation.demand import window_rates

    rates = scenario_rates(scenario, demand_mix)
    if not follow_trace:
        return rates
    windows = window_rates(rates, scenario_traces(scenario), scenario.replan_interval_min)
    now = now or datetime.now(timezone.utc)
    return windows[int(now.minute // scenario.replan_interval_min) % len(windows)]


def store_demand(store: Store, scenario: Scenario, rates: dict[str, float], demand_mix: str,
                 now: datetime | None = None) -> str:
    """Append one demand snapshot (request rate per model) to `demand_snapshots`; returns its id."""
    now = now or datetime.now(timezone.utc)
    demand_id = f"{scenario.name}-{now:%Y%m%dT%H%M%S%f}"
    df = pd.DataFrame([{"demand_id": demand_id, "taken_at": now, "scenario": scenario.name, "demand_mix": demand_mix,
                        "model": m, "rate_req_s": float(r), "scenario_key": scenario.scenario_key}
                       for m, r in sorted(rates.items())])
    with store.transaction() as con:
        write_frame(con, "demand_snapshots", df)
    return demand_id


def latest_demand(store: Store, scenario: Scenario) -> tuple[str, dict[str, float]]:
    """(demand_id, rate per model) of the newest demand snapshot of the scenario (by its `scenario_key`)."""
    fix = f"materialize `demand` for scenario {scenario.ref} (or run `coral run` on it)."
    df = newest_snapshot(store, "demand_snapshots", "demand_id", scenario, "demand snapshot", fix)
    return str(df["demand_id"].iloc[0]), dict(zip(df["model"], df["rate_req_s"].astype(float)))


@dataclass(frozen=True)
class PlanRound:
    """The inputs and outcome of one planning round."""

    plan_id: str
    plan: Plan
    problem: AllocationProblem
    demand_id: str


def plan_round(store: Store, scenario: Scenario, method: str = "coral", *, scarcity: str | None = None,
               time_limit_s: float = SAFETY_NET_S, run_id: str | None = None, closed_loop: bool = False,
               loop_rounds: int = 3, loop_window_s: float = ATTAINMENT_WINDOW_S,
               max_nodes: int | None = DEFAULT_MAX_NODES) -> PlanRound:
    """Plan from the stored library, newest snapshot and newest demand; churn is priced against the newest plan
    of the same method. With `closed_loop`, the plan is simulated on each model's own trace and re-planned with
    more capacity for models that fall short (`app.closed_loop`). A plan that serves less than the demand admits
    per model only the request rate it serves (`admit_req_s`). The plan is written in one transaction; a failure
    writes nothing. `max_nodes` is each MIP's work limit (the plan is the same on any machine), `time_limit_s` the
    wall-clock safety net."""
    from coral_dagster.app.make_plan import PlanRequest, make_plan

    made = make_plan(PlanRequest(scenario, method, scarcity=scarcity, time_limit_s=time_limit_s,
                                 closed_loop=closed_loop, loop_rounds=loop_rounds, loop_window_s=loop_window_s,
                                 max_nodes=max_nodes, from_store=True, save=True, run_id=run_id), store)
    create_views(store)
    return PlanRound(made.plan.plan_id, made.plan, made.problem, made.inputs["demand_id"])


def plan_by_model_region(plan: Plan) -> pd.DataFrame:
    """Instances, nodes, tokens/s and $/h per (model, phase, region): the table people read a plan by."""
    rows = [{"model": i.template.model, "phase": i.template.phase, "region": i.region, "nodes": str(i.template.nodes),
             "instances": i.count, "tokens_per_s": i.tokens_per_s, "usd_per_hour": i.count * i.usd_per_hour}
            for i in plan.instances]
    cols = ["model", "phase", "region", "nodes", "instances", "tokens_per_s", "usd_per_hour"]
    return pd.DataFrame(rows, columns=cols).sort_values(["model", "phase", "region", "nodes"]).reset_index(drop=True)


def stored_model_templates(store: Store, scenario: Scenario, model: str) -> int:
    """How many of one model's templates the store holds under the scenario's library key (0: none), that is built
    from exactly the inputs this scenario would build them from (`Scenario.library_key`)."""
    from coral_dagster.templates.library import TEMPLATES_TABLE

    if "library_key" not in store.columns(TEMPLATES_TABLE):
        return 0
    rows = store.query(f"SELECT count(*) AS n FROM {TEMPLATES_TABLE} WHERE library_key = ? AND model = ?",
                       [scenario.library_key, model])
    return int(rows.n.iloc[0])


def store_model_templates(store: Store, scenario: Scenario, model: str, templates) -> int:
    """Replace one model's templates in the scenario's stored library (the others stay); returns its count."""
    from coral_dagster.templates.library import load_library, store_library

    others = [t for t in load_library(store, scenario) if t.model != model]
    store_library(store, others + list(templates), scenario)
    return len(templates)
