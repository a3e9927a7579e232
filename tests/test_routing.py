"""The one routing policy: region shares against their closed form, and the simulator and the runtime coordinator
driven with the same plan and request stream giving the same per-instance counts."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from coral_dagster.allocation.types import Plan, PlannedInstance
from coral_dagster.catalog.nodes import NodeConfig, NodeMultiset
from coral_dagster.routing import Candidate, Router, WeightedRoundRobin, entry_weights, plan_candidates, region_shares
from coral_dagster.templates.types import Stage, Template

L4, L40S = NodeConfig.parse("L4:1"), NodeConfig.parse("L40S:1")


def _template(model: str, phase: str, tokens_per_s: float, node=L40S, slo_ms: float = 1000.0) -> Template:
    layers = {"phi-4": 40, "qwen3-32b": 64}[model]
    return Template(model, phase, slo_ms, NodeMultiset.of([node]), (Stage(0, layers, (node,), (1.0,)),),
                    tokens_per_s, "compute")


def _plan() -> Plan:
    """Two models over three regions: phi-4 disaggregated in a and b (b short on decode) and aggregated in c;
    qwen3-32b disaggregated in a only."""
    rows = [("phi-4", "prefill", 6000, "a", 2), ("phi-4", "decode", 500, "a", 3), ("phi-4", "prefill", 9000, "b", 1),
            ("phi-4", "decode", 400, "b", 1), ("phi-4", "aggregated", 300, "c", 2), ("phi-4", "prefill", 2000, "a", 1),
            ("qwen3-32b", "prefill", 4000, "a", 1), ("qwen3-32b", "decode", 800, "a", 2)]
    instances = tuple(PlannedInstance(_template(m, p, t, L4 if i % 2 else L40S), r, k, 1.0)
                      for i, (m, p, t, r, k) in enumerate(rows))
    demand = {("phi-4", "prefill"): 20_000.0, ("phi-4", "decode"): 2_500.0,
              ("qwen3-32b", "prefill"): 4_000.0, ("qwen3-32b", "decode"): 1_500.0}
    return Plan("test", "coral", "optimal", 1.0, 1.0, 0.0, 0.0, instances, demand, {})


def test_region_shares_are_what_both_phases_take_there():
    """Closed form per region: min over phases of (supply / demand) (+ aggregated supply / decode demand),
    normalised over regions; a region without decode gets nothing."""
    plan = _plan()
    d = plan.demand_tokens_per_s
    cap = {"a": min((2 * 6000 + 2000) / d["phi-4", "prefill"], 3 * 500 / d["phi-4", "decode"]),
           "b": min(9000 / d["phi-4", "prefill"], 400 / d["phi-4", "decode"]),
           "c": 2 * 300 / d["phi-4", "decode"]}
    shares = plan.routing_shares["phi-4"]
    assert shares == pytest.approx({r: c / sum(cap.values()) for r, c in cap.items()})
    assert plan.routing_shares["qwen3-32b"] == {"a": 1.0}
    lonely = [Candidate("p", "m", "prefill", "x", 1.0), Candidate("d", "m", "decode", "y", 1.0)]
    assert region_shares(lonely) == {} and Router().route("m", lonely) is None
    # A prefill instance with no decode anywhere beside aggregated ones cannot finish a request: all go aggregated
    # (a core plan at ×0.5 availability lost 14% of qwen3-32b's admitted requests as `no-decode-instance` this way).
    mixed = [Candidate("p", "m", "prefill", "x", 1.0), Candidate("g", "m", "aggregated", "y", 1.0)]
    assert region_shares(mixed) == {"x": 0.0, "y": 1.0}
    assert all(Router().route("m", mixed)[0].key == "g" for _ in range(5))


def test_router_counts_follow_the_shares_exactly_over_a_cycle():
    """With integer entry weights, smooth WRR hands every candidate exactly its weight per sum-of-weights picks;
    a request's decode instance is always in its prefill's region."""
    cands = [Candidate("a1", "m", "prefill", "a", 3.0), Candidate("a2", "m", "prefill", "a", 1.0),
             Candidate("b1", "m", "prefill", "b", 4.0), Candidate("ad", "m", "decode", "a", 8.0),
             Candidate("bd", "m", "decode", "b", 2.0), Candidate("c1", "m", "aggregated", "c", 2.0)]
    weights = entry_weights(cands)
    assert weights == {"a1": 3.0, "a2": 1.0, "b1": 2.0, "c1": 2.0}
    router = Router()
    routes = [router.route("m", cands) for _ in range(8 * 50)]
    assert Counter(e.key for e, _ in routes) == {"a1": 150, "a2": 50, "b1": 100, "c1": 100}
    assert all(dec is None if e.phase == "aggregated" else dec.region == e.region for e, dec in routes)


def test_smooth_wrr_matches_nginx_sequence():
    wrr = WeightedRoundRobin()
    assert [wrr.pick({"a": 5, "b": 1, "c": 1}) for _ in range(7)] == list("aabacaa")


def _simulated_counts(plan: Plan, arrivals: np.ndarray, models: np.ndarray) -> Counter:
    from coral_dagster.simulator import ConstantLatencyModel, Engine, Workload

    names = ("phi-4", "qwen3-32b")
    n = len(arrivals)
    w = Workload(names, arrivals, models, np.full(n, 64), np.full(n, 4), float(arrivals.max()) + 1.0)
    out = Engine(plan, w, ConstantLatencyModel(1.0, 1.0)).run()
    return Counter({i["key"]: i["routed_requests"] for i in out.instances if i["routed_requests"]})


def _coordinator_counts(plan: Plan, stream: list[str]) -> Counter:
    """Register the plan's instance copies with a real coordinator (weights and regions as deployment passes them)
    and dispatch the stream through its own code path; count the instances each request was sent to."""
    import zmq

    from coral_dagster.runtime.config import CoordinatorConfig
    from coral_dagster.runtime.coordinator import Coordinator, _Request

    ctx = zmq.Context()
    coord = Coordinator(CoordinatorConfig(listen="tcp://127.0.0.1:0", http_port=None), insecure=True, ctx=ctx)
    # The requests' client: the coordinator stops a request whose client it cannot reach.
    client = ctx.socket(zmq.DEALER)
    client.setsockopt(zmq.ROUTING_ID, b"client")
    client.connect(coord.front_address)
    try:
        for c in plan_candidates(plan):
            name = "#".join(map(str, c.key))
            coord._register(name.encode(), name, {"model": c.model, "phase": c.phase, "tokens_per_s": 1.0,
                                                  "region": c.region, "weight": c.weight}, 0.0)
        counts: Counter = Counter()
        for k, model in enumerate(stream):
            r = _Request(f"r{k}", coord.front, b"client", None, model, [1, 2, 3], 4, True)
            coord.requests[r.rid] = r
            coord._dispatch(r, 0.0)
            for name in r.instances.values():
                template_id, region, copy = name.split("#")
                counts[(template_id, region, int(copy))] += 1
        return counts
    finally:
        client.close(linger=0)
        coord.router.close(linger=0)
        coord.front.close(linger=0)
        ctx.term()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_simulator_and_coordinator_route_a_stream_identically(seed):
    plan = _plan()
    rng = np.random.default_rng(seed)
    n = 600
    arrivals = np.cumsum(rng.exponential(0.01, n))
    models = (rng.random(n) < 0.3).astype(int)
    stream = [("phi-4", "qwen3-32b")[m] for m in models]
    simulated = _simulated_counts(plan, arrivals, models)
    assert sum(simulated.values()) > n  # prefill + decode counted for disaggregated routes
    assert _coordinator_counts(plan, stream) == simulated
