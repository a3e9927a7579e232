"""A Coral plan in the simulator: it holds its SLOs at the demand it was planned for and not at three times that."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from coral_dagster.allocation.inputs import scenario_problem
from coral_dagster.allocation.planner import solve_plan
from coral_dagster.catalog.models import get_model
from coral_dagster.catalog.nodes import NodeMultiset
from coral_dagster.catalog.scenarios import load_scenario
from coral_dagster.simulator import goodput_estimator, simulate_plan
from coral_dagster.simulator.plots import plot_goodput, plot_latency_cdf
from coral_dagster.templates.throughput import build_tables, workload_for
from coral_dagster.templates.types import Stage, Template


@pytest.fixture(scope="module")
def phi4_core():
    """The core scenario cut to Phi-4, and the Coral ILP's cheapest plan over one-node templates whose throughput
    is the library's T̂ for one stage (the scenario's planning rule: SLO margin, prefill utilisation, trace lengths).
    """
    scn = load_scenario("core")
    sm = scn.model("phi-4")
    scn = dataclasses.replace(scn, models=(sm,))
    layers = get_model("phi-4").n_layers
    templates = []
    for phase in ("prefill", "decode"):
        tables = build_tables(workload_for(sm, phase, scn.link_gbps), scn.node_configs, 1)
        for node in scn.node_configs:
            point = tables.point(1, node, layers)
            if point.tokens_per_s > 0:
                templates.append(Template("phi-4", phase, tables.workload.slo_ms, NodeMultiset.of([node]),
                                          (Stage(0, layers, (node,), (1.0,)),), point.tokens_per_s, point.bound))
    plan = solve_plan(scenario_problem(scn, templates, burst_aware=False))  # sized for the Poisson arrivals below
    return scn, plan


@pytest.mark.slow
def test_plan_meets_slos_at_planned_demand_and_not_at_three_times(phi4_core):
    """Poisson arrivals at exactly the planned rate (a trace replay's 10-minute windows run up to 20% off it),
    over three seeds. T̂ keeps 95% of prompts within slo_margin × the SLO, so twice the planned rate still holds
    the full SLO (BENCHMARKS.md, "Template reach"); three times runs its prefill nodes near saturation."""
    scn, plan = phi4_core
    assert {i.template.phase for i in plan.instances} == {"prefill", "decode"}
    at_plan = [simulate_plan(plan, scn, trace="poisson", duration_s=600, seed=s) for s in range(3)]
    doubled = [simulate_plan(plan, scn, trace="poisson", duration_s=600, seed=s, rate_scale=3.0) for s in range(3)]
    attained = [r.attainment_by_model["phi-4"] for r in at_plan]
    assert sum(attained) / 3 >= 0.95 and min(attained) >= 0.93
    assert max(r.attainment_by_model["phi-4"] for r in doubled) < 0.9
    for r in at_plan:
        assert r.counts["completed"] == r.counts["arrivals"]
        # At the planned rate goodput is nearly all offered tokens; tripling the load cannot triple it.
        assert r.goodput_tokens_per_s >= 0.9 * r.offered_tokens_per_s
    assert all(d.goodput_tokens_per_s < 0.9 * 3 * a.goodput_tokens_per_s for a, d in zip(at_plan, doubled))


def test_bursty_arrivals_miss_more_than_poisson(phi4_core):
    scn, plan = phi4_core
    poisson = simulate_plan(plan, scn, trace="poisson", duration_s=300, seed=2)
    bursty = simulate_plan(plan, scn, trace="gamma", gamma_cv=4.0, duration_s=300, seed=2)
    assert bursty.attainment < poisson.attainment
    assert bursty.by_model.ttft_p99_ms.iloc[0] > poisson.by_model.ttft_p99_ms.iloc[0]


def test_result_tables_cost_and_plots(phi4_core, tmp_path: Path):
    scn, plan = phi4_core
    res = simulate_plan(plan, scn, duration_s=120, seed=3)
    again = simulate_plan(plan, scn, duration_s=120, seed=3)
    assert res.requests.equals(again.requests)
    cost = sum(i.count * i.usd_per_hour for i in plan.instances)
    assert res.cost_usd_per_hour == pytest.approx(cost)
    done = res.requests[res.requests.status == "completed"]
    tokens = done.prompt_tokens.sum() + done.output_tokens.sum()
    assert res.usd_per_million_tokens == pytest.approx(cost * 120 / 3600 / tokens * 1e6)
    assert set(res.nodes.busy_fraction.between(0, 1)) == {True}
    assert len(res.nodes) == sum(i.count * i.template.nodes.size for i in plan.instances)
    timeline = res.goodput_timeline(10.0)
    assert (timeline.goodput_tokens_per_s * 10.0).sum() == pytest.approx(
        (res.requests[res.requests.met_slo].prompt_tokens + res.requests[res.requests.met_slo].output_tokens).sum())
    for png in (plot_latency_cdf(res, tmp_path / "cdf.png"), plot_goodput(res, tmp_path / "goodput.png")):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    json.dumps(res.summary())
    estimate = goodput_estimator(scn, duration_s=120, seed=3)(plan, 1.0)
    assert estimate.tokens_per_s == pytest.approx(res.goodput_tokens_per_s)
    assert estimate.per_model == res.attainment_by_model
