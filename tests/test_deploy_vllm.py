"""vLLM instances in a deployment: one cluster per stage wired to the head, no scheduler VM; `coral down`."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from click.testing import CliRunner

from coral_dagster.catalog.prices import load_node_prices
from coral_dagster.cli.down import down as down_cli
from coral_dagster.deploy import state
from coral_dagster.deploy.reconcile import reconcile, teardown
from coral_dagster.deploy.spec import VLLM_MASTER_PORT
from coral_dagster.store import Store
from support.deploy_fakes import RecordingDrainer, RecordingLauncher
from support.deploy_plans import PHI, plan, template

PRICES = load_node_prices()
GPT = template("gpt-oss-20b", "aggregated", [(10, ["L4:1"], [1.0]), (9, ["L40S:1"], [1.0]), (5, ["A10G:1"], [1.0])])
P = plan((GPT, "aws:us-east-2", 1), (PHI, "aws:us-east-2", 1))


@pytest.fixture
def store(tmp_path):
    return Store(tmp_path / "deploy.duckdb")


def test_a_vllm_instance_is_one_cluster_per_stage_wired_to_its_head(store):
    launcher = RecordingLauncher()
    reconcile(P, "p1", store, launcher, RecordingDrainer(), PRICES)
    rows = state.read_nodes(store)
    gpt = rows[rows.model == "gpt-oss-20b"].sort_values("stage")
    assert list(gpt.role) == ["vllm"] * len(GPT.stages)
    assert list(gpt.node) == [str(s.nodes[0]) for s in GPT.stages]
    configs = [launcher.requests[c].config for c in gpt.cluster_name]
    head = gpt.cluster_name.iloc[0]
    order = [c for _, c in launcher.calls]
    assert all(order.index(head) < order.index(c) for c in gpt.cluster_name.iloc[1:])
    for rank, c in enumerate(configs):
        e = c["envs"]
        assert (e["CORAL_NODE_RANK"], e["VLLM_PP_LAYER_PARTITION"], e["CORAL_SPLIT"]) == (str(rank), "10,9,5",
                                                                                          "10,9,5")
        assert e["CORAL_TP"] == "1" and e["CORAL_LAYERS"] == "0:24"
        assert e["CORAL_VLLM_HEAD"] == ("" if rank == 0 else f"tcp://{launcher.ips[head]}:5555")
        assert c["resources"]["ports"] == [5555, VLLM_MASTER_PORT]
        assert c["resources"]["accelerators"] == str(GPT.stages[rank].nodes[0])
    assert [a.startswith("tcp://") for a in configs[0]["envs"]["CORAL_COORDINATOR"].split(",")] == [True, True]
    assert all(c["envs"]["CORAL_COORDINATOR"] == "" for c in configs[1:])
    # Neither instance has a CPU VM of its own: every cluster but the coordinator pair and endpoint carries GPUs.
    assert set(rows.role) == {"vllm", "engine", "coordinator", "endpoint"} and (rows.role == "coordinator").sum() == 2


def _run_script(config: dict, tmp_path, rc: int = 0, processes: int = 1) -> list[str]:
    """The node's run script with a `python` on PATH that prints what it was asked to serve and ends once all
    `processes` of the script have printed (so none is stopped before it printed, whatever the load); the
    script must exit with `rc`."""
    started = tmp_path / "started"
    started.write_text("")
    (tmp_path / "python").write_text(
        f'#!/bin/sh\nshift 2\necho "serve $*"\necho x >> {started}\n'
        f'while [ "$(wc -l < {started})" -lt {processes} ]; do sleep 0.05; done\n')
    (tmp_path / "python").chmod(0o755)
    env = {**os.environ, **config["envs"], "SKYPILOT_NODE_IPS": "10.9.8.7\n10.9.8.8",
           "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    done = subprocess.run(["bash", "-c", config["run"]], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == rc, done.stderr
    return sorted(done.stdout.splitlines())


def test_head_runs_scheduler_and_engine_and_workers_join_its_address(store, tmp_path):
    launcher = RecordingLauncher()
    reconcile(P, "p1", store, launcher, RecordingDrainer(), PRICES)
    rows = state.read_nodes(store)
    gpt = rows[rows.model == "gpt-oss-20b"].sort_values("stage").cluster_name
    head, worker = (launcher.requests[c].config for c in gpt.iloc[:2])
    # The head's job fails once its scheduler or engine ends (the reconciler relaunches it).
    assert _run_script(head, tmp_path, rc=1, processes=2) == [
        "serve engine --vllm-head 10.9.8.7 --stage-rank 0 --scheduler tcp://127.0.0.1:5556 "
        "--listen tcp://127.0.0.1:5557",
        "serve scheduler --split 24 --listen tcp://127.0.0.1:5556"]
    assert _run_script(worker, tmp_path) == [f"serve engine --vllm-head {launcher.ips[gpt.iloc[0]]} --stage-rank 0"]


def test_coral_down_takes_down_what_launch_started_coordinator_last(store, tmp_path):
    launcher = RecordingLauncher()
    reconcile(P, "p1", store, launcher, RecordingDrainer(), PRICES)
    rows = state.read_nodes(store)
    up, pair = set(rows.cluster_name), set(rows[rows.role.isin(("coordinator", "endpoint"))].cluster_name)
    dry = CliRunner().invoke(down_cli, ["--dry-run", "--json", "--db", str(store.path)])
    assert dry.exit_code == 0, dry.output
    planned = json.loads(dry.output)
    assert set(planned["clusters"]) == up and set(planned["clusters"][-3:]) == pair
    assert all(c.startswith("sky down -y ") or c.startswith("# drain") for c in planned["commands"])
    assert set(state.read_nodes(store).status) == {"launched"}
    calls: list = []
    after = RecordingLauncher(calls=calls)
    report = teardown(store, after, RecordingDrainer(calls=calls))
    assert report.status == "done" and set(report.downed) == up
    assert set([c for a, c in calls if a == "down"][-3:]) == pair
    assert len(report.drained) == 2 and set(state.read_nodes(store).status) == {"down"}
    again = teardown(store, RecordingLauncher(), RecordingDrainer())
    assert again.downed == () and again.status == "done"
