"""Library build: enumeration, the incremental sweep, dominance pruning, parallel build, DuckDB round trip."""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest

from coral_dagster.catalog.gpus import node_spec
from coral_dagster.catalog.models import get_model
from coral_dagster.catalog.nodes import NodeConfig
from coral_dagster.catalog.scenarios import load_scenario
from coral_dagster.store import Store
from coral_dagster.templates.library import (
    build_library_with_stats,
    check_library,
    dominated,
    enumerate_multisets,
    load_library,
    store_library,
    templates_from_frame,
    templates_to_frame,
)
from coral_dagster.templates.optimize import best_placement_fast
from coral_dagster.templates.sweep import sweep
from coral_dagster.templates.throughput import build_tables, workload_for

MODEL = "gpt-oss-20b"  # the smallest library of the core scenario: 145 multisets


def all_count_vectors(n_configs: int, n_max: int):
    for n in range(1, n_max + 1):
        for combo in itertools.combinations_with_replacement(range(n_configs), n):
            yield tuple(combo.count(i) for i in range(n_configs))


def test_enumeration_counts_match_the_closed_form():
    configs = tuple(NodeConfig(g, k) for g in ("L40S", "L4", "A10G", "H100", "A100-80GB") for k in (1, 2, 4, 8))
    # No memory filter: multisets of 1..6 items from C types number C(C+6, 6) - 1 (18,563 and 230,229 here).
    assert len(enumerate_multisets(configs[:12], 1.0, 6, rho=1e15)) == math.comb(18, 6) - 1 == 18563
    assert len(enumerate_multisets(configs, 1.0, 6, rho=1e15)) == math.comb(26, 6) - 1 == 230229


def test_enumeration_memory_filter_against_product_enumeration():
    configs = (NodeConfig("L4", 1), NodeConfig("L40S", 2), NodeConfig("H100", 8))
    weights = get_model("qwen3-32b").total_weight_bytes
    expected = sorted(
        c for c in itertools.product(range(5), repeat=3)
        if 1 <= sum(c) <= 4
        and weights <= sum(k * node_spec(n).mem_bytes for k, n in zip(c, configs)) <= 3 * weights
    )
    assert enumerate_multisets(configs, weights, 4, 3) == expected


def random_tables(rng, n_configs, n_layers, max_s, ties):
    tables = {}
    for s in range(1, max_s + 1):
        t = -np.sort(-rng.uniform(1, 100, (n_configs, n_layers)), axis=1)
        for i, f in enumerate(rng.integers(0, n_layers + 1, n_configs)):
            t[i, f:] = 0
        tables[s] = np.round(t / 25) * 25 if ties else t
    return tables


@pytest.mark.parametrize("seed", range(8))
def test_sweep_matches_per_multiset_fast_method_and_pruning_matches_pairwise(seed):
    rng = np.random.default_rng(seed)
    n_configs, n_layers, n_max = int(rng.integers(2, 5)), int(rng.integers(2, 12)), 4
    tables = random_tables(rng, n_configs, n_layers, n_max, ties=seed % 2 == 0)
    # Holes mimic the memory filter: drop small multisets, as too little memory would.
    multisets = [c for c in all_count_vectors(n_configs, n_max) if sum(c) > 1 or rng.random() < 0.5]
    found = sweep(tables, n_layers, multisets)
    for counts in multisets:
        present = [i for i, k in enumerate(counts) if k]
        sub = {s: t[present] for s, t in tables.items() if s <= sum(counts)}
        ref = best_placement_fast(tuple(counts[i] for i in present), sub, n_layers)
        got = found.get(counts)
        assert math.isclose(0 if ref is None else ref.tokens_per_s, 0 if got is None else got.tokens_per_s,
                            rel_tol=1e-9, abs_tol=1e-12)
        if got is not None:
            assert tuple(map(sum, zip(*got.groups))) == counts and sum(got.layers) == n_layers
    values = {c: p.tokens_per_s for c, p in found.items()}
    pairwise = {
        c for c, v in values.items()
        if any(d != c and all(a <= b for a, b in zip(d, c)) and w >= v * (1 - 1e-9) for d, w in values.items())
    }
    assert dominated(values) == pairwise


@pytest.fixture(scope="module")
def small_library():  # its tests are marked slow: a real library over core's node types (~30-45 s to build)
    scn = load_scenario("core")
    tables = {(MODEL, p): build_tables(workload_for(scn.model(MODEL), p), scn.node_configs, scn.n_max)
              for p in ("prefill", "decode", "aggregated")}
    kept, stats = build_library_with_stats(scn, processes=1, models=[MODEL], tables=tables)
    everything, _ = build_library_with_stats(scn, processes=1, models=[MODEL], tables=tables, prune=False)
    return scn, tables, kept, everything, stats


@pytest.mark.slow
def test_library_templates_verify_and_pruning_is_exactly_dominance(small_library):
    scn, tables, kept, everything, stats = small_library
    assert check_library(everything, tables) == []
    assert len({t.template_id for t in kept}) == len(kept)
    counts = {t.template_id: t.nodes.as_dict() for t in everything}
    by_key = {}
    for t in everything:
        by_key.setdefault((t.model, t.phase, t.slo_ms), []).append(t)

    def dominates(a, b):  # a uses no more of any configuration, is another multiset, and is no slower
        return (a.template_id != b.template_id and all(k <= counts[b.template_id].get(n, 0)
                                                       for n, k in counts[a.template_id].items())
                and a.tokens_per_s >= b.tokens_per_s * (1 - 1e-9))

    kept_ids = {t.template_id for t in kept}
    for group in by_key.values():
        for t in group:
            is_dominated = any(dominates(o, t) for o in group)
            assert (t.template_id not in kept_ids) == is_dominated
    assert stats.as_frame().kept.sum() == len(kept)
    # Every memory-feasible multiset of the model was optimized (145 of them in core).
    assert set(stats.as_frame().multisets) == {
        len(enumerate_multisets(scn.node_configs, get_model(MODEL).total_weight_bytes, scn.n_max, scn.rho))}


@pytest.mark.slow
def test_parallel_build_equals_serial(small_library):
    scn, tables, kept, _, _ = small_library
    parallel, stats = build_library_with_stats(scn, processes=2, models=[MODEL], tables=tables)
    assert stats.processes == 2
    assert parallel == kept


@pytest.mark.slow
def test_frame_and_duckdb_round_trip(small_library, tmp_path):
    _, _, kept, _, _ = small_library
    assert templates_from_frame(templates_to_frame(kept, "core")) == kept
    store = Store(tmp_path / "t.duckdb")
    other = dataclasses.replace(load_scenario("core"), n_max=5)  # another library key
    assert store_library(store, kept, "core") == len(kept)
    assert store_library(store, kept[:3], other) == 3
    assert store_library(store, kept, "core") == len(kept)  # replaces the scenario's rows, no duplicates
    assert load_library(store, "core") == sorted(kept, key=lambda t: t.template_id)
    assert len(load_library(store, other)) == 3
    nodes = store.query("SELECT template_id, sum(count) AS n FROM template_nodes WHERE library_key = ? "
                        "GROUP BY template_id", [load_scenario("core").library_key])
    size = {t.template_id: t.nodes.size for t in kept}
    assert len(nodes) == len(kept) and all(size[r.template_id] == r.n for r in nodes.itertuples())
    assert load_library(Store(tmp_path / "empty.duckdb"), "core") == []


@pytest.mark.slow
def test_n_max_and_rho_override_the_scenario(small_library):
    scn, tables, kept, _, _ = small_library
    small, stats = build_library_with_stats(scn, processes=1, models=[MODEL], tables=tables, n_max=3, rho=6)
    weights = get_model(MODEL).total_weight_bytes
    assert set(stats.as_frame().multisets) == {len(enumerate_multisets(scn.node_configs, weights, 3, 6))}
    assert small and all(t.nodes.size <= 3 for t in small)
    assert all(sum(node_spec(n).mem_bytes * k for n, k in t.nodes.counts) <= 6 * weights for t in small)
    # Same optimum for a multiset in both libraries: the bounds change which multisets, never their placements.
    full = {t.template_id: t.tokens_per_s for t in kept}
    assert all(full[t.template_id] == t.tokens_per_s for t in small if t.template_id in full)
