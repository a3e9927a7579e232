"""The closed loop: simulate a plan on each model's own trace, raise the capacity of models that fall short, re-plan.

Round 0 is the plan the capacity rule sizes. Each round simulates the plan once without a break over every
model's whole trace loop plus one attainment window (`window_s`, the capacity rule's), so no stretch of any trace
is left out; a model's attainment is its worst over the windows that start at each of its requests in the first
loop (the share of its admitted requests meeting both SLOs), so no choice of seed or window can find a worse
one of that length. For every model below its target the loop multiplies its capacity factor by `step` (both
phases); at most `rounds` plans are made, and a round that finds no plan (a solver limit) ends the loop there.
The answer is the cheapest plan whose worst model meets its target, or, when none does, the plan with the smallest
worst shortfall (ties: the cheaper), its shortfall named in its notes. Round 0 is always a candidate, so the loop
never returns a plan that simulates worse than the one it started from.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Callable, Mapping

import numpy as np

from coral_dagster.allocation.capacity import ATTAINMENT_WINDOW_S, trace_period_s, worst_window_share
from coral_dagster.allocation.types import Plan
from coral_dagster.catalog.scenarios import Scenario
from coral_dagster.errors import CoralError
from coral_dagster.lifetimes import worker_pool


@dataclass(frozen=True)
class Round:
    """One plan of the loop and what its simulation attained per model."""

    plan: Plan
    attainment: Mapping[str, float]
    boost: Mapping[str, float]

    def shortfall(self, targets: Mapping[str, float]) -> float:
        """The worst model's attainment below its target (0 when every model meets it)."""
        return max([0.0] + [targets[m] - a for m, a in self.attainment.items() if m in targets])


def loop_duration_s(scenario: Scenario, rates: Mapping[str, float], window_s: float) -> float:
    """A simulation long enough for every model's whole trace loop at its rate, plus one window."""
    return window_s + max((trace_period_s(m.trace, float(rates[m.model])) for m in scenario.models
                           if rates.get(m.model, 0) > 0), default=0.0)


def worst_window_attainment(plan: Plan, scenario: Scenario, rates: Mapping[str, float], window_s: float,
                            seed: int, processes: int | None = None) -> dict[str, float]:
    """Per model, the worst share of admitted requests meeting both SLOs over the `window_s` windows of one
    unbroken simulation of its whole trace loop.

    Models share no instance, node or link, and each draws its arrivals from its own stream of `seed`, so each is
    simulated alone (the others at rate 0) over the same duration, on up to `processes` worker processes (default:
    2, or the CPUs if fewer): the answer is the joint simulation's (tests/test_plan_holds_slo.py checks it)."""
    duration_s = loop_duration_s(scenario, rates, window_s)
    # As `simulate_plan` reads `rates`: a model it does not name keeps the scenario's rate; a name the scenario
    # lacks is an error there.
    names = {m.model for m in scenario.models}
    silent = {**{n: 0.0 for n in names}, **{n: r for n, r in rates.items() if n not in names}}
    alone = [{**silent, m.model: float(rates.get(m.model, m.rate_req_s))} for m in scenario.models
             if rates.get(m.model, m.rate_req_s) > 0]
    n = len(alone)
    args = ([plan] * n, [scenario] * n, alone, [window_s] * n, [seed] * n, [duration_s] * n)
    processes = min(n, processes or min(2, os.cpu_count() or 1))
    with worker_pool(processes) if processes > 1 else nullcontext() as pool:
        parts = list((pool.map if pool else map)(simulated_attainment, *args))
    return dict(sorted(kv for part in parts for kv in part.items()))


def simulated_attainment(plan: Plan, scenario: Scenario, rates: Mapping[str, float], window_s: float, seed: int,
                         duration_s: float) -> dict[str, float]:
    """Per model with requests, its worst `window_s`-window share of admitted requests meeting both SLOs in one
    simulation of `duration_s` seconds at `rates`."""
    from coral_dagster.simulator.engine import FAILURES, SHED
    from coral_dagster.simulator.simulate import simulate_plan

    res = simulate_plan(plan, scenario, trace="scenario", duration_s=duration_s, seed=seed, rates=rates)
    req = res.requests[res.requests.status != FAILURES[SHED]].sort_values("arrival_s", kind="stable")
    out: dict[str, float] = {}
    for model, sub in req.groupby("model", sort=True):
        arrival = sub.arrival_s.to_numpy(dtype=float)
        first = int(np.searchsorted(arrival, duration_s - window_s, side="right"))
        out[str(model)] = worst_window_share(arrival, sub.met_slo.to_numpy(dtype=bool), window_s, slice(0, first))
    return out


def held_plan(make: Callable[[Mapping[str, float]], Plan], scenario: Scenario, rates: Mapping[str, float], *,
              loop: bool = True, rounds: int = 3, window_s: float = ATTAINMENT_WINDOW_S) -> Plan:
    """The plan every way of planning makes (`coral plan`, `coral run`, the re-plan asset): `make({})` sized by the
    capacity rule, then, with `loop` (the default), the closed loop's choice, which keeps each model's SLO
    attainment target in simulation where the rule alone falls short."""
    if not loop:
        return make({})
    return closed_loop(make, scenario, rates, rounds=rounds, window_s=window_s)[0]


def closed_loop(make: Callable[[Mapping[str, float]], Plan], scenario: Scenario, rates: Mapping[str, float], *,
                rounds: int = 3, step: float = 1.25, window_s: float = ATTAINMENT_WINDOW_S, seed: int = 0,
                measure: Callable[..., Mapping[str, float]] = worst_window_attainment) -> tuple[Plan, list[Round]]:
    """(the chosen plan with its expected attainment recorded, every round); `make(boost)` plans with the capacity
    factors times `boost` per model."""
    targets = {m.model: m.attainment_target for m in scenario.models if rates.get(m.model, 0) > 0}
    boost: dict[str, float] = {}
    history: list[Round] = []
    stopped = ""
    for k in range(max(1, rounds)):
        try:
            plan = make(dict(boost))
        except CoralError as exc:
            if not history:
                raise
            stopped = f"; round {k + 1} found no plan ({exc.problem})"
            break
        rnd = Round(plan, measure(plan, scenario, rates, window_s, seed), dict(boost))
        history.append(rnd)
        short = [m for m, a in rnd.attainment.items() if m in targets and a < targets[m]]
        if not short:
            break
        for m in short:
            boost[m] = boost.get(m, 1.0) * step
    meeting = [r for r in history if r.shortfall(targets) == 0.0]
    best = min(meeting, key=lambda r: r.plan.cost_usd_per_hour) if meeting else min(
        history, key=lambda r: (r.shortfall(targets), r.plan.cost_usd_per_hour))
    k = history.index(best)
    source = (f"closed loop round {k + 1} of {len(history)}: worst {window_s:g}-s window of each model's whole "
              f"trace loop, simulated unbroken (seed {seed})")
    notes = list(best.plan.notes)
    if best.shortfall(targets) > 0:
        worst = max(targets, key=lambda m: targets[m] - best.attainment.get(m, 1.0))
        notes.append(f"closed loop: no plan in {len(history)} round(s) met every target; best worst model "
                     f"{worst} at {best.attainment[worst]:.1%} (target {targets[worst]:.0%}){stopped}")
    return replace(best.plan, expected_attainment=dict(best.attainment), expected_from=source,
                   notes=tuple(notes)), history
