"""`coral catalog …`: show the bundled catalogs and load them into DuckDB."""

from __future__ import annotations

import click

from coral_dagster.cli._out import db_option, emit, emit_json, json_option
from coral_dagster.cli.types import prices_path_option


@click.group()
def cli() -> None:
    """Show the catalogs (GPU types, node configurations, models, prices, scenarios) or load them into DuckDB."""


def _show(name: str, doc: str) -> click.Command:
    @prices_path_option
    @json_option
    def show(prices_path: str | None, as_json: bool) -> None:
        from coral_dagster.app.catalogs import catalog_frame

        emit(catalog_frame(name, prices_path), as_json, title=name)

    show.__doc__ = doc
    return click.command(name)(show)


for _name, _doc in [
    ("gpus", "GPU types: memory, HBM bandwidth, dense bf16 TFLOP/s, intra-node link and NIC bandwidth."),
    ("nodes", "Node configurations sold somewhere, with memory, network and price range."),
    ("models", "Models: architecture, parameter count and derived weight/KV/activation sizes."),
    ("prices", "On-demand and spot $/node-hour per region and node configuration (SkyPilot catalog snapshot, "
               "or --prices FILE)."),
    ("scenarios", "Scenarios: models, SLOs, traces and request rates."),
]:
    cli.add_command(_show(_name, _doc))


@cli.command("load")
@prices_path_option
@db_option
@json_option
def load(prices_path: str | None, db_path: str | None, as_json: bool) -> None:
    """Validate every catalog and (re)write it into the DuckDB file, one transaction for all."""
    from coral_dagster.app.catalogs import load_catalogs

    counts = load_catalogs(db_path, prices_path)
    if as_json:
        emit_json(counts)
    else:
        for table, n in counts.items():
            click.echo(f"{table:>18}: {n} rows")
