"""The closed loop: simulate a plan on each model's own trace, raise the capacity of models that fall short, re-plan.

Round 0 is the plan the capacity rule sizes. Each round simulates the plan (`simulate_s` seconds of every model's
own trace, for each seed; a model's attainment is its worst over the seeds, since each seed starts the trace at
another point) and, for every model whose SLO attainment among admitted requests is below its target,
multiplies its capacity factor by `step` (both phases); at most `rounds` plans are made. The answer is the cheapest
plan whose worst model meets its target, or, when none does, the plan with the smallest worst shortfall (ties: the
cheaper), its shortfall named in its notes. Round 0 is always a candidate, so the loop never returns a plan that
simulates worse than the one it started from.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Mapping

from coral_dagster.allocation.types import Plan
from coral_dagster.catalog.scenarios import Scenario


@dataclass(frozen=True)
class Round:
    """One plan of the loop and what its simulation attained per model."""

    plan: Plan
    attainment: Mapping[str, float]
    boost: Mapping[str, float]

    def shortfall(self, targets: Mapping[str, float]) -> float:
        """The worst model's attainment below its target (0 when every model meets it)."""
        return max([0.0] + [targets[m] - a for m, a in self.attainment.items() if m in targets])


def admitted_attainment(plan: Plan, scenario: Scenario, rates: Mapping[str, float], simulate_s: float,
                        seeds: tuple[int, ...]) -> dict[str, float]:
    """Per model, the worst over the seeds of the share of admitted requests meeting both SLOs on its own trace."""
    from coral_dagster.simulator.simulate import simulate_plan

    out: dict[str, float] = {}
    for seed in seeds:
        res = simulate_plan(plan, scenario, trace="scenario", duration_s=simulate_s, seed=seed, rates=rates)
        for model, a in zip(res.by_model.model, res.by_model.admitted_attainment.astype(float)):
            out[model] = min(out.get(model, 1.0), a)
    return out


def closed_loop(make: Callable[[Mapping[str, float]], Plan], scenario: Scenario, rates: Mapping[str, float], *,
                rounds: int = 3, step: float = 1.25, simulate_s: float = 300.0, seeds: tuple[int, ...] = (0, 1),
                measure: Callable[..., Mapping[str, float]] = admitted_attainment) -> tuple[Plan, list[Round]]:
    """(the chosen plan with its expected attainment recorded, every round); `make(boost)` plans with the capacity
    factors times `boost` per model."""
    targets = {m.model: m.attainment_target for m in scenario.models if rates.get(m.model, 0) > 0}
    boost: dict[str, float] = {}
    history: list[Round] = []
    for _ in range(max(1, rounds)):
        plan = make(dict(boost))
        rnd = Round(plan, measure(plan, scenario, rates, simulate_s, seeds), dict(boost))
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
    source = (f"closed loop round {k + 1} of {len(history)}: {simulate_s:g} s of each model's own trace, worst of "
              f"seeds {', '.join(map(str, seeds))}")
    notes = list(best.plan.notes)
    if best.shortfall(targets) > 0:
        worst = max(targets, key=lambda m: targets[m] - best.attainment.get(m, 1.0))
        notes.append(f"closed loop: no plan in {len(history)} round(s) met every target; best worst model "
                     f"{worst} at {best.attainment[worst]:.1%} (target {targets[worst]:.0%})")
    return replace(best.plan, expected_attainment=dict(best.attainment), expected_from=source,
                   notes=tuple(notes)), history
