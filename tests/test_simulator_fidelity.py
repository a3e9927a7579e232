"""Simulator fidelity against references: chunked prefill against the per-layer model's whole-prompt time, vLLM's
max_model_len refusal and KV rule, and queueing delay against Lindley's recursion."""

from __future__ import annotations

import numpy as np
import pytest

from coral_dagster.allocation.types import Plan, PlannedInstance
from coral_dagster.catalog.models import get_model
from coral_dagster.catalog.nodes import NodeConfig, NodeMultiset
from coral_dagster.errors import CoralError
from coral_dagster.profiles import default_perf_model
from coral_dagster.simulator import ConstantLatencyModel, Engine, ProfileLatencyModel, SimConfig, Workload
from coral_dagster.simulator.latency import ConstantStage
from coral_dagster.simulator.result import ModelSlo, build_result
from coral_dagster.templates.types import Stage, Template

L4 = NodeConfig.parse("L4:1")
L40S = NodeConfig.parse("L40S:1")


def one_instance(phase: str, stages: tuple[Stage, ...], model: str = "phi-4", slo_ms: float = 1000.0) -> Plan:
    nodes = NodeMultiset.of([n for s in stages for n in s.nodes])
    t = Template(model, phase, slo_ms, nodes, stages, 1000.0, "compute")
    return Plan("test", "coral", "optimal", 1.0, 0.0, 0.0, 0.0, (PlannedInstance(t, "r1", 1, 1.0),), {}, {})


def workload(arrival_s, prompt, output, model: str = "phi-4") -> Workload:
    arrival_s = np.asarray(arrival_s, dtype=float)
    n = len(arrival_s)
    return Workload((model,), arrival_s, np.zeros(n, dtype=int), np.broadcast_to(prompt, n).astype(int),
                    np.broadcast_to(output, n).astype(int), float(arrival_s.max()) + 1e-9)


@pytest.fixture(scope="module")
def perf():
    return default_perf_model()


@pytest.mark.parametrize("model, node, chunk", [
    ("phi-4", "L40S:1", 1024), ("qwen3-32b", "L40S:2", 861), ("gpt-oss-20b", "L4:1", 1116),
    ("qwen3-32b", "L4:4", 304), ("gpt-oss-20b", "L40S:1", 512),
])
@pytest.mark.parametrize("prompt", [3968, 9000])
def test_chunked_prefill_charges_the_whole_prompts_attention(perf, model, node, chunk, prompt):
    """A lone prompt prefilled in chunks costs the per-layer model's whole-prompt time W(P), less the rest of the
    layer M(P) of one pass (M(x): x tokens in one-token prompts), plus that rest for every chunk: its attention is
    the whole prompt's, counted once. (Pricing later chunks as fresh prompts misses the attention to earlier ones.)
    """
    cfg = NodeConfig.parse(node)
    layers = get_model(model).n_layers
    plan = one_instance("prefill", (Stage(0, layers, (cfg,), (1.0,)),), model)
    engine = Engine(plan, workload([0.0], prompt, 1, model), ProfileLatencyModel(perf),
                    config=SimConfig(prefill_chunk_tokens=chunk))
    engine.run()
    head = engine.nodes[0]
    sizes = [min(chunk, prompt - a) for a in range(0, prompt, chunk)]
    assert head.iterations == len(sizes) > 1
    whole = perf.prefill_ms_per_layer(model, cfg, prompt, prompt) * layers
    rest = perf.prefill_ms_per_layer(model, cfg, prompt, 1) * layers
    passes = sum(perf.prefill_ms_per_layer(model, cfg, c, 1) for c in sizes) * layers
    expected = whole - rest + passes
    fresh = sum(perf.prefill_ms_per_layer(model, cfg, c, c) for c in sizes) * layers  # chunks as fresh prompts
    assert expected - fresh > 0.04 * whole  # the earlier chunks' attention is more than twice the tolerance
    assert head.busy_ms == pytest.approx(expected, rel=0.02)


def test_one_pass_prompt_costs_the_whole_prompt_time(perf):
    """A prompt inside one chunk is one pass: exactly the per-layer model's whole-prompt time (grid tolerance)."""
    prompt = 3968
    plan = one_instance("prefill", (Stage(0, 40, (L40S,), (1.0,)),))
    out = Engine(plan, workload([0.0], prompt, 1), ProfileLatencyModel(perf),
                 config=SimConfig(prefill_chunk_tokens=prompt)).run()
    assert out.ttft_s[0] * 1000 == pytest.approx(perf.prefill_ms_per_layer("phi-4", L40S, prompt, prompt) * 40,
                                                 rel=0.01)


class _KvByNode:
    """Constant iteration times; KV capacity per node configuration."""

    def __init__(self, kv: dict[NodeConfig, float]) -> None:
        self.kv = kv

    def stage(self, model, node, layers):
        return ConstantStage(10.0, 5.0, self.kv[node])


def _counts(out, w):
    res = build_result(out, w, {"phi-4": ModelSlo("phi-4", 1e9, 1e9)}, scenario="t", method="coral", arrivals="x",
                       seed=0, rate_scale=1.0, cost_usd_per_hour=1.0)
    return res


@pytest.mark.parametrize("phase", ["aggregated", "prefill"])
def test_requests_beyond_max_model_len_are_refused_and_counted(phase):
    """vLLM's server refuses a request whose prompt and output (a prefill instance: prompt and one token) exceed
    max_model_len; every other request is served."""
    rng = np.random.default_rng(5)
    n = 400
    arrival = np.sort(rng.uniform(0, 50, n))
    prompt = rng.integers(1, 3000, n)
    output = rng.integers(1, 1500, n)
    w = Workload(("phi-4",), arrival, np.zeros(n, dtype=int), prompt, output, 50.0)
    plan = one_instance(phase, (Stage(0, 40, (L40S,), (1.0,)),))
    if phase == "prefill":
        dec = Template("phi-4", "decode", 100.0, NodeMultiset.of([L40S]), (Stage(0, 40, (L40S,), (1.0,)),), 1e3,
                       "compute")
        plan = Plan("t", "coral", "optimal", 2.0, 0.0, 0.0, 0.0,
                    plan.instances + (PlannedInstance(dec, "r1", 1, 1.0),), {}, {})
    limit = 2500
    out = Engine(plan, w, ConstantLatencyModel(10.0, 5.0, 1e6), config=SimConfig(max_model_len=limit)).run()
    res = _counts(out, w)
    if phase == "aggregated":
        too_long = prompt + output > limit
    else:  # the prefill instance checks prompt + 1; the decode instance then prompt + output
        too_long = (prompt + 1 > limit) | (prompt + output > limit)
    assert res.counts["exceeds-max-model-len"] == int(too_long.sum()) > 0
    assert res.counts["completed"] == n - int(too_long.sum())
    assert (res.requests.status[too_long] == "exceeds-max-model-len").all()
    assert res.by_model.exceeds_max_model_len.iloc[0] == int(too_long.sum())


def test_max_model_len_must_fit_the_kv_cache():
    plan = one_instance("aggregated", (Stage(0, 40, (L40S,), (1.0,)),))
    with pytest.raises(CoralError, match="max_model_len 9000 exceeds") as err:
        Engine(plan, workload([0.0], 10, 2), ConstantLatencyModel(1.0, 1.0, 5000), config=SimConfig(max_model_len=9000))
    assert "lower max_model_len to at most 4950" in str(err.value)


def test_pipeline_kv_is_the_smallest_workers():
    """vLLM gives every worker of a pipeline the KV blocks of the smallest: a two-stage instance over a large- and a
    small-cache node holds the small one's tokens on both; requests that fit only the large one are refused."""
    small, large = 3000.0, 50_000.0
    plan = one_instance("aggregated", (Stage(0, 20, (L40S,), (1.0,)), Stage(20, 40, (L4,), (1.0,))))
    prompt = np.array([1000, 2500, 2900, 4000, 20_000])
    w = Workload(("phi-4",), np.arange(5.0), np.zeros(5, dtype=int), prompt, np.full(5, 20), 5.0)
    eng = Engine(plan, w, _KvByNode({L40S: large, L4: small}))
    out = eng.run()
    assert [n["kv_capacity_tokens"] for n in out.nodes] == [small, small]
    room = int(small * (1 - SimConfig().kv_watermark))
    assert out.instances[0]["max_model_len"] == room
    res = _counts(out, w)
    assert list(res.requests.status) == ["completed" if p + 20 <= room else "exceeds-max-model-len" for p in prompt]


def test_data_parallel_nodes_of_one_stage_keep_their_own_kv():
    """Nodes of one stage are separate pipelines (each request runs on one): each keeps its own KV capacity; a
    following stage's largest node bounds a data-parallel node as vLLM's minimum bounds its pipeline."""
    small, large, mid = 3000.0, 50_000.0, 20_000.0
    one_stage = one_instance("aggregated", (Stage(0, 40, (L40S, L4), (0.5, 0.5)),))
    w = workload([0.0], 10, 2)
    out = Engine(one_stage, w, _KvByNode({L40S: large, L4: small})).run()
    assert [n["kv_capacity_tokens"] for n in out.nodes] == [large, small]
    h100 = NodeConfig.parse("H100:1")
    two = one_instance("aggregated", (Stage(0, 20, (L40S, L4), (0.5, 0.5)), Stage(20, 40, (h100,), (1.0,))))
    out = Engine(two, w, _KvByNode({L40S: large, L4: small, h100: mid})).run()
    assert [n["kv_capacity_tokens"] for n in out.nodes] == [mid, small, mid]


def test_queueing_delay_follows_lindleys_recursion():
    """One request per iteration of a constant service time: each waits until the previous one is done
    (Lindley: start = max(arrival, previous start + service)); queue_ms is start − arrival; served requests/s is
    completions over the arrival window."""
    service_ms = 50.0
    arrival = np.cumsum(np.random.default_rng(9).exponential(0.06, 2000))
    w = workload(arrival, 100, 1)
    plan = one_instance("aggregated", (Stage(0, 40, (L4,), (1.0,)),))
    out = Engine(plan, w, ConstantLatencyModel(service_ms, 1.0), config=SimConfig(max_batch_seqs=1)).run()
    start = np.empty_like(arrival)
    prev = -np.inf
    for i, a in enumerate(arrival):
        prev = max(a, prev + service_ms / 1000)
        start[i] = prev
    res = _counts(out, w)
    np.testing.assert_allclose(res.requests.queue_ms, (start - arrival) * 1000, atol=1e-6)
    assert res.by_model.queue_mean_ms.iloc[0] == pytest.approx(((start - arrival) * 1000).mean())
    assert res.requests.queue_ms.max() > 10 * service_ms  # the recursion does build a queue here
    summary = res.summary()
    assert summary["served_requests_per_s"] == pytest.approx(len(arrival) / w.duration_s)
    assert summary["end_s"] == pytest.approx(start[-1] + service_ms / 1000)
