"""`coral day`: run a scenario through a simulated day (re-plan, launch, serve) and report every window."""

from __future__ import annotations

import click

from coral_dagster.cli._out import POSITIVE, SCENARIO_HELP, FiniteFloat, db_option, emit_json, emit_table, json_option
from coral_dagster.cli.types import prices_path_option

METHOD_CHOICES = ("coral", "homo-ilp", "cauchy", "static-peak")
COLUMNS = ["window", "start_min", "demand_tokens_per_s", "served_share", "worst_attainment", "worst_model", "cost_usd",
           "nodes_launched", "nodes_stopped", "nodes_failed", "nodes_preempted", "mixed_share", "replan_s"]


@click.command("day")
@click.option("--scenario", default="core", show_default=True, help=f"Scenario to run through a day: {SCENARIO_HELP}.")
@click.option("--hours", type=POSITIVE, default=24.0, show_default=True,
              help="Hours to simulate from 0:00 UTC, in the scenario's re-plan windows.")
@click.option("--method", type=click.Choice(METHOD_CHOICES), default="coral", show_default=True,
              help="Who re-plans each window; static-peak runs one Coral plan sized for the day's peak all day.")
@click.option("--failure-rate", type=FiniteFloat(0.0, 1.0), default=0.0, show_default=True,
              help="Share of launches that fail at setup (seeded), besides the capacity errors of the market.")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Seed of the launch failures and of the arrivals --serve requests draws.")
@click.option("--serve", type=click.Choice(("fluid", "requests")), default="fluid", show_default=True,
              help="How each window's traffic is served: fluid (capacity up over time) or requests (the "
                   "event-driven simulator per segment between instances coming up and going; slower).")
@click.option("--sizing", type=click.Choice(("forecast", "window")), default="forecast", show_default=True,
              help="What each re-plan sizes capacity for: forecast (the last hour's peak rate carried along the "
                   "day's shape until what it launches is up) or window (the window's own rates, a snapshot plan).")
@click.option("--spot/--on-demand", default=None,
              help="Run every node sold on spot there, at its spot price, preemptible (taken back when a window's "
                   "supply falls below the spot nodes held, and at random at the day's preemptions_per_day); "
                   "default: the scenario's `day: spot` (on demand without one).")
@click.option("--keep-segments", is_flag=True, default=False,
              help="Also store each window's serving inputs (plan, segments, rates) in day_segments, to serve the "
                   "windows request by request apart, in parallel, as the day_window_served asset's partitions.")
@click.option("--plot", type=click.Path(dir_okay=False), default=None,
              help="Write the timeline (demand, capacity, cost, attainment) to this PNG file.")
@db_option
@prices_path_option
@json_option
def cli(scenario: str, hours: float, method: str, failure_rate: float, seed: int, serve: str, sizing: str,
        spot: bool | None, keep_segments: bool, plot: str | None, db_path: str | None, prices_path: str | None,
        as_json: bool) -> None:
    """Re-plan, launch and serve through a day in simulated time: per window the sensor's decision, the re-plan
    from the running plan, the reconciler on a simulated cloud (capacity per the market series, start-up time,
    failover) and the traffic served. The run and its windows are stored (`day_runs`, `day_windows`)."""
    import pandas as pd
    from rich.progress import Progress

    from coral_dagster.day.run import run_day, write_timeline

    with Progress(transient=True, disable=as_json) as bar:
        task = bar.add_task(f"{method} through the day", total=None)
        result = run_day(scenario, method, hours=hours, db_path=db_path, failure_rate=failure_rate, seed=seed,
                         serve=serve, sizing=sizing, prices_path=prices_path, keep_segments=keep_segments, spot=spot,
                         progress=lambda row: bar.update(task, advance=1, description=f"{method} window {row.window}"))
    if plot:
        write_timeline([result], plot)
    summary = result.as_dict()
    if as_json:
        emit_json(summary)
        return
    emit_table(pd.DataFrame(summary["windows"])[COLUMNS], f"{result.scenario}: {method}, {hours:g} h")
    worst = summary["worst_window"]
    click.echo(f"cost ${summary['cost_usd']:,.2f} (${summary['cost_usd_per_day']:,.2f} per day); "
               f"${summary['usd_per_million_slo_tokens']:,.4f} per million SLO-met tokens; served "
               f"{summary['served_share']:.1%}; worst window {worst['window']} ({worst['worst_model']} at "
               f"{worst['worst_attainment']:.1%}); longest re-plan {summary['max_replan_s']:.1f} s"
               + (f"; {summary['nodes_preempted']} nodes preempted" if summary["nodes_preempted"] else ""))
