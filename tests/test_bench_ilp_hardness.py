"""The hardness bench's ILP is `ilp.min_cost`'s by a second formulation, and dropping pair-dominated columns is
exact: on small random instances both reach the optimum the project's ILP proves."""

from __future__ import annotations

import numpy as np
import pytest

from bench.ilp_hardness import _model, _pair_dominated, _solve
from coral_dagster.allocation import ilp
from coral_dagster.allocation.prune import prune_columns
from support.synthetic import random_problem


@pytest.mark.parametrize("seed", range(8))
def test_second_formulation_and_pair_dominance_keep_the_optimum(seed):
    problem = random_problem(seed, n_max=3, avail_range=(2, 8))
    columns, _ = prune_columns(problem)
    reference = ilp.min_cost(problem, columns, time_limit_s=60.0, gap_rel=0.0)
    model = _model(problem, columns)[0].getModel()
    dominated = _pair_dominated(columns)
    full = _solve(model, 60.0)
    reduced = _solve(model, 60.0, fixed={int(j): (0.0, 0.0) for j in np.nonzero(dominated)[0]})
    if reference.status == "infeasible":
        assert full["status"] == reduced["status"] == "kInfeasible"
        return
    assert reference.status == "optimal" and full["status"] == reduced["status"] == "kOptimal"
    assert full["objective"] == pytest.approx(reference.objective, rel=1e-6)
    assert reduced["objective"] == pytest.approx(reference.objective, rel=1e-6)


def test_pair_dominance_flags_exactly_the_columns_a_pair_beats():
    problem = random_problem(0, n_max=3, avail_range=(2, 8))
    columns, _ = prune_columns(problem)
    dominated = _pair_dominated(columns)
    assert dominated.any() and not dominated.all()
    picked = list(np.nonzero(dominated)[0][:15]) + list(np.nonzero(~dominated)[0][:15])
    for j in picked:
        col = columns[j]
        same = [c for c in columns if (c.template.model, c.template.phase, c.region)
                == (col.template.model, col.template.phase, col.region)]
        need = dict(col.template.nodes.counts)

        def fits(a, b) -> bool:
            one, two = dict(a.template.nodes.counts), dict(b.template.nodes.counts)
            return all(one.get(n, 0) + two.get(n, 0) <= need.get(n, 0) for n in set(one) | set(two))

        beaten = any(fits(a, b) and a.template.tokens_per_s + b.template.tokens_per_s >= col.template.tokens_per_s
                     for a in same for b in same)
        assert beaten == bool(dominated[j]), col.template.nodes
