"""Demand from the traces, demand mixes, the scenario glue, plans in DuckDB and the `coral plan` JSON."""

from __future__ import annotations

import csv
import json
from dataclasses import replace
from datetime import datetime

import pytest
from click.testing import CliRunner

from coral_dagster import paths
from coral_dagster.allocation import demand
from coral_dagster.allocation.check import plan_violations
from coral_dagster.allocation.goodput import fluid_goodput
from coral_dagster.allocation.inputs import mixed_scenario, scenario_problem
from coral_dagster.allocation.planner import build_plan, solve_plan
from coral_dagster.allocation.storage import load_plan, store_plan
from coral_dagster.app.plans import latest_plan
from support.synthetic import random_problem, synthetic_template
from coral_dagster.allocation.types import PlannedInstance
from coral_dagster.catalog import traces
from coral_dagster.catalog.nodes import NodeMultiset
from coral_dagster.catalog.scenarios import load_scenario
from coral_dagster.errors import CoralError


def csv_means(name: str) -> tuple[float, float, int, list[float]]:
    """Means and arrival seconds read with the csv module, apart from the pandas path under test."""
    path = paths.TRACES_DIR / traces.TRACE_FILES[name]
    prompts, outputs, stamps = [], [], []
    with open(path) as f:
        for row in csv.DictReader(f):
            prompts.append(int(row["ContextTokens"]))
            outputs.append(int(row["GeneratedTokens"]))
            stamps.append(datetime.fromisoformat(row["TIMESTAMP"][:26]))
    t0 = min(stamps)
    return (sum(prompts) / len(prompts), sum(outputs) / len(outputs), len(prompts),
            [(s - t0).total_seconds() for s in stamps])


@pytest.mark.parametrize("name,prompt,output", [("azure-conv", 1155, 211), ("azure-code", 2048, 28)])
def test_trace_means_match_the_csv_and_the_published_figures(name, prompt, output):
    mean_p, mean_o, n, arrivals = csv_means(name)
    stats = demand.trace_stats(name)
    assert stats.mean_prompt_tokens == pytest.approx(mean_p)
    assert stats.mean_output_tokens == pytest.approx(mean_o)
    assert stats.n_requests == n
    assert round(stats.mean_prompt_tokens) == prompt and round(stats.mean_output_tokens) == output
    # First window: arrivals in [0, 360 s) over the mean arrivals per 360 s.
    first = sum(1 for a in arrivals if a < 360.0) / (n / max(arrivals) * 360.0)
    assert demand.window_factors(name)[0] == pytest.approx(first, rel=1e-6)


def test_scenario_demand_is_rate_times_mean_tokens_times_its_capacity_factor():
    """Means from the trace CSVs themselves; the factor is the capacity rule's, never below the headroom (1.1),
    and exactly the headroom for a plan sized for smooth arrivals."""
    scn = load_scenario("core")
    problem = scenario_problem(scn, ())
    smooth = scenario_problem(scn, (), burst_aware=False)
    for sm in scn.models:
        mean_p, mean_o, _, _ = csv_means(sm.trace)
        for phase, mean in (("prefill", mean_p), ("decode", mean_o)):
            factor = problem.capacity_factors[(sm.model, phase)]
            assert factor >= 1.1
            assert problem.demand_tokens_per_s[(sm.model, phase)] == pytest.approx(sm.rate_req_s * mean * factor)
            assert smooth.demand_tokens_per_s[(sm.model, phase)] == pytest.approx(sm.rate_req_s * mean * 1.1)
    assert problem.churn_k == pytest.approx(10 / 6)


def test_demand_mixes_keep_the_total_and_send_80_percent_to_the_heavy_third():
    rates = {f"m{i}": 25.0 for i in range(6)}
    params = {f"m{i}": float(i + 1) for i in range(6)}
    large = demand.mix_rates(rates, params, "large-heavy")
    small = demand.mix_rates(rates, params, "small-heavy")
    assert sum(large.values()) == pytest.approx(150.0) and sum(small.values()) == pytest.approx(150.0)
    assert large["m5"] + large["m4"] == pytest.approx(120.0) and large["m0"] == pytest.approx(7.5)
    assert small["m0"] + small["m1"] == pytest.approx(120.0) and small["m5"] == pytest.approx(7.5)
    assert demand.mix_rates(rates, params, "uniform") == rates
    with pytest.raises(CoralError):
        demand.mix_rates(rates, params, "heavy")


def test_core_large_heavy_sends_80_percent_to_qwen3_32b():
    scn = load_scenario("core")
    problem = scenario_problem(scn, (), demand_mix="large-heavy", burst_aware=False)
    mean_p = demand.trace_stats("azure-conv").mean_prompt_tokens
    assert problem.demand_tokens_per_s[("qwen3-32b", "prefill")] == pytest.approx(24.0 * mean_p * 1.1)


@pytest.mark.parametrize("mix", ["large-heavy", "small-heavy"])
def test_a_mixed_scenario_plans_the_demand_its_mix_asks_for(mix):
    scn = load_scenario("extended")
    mixed = mixed_scenario(scn, mix)
    assert sum(m.rate_req_s for m in mixed.models) == pytest.approx(sum(m.rate_req_s for m in scn.models))
    assert {m.model: m.rate_req_s for m in mixed.models} != {m.model: m.rate_req_s for m in scn.models}
    for burst_aware in (False, True):
        assert scenario_problem(mixed, (), burst_aware=burst_aware).demand_tokens_per_s == pytest.approx(
            scenario_problem(scn, (), demand_mix=mix, burst_aware=burst_aware).demand_tokens_per_s)


def test_plans_round_trip_through_duckdb(tmp_path):
    from coral_dagster.store import Store

    store = Store(tmp_path / "plans.duckdb")
    core = load_scenario("core")
    problem = replace(random_problem(3, avail_range=(2, 8)), scenario_key=core.scenario_key)
    plan = solve_plan(problem)
    first = store_plan(store, plan, "run-a", {"scenario": "random"})
    second = store_plan(store, plan, "run-b", {"scenario": "random"})
    assert first.plan_id != second.plan_id and first.plan_id and second.plan_id
    assert load_plan(store, first.plan_id) == first
    assert latest_plan(store, core, plan.method) == second
    assert replace(load_plan(store, first.plan_id), plan_id="") == plan
    with pytest.raises(CoralError, match="no homo plan"):
        latest_plan(store, core, "homo")
    rows = store.query("SELECT plan_id, count(*) AS n, sum(count * usd_per_hour) AS cost FROM plan_instances "
                       "GROUP BY plan_id ORDER BY plan_id")
    assert list(rows["n"]) == [len(plan.instances)] * 2
    assert rows["cost"].iloc[0] == pytest.approx(plan.cost_usd_per_hour)
    with pytest.raises(CoralError, match="not in"):
        load_plan(store, "nope")


def test_store_plan_writes_nothing_when_the_transaction_fails(tmp_path, monkeypatch):
    from coral_dagster.allocation import storage
    from coral_dagster.store import Store

    store = Store(tmp_path / "plans.duckdb")
    plan = solve_plan(random_problem(3, avail_range=(2, 8)))
    real = storage.plan_frames

    def broken(*args, **kwargs):
        plans, instances = real(*args, **kwargs)
        return plans, instances.assign(count="not a number")

    store_plan(store, plan, "ok", {})
    monkeypatch.setattr(storage, "plan_frames", broken)
    with pytest.raises(Exception):
        store_plan(store, plan, "bad", {})
    assert list(store.query("SELECT run_id FROM plans")["run_id"]) == ["ok"]


def test_fluid_goodput_counts_the_scarcer_phase_without_headroom():
    x = NodeMultiset.parse("1xL4:1")
    problem = random_problem(1).with_changes(
        templates=(synthetic_template("m0", "prefill", x, 100.0), synthetic_template("m0", "decode", x, 10.0)),
        demand_tokens_per_s={("m0", "prefill"): 110.0, ("m0", "decode"): 22.0})
    plan = solve_plan(problem, scarcity_mode="scale")
    g = fluid_goodput(plan, headroom=1.1)
    served = plan.served_tokens_per_s
    frac = min(1.0, served[("m0", "prefill")] / 100.0, served[("m0", "decode")] / 20.0)
    assert g.per_model["m0"] == pytest.approx(frac)
    assert g.tokens_per_s == pytest.approx(frac * 120.0)


def test_fluid_goodput_needs_both_phases_in_one_region():
    x = NodeMultiset.parse("1xL4:1")
    pre, dec = synthetic_template("m0", "prefill", x, 100.0), synthetic_template("m0", "decode", x, 10.0)
    base = random_problem(1, regions=("r1", "r2"))
    problem = base.with_changes(templates=(pre, dec), available_nodes={k: 4 for k in base.usd_per_hour},
                                demand_tokens_per_s={("m0", "prefill"): 100.0, ("m0", "decode"): 10.0})
    price = problem.instance_usd_per_hour(pre, "r1")

    def plan_with(regions):
        instances = [PlannedInstance(t, r, 1, problem.instance_usd_per_hour(t, r))
                     for t, r in zip((pre, dec), regions)]
        return build_plan(problem, "homo", "heuristic", instances, lp_bound=price, solve_s=0.0)

    assert fluid_goodput(plan_with(("r1", "r1"))).fraction == pytest.approx(1.0)
    apart = plan_with(("r1", "r2"))  # every phase's tokens are there, but no request can use both
    assert apart.served_tokens_per_s == problem.demand_tokens_per_s
    assert fluid_goodput(apart).fraction == 0.0
    assert plan_violations(apart, problem) and not plan_violations(apart, problem, same_region=False)


def test_cli_plan_prints_the_issue_json_shape(tmp_path, monkeypatch):
    from coral_dagster.app import scenario_plans
    from coral_dagster.cli.plan import plan

    scn = load_scenario("core")
    templates = []
    for sm in scn.models:
        for node in scn.node_configs:
            for phase, slo, tps in (("prefill", sm.prefill_slo_ms, 3000.0 * node.count),
                                    ("decode", sm.decode_slo_ms, 400.0 * node.count)):
                templates.append(synthetic_template(sm.model, phase, NodeMultiset.of([node]), tps, slo_ms=slo))
    monkeypatch.setattr(scenario_plans, "library_templates", lambda scenario, db_path=None: tuple(templates))
    db = str(tmp_path / "cli.duckdb")
    # Synthetic templates cannot be simulated, so the closed loop (on by default) is off here.
    result = CliRunner().invoke(plan, ["--scenario", "core", "--db", db, "--json", "--no-closed-loop"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    for key in ("method", "status", "cost_usd_per_hour", "lp_bound_usd_per_hour", "gap", "solve_s", "instances",
                "served", "plan_id"):
        assert key in doc
    assert {"model", "phase", "region", "nodes", "count", "tokens_per_s"} <= set(doc["instances"][0])
    assert doc["status"] == "optimal"
    again = CliRunner().invoke(plan, ["--scenario", "core", "--db", db, "--running", "latest", "--json",
                                      "--no-closed-loop"])
    assert json.loads(again.output)["instances"] == doc["instances"]
    scarce = CliRunner().invoke(plan, ["--scenario", "core", "--db", db, "--availability-scale", "0.05",
                                       "--no-closed-loop"])
    assert scarce.exit_code != 0 and "--scarcity" in str(scarce.exception)


def test_cli_bench_allocation_matches_the_planner(tmp_path, monkeypatch):
    """`coral bench allocation --json`: each method's row is the plan `make_plan` gives on the same inputs."""
    from coral_dagster.app import scenario_plans
    from coral_dagster.allocation.methods import make_plan
    from coral_dagster.cli.plan import bench

    scn = load_scenario("core")
    templates = tuple(synthetic_template(sm.model, phase, NodeMultiset.of([node]), tps * node.count, slo_ms=slo)
                      for sm in scn.models for node in scn.node_configs
                      for phase, slo, tps in (("prefill", sm.prefill_slo_ms, 3000.0),
                                              ("decode", sm.decode_slo_ms, 400.0),
                                              ("aggregated", sm.decode_slo_ms, 300.0)))
    monkeypatch.setattr(scenario_plans, "library_templates", lambda scenario, db_path=None: templates)
    args = ["allocation", "--scenarios", "core", "--settings", "default", "--no-helix", "--sim-duration-s", "0",
            "--db", str(tmp_path / "b.duckdb"), "--json"]
    result = CliRunner().invoke(bench, args)
    assert result.exit_code == 0, result.output
    rows = {r["method"]: r for r in json.loads(result.output)["rows"]}
    problem = scenario_problem(scn, templates)
    for method in ("coral", "homo-ilp", "homo", "cauchy"):
        assert rows[method]["cost_usd_per_hour"] == pytest.approx(make_plan(problem, method).cost_usd_per_hour)
    shown = CliRunner().invoke(bench, args[:-1])
    assert shown.exit_code == 0 and "simulated" in shown.output and "coral" in shown.output


@pytest.mark.slow
def test_cli_bench_allocation_reports_cost_at_equal_attainment_beside_fixed_demand(tmp_path, monkeypatch):
    """`coral bench allocation --settings attainment`: per method the fixed-demand plan (the old rule, the same as
    `make_plan` at fixed demand) and the sized one (the closed loop's, never cheaper: it serves the burst factors on
    top), each with its held-out worst model, and both costs over Coral's; the table is printed."""
    from coral_dagster.app import scenario_plans
    from coral_dagster.allocation.methods import make_plan
    from coral_dagster.catalog.models import get_model
    from coral_dagster.cli.plan import bench

    scn = load_scenario("core")
    templates = tuple(synthetic_template(sm.model, phase, NodeMultiset.of([node]), tps * node.count, slo_ms=slo,
                                         n_layers=get_model(sm.base).n_layers)
                      for sm in scn.models for node in scn.node_configs
                      for phase, slo, tps in (("prefill", sm.prefill_slo_ms, 3000.0),
                                              ("decode", sm.decode_slo_ms, 400.0)))
    monkeypatch.setattr(scenario_plans, "library_templates", lambda scenario, db_path=None: templates)
    args = ["allocation", "--scenarios", "core", "--settings", "attainment", "--no-helix", "--sim-duration-s", "0",
            "--attainment-seeds", "11", "--attainment-duration-s", "20", "--db", str(tmp_path / "b.duckdb"),
            "--json"]
    result = CliRunner().invoke(bench, args)
    assert result.exit_code == 0, result.output
    rows = {r["method"]: r for r in json.loads(result.output)["equal_attainment"]}
    fixed = scenario_problem(scn, templates, burst_aware=False)
    coral = rows["coral"]
    for method in ("coral", "homo-ilp"):
        row = rows[method]
        assert row["fixed_usd_per_hour"] == pytest.approx(make_plan(fixed, method).cost_usd_per_hour)
        assert row["sized_usd_per_hour"] >= row["fixed_usd_per_hour"]
        assert row["fixed_x_coral"] == pytest.approx(row["fixed_usd_per_hour"] / coral["fixed_usd_per_hour"])
        assert row["sized_x_coral"] == pytest.approx(row["sized_usd_per_hour"] / coral["sized_usd_per_hour"])
        assert 0.0 <= row["sized_worst_attainment"] <= 1.0 and 1 <= row["loop_rounds"] <= 3
    shown = CliRunner().invoke(bench, args[:-1])
    assert shown.exit_code == 0 and "equal attainment" in shown.output


def test_bench_png_draws_every_setting():
    import io

    import matplotlib.image

    from coral_dagster.plots import bench_png

    rows = [{"setting": s, "scenario": "core", "method": m, "cost_usd_per_hour": c, "cost_ratio_to_coral": c / 10.0,
             "goodput_fraction": 1.0, "goodput_sim_fraction": g}
            for s in ("default", "scarcity:+25%") for m, c, g in (("coral", 10.0, 0.99), ("homo", 15.0, None))]
    rows.append({"setting": "default", "scenario": "core", "method": "cauchy", "status": "error"})
    image = matplotlib.image.imread(io.BytesIO(bench_png({"rows": rows})))
    assert image.ndim == 3 and image.shape[0] > 300 and image.shape[1] > 600


def test_recent_matches_by_identity_and_key_and_forgets_the_oldest():
    from coral_dagster.allocation.recent import Recent

    memo, calls = Recent(2), []

    def make(tag):
        return lambda: calls.append(tag) or tag

    a, b, c, a_copy = (1, 2), (3, 4), (5, 6), tuple([1, 2])
    assert memo.get(a, make("a")) == "a" and memo.get(a, make("again")) == "a"
    assert memo.get(a_copy, make("copy")) == "copy"  # equal but not the same object: made anew
    assert memo.get(a, make("key"), key="k") == "key"  # same object, other key
    memo.get(b, make("b"))
    memo.get(c, make("c"))  # size 2: only b and c are remembered now
    assert memo.get(a, make("a2")) == "a2"
    assert calls == ["a", "copy", "key", "b", "c", "a2"]
