"""A deployment's full cost: its clusters are the plan's GPU nodes plus one coordinator, priced from the plan's rows."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

import pytest
from click.testing import CliRunner

from coral_dagster.allocation.storage import load_plan
from coral_dagster.allocation.types import PlannedInstance
from coral_dagster.catalog.prices import load_node_prices
from coral_dagster.cli import launch as launch_cli
from coral_dagster.deploy import state
from coral_dagster.deploy.cost import deployment_cost
from coral_dagster.deploy.reconcile import reconcile, teardown
from coral_dagster.store import Store
from support.deploy_fakes import RecordingDrainer, RecordingLauncher
from support.deploy_plans import GPT, PHI, QWEN, plan, template
from support.deploy_plans import store_on_snapshot as _store_on_snapshot

PRICES = load_node_prices()
VLLM = template("gpt-oss-20b", "aggregated", [(10, ["L4:1"], [1.0]), (9, ["L40S:1"], [1.0]), (5, ["A10G:1"], [1.0])])


@dataclass(frozen=True)
class SpotInstance(PlannedInstance):
    """A planned instance the planner marked for spot capacity."""

    use_spot: bool = True


SPOT_PHI = SpotInstance(PHI, "gcp:us-central1", 2, 0.0)
P = plan((QWEN, "aws:us-east-2", 2), (VLLM, "aws:us-east-2", 1), (GPT, "gcp:us-central1", 1))
P = replace(P, instances=(*P.instances, SPOT_PHI))


def oracle_gpu_usd(p, rows) -> float:
    """Σ count × nodes × the row's price (spot for spot instances), looked up in the price rows themselves."""
    total = 0.0
    for inst in p.instances:
        for node, k in inst.template.nodes.counts:
            row = rows[(rows.region == inst.region) & (rows.node == str(node))]
            assert len(row) == 1, (inst.region, node)
            col = "spot_usd_per_hour" if getattr(inst, "use_spot", False) else "usd_per_hour"
            total += inst.count * k * float(row[col].iloc[0])
    return total


def gpu_nodes(p) -> int:
    return sum(i.count * i.template.nodes.size for i in p.instances)


@pytest.fixture
def store(tmp_path):
    return Store(tmp_path / "deploy.duckdb")


def test_clusters_are_gpu_nodes_plus_the_coordinator_pair_and_endpoint_and_all_of_them_go_down(store):
    cost = deployment_cost(P, "p1", PRICES, "the test prices")
    assert (cost.gpu_nodes, cost.cpu_nodes, cost.clusters) == (gpu_nodes(P), 3, gpu_nodes(P) + 3)
    launcher = RecordingLauncher()
    report = reconcile(P, "p1", store, launcher, RecordingDrainer(), PRICES)
    rows = state.read_nodes(store)
    assert report.status == "done" and len(launcher.calls) == len(set(launcher.ips)) == cost.clusters
    assert dict(rows.role.value_counts()) == {"engine": gpu_nodes(P) - VLLM.nodes.size, "vllm": VLLM.nodes.size,
                                              "coordinator": 2, "endpoint": 1}
    assert set(rows.cluster_name) == {c for c, _ in cost.disk_gb}
    # Every GPU cluster carries accelerators; the only ones without are the coordinators and their endpoint.
    no_gpu = [c for c, r in launcher.requests.items() if "accelerators" not in r.config["resources"]]
    assert no_gpu == list(rows[rows.role.isin(("coordinator", "endpoint"))].cluster_name)

    again = RecordingLauncher()
    report = reconcile(P, "p1", store, again, RecordingDrainer(), PRICES)
    assert again.calls == [] and report.launched == () and len(report.kept) == sum(i.count for i in P.instances)

    down = RecordingLauncher()
    report = teardown(store, down, RecordingDrainer())
    assert sorted(c for a, c in down.calls if a == "down") == sorted(rows.cluster_name)
    assert report.status == "done" and set(state.read_nodes(store).status) == {"down"}


def test_full_cost_is_the_sum_of_node_prices_read_from_the_rows_and_names_what_is_unpriced():
    cost = deployment_cost(P, "p1", PRICES, "the test prices")
    expected = oracle_gpu_usd(P, PRICES)
    assert expected > 0 and cost.gpu_usd_per_hour == pytest.approx(expected, rel=1e-12)
    # The rows price GPU nodes only: the coordinators' CPU VMs get no made-up price, and are named.
    assert cost.cpu_usd_per_hour == 0 and cost.total_usd_per_hour == pytest.approx(expected, rel=1e-12)
    coordinators = [c for c, _ in cost.disk_gb if c.endswith(("-coord", "-coord-b", "-endpoint"))]
    assert len(coordinators) == 3
    assert all(any(c in u and "unpriced: no CPU VM price in the test prices for aws:us-east-2" in u
                   for u in cost.unpriced) for c in coordinators)
    disks = dict(cost.disk_gb)
    assert [u for u in cost.unpriced if u.startswith("disks:")] == [
        f"disks: {gpu_nodes(P)} × 256 GB + 2 × 100 GB + 1 × 50 GB = {sum(disks.values()):,} GB: not priced (no disk "
        "prices in the test prices)"]


def test_launch_dry_run_prices_from_the_plans_snapshot_and_shows_the_full_cost(store, tmp_path):
    p = plan((QWEN, "aws:us-east-2", 2), (VLLM, "aws:us-east-2", 1))
    plan_id = _store_on_snapshot(store, p, 3.0)
    snap = load_plan(store, plan_id).snapshot_id
    rows = store.query("SELECT region, node, usd_per_hour, spot_usd_per_hour FROM market_snapshots "
                       "WHERE snapshot_id = ?", [snap])
    expected = oracle_gpu_usd(p, rows)
    assert expected == pytest.approx(3 * oracle_gpu_usd(p, PRICES), rel=1e-9)
    args = ["--plan", plan_id, "--dry-run", "--db", str(store.path), "--out", str(tmp_path / "y")]
    doc = json.loads(CliRunner().invoke(launch_cli.launch, [*args, "--json"], catch_exceptions=False).output)
    assert doc["gpu_usd_per_hour"] == pytest.approx(expected, abs=1e-4)
    assert doc["total_usd_per_hour"] == pytest.approx(expected, abs=1e-4) and doc["cpu_usd_per_hour"] == 0
    assert doc["plan_usd_per_hour"] == pytest.approx(p.cost_usd_per_hour, abs=1e-4)
    assert doc["clusters"] == len([c for c in doc["commands"] if c.startswith("sky launch")]) == gpu_nodes(p) + 3
    assert any(f"unpriced: no CPU VM price in market snapshot {snap} for aws:us-east-2" in u for u in doc["unpriced"])
    text = CliRunner().invoke(launch_cli.launch, args, catch_exceptions=False).output
    assert f"deployment ${expected:,.2f}/h = ${expected:,.2f}/h for {gpu_nodes(p)} GPU node(s)" in text
    assert f"plan ${p.cost_usd_per_hour:,.2f}/h" in text and "unpriced: no CPU VM price" in text


def test_deployment_specs_asset_records_the_full_cost_as_float_metadata(store, tmp_path):
    import dagster as dg

    from assets.deployment import deployment_specs
    from coral_dagster.errors import CoralError
    from resources.launcher import SkyPilotLauncher
    from resources.store import CoralDuckDB

    p = plan((QWEN, "aws:us-east-2", 1), (VLLM, "aws:us-east-2", 1))
    plan_id = _store_on_snapshot(store, p, 2.0)
    _store_on_snapshot(store, p, 5.0)  # a newer plan: deployment takes the recorded one, not the latest
    resources = {"duckdb": CoralDuckDB(database=str(store.path)), "launcher": SkyPilotLauncher(out_dir=str(tmp_path))}
    with dg.DagsterInstance.ephemeral() as instance:
        with pytest.raises(CoralError, match="plan_simulation has no materialization recording a plan_id"):
            dg.materialize([deployment_specs], resources=resources, instance=instance)
        for asset in ("allocation_plan", "plan_simulation"):
            instance.report_runless_asset_event(dg.AssetMaterialization(asset, metadata={"plan_id": plan_id}))
        result = dg.materialize([deployment_specs], resources=resources, instance=instance)
    assert result.success
    (event,) = result.asset_materializations_for_node("deployment_specs")
    meta = event.metadata
    expected = 2.0 * oracle_gpu_usd(p, PRICES)
    for key in ("gpu_usd_per_hour", "total_usd_per_hour", "cpu_usd_per_hour", "plan_usd_per_hour"):
        assert isinstance(meta[key], dg.FloatMetadataValue), key
    assert meta["gpu_usd_per_hour"].value == pytest.approx(expected, abs=1e-4)
    assert meta["total_usd_per_hour"].value == pytest.approx(expected, abs=1e-4) and meta["cpu_usd_per_hour"].value == 0
    assert meta["clusters"].value == gpu_nodes(p) + 3 and "unpriced: no CPU VM price" in meta["unpriced"].value
