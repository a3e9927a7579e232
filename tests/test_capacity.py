"""The burst-aware capacity rule against independent oracles: M/M/1's closed-form waiting time, and a FIFO queue
simulated request by request on the trace itself (the rule must not under-size it, and is the least that works)."""

from __future__ import annotations

import numpy as np
import pytest

from coral_dagster.allocation.capacity import _stream, fluid_waits, phase_capacity


def _fifo_waits(arrival_s, work, capacity) -> np.ndarray:
    """One server, first come first served, simulated event by event: a request starts when it has arrived and
    the previous one is done."""
    waits, free_at = [], 0.0
    for a, w in zip(arrival_s.tolist(), work.tolist()):
        start = max(a, free_at)
        waits.append(start - a)
        free_at = start + w / capacity
    return np.array(waits)


@pytest.mark.parametrize("rho", [0.5, 0.8])
def test_fluid_waits_match_mm1(rho):
    """Poisson arrivals (rate 1), exponential work (mean 1), capacity 1/ρ: P(W > t) = ρ·exp(−(1/ρ)(1 − ρ)t)."""
    rng = np.random.default_rng(11)
    n = 400_000
    arrival = np.cumsum(rng.exponential(1.0, n))
    waits = fluid_waits(arrival, rng.exponential(1.0, n), 1.0 / rho)[n // 10:]
    for t in (0.0, 1.0, 3.0):
        assert np.mean(waits > t) == pytest.approx(rho * np.exp(-(1.0 / rho) * (1.0 - rho) * t), abs=0.01)


def test_fluid_waits_equal_an_event_by_event_queue():
    arrival, prompt, _, _ = _stream("azure-code", 10.0)
    k = slice(0, 5000)
    capacity = 3.0 * float(prompt[k].sum()) / (arrival[k][-1] - arrival[k][0])
    assert np.allclose(fluid_waits(arrival[k], prompt[k], capacity), _fifo_waits(arrival[k], prompt[k], capacity),
                       atol=1e-9)


@pytest.mark.parametrize("trace,phase,slo_ms,rate", [("azure-code", "prefill", 900.0, 10.0),
                                                     ("azure-conv", "prefill", 1200.0, 10.0),
                                                     ("azure-code", "decode", 30.0, 25.0),
                                                     ("azure-conv", "decode", 100.0, 10.0)])
def test_rule_sizes_the_trace_queue_for_its_target_and_no_more(trace, phase, slo_ms, rate):
    """At the rule's factor a FIFO queue fed by the trace (second loop, warm) keeps ≥ target of requests within
    their slack; 3% less capacity does not (unless the factor is the floor of 1)."""
    margin, target = 0.75, 0.95
    cap = phase_capacity("m", phase, trace, rate, slo_ms, margin, target)
    arrival, prompt, output, n = _stream(trace, rate)
    work = prompt if phase == "prefill" else output
    slack = (1 - margin) * slo_ms / 1000.0
    budget = np.full(len(work), slack) if phase == "prefill" else slack * np.maximum(output - 1, 0)
    mean_rate = work[:n].sum() / (arrival[n] - arrival[0])

    def attained(factor):
        return float(np.mean(_fifo_waits(arrival, work, factor * mean_rate)[n:] <= budget[n:]))

    assert attained(cap.factor) >= target
    if cap.factor > 1.0:
        assert attained(cap.factor / 1.03) < target
    assert cap.attained == pytest.approx(attained(cap.factor), abs=1e-9)
