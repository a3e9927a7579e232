"""Where Coral finds its bundled data and its DuckDB file."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = Path(os.environ.get("CORAL_DATA_DIR", REPO_ROOT / "data"))
CATALOG_DIR = DATA_DIR / "catalog"
PRICES_DIR = DATA_DIR / "prices"
SCENARIOS_DIR = DATA_DIR / "scenarios"
PROFILES_DIR = DATA_DIR / "profiles"
TRACES_DIR = DATA_DIR / "traces"

# The performance model's files in PROFILES_DIR: its roofline fit and the measured tables it is fit to (named here,
# at the bottom, so the catalog can digest what templates are computed from without importing the profiles).
FIT_FILE = "roofline_fit.json"
HELIX_FILE = "helix_llama1_30b.csv"
AIC_FILE = "aiconfigurator_layers.csv"
VIDUR_FILE = "vidur_nonattention.csv"
MEASURED_FILES = (HELIX_FILE, AIC_FILE, VIDUR_FILE)


def default_db_path() -> Path:
    """The DuckDB file: `$CORAL_DB` when set, else `data/coral.duckdb`."""
    return Path(os.environ.get("CORAL_DB", DATA_DIR / "coral.duckdb"))


def prices_file() -> Path | None:
    """A user price table (`$CORAL_PRICES`) that replaces the bundled SkyPilot rows where code asks
    `load_node_prices()` for the table in use (`dagster dev`'s runs; `coral day --prices`, which sets it); the other
    commands read `$CORAL_PRICES` once, as their `--prices` option's default, and pass the file on."""
    value = os.environ.get("CORAL_PRICES")
    return Path(value) if value else None
