"""Spot capacity through a day, against oracles from the price table, the market series and the binomial law: spot
nodes are billed at their spot price, taken back when the window's supply falls below them (on demand they stay),
preempted at random at the rate `preemptions_per_day` states, and what ran on them stops at that moment and is
launched again by the next window's reconcile."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import pytest
import yaml

from support.scenario_docs import day_scenario, small

from coral_dagster.app.scenario_plans import library_templates
from coral_dagster.catalog.prices import load_node_prices
from coral_dagster.catalog.scenarios import load_scenario
from coral_dagster.day.cloud import SimCloud
from coral_dagster.day.loop import DayLoop
from coral_dagster.day.run import method_planner
from coral_dagster.day.spot import spot_prices
from coral_dagster.deploy import state
from coral_dagster.deploy.launcher import LaunchRequest
from coral_dagster.errors import CoralError
from coral_dagster.store import Store

# A flat day; instant weights, so an instance serves 3 minutes after launch.
FLAT = {"hourly": [1.0] * 24, "bursts": False, "boot_min": 3, "setup_min": 0, "weight_gbytes_per_s": 1000}


@pytest.fixture(scope="module")
def workdir():
    with tempfile.TemporaryDirectory() as d:
        yield Path(d)


def _loop(scn, workdir: Path, spot: bool) -> DayLoop:
    templates = library_templates(scn, str(workdir / "lib.duckdb"))
    prices = load_node_prices()
    return DayLoop(scn, "coral", method_planner(scn, templates, "coral", time_limit_s=60),
                   Store(workdir / f"dep-{len(list(workdir.iterdir()))}.duckdb"),
                   spot_prices(prices) if spot else prices, sizing="window")


@pytest.mark.parametrize("multiplier", [0.0, 0.1])
def test_falling_supply_takes_back_spot_nodes_and_leaves_on_demand_ones(workdir, multiplier):
    """After hour 0 the market holds `multiplier` × its nodes. On spot, hour 0 is billed at the table's spot prices
    and each (region, node) loses exactly its nodes beyond the new supply as hour 1 starts; on demand (the same day
    otherwise) nothing is taken back."""
    scn = day_scenario(workdir, {**FLAT, "spot": True, "preemptions_per_day": 0.0},
                    series={"window_min": 60, "multipliers": [1, multiplier]}, nodes=40)
    loop = _loop(scn, workdir, spot=True)
    res = loop.run(hours=2.0)
    table = load_node_prices().set_index(["region", "node"])
    used = loop.adopted[0].nodes_used()
    assert used, "hour 0 runs something"
    spot_cost = sum(n * table.loc[(region, node), "spot_usd_per_hour"] for (region, node), n in used.items())
    assert res.windows[0].cost_usd == pytest.approx(spot_cost, rel=1e-9)
    supply = {(o.region, str(o.node)): o.available_nodes for o in scn.market(window=1).offers}
    expected = sum(max(0, n - supply[key]) for key, n in used.items())
    assert expected > 0, "the fall must bite somewhere for the oracle to mean anything"
    assert res.windows[1].nodes_preempted == expected
    assert res.windows[0].nodes_preempted == 0
    if multiplier == 0.0:
        gone = res.windows[1]  # nothing left to serve with, nothing left to pay for
        assert gone.served_share == 0.0 and gone.slo_tokens == 0.0 and gone.cost_usd == 0.0
    on_demand = _loop(day_scenario(workdir, {**FLAT, "preemptions_per_day": 0.0},
                                series={"window_min": 60, "multipliers": [1, multiplier]}, nodes=40), workdir,
                      spot=False)
    kept = on_demand.run(hours=2.0)
    assert [w.nodes_preempted for w in kept.windows] == [0, 0]
    assert kept.windows[1].served_share == pytest.approx(1.0)
    assert kept.windows[1].worst_attainment == pytest.approx(1.0, abs=1e-3)


def _request(i: int, node: str = "L4:1") -> LaunchRequest:
    return LaunchRequest(f"c{i}", {"resources": {"cloud": "aws", "region": "us-east-2", "accelerators": node}}, ())


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("windows", [1, 240])
def test_preemptions_follow_the_stated_daily_rate(seed, windows):
    """4,000 spot nodes through a day, asked once for the whole day or window by window (a constant hazard has no
    memory, so both give the same law): the count preempted is Binomial(4,000, p); it lies within 4 standard
    deviations of its mean. On-demand nodes on the same cloud are never preempted."""
    p, n = 0.1, 4000
    cloud = SimCloud(lambda region, node: 10**6, seed=seed, spot=lambda region, node: node == "L4:1",
                     preemptions_per_day=p)
    for i in range(n):
        cloud.launch(_request(i))
    for i in range(n, n + 100):
        cloud.launch(_request(i, "L40S:1"))
    hits = [hit for _ in range(windows) for hit in cloud.preempt(86_400.0 / windows)]
    assert abs(len(hits) - n * p) <= 4 * math.sqrt(n * p * (1 - p))
    assert all(name in {f"c{i}" for i in range(n)} for name, _ in hits)
    assert all(0 <= offset < 86_400.0 / windows for _, offset in hits)
    assert sum(1 for k in cloud.up.values() if k[1] == "L40S:1") == 100


def test_reclaim_takes_exactly_the_excess():
    capacity = {"L4:1": 10}
    cloud = SimCloud(lambda region, node: capacity[node], seed=0, spot=lambda region, node: True)
    for i in range(10):
        cloud.launch(_request(i))
    capacity["L4:1"] = 4
    taken = cloud.reclaim()
    assert len(taken) == 6 and len(cloud.up) == 4 and not set(taken) & set(cloud.up)
    assert cloud.reclaim() == []


def test_a_preempted_instance_stops_then_and_the_next_window_launches_it_again(workdir):
    """Random preemptions at a high rate on a flat day with ample supply: each preempted instance is billed and
    serves until its moment, inside the window it was hit in, with all its nodes recorded down; the plan stays the
    same, so the next window's reconcile launches exactly the nodes of the instances preempted in this one."""
    scn = day_scenario(workdir, {**FLAT, "spot": True, "preemptions_per_day": 0.99})
    loop = _loop(scn, workdir, spot=True)
    res = loop.run(hours=6.0)
    assert all(p.counts() == loop.adopted[0].counts() for p in loop.adopted), "flat demand keeps the plan"
    stopped = [i for i in loop.instances.values() if math.isfinite(i.bill_until_s)]
    assert stopped, "at 0.99 a day some node is preempted within 6 hours"
    for inst in stopped:
        assert inst.bill_until_s == inst.serve_until_s
    for w in res.windows[:-1]:
        t0 = w.start_min * 60.0
        hit = [i for i in stopped if t0 <= i.bill_until_s < t0 + 3600.0]
        assert (w.nodes_preempted > 0) == bool(hit)
        assert res.windows[w.window + 1].nodes_launched == sum(sum(k for _, k in i.template.nodes.counts)
                                                               for i in hit), f"window {w.window + 1}"
    events = state.read_events(loop.store)
    assert (events.action == "preempted").sum() == sum(sum(k for _, k in i.template.nodes.counts) for i in stopped)


def test_spot_must_be_true_or_false(tmp_path):
    doc = small(day={"spot": "yes"})
    path = tmp_path / "bad.yml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(CoralError, match="spot"):
        load_scenario(path)
