"""`coral run`: the main job — materialize the whole Dagster pipeline on the embedded DuckDB and print a summary."""

from __future__ import annotations

import sys

import click
import pandas as pd

from coral_dagster.cli._out import POSITIVE, FiniteFloat, db_option, emit_json, emit_table, json_option
from coral_dagster.cli.types import prices_path_option

# The pipeline's template library is partitioned by the bundled scenarios' models, so it runs those only.
STEP_BY_STEP = ("run a scenario file step by step instead: `coral templates build --scenario FILE`, then `coral plan "
                "--scenario FILE` and `coral simulate --scenario FILE`")


def _bundled(ctx: click.Context, param: click.Parameter, value: str) -> str:
    from coral_dagster.app.plans import scenario_names

    if value not in scenario_names():
        raise click.BadParameter(f"{value!r} is not a bundled scenario ({', '.join(scenario_names())}), the only "
                                 f"ones the pipeline runs; {STEP_BY_STEP}.", ctx, param)
    return value


@click.command()
@click.option("--scenario", default="core", show_default=True, callback=_bundled,
              help="Bundled scenario to run: core, core-uniform, extended, helix or mega (the pipeline's template "
                   f"library is partitioned by their models; {STEP_BY_STEP}).")
@click.option("--simulate-s", "simulate_s", type=POSITIVE, default=120.0, show_default=True,
              help="Seconds of traffic to simulate.")
@click.option("--attainment-target", "attainment_target", type=FiniteFloat(0.0, 1.0), default=0.95,
              show_default=True, help="SLO attainment every model must reach in simulation before deployment.")
@click.option("--closed-loop/--no-closed-loop", default=True, show_default=True,
              help="Simulate the Coral plan on each model's own trace and re-plan with more capacity for models "
                   "below target (at most 3 plans).")
@click.option("--rebuild-templates", is_flag=True,
              help="Build every model's templates again, even where the DuckDB file holds them for the same inputs "
                   "(same models, nodes, data files and T̂ rule: the library key), which a run otherwise keeps.")
@prices_path_option
@db_option
@json_option
@click.pass_context
def cli(ctx: click.Context, scenario: str, simulate_s: float, attainment_target: float, closed_loop: bool,
        rebuild_templates: bool, prices_path: str | None, db_path: str | None, as_json: bool) -> None:
    """Run the pipeline end to end on the bundled data and print a summary.

    Materializes, in the Dagster code location, every asset: catalogs → market snapshot → profiles → demand →
    template library (one partition per model of the scenario; kept where already stored for the same inputs) →
    allocation plan → baselines → simulation → deployment specs (SkyPilot dry run), with their checks. Everything
    lands in the DuckDB file, and the runs in the Dagster instance at $DAGSTER_HOME (default: the project's
    .dagster/), so `dagster dev` started with the same DAGSTER_HOME shows them. Exits 1 when a check fails (a
    failed blocking check also stops deployment).
    """
    from coral_dagster.app.plans import Store, load_plan
    from coral_dagster.definitions import dagster_home, materialize_pipeline

    verbose = bool(ctx.find_root().params.get("verbose"))
    check_dagster_home(dagster_home())
    result = materialize_pipeline(scenario, simulate_s=simulate_s, attainment_target=attainment_target,
                                  closed_loop=closed_loop, db_path=db_path, prices_path=prices_path,
                                  reuse_templates=not rebuild_templates,
                                  log_level="INFO" if verbose else "CRITICAL",
                                  on_step=lambda step: click.echo(f"materialize: {step}", err=True))
    store = Store(db_path)
    plan_id = result.metadata["allocation_plan"]["plan_id"].value  # the plan this run made
    if not isinstance(plan_id, str):
        raise RuntimeError(f"the allocation_plan asset recorded plan_id {plan_id!r}, not a plan id")
    plan = load_plan(store, plan_id)
    summary = run_summary(store, plan, result)
    if as_json:
        emit_json(summary)
    else:
        click.echo(f"DuckDB: {store.path}   Dagster runs: {dagster_home()} "
                   f"(`DAGSTER_HOME={dagster_home()} dagster dev` shows them)")
        print_summary(summary, plan, simulate_s)
    if result.failed_checks:
        sys.exit(1)


def check_dagster_home(home) -> None:
    """Refuse, before any work, a $DAGSTER_HOME that is not a folder or whose dagster.yaml Dagster cannot read:
    one sentence with the fix instead of Dagster's traceback."""
    import dagster as dg
    import yaml

    from coral_dagster.errors import CoralError
    from coral_dagster.app.documents import make_dir

    fix = "point DAGSTER_HOME at a folder (made when missing), or unset it to use the project's .dagster/"
    if home.exists() and not home.is_dir():
        raise CoralError(f"DAGSTER_HOME {home} is not a folder.", fix)
    make_dir(home, fix)
    config = home / "dagster.yaml"
    if not config.exists():
        return
    try:
        dg.DagsterInstance.from_config(str(home)).dispose()
    except (dg.DagsterError, yaml.YAMLError, OSError) as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
        detail = next((line for line in lines if line.startswith("Error 1:")), lines[0]).split(" Expected:")[0]
        mark = getattr(exc, "problem_mark", None)
        if mark is not None:
            detail = f"{getattr(exc, 'problem', None) or detail}, line {mark.line + 1}, column {mark.column + 1}"
        raise CoralError(f"Dagster cannot read its instance configuration {config} ({detail[:200]}).",
                         f"correct or delete that file (`coral run` then writes its own), or {fix}") from None


def run_summary(store, plan, result) -> dict:
    """What a person reads after `coral run`: the plan, the comparison to the previous one and to the baselines,
    the simulation, and every check as a sentence."""
    from coral_dagster.app.documents import plan_to_doc
    from coral_dagster.app.simulation import plan_simulation

    baselines = result.metadata.get("baseline_plans", {})
    table = baselines.get("cost_vs_baselines")
    infeasible = baselines["infeasible"].value if "infeasible" in baselines else {}
    return {
        "scenario": plan.scenario, "method": plan.method, "plan_id": plan.plan_id, "plan": plan_to_doc(plan),
        "previous": previous_plan(store, plan),
        "baselines": [r.data for r in table.records] if table is not None else None,
        "cannot_meet_demand": {m: str(reason).split(" Fix: ")[0] for m, reason in infeasible.items()},
        "simulation": plan_simulation(store, plan.plan_id)[["model", "attainment", "attainment_target",
                                                             "goodput_tokens_per_s"]].to_dict(orient="records")
        if "plan_simulation" in result.metadata else [],
        "checks": [{"asset": c.asset_key.to_user_string(), "check": c.check_name, "passed": c.passed,
                    "sentence": check_sentence(c)} for c in result.checks],
        "not_materialized": result.not_materialized,
        "dagster_run_ids": list(result.run_ids),
    }


def previous_plan(store, plan) -> dict | None:
    """The scenario's previous plan of the same method, and how this one differs from it (from `plan_diff`)."""
    history = store.query("SELECT plan_id, cost_usd_per_hour FROM plan_history WHERE scenario_key = ? AND method = ? "
                          "AND plan_id <> ? AND created_at <= (SELECT created_at FROM plans WHERE plan_id = ?) "
                          "ORDER BY seq DESC LIMIT 1", [plan.scenario_key, plan.method, plan.plan_id, plan.plan_id])
    if history.empty:
        return None
    diff = store.query("SELECT delta FROM plan_diff WHERE plan_id = ?", [plan.plan_id])["delta"]
    return {"plan_id": str(history["plan_id"].iloc[0]),
            "cost_usd_per_hour": float(history["cost_usd_per_hour"].iloc[0]),
            "instances_launched": int(diff[diff > 0].sum()), "instances_removed": int(-diff[diff < 0].sum())}


def check_sentence(check) -> str:
    """A check's outcome as a sentence: the description the check wrote, else its name and verdict."""
    if check.description:
        return check.description[0].upper() + check.description[1:]
    return f"{check.check_name} on {check.asset_key.to_user_string()} {'passed' if check.passed else 'failed'}."


def churn_sentence(summary: dict) -> str:
    """How this plan compares with the previous plan of the same scenario and method, churn included."""
    plan, prev = summary["plan"], summary["previous"]
    label = f"{plan['method']} plan of {plan['scenario']}"
    if prev is None:
        return f"This is the first {label}: nothing to compare with, so no churn is priced."
    cost, before = plan["cost_usd_per_hour"], prev["cost_usd_per_hour"]
    change = (f"costs the same (${cost:,.2f}/h)" if abs(cost - before) < 0.005 else
              f"costs ${cost:,.2f}/h against ${before:,.2f}/h ({cost - before:+,.2f} $/h, {cost / before - 1:+.1%})")
    if not (prev["instances_launched"] or prev["instances_removed"]):
        return f"Against the previous {label} ({prev['plan_id']}), this one {change} and keeps every instance."
    return (f"Against the previous {label} ({prev['plan_id']}), this one {change}, launches "
            f"{prev['instances_launched']:,} instance(s) and removes {prev['instances_removed']:,}; launching is "
            f"priced as churn (${plan['churn_usd_per_hour']:,.2f}/h in the objective, not in the cost), so a plan "
            "may keep a running instance a fresh plan would not choose.")


def print_summary(summary: dict, plan, simulate_s: float) -> None:
    """The summary as tables and sentences."""
    from coral_dagster.app.plans import plan_label
    from coral_dagster.app.rounds import plan_by_model_region

    header = f"{plan.scenario}: {plan_label(plan)}"
    emit_table(plan_by_model_region(plan).round(2), title=(
        f"{header} — {plan.status}, ${plan.cost_usd_per_hour:,.2f}/h, gap to LP {plan.gap:.2%}, "
        f"to MIP bound {plan.mip_gap:.2%}, solved in {plan.solve_s:,.2f} s"))
    click.echo(churn_sentence(summary))
    if summary["baselines"] is not None:
        emit_table(pd.DataFrame(summary["baselines"]), title=f"{header}: cost by method ($/h, × Coral)")
        for method, reason in summary["cannot_meet_demand"].items():
            click.echo(reason if reason.startswith(method) else f"{method} cannot meet demand: {reason}")
    if summary["simulation"]:
        sim = pd.DataFrame(summary["simulation"])
        emit_table(sim, title=f"{header}: simulated {simulate_s:,g} s of traffic")
    for check in summary["checks"]:
        if not check["passed"]:
            click.echo(f"check failed ({check['asset']} / {check['check']}): {check['sentence']}")
    if summary["not_materialized"]:
        click.echo(f"Not materialized, stopped by a failed blocking check: {', '.join(summary['not_materialized'])}.")
    passed = sum(c["passed"] for c in summary["checks"])
    click.echo(f"{passed} of {len(summary['checks'])} checks passed.")
