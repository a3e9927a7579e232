"""Profiling assets: torch profiling runs on this host, and the per-(model, node) profile table in DuckDB."""

import dagster as dg
from pydantic import Field

from resources.scenario import CoralScenario
from resources.store import CoralDuckDB


class ProfilingRunConfig(dg.Config):
    """Which (model, node) a profiling run measures on this host's device."""

    model: str = Field(default="phi-4", description="Model alias from the catalog.")
    node: str = Field(default="L4:1", description="Node configuration the measurement is filed under.")
    device: str = Field(default="cpu", description="cpu here; cuda on a GPU node.")
    layers: int = Field(default=2, description="Decoder layers built with random weights.")


@dg.asset(group_name="profiling", kinds={"torch", "duckdb"}, deps=["catalogs"])
def profiling_run(config: ProfilingRunConfig, duckdb: CoralDuckDB) -> dg.MaterializeResult:
    """Measure per-layer prefill and decode latency with torch on a random-weight decoder; append to
    `profiling_runs`."""
    from coral_dagster.profiles.torch_run import RunConfig, run_profile

    table, notes = run_profile(RunConfig.for_device(config.model, config.node, config.device, layers=config.layers))
    rows = duckdb.store().write("profiling_runs", table.assign(measured_at=notes["measured_at"]))
    return dg.MaterializeResult(metadata={
        "rows": dg.MetadataValue.int(rows), "notes": dg.MetadataValue.json(notes),
        "latency": dg.MetadataValue.md(table[["phase", "tokens", "ms_per_layer"]].to_markdown(index=False)),
    })


@dg.asset(group_name="profiling", kinds={"duckdb", "python"}, deps=["catalogs"])
def profiles(scenario: CoralScenario, duckdb: CoralDuckDB) -> dg.MaterializeResult:
    """Per-layer latency by batch and memory of every (model, node) of the scenario, with each number's source."""
    from coral_dagster.profiles.store import store_scenario_profiles

    table = store_scenario_profiles(duckdb.store(), scenario.name)
    by_source = table.groupby("source").size().rename("rows").reset_index()
    return dg.MaterializeResult(metadata={
        "rows": dg.MetadataValue.int(len(table)),
        "sources": dg.MetadataValue.md(by_source.to_markdown(index=False)),
    })
