"""Demand per (model, phase) in tokens/s: request rate × mean prompt or output tokens of the trace × a factor.

Prefill demand is rate × mean prompt tokens, decode demand rate × mean output tokens (coral.md §3, ours), both
times max(the scenario's headroom, the burst factor of the capacity rule, `allocation.capacity`). Demand mixes move request rate between models and keep the total: `uniform`
leaves the scenario's rates, `large-heavy` sends 80% of all requests to the largest third of the models by
parameter count (split evenly) and the rest evenly to the others, `small-heavy` the same for the smallest third.
Over time, each 6-minute window's rate follows the trace: its arrival count in the window over its mean count
per window, times the model's rate.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Literal, Mapping

import numpy as np

from coral_dagster.catalog.traces import load_trace, trace_means
from coral_dagster.errors import CoralError, UnknownNameError

DemandMix = Literal["uniform", "large-heavy", "small-heavy"]
DEMAND_MIXES: tuple[str, ...] = ("uniform", "large-heavy", "small-heavy")
HEAVY_SHARE = 0.8
@dataclass(frozen=True)
class TraceStats:
    """What allocation needs from a request trace: mean lengths, request count and span."""

    name: str
    mean_prompt_tokens: float
    mean_output_tokens: float
    n_requests: int
    duration_s: float

    @property
    def prompt_per_output(self) -> float:
        """Prompt tokens per output token of a mean request."""
        return self.mean_prompt_tokens / self.mean_output_tokens


@lru_cache(maxsize=None)
def trace_stats(name: str) -> TraceStats:
    """Mean prompt and output tokens, request count and span of a bundled trace."""
    frame = load_trace(name)
    return TraceStats(name, *trace_means(name), len(frame), float(frame["arrival_s"].max()))


def phase_demand(rate_req_s: float, stats: TraceStats, headroom: float) -> dict[str, float]:
    """Tokens/s to serve per phase for `rate_req_s` requests/s with the trace's mean lengths."""
    return {"prefill": rate_req_s * stats.mean_prompt_tokens * headroom,
            "decode": rate_req_s * stats.mean_output_tokens * headroom}


def mix_rates(rates: Mapping[str, float], params: Mapping[str, float], mix: str) -> dict[str, float]:
    """Request rates under a demand mix, total kept; the heavy third is picked by parameter count."""
    if mix not in DEMAND_MIXES:
        raise UnknownNameError("demand mix", mix, DEMAND_MIXES)
    if mix == "uniform" or len(rates) < 2:
        return dict(rates)
    total = sum(rates.values())
    order = sorted(rates, key=lambda m: (-params[m], m) if mix == "large-heavy" else (params[m], m))
    n_heavy = max(1, round(len(order) / 3))
    heavy, light = order[:n_heavy], order[n_heavy:]
    out = {m: HEAVY_SHARE * total / len(heavy) for m in heavy}
    out.update({m: (1.0 - HEAVY_SHARE) * total / len(light) for m in light})
    return {m: out[m] for m in rates}


def demand_tokens(rates: Mapping[str, float], traces: Mapping[str, str],
                  headroom: float | Mapping[tuple[str, str], float]) -> dict[tuple[str, str], float]:
    """Demand per (model, phase) for request rates per model and each model's trace, times one headroom or a
    factor per (model, phase) (the capacity rule's, `allocation.capacity`)."""
    out = {}
    for model, rate in rates.items():
        for phase, tokens in phase_demand(rate, trace_stats(traces[model]), 1.0).items():
            factor = headroom if isinstance(headroom, (int, float)) else headroom.get((model, phase), 1.0)
            out[(model, phase)] = tokens * factor
    return out


def window_factors(name: str, window_min: float = 6.0, horizon_min: float = 30.0) -> list[float]:
    """Per window of the horizon: the trace's arrivals in it over its mean arrivals per window."""
    frame = load_trace(name)
    stats = trace_stats(name)
    window_s = window_min * 60.0
    n_windows = int(round(horizon_min / window_min))
    if n_windows * window_s > stats.duration_s + window_s:
        raise CoralError(f"trace {name} spans {stats.duration_s / 60:.0f} min, shorter than {horizon_min:g} min.",
                         "choose a shorter horizon.")
    counts, _ = np.histogram(frame["arrival_s"], bins=n_windows, range=(0.0, n_windows * window_s))
    mean_count = stats.n_requests / stats.duration_s * window_s
    return [float(c / mean_count) for c in counts]


def window_rates(rates: Mapping[str, float], traces: Mapping[str, str], window_min: float = 6.0,
                 horizon_min: float = 30.0) -> list[dict[str, float]]:
    """Request rates per model for each re-plan window, following each model's trace."""
    factors = {m: window_factors(traces[m], window_min, horizon_min) for m in rates}
    n = len(next(iter(factors.values()))) if factors else 0
    return [{m: rates[m] * factors[m][w] for m in rates} for w in range(n)]
