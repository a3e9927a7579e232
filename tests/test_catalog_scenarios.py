"""Scenarios as the paper sets them (coral.md §6), their markets, and clear errors on bad YAML."""

from __future__ import annotations

import pytest

from coral_dagster import paths
from coral_dagster.catalog.nodes import NodeConfig
from coral_dagster.catalog.scenarios import load_scenario
from coral_dagster.errors import CatalogError, UnknownNameError

PAPER_SLOS = {"phi-4": (1200, 60), "gpt-oss-20b": (900, 30), "qwen3-32b": (1600, 100),
              "llama-3.1-70b": (1500, 80), "gpt-oss-120b": (1000, 40), "qwen3-235b-a22b": (1800, 120)}


def test_core_and_extended_follow_the_paper():
    core, ext = load_scenario("core"), load_scenario("extended")
    assert len(core.node_configs) == 12 and len(ext.node_configs) == 20
    assert set(core.regions) == {"aws:us-east-2", "aws:ap-northeast-2"}
    assert set(ext.regions) == set(core.regions) | {"gcp:us-central1"}
    assert {m.model for m in core.models} == {"qwen3-32b", "gpt-oss-20b", "phi-4"}
    assert len(ext.models) == 6
    for s, rate in [(core, 10), (ext, 25)]:
        for m in s.models:
            assert (m.prefill_slo_ms, m.decode_slo_ms) == PAPER_SLOS[m.model] and m.rate_req_s == rate


def test_market_only_holds_what_regions_sell():
    ext = load_scenario("extended").market()
    # AWS sells no 2-GPU L40S/L4/A10G instance and no L40S/A10G exists on GCP.
    assert ext.offer("aws:us-east-2", NodeConfig("L40S", 2)) is None
    assert ext.offer("gcp:us-central1", NodeConfig("L40S", 1)) is None
    assert ext.offer("gcp:us-central1", NodeConfig("H100", 2)) is not None
    assert all(o.usd_per_hour > 0 and o.available_nodes >= 1 for o in ext.offers)
    half = load_scenario("extended").market(availability_scale=0.5)
    assert all(h.available_nodes == o.available_nodes // 2 for h, o in zip(half.offers, ext.offers))
    uniform = load_scenario("core-uniform").market()
    assert all(o.available_nodes == 16 for o in uniform.offers)


def test_helix_cluster_is_fixed():
    h = load_scenario("helix")
    m = h.market()
    gpus = sum(o.available_nodes * o.node.count for o in m.offers)
    assert gpus == 64 and h.link_gbps == 10
    assert m.availability("gcp:us-central1", NodeConfig("T4", 4)) == 4


def test_unknown_scenario_lists_names():
    with pytest.raises(UnknownNameError, match="core"):
        load_scenario("huge")


@pytest.mark.parametrize("old,new,field", [
    ("model: phi-4,", "model: phi-5,", "model"),
    ("gpus: [L40S, L4, A10G]", "gpus: [L40S, L4, A10X]", "gpus"),
    ("trace: azure-code", "trace: sharegpt", "trace"),
    ("prefill_slo_ms: 900,", "prefill_slo_ms: -900,", "prefill_slo_ms"),
    ("rate_req_s: 10}", "rate_req_s: ten}", "rate_req_s"),
])
def test_bad_scenario_names_the_field(tmp_path, old, new, field):
    text = (paths.SCENARIOS_DIR / "core.yaml").read_text()
    assert old in text
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace(old, new, 1))
    with pytest.raises(CatalogError) as err:
        load_scenario(bad)
    assert err.value.field == field and "Fix:" in str(err.value)


def test_snapshot_round_trips_through_duckdb(tmp_path):
    from coral_dagster.catalog.store import append_snapshot, latest_snapshot
    from coral_dagster.store import Store

    store = Store(tmp_path / "c.duckdb")
    snap = load_scenario("core").market(availability_scale=0.5)
    assert append_snapshot(store, snap) == len(snap.offers)
    assert append_snapshot(store, snap) == 0  # the same snapshot is never appended twice
    back = latest_snapshot(store, load_scenario("core"))
    assert back == snap
