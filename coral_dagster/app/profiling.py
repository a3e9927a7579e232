"""The performance model for the command line: per-layer latency and T̂ of a model on a node, profile tables,
measuring on this machine, refitting the roofline and importing public tables."""

from __future__ import annotations

from pathlib import Path

import pandas as pd


def model_and_node(model: str, node: str):
    """(ModelSpec, NodeSpec) of a model alias or Hugging Face id and a node configuration such as L40S:2."""
    from coral_dagster.catalog.gpus import node_spec
    from coral_dagster.catalog.models import get_model

    return get_model(model), node_spec(node)


def perf_model():
    """The performance model planning uses (`profiles.default_perf_model`)."""
    from coral_dagster.profiles import default_perf_model

    return default_perf_model()


def profile_frame(model: str, nodes: tuple[str, ...]) -> tuple[str, pd.DataFrame]:
    """(model alias, ms per layer per node configuration and phase): of the nodes named, else of every one."""
    from coral_dagster.catalog.gpus import gpu_catalog, node_spec
    from coral_dagster.catalog.models import get_model
    from coral_dagster.catalog.nodes import GPUS_PER_NODE, NodeConfig
    from coral_dagster.profiles import profile_table

    m = get_model(model)
    chosen: list[NodeConfig | str] = [node_spec(n).config for n in nodes]
    chosen = chosen or [f"{g}:{c}" for g in gpu_catalog() for c in GPUS_PER_NODE]
    return m.alias, profile_table([m], chosen)


def measure(model: str, node: str, device: str, **options) -> tuple[pd.DataFrame, dict]:
    """(table, notes) of one profiling run on this machine (`profiles.torch_run`)."""
    from coral_dagster.profiles.torch_run import RunConfig, run_profile

    model_and_node(model, node)
    return run_profile(RunConfig.for_device(model, node, device, **options))


def store_measured(db_path: str | None, df: pd.DataFrame, notes: dict) -> None:
    """Append a profiling run's table to the store's `profiles_measured`."""
    from coral_dagster.store import Store

    Store(db_path).write("profiles_measured", df.assign(measured_at=notes["measured_at"], host=notes["host"]))


def refit(record: bool):
    """Refit the roofline to the shipped tables, from the current fit when there is one: (path, fit, errors)."""
    from coral_dagster.errors import CoralError
    from coral_dagster.profiles.accuracy import in_sample_errors, record_errors
    from coral_dagster.profiles.fit import fit_roofline, load_fit, save_fit

    try:
        start = load_fit()
    except CoralError:
        start = None
    result = fit_roofline(start=start)
    path = save_fit(result)
    load_fit.cache_clear()
    errors = in_sample_errors(result)
    if record:
        record_errors(errors)
    return path, result, errors


def import_profiles(shared_dir: str) -> dict[str, int]:
    """Convert the public Helix and Vidur tables into data/profiles/; rows per file."""
    from coral_dagster.profiles.sources import import_public_profiles

    return import_public_profiles(shared_dir)


def aic_tables(progress: bool) -> dict[str, int]:
    """Regenerate aiconfigurator's per-layer table; its rows and (model, node) pairs."""
    from coral_dagster.profiles.aic import AIC_FILE, build_aic_tables

    df = build_aic_tables(progress=progress)
    return {AIC_FILE: len(df), "(model, node) pairs": int(df.groupby(["model", "node"]).ngroups)}


def scenario_tables(scenarios: tuple[str, ...], store: bool, db_path: str | None) -> dict[str, int]:
    """Write the scenarios' profile tables (and, with `store`, replace their rows of the store's `profiles`)."""
    from coral_dagster.profiles.table import write_scenario_tables

    counts = write_scenario_tables(scenarios)
    if store:
        from coral_dagster.profiles.store import store_scenario_profiles
        from coral_dagster.store import Store

        target = Store(db_path)
        counts["profiles (DuckDB)"] = sum(len(store_scenario_profiles(target, s)) for s in scenarios)
    return counts


def write_csv(df: pd.DataFrame, out_path: str) -> None:
    """A table as a CSV file (its folder made)."""
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(out_path, index=False)
