"""A simulated day's windows served request by request, one time-window partition per re-plan window, so a backfill
serves them in parallel runs: each from the plan and segments the day loop fixed (`coral day --keep-segments`)."""

from datetime import timedelta

import dagster as dg
from pydantic import Field

from assets.metadata import frame_table, row_count
from coral_dagster.day.loop import DAY_START
from coral_dagster.errors import CoralError
from resources.scenario import CoralScenario
from resources.store import CoralDuckDB

#: The re-plan interval of every bundled scenario: one partition per window of a day run at it.
WINDOW_MIN = 6
#: Partitions cover a week from the day's start, the longest day `coral day --hours` runs.
DAY_HOURS = 24 * 7
PARTITION_FMT = "%Y-%m-%d-%H:%M"

day_window_partitions = dg.TimeWindowPartitionsDefinition(
    start=DAY_START, end=DAY_START + timedelta(hours=DAY_HOURS), cron_schedule=f"*/{WINDOW_MIN} * * * *",
    fmt=PARTITION_FMT, timezone="UTC")


class DayWindowConfig(dg.Config):
    """Which stored day run's windows are served."""

    run_id: str = Field(default="", description="A `day_runs` run that kept its windows' serving inputs "
                                                "(`coral day --keep-segments`); empty: the newest such run.")


def partition_window(partition_key: str) -> int:
    """The window number of a partition: its start's minutes from the day's start over the window length."""
    start = day_window_partitions.time_window_for_partition_key(partition_key).start
    return int((start - DAY_START).total_seconds() // (WINDOW_MIN * 60))


@dg.asset(group_name="simulation", kinds={"duckdb", "python"}, partitions_def=day_window_partitions)
def day_window_served(context: dg.AssetExecutionContext, config: DayWindowConfig, duckdb: CoralDuckDB,
                      scenario: CoralScenario) -> dg.MaterializeResult:
    """One window of a stored day run served request by request (offered, shed, SLO-met requests and tokens per
    model), from the plan, segments and rates the run kept; written to `day_window_served`, replacing that
    (run, window)'s rows."""
    from coral_dagster.day.windows import kept_run_id, read_inputs, store_served

    store = duckdb.store()
    run_id = config.run_id or kept_run_id(store)
    window = partition_window(context.partition_key)
    run = store.query("SELECT scenario, scenario_key, replan_interval_min FROM day_runs WHERE run_id = ?", [run_id])
    scn = scenario.load()
    if not run.empty and float(run.replan_interval_min.iloc[0]) != WINDOW_MIN:
        raise CoralError(f"day run {run_id!r} re-planned every {run.replan_interval_min.iloc[0]:g} minutes; the "
                         f"partitions of day_window_served are {WINDOW_MIN}-minute windows.",
                         f"serve a day of a scenario re-planning every {WINDOW_MIN} minutes, or that run with "
                         "`coral day --serve requests`.")
    if not run.empty and str(run.scenario_key.iloc[0]) != scn.scenario_key:
        raise CoralError(f"day run {run_id!r} was a day of scenario {run.scenario.iloc[0]!r}; the scenario resource "
                         f"is {scn.ref!r} (other contents).",
                         "set the scenario resource to the run's scenario (run config resources.scenario.config.name),"
                         " or pick a run of this scenario.")
    inputs = read_inputs(store, run_id, window)
    serving = inputs.serve(scn)
    rows = store_served(store, run_id, window, serving)
    offered = int(rows.offered.sum())
    return dg.MaterializeResult(metadata={
        "run_id": run_id, "window": window,
        "attainment": dg.MetadataValue.float(round(float(rows.met.sum()) / offered if offered else 1.0, 4)),
        "shed_share": dg.MetadataValue.float(round(float(rows.shed.sum()) / offered if offered else 0.0, 4)),
        "offered_requests": dg.MetadataValue.int(offered),
        "wall_s": dg.MetadataValue.float(round(serving.wall_s, 2)),
        "by_model": frame_table(rows.drop(columns=["run_id", "served_at"]).round(4)),
        **row_count(len(rows)),
    })
