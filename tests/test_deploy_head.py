"""A Coral-runtime instance without a scheduler VM: the generated head task's run script starts the scheduler and
its engine, a second node's task joins the head's address, and a real coordinator serves what `coral generate` does."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest

from coral_dagster import paths
from coral_dagster.catalog.prices import load_node_prices
from coral_dagster.deploy.reconcile import reconcile
from coral_dagster.runtime.local import free_port
from coral_dagster.store import Store
from support.deploy_fakes import RecordingDrainer, RecordingLauncher
from support.deploy_plans import GPT, plan
from support.serve_reference import MAX_TOKENS, PROMPTS, reference

pytest.importorskip("torch")


def _port_pair() -> int:
    """A free port P whose successor is free too (the head's scheduler takes P, its engine P + 1)."""
    for _ in range(50):
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two consecutive free ports on 127.0.0.1")


def _bin(tmp_path):
    """A PATH folder where `python` is this interpreter and `curl` fails (no cloud metadata service here)."""
    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (folder / "curl").write_text("#!/bin/sh\nexit 22\n")
    for tool in ("python", "curl"):
        (folder / tool).chmod(0o755)
    return folder


def test_head_task_runs_scheduler_and_engine_and_the_next_stage_joins_it(tmp_path):
    from coral_dagster.runtime.client import Client
    from coral_dagster.runtime.security import CurveKeys

    launcher = RecordingLauncher()
    reconcile(plan((GPT, "gcp:us-central1", 1)), "p1", Store(tmp_path / "d.duckdb"), launcher, RecordingDrainer(),
              load_node_prices())
    configs = sorted((r.config for r in launcher.requests.values() if "CORAL_LAYERS" in r.config["envs"]),
                     key=lambda c: int(c["envs"]["CORAL_STAGE_RANK"]))
    head, second = configs
    assert (head["envs"]["CORAL_HEAD"], second["envs"]["CORAL_HEAD"]) == ("1", "0")
    assert second["envs"]["CORAL_SCHEDULER"] == f"tcp://{launcher.ips[head['name']]}:5555"

    keys = CurveKeys.generate()
    coordinator, port = f"tcp://127.0.0.1:{free_port()}", _port_pair()
    # The tasks as generated, on loopback and with the tiny model: the head listens where `second` is wired.
    tiny = {"CORAL_MODEL": "tiny-llama", "CORAL_SPLIT": "5,7", "VLLM_PP_LAYER_PARTITION": "5,7"}
    local = {head["name"]: {"CORAL_LISTEN": f"tcp://127.0.0.1:{port}", "CORAL_COORDINATOR": coordinator,
                            "CORAL_LAYERS": "0:5"},
             second["name"]: {"CORAL_LISTEN": f"tcp://127.0.0.1:{free_port()}", "CORAL_LAYERS": "5:12",
                              "CORAL_SCHEDULER": f"tcp://127.0.0.1:{port}"}}
    base = {**os.environ, **keys.env(), "PATH": f"{_bin(tmp_path)}:{os.environ['PATH']}",
            "SKYPILOT_NODE_IPS": "127.0.0.1", "CORAL_HEARTBEAT_S": "0.2", "CORAL_DEAD_AFTER_S": "1.5",
            "OMP_NUM_THREADS": "1"}
    logs = tmp_path / "logs"
    logs.mkdir()
    procs = [subprocess.Popen([sys.executable, "-m", "coral_dagster.cli.serve", "coordinator", "--listen",
                               coordinator, "--http-port", "-1"], env=base, stdout=subprocess.DEVNULL,
                              stderr=open(logs / "coordinator.log", "w"), start_new_session=True)]
    try:
        for cfg in (head, second):
            env = {**base, **cfg["envs"], **tiny, **local[cfg["name"]]}
            procs.append(subprocess.Popen(["bash", "-c", cfg["run"]], env=env, cwd=paths.REPO_ROOT,
                                          stdout=open(logs / f"{cfg['name']}.out", "w"),
                                          stderr=subprocess.STDOUT, start_new_session=True))
        with Client(coordinator, keys=keys, timeout_s=30) as c:
            c.wait_ready(1, timeout_s=90)
            (instance,) = c.status()["instances"]
            done = c.complete("tiny-llama", [PROMPTS[0]], max_tokens=MAX_TOKENS)[0]
        assert instance["instance"] == head["envs"]["CORAL_INSTANCE"]
        assert done["tokens"] == reference(PROMPTS[0])["tokens"]
        head_log = (logs / f"{head['name']}.out").read_text()
        assert f"scheduler {instance['instance']} on tcp://127.0.0.1:{port}" in head_log
        assert f"on tcp://127.0.0.1:{port + 1}" in head_log
    finally:
        for p in procs:
            os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
