"""Simulated goodput in the allocation benchmark: the simulator's per-model rate override, the estimator tracking
load, the bench's simulated column and the one-time library preparation kept out of the timed solves."""

from __future__ import annotations

import numpy as np
import pytest

import coral_dagster.allocation.prune as prune
from coral_dagster.allocation.baselines import homogeneous_problem
from coral_dagster.app.allocation_bench import BenchConfig, bench_simulator, prepare_libraries, run_allocation_bench
from coral_dagster.allocation.inputs import scenario_problem, scenario_rates
from coral_dagster.allocation.methods import make_plan
from coral_dagster.allocation.planner import solve_plan
from coral_dagster.catalog.nodes import NodeMultiset
from coral_dagster.catalog.scenarios import load_scenario
from coral_dagster.errors import InfeasibleError, UnknownNameError
from coral_dagster.simulator import goodput_estimator, simulate_plan
from coral_dagster.templates.best import best_for_nodes

pytestmark = pytest.mark.slow  # plans and simulates core several times (`-m "not slow"` leaves it out)


@pytest.fixture(scope="module")
def core():
    """The core scenario with the best template of every model and phase on one node and on two alike nodes of
    each configuration (the library's planning margins, built in well under a second), and the Coral ILP's
    cheapest plan over them."""
    scn = load_scenario("core")
    templates = []
    for sm in scn.models:
        for node in scn.node_configs:
            for phase in ("prefill", "decode"):
                for k in (1, 2):
                    try:
                        templates.append(best_for_nodes(sm.model, phase, NodeMultiset.of([node] * k),
                                                        scenario="core")[0])
                    except InfeasibleError:
                        continue  # the weights do not fit or no batch meets the SLO on these nodes
    templates = tuple(templates)
    plan = solve_plan(scenario_problem(scn, templates, burst_aware=False))
    return scn, templates, plan


def _model_rows(res, model):
    return res.requests[res.requests.model == model].reset_index(drop=True)


def test_rates_equal_to_the_scenarios_change_nothing(core):
    scn, _, plan = core
    own = simulate_plan(plan, scn, duration_s=60, seed=1)
    same = simulate_plan(plan, scn, duration_s=60, seed=1, rates={m.model: m.rate_req_s for m in scn.models})
    assert own.requests.equals(same.requests)
    assert own.by_model.equals(same.by_model)
    assert same.offered_tokens_per_s == own.offered_tokens_per_s


def test_doubling_one_rate_changes_that_models_offered_tokens_only(core):
    """Trace replay time-scales the trace: at twice the rate the first D seconds hold exactly the requests the
    normal rate puts in the first 2·D seconds, and the other models' streams are untouched."""
    scn, _, plan = core
    base = {m.model: m.rate_req_s for m in scn.models}
    doubled = simulate_plan(plan, scn, duration_s=60, seed=2, rates={"phi-4": 2 * base["phi-4"]})
    normal = simulate_plan(plan, scn, duration_s=60, seed=2)
    long = simulate_plan(plan, scn, duration_s=120, seed=2)
    for model in ("qwen3-32b", "gpt-oss-20b"):
        a, b = _model_rows(doubled, model), _model_rows(normal, model)
        assert a[["arrival_s", "prompt_tokens", "output_tokens"]].equals(b[["arrival_s", "prompt_tokens",
                                                                           "output_tokens"]])
    fast, slow = _model_rows(doubled, "phi-4"), _model_rows(long, "phi-4")
    assert np.array_equal(fast.prompt_tokens.to_numpy(), slow.prompt_tokens.to_numpy())
    assert np.array_equal(fast.output_tokens.to_numpy(), slow.output_tokens.to_numpy())
    assert np.allclose(fast.arrival_s.to_numpy() * 2, slow.arrival_s.to_numpy())
    fast_tokens, normal_tokens = (float((_model_rows(r, "phi-4").prompt_tokens
                                         + _model_rows(r, "phi-4").output_tokens).sum()) for r in (doubled, normal))
    assert fast_tokens > 1.5 * normal_tokens
    assert doubled.offered_tokens_per_s == pytest.approx(normal.offered_tokens_per_s
                                                         + (fast_tokens - normal_tokens) / 60)


def test_unknown_model_in_rates_is_named(core):
    scn, _, plan = core
    with pytest.raises(UnknownNameError, match="llama"):
        simulate_plan(plan, scn, duration_s=10, rates={"llama-9b": 1.0})


def test_simulated_goodput_tracks_load(core):
    """A plan for demand D keeps nearly all of D within SLO (Poisson at exactly D) and far less at 3·D."""
    scn, templates, _ = core
    rates = scenario_rates(scn, "large-heavy")
    # One-type templates alone need more than core's 16 L40S:1 nodes for this mix: twice the availability.
    plan = solve_plan(scenario_problem(scn, templates, demand_mix="large-heavy", burst_aware=False,
                                       availability_scale=2.0))
    simulator = bench_simulator(BenchConfig(sim_duration_s=120.0))
    at_plan = simulator(scn, rates)(plan, scn.headroom)
    tripled = simulator(scn, {m: 3 * r for m, r in rates.items()})(plan, scn.headroom)
    assert at_plan.estimator == "simulated"
    assert at_plan.fraction >= 0.9
    assert min(at_plan.per_model.values()) >= 0.85
    assert tripled.fraction <= 0.6 and tripled.fraction < at_plan.fraction - 0.3
    assert bench_simulator(BenchConfig(sim_duration_s=0)) is None


def test_library_prepared_once_and_reused(core, monkeypatch):
    """After `prepare_libraries`, every problem the methods solve reuses the prepared libraries: dominance is
    never computed again (the counting stand-in would fail)."""
    scn, templates, _ = core
    problem = scenario_problem(scn, templates)
    again = scenario_problem(scn, templates, demand_mix="small-heavy")
    assert again.templates is problem.templates
    assert homogeneous_problem(again).templates is homogeneous_problem(problem).templates
    prepare_s, report = prepare_libraries(problem)
    assert prepare_s >= 0 and report.templates == len(prune.prepare(problem.templates).templates)

    def no_recompute(*_args, **_kwargs):
        raise AssertionError("dominance computed again: a library was not reused")

    monkeypatch.setattr(prune, "dominated_ids", no_recompute)
    for method in ("coral", "homo-ilp", "homo"):
        make_plan(again, method, scarcity_mode="scale", time_limit_s=10)


def test_bench_rows_carry_both_goodputs(core):
    scn, templates, _ = core
    config = BenchConfig(scenarios=("core",), methods=("coral", "homo"), settings=("default",), helix=False,
                         sim_duration_s=30.0)
    doc = run_allocation_bench(lambda _scn: templates, config)
    assert doc["libraries"]["core"]["prepare_s"] > 0
    assert doc["config"]["simulation"] == {"duration_s": 30.0, "arrivals": "poisson", "seed": 0, "replan": True}
    coral = next(r for r in doc["rows"] if r["method"] == "coral")
    # Oracle: the same plan simulated directly at the scenario's rates (scaled down alike, as the bench shows a
    # method that cannot meet demand, when these one-type templates cannot).
    try:
        plan = make_plan(scenario_problem(scn, templates), "coral", time_limit_s=10)
    except InfeasibleError:
        plan = make_plan(scenario_problem(scn, templates), "coral", scarcity_mode="scale", time_limit_s=10)
    assert plan.cost_usd_per_hour == pytest.approx(coral["cost_usd_per_hour"])
    direct = goodput_estimator(scn, trace="poisson", duration_s=30.0, seed=0)(plan, scn.headroom)
    assert coral["goodput_sim_fraction"] == pytest.approx(direct.fraction)
    assert coral["sim_attainment_by_model"] == pytest.approx(direct.per_model)
    for row in doc["rows"]:
        assert 0.0 <= row["goodput_sim_fraction"] <= 1.0 and 0.0 <= row["goodput_fraction"] <= 1.0
    off = run_allocation_bench(lambda _scn: templates, BenchConfig(
        scenarios=("core",), methods=("homo",), settings=("default",), helix=False, sim_duration_s=0))
    assert off["rows"][0]["goodput_sim_fraction"] is None
