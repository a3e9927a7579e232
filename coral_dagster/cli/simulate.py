"""`coral simulate`: serve a plan in the event-driven simulator and report latency, SLO attainment and goodput."""

from __future__ import annotations

from pathlib import Path

import click

from coral_dagster.vocab import METHODS
from coral_dagster.cli._out import POSITIVE, SCENARIO_HELP, db_option, emit_json, emit_table, json_option, prices_option
from coral_dagster.errors import CoralError
from coral_dagster.simulator.simulate import TRAFFIC


def _resolve_plan(plan_ref: str, method: str | None, fresh: bool, scenario: str, db_path: str | None,
                  scenario_given: bool, closed_loop: bool = True):
    """(label, Plan, Scenario): a fresh plan of --method made as `coral plan` makes it, or a stored plan (`latest`
    of the scenario and method, an id, or a JSON file), with the scenario whose traffic it serves: the one it was
    planned for unless --scenario names another (then a note says so)."""
    from coral_dagster.app.plans import plan_label, resolve_plan, scenario_of
    from coral_dagster.catalog.scenarios import load_scenario
    from coral_dagster.store import Store

    scn = load_scenario(scenario)
    if fresh:
        from coral_dagster.allocation.inputs import scenario_rates
        from coral_dagster.app.scenario_plans import plan_scenario
        from coral_dagster.app.closed_loop import held_plan

        plan = held_plan(lambda boost: plan_scenario(scn, method=method, db_path=db_path, boost=boost), scn,
                         scenario_rates(scn, "uniform"), loop=closed_loop and method != "helix")
        return f"fresh {method} plan (unstored)", plan, scn
    store = Store(db_path)
    plan = resolve_plan(store, plan_ref, scn, method)
    if plan.scenario_key and plan.scenario_key != scn.scenario_key:
        if not scenario_given:
            return plan_label(plan), plan, scenario_of(store, plan)
        click.echo(f"note: {plan_label(plan)} was planned for scenario {plan.scenario} with other settings; "
                   f"simulating it on {scn.ref}'s traffic as asked.", err=True)
    return plan_label(plan), plan, scn


@click.command("simulate")
@click.option("--scenario", default="core", show_default=True,
              help=f"Scenario giving models, SLOs, rates and links: {SCENARIO_HELP}.")
@click.option("--plan", "plan_ref", default="latest", show_default=True,
              help="'latest' (the scenario's newest plan of --method), a stored plan id, or a plan JSON file as "
                   "`coral plan --json` prints it.")
@click.option("--method", type=click.Choice(METHODS), default="coral", show_default=True,
              help="Which method's plan `latest` means (or --fresh plans with).")
@click.option("--fresh", is_flag=True, help="Instead of a stored plan, compute a new plan of --method now, as "
                                           "`coral plan` does.")
@click.option("--closed-loop/--no-closed-loop", default=True, show_default=True,
              help="With --fresh: keep each model's SLO attainment target by the closed loop, as `coral plan` "
                   "does; --no-closed-loop plans by the capacity rule alone.")
@click.option("--trace", "traffic", type=click.Choice(TRAFFIC), default="scenario", show_default=True,
              help="Arrivals: each model's own trace replayed at its rate, one trace for all, or Poisson / Gamma "
                   "arrivals with trace lengths.")
@click.option("--gamma-cv", type=POSITIVE, default=2.0, show_default=True,
              help="Coefficient of variation of Gamma inter-arrival gaps (burstiness; 1 is Poisson).")
@click.option("--duration-s", type=POSITIVE, default=600.0, show_default=True, help="Seconds of arrivals.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the arrival streams.")
@click.option("--rate-scale", type=POSITIVE, default=1.0, show_default=True,
              help="Multiply every model's request rate (2 = twice the planned demand).")
@click.option("--plots", "plots_dir", type=click.Path(file_okay=False), default=None,
              help="Write latency_cdf.png and goodput.png into this folder.")
@prices_option
@db_option
@json_option
def cli(scenario: str, plan_ref: str, method: str, fresh: bool, closed_loop: bool, traffic: str, gamma_cv: float,
        duration_s: float, seed: int, rate_scale: float, plots_dir: str | None, db_path: str | None,
        as_json: bool) -> None:
    """Simulate a plan serving the scenario's traffic, request by request.

    Prints per model: SLO attainment (TTFT within the prefill SLO and mean TPOT within the decode SLO), goodput
    (tokens/s of requests that met both), TTFT / TPOT / end-to-end percentiles; and the plan's cost per million
    tokens. Deterministic for a seed.
    """
    from coral_dagster.simulator import simulate_plan

    if rate_scale <= 0:
        raise CoralError(f"--rate-scale {rate_scale}.", "give a positive factor, e.g. 1 or 2.")
    given = click.get_current_context().get_parameter_source("scenario") is not click.core.ParameterSource.DEFAULT
    label, plan, scn = _resolve_plan(plan_ref, method, fresh, scenario, db_path, given, closed_loop)
    result = simulate_plan(plan, scn, trace=traffic, duration_s=duration_s, seed=seed, rate_scale=rate_scale,
                           gamma_cv=gamma_cv)
    plots = {}
    if plots_dir:
        from coral_dagster.simulator.plots import plot_goodput, plot_latency_cdf

        out = Path(plots_dir)
        out.mkdir(parents=True, exist_ok=True)
        plots = {"latency_cdf": str(plot_latency_cdf(result, out / "latency_cdf.png")),
                 "goodput": str(plot_goodput(result, out / "goodput.png"))}
    recorded = _record(db_path, plan, scn, result, traffic)
    summary = {"plan": label, "plan_id": plan.plan_id or None, **result.summary(), "plots": plots,
               "recorded": recorded}
    if as_json:
        emit_json(summary)
        return
    cols = ["model", "arrivals", "attainment", "goodput_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms",
            "tpot_p99_ms", "e2e_p50_ms", "e2e_p99_ms", "mean_busy_fraction"]
    emit_table(result.by_model[cols], title=f"{scn.ref}: {label}, {result.arrivals} "
                                            f"x{rate_scale:g}, {duration_s:g} s")
    c = result.counts
    click.echo(f"attainment {result.attainment:.2%}, goodput {result.goodput_tokens_per_s:,.0f} tokens/s, "
               f"cost {result.cost_usd_per_hour:,.2f} $/h = {result.usd_per_million_tokens:,.3f} $ per million "
               f"tokens; {c['completed']:,} of {c['arrivals']:,} requests completed; simulated in "
               f"{result.wall_s:.1f} s ({result.events:,} events)")
    for name, path in plots.items():
        click.echo(f"{name}: {path}")
    click.echo(recorded)


def _record(db_path: str | None, plan, scn, result, traffic: str) -> str:
    """Append the simulation to the store's `simulations` when it is the stored plan serving its own scenario's
    traces (what the plan's SLO attainment means); says where it went, or why it was not recorded."""
    from coral_dagster.app.simulation import store_simulation
    from coral_dagster.store import Store

    if not plan.plan_id or plan.plan_id.startswith("file-"):
        return "not recorded: the plan is not stored"
    if traffic != "scenario" or plan.scenario_key and plan.scenario_key != scn.scenario_key:
        return "not recorded: only a plan serving its own scenario's traces is recorded"
    store = Store(db_path)
    store_simulation(store, plan.plan_id, result, {m.model: m.attainment_target for m in scn.models})
    return f"recorded in {store.path} (table simulations, plan {plan.plan_id})"


simulate = cli
