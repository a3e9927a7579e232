"""The shipped measured tables as one frame: Helix and aiconfigurator per-layer times, Vidur non-attention times."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import pandas as pd

from coral_dagster import paths
from coral_dagster.catalog.models import get_model
from coral_dagster.errors import CoralError
from coral_dagster.paths import MEASURED_FILES
from coral_dagster.profiles.shapes import LayerShape
COLUMNS = ["source", "model", "gpu", "tp", "phase", "tokens", "seq_tokens", "context_tokens", "ms_per_layer",
           "scope"]


def table_key(row) -> str:
    """One measured table: a source's curve for one model, GPU, TP degree and phase."""
    return f"{row.source}|{row.model}|{row.gpu}:{row.tp}|{row.phase}"


@lru_cache(maxsize=4)
def load_measured(profiles_dir: Path | None = None) -> pd.DataFrame:
    """All shipped measured rows with the standard columns plus `table` (see `table_key`)."""
    root = Path(profiles_dir or paths.PROFILES_DIR)
    frames = []
    for name in MEASURED_FILES:
        path = root / name
        if not path.exists():
            raise CoralError(f"measured profile table {path} is missing.",
                             "restore data/profiles from the repository, or rebuild it with `coral profile import` "
                             "and `coral profile aic-tables`.")
        df = pd.read_csv(path)
        for col in ("seq_tokens", "context_tokens"):
            if col not in df:
                df[col] = 1 if col == "seq_tokens" else 0
        keep = COLUMNS + [c for c in ("hidden", "n_heads", "n_kv_heads", "intermediate", "gated") if c in df]
        frames.append(df[keep])
    out = pd.concat(frames, ignore_index=True)
    out["table"] = [table_key(r) for r in out.itertuples(index=False)]
    return out


def row_shape(row) -> LayerShape:
    """The layer shape a measured row was taken on: catalog models by alias, Vidur's by their own columns."""
    if row.source == "measured:vidur":
        return LayerShape(hidden=int(row.hidden), n_heads=int(row.n_heads), n_kv_heads=int(row.n_kv_heads),
                          head_dim=int(row.hidden) // int(row.n_heads), intermediate=int(row.intermediate),
                          gated=bool(row.gated))
    return LayerShape.of(get_model(row.model))
