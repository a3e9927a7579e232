"""Request streams for the simulator: trace replay scaled to a rate, Poisson or Gamma arrivals with trace lengths."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np

from coral_dagster.errors import CoralError, UnknownNameError
from coral_dagster.catalog.traces import load_trace

Arrivals = Literal["trace", "poisson", "gamma"]
ARRIVALS: tuple[Arrivals, ...] = ("trace", "poisson", "gamma")


@dataclass(frozen=True)
class ModelLoad:
    """One model's request stream: its length trace and mean arrival rate."""

    model: str
    trace: str
    rate_req_s: float


@dataclass(frozen=True)
class Workload:
    """All requests of a run, ordered by arrival; `model[i]` indexes `models`."""

    models: tuple[str, ...]
    arrival_s: np.ndarray
    model: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    duration_s: float

    def __len__(self) -> int:
        return len(self.arrival_s)


def _replay(trace: str, rate_req_s: float, duration_s: float, rng: np.random.Generator):
    """The trace's own arrival pattern, time-scaled to `rate_req_s`, looped, from a seeded starting row."""
    df = load_trace(trace)
    t = df.arrival_s.to_numpy()
    n = len(t)
    period_s = t[-1] + (t[-1] - t[0]) / max(n - 1, 1)  # one mean gap closes the loop
    scale = (n / period_s) / rate_req_s
    start = int(rng.integers(n))
    order = np.r_[start:n, 0:start]
    base = np.where(order >= start, t[order] - t[start], t[order] + period_s - t[start])
    loops = int(np.ceil(duration_s / (period_s * scale))) + 1
    times = (base[None, :] + period_s * np.arange(loops)[:, None]).ravel() * scale
    keep = times < duration_s
    rows = np.tile(order, loops)[keep]
    return times[keep], df.prompt_tokens.to_numpy()[rows], df.output_tokens.to_numpy()[rows]


def _renewal(trace: str, rate_req_s: float, duration_s: float, rng: np.random.Generator, arrivals: Arrivals,
             gamma_cv: float):
    """Poisson (exponential gaps) or Gamma gaps of coefficient of variation `gamma_cv`; lengths from the trace."""
    df = load_trace(trace)
    expect = int(rate_req_s * duration_s * 1.2) + 64
    times = np.empty(0)
    last = 0.0
    while last < duration_s:
        if arrivals == "poisson":
            gaps = rng.exponential(1.0 / rate_req_s, expect)
        else:
            shape = 1.0 / gamma_cv**2
            gaps = rng.gamma(shape, 1.0 / (rate_req_s * shape), expect)
        chunk = last + np.cumsum(gaps)
        times = np.r_[times, chunk]
        last = chunk[-1]
    times = times[times < duration_s]
    rows = rng.integers(len(df), size=len(times))
    return times, df.prompt_tokens.to_numpy()[rows], df.output_tokens.to_numpy()[rows]


def make_workload(loads: Sequence[ModelLoad], duration_s: float, seed: int, arrivals: Arrivals = "trace",
                  gamma_cv: float = 2.0) -> Workload:
    """Requests of every model over `[0, duration_s)`; each model draws from its own stream of `seed`."""
    if arrivals not in ARRIVALS:
        raise UnknownNameError("arrival process", arrivals, ARRIVALS)
    if duration_s <= 0:
        raise CoralError(f"duration {duration_s} s.", "simulate a positive duration, e.g. --duration-s 600.")
    if gamma_cv <= 0:
        raise CoralError(f"Gamma coefficient of variation {gamma_cv}.", "give a CV above 0 (1 is Poisson).")
    parts = []
    for i, load in enumerate(loads):
        if load.rate_req_s <= 0:
            parts.append((np.empty(0), np.empty(0, "int64"), np.empty(0, "int64")))
            continue
        rng = np.random.default_rng([seed, i])
        if arrivals == "trace":
            parts.append(_replay(load.trace, load.rate_req_s, duration_s, rng))
        else:
            parts.append(_renewal(load.trace, load.rate_req_s, duration_s, rng, arrivals, gamma_cv))
    arrival = np.concatenate([p[0] for p in parts]) if parts else np.empty(0)
    model = np.concatenate([np.full(len(p[0]), i, dtype="int64") for i, p in enumerate(parts)]) if parts else \
        np.empty(0, "int64")
    prompt = np.concatenate([p[1] for p in parts]).astype("int64") if parts else np.empty(0, "int64")
    output = np.concatenate([p[2] for p in parts]).astype("int64") if parts else np.empty(0, "int64")
    order = np.lexsort((model, arrival))  # stable: time, then model index
    return Workload(tuple(ld.model for ld in loads), arrival[order], model[order], prompt[order], output[order],
                    float(duration_s))
