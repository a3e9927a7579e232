"""Planning assets: demand from traces, the Coral allocation plan, and the baselines on the same inputs."""

import dagster as dg
from pydantic import Field

from coral_dagster.catalog.scenarios import load_scenario
from resources.solver import SolverSettings
from resources.store import CoralDuckDB

BASELINES = ("homo", "homo-ilp", "cauchy")


class DemandConfig(dg.Config):
    """Where demand comes from."""

    scenario: str = Field(default="core", description="Bundled scenario.")
    demand_mix: str = Field(default="uniform", description="uniform, large-heavy or small-heavy.")
    follow_trace: bool = Field(default=False, description="Scale rates by the traces' current 6-minute window.")


class PlanConfig(dg.Config):
    """How to plan."""

    scenario: str = Field(default="core", description="Bundled scenario.")
    scarcity: str = Field(default="", description="'' (fail when demand cannot be met), 'scale' or 'fair'.")


@dg.asset(group_name="planning", kinds={"duckdb", "python"}, deps=["catalogs"])
def demand(config: DemandConfig, duckdb: CoralDuckDB) -> dg.MaterializeResult:
    """Request rate per model (from the scenario and its traces), appended to `demand_snapshots`."""
    from coral_dagster.app.rounds import demand_rates, store_demand

    scenario = load_scenario(config.scenario)
    rates = demand_rates(scenario, config.demand_mix, config.follow_trace)
    demand_id = store_demand(duckdb.store(), scenario, rates, config.demand_mix)
    return dg.MaterializeResult(metadata={"demand_id": demand_id,
                                          "rate_req_s": dg.MetadataValue.json({m: round(r, 3) for m, r in rates.items()})})


@dg.asset(group_name="planning", kinds={"duckdb", "pulp"}, deps=["market_snapshot", "demand", "template_library"])
def allocation_plan(context: dg.AssetExecutionContext, config: PlanConfig, duckdb: CoralDuckDB,
                    solver: SolverSettings) -> dg.MaterializeResult:
    """The minimum-cost plan (templates × regions) meeting demand within availability, with churn priced in."""
    from coral_dagster.app.rounds import plan_by_model_region, plan_round
    from coral_dagster.plots import cost_over_time_png, markdown_image

    store = duckdb.store()
    rnd = plan_round(store, load_scenario(config.scenario), "coral", scarcity=config.scarcity or None,
                     time_limit_s=solver.time_limit_s, run_id=context.run_id)
    plan = rnd.plan
    history = store.query("SELECT * FROM plan_history WHERE scenario = ?", [plan.scenario])
    return dg.MaterializeResult(metadata={
        "plan_id": rnd.plan_id,
        "cost_usd_per_hour": dg.MetadataValue.float(round(plan.cost_usd_per_hour, 3)),
        "solver": dg.MetadataValue.json({"status": plan.status, "gap": plan.as_dict()["gap"],
                                         "lp_bound_usd_per_hour": plan.as_dict()["lp_bound_usd_per_hour"],
                                         "solve_s": round(plan.solve_s, 3), "demand_scale": plan.demand_scale}),
        "plan": dg.MetadataValue.md(plan_by_model_region(plan).round(2).to_markdown(index=False)),
        "cost_over_time": dg.MetadataValue.md(markdown_image(cost_over_time_png(history), "plan cost over time")),
    })


@dg.asset_check(asset=allocation_plan, description="The newest plan meets demand within availability.")
def plan_meets_demand(config: PlanConfig, duckdb: CoralDuckDB) -> dg.AssetCheckResult:
    from coral_dagster.allocation.check import plan_violations
    from coral_dagster.app.plans import latest_plan, plan_problem

    store = duckdb.store()
    plan = latest_plan(store, config.scenario)
    problems = plan_violations(plan, plan_problem(store, plan), require_demand=plan.status == "optimal")
    return dg.AssetCheckResult(passed=not problems, metadata={"violations": dg.MetadataValue.json(problems[:20])})


@dg.asset(group_name="planning", kinds={"duckdb", "pulp"}, deps=["allocation_plan"])
def baseline_plans(context: dg.AssetExecutionContext, config: PlanConfig, duckdb: CoralDuckDB,
                   solver: SolverSettings) -> dg.MaterializeResult:
    """Homo, Homo-ILP and Cauchy on exactly the inputs of the Coral plan, stored beside it."""
    from coral_dagster.app.plans import latest_plan
    from coral_dagster.app.rounds import plan_round
    from coral_dagster.plots import cost_by_model_png, markdown_image

    from coral_dagster.errors import InfeasibleError

    store, scenario = duckdb.store(), load_scenario(config.scenario)
    plans = {"coral": latest_plan(store, scenario.name)}
    failed = {}
    for method in BASELINES:
        try:
            plans[method] = plan_round(store, scenario, method, scarcity=config.scarcity or None,
                                       time_limit_s=solver.time_limit_s, run_id=context.run_id).plan
        except InfeasibleError as exc:  # a baseline that cannot serve the demand is a result, not a failure
            context.log.warning("%s: %s", method, exc)
            failed[method] = str(exc)
    coral = plans["coral"].cost_usd_per_hour
    table = "| method | $/h | × Coral | status |\n|---|---|---|---|\n" + "\n".join(
        [f"| {m} | {p.cost_usd_per_hour:,.2f} | {p.cost_usd_per_hour / coral:.2f} | {p.status} |"
         for m, p in plans.items()] + [f"| {m} | – | – | cannot meet demand |" for m in failed])
    return dg.MaterializeResult(metadata={
        "cost_vs_baselines": dg.MetadataValue.md(table),
        "infeasible": dg.MetadataValue.json(failed),
        "cost_by_model": dg.MetadataValue.md(markdown_image(cost_by_model_png(plans), "cost per model")),
    })
