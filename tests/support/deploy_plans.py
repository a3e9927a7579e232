"""Small hand-made plans the deployment tests share, priced from the bundled price table."""

from __future__ import annotations

from coral_dagster.allocation.types import Plan, PlannedInstance
from coral_dagster.catalog.nodes import NodeConfig, NodeMultiset
from coral_dagster.catalog.prices import load_node_prices
from coral_dagster.templates.types import Stage, Template

PRICES = load_node_prices()


def template(model: str, phase: str, stages: list[tuple[int, list[str], list[float]]]) -> Template:
    out, start = [], 0
    for layers, nodes, shares in stages:
        out.append(Stage(start, start + layers, tuple(NodeConfig.parse(n) for n in nodes), tuple(shares)))
        start += layers
    return Template(model, phase, 1000.0, NodeMultiset.of([n for s in out for n in s.nodes]), tuple(out), 900.0,
                    "compute")


QWEN = template("qwen3-32b", "prefill", [(40, ["L40S:1", "L40S:1"], [0.5, 0.5]), (24, ["A10G:4"], [1.0])])
PHI = template("phi-4", "decode", [(40, ["L4:1"], [1.0])])
GPT = template("gpt-oss-20b", "aggregated", [(10, ["L4:1"], [1.0]), (14, ["L4:2"], [1.0])])


def plan(*items: tuple[Template, str, int]) -> Plan:
    def price(t: Template, region: str) -> float:
        rows = PRICES[PRICES.region == region].set_index("node").usd_per_hour
        return sum(k * rows[str(n)] for n, k in t.nodes.counts)

    instances = tuple(PlannedInstance(t, r, c, price(t, r)) for t, r, c in items)
    cost = sum(i.count * i.usd_per_hour for i in instances)
    return Plan("core", "coral", "optimal", cost, cost, 0.0, 0.1, instances, {}, {})


def store_on_snapshot(store, p: Plan, price_scale: float = 1.0) -> str:
    """Store the plan on core's bundled market snapshot with every price times `price_scale`; its plan id."""
    from dataclasses import replace

    from coral_dagster.allocation.storage import store_plan
    from coral_dagster.catalog.market import MarketSnapshot
    from coral_dagster.catalog.scenarios import load_scenario
    from coral_dagster.catalog.store import append_snapshot

    snap = load_scenario("core").market()
    snap = MarketSnapshot(f"{snap.snapshot_id}-p{price_scale:g}", snap.taken_at, tuple(
        replace(o, usd_per_hour=o.usd_per_hour * price_scale) for o in snap.offers), snap.scenario_key)
    append_snapshot(store, snap)
    return store_plan(store, replace(p, snapshot_id=snap.snapshot_id, scenario_key=snap.scenario_key),
                      "run-1", {}).plan_id
