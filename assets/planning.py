"""Planning assets: demand from traces, the Coral allocation plan, and the baselines on the same inputs."""

import dagster as dg
import pandas as pd
from pydantic import Field

from assets.metadata import frame_table, recorded_plan_id, row_count
from coral_dagster.allocation.capacity import ATTAINMENT_WINDOW_S
from resources.scenario import CoralScenario
from resources.solver import SolverSettings
from resources.store import CoralDuckDB

BASELINES = ("homo", "homo-ilp", "cauchy")


class DemandConfig(dg.Config):
    """Where demand comes from."""

    demand_mix: str = Field(default="uniform", description="uniform, large-heavy or small-heavy.")
    follow_trace: bool = Field(default=False, description="Scale rates by the traces' current 6-minute window.")


class PlanConfig(dg.Config):
    """How to plan."""

    scarcity: str = Field(default="", description="'' (fail when demand cannot be met), 'scale' or 'fair'.")
    closed_loop: bool = Field(default=True, description="Simulate the plan on each model's own trace and re-plan "
                              "with more capacity for models below their attainment target (Coral plan only).")
    loop_rounds: int = Field(default=3, description="Most plans the closed loop makes.")
    loop_window_s: float = Field(default=ATTAINMENT_WINDOW_S,
                                 description="Seconds of traffic per attainment window; each "
                                 "closed-loop round checks the worst window of every model's trace loop.")


@dg.asset(group_name="planning", kinds={"duckdb", "python"}, deps=["catalogs"])
def demand(config: DemandConfig, scenario: CoralScenario, duckdb: CoralDuckDB) -> dg.MaterializeResult:
    """Request rate per model (from the scenario and its traces), appended to `demand_snapshots`."""
    from coral_dagster.app.rounds import demand_rates, store_demand

    scn = scenario.load()
    rates = demand_rates(scn, config.demand_mix, config.follow_trace)
    demand_id = store_demand(duckdb.store(), scn, rates, config.demand_mix)
    rounded = {m: round(r, 3) for m, r in rates.items()}
    return dg.MaterializeResult(metadata={"demand_id": demand_id, "rate_req_s": dg.MetadataValue.json(rounded)})


@dg.asset(group_name="planning", kinds={"duckdb", "pulp"}, deps=["market_snapshot", "demand", "template_library"])
def allocation_plan(context: dg.AssetExecutionContext, config: PlanConfig, scenario: CoralScenario,
                    duckdb: CoralDuckDB, solver: SolverSettings) -> dg.MaterializeResult:
    """The minimum-cost plan (templates × regions) meeting demand within availability, with churn priced in."""
    from coral_dagster.app.rounds import plan_by_model_region, plan_round
    from coral_dagster.plots import cost_over_time_png, markdown_image

    store = duckdb.store()
    rnd = plan_round(store, scenario.load(), "coral", scarcity=config.scarcity or None,
                     time_limit_s=solver.time_limit_s, run_id=context.run.run_id, closed_loop=config.closed_loop,
                     loop_rounds=config.loop_rounds, loop_window_s=config.loop_window_s,
                     max_nodes=solver.max_nodes)
    plan = rnd.plan
    table = plan_by_model_region(plan).round(2)
    history = store.query("SELECT * FROM plan_history WHERE scenario_key = ?", [plan.scenario_key])
    return dg.MaterializeResult(metadata={
        "plan_id": rnd.plan_id,
        "status": plan.status,
        "cost_usd_per_hour": dg.MetadataValue.float(round(plan.cost_usd_per_hour, 3)),
        "churn_usd_per_hour": dg.MetadataValue.float(round(plan.churn_usd_per_hour, 3)),
        "gap": dg.MetadataValue.float(round(float(plan.gap), 6)),
        "mip_gap": dg.MetadataValue.float(round(float(plan.mip_gap), 6)),
        "lp_bound_usd_per_hour": dg.MetadataValue.float(round(float(plan.lp_bound_usd_per_hour), 3)),
        "solve_s": dg.MetadataValue.float(round(plan.solve_s, 3)),
        "demand_scale": dg.MetadataValue.float(plan.demand_scale),
        "plan": frame_table(table),
        **row_count(len(table)),
        "cost_over_time": dg.MetadataValue.md(markdown_image(cost_over_time_png(history), "plan cost over time")),
    })


@dg.asset_check(asset=allocation_plan, blocking=True,
                description="The plan just made meets demand within availability; a failure stops deployment.")
def plan_meets_demand(context: dg.AssetCheckExecutionContext, duckdb: CoralDuckDB) -> dg.AssetCheckResult:
    from coral_dagster.allocation.check import plan_violations
    from coral_dagster.allocation.storage import load_plan
    from coral_dagster.app.plans import plan_problem

    store = duckdb.store()
    plan = load_plan(store, recorded_plan_id(context, "allocation_plan"))
    problems = plan_violations(plan, plan_problem(store, plan), require_demand=plan.status == "optimal")
    what = f"{plan.method} plan {plan.plan_id} of {plan.scenario}"
    description = (f"{what} meets demand within availability." if not problems else
                   f"{what} breaks {len(problems)} constraint(s), first: {problems[0]}.")
    return dg.AssetCheckResult(passed=not problems, description=description, metadata={
        "plan_id": plan.plan_id, "violations": dg.MetadataValue.json(problems[:20])})


@dg.asset(group_name="planning", kinds={"duckdb", "pulp"}, deps=["allocation_plan"])
def baseline_plans(context: dg.AssetExecutionContext, config: PlanConfig, scenario: CoralScenario,
                   duckdb: CoralDuckDB, solver: SolverSettings) -> dg.MaterializeResult:
    """Homo, Homo-ILP and Cauchy on exactly the inputs of the Coral plan `allocation_plan` made, stored beside it."""
    from coral_dagster.allocation.storage import load_plan
    from coral_dagster.app.rounds import plan_round
    from coral_dagster.plots import cost_by_model_png, markdown_image

    from coral_dagster.errors import InfeasibleError

    store, scn = duckdb.store(), scenario.load()
    plans = {"coral": load_plan(store, recorded_plan_id(context, "allocation_plan"))}
    failed = {}
    for method in BASELINES:
        try:
            plans[method] = plan_round(store, scn, method, scarcity=config.scarcity or None,
                                       time_limit_s=solver.time_limit_s, run_id=context.run.run_id,
                                       max_nodes=solver.max_nodes).plan
        except InfeasibleError as exc:  # a baseline that cannot serve the demand is a result, not a failure
            context.log.warning("%s: %s", method, exc)
            failed[method] = str(exc)
    coral = plans["coral"].cost_usd_per_hour
    rows = [{"method": m, "plan_id": p.plan_id, "usd_per_hour": round(p.cost_usd_per_hour, 2),
             "x_coral": round(p.cost_usd_per_hour / coral, 3), "status": p.status} for m, p in plans.items()]
    rows += [{"method": m, "plan_id": "", "usd_per_hour": float("nan"), "x_coral": float("nan"),
              "status": "cannot meet demand"} for m in failed]
    return dg.MaterializeResult(metadata={
        "plan_id": plans["coral"].plan_id,
        "cost_vs_baselines": frame_table(pd.DataFrame(rows)),
        "infeasible": dg.MetadataValue.json(failed),
        **row_count(len(rows)),
        "cost_by_model": dg.MetadataValue.md(markdown_image(cost_by_model_png(plans), "cost per model")),
    })
