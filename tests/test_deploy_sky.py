"""Generated tasks checked by SkyPilot 0.14.1 itself, offline, in a child process with a temporary HOME.

The child's `~/.sky/catalogs/v8` holds the bundled price CSVs (they are SkyPilot catalog rows, copied verbatim)
as `aws/vms.csv` and `gcp/vms.csv`, plus `common/accelerators.csv` (SkyPilot's accelerator-name table, in its own
two-column format) built from the accelerators those rows name. With a catalog present and no `.meta` md5 file,
SkyPilot treats it as user-modified and never downloads; it needs no cloud credentials and starts no API server
for `Task.from_yaml`, `validate()`, `Resources` or its catalog lookups. A child process keeps SkyPilot's
import-time paths away from the test process's HOME and from any other test that imports sky.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

import pandas as pd
import pytest
import yaml

from coral_dagster import paths
from coral_dagster.allocation.types import Plan, PlannedInstance
from coral_dagster.catalog.nodes import NodeConfig, NodeMultiset
from coral_dagster.catalog.prices import load_node_prices
from coral_dagster.deploy.dry_run import write_dry_run
from coral_dagster.deploy.reconcile import plan_diff, reconcile
from coral_dagster.deploy.spec import GPU_ROLES
from coral_dagster.runtime import credentials
from coral_dagster.store import Store
from coral_dagster.templates.types import Stage, Template
from support.deploy_fakes import RecordingDrainer, RecordingLauncher
from support.sky_catalog import _catalog, run_sky

PRICES = load_node_prices()
SENTINEL = {"HF_TOKEN": "hf_SENTINEL_51d0", "CORAL_CURVE_SECRET_KEY": "curve_SENTINEL_9a7e",
            "CORAL_CURVE_PUBLIC_KEYS": "curvepub_SENTINEL_c3f2",
            "CORAL_REGISTRATION_KEY": "registration_SENTINEL_0b5d_kept_on_this_machine"}
# An AWS zone ID with a metro segment (usw2-lax1-az1) is a Local Zone, which Coral does not price.
LOCAL_ZONE = re.compile(r"^[a-z]+\d+-[a-z]+\d+-az\d+$")

PROBE = r"""
import json, os, sys
payload = json.load(sys.stdin)
import sky
from sky import catalog
from sky.utils import common_utils
from coral_dagster.deploy.launcher import LaunchRequest
from coral_dagster.deploy.sky_adapter import to_sky_task
from coral_dagster.errors import CoralError

CLOUDS = {"aws": sky.AWS(), "gcp": sky.GCP()}
out = {"tasks": [], "prices": [], "names": {}, "secrets": {}}
for path in payload["yamls"]:
    task = sky.Task.from_yaml(path)
    task.validate()
    (r,) = task.resources
    out["tasks"].append({
        "path": path, "name": task.name, "cloud": str(r.cloud).lower(), "region": r.region,
        "instance_type": r.instance_type, "accelerators": r.accelerators, "use_spot": r.use_spot,
        "ports": r.ports, "usd_per_hour": r.get_cost(3600) if r.instance_type else None,
        "disk_size": r.disk_size, "cpus": r.cpus,
        "secret_refs": sorted(ref.name for ref in task.managed_secret_refs), "inline_secrets": sorted(task.secrets),
        "envs": dict(task.envs)})

def cost(row, **kw):
    try:
        return sky.Resources(cloud=CLOUDS[row["cloud"]], region=row["region"], instance_type=row["instance_type"],
                             accelerators={row["gpu"]: row["gpus"]}, **kw).get_cost(3600)
    except ValueError:
        return None

def parts(row, zone):
    # (on-demand, spot) of each priced part in one zone: the instance, or on GCP the host and the GPUs.
    def both(fn, *args):
        try:
            return [fn(*args, False, row["region"], zone, clouds=row["cloud"]),
                    fn(*args, True, row["region"], zone, clouds=row["cloud"])]
        except ValueError:
            return None
    out = [both(catalog.get_hourly_cost, row["instance_type"])]
    if row["cloud"] == "gcp":
        out.append(both(catalog.get_accelerator_hourly_cost, row["gpu"], row["gpus"]))
    return out

for row in payload["prices"]:
    types, _ = catalog.get_instance_type_for_accelerator(row["gpu"], row["gpus"], use_spot=False,
                                                         region=row["region"], clouds=row["cloud"])
    out["prices"].append({
        **row, "sky_usd_per_hour": cost(row), "sky_types": types or [],
        "sky_spot_by_zone": {z: cost(row, zone=z, use_spot=True) for z in row["zones"]},
        "sky_parts_by_zone": {z: parts(row, z) for z in row["zones"]}})

# Each `sky launch` of the dry run's launch.sh: its kind's YAML with the cluster's --env values applied.
out["launches"] = {}
for launch in payload["launches"]:
    task = sky.Task.from_yaml(launch["kind"])
    task.update_envs(launch["envs"])
    task.validate()
    (r,) = task.resources
    out["launches"][launch["cluster"]] = {
        "cloud": str(r.cloud).lower(), "region": r.region, "instance_type": r.instance_type,
        "accelerators": r.accelerators, "use_spot": r.use_spot, "ports": r.ports, "disk_size": r.disk_size,
        "envs": dict(task.envs), "run": task.run}

limit = sky.GCP.max_cluster_name_length()
user = common_utils.get_user_hash()
for name in payload["names"]:
    common_utils.check_cluster_name_is_valid(name)
    out["names"][name] = common_utils.make_cluster_name_on_cloud(name, limit) == f"{name}-{user}"

req = payload["request"]
request = LaunchRequest(req["cluster_name"], req["config"], tuple(req["secret_names"]))
task = to_sky_task(request, payload["environ"])
# What SkyPilot shows and stores (the user's YAML, redacted) and its own redacted dump.
dumped = json.dumps([task.to_yaml_config(use_user_specified_yaml=True), task._to_yaml_config(redact_secrets=True)],
                    default=str)
out["secrets"] = {
    "values": {k: v.get_secret_value() for k, v in task.secrets.items()},
    "in_envs": any(v in payload["environ"].values() for v in task.envs.values()),
    "in_redacted_yaml": any(v in dumped for v in payload["environ"].values()),
    "refs_left": [ref.name for ref in task.managed_secret_refs]}
try:
    to_sky_task(request, {})
    out["secrets"]["missing_refused"] = False
except CoralError as exc:
    out["secrets"]["missing_refused"] = "HF_TOKEN" in str(exc)
out["api_server_dir"] = os.path.exists(os.path.expanduser("~/.sky/api_server"))
json.dump(out, sys.stdout)
"""


@dataclass(frozen=True)
class SpotInstance(PlannedInstance):
    """A planned instance the planner marked for spot capacity."""

    use_spot: bool = True


def template(model: str, phase: str, stages: list[tuple[int, list[str]]]) -> Template:
    out, start = [], 0
    for layers, nodes in stages:
        out.append(Stage(start, start + layers, tuple(NodeConfig.parse(n) for n in nodes),
                         tuple(1 / len(nodes) for _ in nodes)))
        start += layers
    return Template(model, phase, 1000.0, NodeMultiset.of([n for s in out for n in s.nodes]), tuple(out), 900.0,
                    "compute")


PLAN = Plan("extended", "coral", "optimal", 0.0, 0.0, 0.0, 0.1, (
    PlannedInstance(template("qwen3-32b", "prefill", [(40, ["L40S:1", "L40S:1"]), (24, ["A10G:4"])]),
                    "aws:us-east-2", 1, 0.0),
    SpotInstance(template("phi-4", "decode", [(20, ["L4:1"]), (20, ["T4:2"])]), "gcp:us-central1", 1, 0.0),
    PlannedInstance(template("llama-3.1-70b", "aggregated", [(50, ["A100:8"]), (30, ["H100:4"])]),
                    "gcp:us-central1", 1, 0.0),
), {}, {})


def _zones(row) -> list[str]:
    """The zones the raw CSV lists for a price row's instance type (GCP: its accelerator rows' zones)."""
    cloud, region = row.region.split(":")
    raw = pd.read_csv(paths.PRICES_DIR / f"{cloud}_gpu_vms.csv")
    if cloud == "aws":
        rows = raw[(raw.InstanceType == row.instance_type) & (raw.Region == region)]
    else:
        rows = raw[(raw.AcceleratorName == row.gpu) & (raw.AcceleratorCount == row.gpus) & (raw.Region == region)]
    return sorted(rows.AvailabilityZone.dropna().unique())


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    _catalog(home)
    out = tmp_path_factory.mktemp("tasks")
    diff = plan_diff(PLAN, "plan-sky", state_frame(tmp_path_factory), PRICES)
    dry = write_dry_run(diff, out / "dry")
    launcher = RecordingLauncher()
    reconcile(PLAN, "plan-sky", Store(out / "d.duckdb"), launcher, RecordingDrainer(), PRICES)
    wired = []
    for name, req in launcher.requests.items():
        path = out / "wired" / f"{name}.yaml"
        path.parent.mkdir(exist_ok=True)
        path.write_text(yaml.safe_dump(dict(req.config), sort_keys=False))
        wired.append(path)
    checked_in = [paths.REPO_ROOT / "sky_tasks" / f"{r}.yaml" for r in ("engine", "vllm", "coordinator", "endpoint")]
    engine = next(r for r in launcher.requests.values() if "CORAL_LAYERS" in r.config["envs"])
    rows = [{"cloud": r.region.split(":")[0], "region": r.region.split(":")[1], "gpu": r.gpu, "gpus": int(r.gpus),
             "instance_type": r.instance_type, "zones": _zones(r)} for r in PRICES.itertuples()]
    launches = [{"cluster": c.cluster, "kind": str(c.kind), "envs": {
        **dict(c.envs), **{env: ",".join(f"tcp://{launcher.ips[x]}:5555" for x in cs) for env, cs in c.wired}}}
        for c in dry.launches]
    payload = {"yamls": [str(p) for p in [*dry.yaml_paths, *wired, *checked_in]], "prices": rows,
               "launches": launches,
               "names": [n.cluster_name for n in diff.nodes_to_launch()],
               "request": {"cluster_name": engine.cluster_name, "config": dict(engine.config),
                           "secret_names": list(engine.secret_names)},
               "environ": SENTINEL}
    done = run_sky(PROBE, payload, home)
    result = json.loads(done.stdout)
    result["_stderr"] = done.stderr
    result["_diff"] = diff
    result["_engine_instance"] = engine.config["envs"]["CORAL_INSTANCE"]
    result["_engine_envs"] = dict(engine.config["envs"])
    result["_launcher"] = launcher
    result["_wired"] = {str(p) for p in wired}
    result["_kinds"] = {str(p) for p in dry.yaml_paths}
    return result


def state_frame(tmp_path_factory):
    from coral_dagster.deploy.state import read_nodes
    return read_nodes(Store(tmp_path_factory.mktemp("empty") / "none.duckdb"))


def _ports(envs: dict) -> list[str]:
    """What a task opens, from what it runs: a Coral head also its engine's port (SkyPilot writes the two as a
    range), a vLLM node vLLM's, the coordinator its HTTP front door, the endpoint only the URL clients call."""
    if envs.get("CORAL_HEAD") == "1":
        return ["5555-5556"]
    if "CORAL_COORDINATOR_HTTP_PORT" in envs:
        return ["8000"]
    if "CORAL_HTTP_PORT" in envs:
        return ["5555", "8000"]
    return ["5555", "29501"] if "CORAL_VLLM_PORT" in envs else ["5555"]


def test_every_generated_and_checked_in_task_loads_and_validates(probe):
    tasks = probe["tasks"]
    n_nodes = 3 + sum(i.count * i.template.nodes.size for i in PLAN.instances)
    assert len(tasks) == len(probe["_kinds"]) + n_nodes + 4 and len(probe["_kinds"]) <= n_nodes
    for t in tasks:
        assert t["ports"] == _ports(t["envs"]), t["path"]
        assert t["inline_secrets"] == []
        # Every task but the endpoint's (HAProxy holds no secret) takes secrets.
        assert bool(t["secret_refs"]) != ("CORAL_COORDINATOR_HTTP_PORT" in t["envs"]), t["path"]
    assert not probe["api_server_dir"]


def test_engine_resources_match_the_plan_node_by_node(probe):
    nodes = {n.cluster_name: n for n in probe["_diff"].nodes_to_launch()}
    engines = [t for t in probe["tasks"] if t["name"] in nodes and nodes[t["name"]].role == "engine"]
    # The tasks a real run hands SkyPilot; the dry run's launches equal them (test below).
    assert len(engines) == sum(i.count * i.template.nodes.size for i in PLAN.instances)
    for t in engines:
        n = nodes[t["name"]]
        node = NodeConfig.parse(n.node)
        assert (t["cloud"], t["region"]) == tuple(n.region.split(":"))
        assert t["accelerators"] == {node.gpu: node.count}
        assert t["instance_type"] == n.instance_type and t["use_spot"] == n.use_spot
        # SkyPilot's own price for the pinned resources is what the deployment records for the node.
        assert t["usd_per_hour"] == pytest.approx(n.usd_per_hour, rel=1e-9)
    assert {t["use_spot"] for t in engines if t["envs"]["CORAL_MODEL"] == "phi-4"} == {True}
    assert {t["use_spot"] for t in engines if t["envs"]["CORAL_MODEL"] != "phi-4"} == {False}


def test_full_cost_is_skypilots_price_of_every_gpu_task_and_the_coordinator_is_named_unpriced(probe):
    """The launched tasks are the plan's GPU nodes plus the coordinator pair and its endpoint; SkyPilot's own hourly
    price of the GPU tasks sums to the deployment's GPU cost; each CPU VM (no instance type pinned) is listed as
    unpriced, and
    the disk SkyPilot will give each cluster is the one the cost states."""
    from coral_dagster.deploy.cost import deployment_cost

    cost = deployment_cost(PLAN, "plan-sky", PRICES, "the bundled prices")
    wired = [t for t in probe["tasks"] if t["path"] in probe["_wired"]]
    gpu = [t for t in wired if t["accelerators"]]
    cpu = [t for t in wired if not t["accelerators"]]
    assert len(gpu) == sum(i.count * i.template.nodes.size for i in PLAN.instances) == cost.gpu_nodes
    assert len(cpu) == cost.cpu_nodes == 3 and all(c["instance_type"] is None for c in cpu)
    assert sorted(c["cpus"] for c in cpu) == ["2+", "4+", "4+"]
    assert cost.gpu_usd_per_hour == pytest.approx(sum(t["usd_per_hour"] for t in gpu), rel=1e-9)
    assert cost.cpu_usd_per_hour == 0
    assert all(any(c["name"] in u and "unpriced" in u for u in cost.unpriced) for c in cpu)
    assert {t["name"]: t["disk_size"] for t in wired} == dict(cost.disk_gb)


def test_on_demand_prices_and_instance_types_agree_with_skypilot_catalog(probe):
    """Every (region, node) price Coral derives equals SkyPilot's price for the same pinned instance.

    Instance types: SkyPilot's cheapest candidate for the accelerator is Coral's, except GCP T4/V100 nodes, where
    SkyPilot sizes the n1 host by its own default vCPU count and Coral takes the cheapest n1-standard host with
    4 vCPUs per GPU; the tasks pin Coral's host, which SkyPilot accepts and prices identically (above).
    """
    n1 = 0
    for row, ours in zip(probe["prices"], PRICES.itertuples()):
        assert row["sky_usd_per_hour"] == pytest.approx(ours.usd_per_hour, rel=1e-9), row
        if row["cloud"] == "gcp" and row["gpu"] in ("T4", "V100"):
            n1 += 1
            assert ours.instance_type.startswith("n1-standard-")
            continue
        assert row["sky_types"] and row["sky_types"][0] == ours.instance_type, row
    assert len(probe["prices"]) == len(PRICES) and 0 < n1 < len(PRICES) / 4


def _real_spot_market(parts) -> bool:
    """Every priced part of the zone (instance; GCP host and GPUs) sells spot above 0 and below on-demand."""
    return all(p is not None and 0 < p[1] < p[0] for p in parts)


def test_spot_prices_agree_with_skypilot_zone_by_zone(probe):
    """Coral's spot price is SkyPilot's cheapest zone price, over zones that are not AWS Local Zones and where
    every part has a real spot market (spot above 0, below on-demand; on GCP the host and the GPUs each);
    a cheaper SkyPilot zone price only ever comes from a Local Zone."""
    compared = local_cheaper = 0
    for row, ours in zip(probe["prices"], PRICES.itertuples()):
        by_zone = {z: p for z, p in row["sky_spot_by_zone"].items() if p is not None}
        ordinary = [p for z, p in by_zone.items()
                    if not LOCAL_ZONE.match(z) and _real_spot_market(row["sky_parts_by_zone"][z])]
        if math.isnan(ours.spot_usd_per_hour):
            assert not ordinary, row
            continue
        compared += 1
        assert ours.spot_usd_per_hour == pytest.approx(min(ordinary), rel=1e-9), row
        cheaper = [z for z, p in by_zone.items() if p < min(ordinary) - 1e-9]
        assert all(LOCAL_ZONE.match(z) for z in cheaper), row
        local_cheaper += bool(cheaper)
    assert compared > 100 and local_cheaper >= 1


def test_cluster_names_reach_gcp_unshortened(probe):
    assert probe["names"] and all(probe["names"].values())


def test_the_dry_run_script_launches_what_a_real_run_launches_as_skypilot_reads_it(probe):
    """Each `sky launch` of launch.sh (its kind's YAML plus the cluster's --env values, loaded and validated by
    SkyPilot) has the resources, envs and run script of the task a real `coral launch` hands SkyPilot."""
    wired = {t["name"]: t for t in probe["tasks"] if t["path"] in probe["_wired"]}
    assert set(probe["launches"]) == set(wired)
    for cluster, got in probe["launches"].items():
        want = wired[cluster]
        for key in ("cloud", "region", "instance_type", "accelerators", "use_spot", "ports", "disk_size", "envs"):
            assert got[key] == want[key], (cluster, key)


def test_secrets_go_to_skypilot_as_secrets_only(probe):
    """An engine node gets the shell's secrets, less the registration key, its own instance's credential (the head
    only) and its own node credential."""
    s = probe["secrets"]
    instance = probe["_engine_instance"]
    own = credentials.instance_credential(SENTINEL["CORAL_REGISTRATION_KEY"], instance)
    envs = probe["_engine_envs"]
    head = envs["CORAL_HEAD"] == "1"
    node = credentials.node_credential_of(SENTINEL["CORAL_REGISTRATION_KEY"], instance, int(envs["CORAL_STAGE_RANK"]),
                                          envs["CORAL_NODE"])
    assert s["values"] == {**{k: v for k, v in SENTINEL.items() if k != "CORAL_REGISTRATION_KEY"},
                           "CORAL_INSTANCE_CREDENTIAL": own if head else "", "CORAL_NODE_CREDENTIAL": node}
    others = {n.env()["CORAL_INSTANCE"] for n in probe["_diff"].nodes_to_launch() if n.role in GPU_ROLES}
    assert len(others) > 1 and all(credentials.instance_credential(SENTINEL["CORAL_REGISTRATION_KEY"], i) != own
                                   for i in others - {instance})
    assert not s["in_envs"] and not s["in_redacted_yaml"] and s["refs_left"] == []
    assert s["missing_refused"]
    assert all(v not in probe["_stderr"] for v in SENTINEL.values())
