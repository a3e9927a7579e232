"""How well the calibrated roofline predicts measured tables: in-sample, and with tables held out of the fit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pandas as pd

from coral_dagster import paths
from coral_dagster.profiles.fit import (CLOSEST_GPUS, RooflineFit, fit_roofline, load_fit, measured_features,
                                        predict_measured)
from coral_dagster.profiles.measured import load_measured, row_shape

RECORD_FILE = "accuracy_recorded.json"


def ape_frame(fit: RooflineFit, df: pd.DataFrame) -> pd.DataFrame:
    """`df` with the roofline's prediction and absolute percentage error per row."""
    df = df.reset_index(drop=True)
    pred = predict_measured(fit, measured_features(df))
    return df.assign(predicted_ms=pred, ape=np.abs(pred - df["ms_per_layer"]) / df["ms_per_layer"])


def summarise(df: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    """Median and p90 APE and row count per group."""
    g = df.groupby(by)["ape"]
    return pd.DataFrame({"median_ape": g.median(), "p90_ape": g.quantile(0.9), "rows": g.size()}).reset_index()


def in_sample_errors(fit: RooflineFit | None = None, df: pd.DataFrame | None = None) -> dict[str, dict]:
    """Error of a fit on the data it was fitted to, per source and phase (`source|phase` keys) and overall."""
    errs = ape_frame(fit or load_fit(), load_measured() if df is None else df)
    out = {f"{r.source}|{r.phase}": {"median_ape": float(r.median_ape), "p90_ape": float(r.p90_ape),
                                     "rows": int(r.rows)} for r in summarise(errs, ["source", "phase"]).itertuples()}
    out["all"] = {"median_ape": float(errs["ape"].median()), "p90_ape": float(errs["ape"].quantile(0.9)),
                  "rows": int(len(errs))}
    return out


def record_errors(errors: dict[str, dict], path: Path | None = None) -> Path:
    """Store `errors` as the regression baseline the tests compare against."""
    from coral_dagster.files import write_file

    return write_file(path or paths.PROFILES_DIR / RECORD_FILE,
                      json.dumps({"in_sample": errors}, indent=1, sort_keys=True) + "\n")


def recorded_errors(path: Path | None = None) -> dict[str, dict]:
    return json.loads(Path(path or paths.PROFILES_DIR / RECORD_FILE).read_text())["in_sample"]


def shape_group(row) -> str:
    """Models with identical layers (Llama-2-70B and Llama-3.1-70B; Vidur's copies of catalog models) are one
    group, so holding a model out holds out every table of its layer shape."""
    s = row_shape(row)
    return f"h{s.hidden}-q{s.n_heads}-kv{s.n_kv_heads}-i{s.intermediate}-e{s.n_experts}x{s.expert_intermediate}"


def holdouts(df: pd.DataFrame, by: str) -> Iterator[tuple[str, pd.Series]]:
    """(name, mask of held-out rows): every layer-shape group (`by="model"`) or every GPU type (`by="gpu"`)."""
    key = df.apply(shape_group, axis=1) if by == "model" else df["gpu"]
    for name in sorted(key.unique()):
        yield name, key == name


def holdout_errors(by: str, base: RooflineFit | None = None, df: pd.DataFrame | None = None,
                   max_nfev: int = 60, progress: Callable | None = None) -> pd.DataFrame:
    """Fit without each held-out part in turn (warm-started from `base`) and return its rows' errors.

    By model: a held-out model is scored only on GPUs that keep other measurements in the fit. By GPU: the held-out
    GPU takes the efficiencies of its closest class (`CLOSEST_GPUS`), as a GPU without measurements does.
    """
    df = (load_measured() if df is None else df).reset_index(drop=True)
    base = base or load_fit()
    parts = list(holdouts(df, by))
    out = []
    for name, mask in (progress(parts) if progress else parts):
        train, test = df[~mask], df[mask]
        if by == "model":
            test = test[test["gpu"].isin(set(train["gpu"]))]
        if test.empty or train.empty:
            continue
        fit = fit_roofline(train, memory=base.memory, start=base, max_nfev=max_nfev)
        errs = ape_frame(fit, test).assign(held_out=name)
        if by == "gpu":
            errs["borrowed_from"] = fit.gpu_source(name)
        out.append(errs)
    return pd.concat(out, ignore_index=True)


__all__ = ["CLOSEST_GPUS", "ape_frame", "holdout_errors", "holdouts", "shape_group", "in_sample_errors", "record_errors", "recorded_errors",
           "summarise"]
