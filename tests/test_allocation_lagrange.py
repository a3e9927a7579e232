"""The Lagrangian bound: never above the exact optimum (a solve with no work limit) on coupled instances, at full
demand and at scaled targets; never below the LP relaxation; exactly the optimum where models share no node and
availability does not bind (no price is needed, so it is the sum of the models' own optima); and a plan the work
limit leaves unproven reads it as its proven bound when it is the stronger one."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from coral_dagster.allocation import ilp, lagrange
from coral_dagster.allocation.methods import make_plan
from coral_dagster.allocation.prune import prune_columns

from support.synthetic import random_problem

GPUS = ("L4", "A10G", "L40S")
SEEDS = range(12)


def _case(seed: int, separable: bool = False, avail_range=(3, 10)):
    problem = random_problem(seed, n_models=3, gpus=GPUS, counts=(1,), n_max=2, regions=("r1", "r2"),
                             avail_range=avail_range, demand_range=(1500.0, 6000.0))
    if separable:  # model i runs on GPUS[i] alone: no two models compete for a node
        own = {f"m{i}": g for i, g in enumerate(GPUS)}
        problem = replace(problem, templates=tuple(t for t in problem.templates
                                                   if {n.gpu for n, _ in t.nodes.counts} == {own[t.model]}))
    columns, _ = prune_columns(problem, prune_dominated=False)
    return problem, columns


def _targets(problem, level: float):
    return {k: level for k, d in problem.demand_tokens_per_s.items() if d > 0}


@pytest.mark.parametrize("level", [1.0, 0.6])
def test_the_bound_lies_between_the_lp_and_the_exact_optimum(level):
    checked, above_lp = 0, 0
    for seed in SEEDS:
        problem, columns = _case(seed)
        targets = _targets(problem, level)
        exact = ilp.min_cost(problem, columns, targets, time_limit_s=120, gap_rel=0.0)
        if exact.status != "optimal":
            continue
        lp = ilp.min_cost(problem, columns, targets, integer=False)
        found = lagrange.bound(problem, columns, targets, exact.objective * 1.1, max_nodes=None, time_limit_s=60)
        assert found.lp_bound == pytest.approx(lp.objective, rel=1e-6)
        assert lp.objective - 1e-6 <= found.bound <= exact.objective + 1e-6, seed
        checked += 1
        above_lp += found.bound > lp.objective + 1e-3
    assert checked >= 4 and above_lp >= 1


def test_models_that_share_no_node_with_room_to_spare_are_bounded_exactly():
    for seed in range(4):
        problem, columns = _case(seed, separable=True, avail_range=(40, 60))
        exact = ilp.min_cost(problem, columns, time_limit_s=120, gap_rel=0.0)
        assert exact.status == "optimal"
        found = lagrange.bound(problem, columns, None, exact.objective, max_nodes=None, time_limit_s=60)
        assert found.bound == pytest.approx(exact.objective, rel=1e-4), seed


def test_a_running_plan_has_no_lagrangian_bound():
    problem, columns = _case(0)
    running = replace(problem, churn_k=0.5, running={(columns[0].template.template_id, columns[0].region): 1})
    assert not lagrange.applies(running) and lagrange.applies(problem)
    assert math.isnan(lagrange.bound(running, columns, None, 1e6, max_nodes=None, time_limit_s=60).bound)


def test_an_unproven_plan_reads_the_stronger_of_the_solver_and_lagrangian_bounds():
    noted = 0
    for seed in SEEDS:
        problem, columns = _case(seed)
        exact = ilp.min_cost(problem, columns, time_limit_s=120, gap_rel=0.0)
        if exact.status != "optimal":
            continue
        plan = make_plan(problem, "coral", max_nodes=1)
        note = next((n for n in plan.notes if n.startswith("Lagrangian bound")), None)
        assert (note is None) == (plan.status == "optimal")
        assert plan.mip_bound_usd_per_hour <= exact.objective + 1e-6
        if note is not None:
            noted += 1
            found = float(note.split(": ")[1].split(" $/h")[0])
            assert plan.mip_bound_usd_per_hour >= min(found, plan.objective_usd_per_hour) - 0.005
    assert noted >= 1
