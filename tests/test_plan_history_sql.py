"""Plan history in SQL: the documented views agree with the plans computed by hand, and the documented queries
(docs/plan-history.md) run."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pandas as pd

from coral_dagster.allocation.storage import store_plan
from coral_dagster.allocation.types import Plan, PlannedInstance
from coral_dagster.catalog.nodes import NodeMultiset
from coral_dagster.store import Store
from coral_dagster.store.duck import write_frame
from coral_dagster.store.views import create_views
from coral_dagster.templates.types import Stage, Template

ROOT = Path(__file__).resolve().parent.parent


def _template(model: str, phase: str, nodes: str, tps: float) -> Template:
    ms = NodeMultiset.parse(nodes)
    stage = Stage(0, 40, tuple(ms.nodes()), tuple(1 / ms.size for _ in range(ms.size)))
    return Template(model, phase, 100.0, ms, (stage,), tps, "compute")


def _plan(counts: dict[tuple[str, str, str, str], int], price: float = 2.0) -> Plan:
    instances = tuple(PlannedInstance(_template(m, p, n, 1000.0), r, k, price * NodeMultiset.parse(n).size)
                      for (m, p, r, n), k in counts.items())
    cost = sum(i.count * i.usd_per_hour for i in instances)
    return Plan("core", "coral", "optimal", cost, cost, 0.0, 0.1, instances, {}, {})


PLAN_A = {("phi-4", "prefill", "aws:us-east-2", "1xL40S:1"): 2, ("phi-4", "decode", "aws:us-east-2", "2xL4:1"): 1,
          ("qwen3-32b", "decode", "aws:us-east-2", "1xL40S:4"): 1}
PLAN_B = {("phi-4", "prefill", "aws:us-east-2", "1xL40S:1"): 3, ("qwen3-32b", "decode", "aws:us-east-2", "1xL40S:4"): 1,
          ("qwen3-32b", "prefill", "aws:ap-northeast-2", "1xL40S:1"): 1}


def _store(tmp_path) -> tuple[Store, str, str]:
    store = Store(tmp_path / "c.duckdb")
    a = store_plan(store, _plan(PLAN_A), "run-a", {}).plan_id
    expected = {"phi-4": 0.97, "qwen3-32b": 0.95}
    b = store_plan(store, replace(_plan(PLAN_B), expected_attainment=expected, expected_from="closed loop round 1"),
                   "run-b", {}).plan_id
    got = pd.DataFrame([{"plan_id": b, "model": m, "attainment": a_ - 0.01,
                         "simulated_at": pd.Timestamp("2026-12-01", tz="UTC")} for m, a_ in expected.items()])
    with store.transaction() as con:
        write_frame(con, "simulations", got)
    create_views(store)
    return store, a, b


def test_plan_diff_matches_a_diff_by_hand(tmp_path):
    store, a, b = _store(tmp_path)
    expected = {}
    for key in set(PLAN_A) | set(PLAN_B):
        delta = PLAN_B.get(key, 0) - PLAN_A.get(key, 0)
        if delta:
            expected[(key[0], key[1], key[2], str(NodeMultiset.parse(key[3])))] = delta
    rows = store.query("SELECT model, phase, region, nodes, delta FROM plan_diff WHERE plan_id = ?", [b])
    assert {(r.model, r.phase, r.region, r.nodes): r.delta for r in rows.itertuples()} == expected
    first = store.query("SELECT model, phase, region, nodes, delta FROM plan_diff WHERE plan_id = ?", [a])
    assert {(r.model, r.phase, r.region, r.nodes): r.delta for r in first.itertuples()} == {
        (m, p, r, str(NodeMultiset.parse(n))): k for (m, p, r, n), k in PLAN_A.items()}  # all new


def test_plan_history_and_cost_by_model(tmp_path):
    store, a, b = _store(tmp_path)
    hist = store.query("SELECT plan_id, seq, instances, cost_usd_per_hour FROM plan_history ORDER BY seq")
    assert hist["plan_id"].tolist() == [a, b] and hist["seq"].tolist() == [1, 2]
    assert hist["instances"].tolist() == [sum(PLAN_A.values()), sum(PLAN_B.values())]
    cost = store.query("SELECT model, usd_per_hour FROM cost_by_model WHERE plan_id = ?", [b])
    by_hand = {}
    for (model, _, _, nodes), k in PLAN_B.items():
        by_hand[model] = by_hand.get(model, 0.0) + k * 2.0 * NodeMultiset.parse(nodes).size
    assert dict(zip(cost["model"], cost["usd_per_hour"])) == by_hand


def test_documented_sql_examples_run(tmp_path):
    store, _, _ = _store(tmp_path)
    doc = (ROOT / "docs" / "plan-history.md").read_text()
    queries = re.findall(r"```sql\n(.*?)```", doc, re.S)
    assert len(queries) >= 3
    for sql in queries:
        assert not store.query(sql.strip().rstrip(";")).empty, sql


def test_plan_expectations_read_back_what_the_plan_recorded(tmp_path):
    store, a, b = _store(tmp_path)
    rows = store.query("SELECT plan_id, model, expected_attainment, expected_from FROM plan_expectations")
    assert set(rows.plan_id) == {b}
    assert dict(zip(rows.model, rows.expected_attainment)) == {"phi-4": 0.97, "qwen3-32b": 0.95}
    assert set(rows.expected_from) == {"closed loop round 1"}
