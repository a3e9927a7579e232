"""`coral simulate`: serve a plan in the event-driven simulator and report latency, SLO attainment and goodput."""

from __future__ import annotations

import click

from coral_dagster.app.simulation import TRAFFIC
from coral_dagster.cli._out import POSITIVE, SCENARIO_HELP, db_option, emit_json, emit_table, json_option
from coral_dagster.cli.types import prices_path_option
from coral_dagster.errors import CoralError
from coral_dagster.vocab import METHODS


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
@prices_path_option
@db_option
@json_option
def cli(scenario: str, plan_ref: str, method: str, fresh: bool, closed_loop: bool, traffic: str, gamma_cv: float,
        duration_s: float, seed: int, rate_scale: float, plots_dir: str | None, prices_path: str | None,
        db_path: str | None, as_json: bool) -> None:
    """Simulate a plan serving the scenario's traffic, request by request.

    Prints per model: SLO attainment (TTFT within the prefill SLO and mean TPOT within the decode SLO), goodput
    (tokens/s of requests that met both), TTFT / TPOT / end-to-end percentiles; and the plan's cost per million
    tokens. Deterministic for a seed.
    """
    from coral_dagster.app.simulation import plan_to_simulate, record_simulation, simulate, write_plots

    if rate_scale <= 0:
        raise CoralError(f"--rate-scale {rate_scale}.", "give a positive factor, e.g. 1 or 2.")
    given = click.get_current_context().get_parameter_source("scenario") is not click.core.ParameterSource.DEFAULT
    label, plan, scn, note = plan_to_simulate(plan_ref, scenario, method=method, fresh=fresh, closed_loop=closed_loop,
                                              scenario_given=given, db_path=db_path, prices_path=prices_path)
    if note:
        click.echo(f"note: {note}", err=True)
    result = simulate(plan, scn, trace=traffic, duration_s=duration_s, seed=seed, rate_scale=rate_scale,
                      gamma_cv=gamma_cv)
    plots = write_plots(result, plots_dir) if plots_dir else {}
    recorded = record_simulation(db_path, plan, scn, result, traffic)
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


simulate = cli
