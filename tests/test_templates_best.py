"""One multiset's template: latency rule end to end, shares, bound, aggregated T̂, and the vLLM layer split."""

from __future__ import annotations

import itertools

import pytest

from coral_dagster.catalog.gpus import node_spec
from coral_dagster.catalog.models import get_model
from coral_dagster.catalog.nodes import NodeConfig, NodeMultiset
from coral_dagster.errors import CoralError, InfeasibleError
from coral_dagster.templates.best import best_for_nodes, best_template, verify_template
from coral_dagster.templates.queueing import decode_rate
from coral_dagster.layer_split import parse_split, stage_ranges
from coral_dagster.templates.throughput import (
    DECODE_STEP_FRACTIONS,
    PREFILL_STEP_FRACTIONS,
    Workload,
    build_tables,
    perf_for_prompt,
    send_gbps,
)
from support.perf_points import Pt


@pytest.mark.parametrize("model, phase, nodes", [
    ("qwen3-32b", "prefill", "1xL4:4,3xL40S:1"),  # prefill streams through stages: S > 1 can serve
    ("phi-4", "prefill", "2xA10G:2,2xL40S:2"),
    ("qwen3-32b", "decode", "2xL4:4,2xA10G:2"),
    ("llama-3.1-70b", "decode", "2xA100-80GB:2,2xH100:2"),  # four mixed stages at extended's margin 0.6
    ("gpt-oss-120b", "decode", "1xH100:1,2xL40S:1"),
    ("gpt-oss-120b", "aggregated", "1xH100:2,1xL40S:4"),
])
def test_pipeline_latency_and_throughput_rechecked_with_the_perf_model(model, phase, nodes):
    t, tables, _ = best_for_nodes(model, phase, nodes)
    w = tables.workload
    n_stages = len(t.stages)
    assert t.pp_partition == ",".join(str(s.end - s.start) for s in t.stages)
    assert [s.start for s in t.stages] == [0] + [s.end for s in t.stages[:-1]]
    assert t.stages[-1].end == get_model(model).n_layers
    if phase == "aggregated":
        return  # its T̂ is composed from two t_hat calls; covered by the aggregated tests below
    # The rule: steps within slo_margin × ℓ/S, KV for S resident micro-batches; a prefill step within a share of that,
    # its T̂ below the rate of that batch (the queueing share is checked in test_templates_queueing).
    perf = perf_for_prompt(w.prefill_seq_tokens)
    ctx = w.prompt_tokens if phase == "prefill" else w.decode_context_tokens
    pipeline_ms, stage_values = 0.0, []
    def budget(n, layers):
        if phase == "prefill":
            return w.slo_ms * w.slo_margin / n_stages * max(PREFILL_STEP_FRACTIONS)
        return w.slo_ms * w.slo_margin / n_stages * max(DECODE_STEP_FRACTIONS)

    def decode_value(n, layers, p):
        # Running sequences fit S micro-batches of B with the target probability, the cycle linear in their number.
        send = None if n_stages == 1 else node_spec(n).nic_gbps
        per_unit = 0.0 if send is None else get_model(model).activation_bytes_per_token * 8e3 / (send * 1e9)
        one = layers * perf.curve(get_model(model), n, "decode", ctx)(1) + per_unit
        per_seq = (p.stage_ms - one) / (p.batch - 1)
        rate = decode_rate(n_stages * (one - per_seq), per_seq, n_stages * p.batch, w.attainment_target)
        return min(rate, p.tokens_per_s)

    def nic_load(n, layers, tokens_per_s):
        # Utilisation of the node's receiving NIC: its layers' KV of every request plus the activations per token.
        gbps = node_spec(n).nic_gbps
        kv_bits = layers * get_model(model).kv_bytes_per_layer(w.prompt_tokens) * 8
        act_bits = 0 if n_stages == 1 else get_model(model).activation_bytes_per_token * 8
        return tokens_per_s * (kv_bits / w.output_tokens + act_bits) / (gbps * 1e9)

    for s in t.stages:
        points = [perf.t_hat(get_model(model), n, phase, s.layers, budget(n, s.layers), ctx,
                             None if n_stages == 1 else node_spec(n).nic_gbps, resident_batches=n_stages)
                  for n in s.nodes]
        planned = [tables.point(n_stages, n, s.layers) for n in s.nodes]
        # Decode: no more than the longest step allows, and its NIC below saturation by its KV hand-offs.
        assert all(0 < q.tokens_per_s <= p.tokens_per_s * (1 + 1e-9) and q.stage_ms <= p.stage_ms + 1e-9
                   for p, q in zip(points, planned) if q.tokens_per_s > 0)
        if phase == "decode":
            assert all(nic_load(n, s.layers, q.tokens_per_s) < 1 for n, q in zip(s.nodes, planned))
            assert all(q.tokens_per_s <= decode_value(n, s.layers, p) * (1 + 1e-9) for n, p, q in
                       zip(s.nodes, points, planned))
        pipeline_ms += max(p.stage_ms for p in planned)
        values = [q.tokens_per_s for q in planned]
        stage_values.append(sum(values))
        assert s.shares == pytest.approx([v / sum(values) for v in values])
    assert pipeline_ms <= w.slo_ms
    assert t.tokens_per_s == pytest.approx(min(stage_values), rel=1e-9)


def test_multi_stage_template_charges_activation_transfer():
    # Qwen3-235B does not fit one L40S:8 node: the pipeline needs stages, so T̂ is taken with a send rate.
    # A 20 s SLO: a stage prefills ~1,250 tokens/s, so at the scenario's 1.8 s (or 8 s) the code trace's long prompts
    # (95th percentile 7,303 tokens) overrun it at any load.
    t, tables, _ = best_for_nodes("qwen3-235b-a22b", "prefill", "2xL40S:8", slo_ms=20000)
    assert len(t.stages) == 2 and sorted(s.layers for s in t.stages) == [47, 47]
    w = tables.workload
    perf = perf_for_prompt(w.prefill_seq_tokens)
    m, node = get_model("qwen3-235b-a22b"), NodeConfig("L40S", 8)
    planned = tables.point(2, node, 47)
    step_ms = planned.stage_ms  # the chosen step budget: the smallest of the rule's shares its batch fits
    budget = min(f * w.slo_ms * w.slo_margin / 2 for f in PREFILL_STEP_FRACTIONS
                 if f * w.slo_ms * w.slo_margin / 2 >= step_ms)
    with_send = perf.t_hat(m, node, "prefill", 47, budget, w.prompt_tokens, node_spec(node).nic_gbps,
                           resident_batches=2)
    without = perf.t_hat(m, node, "prefill", 47, budget, w.prompt_tokens, None, resident_batches=2)
    assert (planned.batch, planned.stage_ms) == (with_send.batch, pytest.approx(with_send.stage_ms))
    assert 0 < t.tokens_per_s < with_send.tokens_per_s < without.tokens_per_s


class LinearPerf:
    """A perf model with linear costs: prefill `a` ms per token per layer, decode `b` ms per sequence per layer."""

    def __init__(self, a: float = 0.01, b: float = 0.05, fits: int = 10**6) -> None:
        self.a, self.b, self.fits, self.calls = a, b, fits, []

    def max_layers(self, model, node) -> int:
        return self.fits

    def prefill_ms_per_layer(self, model, node, tokens, seq_tokens=None) -> float:
        return self.a * tokens

    def decode_ms_per_layer(self, model, node, batch, context_tokens) -> float:
        return self.b * batch

    def t_hat(self, model, node, phase, layers, budget_ms, context_tokens=0, send_gbps=None, *, resident_batches=1):
        self.calls.append((str(node), phase, layers, budget_ms, send_gbps))
        per = layers * (self.a if phase == "prefill" else self.b)
        batch = int(budget_ms // per)
        if batch < 1:
            return Pt(0.0, 0, 0.0, "slo")
        return Pt(batch * 1000 / (batch * per), batch, batch * per, "compute")


def test_send_rate_is_min_of_nic_and_link_and_absent_for_one_stage():
    w = Workload("phi-4", "decode", 60, 1155, 211, 1200, link_gbps=20.0)
    perf = LinearPerf()
    build_tables(w, (NodeConfig("L4", 1), NodeConfig("H100", 8)), 3, perf)
    sends = {(node, s): send for node, _, _, budget, send in perf.calls for s in (round(60 / budget),)}
    assert sends[("L4:1", 1)] is None and sends[("H100:8", 1)] is None
    assert sends[("L4:1", 2)] == 12.5  # the L4 node's NIC (12.5 Gb/s) is below the 20 Gb/s link
    assert sends[("H100:8", 3)] == 20.0  # the link caps the H100:8 node's 3200 Gb/s NIC
    assert send_gbps(NodeConfig("H100", 8), 2, None) == 3200.0


def test_aggregated_table_obeys_both_slos_and_cannot_beat_pure_phases():
    nodes = (NodeConfig("L4", 1),)
    perf = LinearPerf()
    agg = build_tables(Workload("phi-4", "aggregated", 60, 1155, 211, 1200), nodes, 2, perf)
    dec = build_tables(Workload("phi-4", "decode", 60, 1155, 211, 1200), nodes, 2, perf)
    for s in (1, 2):
        slot = 60 / s
        for j in (1, 5, 20, 40):
            p = agg.point(s, nodes[0], j)
            # Output tokens/s can beat neither a node that only decodes nor one that only prefills (× D/P; the
            # linear model prefills 1 / (j·a) tokens per ms whatever the batch).
            assert p.tokens_per_s <= dec.point(s, nodes[0], j).tokens_per_s + 1e-9
            assert p.tokens_per_s <= 1000 / (j * perf.a) * 211 / 1155 + 1e-9
            if p.tokens_per_s > 0:
                assert p.stage_ms <= slot + 1e-9  # prefill chunk + decode step fit the per-token slot
                # Prompts queue at under the slot's prefill rate: the first token still has a slot per stage.
                assert s * slot < 1200
    # A prefill bound below the prompt's own prefill time (j·a ms per prompt token, however it is chunked) leaves
    # nothing; far above it, something.
    tight = build_tables(Workload("phi-4", "aggregated", 60, 1155, 211, 100), nodes, 2, perf)
    for s in (1, 2):
        for j in (1, 9, 20, 40):
            if j * perf.a * 1155 >= 100:
                assert tight.point(s, nodes[0], j).tokens_per_s == 0, (s, j)
        assert tight.point(s, nodes[0], 1).tokens_per_s > 0


def test_zero_share_nodes_and_infeasible_multisets():
    t, _, _ = best_for_nodes("phi-4", "decode", "2xL4:1,1xL40S:1")
    # An L4:1 node cannot hold all 40 layers; if the optimum is one stage, those nodes carry nothing.
    for s in t.stages:
        for n, x in zip(s.nodes, s.shares):
            assert x >= 0
    with pytest.raises(InfeasibleError, match="cannot serve"):
        best_for_nodes("qwen3-235b-a22b", "prefill", "1xL4:1")


def test_fast_and_ilp_agree_on_real_tables():
    w = Workload("gpt-oss-20b", "decode", 30, 2048, 28, 900)
    nodes = NodeMultiset.parse("2xL4:1,1xA10G:1")
    tables = build_tables(w, tuple(n for n, _ in nodes.counts), nodes.size)
    fast = best_template(tables, nodes, "fast")
    ilp = best_template(tables, nodes, "ilp")
    assert fast.tokens_per_s == pytest.approx(ilp.tokens_per_s, rel=1e-6)
    assert verify_template(ilp, tables) == []


def test_explain_table_reproduces_the_optimum_by_enumeration():
    t, tables, _ = best_for_nodes("qwen3-32b", "decode", "1xL40S:2,2xA10G:4")
    df = tables.to_frame()
    value = {(r.stages, r.node, r.layers): r.tokens_per_s for r in df.itertuples()}
    nodes = [str(n) for n in t.nodes.nodes()]
    n_layers = tables.n_layers
    best = 0.0
    for s in (1, 2, 3):
        for assign in itertools.product(range(s), repeat=len(nodes)):
            for cut in itertools.combinations(range(1, n_layers), s - 1):
                layers = [b - a for a, b in zip((0,) + cut, cut + (n_layers,))]
                stage = [sum(value[(s, n, layers[a])] for n, a2 in zip(nodes, assign) if a2 == a) for a in range(s)]
                best = max(best, min(stage))
    assert t.tokens_per_s == pytest.approx(best, rel=1e-9)


def test_pp_partition_validated_like_vllm():
    """One parser (`layer_split`) for the planner and the runtime, refusing what vLLM's partition check refuses."""
    assert parse_split("20,20", 40, 2) == (20, 20)
    assert stage_ranges(parse_split("15,25", 40, 2))[1] == (15, 40)
    with pytest.raises(CoralError, match="holds 39 layers, the model has 40"):
        parse_split("20,19", 40)
    with pytest.raises(CoralError, match="has 2 stages, not 3"):
        parse_split("20,20", 40, 3)
    for bad in ("40,0", "20;20", "", "20,,20"):
        with pytest.raises(CoralError, match="not a list of positive layer counts"):
            parse_split(bad, 40)
