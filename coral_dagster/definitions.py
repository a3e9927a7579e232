"""The one Dagster `Definitions` of the Coral code location: assets, checks, resources, sensors and schedules."""

from __future__ import annotations

import os

import dagster as dg

from assets import automation, catalog, deployment, market, planning, profiling, simulation, templates
from coral_dagster.errors import CoralError
from coral_dagster.paths import default_db_path
from resources import BundledMarketFeed, CoralDuckDB, SkyPilotLauncher, SolverSettings

ASSET_MODULES = [catalog, market, profiling, templates, planning, simulation, deployment]


def _database() -> str | dg.EnvVar:
    """`$CORAL_DB` when set (read through `dg.EnvVar`, so the UI shows where it came from), else the bundled file."""
    return dg.EnvVar("CORAL_DB") if os.environ.get("CORAL_DB") else str(default_db_path())


RESOURCES = {
    "duckdb": CoralDuckDB(database=_database()),
    "market": BundledMarketFeed(),
    "solver": SolverSettings(),
    "launcher": SkyPilotLauncher(),
}

defs = dg.Definitions(
    assets=dg.load_assets_from_modules(ASSET_MODULES),
    asset_checks=dg.load_asset_checks_from_modules(ASSET_MODULES),
    jobs=[automation.refresh_inputs_job, automation.replan_job],
    schedules=[automation.refresh_inputs_schedule, automation.replan_schedule],
    sensors=[automation.reallocation_sensor],
    resources=RESOURCES,
)

UPSTREAM = ["catalogs", "market_snapshot", "profiles", "demand"]
DOWNSTREAM = ["allocation_plan", "baseline_plans", "plan_simulation", "deployment_specs"]


def materialize_pipeline(scenario: str, *, simulate_s: float = 120.0, on_step=None) -> list[dg.AssetCheckEvaluation]:
    """Materialize every asset for one scenario in order (templates one model partition at a time), in process;
    returns the asset-check evaluations. `on_step(name)` is told each step as it starts."""
    from coral_dagster.catalog.scenarios import load_scenario

    settings = {"scenario": scenario}
    config = {name: settings for name in UPSTREAM[1:] + ["template_library"] + DOWNSTREAM}
    config["plan_simulation"] = {**settings, "duration_s": simulate_s}
    every = list(defs.assets) + list(defs.asset_checks)
    checks: list[dg.AssetCheckEvaluation] = []

    def run(selection: list[str], partition: str | None = None) -> None:
        if on_step:
            on_step(f"{', '.join(selection)}" + (f" [{partition}]" if partition else ""))
        ops = {name: {"config": config[name]} for name in selection if name in config}
        try:
            result = dg.materialize(every, selection=selection, partition_key=partition, resources=defs.resources,
                                    run_config={"ops": ops, "loggers": {"console": {"config": {"log_level": "WARNING"}}}})
        except dg.DagsterExecutionStepExecutionError as exc:
            if isinstance(exc.user_exception, CoralError):
                raise exc.user_exception from exc
            raise
        checks.extend(result.get_asset_check_evaluations())

    run(UPSTREAM)
    for model in (m.model for m in load_scenario(scenario).models):
        run(["template_library"], partition=model)
    run(DOWNSTREAM)
    return checks
