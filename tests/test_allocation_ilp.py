"""The allocation ILP against brute force, an independent checker, and churn and infeasibility oracles."""

from __future__ import annotations

import math
import random

import pytest

from coral_dagster.allocation.baselines import plan_cauchy, plan_homo, plan_homo_ilp
from coral_dagster.allocation.check import plan_violations
from coral_dagster.allocation.codec import plan_to_doc
from coral_dagster.allocation.planner import solve_plan
from coral_dagster.allocation.problem import AllocationProblem
from coral_dagster.allocation.prune import dominated_ids
from support.synthetic import random_problem, synthetic_template
from coral_dagster.catalog.nodes import NodeConfig, NodeMultiset
from coral_dagster.errors import InfeasibleError

from support.brute_force import every_plan, routed

EXACT = 1e-9


def brute_force(problem: AllocationProblem, scale: float = 1.0):
    """Cheapest objective over every integer allocation within availability (None when none meets demand).

    Written without the ILP's columns or pruning (`every_plan` walks templates × regions, bounding each count by
    the nodes still free), pricing churn as K × price of each instance beyond the running plan. Demand is met
    when a model's requests can be split over regions with both phases of each share served in its region.
    """
    pairs = [(t, r) for t in problem.templates for r in sorted({r for r, _ in problem.usd_per_hour})
             if all((r, n) in problem.usd_per_hour for n, _ in t.nodes.counts)]
    running = any(v > 0 for v in problem.running.values())
    best = math.inf
    for counts, cost in every_plan(problem, pairs, problem.available_nodes):
        if any(v < scale * (1 - 1e-7) for v in routed(problem, counts).values()):
            continue
        if running:
            cost += sum(problem.churn_k * problem.instance_usd_per_hour(t, r)
                        * max(0, n - problem.running.get((t.template_id, r), 0)) for (t, r), n in counts.items())
        best = min(best, cost)
    return None if best == math.inf else best


def tiny(seed: int, **kw) -> AllocationProblem:
    return random_problem(seed, n_models=1, gpus=("L4", "L40S"), counts=(1,), n_max=2, avail_range=(0, 3),
                          demand_range=(500.0, 6000.0), **kw)


@pytest.mark.parametrize("seed", range(8))
def test_ilp_optimum_equals_brute_force(seed):
    problem = tiny(seed, regions=("r1",) if seed % 2 else ("r1", "r2"), aggregated=seed % 3 == 0)
    expected = brute_force(problem)
    if expected is None:
        with pytest.raises(InfeasibleError):
            solve_plan(problem, gap_rel=EXACT)
        return
    plan = solve_plan(problem, gap_rel=EXACT)
    assert plan.status == "optimal"
    assert plan.objective_usd_per_hour == pytest.approx(expected, rel=1e-7, abs=1e-9)
    assert plan.lp_bound_usd_per_hour <= plan.objective_usd_per_hour + 1e-7
    assert plan_violations(plan, problem) == []


@pytest.mark.parametrize("seed", range(4))
def test_ilp_with_churn_equals_brute_force(seed):
    problem = random_problem(seed + 100, n_models=1, gpus=("L4", "L40S"), counts=(1,), n_max=2, regions=("r1",),
                             avail_range=(2, 3), demand_range=(300.0, 1500.0), churn_k=10 / 6)
    plan = solve_plan(problem, gap_rel=EXACT)
    assert plan.objective_usd_per_hour == pytest.approx(brute_force(problem), rel=1e-7)
    rng = random.Random(seed)
    cheaper = {k: round(p * rng.uniform(0.3, 1.0), 3) for k, p in problem.usd_per_hour.items()}
    replan = problem.with_changes(running=plan.counts(), usd_per_hour=cheaper)
    again = solve_plan(replan, gap_rel=EXACT)
    assert again.objective_usd_per_hour == pytest.approx(brute_force(replan), rel=1e-7)


def feasible_random(seed: int) -> tuple[AllocationProblem, float]:
    """A random instance whose demand a random allocation meets: it is feasible and that allocation's cost
    bounds the optimum from above."""
    rng = random.Random(seed)
    base = random_problem(seed, n_models=2, gpus=("L4", "L40S"), n_max=2, avail_range=(2, 10),
                          aggregated=seed % 2 == 0)
    free = dict(base.available_nodes)
    served = {k: 0.0 for k in base.demand_tokens_per_s}
    cost = 0.0
    home = {m: rng.choice(sorted({r for r, _ in base.usd_per_hour})) for m, _ in base.demand_tokens_per_s}
    for t in rng.sample(list(base.templates), 12):
        r = home[t.model]  # one region per model, so the witness routes every request within a region
        if all(free.get((r, c), 0) >= k for c, k in t.nodes.counts) and all(
                (r, c) in base.usd_per_hour for c, _ in t.nodes.counts):
            for c, k in t.nodes.counts:
                free[(r, c)] -= k
            cost += sum(k * base.usd_per_hour[(r, c)] for c, k in t.nodes.counts)
            for key in base.demand_tokens_per_s:
                if t.model == key[0] and t.phase == key[1]:
                    served[key] += t.tokens_per_s
                elif t.model == key[0] and t.phase == "aggregated":
                    ratio = base.prompt_per_output[t.model]
                    served[key] += t.tokens_per_s * (ratio if key[1] == "prefill" else 1.0)
    demand = {k: v * rng.uniform(0.5, 1.0) for k, v in served.items()}
    return base.with_changes(demand_tokens_per_s=demand), cost


@pytest.mark.parametrize("seed", range(5))
def test_feasible_random_plans_meet_demand_within_availability(seed):
    problem, witness_cost = feasible_random(seed)
    plan = solve_plan(problem, time_limit_s=20)
    assert plan_violations(plan, problem) == []
    assert plan.cost_usd_per_hour <= witness_cost + 1e-6
    assert plan.lp_bound_usd_per_hour <= plan.cost_usd_per_hour + 1e-6
    for baseline in (plan_homo, plan_cauchy, plan_homo_ilp):
        try:
            other = baseline(problem)
        except InfeasibleError:
            continue
        assert plan_violations(other, problem) == []
        # Coral's template space contains theirs, under the same constraints: never dearer.
        assert plan.cost_usd_per_hour <= other.cost_usd_per_hour * (1 + 1e-4) + 1e-9


@pytest.mark.parametrize("seed", range(3))
def test_pruning_is_lossless_and_dominance_matches_pairwise(seed):
    problem, _ = feasible_random(seed + 50)
    pruned = solve_plan(problem, gap_rel=1e-7)
    full = solve_plan(problem, gap_rel=1e-7, prune=False)
    assert pruned.cost_usd_per_hour == pytest.approx(full.cost_usd_per_hour, rel=1e-7)
    templates = list(problem.templates)
    pairwise = set()
    for a in templates:
        for b in templates:
            if (a is not b and (a.model, a.phase) == (b.model, b.phase) and b.tokens_per_s >= a.tokens_per_s
                    and all(b.node_count(n) <= a.node_count(n) for n, _ in a.nodes.counts + b.nodes.counts)
                    and (b.tokens_per_s > a.tokens_per_s or b.nodes.size < a.nodes.size)):
                pairwise.add(a.template_id)
    assert dominated_ids(templates) == pairwise


@pytest.mark.parametrize("seed", range(4))
def test_unchanged_replan_changes_nothing(seed):
    problem, _ = feasible_random(seed + 10)
    problem = problem.with_changes(churn_k=10 / 6)
    plan = solve_plan(problem, gap_rel=EXACT)
    again = solve_plan(problem.with_changes(running=plan.counts()), gap_rel=EXACT)
    assert again.counts() == plan.counts()
    assert again.churn_usd_per_hour == 0


def two_node_problem(price_y: float, running: dict | None = None, churn_k: float = 10 / 6) -> AllocationProblem:
    x, y = NodeConfig("X", 1), NodeConfig("Y", 1)
    tx = synthetic_template("m", "prefill", NodeMultiset.of([x]), 100.0)
    ty = synthetic_template("m", "prefill", NodeMultiset.of([y]), 100.0)
    return AllocationProblem("two", (tx, ty), {("r1", x): 1.0, ("r2", y): price_y},
                             {("r1", x): 5, ("r2", y): 5}, {("m", "prefill"): 300.0},
                             running=running or {}, churn_k=churn_k)


def test_price_drop_smaller_than_churn_penalty_moves_nothing():
    first = solve_plan(two_node_problem(1.2), gap_rel=EXACT)
    assert {k: v for k, v in first.counts().items()} == {("m|prefill|1000|1xX:1", "r1"): 3}
    # Y drops to 0.9 $/h: moving saves 3 × 0.1 = 0.3 $/h, launching 3 Y costs 3 × 0.9 × K = 4.5 $/h of churn.
    small = solve_plan(two_node_problem(0.9, first.counts()), gap_rel=EXACT)
    assert small.counts() == first.counts()
    # Y drops to 0.1 $/h: moving saves 2.7 $/h, the churn penalty is 3 × 0.1 × K = 0.5 $/h: it moves.
    big = solve_plan(two_node_problem(0.1, first.counts()), gap_rel=EXACT)
    assert big.counts() == {("m|prefill|1000|1xY:1", "r2"): 3}


@pytest.mark.parametrize("seed", range(4))
def test_random_price_drops_below_penalty_move_nothing(seed):
    problem, _ = feasible_random(seed + 20)
    problem = problem.with_changes(churn_k=10 / 6)
    plan = solve_plan(problem, gap_rel=EXACT)
    rng = random.Random(seed)
    dropped = {k: p * (1 - rng.uniform(0, 0.05)) for k, p in problem.usd_per_hour.items()}
    replan = problem.with_changes(usd_per_hour=dropped, running=plan.counts())
    stay = sum(i.count * replan.instance_usd_per_hour(i.template, i.region) for i in plan.instances)
    fresh = solve_plan(problem.with_changes(usd_per_hour=dropped), gap_rel=EXACT).cost_usd_per_hour
    cheapest = min(replan.instance_usd_per_hour(t, r) for t in replan.templates for r in replan.regions
                   if replan.max_instances(t, r) > 0)
    new = solve_plan(replan, gap_rel=EXACT)
    assert new.objective_usd_per_hour <= stay + 1e-7
    # Any plan that launches something pays at least K × the cheapest instance on top of the fresh optimum.
    if stay - fresh < replan.churn_k * cheapest:
        assert new.counts() == plan.counts()


def test_infeasible_error_names_the_binding_model_and_nodes():
    x = NodeConfig("X", 1)
    t = synthetic_template("big-model", "prefill", NodeMultiset.of([x]), 100.0)
    small = synthetic_template("small-model", "prefill", NodeMultiset.of([x]), 100.0)
    problem = AllocationProblem("inf", (t, small), {("r1", x): 1.0}, {("r1", x): 4},
                                {("big-model", "prefill"): 1000.0, ("small-model", "prefill"): 50.0})
    with pytest.raises(InfeasibleError) as err:
        solve_plan(problem)
    text = str(err.value)
    assert "big-model prefill needs 1,000 tokens/s, at most 400 is reachable" in text
    # 10 nodes for big-model and one whole node for small-model (C2's capped coefficients); 4 are available.
    assert "X:1 in r1: 11.0 nodes needed, 4 available (short 7.0)" in text
    assert "small-model" not in text.split("Short even alone")[1].split("Binding")[0]
    assert "--scarcity" in text


def brute_force_scale(problem: AllocationProblem) -> float:
    """Largest uniform fraction of demand an allocation reaches, by trying fractions on a fine grid."""
    lo = 0.0
    for s in [i / 400 for i in range(1, 401)]:
        if brute_force(problem, scale=s) is not None:
            lo = s
    return lo


@pytest.mark.parametrize("seed", [1, 3, 7, 8])
def test_scarcity_modes_match_brute_force_and_meet_their_levels(seed):
    problem = tiny(seed, regions=("r1",))
    problem = problem.with_changes(demand_tokens_per_s={k: v * 4 for k, v in problem.demand_tokens_per_s.items()})
    assert brute_force(problem) is None, f"seed {seed} is no longer a scarcity draw: pick the seeds again"
    scaled = solve_plan(problem, scarcity_mode="scale", gap_rel=EXACT)
    assert scaled.status == "scaled"
    assert scaled.demand_scale == pytest.approx(brute_force_scale(problem), abs=1 / 400)
    assert plan_violations(scaled, problem) == []
    assert scaled.bottlenecks
    fair = solve_plan(problem, scarcity_mode="fair", gap_rel=EXACT)
    assert fair.status == "fair-share"
    assert fair.demand_scale >= scaled.demand_scale - 1e-7
    assert plan_violations(fair, problem) == []


def test_fair_share_raises_models_that_can_go_higher():
    x, y = NodeConfig("X", 1), NodeConfig("Y", 1)
    a = synthetic_template("a", "prefill", NodeMultiset.of([x]), 100.0)
    b = synthetic_template("b", "prefill", NodeMultiset.of([y]), 100.0)
    problem = AllocationProblem("fair", (a, b), {("r", x): 1.0, ("r", y): 1.0}, {("r", x): 2, ("r", y): 5},
                                {("a", "prefill"): 400.0, ("b", "prefill"): 400.0})
    fair = solve_plan(problem, scarcity_mode="fair")
    scaled = solve_plan(problem, scarcity_mode="scale")
    # a is capped at 200/400 by its 2 X nodes; b has its own nodes and reaches full demand under fair share.
    assert scaled.served_fraction() == {("a", "prefill"): 0.5, ("b", "prefill"): 0.5}
    assert fair.served_fraction() == {("a", "prefill"): 0.5, ("b", "prefill"): 1.0}


def test_lp_bound_is_a_lower_bound_and_gap_consistent():
    problem, _ = feasible_random(3)
    plan = solve_plan(problem)
    assert plan.lp_bound_usd_per_hour <= plan.mip_bound_usd_per_hour + 1e-6
    assert plan.mip_bound_usd_per_hour <= plan.objective_usd_per_hour + 1e-6
    assert plan.gap == pytest.approx((plan.objective_usd_per_hour - plan.lp_bound_usd_per_hour)
                                     / plan.objective_usd_per_hour)
    assert plan.status == "optimal" and 0 <= plan.mip_gap <= 1e-4 + 1e-9  # the solver's own tolerance
    assert plan.mip_gap <= plan.gap + 1e-12
    assert plan_to_doc(plan)["mip_gap"] == plan.mip_gap


def test_homogeneous_baselines_only_use_one_configuration_per_instance():
    problem, _ = feasible_random(4)
    for plan in (plan_homo(problem, scarcity_mode="scale"), plan_cauchy(problem, scarcity_mode="scale"),
                 plan_homo_ilp(problem)):
        assert plan.instances and all(len(i.template.nodes.counts) == 1 for i in plan.instances)
    assert all(i.template.phase == "aggregated" and i.template.nodes.counts[0][1] == 1
               for i in plan_homo(problem, scarcity_mode="scale").instances)


@pytest.mark.parametrize("seed,loose,first", [(30, True, 300), (31, True, 300), (33, False, 300),
                                              (33, False, 1), (34, False, 1), (35, False, 1), (36, False, 2)])
def test_decomposition_column_generation_and_fixing_match_the_direct_ilp(seed, loose, first, monkeypatch):
    from coral_dagster.allocation import colgen, ilp
    from coral_dagster.allocation.prune import prune_columns

    problem, _ = feasible_random(seed)
    if loose:  # availability that never binds: the per-group optima are the whole optimum
        problem = problem.with_changes(available_nodes={k: v * 20 for k, v in problem.available_nodes.items()})
    columns, _ = prune_columns(problem)
    direct = ilp.min_cost(problem, columns, gap_rel=EXACT, time_limit_s=600)
    relaxed = ilp.min_cost(problem, columns, integer=False)
    # Force the detour on these small instances, with few starting columns so pricing has work to do.
    monkeypatch.setattr(colgen, "DIRECT_MAX", 0)
    monkeypatch.setattr(colgen, "INITIAL_PER_KEY", 1)
    monkeypatch.setattr(colgen, "FIRST_PER_GROUP", first)  # a poor first plan: fixing must widen the ILP
    fast = colgen.solve_min_cost(problem, columns, gap_rel=EXACT, time_limit_s=600)
    assert fast.result.status == "optimal"
    assert fast.result.objective == pytest.approx(direct.objective, rel=1e-7)
    assert fast.lp_objective == pytest.approx(relaxed.objective, rel=1e-7)
    assert fast.decomposed or not loose


@pytest.mark.parametrize("seed", [40, 41])
def test_column_generation_matches_the_direct_scarcity_models(seed, monkeypatch):
    from coral_dagster.allocation import colgen, ilp
    from coral_dagster.allocation.prune import prune_columns

    problem, _ = feasible_random(seed)
    problem = problem.with_changes(demand_tokens_per_s={k: 3 * v for k, v in problem.demand_tokens_per_s.items()})
    columns, _ = prune_columns(problem)
    keys = [k for k, d in problem.demand_tokens_per_s.items() if d > 0]
    level = ilp.max_level(problem, columns, {"all": keys}, gap_rel=EXACT)
    sigma = ilp.availability_scale_lp(problem, columns)
    elastic = ilp.min_cost(problem, columns, integer=False, overflow_weight=1000.0)
    monkeypatch.setattr(colgen, "DIRECT_MAX", 0)
    monkeypatch.setattr(colgen, "INITIAL_PER_KEY", 1)
    fast = colgen.solve_max_level(problem, columns, {"all": keys}, gap_rel=EXACT)
    assert fast.status == "optimal"
    assert fast.objective == pytest.approx(level.objective, rel=1e-7, abs=1e-9)
    assert colgen.min_availability_scale(problem, columns) == pytest.approx(sigma.objective, rel=1e-7)
    assert colgen.elastic_lp(problem, columns, 1000.0).objective == pytest.approx(elastic.objective, rel=1e-7)


@pytest.mark.parametrize("seed", range(30, 42))
def test_unproven_fixing_reports_a_bound_below_the_true_optimum(seed, monkeypatch):
    """With fixing capped at one column per group the ILPs leave columns out: the plan may be unproven, and its
    bound (the best of each ILP's solver bound and LP bound plus the least reduced cost left out) must still lie
    below the direct ILP's optimum and above the LP bound."""
    from coral_dagster.allocation import colgen, ilp
    from coral_dagster.allocation.prune import prune_columns

    problem, _ = feasible_random(seed)
    columns, _ = prune_columns(problem)
    optimum = ilp.min_cost(problem, columns, gap_rel=EXACT, time_limit_s=600)
    assert optimum.status == "optimal"  # the oracle itself proven, however loaded the machine
    monkeypatch.setattr(colgen, "DIRECT_MAX", 0)
    monkeypatch.setattr(colgen, "INITIAL_PER_KEY", 1)
    monkeypatch.setattr(colgen, "FIRST_PER_GROUP", 1)
    monkeypatch.setattr(colgen, "MAX_PER_GROUP", 2)
    fast = colgen.solve_min_cost(problem, columns, gap_rel=EXACT)
    assert fast.result.status in ("optimal", "feasible-work-limit")
    assert fast.lp_objective - 1e-7 <= fast.result.bound <= optimum.objective + 1e-7
    assert fast.result.objective >= optimum.objective - 1e-7
    if fast.result.status == "optimal":
        assert fast.result.objective == pytest.approx(optimum.objective, rel=1e-7)


@pytest.mark.parametrize("seed,ample,direct", [(s, a, d) for s in range(40, 44) for a in (True, False)
                                               for d in (True, False)])
def test_an_ilp_stopped_before_any_plan_falls_back_to_the_rounded_lp(seed, ample, direct, monkeypatch):
    """HiGHS stopping at its limit before any incumbent (every integer solve answers no-solution): the plan is the
    LP rounded (down, shortfalls filled, dearest dropped). The independent checker finds it meets demand within
    availability, it costs no less than the optimum, and its bound lies between the LP and the optimum. With ample
    availability the rounding always fits; with tight availability it may not, and then the error says to raise
    the limit."""
    from coral_dagster.allocation import colgen, ilp
    from coral_dagster.errors import SolverTimeoutError

    problem, _ = feasible_random(seed)
    if ample:
        problem = problem.with_changes(available_nodes={k: v * 1000 for k, v in problem.available_nodes.items()})
    optimum = solve_plan(problem, gap_rel=EXACT, time_limit_s=600)
    assert optimum.status == "optimal"
    real = ilp.min_cost

    def timed_out(*args, integer=True, **kw):
        if integer:
            return ilp.SolveResult("no-solution", (), math.nan, math.nan, 0.0)
        return real(*args, integer=integer, **kw)

    monkeypatch.setattr(ilp, "min_cost", timed_out)
    if not direct:
        monkeypatch.setattr(colgen, "DIRECT_MAX", 0)
    try:
        plan = solve_plan(problem, gap_rel=EXACT)
    except SolverTimeoutError:
        assert not ample
        return
    assert plan.status in ("feasible-work-limit", "feasible-time-limit")
    assert any("the LP rounded" in n for n in plan.notes)
    assert plan_violations(plan, problem) == []
    assert plan.objective_usd_per_hour >= optimum.objective_usd_per_hour - 1e-7
    assert plan.lp_bound_usd_per_hour - 1e-7 <= plan.mip_bound_usd_per_hour <= optimum.objective_usd_per_hour + 1e-7
