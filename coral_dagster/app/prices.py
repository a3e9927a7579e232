"""The price table a command plans and deploys with: the bundled SkyPilot rows, or a user's price file."""

from __future__ import annotations

import os
from pathlib import Path

from coral_dagster.catalog.prices import load_node_prices as load_node_prices, read_price_file


def checked_price_file(path: str) -> str:
    """The absolute path of a user price file, read and checked now (a CoralError names what is wrong)."""
    read_price_file(Path(path))
    return os.path.abspath(path)

