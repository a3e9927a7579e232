"""Automation: the re-plan job, a 6-minute schedule, and the sensor that re-plans when inputs change enough."""

import os

import dagster as dg

from resources.solver import SolverSettings
from resources.store import CoralDuckDB

SENSOR_SCENARIO = os.environ.get("CORAL_SCENARIO", "core")  # the scenario the sensor and schedules serve

REFRESH_ASSETS = ("market_snapshot", "demand")
REPLAN_ASSETS = ("allocation_plan", "plan_simulation", "deployment_specs")
#: The run tag the instance limits to one run in progress (`definitions.INSTANCE_YAML`): a re-plan can outlast
#: the 6-minute schedule, and two at once would plan against the same running plan.
REPLAN_TAG = {"coral/replan": "true"}
#: The run config naming the scenario, so a run's Launchpad shows what it plans for (`resources.CoralScenario`).
SCENARIO_RUN_CONFIG = {"resources": {"scenario": {"config": {"name": SENSOR_SCENARIO}}}}


refresh_inputs_job = dg.define_asset_job(
    "refresh_inputs", selection=dg.AssetSelection.assets(*REFRESH_ASSETS),
    description="Take a new price/availability snapshot and a new demand snapshot.")


replan_job = dg.define_asset_job(
    "replan", selection=dg.AssetSelection.assets(*REPLAN_ASSETS),
    description="Plan from the newest snapshot and demand, simulate the plan, and write its deployment.",
    tags=REPLAN_TAG)

refresh_inputs_schedule = dg.ScheduleDefinition(
    name="refresh_inputs_every_6_min", job=refresh_inputs_job, cron_schedule="*/6 * * * *",
    tags={"coral/scenario": SENSOR_SCENARIO}, run_config=SCENARIO_RUN_CONFIG,
    description="New market and demand snapshots every re-plan interval (the paper re-solves every 6 minutes).")

replan_schedule = dg.ScheduleDefinition(
    name="replan_every_6_min", job=replan_job, cron_schedule="3-59/6 * * * *",
    tags={"coral/scenario": SENSOR_SCENARIO}, run_config=SCENARIO_RUN_CONFIG,
    description="Re-plan every 6 minutes whatever changed (the sensor re-plans only when it pays).")


@dg.sensor(job=replan_job, minimum_interval_seconds=60, default_status=dg.DefaultSensorStatus.STOPPED,
           description="Re-plan when the newest snapshot or demand is no longer met by the plan, or when a new "
                       "plan would save more than the threshold after churn.")
def reallocation_sensor(context: dg.SensorEvaluationContext, duckdb: CoralDuckDB, solver: SolverSettings):
    from coral_dagster.errors import CoralError
    from coral_dagster.reallocation import evaluate

    try:
        key, decision = evaluate(duckdb.store(), SENSOR_SCENARIO, savings_threshold=solver.replan_savings_threshold,
                                 time_limit_s=min(solver.time_limit_s, 20.0), evaluated_key=context.cursor)
    except CoralError as exc:
        return dg.SkipReason(f"cannot evaluate yet: {exc}")
    if decision is None:
        return dg.SkipReason(f"inputs {key} already evaluated")
    context.update_cursor(key)
    if not decision.replan:
        return dg.SkipReason(f"plan still right for {key}")
    return dg.RunRequest(run_key=f"replan:{key}", run_config=SCENARIO_RUN_CONFIG,
                         tags={"coral/scenario": SENSOR_SCENARIO, "coral/reasons": "; ".join(decision.reasons)[:500]})

