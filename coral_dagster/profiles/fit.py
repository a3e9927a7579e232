"""Fit the roofline's efficiencies to the measured tables (scipy least squares) and store the fit as JSON.

Notation: per GPU type g the six `GPU_PARAMS` θ_g (efficiencies and per-phase overheads), a prior mean μ shared
by all GPUs, the `GLOBAL_PARAMS` and per-link `LINK_PARAMS`; all positive, fitted in log space.
Objective: minimise Σ_tables (1/n_table) Σ_rows ρ(log predicted − log measured)  +  λ² Σ_g |log θ_g − log μ|²,
with ρ a soft-L1 loss, so that every measured table weighs the same whatever its length, one-off outliers do not
dominate, and a parameter the data of one GPU does not determine (Vidur's tables have no attention) falls back
to the mean of the others. GPUs with no measurement at all borrow the fit of the closest measured GPU class
(`CLOSEST_GPUS`); the GPU's own peak TFLOP/s, bandwidth and link stay its own.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from datetime import date
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from scipy.optimize import least_squares

from coral_dagster import paths
from coral_dagster.paths import FIT_FILE
from coral_dagster.catalog.gpus import GpuType, get_gpu
from coral_dagster.catalog.models import get_model
from coral_dagster.errors import CoralError
from coral_dagster.profiles.measured import load_measured, row_shape
from coral_dagster.profiles.memory import MemoryParams, fit_memory_params
from coral_dagster.profiles.roofline import (FEATURES, GLOBAL_PARAMS, GPU_PARAMS, LINK_PARAMS, LINKS, RowParams,
                                             layer_features, layer_ms)
from coral_dagster.profiles.sources import HELIX_NODES, helix_memory
#: Where a GPU without measurements (or held out) takes its efficiencies from, in order of preference:
#: the same chip (A10G and A40 are both GA102; A100 40/80 GB; H100/H200), then the same generation and memory
#: kind (L4/L40S are Ada with GDDR6), then the nearest older part.
CLOSEST_GPUS = {
    "A10G": ("A40", "L40S", "L4"), "A40": ("A10G", "L40S", "A100-80GB"), "L4": ("L40S", "A40"),
    "L40S": ("L4", "A40"), "T4": ("L4", "V100"), "V100": ("A100", "T4"), "A100": ("A100-80GB", "V100"),
    "A100-80GB": ("A100", "H100"), "H100": ("H200", "A100-80GB"), "H200": ("H100", "A100-80GB"),
}
PRIOR_WEIGHT = 0.05
#: Bounds of each parameter (natural units) and its start value.
BOUNDS = {
    "compute_eff": (0.05, 1.0, 0.6), "memory_eff": (0.05, 1.0, 0.7), "attn_compute_eff": (0.02, 1.0, 0.4),
    "attn_memory_eff": (0.02, 1.0, 0.5), "prefill_overhead_ms": (1e-4, 5.0, 0.05),
    "decode_overhead_ms": (1e-4, 5.0, 0.05), "moe_compute_eff": (0.02, 1.5, 0.4), "moe_memory_eff": (0.05, 1.5, 0.7), "lowbit_moe_eff": (0.1, 1.5, 1.0),
    "smooth_p": (1.2, 12.0, 3.0), "elementwise_passes": (0.5, 60.0, 8.0), "allreduce_latency_ms": (1e-4, 1.0, 0.02),
    "allreduce_eff": (0.02, 2.0, 0.6), "allreduce_scaling": (0.01, 4.0, 0.1), "vidur_time_factor": (0.5, 2.0, 1.0),
}


@dataclass(frozen=True)
class RooflineFit:
    """Fitted roofline parameters: per GPU, their prior mean, global, per link; plus the memory reserve."""

    gpus: dict[str, dict[str, float]]
    prior: dict[str, float]
    global_params: dict[str, float]
    links: dict[str, dict[str, float]]
    memory: MemoryParams
    meta: dict = field(default_factory=dict, compare=False)

    def gpu_source(self, gpu: str) -> str:
        """Whose efficiencies `gpu` uses: its own fit, the closest fitted GPU, or the prior mean."""
        if gpu in self.gpus:
            return gpu
        for other in CLOSEST_GPUS.get(gpu, ()):
            if other in self.gpus:
                return other
        return "prior"

    def gpu_values(self, gpu: str) -> dict[str, float]:
        src = self.gpu_source(gpu)
        return self.prior if src == "prior" else self.gpus[src]

    def row_params(self, gpus: np.ndarray | list[str], links: np.ndarray | list[str]) -> RowParams:
        """Parameters broadcast to rows of the given GPU type and link names."""
        gpus, links = np.asarray(gpus), np.asarray(links)
        # Any: RowParams takes these arrays by keyword beside scalar fields, which mypy checks each against.
        per_gpu: dict[str, Any] = {k: np.empty(len(gpus)) for k in GPU_PARAMS}
        for g in np.unique(gpus):
            values, mask = self.gpu_values(str(g)), gpus == g
            for k in GPU_PARAMS:
                per_gpu[k][mask] = values[k]
        per_link: dict[str, Any] = {k: np.empty(len(links)) for k in LINK_PARAMS}
        for name in np.unique(links):
            for k in LINK_PARAMS:
                per_link[k][links == name] = self.links[str(name)][k]
        return RowParams(**per_gpu, **self.global_params, **per_link)

    def scalar_params(self, gpu: GpuType) -> RowParams:
        values = self.gpu_values(gpu.name)
        return RowParams(**{k: values[k] for k in GPU_PARAMS}, **self.global_params,
                         **self.links[link_kind(gpu)])

    def to_json(self) -> dict:
        return {"gpus": self.gpus, "prior": self.prior, "global": self.global_params, "links": self.links,
                "memory": {"gpu_memory_utilization": self.memory.gpu_memory_utilization,
                           "per_gpu_overhead_bytes": self.memory.per_gpu_overhead_bytes},
                "closest_gpus": {g: list(v) for g, v in CLOSEST_GPUS.items()}, "meta": self.meta}

    @classmethod
    def from_json(cls, doc: dict) -> "RooflineFit":
        return cls(gpus=doc["gpus"], prior=doc["prior"], global_params=doc["global"], links=doc["links"],
                   memory=MemoryParams(**doc["memory"]), meta=doc.get("meta", {}))


def link_kind(gpu: GpuType) -> str:
    return "NVLink" if gpu.link == "NVLink" else "PCIe"


def measured_features(df: pd.DataFrame) -> dict[str, np.ndarray]:
    """Roofline features of every measured row (one vectorised call per table), plus `full_layer`, `gpu`, `link`."""
    df = df.reset_index(drop=True)
    out = {k: np.empty(len(df)) for k in FEATURES}
    for _, t in df.groupby("table", sort=False):
        first = t.iloc[0]
        phase = "decode" if first.phase == "decode" else "prefill"
        f = layer_features(row_shape(first), get_gpu(first.gpu), int(first.tp), phase, t["tokens"].to_numpy(float),
                           t["seq_tokens"].to_numpy(float), t["context_tokens"].to_numpy(float))
        rows = t.index.to_numpy()
        for k in FEATURES:
            out[k][rows] = f[k]
    out["full_layer"] = (df["scope"] == "layer").to_numpy()
    out["gpu"] = df["gpu"].to_numpy()
    out["link"] = np.array([link_kind(get_gpu(g)) for g in df["gpu"]])
    return out


def predict_measured(fit: RooflineFit, f: dict[str, np.ndarray]) -> np.ndarray:
    """Roofline milliseconds for rows described by `measured_features`."""
    return layer_ms(f, fit.row_params(f["gpu"], f["link"]), f["full_layer"])


class _Layout:
    """Position of every parameter in the log-space vector the optimiser moves."""

    def __init__(self, gpus: list[str]) -> None:
        self.gpus = gpus
        self.names: list[tuple[str, str]] = [(g, k) for g in gpus for k in GPU_PARAMS]
        self.names += [("prior", k) for k in GPU_PARAMS] + [("global", k) for k in GLOBAL_PARAMS]
        self.names += [(link, k) for link in LINKS for k in LINK_PARAMS]
        self.index = {n: i for i, n in enumerate(self.names)}

    def bounds(self) -> tuple[np.ndarray, np.ndarray]:
        lo = np.log([BOUNDS[k][0] for _, k in self.names])
        hi = np.log([BOUNDS[k][1] for _, k in self.names])
        return lo, hi

    def start(self, previous: RooflineFit | None) -> np.ndarray:
        x = np.log([BOUNDS[k][2] for _, k in self.names])
        if previous is not None:
            for i, (owner, k) in enumerate(self.names):
                if owner == "global" and k not in previous.global_params:
                    continue
                value = (previous.prior if owner == "prior" else previous.global_params if owner == "global"
                         else previous.links[owner] if owner in LINKS else previous.gpu_values(owner))[k]
                x[i] = math.log(value)
        lo, hi = self.bounds()
        return np.clip(x, lo + 1e-9, hi - 1e-9)

    def unpack(self, x: np.ndarray, memory: MemoryParams, meta: dict) -> RooflineFit:
        v = np.exp(x)
        get = lambda owner, k: float(v[self.index[(owner, k)]])  # noqa: E731
        return RooflineFit(
            gpus={g: {k: get(g, k) for k in GPU_PARAMS} for g in self.gpus},
            prior={k: get("prior", k) for k in GPU_PARAMS},
            global_params={k: get("global", k) for k in GLOBAL_PARAMS},
            links={link: {k: get(link, k) for k in LINK_PARAMS} for link in LINKS},
            memory=memory, meta=meta)


def fit_roofline(df: pd.DataFrame | None = None, *, memory: MemoryParams | None = None,
                 start: RooflineFit | None = None, max_nfev: int = 400) -> RooflineFit:
    """Fit to measured rows `df` (default: every shipped table). `start` warm-starts from an earlier fit."""
    df = load_measured() if df is None else df
    if df.empty:
        raise CoralError("no measured rows to fit the roofline to.", "keep at least one measured table.")
    memory = memory or default_memory_params()
    f = measured_features(df)
    measured = np.log(df["ms_per_layer"].to_numpy(float))
    counts = df.groupby("table")["table"].transform("size").to_numpy(float)
    weight = 1 / np.sqrt(counts)
    layout = _Layout(sorted(df["gpu"].unique()))
    gpu_pos = {g: i for i, g in enumerate(layout.gpus)}
    row_gpu = np.array([gpu_pos[g] for g in f["gpu"]])
    row_link = np.array([LINKS.index(link) for link in f["link"]])
    gpu_idx = {k: np.array([layout.index[(g, k)] for g in layout.gpus])[row_gpu] for k in GPU_PARAMS}
    link_idx = {k: np.array([layout.index[(link, k)] for link in LINKS])[row_link] for k in LINK_PARAMS}
    prior_pairs = np.array([(layout.index[(g, k)], layout.index[("prior", k)]) for g in layout.gpus
                            for k in GPU_PARAMS])

    def residual(x: np.ndarray) -> np.ndarray:
        v = np.exp(x)
        p = RowParams(**{k: v[i] for k, i in gpu_idx.items()}, **{k: v[i] for k, i in link_idx.items()},
                      **{k: v[layout.index[("global", k)]] for k in GLOBAL_PARAMS})
        pred = np.log(np.maximum(layer_ms(f, p, f["full_layer"]), 1e-9))
        prior = x[prior_pairs[:, 0]] - x[prior_pairs[:, 1]]
        return np.concatenate([(pred - measured) * weight, PRIOR_WEIGHT * prior])

    lo, hi = layout.bounds()
    result = least_squares(residual, layout.start(start), bounds=(lo, hi), loss="soft_l1", f_scale=0.05,
                           max_nfev=max_nfev, ftol=1e-6)
    meta = {"fitted_on": date.today().isoformat(), "rows": int(len(df)), "tables": int(df["table"].nunique()),
            "sources": sorted(df["source"].unique()), "optimizer_status": int(result.status),
            "evaluations": int(result.nfev), "command": "coral profile fit"}
    return layout.unpack(result.x, memory, meta)


def default_memory_params() -> MemoryParams:
    """The engine reserve fitted to Helix's memory.json."""
    return fit_memory_params(helix_memory(), get_model("llama-1-30b"), HELIX_NODES)


def save_fit(fit: RooflineFit, path: Path | None = None) -> Path:
    from coral_dagster.files import write_file

    return write_file(path or paths.PROFILES_DIR / FIT_FILE, json.dumps(fit.to_json(), indent=1, sort_keys=True) + "\n")


@lru_cache(maxsize=4)
def load_fit(path: Path | None = None) -> RooflineFit:
    """The shipped fit (`data/profiles/roofline_fit.json`)."""
    path = Path(path or paths.PROFILES_DIR / FIT_FILE)
    if not path.exists():
        raise CoralError(f"roofline fit {path} is missing.", "regenerate it with `coral profile fit`.")
    return RooflineFit.from_json(json.loads(path.read_text()))
