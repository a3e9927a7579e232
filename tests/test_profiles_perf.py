"""T̂, memory and latency lookups of the performance model, checked against brute force, closed forms and the
measured tables themselves."""

from __future__ import annotations

import json
import random

import numpy as np
import pandas as pd
import pytest

from coral_dagster import paths
from coral_dagster.catalog.gpus import GIB, node_spec
from coral_dagster.catalog.models import get_model, model_catalog
from coral_dagster.catalog.nodes import NodeConfig
from coral_dagster.errors import CoralError, UnknownNameError
from coral_dagster.profiles import PerfModel, ThroughputPoint, default_perf_model, profile_table
from coral_dagster.profiles.memory import MIN_KV_TOKENS, kv_replication, tp_unsupported_reason
from coral_dagster.profiles.perf import PREFILL_GRID

NODES = [NodeConfig.parse(n) for n in ("L4:1", "L4:2", "A10G:1", "L40S:1", "L40S:4", "H100:1", "H100:8",
                                       "A100:1", "A100-80GB:2", "T4:4", "V100:1")]
MODELS = ["phi-4", "gpt-oss-20b", "qwen3-32b", "llama-2-70b", "gpt-oss-120b", "qwen3-235b-a22b", "llama-1-30b"]


@pytest.fixture(scope="module")
def perf() -> PerfModel:
    return default_perf_model()


def _brute_force(perf: PerfModel, model, node, phase, layers, budget_ms, ctx, send_gbps, limit):
    """Best throughput over every integer batch up to `limit`, from the latency functions and the memory rules."""
    m = get_model(model)
    spec = node_spec(node)
    if layers > perf.max_layers(m, node):
        return 0.0
    free = spec.mem_bytes - perf.engine_reserve_bytes(m, node) - layers * m.weight_bytes_per_layer
    rep = kv_replication(m, node.count)
    per_token_ms = 0.0 if not send_gbps else m.activation_bytes_per_token * 8 / (send_gbps * 1e9) * 1e3
    best = 0.0
    for b in range(1, limit + 1):
        if phase == "prefill":
            seq = perf.prefill_seq_tokens
            kv = b * layers * m.kv_bytes_per_layer(seq) / seq * rep
            stage = layers * perf.prefill_ms_per_layer(m, node, b) + per_token_ms * b
        else:
            kv = b * layers * m.kv_bytes_per_layer(ctx) * rep
            stage = layers * perf.decode_ms_per_layer(m, node, b, ctx) + per_token_ms * b
        if kv <= free and stage <= budget_ms:
            best = max(best, b * 1000 / stage)
    return best


def test_t_hat_matches_brute_force(perf):
    rng = random.Random(3)
    cases = 0
    while cases < 25:
        model, node = rng.choice(MODELS), rng.choice(NODES)
        ml = perf.max_layers(model, node)
        if ml == 0:
            continue
        layers = rng.randint(1, ml)
        phase = rng.choice(["prefill", "decode"])
        budget = rng.choice([5.0, 20.0, 60.0]) if phase == "decode" else rng.choice([20.0, 60.0, 150.0])
        send = rng.choice([None, 10.0, 100.0])
        point = perf.t_hat(model, node, phase, layers, budget, 900, send)
        limit = 1500 if phase == "decode" else 3000
        if point.batch > limit:  # brute force only where it can enumerate every batch
            continue
        expected = _brute_force(perf, model, node, phase, layers, budget, 900, send, limit)
        assert point.tokens_per_s == pytest.approx(expected, rel=1e-6, abs=1e-9), (model, node, phase, layers)
        cases += 1


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_t_hat_non_increasing_in_layers_and_non_decreasing_in_budget(perf, phase):
    rng = random.Random(11 if phase == "prefill" else 12)
    for _ in range(40):
        model, node = rng.choice(MODELS), rng.choice(NODES)
        ctx = rng.choice([256, 1300, 4000])
        send = rng.choice([None, 25.0])
        budgets = sorted(rng.uniform(1, 2000) for _ in range(6))
        ml = perf.max_layers(model, node)
        top = get_model(model).n_layers
        for budget in budgets:
            series = [perf.t_hat(model, node, phase, j, budget, ctx, send).tokens_per_s for j in range(1, top + 1)]
            assert all(a >= b - 1e-9 for a, b in zip(series, series[1:])), (model, node, budget)
            assert all(v == 0 for v in series[ml:])
        for j in sorted({1, max(ml // 2, 1), max(ml, 1)}):
            series = [perf.t_hat(model, node, phase, j, b, ctx, send).tokens_per_s for b in budgets]
            assert all(a <= b + 1e-9 for a, b in zip(series, series[1:])), (model, node, j)


def test_t_hat_zero_exactly_when_weights_do_not_fit(perf):
    """With a generous budget and a context the KV floor covers, T̂ is 0 exactly beyond max_layers, where the
    weights of the layers no longer fit beside the reserve and MIN_KV_TOKENS of KV (closed form from bytes)."""
    for model in MODELS:
        m = get_model(model)
        for node in NODES:
            spec = node_spec(node)
            ml = perf.max_layers(m, node)
            floor_kv = MIN_KV_TOKENS * m.kv_bytes_per_token_per_layer * kv_replication(m, node.count)
            room = spec.mem_bytes - perf.engine_reserve_bytes(m, node)
            if tp_unsupported_reason(m, node.count):
                assert ml == 0
            elif ml < m.n_layers:
                assert ml * (m.weight_bytes_per_layer + floor_kv) <= room < (ml + 1) * (
                    m.weight_bytes_per_layer + floor_kv)
            for j in {1, ml, ml + 1, m.n_layers}:
                if j < 1 or j > m.n_layers:
                    continue
                for phase in ("prefill", "decode"):
                    p = perf.t_hat(m, node, phase, j, 1e7, 1000)
                    assert (p.tokens_per_s == 0) == (j > ml), (model, node, j, phase)
                    if j > ml:
                        assert p.bound == "memory" and perf.kv_capacity_tokens(m, node, j) == 0
                    else:
                        assert perf.kv_capacity_tokens(m, node, j) >= MIN_KV_TOKENS


def test_bounds_say_what_limits(perf):
    m, node = get_model("qwen3-32b"), NodeConfig.parse("H100:2")
    tight = perf.t_hat(m, node, "decode", 4, 0.5, 1000)
    assert tight == ThroughputPoint(0.0, 0, 0.0, "slo")
    roomy = perf.t_hat(m, node, "decode", 60, 1e6, 8000)
    cap = perf.kv_capacity_tokens(m, node, 60)
    assert roomy.bound == "memory" and roomy.batch == cap // 8000
    slow_link = perf.t_hat(m, node, "prefill", 2, 500.0, 1000, send_gbps=0.1)
    assert slow_link.bound == "network"
    assert perf.t_hat(m, node, "prefill", 2, 500.0, 1000).bound == "compute"


def test_kv_capacity_matches_helix_measured_kv_blocks(perf):
    """Independent oracle: vLLM's KV blocks that Helix measured for LLaMA-1-30B next to k resident layers."""
    doc = json.loads((paths.PROFILES_DIR / "helix_memory.json").read_text())
    m = get_model("llama-1-30b")
    names = {"A100-40GB_x1": "A100:1", "L4_x1": "L4:1", "L4_x2": "L4:2", "T4_x2": "T4:2", "T4_x4": "T4:4",
             "V100-16GB_x1": "V100:1", "T4_x1": "T4:1"}
    errors = []
    for name, blocks in doc["kv_blocks"].items():
        for k, b in blocks.items():
            k = int(k)
            if k <= perf.max_layers(m, names[name]):
                ours = perf.kv_capacity_tokens(m, names[name], k)
                errors.append(abs(ours - 16 * b) / (16 * b))
    assert len(errors) > 60
    assert np.median(errors) < 0.10


def test_measured_pairs_reproduce_their_tables(perf):
    """Where a (model, node) is measured, latency at the measured points is the measured value."""
    helix = pd.read_csv(paths.PROFILES_DIR / "helix_llama1_30b.csv")
    for (node, phase), t in helix.groupby(["node", "phase"]):
        assert perf.source("llama-1-30b", node, phase) == "measured:helix"
        for r in t.itertuples():
            if phase == "prefill":
                got = perf.prefill_ms_per_layer("llama-1-30b", node, r.tokens, seq_tokens=750)
            else:
                got = perf.decode_ms_per_layer("llama-1-30b", node, r.tokens, r.context_tokens)
            running_max = t[t["tokens"] <= r.tokens]["ms_per_layer"].max()
            assert got == pytest.approx(running_max, rel=1e-6)
    aic = pd.read_csv(paths.PROFILES_DIR / "aiconfigurator_layers.csv")
    t = aic[(aic.model == "qwen3-32b") & (aic.node == "L40S:1") & (aic.phase == "decode")
            & (aic.context_tokens == 2048)]
    for r in t.itertuples():
        expected = t[t["tokens"] <= r.tokens]["ms_per_layer"].max()
        assert perf.decode_ms_per_layer("qwen3-32b", "L40S:1", r.tokens, 2048) == pytest.approx(expected, rel=1e-6)


def test_sources_follow_the_order_of_trust(perf):
    assert perf.source("llama-1-30b", "A100:1", "decode") == "measured:helix"
    assert perf.source("qwen3-32b", "H100:2", "prefill") == "measured:aiconfigurator"
    assert perf.source("llama-2-70b", "A40:2", "prefill") == "measured:vidur"
    assert perf.source("qwen3-32b", "L4:1", "decode") == "model:roofline-calibrated"
    assert perf.source("phi-4", "A10G:1", "decode") == "model:roofline-calibrated"
    assert perf.fit.gpu_source("A10G") == "A40"


def test_latency_grows_with_batch_context_and_falls_with_tensor_parallelism(perf):
    for model in MODELS:
        xs = [perf.decode_ms_per_layer(model, "L40S:1", b, 2000) for b in (1, 8, 64, 512)]
        assert xs == sorted(xs)
        ctxs = [perf.decode_ms_per_layer(model, "H100:1", 64, c) for c in (100, 1000, 10000)]
        assert ctxs == sorted(ctxs)
        assert perf.prefill_ms_per_layer(model, "H100:4", 4096) < perf.prefill_ms_per_layer(model, "H100:1", 4096)
    assert PREFILL_GRID[0] == 1


def test_profile_table_shape_and_sources():
    df = profile_table(["llama-1-30b", "qwen3-32b"], ["A100:1", "L4:1", "H100:2"])
    assert set(df["phase"]) == {"prefill", "decode"}
    assert (df["ms_per_layer"] > 0).all()
    assert {"weight_bytes_per_layer", "kv_bytes_per_token_per_layer", "engine_reserve_bytes", "source"} <= set(df)
    by_pair = df.groupby(["model", "node"])["source"].first()
    assert by_pair[("llama-1-30b", "A100:1")] == "measured:helix"
    assert by_pair[("qwen3-32b", "H100:2")] == "measured:aiconfigurator"
    assert by_pair[("qwen3-32b", "L4:1")] == "model:roofline-calibrated"
    m = get_model("qwen3-32b")
    row = df[(df.model == "qwen3-32b")].iloc[0]
    assert row.weight_bytes_per_layer == m.weight_bytes_per_layer
    assert row.kv_bytes_per_token_per_layer == 2 * 8 * 128 * 2


def test_shipped_scenario_tables_match_the_model():
    for name in ("core", "extended", "helix"):
        shipped = pd.read_csv(paths.PROFILES_DIR / f"profiles_{name}.csv")
        sample = shipped.sample(40, random_state=1)
        fresh = profile_table(sorted(set(sample["model"])), sorted(set(sample["node"])))
        merged = sample.merge(fresh, on=["model", "node", "phase", "tokens", "context_tokens"], suffixes=("", "_now"))
        assert len(merged) == len(sample)
        assert np.allclose(merged["ms_per_layer"], merged["ms_per_layer_now"], rtol=1e-3)
        assert (merged["source"] == merged["source_now"]).all()


def test_unknown_names_and_bad_arguments(perf):
    with pytest.raises(UnknownNameError, match="phi-4"):
        perf.t_hat("gpt-5", "L4:1", "decode", 1, 10.0, 100)
    with pytest.raises(UnknownNameError, match="L40S"):
        perf.prefill_ms_per_layer("phi-4", "B300:1", 10)
    with pytest.raises(CoralError):
        perf.t_hat("phi-4", "L4:1", "decode", 0, 10.0, 100)
    with pytest.raises(CoralError):
        perf.decode_ms_per_layer("phi-4", "L4:1", 0, 100)


def test_every_catalog_model_has_a_profile_on_every_gpu(perf):
    for model in model_catalog():
        for gpu in ("H100", "H200", "A100-80GB", "A100", "L40S", "L4", "A10G", "T4", "V100", "A40"):
            assert perf.prefill_ms_per_layer(model, f"{gpu}:1", 1024) > 0
            assert perf.decode_ms_per_layer(model, f"{gpu}:1", 16, 1000) > 0
            assert node_spec(f"{gpu}:1").mem_bytes > 15 * GIB


def test_resident_micro_batches_share_the_kv_cache(perf):
    # Memory-bound decode (phi-4 on one L40S at 4k context): k resident micro-batches of b sequences hold
    # k · b · 4096 tokens, which must fit the node's KV capacity.
    cap = perf.kv_capacity_tokens("phi-4", "L40S:1", 40)
    for k in (1, 2, 3):
        p = perf.t_hat("phi-4", "L40S:1", "decode", 40, 10_000.0, 4096, resident_batches=k)
        assert p.bound == "memory" and p.batch == cap // (k * 4096)
    assert perf.t_hat("phi-4", "L40S:1", "decode", 40, 60.0, 1024) == perf.t_hat(
        "phi-4", "L40S:1", "decode", 40, 60.0, 1024, resident_batches=1)
    with pytest.raises(CoralError):
        perf.t_hat("phi-4", "L40S:1", "decode", 40, 60.0, 1024, resident_batches=0)
