"""The second admission bucket against a direct simulation of one FIFO queue per phase fed by what the buckets
admit of the whole trace: deep and fast enough to keep the capacity rule's target, and no more."""

from __future__ import annotations


import numpy as np
import pytest

from coral_dagster.allocation.planner import with_admission
from coral_dagster.catalog.scenarios import load_scenario
from coral_dagster.catalog.traces import load_trace
from coral_dagster.routing import Admission, admission_shares
from support.admission_plans import aggregated_plan as _aggregated_plan

RATE, WINDOW_S = 10.0, 600.0


def _replayed(trace: str, loops: int):
    """The trace time-scaled to RATE requests/s and looped `loops` times (one loop's period: its span plus one mean
    gap), with its prompt and output lengths."""
    df = load_trace(trace)
    t = df.arrival_s.to_numpy(dtype=float)
    period = t[-1] + (t[-1] - t[0]) / (len(t) - 1)
    scale = len(t) / period / RATE
    arrival = np.concatenate([(t + k * period) * scale for k in range(loops)])
    lengths = (np.tile(df.prompt_tokens.to_numpy(float), loops), np.tile(df.output_tokens.to_numpy(float), loops))
    return arrival, *lengths, len(t)


def _worst_window(arrival, work, budget, capacity, first, last) -> float:
    """Request by request: FIFO waits at `capacity` units/s, then the least share within budget over the windows
    of WINDOW_S seconds starting at each request in [first, last)."""
    free, met = 0.0, []
    for a, w, b in zip(arrival.tolist(), work.tolist(), budget.tolist()):
        start = max(free, a)
        met.append(start - a <= b)
        free = start + w / capacity
    worst, hi = 1.0, 0
    done = np.r_[0, np.cumsum(met)]
    for lo in range(first, last):
        while hi < len(arrival) and arrival[hi] < arrival[lo] + WINDOW_S:
            hi += 1
        worst = min(worst, (done[hi] - done[lo]) / (hi - lo))
    return worst


def _direct(plan, model, share, factors, peak):
    """The worst window share met over the phases when the plan's buckets (the second one `peak`) admit from
    three loops of the model's whole trace, windows starting anywhere in the first two (from the start: the share
    bucket empty, the second full, queues empty), each phase one FIFO queue of the plan's capacity (served share ×
    capacity factor × the trace's mean work rate)."""
    arrival, prompt, output, n = _replayed(model.trace, 3)
    buckets = Admission(plan.admission.admit_req_s, plan.admission.admit_depth_req, {model.model: peak},
                        shares=admission_shares(plan))
    keep = np.array(buckets.admits(model.model, arrival.tolist()))
    t = arrival[keep]
    first, last = 0, np.searchsorted(t, arrival[2 * n])
    out = {}
    for phase, slo_ms in (("prefill", model.prefill_slo_ms), ("decode", model.decode_slo_ms)):
        slack = (1.0 - model.slo_margin) * slo_ms / 1000.0
        work = prompt if phase == "prefill" else output
        budget = np.full(len(work), slack) if phase == "prefill" else slack * np.maximum(output - 1.0, 0.0)
        capacity = share * factors[phase] * RATE * work[:n].mean()
        out[phase] = _worst_window(t, work[keep], budget[keep], capacity, int(first), int(last))
    return min(out.values())


def _passed(plan, model, peak) -> int:
    """How many of the last two of three loops of the model's whole trace the plan's first bucket and the second
    bucket `peak` admit (None: the first alone); the first loop starts the buckets."""
    arrival, _, _, n = _replayed(model.trace, 3)
    adm = plan.admission
    return sum(Admission(adm.admit_req_s, adm.admit_depth_req, {model.model: peak} if peak else None,
                         shares=admission_shares(plan)).admits(model.model, arrival.tolist())[n:])


@pytest.mark.parametrize("prefill_factor, decode_factor", [(4.0, 4.0), (2.6, 2.2), (2.6, 1.8)])
def test_the_second_bucket_keeps_the_target_and_the_promised_rate(prefill_factor, decode_factor):
    """phi-4 of core served at 30% of 10 req/s with capacity factors `prefill_factor`, `decode_factor` over its
    mean rate (the bucket kept, cut shallower, slowed): what the buckets admit of the whole Azure conversation
    trace meets the 95% target in every 10-minute window of both phases' direct queues, and the second bucket sheds
    at most 2% of what the first passes (the share the plan promises). Where the bucket the thinned trace needs
    (`admission_depth_req` at the rate the capacity carries) would miss the target, the bucket is cut: shallower
    (one request deeper misses) or refilling slower (one step faster, at the depth that keeps the promise,
    misses)."""
    from coral_dagster.allocation.capacity import REFILL_STEP, admission_depth_req, delivery_depth_req

    phi4 = next(m for m in load_scenario("core").models if m.model == "phi-4")
    share, factors = 0.3, {"prefill": prefill_factor, "decode": decode_factor}
    made = _aggregated_plan({}, served=share, factors={("phi-4", p): f for p, f in factors.items()})
    plan = with_admission(made, {"phi-4": RATE}, [phi4])
    rate, depth = plan.admission.admit_peak["phi-4"]
    carried = RATE * share * min(factors.values())
    thinned = (carried, admission_depth_req(phi4.trace, RATE, share, carried))
    target = phi4.attainment_target
    admitted = plan.admission.admit_req_s["phi-4"]
    assert admitted < rate <= carried + 1e-9
    assert _direct(plan, phi4, share, factors, (rate, depth)) >= target
    assert _passed(plan, phi4, (rate, depth)) >= 0.98 * _passed(plan, phi4, None)
    if (rate, depth) == thinned:
        return
    assert _direct(plan, phi4, share, factors, thinned) < target
    if rate < carried - 1e-9:
        faster = rate * REFILL_STEP
        keeps = delivery_depth_req(phi4.trace, RATE, admitted, plan.admission.admit_depth_req["phi-4"], faster)
        assert _direct(plan, phi4, share, factors, (faster, keeps)) < target
    else:
        assert _direct(plan, phi4, share, factors, (rate, depth + 1.0)) < target
