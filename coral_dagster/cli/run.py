"""`coral run`: the main job — materialize the whole Dagster pipeline on the embedded DuckDB and print the plan."""

from __future__ import annotations

import os

import click

from coral_dagster.cli._out import POSITIVE, SCENARIO_HELP, db_option, emit_json, emit_table, json_option, prices_option


@click.command()
@click.option("--scenario", default="core", show_default=True, help=f"Scenario to run: {SCENARIO_HELP}.")
@click.option("--simulate-s", "simulate_s", type=POSITIVE, default=120.0, show_default=True,
              help="Seconds of traffic to simulate.")
@prices_option
@db_option
@json_option
def cli(scenario: str, simulate_s: float, db_path: str | None, as_json: bool) -> None:
    """Run the pipeline end to end on the bundled data and print a summary.

    Materializes, in the Dagster code location, every asset: catalogs → market snapshot → profiles → demand →
    template library (one partition per model) → allocation plan → baselines → simulation → deployment specs
    (SkyPilot dry run), with their checks. Everything lands in the DuckDB file; `dagster dev` shows the same
    assets and their history.
    """
    if db_path:
        os.environ["CORAL_DB"] = str(db_path)
    from coral_dagster.app.plans import latest_plan
    from coral_dagster.catalog.scenarios import load_scenario
    from coral_dagster.definitions import materialize_pipeline
    from coral_dagster.app.rounds import plan_by_model_region
    from coral_dagster.store import Store

    sc = load_scenario(scenario)
    checks = materialize_pipeline(scenario, simulate_s=simulate_s,
                                  on_step=lambda step: click.echo(f"materialize: {step}", err=True))
    for check in checks:
        if not check.passed:
            click.echo(f"check failed: {check.asset_key.to_user_string()} {check.check_name}: {check.metadata}",
                       err=True)

    store = Store()
    history = store.query("SELECT * FROM plan_history WHERE scenario = ? ORDER BY created_at DESC", [scenario])
    latest = history.groupby("method").head(1).set_index("method")
    plan = latest_plan(store, scenario)
    sim = store.query("SELECT model, attainment, goodput_tokens_per_s FROM simulations WHERE plan_id = ? "
                      "ORDER BY simulated_at DESC, model LIMIT ?", [latest.loc["coral", "plan_id"], len(sc.models)])
    summary = {"db": str(store.path), "scenario": scenario, "plan": plan.as_dict(),
               "cost_usd_per_hour": latest["cost_usd_per_hour"].to_dict(),
               "simulation": sim.to_dict(orient="records")}
    if as_json:
        emit_json(summary)
        return
    click.echo(f"DuckDB: {store.path}")
    emit_table(plan_by_model_region(plan).round(2), title=f"{scenario}: Coral plan ({plan.status}, "
               f"${plan.cost_usd_per_hour:,.2f}/h, gap to LP {plan.gap:.2%}, to MIP bound {plan.mip_gap:.2%}, "
               f"solved in {plan.solve_s:.2f}s)")
    costs = latest[["cost_usd_per_hour", "status"]].reset_index()
    costs["x_coral"] = costs["cost_usd_per_hour"] / latest.loc["coral", "cost_usd_per_hour"]
    emit_table(costs.round(3), title="cost by method ($/h)")
    emit_table(sim.round(3), title=f"simulated {simulate_s:g}s of traffic")
