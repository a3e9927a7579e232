"""The stored prepared library: a re-plan in a fresh process reads only what pruning keeps and plans the same."""

from __future__ import annotations

import json
import os
from dataclasses import replace
import subprocess
import sys
from pathlib import Path

import pytest

from coral_dagster.allocation.inputs import scenario_problem, scenario_rates, scenario_templates
from coral_dagster.allocation.methods import make_plan
from coral_dagster.allocation.prepared import PREPARED_TABLE, prepared_key, survivor_ids
from coral_dagster.allocation.prune import prune_columns
from coral_dagster.app.rounds import plan_round, store_demand
from coral_dagster.catalog.scenarios import load_scenario
from coral_dagster.catalog.store import append_snapshot, latest_snapshot
from coral_dagster.store import Store
from coral_dagster.templates.library import build_library, load_library, store_library

ROOT = Path(__file__).resolve().parent.parent
# One model on three GPU types in two AWS regions, four nodes of each per region: most templates fit no region.
TINY = """name: tiny
description: One model on L4, A10G and L40S nodes in two AWS regions (a test slice).
regions: [aws:us-east-2, aws:ap-northeast-2]
gpus: [L4, A10G, L40S]
gpus_per_node: [1, 2, 4]
models:
  - {model: phi-4, prefill_slo_ms: 1200, decode_slo_ms: 60, trace: azure-conv, rate_req_s: 0.5}
availability:
  default_nodes: 4
templates: {n_max: 3, rho: 12, slo_margin: 0.75}
allocation: {headroom: 1.1, replan_interval_min: 6, node_startup_min: 10}
"""

FRESH = """
import gc, json, sys
from coral_dagster.app.rounds import plan_round
from coral_dagster.catalog.scenarios import load_scenario
from coral_dagster.store import Store
rnd = plan_round(Store(sys.argv[1]), load_scenario(sys.argv[2]), "coral", time_limit_s=30)
print(json.dumps({"templates": len(rnd.problem.templates), "plan_id": rnd.plan_id,
                  "dominance_rule": rnd.plan.pruning["dominance_rule"], "gc": gc.isenabled(),
                  "running": {f"{t}@{r}": n for (t, r), n in rnd.problem.running.items()}}))
"""


def _instances(plan) -> list[tuple]:
    return sorted((i.template.template_id, i.region, i.count) for i in plan.instances)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    path = root / "tiny.yaml"
    path.write_text(TINY)
    scn = load_scenario(path)
    store = Store(root / "c.duckdb")
    store_library(store, build_library(scn), scn)
    append_snapshot(store, scn.market())
    store_demand(store, scn, scenario_rates(scn), "uniform")
    return store, scn


def test_survivors_are_exactly_the_templates_some_column_of_any_demand_can_use(tiny):
    store, scn = tiny
    market = latest_snapshot(store, scn)
    library = tuple(load_library(store, scn))
    ids = set(survivor_ids(scn, scenario_templates(scn, library), market))
    # Oracle: the planner's own pruning, per region, with every model demanded.
    problem = scenario_problem(scn, library, market)
    columns, _ = prune_columns(problem)
    assert ids == {c.template.template_id for c in columns}
    assert 0 < len(ids) < len(library)


def test_a_fresh_process_replan_reads_the_stored_survivors_and_plans_as_the_whole_library_does(tiny):
    store, scn = tiny
    first = plan_round(store, scn, "coral", time_limit_s=30)  # reads the whole library, stores the survivors
    assert len(first.problem.templates) == len(load_library(store, scn))
    stored = store.query(f"SELECT count(*) AS n FROM {PREPARED_TABLE}")["n"].iloc[0]
    assert stored > 0
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", FRESH, str(store.path), scn.path], env=env, cwd=ROOT,
                         capture_output=True, text=True, check=True, timeout=300)
    fresh = json.loads(out.stdout.strip().splitlines()[-1])
    assert fresh["templates"] == stored  # the fresh process read only the survivors
    assert fresh["dominance_rule"] == "stored"  # and did not search them for dominance again
    assert fresh["running"]  # and re-planned against the first plan
    assert fresh["gc"]  # the garbage collector paused while the survivors were built runs again
    # The same re-plan in this process, over the whole library.
    market = latest_snapshot(store, scn)
    problem = scenario_problem(scn, load_library(store, scn), market, running=first.plan.counts())
    whole = make_plan(problem, "coral", time_limit_s=30)
    again = store.query("SELECT template_id, region, count FROM plan_instances WHERE plan_id = ?",
                        [fresh["plan_id"]])
    assert _instances(whole) and sorted(zip(again["template_id"], again["region"],
                                            again["count"].astype(int))) == _instances(whole)


def test_a_changed_library_or_other_availability_gets_a_new_key_and_new_prices_do_not(tiny):
    store, scn = tiny
    market = latest_snapshot(store, scn)
    key = prepared_key(store, scn, market)
    assert key == prepared_key(store, scn, scn.market(prices=None))  # a later snapshot, same offers
    assert key != prepared_key(store, scn, scn.market(availability_scale=2.0))
    dearer = replace(market, offers=tuple(replace(o, usd_per_hour=2 * o.usd_per_hour) for o in market.offers))
    assert key == prepared_key(store, scn, dearer)
    library = load_library(store, scn)
    store_library(store, library[1:], scn)
    try:
        assert prepared_key(store, scn, market) != key
    finally:
        store_library(store, library, scn)
    assert prepared_key(store, scn, market) == key
