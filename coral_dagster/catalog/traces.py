"""Bundled request traces (Azure LLM inference 2023): arrival times and prompt/output lengths."""

from __future__ import annotations

from functools import lru_cache

import pandas as pd

from coral_dagster import paths
from coral_dagster.errors import CatalogError, UnknownNameError

TRACE_FILES = {
    "azure-conv": "azure-llm-2023/AzureLLMInferenceTrace_conv.csv",
    "azure-code": "azure-llm-2023/AzureLLMInferenceTrace_code.csv",
}


def trace_names() -> tuple[str, ...]:
    return tuple(TRACE_FILES)


@lru_cache(maxsize=None)
def _read(name: str) -> pd.DataFrame:
    path = paths.TRACES_DIR / TRACE_FILES[name]
    if not path.exists():
        raise CatalogError(path, "-", "-", "trace file is missing",
                           "restore data/traces from the repository (see its PROVENANCE.md)")
    raw = pd.read_csv(path)
    for col in ("TIMESTAMP", "ContextTokens", "GeneratedTokens"):
        if col not in raw.columns:
            raise CatalogError(path, 0, col, "column is missing", "use the AzurePublicDataset file unchanged")
    stamps = pd.to_datetime(raw["TIMESTAMP"], format="ISO8601")
    arrival_s = (stamps - stamps.iloc[0]).dt.total_seconds().to_numpy()
    df = pd.DataFrame({
        "arrival_s": arrival_s,
        "prompt_tokens": raw["ContextTokens"].to_numpy(dtype="int64"),
        "output_tokens": raw["GeneratedTokens"].to_numpy(dtype="int64"),
    })
    bad = df.index[(df.prompt_tokens < 1) | (df.output_tokens < 1) | (df.arrival_s.diff() < 0)]
    if len(bad):
        raise CatalogError(path, int(bad[0]) + 2, "TIMESTAMP/ContextTokens/GeneratedTokens",
                           "rows must be time-ordered with at least one prompt and one output token",
                           "use the AzurePublicDataset file unchanged")
    return df


def load_trace(name: str) -> pd.DataFrame:
    """The trace `azure-conv` or `azure-code` as columns arrival_s (from 0), prompt_tokens, output_tokens."""
    if name not in TRACE_FILES:
        raise UnknownNameError("trace", name, list(TRACE_FILES))
    return _read(name).copy()


def trace_means(name: str) -> tuple[float, float]:
    """(mean prompt tokens, mean output tokens) of a bundled trace."""
    if name not in TRACE_FILES:
        raise UnknownNameError("trace", name, list(TRACE_FILES))
    df = _read(name)
    return float(df.prompt_tokens.mean()), float(df.output_tokens.mean())
