"""Dagster metadata from domain values: typed tables, and the plan id read off the materialization that recorded it."""

from __future__ import annotations

import dagster as dg
import pandas as pd

from coral_dagster.errors import CoralError

_COLUMN_TYPES = {"i": "int", "u": "int", "f": "float", "b": "bool"}


def frame_table(df: pd.DataFrame) -> dg.TableMetadataValue:
    """A DataFrame as `MetadataValue.table` with a `TableSchema` naming each column's type."""
    schema = dg.TableSchema(columns=[dg.TableColumn(str(c), _COLUMN_TYPES.get(df[c].dtype.kind, "string"))
                                     for c in df.columns])
    records = [dg.TableRecord({str(c): _cell(v) for c, v in row.items()}) for row in df.to_dict(orient="records")]
    return dg.MetadataValue.table(records, schema=schema)


def _cell(value):
    """A cell as the JSON scalar a `TableRecord` holds (None for a missing number)."""
    value = value.item() if hasattr(value, "item") else value
    if isinstance(value, float) and value != value:
        return None
    return value if isinstance(value, (bool, int, float, str)) else str(value)


def row_count(n: int) -> dict[str, dg.IntMetadataValue]:
    """The `dagster/row_count` entry the UI shows beside an asset."""
    return {"dagster/row_count": dg.MetadataValue.int(int(n))}


def recorded_plan_id(context: dg.AssetExecutionContext | dg.AssetCheckExecutionContext, asset: str) -> str:
    """The `plan_id` the newest materialization of `asset` recorded: for a downstream asset the plan its upstream
    made (in one run of the pipeline, that run's), for a check the plan of the materialization it checks; never
    the store's latest plan, which another command may have written since."""
    event = context.instance.get_latest_materialization_event(dg.AssetKey(asset))
    entry = event.asset_materialization.metadata.get("plan_id") if event and event.asset_materialization else None
    if entry is None:
        raise CoralError(f"{asset} has no materialization recording a plan_id.",
                         f"materialize {asset} (with its upstream assets) first.")
    return str(entry.value)
