"""Market assets: time-stamped price and availability snapshots, appended to DuckDB history."""

import dagster as dg

from assets.config import MarketConfig
from assets.metadata import frame_table, row_count
from coral_dagster.catalog.store import append_snapshot
from resources.market import MarketFeed
from resources.scenario import CoralScenario
from resources.store import CoralDuckDB


@dg.asset(group_name="market", kinds={"duckdb", "skypilot"}, deps=["catalogs"])
def market_snapshot(config: MarketConfig, scenario: CoralScenario, duckdb: CoralDuckDB,
                    market: MarketFeed) -> dg.MaterializeResult:
    """Prices and availability per (region, node configuration) for the scenario, appended to `market_snapshots`."""
    snap = market.snapshot(scenario.load(), config.availability_scale)
    rows = append_snapshot(duckdb.store(), snap)
    table = snap.to_frame()[["region", "node", "instance_type", "usd_per_hour", "spot_usd_per_hour",
                             "available_nodes"]]
    return dg.MaterializeResult(metadata={
        "snapshot_id": snap.snapshot_id,
        "taken_at": snap.taken_at.isoformat(),
        "rows_appended": dg.MetadataValue.int(rows),
        **row_count(len(table)),
        "offers": frame_table(table),
    })


@dg.asset_check(asset=market_snapshot, description="The newest snapshot is fresh, names known GPUs and has prices > 0.")
def snapshot_is_sane(duckdb: CoralDuckDB) -> dg.AssetCheckResult:
    from coral_dagster.catalog.checks import snapshot_problems

    latest = duckdb.store().query(
        "SELECT * FROM market_snapshots WHERE taken_at = (SELECT max(taken_at) FROM market_snapshots)")
    problems = snapshot_problems(latest)
    description = (f"the newest snapshot's {len(latest):,} offers are fresh, priced and name known GPUs."
                   if not problems else f"the newest snapshot has {len(problems)} problem(s), first: {problems[0]}.")
    return dg.AssetCheckResult(passed=not problems, description=description, metadata={
        "problems": dg.MetadataValue.json(problems), "offers": dg.MetadataValue.int(len(latest))})
