"""Making a plan: the one way `coral plan`, `coral simulate --fresh` and the Dagster re-planning rounds plan."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Mapping, cast

from coral_dagster.highs import DEFAULT_MAX_NODES as DEFAULT_MAX_NODES, SAFETY_NET_S as SAFETY_NET_S

if TYPE_CHECKING:
    from coral_dagster.allocation.types import Plan, Scarcity
    from coral_dagster.catalog.scenarios import Scenario
    from coral_dagster.store.duck import Store

#: The fields of the `inputs_json` every stored plan records (`plan_inputs`); rows written before 2026-12-06 by a
#: re-planning round named the running plan `running_plan`, and those by `coral plan` wrote scarcity `none`.
INPUT_FIELDS = ("scenario", "scenario_path", "method", "engine", "t_hat_rule", "availability_scale", "demand_mix",
                "demand_id", "snapshot_id", "templates", "running", "scarcity", "time_limit_s", "max_nodes",
                "closed_loop", "prices_path")


@dataclass(frozen=True)
class PlanRequest:
    """What to plan and how: every option `coral plan`, `coral simulate --fresh` and the re-planning assets take.

    `from_store` plans from the store's newest market and demand snapshots and its stored library (the Dagster
    rounds; churn priced against the scenario's newest plan of `method`); otherwise from the scenario's market
    (prices from `prices_path` when given) and its rates under `demand_mix`, building the library when the store
    lacks it, with churn priced against the plan `running` names (`latest`, an id or a plan file). The closed loop
    makes at most `loop_rounds` plans, each checked over windows of `loop_window_s` seconds (None:
    `allocation.capacity.ATTAINMENT_WINDOW_S`)."""

    scenario: str | Scenario
    method: str = "coral"
    scarcity: str | None = None
    availability_scale: float = 1.0
    demand_mix: str = "uniform"
    t_hat_rule: str | None = None
    engine: str | None = None
    max_nodes: int | None = DEFAULT_MAX_NODES
    time_limit_s: float = SAFETY_NET_S
    closed_loop: bool = True
    loop_rounds: int = 3
    loop_window_s: float | None = None
    running: str | None = None
    db_path: str | None = None
    prices_path: str | None = None
    from_store: bool = False
    save: bool = False
    run_id: str | None = None


@dataclass(frozen=True)
class MadePlan:
    """A plan and what it was made from: its scenario (as planned), the allocation problem of its first round (of a
    plan made from the store, which the round's checks read; else None) and the `inputs_json` it is (or would be)
    stored with."""

    plan: Plan
    scenario: Scenario
    problem: Any
    inputs: Mapping[str, Any]


def request_scenario(request: PlanRequest) -> Scenario:
    """The request's scenario with its T̂ rule and serving engine as asked (None: the scenario's own)."""
    from coral_dagster.catalog.scenarios import load_scenario

    scn = load_scenario(request.scenario) if isinstance(request.scenario, str) else request.scenario
    return replace(scn, t_hat_rule=request.t_hat_rule or scn.t_hat_rule, engine=request.engine or scn.engine)


def make_plan(request: PlanRequest, store: Store | None = None) -> MadePlan:
    """The plan `request` asks for: sized by the capacity rule, then, with `closed_loop` (not Helix), the closed
    loop's choice (`app.closed_loop.held_plan`); stored with its inputs when `request.save`. A failure stores
    nothing. `store` is the DuckDB store to read and write (default: the file `request.db_path` names)."""
    from coral_dagster.allocation.capacity import ATTAINMENT_WINDOW_S
    from coral_dagster.allocation.inputs import scenario_problem
    from coral_dagster.app.closed_loop import held_plan
    from coral_dagster.store.duck import Store

    scn = request_scenario(request)
    store = store or Store(request.db_path)
    running = _running(store, request, scn)
    market, rates, templates, demand_id = _sources(store, request, scn, running)

    def make(boost):
        return solve_once(scn, request.method, templates, market, rates, running=running, scarcity=request.scarcity,
                          time_limit_s=request.time_limit_s, max_nodes=request.max_nodes, boost=boost)

    plan = held_plan(make, scn, rates, loop=request.closed_loop and request.method != "helix",
                     rounds=request.loop_rounds,
                     window_s=ATTAINMENT_WINDOW_S if request.loop_window_s is None else request.loop_window_s)
    inputs = plan_inputs(request, scn, plan.snapshot_id, demand_id, len(templates) if request.from_store else None,
                         running)
    if request.save:
        plan = _store(store, request, plan, market, inputs)
    problem = scenario_problem(scn, templates, market, rates=rates, running=running.counts() if running else None,
                               boost={}) if request.from_store and request.method != "helix" else None
    return MadePlan(plan, scn, problem, inputs)


def solve_once(scn: Scenario, method: str, templates, market, rates: Mapping[str, float], *,
               running: Plan | None = None, scarcity: str | None = None, time_limit_s: float = SAFETY_NET_S,
               max_nodes: int | None = DEFAULT_MAX_NODES, boost: Mapping[str, float] | None = None,
               burst_aware: bool = True) -> Plan:
    """One solve of `method` on the scenario's problem (templates, market, request rates, the running plan, each
    model's capacity factor times `boost`), each model admitting only the rate its plan serves; Helix ignores the
    templates, rates and running plan (it places one model on the whole cluster)."""
    from coral_dagster.allocation.inputs import scenario_problem
    from coral_dagster.allocation.methods import make_plan as solve
    from coral_dagster.allocation.planner import with_admission

    if method == "helix":
        from coral_dagster.allocation.helix import helix_plan

        return helix_plan(scn, time_limit_s=time_limit_s, market=market)[0]
    problem = scenario_problem(scn, templates, market, rates=rates, running=running.counts() if running else None,
                               boost=boost, burst_aware=burst_aware)
    plan = solve(problem, method, scarcity_mode=cast("Scarcity | None", scarcity), time_limit_s=time_limit_s,
                 max_nodes=max_nodes)
    return with_admission(plan, rates, scn.models)


def _running(store: Store, request: PlanRequest, scn: Scenario) -> Plan | None:
    """The plan live now, whose churn the new plan pays: the scenario's newest of the method (rounds), or the one
    the request names."""
    from coral_dagster.app.plans import find_plan, resolve_plan

    if request.from_store:
        return find_plan(store, scn, request.method)
    if not request.running:
        return None
    from coral_dagster.app.prices import price_table

    return resolve_plan(store, request.running, request.scenario, request.method, price_table(request.prices_path))


def _sources(store: Store, request: PlanRequest, scn: Scenario, running: Plan | None):
    """(market, request rate per model, templates, demand_id): the store's newest snapshots and stored library,
    or the scenario's market and rates and its library (built when the store lacks it)."""
    from coral_dagster.allocation.inputs import scenario_rates
    from coral_dagster.app.scenario_plans import library_templates

    if not request.from_store:
        from coral_dagster.app.prices import price_table

        market = scn.market(availability_scale=request.availability_scale, prices=price_table(request.prices_path))
        templates = () if request.method == "helix" else library_templates(scn, request.db_path)
        return market, scenario_rates(scn, request.demand_mix), templates, None
    from coral_dagster.allocation.prepared import planning_templates
    from coral_dagster.app.rounds import latest_demand
    from coral_dagster.catalog.store import latest_snapshot
    from coral_dagster.errors import CoralError
    from coral_dagster.templates.library import load_library

    demand_id, rates = latest_demand(store, scn)
    market = latest_snapshot(store, scn)
    # Coral reads only what pruning keeps under the snapshot, stored once (`allocation.prepared`); the baselines
    # read the whole library.
    templates = (planning_templates(store, scn, market, [k[0] for k in running.counts()] if running else ())
                 if request.method == "coral" else tuple(load_library(store, scn)))
    if not templates:
        raise CoralError(f"no templates of scenario {scn.name} are stored in {store.path}.",
                         "materialize `template_library` (every model partition) or run "
                         f"`coral templates build --scenario {scn.name}`.")
    return market, rates, templates, demand_id


def plan_inputs(request: PlanRequest, scn: Scenario, snapshot_id: str, demand_id: str | None,
                templates: int | None, running: Plan | None) -> dict[str, Any]:
    """The `inputs_json` of a plan: what it was asked for and made from (INPUT_FIELDS, one shape for every way of
    planning)."""
    return {"scenario": request.scenario if isinstance(request.scenario, str) else scn.ref,
            "scenario_path": scn.path, "method": request.method, "engine": scn.engine, "t_hat_rule": scn.t_hat_rule,
            "availability_scale": request.availability_scale, "demand_mix": request.demand_mix,
            "demand_id": demand_id, "snapshot_id": snapshot_id, "templates": templates,
            "running": running.plan_id if running else None, "scarcity": request.scarcity,
            "time_limit_s": request.time_limit_s, "max_nodes": request.max_nodes, "closed_loop": request.closed_loop,
            "prices_path": request.prices_path}


def read_inputs(raw: Mapping[str, Any]) -> dict[str, Any]:
    """A stored `inputs_json` in the shape `plan_inputs` writes, old rows included (their missing fields None)."""
    out = dict(raw)
    if "running_plan" in out:
        out.setdefault("running", out.pop("running_plan"))
    if out.get("scarcity") == "none":
        out["scarcity"] = None
    return {**{k: None for k in INPUT_FIELDS}, **out}


def _store(store: Store, request: PlanRequest, plan: Plan, market, inputs: Mapping[str, Any]) -> Plan:
    """Write the plan (and the market snapshot it was made on, when the store lacks it) in one go."""
    from coral_dagster.allocation.storage import store_plan
    from coral_dagster.catalog.store import append_snapshot

    if not request.from_store and plan.snapshot_id == market.snapshot_id:
        append_snapshot(store, market)
    run_id = request.run_id or (uuid.uuid4().hex if request.from_store else f"cli-{uuid.uuid4().hex[:12]}")
    return store_plan(store, plan, run_id, inputs)
