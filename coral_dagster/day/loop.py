"""The day loop: each re-plan window the sensor decides, the planner re-plans from the running plan, the reconciler
deploys onto the simulated cloud (failing over where it refuses), and the window's traffic is served by what is up.

Time is simulated: a window starts at `window × replan_interval_min`. Launched instances serve once started
(`shape.startup_s`); removed ones serve until their replacements are up (the reconciler raises capacity before
it lowers it) and are billed through their drain (`shape.drain_s`); the day starts warm (window 0's plan is up
at 0:00). Serving is a fluid estimate over the window's segments between those moments, not a request-level
simulation: admission admits of each model the share of its demand the plan serves (`with_admission`), the plan
holds its attainment target on what it admits when the capacity the rule sizes for that is up, and each model's
attainment in the window is the time-weighted share of that capacity that is up (start-up lag and refused launches
lower it). Re-plans size for a forecast (`shape.forecast_rates`: the last hour's peak carried along the day's shape
until launches are up) or, with `sizing="window"`, for the window's own rates; nodes held stay held when the
market's free pool shrinks, unless they run on spot (`day: spot`): then the cloud takes back those beyond the
window's supply as it starts, and preempts others at random within it; what ran on them stops at that moment and
is replaced by the next reconcile.
With `serve_mode="requests"` the segments are served request by request instead (`day.serve`): the instances up in
a segment serve that segment's arrivals in the event-driven simulator, behind admission recomputed for the capacity
up. Requests still running at a segment's end finish on that segment's instances (a removed instance finishes what
it holds; one coming up takes only requests that arrive after it is up).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timedelta, timezone
from typing import Callable, Mapping

import pandas as pd

from coral_dagster.allocation.demand import trace_stats
from coral_dagster.allocation.inputs import capacity_factors
from coral_dagster.allocation.types import Plan, PlannedInstance
from coral_dagster.catalog.market import MarketSnapshot
from coral_dagster.catalog.nodes import NodeConfig
from coral_dagster.catalog.scenarios import Scenario
from coral_dagster.day.cloud import SimCloud, SimDrainer
from coral_dagster.day.serve import SERVE_MODES, Segment, WindowServing, serve_window
from coral_dagster.day.shape import (SIZINGS, availability_window, day_spec, drain_s, forecast_rates, lookback_windows,
                                     raw_demand, startup_s, window_count, window_rates)
from coral_dagster.day.spot import spot_nodes
from coral_dagster.day.windows import WindowInputs
from coral_dagster.deploy import state
from coral_dagster.deploy.reconcile import reconcile
from coral_dagster.deploy.spec import GPU_ROLES
from coral_dagster.errors import UnknownNameError
from coral_dagster.reallocation import PlanState, decide_replan
from coral_dagster.store import Store
from coral_dagster.templates.types import Template
from coral_dagster.vocab import DEMAND_PHASES

# A (region, node) the cloud refused is re-planned around at most this many times per window.
MAX_FAILOVERS = 3
DAY_START = datetime(2026, 1, 5, tzinfo=timezone.utc)  # a Monday, 0:00 UTC: window 0's moment

Planner = Callable[[Mapping[str, float], MarketSnapshot, "Plan | None"], Plan]


@dataclass(frozen=True)
class WindowRow:
    """One re-plan window of the day: demand, what was served, what it cost and what the loop did."""

    window: int
    start_min: float
    demand_tokens_per_s: float
    capacity_tokens_per_s: float
    served_share: float
    worst_attainment: float
    worst_model: str
    slo_tokens: float
    demanded_tokens: float
    cost_usd: float
    plan_usd_per_hour: float
    replanned: bool
    reasons: str
    replan_s: float
    nodes_launched: int
    nodes_stopped: int
    nodes_failed: int
    blocked: str
    mixed_share: float
    plan_id: str
    worst_admitted_attainment: float = 1.0
    nodes_preempted: int = 0


@dataclass(frozen=True)
class DayResult:
    """A simulated day of one method on one scenario."""

    scenario: str
    method: str
    hours: float
    replan_interval_min: float
    windows: tuple[WindowRow, ...]
    serve_mode: str = "fluid"
    sizing: str = "forecast"

    @property
    def cost_usd(self) -> float:
        return sum(w.cost_usd for w in self.windows)

    @property
    def slo_tokens(self) -> float:
        return sum(w.slo_tokens for w in self.windows)

    @property
    def usd_per_million_slo_tokens(self) -> float:
        return self.cost_usd / self.slo_tokens * 1e6 if self.slo_tokens > 0 else math.inf

    @property
    def worst_window(self) -> WindowRow:
        return min(self.windows, key=lambda w: (w.worst_attainment, w.window))

    def as_dict(self) -> dict:
        worst = self.worst_window
        return {"scenario": self.scenario, "method": self.method, "serve_mode": self.serve_mode, "sizing": self.sizing,
                "hours": self.hours,
                "replan_interval_min": self.replan_interval_min, "cost_usd": self.cost_usd,
                "cost_usd_per_day": self.cost_usd * 24.0 / self.hours if self.hours else 0.0,
                "slo_tokens": self.slo_tokens, "usd_per_million_slo_tokens": self.usd_per_million_slo_tokens,
                "served_share": (sum(w.served_share * w.demanded_tokens for w in self.windows)
                                 / max(1e-12, sum(w.demanded_tokens for w in self.windows))),
                "worst_window": {"window": worst.window, "worst_attainment": worst.worst_attainment,
                                 "worst_model": worst.worst_model},
                "max_replan_s": max((w.replan_s for w in self.windows), default=0.0),
                "nodes_launched": sum(w.nodes_launched for w in self.windows),
                "nodes_failed": sum(w.nodes_failed for w in self.windows),
                "nodes_preempted": sum(w.nodes_preempted for w in self.windows),
                "windows": [asdict(w) for w in self.windows]}


@dataclass
class _Instance:
    """A deployed instance in simulated seconds: when it was launched, serves from, serves until, is billed until."""

    template: Template
    region: str
    usd_per_hour: float
    ready_s: float
    start_s: float
    serve_until_s: float = math.inf
    bill_until_s: float = math.inf


@dataclass
class DayLoop:
    """Runs one scenario's day with `planner` (the method's re-plan from the running plan) on a scratch `store`
    holding the simulated deployment; `static` plans once (the first window's inputs) and never re-plans."""

    scenario: Scenario
    method: str
    planner: Planner
    store: Store
    prices: pd.DataFrame
    static_rates: Mapping[str, float] | None = None
    failure_rate: float = 0.0
    savings_threshold: float = 0.05
    seed: int = 0
    # What the cloud really gives per (window, region, node), where it differs from the market snapshot the
    # planner sees (a stale snapshot, a what-if); None: the snapshot's counts.
    cloud_capacity: Callable[[int, str, str], int] | None = None
    # "fluid": the time-weighted capacity estimate; "requests": each segment in the event-driven simulator.
    serve_mode: str = "fluid"
    # Keep every window's segment runs (sub-plans, arrivals, engine output) in `served`; else their sums alone.
    keep_runs: bool = False
    # "forecast": re-plans size for the last hour's peak carried along the day's shape until launches are up;
    # "window": for the window's own rates (`shape.SIZINGS`).
    sizing: str = "forecast"
    # Keep every window's serving inputs (plan, segments, rates) in `kept`, to serve the windows apart later.
    keep_segments: bool = False
    instances: dict[str, _Instance] = field(default_factory=dict)
    adopted: list[Plan] = field(default_factory=list)
    served: list[WindowServing] = field(default_factory=list)
    kept: list[WindowInputs] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.serve_mode not in SERVE_MODES:
            raise UnknownNameError("serve mode", self.serve_mode, SERVE_MODES)
        if self.sizing not in SIZINGS:
            raise UnknownNameError("sizing", self.sizing, SIZINGS)

    def run(self, hours: float = 24.0, progress: Callable[[WindowRow], None] | None = None) -> DayResult:
        interval_s = self.scenario.replan_interval_min * 60.0
        market_now: dict[str, MarketSnapshot] = {}
        window_now = [0]

        def capacity(region: str, node: str) -> int:
            if self.cloud_capacity is not None:
                return self.cloud_capacity(window_now[0], region, node)
            return market_now["m"].availability(region, NodeConfig.parse(node))

        spec = day_spec(self.scenario)
        on_spot = spot_nodes(self.prices) if spec.spot else set()
        cloud = SimCloud(capacity, failure_rate=self.failure_rate, seed=self.seed,
                         spot=lambda region, node: (region, node) in on_spot,
                         preemptions_per_day=spec.preemptions_per_day)
        drainer = SimDrainer()
        running: Plan | None = None
        pending = False
        rows = []
        # The day starts warm: yesterday's last hour of rates is the forecast's first history.
        observed = [window_rates(self.scenario, w) for w in range(-lookback_windows(self.scenario), 0)]
        for w in range(window_count(self.scenario, hours)):
            t0 = w * interval_s
            market = self.scenario.market(window=availability_window(self.scenario, w), prices=self.prices,
                                          taken_at=DAY_START + timedelta(seconds=t0))
            market_now["m"], window_now[0] = market, w
            # Spot nodes beyond the window's supply are taken back as it starts; what ran on them is replaced.
            preempted = self._preempt(cloud, [(name, t0) for name in cloud.reclaim()])
            pending = pending or preempted > 0
            rates = window_rates(self.scenario, w)
            observed.append(rates)
            if self.static_rates is not None:
                plan_rates = dict(self.static_rates)
            else:
                plan_rates = forecast_rates(self.scenario, w, observed) if self.sizing == "forecast" else rates
            # Nodes held stay held when the market's free pool shrinks: the planner may keep what is up.
            market = _held_market(market, cloud)
            plan, replan_s, reasons = running, 0.0, ""
            if running is None or self.static_rates is None:
                plan, replan_s, reasons = self._decide(plan_rates, market, running)
            launched = failed = 0
            blocked: dict[tuple[str, str], int] = {}
            refused_seen = len(cloud.refused)
            assert plan is not None
            plan_id = plan.plan_id
            # The running plan with nothing left pending: a reconcile would change nothing (it is idempotent).
            settled = plan is running and not pending
            for attempt in range(0 if settled else MAX_FAILOVERS + 1):
                before = set(cloud.up)
                if plan is not running:
                    plan_id = f"{self.method}-w{w}-a{attempt}"
                report = reconcile(plan, plan_id, self.store, cloud, drainer, self.prices,
                                   engine=self.scenario.engine)
                launched += len(set(cloud.up) - before)
                failed += len(report.failed)
                refused = cloud.refused[refused_seen:]
                pending = bool(report.failed)
                if not refused or attempt == MAX_FAILOVERS or self.static_rates is not None:
                    break
                refused_seen = len(cloud.refused)
                for region, node in refused:
                    blocked[(region, node)] = cloud.in_use(region, node)
                market = _blocked_market(market, blocked)
                started = time.perf_counter()
                plan = self.planner(plan_rates, market, running)
                replan_s += time.perf_counter() - started
            stopped = self._track(plan, t0)
            running = replace(plan, plan_id=plan_id)
            self.adopted.append(running)
            hit = self._preempt(cloud, [(name, t0 + dt) for name, dt in cloud.preempt(interval_s)])
            pending = pending or hit > 0
            row = self._serve(w, t0, interval_s, rates, running, replan_s, reasons, launched, stopped, failed,
                              blocked)
            row = replace(row, nodes_preempted=preempted + hit)
            rows.append(row)
            if progress is not None:
                progress(row)
        return DayResult(self.scenario.name, self.method, hours, self.scenario.replan_interval_min, tuple(rows),
                         self.serve_mode, self.sizing)

    def _decide(self, rates: Mapping[str, float], market: MarketSnapshot,
                running: Plan | None) -> tuple[Plan, float, str]:
        """The sensor's decision on a candidate re-planned from the running plan: (plan to run, seconds, reasons)."""
        started = time.perf_counter()
        candidate = self.planner(rates, market, running)
        replan_s = time.perf_counter() - started
        available = {(o.region, str(o.node)): o.available_nodes for o in market.offers}
        current = None if running is None else PlanState(
            running.plan_id, dict(running.served_tokens_per_s), running.nodes_used(), running.cost_usd_per_hour)
        decision = decide_replan(current, dict(candidate.demand_tokens_per_s), available,
                                 candidate_cost_usd_per_hour=candidate.cost_usd_per_hour,
                                 churn_usd_per_hour=candidate.churn_usd_per_hour,
                                 savings_threshold=self.savings_threshold)
        if decision.replan or running is None:
            return candidate, replan_s, "; ".join(decision.reasons)
        return running, replan_s, ""

    def _preempt(self, cloud: SimCloud, hits: list[tuple[str, float]]) -> int:
        """Spot clusters taken back at the given moments: each one's whole instance stops serving and billing then
        (a pipeline cannot serve without a stage; its other nodes are downed with it) and is recorded down, so the
        next reconcile launches a replacement. Returns the nodes preempted."""
        if not hits:
            return 0
        nodes = state.read_nodes(self.store)
        instance_of = dict(zip(nodes.cluster_name, nodes.instance_id))
        when: dict[str, float] = {}
        for name, t in hits:
            iid = str(instance_of[name])
            when[iid] = min(t, when.get(iid, math.inf))
        with self.store.transaction() as con:
            for iid, t in sorted(when.items()):
                for name in nodes.cluster_name[(nodes.instance_id == iid) & (nodes.status == "launched")]:
                    state.set_status(con, str(name), "down", f"preempt-{iid}", "preempted",
                                     "spot node taken back (simulated)")
                inst = self.instances.get(iid)
                if inst is not None:
                    inst.serve_until_s = min(inst.serve_until_s, t)
                    inst.bill_until_s = min(inst.bill_until_s, t)
        for name in nodes.cluster_name[nodes.instance_id.isin(list(when))]:
            cloud.down(str(name))
        return len(hits)

    def _track(self, plan: Plan, t0: float) -> int:
        """Read the deployment the reconciler recorded and update each instance's serving and billing times;
        returns the nodes stopped."""
        templates = {i.template.template_id: i.template for i in plan.instances}
        nodes = state.read_nodes(self.store)
        nodes = nodes[nodes.role.isin(GPU_ROLES)]
        spec = day_spec(self.scenario)
        new: list[_Instance] = []
        gone: list[_Instance] = []
        stopped = 0
        for iid, rows in nodes.groupby("instance_id", sort=True):
            key = str(iid)
            live = bool((rows.status == "launched").all())
            if live and key not in self.instances:
                template = templates[str(rows.template_id.iloc[0])]
                # The day starts warm: the first window's plan is up at 0:00, as yesterday's would be.
                ready = t0 if t0 == 0 else t0 + startup_s(spec, self.scenario, template)
                inst = _Instance(template, str(rows.region.iloc[0]), float(rows.usd_per_hour.sum()), ready, t0)
                self.instances[key] = inst
                new.append(inst)
            elif not live and key in self.instances and math.isinf(self.instances[key].serve_until_s):
                gone.append(self.instances[key])
                stopped += len(rows)
        switch = max([i.ready_s for i in new], default=t0)
        for inst in gone:
            inst.serve_until_s = switch
            inst.bill_until_s = switch + drain_s(self.scenario, inst.template.model)
        return stopped

    def _serve(self, w: int, t0: float, interval_s: float, rates: Mapping[str, float], plan: Plan,
               replan_s: float, reasons: str, launched: int, stopped: int, failed: int,
               blocked: Mapping[tuple[str, str], int]) -> WindowRow:
        """The window's serving (fluid estimate, or request by request per segment) and its bill."""
        t1 = t0 + interval_s
        need = raw_demand(self.scenario, rates)
        ppo = {m.model: trace_stats(m.trace).prompt_per_output for m in self.scenario.models}
        planned: dict[tuple[str, str], float] = {}
        for pi in plan.instances:
            for phase in DEMAND_PHASES:
                key = (pi.template.model, phase)
                planned[key] = planned.get(key, 0.0) + pi.count * _contribution(pi.template, phase, ppo)
        # What admission admits: the share of this window's demand, sized by the capacity rule as the plan was,
        # that the plan's capacity carries (`with_admission`); a plan kept from another window is held to today's.
        factors = capacity_factors(self.scenario, rates)
        admitted = {m: min([1.0] + [planned.get((m, p), 0.0) / (d * factors.get((m, p), 1.0))
                                    for p in DEMAND_PHASES if (d := need.get((m, p), 0.0)) > 0])
                    for m in rates}
        # What the admitted traffic needs up to hold its target: the capacity rule's size for the window's demand,
        # or all the plan has where that is less (a plan sized ahead carries more than the window needs).
        required = {k: min(v, need.get(k, 0.0) * factors.get(k, 1.0)) for k, v in planned.items()}
        cuts = sorted({t0, t1} | {t for i in self.instances.values() for t in (i.ready_s, i.serve_until_s)
                                  if t0 < t < t1})
        up_share: dict[str, float] = {m: 0.0 for m in rates}
        segments: list[Segment] = []
        capacity_end = 0.0
        for a, b in zip(cuts, cuts[1:]):
            cap: dict[tuple[str, str], float] = {}
            up: dict[tuple[str, str], tuple[Template, int, float]] = {}
            for i in self.instances.values():
                if i.ready_s <= a and i.serve_until_s >= b:
                    for phase in DEMAND_PHASES:
                        key = (i.template.model, phase)
                        cap[key] = cap.get(key, 0.0) + _contribution(i.template, phase, ppo)
                    held = up.get((i.template.template_id, i.region))
                    up[(i.template.template_id, i.region)] = (i.template, (held[1] if held else 0) + 1,
                                                              i.usd_per_hour)
            for m in rates:
                keys = [(m, p) for p in DEMAND_PHASES if required.get((m, p), 0) > 0]
                up_share[m] += (b - a) * min([1.0] + [cap.get(k, 0.0) / required[k] for k in keys])
            capacity_end = sum(cap.values())
            segments.append(Segment(a, b, tuple(PlannedInstance(t, region, n, usd)
                                                for (_, region), (t, n, usd) in sorted(up.items())),
                                    {k: cap.get(k, 0.0) / v for k, v in planned.items() if v > 0}))
        tokens = {m: need.get((m, "prefill"), 0.0) + need.get((m, "decode"), 0.0) for m in rates}
        if self.keep_segments:
            self.kept.append(WindowInputs(w, plan, tuple(segments), dict(rates), self.seed))
        if self.serve_mode == "requests":
            serving = serve_window(self.scenario, plan, segments, rates, seed=self.seed, window=w)
            self.served.append(serving if self.keep_runs else replace(serving, runs=()))
            by_model = serving.by_model
            demanded = sum(s.offered_tokens for s in by_model.values())
            slo_tokens = sum(s.slo_tokens for s in by_model.values())
            served_tokens = sum(s.completed_tokens for s in by_model.values())
            attain = {m: s.attainment for m, s in by_model.items() if s.offered}
            admitted_attain = {m: s.admitted_attainment for m, s in by_model.items() if s.offered}
        else:
            covered = {m: up_share[m] / interval_s for m in rates}
            demanded = sum(tokens.values()) * interval_s
            slo_tokens = sum(tokens[m] * interval_s * admitted[m] * covered[m] for m in rates)
            served_tokens = sum(tokens[m] * interval_s * admitted[m] for m in rates)
            attain = {m: covered[m] for m in rates if tokens[m] > 0}
            admitted_attain = attain
        worst = min(attain, key=lambda m: (attain[m], m)) if attain else ""
        cost = sum(i.usd_per_hour * max(0.0, min(t1, i.bill_until_s) - max(t0, i.start_s)) / 3600.0
                   for i in self.instances.values())
        mixed = [i.count for i in plan.instances if not i.template.homogeneous]
        return WindowRow(w, t0 / 60.0, sum(tokens.values()), capacity_end,
                         served_tokens / demanded if demanded else 1.0, attain[worst] if worst else 1.0, worst,
                         slo_tokens, demanded, cost, plan.cost_usd_per_hour, bool(reasons), reasons, replan_s,
                         launched, stopped, failed,
                         ",".join(f"{r}/{n}" for r, n in sorted(blocked)),
                         sum(mixed) / max(1, sum(i.count for i in plan.instances)), plan.plan_id,
                         min(admitted_attain.values(), default=1.0))


def _contribution(template: Template, phase: str, prompt_per_output: Mapping[str, float]) -> float:
    """Tokens/s one instance adds to (its model, `phase`), as the planner counts it (`AllocationProblem`)."""
    if template.phase == phase:
        return template.tokens_per_s
    if template.phase == "aggregated":
        return template.tokens_per_s * (1.0 if phase == "decode" else prompt_per_output[template.model])
    return 0.0


def _held_market(market: MarketSnapshot, cloud: SimCloud) -> MarketSnapshot:
    """The snapshot with each (region, node) at least the nodes held there: a cloud's free pool shrinking takes
    no node already running (on-demand nodes are not reclaimed)."""
    held = {(o.region, str(o.node)): cloud.in_use(o.region, str(o.node)) for o in market.offers}
    if all(o.available_nodes >= held[(o.region, str(o.node))] for o in market.offers):
        return market
    offers = tuple(replace(o, available_nodes=max(o.available_nodes, held[(o.region, str(o.node))]))
                   for o in market.offers)
    return replace(market, snapshot_id=f"{market.snapshot_id}-held", offers=offers)


def _blocked_market(market: MarketSnapshot, blocked: Mapping[tuple[str, str], int]) -> MarketSnapshot:
    """The snapshot with each refused (region, node) capped at the nodes already held there."""
    offers = tuple(replace(o, available_nodes=min(o.available_nodes, blocked[(o.region, str(o.node))]))
                   if (o.region, str(o.node)) in blocked else o for o in market.offers)
    return replace(market, snapshot_id=f"{market.snapshot_id}-blocked{len(blocked)}", offers=offers)
