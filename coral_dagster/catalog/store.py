"""Write the validated catalogs into the DuckDB store in one transaction."""

from __future__ import annotations

import pandas as pd

from coral_dagster.catalog.frames import CATALOG_FRAMES, PRICED_FRAMES
from coral_dagster.catalog.market import MarketSnapshot, market_from_frame
from coral_dagster.catalog.scenarios import Scenario
from coral_dagster.store.duck import Store, newest_snapshot, write_frame


def load_catalogs(store: Store, prices: pd.DataFrame | None = None) -> dict[str, int]:
    """Replace the `catalog_*` tables with the bundled catalogs (priced from `prices`, default: the price table in
    use); returns rows per table."""
    frames = {f"catalog_{name}": build(prices) if name in PRICED_FRAMES else build()
              for name, build in CATALOG_FRAMES.items()}
    with store.transaction() as con:
        for table, df in frames.items():
            write_frame(con, table, df, mode="replace")
    return {table: len(df) for table, df in frames.items()}


def append_snapshot(store: Store, snapshot: MarketSnapshot) -> int:
    """Append one price/availability snapshot to `market_snapshots` (history is never rewritten)."""
    df = snapshot.to_frame()
    with store.transaction() as con:
        exists = con.execute(
            "SELECT count(*) FROM information_schema.tables WHERE table_name = 'market_snapshots'").fetchall()[0][0]
        if exists and con.execute("SELECT count(*) FROM market_snapshots WHERE snapshot_id = ?",
                                  [snapshot.snapshot_id]).fetchall()[0][0]:
            return 0
        write_frame(con, "market_snapshots", df)
    return len(df)


def latest_snapshot(store: Store, scenario: Scenario) -> MarketSnapshot:
    """The newest stored snapshot of the scenario (stored under its `scenario_key`, so a file named like another
    scenario never reads that scenario's snapshots)."""
    fix = f"materialize `market_snapshot` for scenario {scenario.ref} (or run `coral run` on it)."
    df = newest_snapshot(store, "market_snapshots", "snapshot_id", scenario, "market snapshot", fix)
    return market_from_frame(df)
