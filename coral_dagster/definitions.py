"""The one Dagster `Definitions` of the Coral code location: assets, checks, resources, sensors and schedules."""

from __future__ import annotations

import os

import dagster as dg

from assets import catalog, market
from coral_dagster.paths import default_db_path
from resources import BundledMarketFeed, CoralDuckDB, SolverSettings


def _database() -> str | dg.EnvVar:
    """`$CORAL_DB` when set (read through `dg.EnvVar`, so the UI shows where it came from), else the bundled file."""
    return dg.EnvVar("CORAL_DB") if os.environ.get("CORAL_DB") else str(default_db_path())


RESOURCES = {
    "duckdb": CoralDuckDB(database=_database()),
    "market": BundledMarketFeed(),
    "solver": SolverSettings(),
}

defs = dg.Definitions(
    assets=dg.load_assets_from_modules([catalog, market]),
    asset_checks=dg.load_asset_checks_from_modules([market]),
    resources=RESOURCES,
)
