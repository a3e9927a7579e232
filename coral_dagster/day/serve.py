"""Request-level serving of a day's window: per segment between instances coming up and going, the instances up then
serve that segment's arrivals in the event-driven simulator (`simulator.engine.Engine`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

import numpy as np

from coral_dagster.allocation.planner import with_admission
from coral_dagster.allocation.types import Plan, PlannedInstance
from coral_dagster.catalog.scenarios import Scenario
from coral_dagster.simulator.engine import Engine, EngineOutput
from coral_dagster.simulator.latency import ProfileLatencyModel
from coral_dagster.simulator.result import ModelSlo, build_result
from coral_dagster.simulator.workload import ModelLoad, Workload, make_workload

SERVE_MODES = ("fluid", "requests")


@dataclass(frozen=True)
class Segment:
    """A stretch of a window with one set of instances up: `instances` (counts per template and region) and, per
    (model, phase), their capacity over the window plan's (`up_share`; 1 where the plan plans none)."""

    start_s: float
    end_s: float
    instances: tuple[PlannedInstance, ...]
    up_share: Mapping[tuple[str, str], float]


@dataclass(frozen=True)
class ModelServed:
    """One model's requests over a window: offered, shed by admission, SLO-met, and their tokens."""

    offered: int = 0
    shed: int = 0
    met: int = 0
    offered_tokens: float = 0.0
    completed_tokens: float = 0.0
    slo_tokens: float = 0.0

    def __add__(self, other: ModelServed) -> ModelServed:
        return ModelServed(self.offered + other.offered, self.shed + other.shed, self.met + other.met,
                           self.offered_tokens + other.offered_tokens,
                           self.completed_tokens + other.completed_tokens, self.slo_tokens + other.slo_tokens)

    @property
    def attainment(self) -> float:
        """SLO-met over offered requests (a shed request is not met)."""
        return self.met / self.offered if self.offered else 1.0

    @property
    def admitted_attainment(self) -> float:
        """SLO-met over the requests admission let in."""
        admitted = self.offered - self.shed
        return self.met / admitted if admitted else 1.0


@dataclass(frozen=True)
class SegmentRun:
    """What one segment's simulation was given and what it returned."""

    segment: Segment
    plan: Plan
    workload: Workload
    output: EngineOutput | None


@dataclass(frozen=True)
class WindowServing:
    """A window served request by request: per model over all its segments, and each segment's run."""

    by_model: Mapping[str, ModelServed]
    runs: tuple[SegmentRun, ...] = field(default=())
    wall_s: float = 0.0


def window_seed(seed: int, window: int) -> int:
    """The arrivals' seed of one window: a stream of the day's seed, apart for every window."""
    return int(np.random.SeedSequence([seed, window]).generate_state(1)[0])


def segment_plan(plan: Plan, segment: Segment, rates: Mapping[str, float], scenario: Scenario) -> Plan:
    """The window's plan cut to the instances up in `segment`, serving the plan's share of each (model, phase) times
    the share of its capacity up (at most 1), admission recomputed for that (`with_admission`) so what the capacity
    up cannot serve is shed at the door; with all of the plan up, its admission is the plan's at the window's rates."""
    served = {k: v * min(1.0, segment.up_share.get(k, 1.0)) for k, v in plan.served_tokens_per_s.items()}
    bare = replace(plan.admission, admit_req_s={}, admit_depth_req={}, admit_peak={})
    cut = replace(plan, instances=segment.instances, served_tokens_per_s=served, admission=bare)
    return with_admission(cut, rates, scenario.models)


def window_workload(scenario: Scenario, rates: Mapping[str, float], duration_s: float, seed: int) -> Workload:
    """Each model's own trace replayed at its window rate over the window (`make_workload`, as `simulate_plan`)."""
    loads = [ModelLoad(m.model, m.trace, float(rates.get(m.model, 0.0))) for m in scenario.models]
    return make_workload(loads, duration_s, seed)


def segment_workload(workload: Workload, start_s: float, end_s: float) -> Workload:
    """The window's requests arriving in [start_s, end_s) (seconds into the window), timed from `start_s`: the
    window's arrivals are drawn once, so where the segments fall changes who serves a request, not the requests."""
    keep = (workload.arrival_s >= start_s) & (workload.arrival_s < end_s)
    return Workload(workload.models, workload.arrival_s[keep] - start_s, workload.model[keep],
                    workload.prompt_tokens[keep], workload.output_tokens[keep], end_s - start_s)


def serve_segment(plan: Plan, workload: Workload, scenario: Scenario) -> tuple[dict[str, ModelServed],
                                                                           EngineOutput | None]:
    """The plan serving the workload in the engine (requests running at the end finish: the engine's drain)."""
    if not len(workload):
        return {m: ModelServed() for m in workload.models}, None
    out = Engine(plan, workload, ProfileLatencyModel(), link_gbps=scenario.link_gbps).run()
    slos = {m.model: ModelSlo(m.model, m.prefill_slo_ms, m.decode_slo_ms) for m in scenario.models}
    req = build_result(out, workload, slos, scenario=scenario.name, method=plan.method, arrivals="trace", seed=0,
                       rate_scale=1.0, cost_usd_per_hour=0.0).requests
    tokens = req.prompt_tokens + req.output_tokens
    by_model = {}
    for name in workload.models:
        mine = req.model == name
        by_model[name] = ModelServed(int(mine.sum()), int((mine & (req.status == "shed")).sum()),
                                     int((mine & req.met_slo).sum()), float(tokens[mine].sum()),
                                     float(tokens[mine & (req.status == "completed")].sum()),
                                     float(tokens[mine & req.met_slo].sum()))
    return by_model, out


def serve_window(scenario: Scenario, plan: Plan, segments: Sequence[Segment], rates: Mapping[str, float], *,
                 seed: int, window: int) -> WindowServing:
    """Every segment of the window (in order, from the window's start) served request by request; the per-model
    sums over them."""
    started = time.perf_counter()
    totals = {m.model: ModelServed() for m in scenario.models}
    runs = []
    t0 = segments[0].start_s
    arrivals = window_workload(scenario, rates, segments[-1].end_s - t0, window_seed(seed, window))
    for seg in segments:
        sub = segment_plan(plan, seg, rates, scenario)
        workload = segment_workload(arrivals, seg.start_s - t0, seg.end_s - t0)
        served, out = serve_segment(sub, workload, scenario)
        totals = {m: totals[m] + served.get(m, ModelServed()) for m in totals}
        runs.append(SegmentRun(seg, sub, workload, out))
    return WindowServing(totals, tuple(runs), time.perf_counter() - started)
