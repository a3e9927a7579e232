"""`coral run`: the main job on the bundled data and the embedded DuckDB file."""

from __future__ import annotations

import click

from coral_dagster.cli._out import db_option, emit_json, emit_table, json_option


@click.command()
@click.option("--scenario", default="core", show_default=True, help="Bundled scenario to run (core, extended, helix).")
@db_option
@json_option
def cli(scenario: str, db_path: str | None, as_json: bool) -> None:
    """Run the pipeline end to end and print a summary.

    Loads and validates every catalog into DuckDB and appends today's price and availability snapshot of the
    scenario.
    """
    from coral_dagster.catalog.frames import prices_frame
    from coral_dagster.catalog.scenarios import load_scenario
    from coral_dagster.catalog.store import append_snapshot, load_catalogs
    from coral_dagster.store import Store

    store = Store(db_path)
    counts = load_catalogs(store)
    snap = load_scenario(scenario).market()
    append_snapshot(store, snap)
    summary = {"db": str(store.path), "scenario": scenario, "catalog_rows": counts,
               "snapshot_id": snap.snapshot_id, "offers": len(snap.offers)}
    if as_json:
        emit_json(summary)
        return
    click.echo(f"DuckDB: {store.path}")
    for table, n in counts.items():
        click.echo(f"  {table}: {n} rows")
    prices = prices_frame()
    emit_table(prices[prices["region"].isin(snap.regions)], title=f"{scenario}: node prices ($/node-hour)")
    click.echo(f"snapshot {snap.snapshot_id}: {len(snap.offers)} offers in {', '.join(snap.regions)}")
