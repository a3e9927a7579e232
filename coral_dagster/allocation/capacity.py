"""Burst-aware capacity: how far above its mean token rate each (model, phase) must be served to meet its SLO
attainment target in every window of its own trace.

The rule: replay the model's trace at its request rate (the simulator's time scaling, the whole trace looped, the
first loop warming the queue) into one fluid FIFO server of capacity c tokens/s, whose work per request is its
prompt (prefill) or output tokens (decode). A request's queueing delay is Lindley's
W_n = max(0, W_{n-1} + S_{n-1} − (A_n − A_{n-1})), S = tokens / c. The factor is the least c, over the mean token
rate, at which in every window of `ATTAINMENT_WINDOW_S` seconds of arrivals (one starting at each request of the
second loop) a share `target` of the requests wait no longer than the slack the templates leave them: a plan is
judged on a stretch of traffic (a simulation, an hour of service), not on the trace's average, and the Azure traces'
worst 10-minute windows queue far more than their mean (at the whole-trace factor phi-4's prefill keeps 87% in its
worst window). Templates plan every step within `slo_margin` of its budget, so prefill may wait
(1 − slo_margin) × its TTFT SLO and decode (1 − slo_margin) × its TPOT SLO × (output tokens − 1) (a wait before
the first decode step stretches mean TPOT). The router splits a model's stream over its instances in fixed proportions
(`coral_dagster.routing`), so each instance sees a scaled copy of the same fluid stream and the aggregate queue is
each instance's queue.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np

from coral_dagster.catalog.traces import load_trace

ATTAINMENT_WINDOW_S = 600.0
# The share of the first admission bucket's requests the second may shed (`delivery_depth_req`).
DELIVERY_LOSS = 0.02
# The second bucket's refill is tried this many times slower at each step below the carried rate (`peak_bucket`).
REFILL_STEP = 1.05


@dataclass(frozen=True)
class PhaseCapacity:
    """The capacity rule's answer for one (model, phase): factor over the mean rate and what it was fitted on."""

    model: str
    phase: str
    factor: float
    budget_ms: float
    target: float
    attained: float
    window_s: float = ATTAINMENT_WINDOW_S

    def as_dict(self) -> dict:
        return {"model": self.model, "phase": self.phase, "factor": self.factor, "budget_ms": self.budget_ms,
                "target": self.target, "attained": self.attained, "window_s": self.window_s}


def fluid_waits(arrival_s: np.ndarray, work: np.ndarray, capacity: float) -> np.ndarray:
    """Lindley's waiting times of a FIFO server doing `work` units per request at `capacity` units/s (vectorised:
    W_n = P_n − min_{k≤n} P_k with P the running sum of service minus inter-arrival time)."""
    service = work / capacity
    steps = np.r_[0.0, service[:-1] - np.diff(arrival_s)]
    running = np.cumsum(steps)
    return running - np.minimum.accumulate(np.minimum(running, 0.0))


def worst_window_share(arrival_s: np.ndarray, met: np.ndarray, window_s: float, starts: slice) -> float:
    """The smallest share of `met` requests among those arriving in [a_i, a_i + window_s), over the windows that
    start at the requests `starts` (arrivals sorted); a window running past the last arrival is cut there."""
    if not len(arrival_s[starts]):
        return 1.0
    done = np.r_[0, np.cumsum(met, dtype=np.int64)]
    lo = np.arange(len(arrival_s))[starts]
    hi = np.searchsorted(arrival_s, arrival_s[lo] + window_s, side="left")
    return float(np.min((done[hi] - done[lo]) / (hi - lo)))


def _met(arrival_s, work, budget_s, capacity: float, n: int, window_s: float) -> float:
    waits = fluid_waits(arrival_s, work, capacity)
    return worst_window_share(arrival_s, waits <= budget_s, window_s, slice(n, 2 * n))


@lru_cache(maxsize=256)
def _stream(trace: str, rate_req_s: float, loops: int = 2):
    """The trace's arrivals time-scaled to `rate_req_s` (as the simulator replays it), `loops` loops; lengths."""
    df = load_trace(trace)
    t = df.arrival_s.to_numpy(dtype=float)
    n = len(t)
    period_s = t[-1] + (t[-1] - t[0]) / max(n - 1, 1)
    scale = (n / period_s) / rate_req_s
    arrival = np.concatenate([t + k * period_s for k in range(loops)]) * scale
    prompt = np.tile(df.prompt_tokens.to_numpy(dtype=float), loops)
    output = np.tile(df.output_tokens.to_numpy(dtype=float), loops)
    return arrival, prompt, output, n


def trace_period_s(trace: str, rate_req_s: float) -> float:
    """How long one loop of the trace lasts replayed at `rate_req_s`."""
    arrival, _, _, n = _stream(trace, rate_req_s)
    return float(arrival[n] - arrival[0])


def _phase_load(phase: str, prompt: np.ndarray, output: np.ndarray, slack_s: float):
    """Each request's work in the phase (prompt or output tokens) and the wait its slack allows it."""
    if phase == "prefill":
        return prompt, np.full(len(prompt), slack_s)
    return output, slack_s * np.maximum(output - 1.0, 0.0)


@lru_cache(maxsize=1024)
def phase_capacity(model: str, phase: str, trace: str, rate_req_s: float, slo_ms: float, slo_margin: float,
                   target: float, window_s: float = ATTAINMENT_WINDOW_S) -> PhaseCapacity:
    """The least capacity factor (≥ 1, to 0.5%) at which, in every `window_s` window of the trace's second loop, a
    share `target` of the requests of this phase wait within their slack in the fluid queue fed by the trace."""
    period_s = trace_period_s(trace, rate_req_s)
    arrival, prompt, output, n = _stream(trace, rate_req_s, 2 + int(np.ceil(window_s / period_s)))
    slack_s = (1.0 - slo_margin) * slo_ms / 1000.0
    work, budget = _phase_load(phase, prompt, output, slack_s)
    mean_rate = float(work[:n].sum()) / (arrival[n] - arrival[0]) if n else 0.0

    def met(factor: float) -> float:
        return _met(arrival, work, budget, max(factor * mean_rate, 1e-9), n, window_s)

    if mean_rate <= 0 or met(1.0) >= target:
        return PhaseCapacity(model, phase, 1.0, slack_s * 1000.0, target, met(1.0), window_s)
    lo, hi = 1.0, 2.0
    while met(hi) < target:
        lo, hi = hi, hi * 2.0
    while hi / lo > 1.005:
        mid = (lo * hi) ** 0.5
        lo, hi = (lo, mid) if met(mid) >= target else (mid, hi)
    return PhaseCapacity(model, phase, hi, slack_s * 1000.0, target, met(hi), window_s)


def scenario_capacity(scenario, rates=None, boost=None) -> dict[tuple[str, str], PhaseCapacity]:
    """The rule for every model and phase of a scenario at its rates (or `rates`), times the closed loop's extra
    `boost` per model where given."""
    out = {}
    for m in scenario.models:
        rate = (rates or {}).get(m.model, m.rate_req_s)
        if rate <= 0:
            continue
        for phase, slo in (("prefill", m.prefill_slo_ms), ("decode", m.decode_slo_ms)):
            cap = phase_capacity(m.model, phase, m.trace, float(rate), float(slo), float(m.slo_margin),
                                 float(m.attainment_target))
            extra = (boost or {}).get(m.model, 1.0)
            if extra != 1.0:
                cap = replace(cap, factor=cap.factor * extra)
            out[(m.model, phase)] = cap
    return out


@lru_cache(maxsize=256)
def admission_depth_req(trace: str, rate_req_s: float, share: float, refill_req_s: float) -> float:
    """The token-bucket depth (requests) at which the trace replayed at `rate_req_s` (looped twice, as the rule
    loops it), thinned to `share` of its requests, is never shed by a bucket refilling at `refill_req_s`: the
    largest backlog of that thinned stream, each arrival counting `share` of a request, against the refill rate
    (Lindley's recursion via `fluid_waits`), plus one request for the rounding of a thinning to whole requests."""
    arrival, _, _, _ = _stream(trace, rate_req_s)
    refill = refill_req_s
    if refill <= 0:
        return 1.0
    backlog = fluid_waits(arrival, np.full(len(arrival), share), refill) * refill + share
    return float(np.ceil(backlog.max())) + 1.0


@lru_cache(maxsize=256)
def peak_bucket(trace: str, rate_req_s: float, admit_req_s: float, admit_depth_req: float, carried_req_s: float,
                max_depth_req: float, phases: tuple[tuple[str, float, float], ...], slo_margin: float, target: float,
                window_s: float = ATTAINMENT_WINDOW_S) -> tuple[float, float]:
    """The second admission bucket (refill req/s, depth requests), at most as fast as `carried_req_s` (the request
    rate the plan's capacity carries) and never so shallow that it sheds what the first bucket (the share bucket of
    `routing.Admission`: `admit_req_s` / `rate_req_s` of the requests, credit saved up to `admit_depth_req`) passes
    of the trace replayed at `rate_req_s`: at least `delivery_depth_req` deep at its refill. A bucket shallower than
    a burst sheds the tail of every burst the first admits (one request deep at the admitted rate, a stream offered
    at twice that rate keeps two thirds of it), so the model would get less than the share the plan promises.

    Within that, what the buckets admit of the whole trace should meet the rule's criterion in every phase (in every
    `window_s` window starting in the first two loops, a share `target` of the admitted requests wait within their
    slack in the fluid queue of the plan's capacity for the phase; from the start, as a coordinator starts: the
    share bucket empty, the second full, queues empty): refilling at `carried_req_s`, `max_depth_req` deep where
    that meets it; else the deepest that does (to one request) where that delivers; else the fastest refill above
    `admit_req_s`, in steps of `REFILL_STEP` down from `carried_req_s`, that meets it at its delivering depth; else
    the carried rate at its delivering depth (the promise first: the fluid queue serves a burst's requests one after
    the other at the whole capacity, so it judges a short burst harsher than batching instances do; the simulation
    checks the admitted requests' attainment, `bench.scarcity_goodput`). `phases` holds per phase (phase, SLO ms,
    capacity in units of the trace's mean rate at `rate_req_s`, e.g. served share × capacity factor)."""
    from coral_dagster.routing import Admission

    period_s = trace_period_s(trace, rate_req_s)
    arrival, prompt, output, n = _stream(trace, rate_req_s, 2 + int(np.ceil(window_s / period_s)))
    share = admit_req_s / rate_req_s
    loads = []
    for phase, slo_ms, capacity in phases:
        work, budget = _phase_load(phase, prompt, output, (1.0 - slo_margin) * slo_ms / 1000.0)
        loads.append((work, budget, max(capacity * float(work[:n].sum()) / (arrival[n] - arrival[0]), 1e-9)))

    def delivery(refill: float) -> float:
        return delivery_depth_req(trace, rate_req_s, admit_req_s, admit_depth_req, refill)

    def meets(refill: float, depth: float) -> bool:
        keep = np.array(Admission({"m": admit_req_s}, {"m": admit_depth_req}, {"m": (refill, depth)},
                                  shares={"m": share}).admits("m", arrival.tolist()))
        t = arrival[keep]
        starts = slice(0, int(np.searchsorted(t, arrival[2 * n])))
        return all(worst_window_share(t, fluid_waits(t, work[keep], cap) <= budget[keep], window_s, starts)
                   >= target for work, budget, cap in loads)

    if meets(carried_req_s, max_depth_req):
        return carried_req_s, float(max_depth_req)
    lo, hi = 1.0, float(max_depth_req)
    while hi - lo > 1.0:
        mid = float(np.floor((lo + hi) / 2.0))
        lo, hi = (mid, hi) if meets(carried_req_s, mid) else (lo, mid)
    floor = delivery(carried_req_s)
    if lo >= floor and meets(carried_req_s, lo):
        return carried_req_s, lo
    refill = carried_req_s / REFILL_STEP
    while refill > admit_req_s:
        if meets(refill, delivery(refill)):
            return refill, delivery(refill)
        refill /= REFILL_STEP
    return carried_req_s, floor


@lru_cache(maxsize=256)
def delivery_depth_req(trace: str, rate_req_s: float, admit_req_s: float, admit_depth_req: float,
                       carried_req_s: float) -> float:
    """The least depth (to one request, at most the first bucket's) of a second bucket refilling at `carried_req_s`
    at which the two buckets admit at least (1 − `DELIVERY_LOSS`) of what the first bucket alone admits of the
    trace replayed at `rate_req_s` (three loops, counted after the first, which starts the buckets; the first is
    the share bucket of `routing.Admission` at `admit_req_s` / `rate_req_s`): the second bucket then caps how fast
    a burst enters, not how much of the promised share gets in."""
    from coral_dagster.routing import Admission

    arrival, _, _, n = _stream(trace, rate_req_s, 3)
    times = arrival.tolist()
    share = {"m": admit_req_s / rate_req_s}
    alone = sum(Admission({"m": admit_req_s}, {"m": admit_depth_req}, shares=share).admits("m", times)[n:])

    def delivers(depth: float) -> bool:
        both = Admission({"m": admit_req_s}, {"m": admit_depth_req}, {"m": (carried_req_s, depth)}, shares=share)
        return sum(both.admits("m", times)[n:]) >= (1.0 - DELIVERY_LOSS) * alone

    if delivers(1.0):
        return 1.0
    lo, hi = 1.0, float(max(admit_depth_req, 1.0))
    while hi - lo > 1.0:
        mid = float(np.floor((lo + hi) / 2.0))
        lo, hi = (lo, mid) if delivers(mid) else (mid, hi)
    return hi
