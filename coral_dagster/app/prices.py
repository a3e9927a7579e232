"""The price table a command plans and deploys with: the bundled SkyPilot rows, or a user's price file."""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd

from coral_dagster.catalog.prices import load_node_prices as load_node_prices, read_price_file


def checked_price_file(path: str) -> str:
    """The absolute path of a user price file, read and checked now (a CoralError names what is wrong)."""
    read_price_file(Path(path))
    return os.path.abspath(path)


def price_table(prices_path: str | None) -> pd.DataFrame | None:
    """The rows of the price file `prices_path` (a command's `--prices`); None without one, which every consumer
    reads as the default table (`load_node_prices`)."""
    return read_price_file(Path(prices_path)) if prices_path else None
