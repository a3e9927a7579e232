"""Printing helpers shared by the CLI modules: rich tables for people, JSON for scripts."""

from __future__ import annotations

import json
import numbers
from typing import Any

import click

from coral_dagster.app.documents import finite_json
# The option types every command uses, re-exported.
from coral_dagster.cli.types import NON_NEGATIVE as NON_NEGATIVE, POSITIVE as POSITIVE, FiniteFloat as FiniteFloat
import pandas as pd
from rich.console import Console
from rich.table import Table


def emit_json(data: Any) -> None:
    """Print `data` as JSON (DataFrames become lists of records); NaN and infinities print as null, since JSON
    has no such numbers and scripts reading ours must never meet them."""
    if isinstance(data, pd.DataFrame):
        data = json.loads(data.to_json(orient="records", date_format="iso"))
    click.echo(json.dumps(finite_json(data), indent=2, default=str, allow_nan=False))


def emit_table(df: pd.DataFrame, title: str = "") -> None:
    """Print a DataFrame as a rich table."""
    table = Table(title=title or None)
    for col in df.columns:
        table.add_column(str(col), justify="right" if pd.api.types.is_numeric_dtype(df[col]) else "left")
    for row in df.itertuples(index=False):
        table.add_row(*(_cell(v) for v in row))
    Console(width=200).print(table)


def _cell(value: Any) -> str:
    """A cell people read: numbers with thousands separators (30,490), floats below 100 to four digits (55.27)."""
    if isinstance(value, bool) or value is None:
        return "" if value is None else str(value)
    if isinstance(value, numbers.Integral):
        return f"{value:,}"
    if isinstance(value, float):
        return "" if pd.isna(value) else f"{value:,.0f}" if abs(value) >= 100 else f"{value:,.4g}"
    return str(value)


def emit(df: pd.DataFrame, as_json: bool, title: str = "") -> None:
    """Table or JSON, as the user asked."""
    emit_json(df) if as_json else emit_table(df, title)


json_option = click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
db_option = click.option("--db", "db_path", type=click.Path(dir_okay=False), default=None,
                         help="DuckDB file (default: $CORAL_DB or data/coral.duckdb).")


SCENARIO_HELP = ("a bundled name (core, extended, helix) or the path of a scenario file (.yaml or .yml, any file "
                 "and scenario name; see data/scenarios/core.yaml)")
