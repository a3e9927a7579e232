"""The one Dagster `Definitions` of the Coral code location: assets, checks, resources, sensors and schedules."""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import dagster as dg
from dagster._core.errors import DagsterAssetCheckFailedError

from assets import automation, catalog, day, deployment, market, planning, profiling, simulation, templates
from coral_dagster.errors import CoralError
from coral_dagster.paths import REPO_ROOT, default_db_path
from resources import BundledMarketFeed, CoralDuckDB, CoralScenario, SkyPilotLauncher, SolverSettings

ASSET_MODULES = [catalog, market, profiling, templates, planning, simulation, deployment, day]


def _database() -> str | dg.EnvVar:
    """`$CORAL_DB` when set (read through `dg.EnvVar`, so the UI shows where it came from), else the bundled file."""
    return dg.EnvVar("CORAL_DB") if os.environ.get("CORAL_DB") else str(default_db_path())


RESOURCES = {
    "scenario": CoralScenario(name=automation.SENSOR_SCENARIO),
    "duckdb": CoralDuckDB(database=_database()),
    "market": BundledMarketFeed(),
    "solver": SolverSettings(),
    "launcher": SkyPilotLauncher(),
}

UPSTREAM = ["catalogs", "market_snapshot", "profiles", "demand"]
DOWNSTREAM = ["allocation_plan", "baseline_plans", "plan_simulation", "deployment_specs"]
PIPELINE = UPSTREAM + ["template_library"] + DOWNSTREAM

#: `coral run`: every pipeline asset and its checks in one run (the template library over the scenario's
#: partitions, as one partition range).
pipeline_job = dg.define_asset_job(
    "coral_pipeline", selection=dg.AssetSelection.assets(*PIPELINE),
    description="Catalogs, market, profiles, demand, the scenario's template library, the plan, its baselines, "
                "its simulation and its deployment, in one run (what `coral run` launches).")

defs = dg.Definitions(
    assets=dg.load_assets_from_modules(ASSET_MODULES),
    asset_checks=dg.load_asset_checks_from_modules(ASSET_MODULES),
    jobs=[pipeline_job, automation.refresh_inputs_job, automation.replan_job],
    schedules=[automation.refresh_inputs_schedule, automation.replan_schedule],
    sensors=[automation.reallocation_sensor],
    resources=RESOURCES,
)

#: The instance settings `coral run` writes to a new `dagster_home()` (`dagster dev` reads them from there): no
#: telemetry, and at most one re-plan run in progress (the replan job's runs carry `automation.REPLAN_TAG`).
INSTANCE_YAML = """# Created by `coral run`; see README (Dagster).
telemetry:
  enabled: false
concurrency:
  runs:
    tag_concurrency_limits:
""" + "".join(f"      - key: \"{k}\"\n        value: \"{v}\"\n        limit: 1\n"
              for k, v in automation.REPLAN_TAG.items())


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
                         closed_loop: bool = True, on_step=None, log_level: str = "WARNING",
                         db_path: str | None = None, prices_path: str | None = None,
                         reuse_templates: bool = True) -> PipelineRun:
    """Run the `coral_pipeline` job for one scenario, in process: one run, tagged with the scenario, recorded in the
    instance at `dagster_home()`, its template library over the scenario's partitions. A failed blocking check
    stops what depends on it; an asset that raises `CoralError` stops the run with that error. `on_step(text)` is
    told the run as it starts; Dagster's console log shows `log_level` and above. `db_path`: the DuckDB file
    (default: `$CORAL_DB`, else the bundled file); `prices_path`: a price CSV replacing the bundled rows;
    `reuse_templates`: keep each model's templates already stored for the same inputs (else build them again)."""
    from assets.templates import scenario_partitions

    partitions = scenario_partitions(scenario)
    home = dagster_home()
    if not (home / "dagster.yaml").exists():  # an instance of our own making: say so, without telemetry
        from coral_dagster.files import write_file

        home.mkdir(parents=True, exist_ok=True)
        write_file(home / "dagster.yaml", INSTANCE_YAML, fix="point DAGSTER_HOME at a folder you can write")
    # The DuckDB file asked for ($CORAL_DB as of now by default), and the scenario asked for.
    resources = {**(defs.resources or {}), "duckdb": CoralDuckDB(database=str(db_path or default_db_path())),
                 "scenario": CoralScenario(name=scenario)}
    if prices_path:
        resources["market"] = BundledMarketFeed(prices_file=prices_path)
    job = dg.Definitions(assets=defs.assets, asset_checks=defs.asset_checks, jobs=[pipeline_job],
                         resources=resources).resolve_job_def(pipeline_job.name)
    ops = {"plan_simulation": {"config": {"duration_s": simulate_s, "attainment_target": attainment_target,
                                          "rate_scale": rate_scale}},
           "allocation_plan": {"config": {"closed_loop": closed_loop}},
           "template_library": {"config": {"reuse_stored": reuse_templates}}}
    tag = uuid.uuid4().hex
    tags = {"coral/scenario": scenario, "coral/pipeline": tag,
            "dagster/asset_partition_range_start": partitions[0], "dagster/asset_partition_range_end": partitions[-1]}
    if on_step:
        on_step(f"{pipeline_job.name} [{scenario}: {', '.join(PIPELINE)}]")
    with dg.DagsterInstance.from_config(str(home)) as instance:
        try:
            job.execute_in_process(instance=instance, tags=tags, run_config={
                "ops": ops, "loggers": {"console": {"config": {"log_level": log_level}}}})
        except dg.DagsterExecutionStepExecutionError as exc:
            if isinstance(exc.user_exception, CoralError):
                raise exc.user_exception from exc
            raise
        except DagsterAssetCheckFailedError:
            pass  # a blocking check failed: what depends on it did not run, and `_recorded` shows which
        run_id = instance.get_runs(filters=dg.RunsFilter(tags={"coral/pipeline": tag}), limit=1)[0].run_id
        return _recorded(instance, [run_id])


def _recorded(instance: dg.DagsterInstance, run_ids: list[str]) -> PipelineRun:
    """The check evaluations and materialization metadata the runs wrote to the instance."""
    checks: list[dg.AssetCheckEvaluation] = []
    metadata: dict[str, Mapping[str, dg.MetadataValue]] = {}
    for run_id in run_ids:
        for entry in instance.all_logs(run_id):
            data = entry.dagster_event.event_specific_data if entry.dagster_event else None
            if isinstance(data, dg.AssetCheckEvaluation):
                checks.append(data)
            elif entry.asset_materialization is not None:
                mat = entry.asset_materialization
                metadata[mat.asset_key.to_user_string()] = dict(mat.metadata)
    return PipelineRun(tuple(run_ids), tuple(checks), metadata)
