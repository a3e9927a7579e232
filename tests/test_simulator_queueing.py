"""The simulator against closed forms: M/D/1 waiting time, pipeline and transfer latencies, KV admission, routing."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from coral_dagster.allocation.types import Plan, PlannedInstance
from coral_dagster.catalog.gpus import node_spec
from coral_dagster.catalog.models import get_model
from coral_dagster.catalog.nodes import NodeConfig, NodeMultiset
from coral_dagster.simulator import ConstantLatencyModel, Engine, SimConfig, Workload
from coral_dagster.simulator.engine import FAILURES
from coral_dagster.simulator.result import ModelSlo, build_result
from coral_dagster.templates.types import Stage, Template

L4 = NodeConfig.parse("L4:1")
L40S = NodeConfig.parse("L40S:1")
H100 = NodeConfig.parse("H100:1")


def template(phase: str, stages: tuple[Stage, ...], tokens_per_s: float = 1000.0, model: str = "phi-4") -> Template:
    nodes = NodeMultiset.of([n for s in stages for n in s.nodes])
    return Template(model, phase, 1000.0, nodes, stages, tokens_per_s, "compute")


def plan_of(*instances: tuple[Template, int], region: str = "r1") -> Plan:
    pis = tuple(PlannedInstance(t, region, k, 1.0) for t, k in instances)
    return Plan("test", "coral", "optimal", float(len(pis)), 0.0, 0.0, 0.0, pis, {}, {})


def workload(arrival_s, prompt, output, model_idx=None, models=("phi-4",)) -> Workload:
    arrival_s = np.asarray(arrival_s, dtype=float)
    n = len(arrival_s)
    model_idx = np.zeros(n, dtype=int) if model_idx is None else np.asarray(model_idx)
    return Workload(tuple(models), arrival_s, model_idx, np.broadcast_to(prompt, n).astype(int),
                    np.broadcast_to(output, n).astype(int), float(arrival_s.max()) + 1e-9 if n else 1.0)


@dataclass(frozen=True)
class LinearStage:
    """Per-layer costs: prefill a + b·tokens + c·tokens·(chunk length + 2·past tokens), decode d + e·batch +
    f·context."""

    layers: int
    kv_capacity_tokens: float = 1e9

    def prefill_ms(self, tokens: int, seq_tokens: int, past_tokens: float = 0.0) -> float:
        return self.layers * (0.05 + 0.0004 * tokens + 1e-7 * tokens * (seq_tokens + 2 * past_tokens))

    def decode_ms(self, batch: int, context_tokens: int) -> float:
        return self.layers * (0.4 + 0.002 * batch + 1e-6 * context_tokens)


class LinearModel:
    def __init__(self, kv_capacity_tokens: float = 1e9) -> None:
        self.kv = kv_capacity_tokens

    def stage(self, model, node, layers):
        return LinearStage(layers, self.kv)


def test_md1_mean_wait_matches_pollaczek_khinchine():
    lam, service_s, n = 6.0, 0.1, 100_000
    arrival = np.cumsum(np.random.default_rng(7).exponential(1 / lam, n))
    plan = plan_of((template("aggregated", (Stage(0, 40, (L4,), (1.0,)),)), 1))
    out = Engine(plan, workload(arrival, 100, 1), ConstantLatencyModel(service_s * 1000, 1.0),
                 config=SimConfig(max_batch_seqs=1)).run()
    wait = out.ttft_s - arrival - service_s
    rho = lam * service_s
    pk = rho * service_s / (2 * (1 - rho))
    assert wait.mean() == pytest.approx(pk, rel=0.05)
    assert wait.min() >= -1e-9


def test_single_request_pipeline_latency_is_sum_of_stages_and_transfers():
    """One request alone: TTFT and TPOT are the sums of stage times and activation transfers (closed form)."""
    spec = get_model("phi-4")
    stages = (Stage(0, 10, (L4,), (1.0,)), Stage(10, 30, (L40S,), (1.0,)), Stage(30, 40, (H100,), (1.0,)))
    plan = plan_of((template("aggregated", stages), 1))
    prompt, output = 1500, 9
    out = Engine(plan, workload([0.5], prompt, output), LinearModel(),
                 config=SimConfig(prefill_chunk_tokens=4096)).run()
    nic = [node_spec(s.nodes[0]).nic_gbps for s in stages]
    link_s = [spec.activation_bytes_per_token * 8 / (min(nic[i], nic[i + 1]) * 1e9) for i in range(2)]
    token_id_s = 8 * 8 / (min(nic[2], nic[0]) * 1e9)
    prefill_s = sum(LinearStage(s.layers).prefill_ms(prompt, prompt) for s in stages) / 1000 + prompt * sum(link_s)
    assert out.ttft_s[0] - 0.5 == pytest.approx(prefill_s, rel=1e-9)
    ctx = prompt + 1
    decode_s = 0.0
    for k in range(output - 1):
        decode_s += sum(LinearStage(s.layers).decode_ms(1, ctx + k) for s in stages) / 1000 + sum(link_s)
        decode_s += token_id_s  # the sampled token returns from the last stage to the first
    assert out.finish_s[0] - out.ttft_s[0] == pytest.approx(decode_s, rel=1e-9)


def test_pd_handoff_adds_kv_transfer_over_the_slower_nic():
    spec = get_model("phi-4")
    pre = template("prefill", (Stage(0, 40, (H100,), (1.0,)),))
    dec = template("decode", (Stage(0, 40, (L4,), (1.0,)),))
    prompt, output = 3000, 5
    out = Engine(plan_of((pre, 1), (dec, 1)), workload([0.0], prompt, output), LinearModel(),
                 config=SimConfig(prefill_chunk_tokens=8192)).run()
    assert out.ttft_s[0] == pytest.approx(LinearStage(40).prefill_ms(prompt, prompt) / 1000, rel=1e-9)
    kv_s = 40 * spec.kv_bytes_per_layer(prompt) * 8 / (min(node_spec(H100).nic_gbps, node_spec(L4).nic_gbps) * 1e9)
    decode_s = sum(LinearStage(40).decode_ms(1, prompt + 1 + k) for k in range(output - 1)) / 1000
    assert out.finish_s[0] - out.ttft_s[0] == pytest.approx(kv_s + decode_s, rel=1e-9)


def test_concurrent_kv_transfers_share_the_nic():
    """Two hand-offs leave one prefill node for one decode node at once: processor sharing lands the smaller at
    2·x₁/C and the larger at (x₁ + x₂)/C (C the slower NIC); one at a time would land the first at x₁/C."""
    spec = get_model("phi-4")
    pre = template("prefill", (Stage(0, 40, (H100,), (1.0,)),))
    dec = template("decode", (Stage(0, 40, (L4,), (1.0,)),))
    prompts, d_pre, d_dec = np.array([1000, 4000]), 5.0, 0.5
    wl = Workload(("phi-4",), np.zeros(2), np.zeros(2, dtype=int), prompts, np.array([2, 2]), 1e-9)
    out = Engine(plan_of((pre, 1), (dec, 1)), wl, ConstantLatencyModel(d_pre, d_dec),
                 config=SimConfig(prefill_chunk_tokens=8192)).run()
    gbps = min(node_spec(H100).nic_gbps, node_spec(L4).nic_gbps)
    x1, x2 = (40 * spec.kv_bytes_per_layer(int(p)) * 8 / (gbps * 1e9) for p in prompts)
    assert out.ttft_s == pytest.approx([d_pre / 1000] * 2, rel=1e-9)
    landed = out.finish_s - out.ttft_s - d_dec / 1000  # one decode iteration after its KV lands, the node idle
    assert landed == pytest.approx([2 * x1, x1 + x2], rel=1e-9)


def test_small_message_overtakes_a_large_transfer_on_a_shared_link():
    """A node's link (`link_gbps` below its NIC) is shared: a second transfer starting while a first is in flight
    halves the first's rate until it ends (closed form: the small one takes 2·x_s, the large one x_l + x_s)."""
    spec = get_model("phi-4")
    pre = template("prefill", (Stage(0, 40, (H100,), (1.0,)),))
    dec = template("decode", (Stage(0, 40, (H100,), (1.0,)),))
    prompts, d_pre, d_dec, link = np.array([8000, 200]), 1.0, 0.5, 5.0
    wl = Workload(("phi-4",), np.array([0.0, 0.0015]), np.zeros(2, dtype=int), prompts, np.array([2, 2]), 0.0015)
    out = Engine(plan_of((pre, 1), (dec, 1)), wl, ConstantLatencyModel(d_pre, d_dec),
                 config=SimConfig(prefill_chunk_tokens=8192), link_gbps=link).run()
    x_l, x_s = (40 * spec.kv_bytes_per_layer(int(p)) * 8 / (link * 1e9) for p in prompts)
    start = out.ttft_s
    assert start == pytest.approx([d_pre / 1000, 0.0015 + d_pre / 1000], rel=1e-9)
    assert start[1] < start[0] + x_l  # the small one starts while the large one is in flight
    landed = out.finish_s - d_dec / 1000
    assert landed[1] - start[1] == pytest.approx(2 * x_s, rel=1e-9)
    assert landed[0] - start[0] == pytest.approx(x_l + x_s, rel=1e-9)


def test_pipeline_messages_land_in_order_on_their_connection():
    """A prompt in chunks of 1,000 and 100 tokens over a 1 Gb/s link between two stages: the small chunk's
    activations wait for the large one's on the stages' connection, so the first token comes at 3d + x₁ (d the
    iteration, x₁ the large transfer), not before the large chunk has even been computed downstream."""
    spec = get_model("phi-4")
    stages = (Stage(0, 20, (L40S,), (1.0,)), Stage(20, 40, (L40S,), (1.0,)))
    d_ms, link = 10.0, 1.0
    out = Engine(plan_of((template("aggregated", stages), 1)), workload([0.0], 1100, 1),
                 ConstantLatencyModel(d_ms, 1.0), config=SimConfig(prefill_chunk_tokens=1000), link_gbps=link).run()
    x1 = 1000 * spec.activation_bytes_per_token * 8 / (link * 1e9)
    assert x1 > d_ms / 1000  # the small chunk's transfer would start before the large one lands
    assert out.ttft_s[0] == pytest.approx(3 * d_ms / 1000 + x1, rel=1e-9)


def test_kv_capacity_serialises_requests_that_do_not_fit_together():
    """Room for one request's KV at a time: service is strictly one after another, an M/D/1 queue in effect."""
    prompt, output, d_pre, d_dec = 200, 11, 20.0, 5.0
    arrival = np.cumsum(np.random.default_rng(3).exponential(0.2, 400))
    plan = plan_of((template("aggregated", (Stage(0, 40, (L4,), (1.0,)),)), 1))
    cap = 1.5 * (prompt + output)
    out = Engine(plan, workload(arrival, prompt, output), ConstantLatencyModel(d_pre, d_dec, cap)).run()
    service_s = (d_pre + (output - 1) * d_dec) / 1000
    finish = out.finish_s
    start = finish - service_s
    assert np.all(np.diff(finish) > 0)
    assert np.all(start[1:] >= finish[:-1] - 1e-9)
    # Lindley's recursion: each starts at max(its arrival, the previous finish).
    expect = np.empty_like(finish)
    prev = 0.0
    for i, a in enumerate(arrival):
        prev = max(a, prev) + service_s
        expect[i] = prev
    np.testing.assert_allclose(finish, expect, rtol=1e-9)


def test_nothing_is_lost():
    """routed + unroutable == arrivals and completed + failures == arrivals, through PD pipelines with tight KV;
    every node's KV and running count return to zero (an independent ledger of admissions and releases)."""
    pre = template("prefill", (Stage(0, 20, (L4, L4), (0.3, 0.7)), Stage(20, 40, (L40S,), (1.0,))), 20000)
    dec = template("decode", (Stage(0, 25, (L40S,), (1.0,)), Stage(25, 40, (L4, L40S), (0.5, 0.5))), 900)
    agg = template("aggregated", (Stage(0, 40, (H100,), (1.0,)),), 800)
    rng = np.random.default_rng(11)
    n = 3000
    arrival = np.sort(rng.uniform(0, 300, n))
    models = ("phi-4", "qwen3-32b")
    idx = (rng.random(n) < 0.1).astype(int)  # qwen3-32b has no instance: unroutable
    prompt = rng.integers(10, 3000, n)
    prompt[::500] = 30_000  # beyond any node's KV
    output = rng.integers(1, 400, n)
    w = Workload(models, arrival, idx, prompt, output, 300.0)
    eng = Engine(plan_of((pre, 1), (dec, 2), (agg, 1)), w, LinearModel(kv_capacity_tokens=20_000))
    out = eng.run()
    assert out.preemptions.sum() > 0  # KV is tight enough that growing sequences get preempted and recomputed
    res = build_result(out, w, {m: ModelSlo(m, 1000, 100) for m in models}, scenario="t", method="coral",
                       arrivals="x", seed=0, rate_scale=1, cost_usd_per_hour=1.0)
    c = res.counts
    assert c["routed"] + c["no-instance"] == c["arrivals"] == n
    assert c["no-instance"] == int((idx == 1).sum())
    assert sum(c[k] for k in FAILURES) == n
    assert c["exceeds-max-model-len"] == int(((prompt >= 30_000) & (idx == 0)).sum()) > 0
    assert c["completed"] == n - c["no-instance"] - c["exceeds-max-model-len"]
    done = res.requests[res.requests.status == "completed"]
    assert (done.ttft_ms > 0).all() and (done.e2e_ms >= done.ttft_ms - 1e-9).all()
    # Every reservation was returned: all nodes end with empty KV and no running sequence.
    assert all(node.kv_used == pytest.approx(0.0) and node.running == 0 for node in eng.nodes)


def test_router_and_scheduler_follow_weights_and_shares():
    """Instances receive requests in proportion to template throughput; stage nodes in proportion to shares (the
    decode instance is the prefills' route; one-token requests never reach it)."""
    a = template("prefill", (Stage(0, 40, (L4,), (1.0,)),), 1000)
    b = template("prefill", (Stage(0, 40, (L40S,), (1.0,)),), 3000)
    c = template("prefill", (Stage(0, 20, (L4, L40S, H100), (0.2, 0.3, 0.5)), Stage(20, 40, (H100,), (1.0,))), 6000)
    d = template("decode", (Stage(0, 40, (H100,), (1.0,)),), 1e6)
    n, prompt = 10_000, 100
    eng = Engine(plan_of((a, 1), (b, 1), (c, 1), (d, 1)), workload(np.arange(n) * 0.01, prompt, 1), LinearModel())
    eng.run()
    per_node = {(n_.inst.template_id, n_.stage, str(n_.config)): n_.prefill_tokens / prompt for n_ in eng.nodes}
    assert per_node[(a.template_id, 0, "L4:1")] == pytest.approx(n * 0.1, abs=1)
    assert per_node[(b.template_id, 0, "L40S:1")] == pytest.approx(n * 0.3, abs=1)
    assert per_node[(c.template_id, 1, "H100:1")] == pytest.approx(n * 0.6, abs=1)
    for gpu, share in (("L4:1", 0.2), ("L40S:1", 0.3), ("H100:1", 0.5)):
        assert per_node[(c.template_id, 0, gpu)] == pytest.approx(n * 0.6 * share, abs=1)


def test_same_seed_same_result():
    pre = template("prefill", (Stage(0, 20, (L4, L40S), (0.5, 0.5)), Stage(20, 40, (H100,), (1.0,))))
    dec = template("decode", (Stage(0, 40, (L40S,), (1.0,)),))
    rng = np.random.default_rng(5)
    arrival = np.sort(rng.uniform(0, 60, 600))
    w = workload(arrival, rng.integers(10, 2000, 600), rng.integers(1, 200, 600))
    runs = [Engine(plan_of((pre, 1), (dec, 2)), w, LinearModel()).run() for _ in range(2)]
    np.testing.assert_array_equal(runs[0].finish_s, runs[1].finish_s)
    np.testing.assert_array_equal(runs[0].ttft_s, runs[1].ttft_s)


class FastPrefill:
    """Prefill nodes (H100) take 1 ms per iteration; every other node follows `inner`."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def stage(self, model, node, layers):
        if node == H100:
            return ConstantLatencyModel(1.0, 1.0).stage(model, node, layers)
        return self.inner.stage(model, node, layers)


def saturated_decode(latency, batch: int, prompt: int, output: int, cohorts: int = 6,
                     stages: tuple[Stage, ...] = (Stage(0, 40, (L40S,), (1.0,)),)):
    """Flood one decode instance (L40S nodes holding phi-4) capped at `batch` sequences per micro-batch.

    Returns (measured decode tokens/s between the first and last cohort's completions, finish times).
    """
    pre = template("prefill", (Stage(0, 40, (H100,), (1.0,)),))
    dec = template("decode", stages)
    n = batch * len(stages) * cohorts
    w = workload(np.zeros(n), prompt, output)
    out = Engine(plan_of((pre, 1), (dec, 1)), w, FastPrefill(latency),
                 config=SimConfig(max_batch_seqs=batch, prefill_chunk_tokens=batch * prompt)).run()
    finish = np.sort(out.finish_s)
    first = batch * len(stages)
    measured = (n - first) * (output - 1) / (finish[-1] - finish[first - 1])
    return measured, finish


def test_saturated_node_throughput_equals_linear_profile_at_that_batch():
    batch, prompt, output = 32, 16, 300
    measured, _ = saturated_decode(LinearModel(), batch, prompt, output)
    stage = LinearStage(40)
    cycle_ms = sum(stage.decode_ms(batch, batch * (prompt + 1 + k)) for k in range(output - 1))
    assert measured == pytest.approx(batch * (output - 1) / (cycle_ms / 1000), rel=0.02)


@pytest.mark.parametrize("batch", [8, 96])
def test_saturated_node_throughput_equals_the_profile_at_that_batch(batch):
    """The profile performance model, asked directly per iteration, is the oracle for the node's token rate."""
    from coral_dagster.profiles import default_perf_model
    from coral_dagster.simulator import ProfileLatencyModel

    perf = default_perf_model()
    prompt, output = 16, 200
    measured, _ = saturated_decode(ProfileLatencyModel(perf), batch, prompt, output, cohorts=4)
    cycle_ms = sum(40 * perf.decode_ms_per_layer("phi-4", L40S, batch, prompt + 1 + k) for k in range(output - 1))
    assert measured == pytest.approx(batch * (output - 1) / (cycle_ms / 1000), rel=0.02)


def test_saturated_pipeline_runs_at_its_bottleneck_stage():
    """Three stages keep three micro-batches in flight, so tokens/s is the micro-batch over the slowest stage's
    iteration (plus its activation transfer), not over the sum of the stages."""
    batch, prompt, output = 16, 16, 200
    stages = (Stage(0, 10, (L40S,), (1.0,)), Stage(10, 26, (L40S,), (1.0,)), Stage(26, 40, (L40S,), (1.0,)))
    measured, _ = saturated_decode(LinearModel(), batch, prompt, output, cohorts=4, stages=stages)
    spec = get_model("phi-4")
    hop_s = batch * spec.activation_bytes_per_token * 8 / (node_spec(L40S).nic_gbps * 1e9)
    mean_ctx = batch * (prompt + 1 + (output - 2) / 2)
    slowest_s = max(LinearStage(s.layers).decode_ms(batch, mean_ctx) for s in stages) / 1000
    assert measured == pytest.approx(batch / (slowest_s + hop_s), rel=0.03)
    serial_s = sum(LinearStage(s.layers).decode_ms(batch, mean_ctx) for s in stages) / 1000
    assert measured > 2 * batch / serial_s


def test_inconsistent_template_is_refused():
    """Stages must cover every layer once and hold exactly the template's nodes."""
    from coral_dagster.errors import CoralError

    good = (Stage(0, 20, (L4,), (1.0,)), Stage(20, 40, (L40S,), (1.0,)))
    gap = (Stage(0, 20, (L4,), (1.0,)), Stage(21, 40, (L40S,), (1.0,)))
    for stages, nodes, problem in ((gap, NodeMultiset.of([L4, L40S]), "contiguous"),
                                   (good, NodeMultiset.of([L4, L4]), "node multiset")):
        bad = Template("phi-4", "aggregated", 1000.0, nodes, stages, 1.0, "compute")
        with pytest.raises(CoralError, match=problem):
            Engine(plan_of((bad, 1)), workload([0.0], 10, 2), LinearModel())
