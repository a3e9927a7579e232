"""Large-neighbourhood search on plan counts: what it returns meets demand within the availability (checked by the
brute-force helpers, not the solver), is never dearer than its start nor cheaper than the exact optimum (a solve
with no work limit), and reaches that optimum where models share no node (each model's sub-solve is then exact)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from coral_dagster.allocation import ilp, lns
from coral_dagster.allocation.methods import make_plan
from coral_dagster.allocation.prune import prune_columns

from support.brute_force import routed
from support.synthetic import random_problem

CASES = 6


def _objective(columns, values) -> float:
    return sum(c.usd_per_hour * v for c, v in zip(columns, values))


def _poor_start(problem, columns, seed: int) -> list[float]:
    """A plan meeting demand that is optimal for scrambled prices, so usually dear at the real ones."""
    rng = random.Random(seed)
    scrambled = replace(problem, usd_per_hour={k: p * rng.uniform(0.2, 5.0) for k, p in problem.usd_per_hour.items()})
    cols, _ = prune_columns(scrambled, prune_dominated=False)
    by_key = {(c.template.template_id, c.region): v for c, v in
              zip(cols, ilp.min_cost(scrambled, cols, time_limit_s=60).values)}
    return [float(by_key.get((c.template.template_id, c.region), 0.0)) for c in columns]


def _holds(problem, columns, values) -> bool:
    counts = {(c.template, c.region): round(v) for c, v in zip(columns, values) if v > 0}
    used: dict = {}
    for (t, r), n in counts.items():
        for node, k in t.nodes.counts:
            used[(r, node)] = used.get((r, node), 0) + k * n
    fits = all(n <= problem.available_nodes.get(key, 0) for key, n in used.items())
    return fits and all(share >= 1.0 - 1e-6 for share in routed(problem, counts).values())


def _cases(separable: bool):
    """(seed, problem, columns, exact optimum) of the first CASES seeds whose demand can be met."""
    found = []
    for seed in range(10 * CASES):
        problem, columns, exact = _case(seed, separable)
        if exact.status == "optimal":
            found.append((seed, problem, columns, exact))
        if len(found) == CASES:
            return found
    raise AssertionError(f"fewer than {CASES} of {10 * CASES} seeds can meet demand")


def _case(seed: int, separable: bool):
    gpus = ("L4", "A10G", "L40S")
    problem = random_problem(seed, n_models=3, gpus=gpus, counts=(1,), n_max=2, regions=("r1", "r2"),
                             avail_range=(4, 12), demand_range=(1500.0, 6000.0))
    if separable:  # model i runs on gpus[i] alone: no two models compete for a node
        own = {f"m{i}": g for i, g in enumerate(gpus)}
        problem = replace(problem, templates=tuple(t for t in problem.templates
                                                   if {n.gpu for n, _ in t.nodes.counts} == {own[t.model]}))
    columns, _ = prune_columns(problem, prune_dominated=False)
    exact = ilp.min_cost(problem, columns, time_limit_s=120)
    return problem, columns, exact


@pytest.mark.parametrize("separable", [False, True])
def test_the_search_keeps_demand_never_costs_more_and_never_beats_the_optimum(separable):
    reached = 0
    for seed, problem, columns, exact in _cases(separable):
        start = _poor_start(problem, columns, seed)
        assert _holds(problem, columns, start)
        found = lns.improve(problem, columns, start, lambda v: _objective(columns, v), max_nodes=None,
                            time_limit_s=60)
        assert _holds(problem, columns, found.values), seed
        assert found.objective == pytest.approx(_objective(columns, found.values))
        assert exact.objective - 1e-6 <= found.objective <= _objective(columns, start) + 1e-9, seed
        reached += found.objective <= exact.objective + 1e-6
        if separable:
            assert found.objective == pytest.approx(exact.objective, rel=1e-9), seed
    assert reached >= 1


def test_a_plan_the_work_limit_leaves_unproven_is_searched_and_says_so():
    """One MIP node per solve leaves the cost solve unproven; the plan is the search's, at most the solve's."""
    searched = 0
    for _, problem, _, exact in _cases(separable=False):
        plan = make_plan(problem, "coral", max_nodes=1)
        note = next((n for n in plan.notes if n.startswith("large-neighbourhood search")), None)
        if plan.status == "optimal":
            assert note is None
            continue
        searched += 1
        before, after = (float(x) for x in note.split(", ")[-2].split(" $/h")[0].split(" -> "))
        assert plan.cost_usd_per_hour == pytest.approx(after, abs=0.005) and after <= before + 1e-9
        assert plan.cost_usd_per_hour >= exact.objective - 1e-6
    assert searched >= 1
