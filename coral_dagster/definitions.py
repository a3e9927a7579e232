"""The one Dagster `Definitions` of the Coral code location: assets, checks, resources, sensors and schedules."""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import dagster as dg
from dagster._core.errors import DagsterAssetCheckFailedError

from assets import automation, catalog, deployment, market, planning, profiling, simulation, templates
from coral_dagster.errors import CoralError
from coral_dagster.paths import REPO_ROOT, default_db_path
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
PIPELINE = UPSTREAM + ["template_library"] + DOWNSTREAM


def dagster_home() -> Path:
    """`$DAGSTER_HOME`, or the project's `.dagster/` when unset: where `coral run` records its runs, and what
    `dagster dev` must be started with to show them."""
    return Path(os.environ.get("DAGSTER_HOME") or REPO_ROOT / ".dagster").resolve()


@dataclass(frozen=True)
class PipelineRun:
    """What one pipeline run recorded in the Dagster instance: its runs, check evaluations, and the metadata of
    each asset's newest materialization (keyed by asset name)."""

    run_ids: tuple[str, ...]
    checks: tuple[dg.AssetCheckEvaluation, ...]
    metadata: Mapping[str, Mapping[str, dg.MetadataValue]]

    @property
    def failed_checks(self) -> list[dg.AssetCheckEvaluation]:
        return [c for c in self.checks if not c.passed]

    @property
    def not_materialized(self) -> list[str]:
        """Pipeline assets no run materialized (a blocking check upstream failed)."""
        return [name for name in PIPELINE if name not in self.metadata]


def materialize_pipeline(scenario: str, *, simulate_s: float = 120.0, attainment_target: float = 0.95,
                         rate_scale: float = 1.0,
                         closed_loop: bool = True, on_step=None, log_level: str = "WARNING") -> PipelineRun:
    """Materialize every asset for one scenario in order (templates one partition per model), in process, recording
    the runs in the instance at `dagster_home()`. A failed blocking check stops what depends on it; an asset that
    raises `CoralError` stops the pipeline with that error. `on_step(name)` is told each step as it starts;
    Dagster's console log shows `log_level` and above."""
    from assets.automation import scenario_run_config
    from assets.templates import scenario_partitions

    partitions = scenario_partitions(scenario)
    config = scenario_run_config(scenario, UPSTREAM[1:] + DOWNSTREAM)["ops"]
    config["plan_simulation"]["config"].update(duration_s=simulate_s, attainment_target=attainment_target,
                                               rate_scale=rate_scale)
    config["allocation_plan"]["config"].update(closed_loop=closed_loop)
    every = list(defs.assets) + list(defs.asset_checks)
    home = dagster_home()
    if not (home / "dagster.yaml").exists():  # an instance of our own making: say so, and without telemetry
        home.mkdir(parents=True, exist_ok=True)
        (home / "dagster.yaml").write_text("# Created by `coral run`; see README (Dagster).\ntelemetry:\n  enabled: false\n")
    resources = {**defs.resources, "duckdb": CoralDuckDB(database=str(default_db_path()))}  # $CORAL_DB as of now
    run_ids: list[str] = []

    def run(instance: dg.DagsterInstance, selection: list[str], partition: str | None = None) -> bool:
        if on_step:
            on_step(f"{', '.join(selection)}" + (f" [{partition}]" if partition else ""))
        tag = uuid.uuid4().hex
        ops = {name: config[name] for name in selection if name in config}
        try:
            dg.materialize(every, selection=selection, partition_key=partition, resources=resources,
                           instance=instance, tags={"coral/scenario": scenario, "coral/pipeline": tag},
                           run_config={"ops": ops, "loggers": {"console": {"config": {"log_level": log_level}}}})
            blocked = False
        except dg.DagsterExecutionStepExecutionError as exc:
            if isinstance(exc.user_exception, CoralError):
                raise exc.user_exception from exc
            raise
        except DagsterAssetCheckFailedError:
            blocked = True
        run_ids.append(instance.get_runs(filters=dg.RunsFilter(tags={"coral/pipeline": tag}), limit=1)[0].run_id)
        return not blocked

    with dg.DagsterInstance.from_config(str(home)) as instance:
        if run(instance, UPSTREAM):
            for partition in partitions:
                run(instance, ["template_library"], partition=partition)
            run(instance, DOWNSTREAM)
        return _recorded(instance, run_ids)


def _recorded(instance: dg.DagsterInstance, run_ids: list[str]) -> PipelineRun:
    """The check evaluations and materialization metadata the runs wrote to the instance."""
    checks, metadata = [], {}
    for run_id in run_ids:
        for entry in instance.all_logs(run_id):
            event = entry.dagster_event
            if event is None:
                continue
            if event.event_type == dg.DagsterEventType.ASSET_CHECK_EVALUATION:
                checks.append(event.event_specific_data)
            elif event.event_type == dg.DagsterEventType.ASSET_MATERIALIZATION:
                mat = event.event_specific_data.materialization
                metadata[mat.asset_key.to_user_string()] = dict(mat.metadata)
    return PipelineRun(tuple(run_ids), tuple(checks), metadata)
