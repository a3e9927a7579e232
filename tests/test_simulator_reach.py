"""A template alone in the simulator at 95% of its T̂ (Poisson) meets its SLO: the templates' throughput model and
the simulator agree (decode templates here, mixed GPU types and one-node-per-stage pipelines included; prefill and
decode cases of other scenarios in test_templates_queueing.py)."""

from __future__ import annotations

import pytest

from coral_dagster.catalog.scenarios import load_scenario
from coral_dagster.catalog.traces import trace_means
from coral_dagster.errors import CoralError
from coral_dagster.simulator.latency import ProfileLatencyModel
from coral_dagster.simulator.reach import template_reach
from coral_dagster.templates.best import best_for_nodes


@pytest.fixture(scope="module")
def latency():
    return ProfileLatencyModel()


@pytest.mark.parametrize("model, nodes", [
    ("phi-4", "1xL40S:1,2xL40S:2"), ("qwen3-32b", "1xL4:8,1xL40S:4"), ("gpt-oss-20b", "1xL4:2,1xL40S:1"),
])
def test_decode_templates_reach_their_t_hat(latency, model, nodes):
    """≥ 95% of requests within the decode SLO at 95% of T̂ (requests/s = 0.95 T̂ over the trace's mean output),
    for every seed."""
    scn = load_scenario("core")
    t, _, _ = best_for_nodes(model, "decode", nodes, scenario="core")
    assert t.tokens_per_s > 0 and (len(t.stages) == 1 or all(len(s.nodes) == 1 for s in t.stages))
    for seed in (1, 2, 3):
        r = template_reach(t, scn, seed=seed, min_requests=600, latency=latency)
        assert r.requests >= 600 - 4 * 600 ** 0.5 and r.phase == "decode"  # Poisson count of 600 expected
        assert r.rate_req_s == pytest.approx(0.95 * t.tokens_per_s / trace_means(scn.model(model).trace)[1])
        assert r.attainment >= 0.95, (seed, r)


def test_reach_says_what_is_wrong():
    scn = load_scenario("core")
    t, _, _ = best_for_nodes("phi-4", "decode", "1xL40S:1", scenario="core")
    with pytest.raises(CoralError, match="load"):
        template_reach(t, scn, load=0.0)
