"""The routing shares eliminated from the allocation ILP (`ilp._projected_demand`) change no integer optimum: checked
against the formulation with the shares (a second formulation) and, on two-region instances, brute force."""

from __future__ import annotations

import pytest

from coral_dagster.allocation import ilp
from coral_dagster.allocation.prune import prune_columns

from support.brute_force import every_plan, routed
from support.synthetic import random_problem


@pytest.mark.parametrize("seed,regions", [(s, r) for s in range(6) for r in (("r1", "r2"), ("r1", "r2", "r3"))])
def test_eliminating_the_shares_keeps_every_optimum(seed, regions):
    problem = random_problem(seed, n_models=2, gpus=("L4", "L40S"), counts=(1, 2), n_max=2, regions=regions,
                             avail_range=(1, 4), demand_range=(400.0, 4000.0), aggregated=True)
    columns, _ = prune_columns(problem, prune_dominated=False)
    targets = {k: (0.6 if k[0] == "m1" else 1.0) for k, d in problem.demand_tokens_per_s.items() if d > 0}
    for goal in (None, targets):
        projected = ilp.min_cost(problem, columns, goal, gap_rel=0.0, time_limit_s=600, project=True)
        shares = ilp.min_cost(problem, columns, goal, gap_rel=0.0, time_limit_s=600)
        assert projected.status == shares.status
        if shares.status != "optimal":
            continue
        assert projected.objective == pytest.approx(shares.objective, rel=1e-9, abs=1e-9)
        served = ilp.routed_fractions(problem, columns, projected.values)
        for model, share in served.items():
            want = 1.0 if goal is None else goal[(model, "prefill")]
            assert share >= want - 1e-6


@pytest.mark.parametrize("seed", [pytest.param(s, marks=pytest.mark.slow) if s == 3 else s for s in range(6)])
def test_the_projected_ilp_finds_the_brute_force_optimum(seed):
    problem = random_problem(seed, n_models=2, gpus=("L4", "L40S"), counts=(1,), n_max=2, regions=("r1", "r2"),
                             avail_range=(1, 3), demand_range=(400.0, 2500.0))
    columns, _ = prune_columns(problem, prune_dominated=False)
    pairs = [(c.template, c.region) for c in columns]
    costs = [cost for counts, cost in every_plan(problem, pairs, problem.available_nodes)
             if all(v >= 1 - 1e-7 for v in routed(problem, counts).values())]
    got = ilp.min_cost(problem, columns, gap_rel=0.0, time_limit_s=600, project=True)
    if not costs:
        assert got.status == "infeasible"
        return
    assert got.status == "optimal"
    assert got.objective == pytest.approx(min(costs), rel=1e-9)
