"""The catalogs (GPU types, node configurations, models, prices, scenarios) as tables, and loading them into the
store; priced from a user's price file when one is named, else from the price table in use."""

from __future__ import annotations

import pandas as pd

from coral_dagster.catalog.frames import CATALOG_FRAMES, PRICED_FRAMES


def _prices(prices_path: str | None) -> pd.DataFrame | None:
    from pathlib import Path

    from coral_dagster.catalog.prices import read_price_file

    return read_price_file(Path(prices_path)) if prices_path else None


def catalog_frame(name: str, prices_path: str | None = None) -> pd.DataFrame:
    """One catalog (a key of `CATALOG_FRAMES`) as a table."""
    build = CATALOG_FRAMES[name]
    return build(_prices(prices_path)) if name in PRICED_FRAMES else build()


def load_catalogs(db_path: str | None, prices_path: str | None = None) -> dict[str, int]:
    """Validate every catalog and (re)write it into the DuckDB file in one transaction; rows per table."""
    from coral_dagster.catalog.store import load_catalogs as write
    from coral_dagster.store import Store

    return write(Store(db_path), _prices(prices_path))
