"""Cluster names: SkyPilot's character rules, short enough for GCP, unique and stable."""

from __future__ import annotations

import itertools
import re

from coral_dagster.catalog.models import model_catalog
from coral_dagster.deploy import names

# SkyPilot's own rule (sky/skylet/constants.py CLUSTER_NAME_VALID_REGEX, 0.14.1), restated here as the oracle.
SKYPILOT_NAME = re.compile(r"[a-zA-Z]([-_.a-zA-Z0-9]*[a-zA-Z0-9])?")
# GCP allows 35 characters; SkyPilot appends "-" and an 8-character user hash to the name on the cloud.
GCP_ROOM = 35 - 9


def test_names_are_valid_short_and_unique_over_a_large_deployment():
    """Within a plan every instance has its own number (the model in the name is for people and may be cut)."""
    seen: set[str] = set()
    plans = ["core-coral-20261129T103000000000-1a2b3c4d", "7", "extended-homo-ILP/weird id"]
    numbers = itertools.chain(range(0, 12), range(95, 105), range(995, 1005), range(9990, 10000))
    pairs = list(itertools.product(sorted(model_catalog()), ("prefill", "decode", "aggregated")))
    count = 0
    for plan_id in plans:
        for instance, (model, phase) in zip(numbers, itertools.cycle(pairs)):
            batch = [names.engine_name(plan_id, model, phase, instance, s, n) for s in (0, 5, 10, 99) for n in (0, 7)]
            for name in batch:
                assert SKYPILOT_NAME.fullmatch(name) and name == name.lower(), name
                assert "--" not in name and "_" not in name and "." not in name
                assert len(name) <= GCP_ROOM, name
            seen.update(batch)
            count += len(batch)
        numbers = itertools.chain(range(0, 12), range(95, 105), range(995, 1005), range(9990, 10000))
    assert len(seen) == count == len(plans) * 42 * 8


def test_names_are_stable_and_carry_plan_model_instance_stage_and_node():
    a = names.engine_name("plan-1", "qwen3-32b", "prefill", 3, 1, 0)
    assert a == names.engine_name("plan-1", "qwen3-32b", "prefill", 3, 1, 0)
    assert a != names.engine_name("plan-2", "qwen3-32b", "prefill", 3, 1, 0)
    assert a.startswith("qwen3-32b-") and a.endswith(f"{names.plan_tag('plan-1')}-i3p-s1n0")
    coord = names.coordinator_name("plan-1")
    assert SKYPILOT_NAME.fullmatch(coord) and len(coord) <= GCP_ROOM


def test_a_large_deployments_clusters_and_kinds_are_named_consistently_and_uniquely(tmp_path):
    """Every cluster of a 100-instance deployment has its own name, carrying the plan's tag; the nodes of one
    instance share its number and phase; building the deployment again gives the same names; and the dry run's
    kind YAMLs have distinct names too (one file per kind)."""
    from coral_dagster.catalog.prices import load_node_prices
    from coral_dagster.deploy.dry_run import write_dry_run
    from coral_dagster.deploy.reconcile import plan_diff
    from coral_dagster.deploy.spec import deployment_nodes
    from coral_dagster.deploy.state import read_nodes
    from coral_dagster.store import Store
    from support.deploy_plans import GPT, PHI, QWEN, plan

    prices = load_node_prices()
    big = plan((QWEN, "aws:us-east-2", 40), (PHI, "aws:us-east-2", 30), (GPT, "gcp:us-central1", 30))
    nodes = deployment_nodes(big, "plan-big", prices)
    clusters = [n.cluster_name for n in nodes]
    assert len(clusters) == len(set(clusters)) == 3 + sum(i.count * i.template.nodes.size for i in big.instances)
    assert [n.cluster_name for n in deployment_nodes(big, "plan-big", prices)] == clusters
    tag = names.plan_tag("plan-big")
    assert all(tag in c and SKYPILOT_NAME.fullmatch(c) and len(c) <= GCP_ROOM for c in clusters)
    by_instance: dict[str, set[str]] = {}
    for n in nodes[3:]:
        by_instance.setdefault(n.instance_id, set()).add(n.cluster_name.rsplit("-s", 1)[0])
    assert len(by_instance) == sum(i.count for i in big.instances)
    assert all(len(prefixes) == 1 for prefixes in by_instance.values())
    dry = write_dry_run(plan_diff(big, "plan-big", read_nodes(Store(tmp_path / "none.duckdb")), prices),
                        tmp_path / "dry")
    kinds = [p.stem for p in dry.yaml_paths]
    assert len(kinds) == len(set(kinds)) < len(clusters) and all(SKYPILOT_NAME.fullmatch(k) for k in kinds)
    assert [launch.cluster for launch in dry.launches] == clusters
