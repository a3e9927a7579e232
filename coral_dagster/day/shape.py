"""The day's demand and supply per re-plan window, and how long a node takes to start (data/scenarios/DAY.md)."""

from __future__ import annotations

import math
from typing import Mapping, Sequence

from coral_dagster.catalog.scenarios import DaySpec, Scenario
from coral_dagster.templates.types import Template

MINUTES_PER_DAY = 1440.0
# How a window's re-plan sizes capacity: "window" for the window's own rates (a snapshot plan), "forecast" for
# the highest of the last hour's rates carried along the diurnal forecast until what it launches is up (DAY.md §6).
SIZINGS = ("forecast", "window")
LOOKBACK_MIN = 60.0


def day_spec(scenario: Scenario) -> DaySpec:
    """The scenario's `day:` section, or the documented default day (DAY.md §1)."""
    return scenario.day or DaySpec()


def diurnal(spec: DaySpec, minute: float) -> float:
    """The share of the peak rate at `minute` of the day (UTC): the hour's factor, or a cosine that is 1 at
    `peak_hour` and 1/`peak_to_trough` twelve hours away."""
    hour = (minute / 60.0) % 24.0
    if spec.hourly:
        return spec.hourly[int(hour)]
    trough = 1.0 / spec.peak_to_trough
    return trough + (1.0 - trough) * (1.0 + math.cos(2.0 * math.pi * (hour - spec.peak_hour) / 24.0)) / 2.0


def window_count(scenario: Scenario, hours: float) -> int:
    """Re-plan windows in `hours` hours (at least one)."""
    return max(1, int(round(hours * 60.0 / scenario.replan_interval_min)))


def window_rates(scenario: Scenario, window: int) -> dict[str, float]:
    """Request rate per model in one re-plan window: the scenario's rate (the peak) × the diurnal share at the
    window's middle × its trace's burst factor in that window (the trace's windows replayed in turn)."""
    from coral_dagster.allocation.demand import window_rates as trace_windows
    from coral_dagster.allocation.inputs import scenario_traces

    spec = day_spec(scenario)
    middle = (window + 0.5) * scenario.replan_interval_min
    share = diurnal(spec, middle)
    rates = {m.model: m.rate_req_s * share for m in scenario.models}
    if not spec.bursts:
        return rates
    bursts = trace_windows({m: 1.0 for m in rates}, scenario_traces(scenario), scenario.replan_interval_min)
    factors = bursts[window % len(bursts)] if bursts else {}
    return {m: r * factors.get(m, 1.0) for m, r in rates.items()}


def peak_rates(scenario: Scenario, windows: int) -> dict[str, float]:
    """Per model, its highest window rate over the day: what a plan sized for the peak serves."""
    out: dict[str, float] = {}
    for w in range(windows):
        for m, r in window_rates(scenario, w).items():
            out[m] = max(out.get(m, 0.0), r)
    return out


def availability_window(scenario: Scenario, window: int) -> int:
    """The availability series' window that re-plan window `window` starts in (0 without a series)."""
    series = scenario.availability_model.series
    if series is None:
        return 0
    return int(window * scenario.replan_interval_min // series.window_min) % series.windows


def startup_s(spec: DaySpec, scenario: Scenario, template: Template) -> float:
    """Seconds from launch until an instance serves: boot, setup, and each node loading its share of the
    weights (the layers split over the template's nodes) at `weight_gbytes_per_s`, all nodes in parallel."""
    from coral_dagster.catalog.models import get_model

    weights_bytes = get_model(scenario.model(template.model).base).total_weight_bytes
    return _startup_s(spec, weights_bytes, sum(k for _, k in template.nodes.counts))


def _startup_s(spec: DaySpec, weights_bytes: float, nodes: int) -> float:
    """Boot, setup, and one node's share of `weights_bytes` (split over `nodes`) at `weight_gbytes_per_s`."""
    return 60.0 * (spec.boot_min + spec.setup_min) + weights_bytes / nodes / (spec.weight_gbytes_per_s * 1e9)


def drain_s(scenario: Scenario, model: str) -> float:
    """Seconds an instance removed at its model's mean request takes to finish what it holds: the prefill SLO plus
    the mean output tokens at the decode SLO (a request admitted just before the drain, served within its SLOs)."""
    from coral_dagster.allocation.demand import trace_stats

    m = scenario.model(model)
    return (m.prefill_slo_ms + trace_stats(m.trace).mean_output_tokens * m.decode_slo_ms) / 1000.0


def raw_demand(scenario: Scenario, rates: Mapping[str, float]) -> dict[tuple[str, str], float]:
    """Tokens/s per (model, phase) the rates bring, without headroom: what serving must carry."""
    from coral_dagster.allocation.demand import demand_tokens
    from coral_dagster.allocation.inputs import scenario_traces

    return demand_tokens(rates, scenario_traces(scenario), 1.0)


def lead_windows(scenario: Scenario) -> int:
    """Re-plan windows until an instance launched now surely serves: the longest start-up (boot, setup and the
    scenario's largest model's weights loaded by one node) in whole windows."""
    from coral_dagster.catalog.models import get_model

    weights = max(get_model(m.base).total_weight_bytes for m in scenario.models)
    longest_s = _startup_s(day_spec(scenario), weights, 1)
    return math.ceil(longest_s / (scenario.replan_interval_min * 60.0) - 1e-9)


def lookback_windows(scenario: Scenario) -> int:
    """Re-plan windows of observed rates a forecast looks back over (`LOOKBACK_MIN`, at least one)."""
    return max(1, int(round(LOOKBACK_MIN / scenario.replan_interval_min)))


def forecast_rates(scenario: Scenario, window: int, observed: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The rates window `window`'s re-plan sizes for: per model, the highest rate of the last hour's windows
    (`observed`, oldest first, this window's last), each carried along the diurnal shape to the highest share of
    the windows from this one until capacity launched now is up (`lead_windows`). A forecast from the day's shape
    and recent bursts, as forecast-aware autoscaling with a lead time does (DAY.md D3); never the future's bursts."""
    spec = day_spec(scenario)
    minutes = scenario.replan_interval_min
    recent = list(observed)[-lookback_windows(scenario):]
    ahead = max(diurnal(spec, (window + k + 0.5) * minutes) for k in range(lead_windows(scenario) + 1))
    out: dict[str, float] = {}
    for age, rates in enumerate(reversed(recent)):
        scale = ahead / diurnal(spec, (window - age + 0.5) * minutes)
        for m, r in rates.items():
            out[m] = max(out.get(m, 0.0), r * scale)
    return out
