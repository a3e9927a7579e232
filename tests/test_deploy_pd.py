"""A plan of engine `vllm` with prefill and decode templates deploys PD-disaggregated vLLM instances: each node
started with its role's `--kv-transfer-config` (kv_producer / kv_consumer, as vLLM's disaggregated-prefill docs
name them), NixlConnector's handshake port opened and its host set to the node's own address, in the dry run's
kind YAMLs and launch.sh as SkyPilot itself loads them; the same plan under engine `coral` stays on Coral's runtime."""

from __future__ import annotations

import json
import os
import shlex
import subprocess

import pytest

from coral_dagster import paths
from coral_dagster.cli.serve import engine_cmd
from coral_dagster.deploy import state
from coral_dagster.deploy.dry_run import write_dry_run
from coral_dagster.deploy.reconcile import plan_diff, reconcile
from coral_dagster.deploy.spec import GPU_ROLES, instance_shapes
from coral_dagster.runtime.vllm_engine import VllmLaunch
from coral_dagster.store import Store
from support.deploy_fakes import RecordingDrainer, RecordingLauncher
from support.deploy_plans import PRICES, plan, template
from support.sky_catalog import _catalog, run_sky
from support.node_env import node_python

REGION = "aws:us-east-2"
# phi-4 has 40 layers: a pipelined prefill instance (vLLM's NIXL producers may be pipelined), a one-stage decode
# instance (its consumers may not), and an aggregated instance that needs no connector.
PREFILL = template("phi-4", "prefill", [(24, ["L40S:1"], [1.0]), (16, ["L4:1"], [1.0])])
DECODE = template("phi-4", "decode", [(40, ["L40S:1"], [1.0])])
AGG = template("phi-4", "aggregated", [(40, ["A10G:1"], [1.0])])
P = plan((PREFILL, REGION, 2), (DECODE, REGION, 2), (AGG, REGION, 1))
# What vLLM's disaggregated-prefill guide calls each side (docs/features/disagg_prefill.md, nixl_connector_usage.md).
ROLE = {"prefill": "kv_producer", "decode": "kv_consumer"}


def _empty(tmp_path):
    return state.read_nodes(Store(tmp_path / "none.duckdb"))


def test_pd_templates_of_a_vllm_plan_are_vllm_instances_with_their_kv_roles(tmp_path):
    nodes = plan_diff(P, "p-pd", _empty(tmp_path), PRICES, engine="vllm").nodes_to_launch()
    gpu = [n for n in nodes if n.role in GPU_ROLES]
    assert {n.role for n in gpu} == {"vllm"}
    assert len({n.cluster_name for n in nodes}) == len(nodes)
    by_instance: dict[str, list] = {}
    for n in gpu:
        by_instance.setdefault(n.instance_id, []).append(n)
    assert sorted(len(v) for v in by_instance.values()) == [1, 1, 1, 2, 2]
    engine_ids = {}
    for instance, members in by_instance.items():
        configs = {n.env().get("CORAL_KV_TRANSFER_CONFIG") for n in members}
        assert len(configs) == 1, "every rank of an instance builds the same connector"
        (raw,) = configs
        phase = members[0].phase
        if phase == "aggregated":
            assert raw is None and all("VLLM_NIXL_SIDE_CHANNEL_PORT" not in n.env() for n in members)
            continue
        config = json.loads(raw)
        assert config["kv_connector"] == "NixlConnector" and config["kv_role"] == ROLE[phase]
        engine_ids[instance] = config["engine_id"]
        for n in members:
            assert n.env()["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"
    assert len(set(engine_ids.values())) == len(engine_ids) == 4


def test_the_same_plan_under_the_coral_engine_keeps_pd_on_corals_runtime(tmp_path):
    nodes = plan_diff(P, "p-pd", _empty(tmp_path), PRICES, engine="coral").nodes_to_launch()
    roles = {(n.phase, n.role) for n in nodes if n.role in GPU_ROLES}
    assert roles == {("prefill", "engine"), ("decode", "engine"), ("aggregated", "vllm")}
    assert not any("CORAL_KV_TRANSFER_CONFIG" in n.env() for n in nodes)
    # Switching the engine relaunches the PD instances (other fingerprints), never the aggregated one.
    coral = {s.template.phase: s.fingerprint for s in instance_shapes(P, PRICES, "coral")}
    vllm = {s.template.phase: s.fingerprint for s in instance_shapes(P, PRICES, "vllm")}
    assert coral["aggregated"] == vllm["aggregated"]
    assert coral["prefill"] != vllm["prefill"] and coral["decode"] != vllm["decode"]


def test_a_real_run_hands_each_node_its_connector_and_opens_the_handshake_port(tmp_path):
    launcher = RecordingLauncher()
    store = Store(tmp_path / "d.duckdb")
    reconcile(P, "p-pd", store, launcher, RecordingDrainer(), PRICES, engine="vllm")
    rows = state.read_nodes(store)
    for r in rows[rows.role == "vllm"].itertuples():
        cfg = launcher.requests[r.cluster_name].config
        pd_node = r.phase in ROLE
        assert cfg["resources"]["ports"] == [5555, 29501] + ([5600] if pd_node else [])
        assert (json.loads(cfg["envs"]["CORAL_KV_TRANSFER_CONFIG"])["kv_role"] if pd_node
                else cfg["envs"]["CORAL_KV_TRANSFER_CONFIG"]) == ROLE.get(r.phase, "")
    # The task's run script gives NIXL this node's own address and `coral serve engine` the config.
    head = next(launcher.requests[c].config for c in rows[(rows.phase == "decode") & (rows.stage == 0)].cluster_name)
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\necho "$VLLM_NIXL_SIDE_CHANNEL_HOST $CORAL_KV_TRANSFER_CONFIG"\n')
    fake.chmod(0o755)
    env = {**os.environ, **head["envs"], "SKYPILOT_NODE_IPS": "10.9.8.7\n10.9.8.8",
           "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    done = subprocess.run(["bash", "-c", head["run"]], env=env, capture_output=True, text=True, timeout=60)
    host, config = done.stdout.splitlines()[0].split(" ", 1)
    assert host == "10.9.8.7" and json.loads(config)["kv_role"] == "kv_consumer"
    option = next(p for p in engine_cmd.params if p.name == "kv_transfer_config")
    assert option.envvar == "CORAL_KV_TRANSFER_CONFIG"


def _script_envs(commands: tuple[str, ...]) -> dict[str, dict[str, str]]:
    """Cluster -> the --env values its `sky launch` line in launch.sh gives, read back as a shell would."""
    out = {}
    for line in commands:
        if not line.startswith("sky launch"):
            continue
        words = shlex.split(line)
        cluster = words[words.index("-c") + 1]
        out[cluster] = dict(w.split("=", 1) for w in (words[i + 1] for i, x in enumerate(words) if x == "--env"))
    return out


PROBE = r"""
import json, sys
payload = json.load(sys.stdin)
import sky
out = {}
for cluster, (path, envs) in payload.items():
    task = sky.Task.from_yaml(path)
    task.update_envs(envs)
    task.validate()
    (r,) = task.resources
    out[cluster] = {"envs": task.envs, "ports": r.ports, "accelerators": r.accelerators}
print(json.dumps(out))
"""


def test_dry_run_kinds_and_script_load_in_skypilot_with_each_nodes_connector(tmp_path):
    diff = plan_diff(P, "p-pd", _empty(tmp_path), PRICES, engine="vllm")
    dry = write_dry_run(diff, tmp_path / "dry")
    nodes = {n.cluster_name: n for n in diff.nodes_to_launch()}
    kinds = {str(launch.kind.name) for launch in dry.launches if nodes[launch.cluster].phase in ROLE}
    assert kinds and all(k.startswith(("vllm-prefill-", "vllm-decode-")) for k in kinds)
    script = _script_envs(dry.commands)
    assert set(script) == set(nodes)
    payload = {launch.cluster: (str(launch.kind), script[launch.cluster]) for launch in dry.launches}
    home = tmp_path / "home"
    _catalog(home)
    tasks = json.loads(run_sky(PROBE, payload, home).stdout.splitlines()[-1])
    for cluster, task in tasks.items():
        node = nodes[cluster]
        # What SkyPilot would run each cluster with is exactly the node's envs (the YAML's and the script's).
        assert {k: task["envs"][k] for k in node.env()} == node.env()
        if node.role == "vllm" and node.phase in ROLE:
            assert json.loads(task["envs"]["CORAL_KV_TRANSFER_CONFIG"])["kv_role"] == ROLE[node.phase]
            assert "5600" in task["ports"]
        elif node.role == "vllm":
            assert task["envs"]["CORAL_KV_TRANSFER_CONFIG"] == "" and "5600" not in task["ports"]


@pytest.mark.slow
def test_vllm_parses_each_pd_node_into_its_kv_transfer_config(tmp_path, vllm_node_env):
    """vLLM 0.32's own parser and `KVTransferConfig` (CPU build's node environment) read every PD node's
    `vllm serve` line as Coral starts it: the role from the phase, the same connector and engine id on every rank."""
    python = node_python(vllm_node_env)
    nodes = [n for n in plan_diff(P, "p-pd", _empty(tmp_path), PRICES, engine="vllm").nodes_to_launch()
             if n.phase in ROLE]
    lines = []
    for n in nodes:
        e = n.env()
        split = tuple(int(x) for x in e["VLLM_PP_LAYER_PARTITION"].split(","))
        launch = VllmLaunch("facebook/opt-125m", split, tp=int(e["CORAL_TP"]),
                            kv_transfer_config=e["CORAL_KV_TRANSFER_CONFIG"])
        lines.append({"cluster": n.cluster_name, "argv": launch.argv(int(e["CORAL_NODE_RANK"]))})
    script = ("import json, sys\n"
              "from coral_dagster.runtime.vllm_engine import engine_args\n"
              "out = {}\n"
              "for doc in json.load(sys.stdin):\n"
              "    c = engine_args(doc['argv']).kv_transfer_config\n"
              "    out[doc['cluster']] = [c.kv_connector, c.kv_role, c.engine_id, c.is_kv_producer, c.is_kv_consumer]\n"
              "print('RESULT ' + json.dumps(out))\n")
    done = subprocess.run([str(python), "-c", script], input=json.dumps(lines), capture_output=True, text=True,
                          cwd=paths.REPO_ROOT, env={**os.environ, "PYTHONPATH": str(paths.REPO_ROOT)}, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    parsed = json.loads(next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))[7:])
    for n in nodes:
        connector, role, engine_id, producer, consumer = parsed[n.cluster_name]
        assert (connector, role, engine_id) == ("NixlConnector", ROLE[n.phase], n.instance_id)
        assert (producer, consumer) == (n.phase == "prefill", n.phase == "decode")


def test_launch_deploys_a_plan_with_the_engine_it_was_planned_for(tmp_path):
    """`coral launch` reads the engine `coral plan --engine` recorded; else the scenario's; a plan file of a
    scenario not at hand runs on Coral's runtime, which runs every template."""
    from dataclasses import replace

    from coral_dagster.allocation.storage import store_plan
    from coral_dagster.app.plans import plan_engine
    from coral_dagster.catalog.scenarios import load_scenario

    store = Store(tmp_path / "plans.duckdb")
    assert plan_engine(store, store_plan(store, P, "r1", {"engine": "vllm"})) == "vllm"
    assert plan_engine(store, store_plan(store, P, "r2", {})) == load_scenario(P.scenario).engine
    assert plan_engine(store, replace(P, scenario="nowhere", plan_id="file-x")) == "coral"
