"""Homo, Cauchy and the scarcity modes against brute force on small synthetic instances."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import random

import pytest

from coral_dagster.allocation.baselines import _Greedy, least_cost_cover, plan_cauchy, plan_homo, plan_homo_ilp
from coral_dagster.allocation.check import plan_violations
from coral_dagster.allocation.methods import make_plan
from coral_dagster.allocation.planner import solve_plan
from coral_dagster.allocation.problem import AllocationProblem
from support.synthetic import random_problem, synthetic_template
from coral_dagster.catalog.nodes import NodeConfig, NodeMultiset
from coral_dagster.errors import InfeasibleError

from support.brute_force import every_plan, routed

EXACT = 1e-9


def sold_pairs(problem: AllocationProblem, templates):
    return [(t, r) for t in templates for r in problem.regions
            if all(problem.sells(r, n) for n, _ in t.nodes.counts)]


def small(seed: int, **kw) -> AllocationProblem:
    return random_problem(seed, n_models=1, gpus=("L4", "L40S"), counts=(1, 2), n_max=1, avail_range=(0, 3),
                          aggregated=True, **kw)


@pytest.mark.parametrize("seed", range(6))
def test_least_cost_cover_matches_brute_force(seed):
    problem = small(seed)
    rng = random.Random(seed)
    for method in ("homo", "cauchy"):
        greedy = _Greedy(problem, method, 10.0)
        pool = {k: rng.randint(0, 3) for k in problem.available_nodes}
        fraction = rng.uniform(0.05, 1.0)
        got = least_cost_cover(greedy.problem, greedy.columns, "m0", fraction, dict(pool))
        pairs = [(c.template, c.region) for c in greedy.columns]
        costs = [cost for counts, cost in every_plan(problem, pairs, pool)
                 if routed(problem, counts)["m0"] >= fraction * (1 - 1e-7)]
        if not costs:
            assert got is None
            continue
        assert got is not None
        assert sum(n * greedy.columns[j].usd_per_hour for j, n in got.items()) == pytest.approx(min(costs))


@pytest.mark.parametrize("seed", range(6))
def test_homo_replicates_the_best_replica_and_buys_the_last_part_at_least_cost(seed):
    """Availability that never binds: floor(1 / f) replicas of the one-node aggregated replica with the best
    fraction per $, then the brute-force cheapest mix of replicas serving the rest; never dearer than
    replicating the best replica alone."""
    base = random_problem(seed, n_models=1, regions=("r1",), gpus=("L4", "L40S"), counts=(1, 2), n_max=2,
                          avail_range=(1000, 1000), aggregated=True)
    problem = base.with_changes(available_nodes={k: 1000 for k in base.usd_per_hour})
    one_node = [t for t, _ in sold_pairs(problem, problem.templates)
                if t.phase == "aggregated" and t.nodes.counts[0][1] == 1 and len(t.nodes.counts) == 1]
    d = problem.demand_tokens_per_s
    frac = {t: min(t.tokens_per_s / d[("m0", "decode")],
                   t.tokens_per_s * problem.prompt_per_output["m0"] / d[("m0", "prefill")]) for t in one_node}
    price = {t: problem.instance_usd_per_hour(t, "r1") for t in one_node}
    best = max(one_node, key=lambda t: (frac[t] / price[t], -price[t]))
    whole = math.floor(1.0 / frac[best] + 1e-9)
    rest = 1.0 - whole * frac[best]
    expected = whole * price[best]
    if rest > 1e-9:  # brute force: every mix of at most ceil(rest / f) replicas of each kind
        bounds = [range(math.ceil(rest / frac[t]) + 1) for t in one_node]
        expected += min(sum(n * price[t] for n, t in zip(ns, one_node)) for ns in itertools.product(*bounds)
                        if sum(n * frac[t] for n, t in zip(ns, one_node)) >= rest * (1 - 1e-7))
    plan = plan_homo(problem)
    assert plan.cost_usd_per_hour == pytest.approx(expected)
    assert plan.cost_usd_per_hour <= math.ceil(1.0 / frac[best] - 1e-9) * price[best] + 1e-9
    assert plan_violations(plan, problem) == []


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("mode", [None, "scale", "fair"])
def test_greedy_baselines_stay_within_availability_and_serve_their_levels(seed, mode):
    problem = random_problem(seed, n_models=2, gpus=("L4", "L40S"), counts=(1, 2), n_max=2, avail_range=(0, 4),
                             aggregated=True)
    for planner in (plan_homo, plan_cauchy):
        try:
            plan = planner(problem, scarcity_mode=mode)
        except InfeasibleError:
            assert mode is None
            continue
        assert plan_violations(plan, problem, require_demand=False) == []
        got = routed(problem, {(i.template, i.region): i.count for i in plan.instances})
        assert min(got.values()) >= plan.demand_scale * (1 - 1e-7)
        if plan.status == "heuristic":
            assert plan_violations(plan, problem) == []
        coral = solve_plan(problem, scarcity_mode=mode, gap_rel=EXACT)
        if plan.status == "heuristic" and coral.status == "optimal":  # Coral's space contains theirs
            assert coral.cost_usd_per_hour <= plan.cost_usd_per_hour * (1 + 1e-9) + 1e-9


def two_model(seed: int) -> AllocationProblem:
    return random_problem(seed, n_models=2, gpus=("L4", "L40S"), counts=(1,), n_max=1, regions=("r1", "r2"),
                          avail_range=(0, 2), demand_range=(2000.0, 9000.0))


@pytest.mark.parametrize("seed", range(10))
def test_fair_share_is_max_min_and_pareto_against_brute_force(seed):
    problem = two_model(seed)
    outcomes = [routed(problem, counts) for counts, _ in every_plan(problem, sold_pairs(problem, problem.templates),
                                                                    problem.available_nodes)]
    # Every seed of two_model is a scarcity draw (no plan meets all demand); a change to the generator fails here.
    assert not any(min(o.values()) >= 1 - 1e-9 for o in outcomes), f"seed {seed} is no longer a scarcity draw"
    plan = solve_plan(problem, scarcity_mode="fair", gap_rel=EXACT)
    got = routed(problem, {(i.template, i.region): i.count for i in plan.instances})
    levels = {m: float(x.rstrip("%")) / 100 for m, x in
              (part.split() for part in next(n for n in plan.notes if n.startswith("max-min")).split(": ")[1]
               .split(", "))}
    assert all(got[m] >= levels[m] - 1e-3 for m in levels)
    assert min(levels.values()) == pytest.approx(max(min(o.values()) for o in outcomes), abs=2e-3)
    for m in levels:  # no model can rise without another falling below its level
        assert not any(o[m] > levels[m] + 2e-3 and all(o[x] >= levels[x] - 1e-3 for x in levels if x != m)
                       for o in outcomes)


def blocked_problem() -> AllocationProblem:
    """Model a needs one X node per phase, and every region sells one; model b has its own Y nodes."""
    x, y = NodeConfig("X", 1), NodeConfig("Y", 1)
    templates = (synthetic_template("a", "prefill", NodeMultiset.of([x]), 100.0),
                 synthetic_template("a", "decode", NodeMultiset.of([x]), 100.0),
                 synthetic_template("b", "prefill", NodeMultiset.of([y]), 100.0),
                 synthetic_template("b", "decode", NodeMultiset.of([y]), 100.0))
    regions = ("r1", "r2")
    return AllocationProblem("blocked", templates, {(r, n): 1.0 for r in regions for n in (x, y)},
                             {**{(r, x): 1 for r in regions}, **{(r, y): 2 for r in regions}},
                             {("a", "prefill"): 300.0, ("a", "decode"): 300.0, ("b", "prefill"): 400.0,
                              ("b", "decode"): 400.0})


def test_a_model_no_plan_serves_leaves_the_others_served():
    """Model a cannot be served (its two phases need two X nodes in one region; each region has one); b's two Y
    nodes per region hold one prefill and one decode instance: 100 / 400 of its requests per region, 0.5 in all.
    The LP relaxation serves a in part (half an X node per phase), so only the integer answer shows this."""
    problem = blocked_problem()
    for method in ("coral", "homo-ilp", "cauchy"):
        for mode in ("scale", "fair"):
            planner = {"coral": solve_plan, "homo-ilp": plan_homo_ilp, "cauchy": plan_cauchy}[method]
            plan = planner(problem, scarcity_mode=mode)
            assert plan.served_fraction()[("a", "prefill")] == 0.0
            assert routed(problem, {(i.template, i.region): i.count for i in plan.instances})["b"] == pytest.approx(0.5)
            assert plan_violations(plan, problem, require_demand=False) == []
            if mode == "scale":
                assert any("a cannot be served alongside the others" in n for n in plan.notes)


def test_fair_share_serves_one_of_two_models_sharing_a_node():
    """Two models each need the one X node: a plan serves one of them; neither mode may leave both at 0."""
    x = NodeConfig("X", 1)
    templates = tuple(synthetic_template(m, "prefill", NodeMultiset.of([x]), 100.0) for m in ("a", "b"))
    problem = AllocationProblem("shared", templates, {("r", x): 1.0}, {("r", x): 1},
                                {("a", "prefill"): 200.0, ("b", "prefill"): 300.0})
    for mode in ("fair", "scale"):  # scaling both alike would serve neither
        plan = solve_plan(problem, scarcity_mode=mode)
        fractions = sorted(plan.served_fraction().values())
        assert fractions[0] == 0.0 and fractions[1] > 0.0
    zero = next(k[0] for k, v in plan.served_fraction().items() if v == 0.0)
    assert any(f"{zero} cannot be served alongside the others" in n for n in plan.notes)


def test_a_scarcity_cost_solve_out_of_time_falls_back_to_the_level_solve(monkeypatch):
    """When the cost solve at the levels finds nothing in time, the level solve's counts are the plan: it still
    serves every model its level within availability."""
    from coral_dagster.allocation import colgen, ilp, planner

    problem = blocked_problem()
    real = colgen.solve_min_cost

    def out_of_time(problem, columns, targets=None, **kwargs):
        done = real(problem, columns, targets, **kwargs)
        if targets is None:  # the full-demand solve: infeasible here, left alone
            return done
        return dataclasses.replace(done, result=ilp.SolveResult("no-solution", (), math.nan, math.nan, 0.0))

    monkeypatch.setattr(planner.colgen, "solve_min_cost", out_of_time)
    for mode in ("scale", "fair"):
        plan = solve_plan(problem, scarcity_mode=mode)
        assert any("not cost-minimised" in n for n in plan.notes)
        assert plan_violations(plan, problem) == []
        assert routed(problem, {(i.template, i.region): i.count for i in plan.instances})["b"] == pytest.approx(0.5)


def _max_min_level(problem) -> float:
    """The brute-force max-min served share of a two-model problem: the best over every plan of its worst model."""
    outcomes = [routed(problem, counts) for counts, _ in every_plan(problem, sold_pairs(problem, problem.templates),
                                                                    problem.available_nodes)]
    return max(min(o.values()) for o in outcomes)


@functools.cache
def _scarce_seeds(n: int = 5, tries: int = 200) -> tuple[int, ...]:
    """The first `n` seeds whose two-model problem is scarce but servable (max-min level strictly in (0, 1))."""
    seeds = tuple(s for s in range(tries) if 1e-9 < _max_min_level(two_model(s)) < 1 - 1e-9)[:n]
    assert len(seeds) == n, f"only {len(seeds)} of {tries} seeds give a scarce, servable problem"
    return seeds


@pytest.mark.parametrize("draw", range(5))
def test_a_level_solve_that_times_out_at_zero_is_retried_with_more_time(draw, monkeypatch):
    """The first level solve of each fair-share run ends at its time limit with no incumbent; the retry (the real
    ILP) answers, so fair share still reaches the brute-force max-min level instead of fixing a model at 0. Each
    draw is a seed whose problem is scarce but servable (the case the retry is for)."""
    from coral_dagster.allocation import colgen, ilp, scarcity

    problem = two_model(_scarce_seeds()[draw])
    best = _max_min_level(problem)
    real, limits = colgen.solve_max_level, []

    def first_times_out(problem, columns, groups, *args, max_nodes=None, **kwargs):
        if len(groups) > 1:  # fair share's solves (one group per model), not the diagnosis
            limits.append(max_nodes)
            if len(limits) == 1:
                return ilp.SolveResult("no-solution", (), math.nan, math.nan, 0.0)
        return real(problem, columns, groups, *args, max_nodes=max_nodes, **kwargs)

    monkeypatch.setattr(scarcity.colgen, "solve_max_level", first_times_out)
    plan = solve_plan(problem, scarcity_mode="fair", gap_rel=EXACT, max_nodes=50)
    assert limits[1] == scarcity.RETRY_WORK_FACTOR * limits[0]
    got = routed(problem, {(i.template, i.region): i.count for i in plan.instances})
    assert min(got.values()) == pytest.approx(best, abs=2e-3)


@pytest.mark.parametrize("seed", range(8))
def test_coral_starts_from_the_homogeneous_plan_so_a_cut_short_solve_is_never_dearer(seed, monkeypatch):
    """Coral's solve over every column is cut short and answers only its first incumbent, the homogeneous
    sub-problem's plan (what Homo-ILP, the same ILP over the homogeneous columns planned on its own, costs): the
    plan is that one or, after the large-neighbourhood search, cheaper, never below the uncut optimum; uncut,
    Coral is never dearer than Homo-ILP."""
    from coral_dagster.allocation import colgen, planner

    problem = random_problem(seed, n_models=2, gpus=("L4", "L40S"), counts=(1, 2), n_max=2,
                             avail_range=(2, 6), demand_range=(500.0, 3000.0))
    homo = plan_homo_ilp(problem, gap_rel=EXACT)  # every seed listed has a homogeneous plan meeting demand
    best = make_plan(problem, "coral", gap_rel=EXACT).cost_usd_per_hour
    assert best <= homo.cost_usd_per_hour + 1e-6
    real = colgen.solve_min_cost

    def cut_short(problem, columns, targets=None, *, start=None, **kwargs):
        done = real(problem, columns, targets, start=start, **kwargs)
        if start is None:  # the homogeneous sub-problem: solved in full
            return done
        return dataclasses.replace(done, result=dataclasses.replace(done.result, status="feasible-time-limit",
                                                                    values=tuple(start)))

    monkeypatch.setattr(planner.colgen, "solve_min_cost", cut_short)
    plan = make_plan(problem, "coral", gap_rel=EXACT)
    assert any("incumbent: the Homo-ILP plan" in n for n in plan.notes)
    assert best - 1e-6 <= plan.cost_usd_per_hour <= homo.cost_usd_per_hour + 1e-6
    assert plan_violations(plan, problem) == []
