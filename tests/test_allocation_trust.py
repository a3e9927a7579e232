"""Plans you can trust with money (issue 30): never dearer than what Coral's library contains (the Homo-ILP plan,
the running plan plus churn), checked against brute force; the same plan, bound and status under CPU load."""

from __future__ import annotations

import math
from dataclasses import replace
import multiprocessing
import random
import time

import pytest

from coral_dagster.allocation.baselines import homogeneous_problem
from coral_dagster.allocation.methods import make_plan
from coral_dagster.allocation.planner import solve_plan
from coral_dagster.allocation.problem import AllocationProblem

from support.brute_force import every_plan, routed
from support.synthetic import random_problem


def _sold(problem: AllocationProblem, templates):
    return [(t, r) for t in templates for r in problem.regions
            if all(problem.sells(r, n) for n, _ in t.nodes.counts)]


def _brute_optimum(problem: AllocationProblem) -> tuple[float, dict] | None:
    """The cheapest plan meeting all demand among every integer plan (the oracle), with its counts."""
    pool = dict(problem.available_nodes)
    best = None
    for counts, cost in every_plan(problem, _sold(problem, problem.templates), pool):
        if all(v >= 1 - 1e-7 for v in routed(problem, counts).values()) and (best is None or cost < best[0] - 1e-9):
            best = (cost, counts)
    return best


def _tiny(seed: int, **kw) -> AllocationProblem:
    return random_problem(seed, n_models=2, gpus=("L4", "L40S"), counts=(1,), n_max=2, regions=("r1", "r2"),
                          avail_range=(1, 3), demand_range=(400.0, 2500.0), **kw)


# Seeds of `_tiny` that have a plan meeting demand, homogeneous or not (seeds 2, 5 and 10 have none; 8 and 11 take
# a minute or more of brute force). Chosen up front so every listed seed runs; each test asserts its seed still does.
FEASIBLE_SEEDS = (0, 1, 3, 4, 6, 7, 9)
SLOW_SEEDS = (3,)


def _seeds(limit: int) -> list:
    return [pytest.param(s, marks=pytest.mark.slow) if s in SLOW_SEEDS else s for s in FEASIBLE_SEEDS[:limit]]


@pytest.mark.parametrize("seed", _seeds(7))
def test_coral_is_never_dearer_than_the_homo_ilp_optimum_found_by_brute_force(seed):
    problem = _tiny(seed)
    homo = _brute_optimum(homogeneous_problem(problem))
    assert homo is not None, f"seed {seed} no longer has a homogeneous plan: pick FEASIBLE_SEEDS again"
    for nodes in (1, None):  # a starved solve and a full one
        plan = make_plan(problem, "coral", max_nodes=nodes)
        assert plan.objective_usd_per_hour <= homo[0] + 1e-6
        assert all(v >= 1 - 1e-6 for v in routed(problem, {(i.template, i.region): i.count
                                                             for i in plan.instances}).values())


@pytest.mark.parametrize("seed", _seeds(5))
def test_coral_is_never_dearer_than_the_running_plan_plus_churn(seed):
    """The running plan is the brute-force optimum of a slightly lower demand priced at other rates: still
    feasible, not optimal; Coral's objective (cost plus churn) never exceeds what keeping it costs."""
    base = _tiny(seed)
    found = _brute_optimum(base)
    assert found is not None, f"seed {seed} no longer has a plan: pick FEASIBLE_SEEDS again"
    rng = random.Random(seed)
    running = {(t.template_id, r): n for (t, r), n in found[1].items()}
    prices = {k: v * rng.uniform(0.7, 1.4) for k, v in base.usd_per_hour.items()}
    problem = base.with_changes(running=running, churn_k=0.5, usd_per_hour=prices)
    keep = sum(n * problem.instance_usd_per_hour(t, r) for (t, r), n in found[1].items())
    for nodes in (1, None):
        plan = make_plan(problem, "coral", max_nodes=nodes)
        assert plan.objective_usd_per_hour <= keep + 1e-6
    truth = _brute_optimum(problem.with_changes(running={}, churn_k=0.0))
    assert plan.cost_usd_per_hour >= truth[0] - 1e-6  # no plan is cheaper than the optimum (oracle sanity)


@pytest.mark.slow
def test_a_worse_solve_returns_the_incumbent_and_says_so():
    """An incumbent cheaper than anything the starved solve finds is returned, its status unproven."""
    problem = _tiny(3)
    best = _brute_optimum(problem)
    assert best is not None
    cheap = solve_plan(problem, max_nodes=None)
    plan = solve_plan(problem, max_nodes=1, incumbents={"a given plan": cheap})
    assert plan.objective_usd_per_hour <= cheap.objective_usd_per_hour + 1e-9
    assert plan.objective_usd_per_hour == pytest.approx(best[0])
    assert plan.mip_bound_usd_per_hour <= best[0] + 1e-6


def _burn(stop_at: float) -> None:
    x = 0
    while time.time() < stop_at:
        x += 1


def _signature(plan):
    return (sorted((i.template.template_id, i.region, i.count) for i in plan.instances), plan.status,
            round(plan.mip_bound_usd_per_hour, 9), round(plan.lp_bound_usd_per_hour, 9), plan.work_nodes)


@pytest.mark.slow
def test_a_work_limited_solve_is_the_same_on_an_idle_and_a_loaded_machine():
    """The same work-limited solve twice, the second while two busy loops burn both cores: identical plans,
    bounds, statuses and work. The instance is large enough that the work limit, not optimality, ends it."""
    problem = random_problem(11, n_models=4, gpus=("L4", "L40S", "H100"), counts=(1, 2), n_max=2,
                             regions=("r1", "r2"), avail_range=(2, 10), demand_range=(4000.0, 30000.0))
    idle = make_plan(problem, "coral", max_nodes=100)
    assert idle.status == "feasible-work-limit"  # the work limit, not optimality, ended it
    ctx = multiprocessing.get_context("spawn")
    burners = [ctx.Process(target=_burn, args=(time.time() + 120,)) for _ in range(2)]
    for b in burners:
        b.start()
    try:
        loaded = make_plan(problem, "coral", max_nodes=100)
    finally:
        for b in burners:
            b.terminate()
            b.join()
    assert _signature(loaded) == _signature(idle)
    assert math.isfinite(idle.mip_bound_usd_per_hour)


@pytest.mark.parametrize("seed", _seeds(2))
def test_a_solve_that_finds_no_plan_returns_the_running_plan_topped_up(seed, monkeypatch):
    """The running plan is the optimum of 60% of the demand; the main solve is made to end with no plan (as a
    starved MIP on a large library does). Instead of no plan, one meeting demand comes back, its cost plus churn no
    more than the cheapest of every integer plan that keeps every running instance and meets demand (brute force:
    the topped-up plan; the local search after it may only lower that)."""
    from coral_dagster.allocation import colgen, planner
    from coral_dagster.errors import SolverTimeoutError

    base = _tiny(seed)
    lower = _brute_optimum(base.with_changes(demand_tokens_per_s={k: 0.6 * v for k, v in
                                                                  base.demand_tokens_per_s.items()}))
    assert lower is not None and _brute_optimum(base) is not None, f"seed {seed}: pick FEASIBLE_SEEDS again"
    running = {(t.template_id, r): n for (t, r), n in lower[1].items()}
    problem = base.with_changes(running=running, churn_k=0.5)
    assert not all(v >= 1 - 1e-7 for v in routed(problem, lower[1]).values()), "the running plan must fall short"
    real = colgen.solve_min_cost

    def starved(*args, **kwargs):
        done = real(*args, **kwargs)
        return replace(done, result=replace(done.result, status="no-solution", values=(), objective=math.nan))

    monkeypatch.setattr(colgen, "solve_min_cost", starved)
    plan = solve_plan(problem, max_nodes=None)
    counts = {(i.template, i.region): i.count for i in plan.instances}
    assert all(v >= 1 - 1e-6 for v in routed(problem, counts).values())

    def objective(c):
        price = {k: problem.instance_usd_per_hour(*k) for k in c}
        return sum(n * price[k] * (1 + problem.churn_k) - min(n, lower[1].get(k, 0)) * price[k] * problem.churn_k
                   for k, n in c.items())

    best = min(objective(c) for c, _ in every_plan(problem, _sold(problem, problem.templates),
                                                   dict(problem.available_nodes))
               if all(c.get(k, 0) >= n for k, n in lower[1].items())
               and all(v >= 1 - 1e-7 for v in routed(problem, c).values()))
    assert plan.objective_usd_per_hour <= best * (1 + 1e-6)
    assert "topped up" in " ".join(plan.notes) and plan.status != "optimal"
    monkeypatch.setattr(planner, "_topped_up", lambda problem, columns, result, *rest: result)
    with pytest.raises(SolverTimeoutError):  # the contrast: without the fallback the same solve has no plan
        solve_plan(problem, max_nodes=None)
