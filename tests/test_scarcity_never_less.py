"""Under scarcity Coral's plan never serves less than the best plan of homogeneous templates alone (a subset of its
library), and serving as much never costs more: checked against every integer plan of small instances."""

from __future__ import annotations

from dataclasses import replace
from itertools import islice

import pytest

from coral_dagster.allocation.methods import make_plan
from coral_dagster.allocation.problem import AllocationProblem
from coral_dagster.allocation.scarcity import never_serves_less, served_levels

from support.brute_force import every_plan, routed
from support.synthetic import random_problem

TOL = 1e-6


def _problem(seed: int) -> AllocationProblem:
    return random_problem(seed, n_models=2, regions=("r1",), gpus=("L4", "L40S"), counts=(1,), n_max=2,
                          avail_range=(1, 3), demand_range=(4000.0, 12000.0))


def _homogeneous_best(problem: AllocationProblem) -> tuple[tuple[float, ...], float]:
    """Brute force over every integer plan of homogeneous templates: the max-min greatest ascending served levels
    and the least cost reaching them."""
    pairs = [(t, r) for t in problem.templates for r in problem.regions
             if len({n.gpu for n, _ in t.nodes.counts}) == 1 and all(problem.sells(r, n) for n, _ in t.nodes.counts)]
    best: tuple[tuple[float, ...], float] = ((), 0.0)
    for counts, cost in every_plan(problem, pairs, dict(problem.available_nodes)):
        levels = tuple(sorted(routed(problem, counts).values()))
        rounded = tuple(round(x, 9) for x in levels)
        if rounded > tuple(round(x, 9) for x in best[0]) or (rounded == tuple(round(x, 9) for x in best[0])
                                                              and cost < best[1]):
            best = (levels, cost)
    return best


SCARCE = list(islice((s for s in range(40) if min(_homogeneous_best(_problem(s))[0], default=1.0) < 1.0 - TOL), 6))


def test_enough_scarce_instances():
    assert len(SCARCE) == 6


@pytest.mark.parametrize("seed", SCARCE)
@pytest.mark.parametrize("mode", ["scale", "fair"])
def test_coral_serves_at_least_the_best_homogeneous_plan(seed, mode):
    problem = _problem(seed)
    levels, cost = _homogeneous_best(problem)
    plan = make_plan(problem, "coral", scarcity_mode=mode, time_limit_s=30.0)
    got = served_levels(plan)
    if mode == "scale":
        assert got[0] >= levels[0] - TOL
        return
    first = next((k for k, (x, y) in enumerate(zip(got, levels)) if abs(x - y) > TOL), None)
    if first is not None:
        assert got[first] > levels[first]
    else:
        assert plan.cost_usd_per_hour <= cost + TOL


@pytest.mark.parametrize("seed", SCARCE[:2])
def test_a_plan_serving_less_is_replaced_by_the_one_serving_more(seed):
    """The guard itself: Homo-ILP's plan against a copy of it missing an instance (serving less), and against a
    dearer copy serving the same."""
    problem = _problem(seed)
    homo = make_plan(problem, "homo-ilp", scarcity_mode="fair", time_limit_s=30.0)
    first = homo.instances[0]
    fewer = (replace(first, count=first.count - 1),) if first.count > 1 else ()
    less = replace(homo, method="coral", instances=fewer + homo.instances[1:])
    assert served_levels(less) < served_levels(homo)
    assert never_serves_less(less, homo, "the Homo-ILP plan").instances == homo.instances
    dearer = replace(homo, method="coral", cost_usd_per_hour=homo.cost_usd_per_hour + 1.0)
    kept = never_serves_less(dearer, homo, "the Homo-ILP plan")
    assert kept.cost_usd_per_hour == homo.cost_usd_per_hour and kept.method == "coral"
    assert never_serves_less(homo, dearer, "a dearer plan") is homo
