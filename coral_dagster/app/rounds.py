"""One re-planning round over the store: demand snapshots in, a stored plan (Coral or a baseline) out."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime, timezone

import pandas as pd

from coral_dagster.allocation.capacity import ATTAINMENT_WINDOW_S
from coral_dagster.allocation.inputs import scenario_problem, scenario_rates, scenario_traces
from coral_dagster.allocation.methods import make_plan
from coral_dagster.allocation.planner import with_admission
from coral_dagster.allocation.prepared import planning_templates
from coral_dagster.allocation.problem import AllocationProblem
from coral_dagster.allocation.storage import store_plan
from coral_dagster.app.closed_loop import held_plan
from coral_dagster.app.plans import find_plan
from coral_dagster.allocation.types import Plan
from coral_dagster.catalog.scenarios import Scenario
from coral_dagster.catalog.store import latest_snapshot
from coral_dagster.errors import CoralError
from coral_dagster.highs import DEFAULT_MAX_NODES, SAFETY_NET_S
from coral_dagster.store.duck import Store, newest_snapshot, write_frame
from coral_dagster.store.views import create_views
from coral_dagster.templates.library import load_library


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
    running = find_plan(store, scenario, method)
    demand_id, rates = latest_demand(store, scenario)
    snapshot = latest_snapshot(store, scenario)
    # Coral reads only what pruning keeps under the snapshot, stored once (`allocation.prepared`); the baselines
    # read the whole library.
    templates = (planning_templates(store, scenario, snapshot, [k[0] for k in running.counts()] if running else ())
                 if method == "coral" else load_library(store, scenario))
    if not templates:
        raise CoralError(f"no templates of scenario {scenario.name} are stored in {store.path}.",
                         "materialize `template_library` (every model partition) or run "
                         f"`coral templates build --scenario {scenario.name}`.")

    def problem_for(boost):
        return scenario_problem(scenario, templates, snapshot, rates=rates,
                                running=running.counts() if running else None, boost=boost)

    def make(boost):
        return with_admission(make_plan(problem_for(boost), method, scarcity_mode=scarcity,
                                        time_limit_s=time_limit_s, max_nodes=max_nodes), rates, scenario.models)

    problem = problem_for({})
    plan = held_plan(make, scenario, rates, loop=closed_loop, rounds=loop_rounds, window_s=loop_window_s)
    inputs = {"scenario_path": scenario.path, "demand_id": demand_id, "snapshot_id": problem.snapshot_id,
              "templates": len(templates),
              "running_plan": running.plan_id if running else None, "scarcity": scarcity,
              "closed_loop": closed_loop, "max_nodes": max_nodes, "time_limit_s": time_limit_s}
    plan = store_plan(store, plan, run_id or uuid.uuid4().hex, inputs)
    create_views(store)
    return PlanRound(plan.plan_id, plan, problem, demand_id)


def plan_by_model_region(plan: Plan) -> pd.DataFrame:
    """Instances, nodes, tokens/s and $/h per (model, phase, region): the table people read a plan by."""
    rows = [{"model": i.template.model, "phase": i.template.phase, "region": i.region, "nodes": str(i.template.nodes),
             "instances": i.count, "tokens_per_s": i.tokens_per_s, "usd_per_hour": i.count * i.usd_per_hour}
            for i in plan.instances]
    cols = ["model", "phase", "region", "nodes", "instances", "tokens_per_s", "usd_per_hour"]
    return pd.DataFrame(rows, columns=cols).sort_values(["model", "phase", "region", "nodes"]).reset_index(drop=True)


def store_model_templates(store: Store, scenario: Scenario, model: str, templates) -> int:
    """Replace one model's templates in the scenario's stored library (the others stay); returns its count."""
    from coral_dagster.templates.library import store_library

    others = [t for t in load_library(store, scenario) if t.model != model]
    store_library(store, others + list(templates), scenario)
    return len(templates)
