"""No orphans, and self-healing: children die with a killed `serve local`; a killed engine is restarted."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time

import pytest

from coral_dagster.runtime.config import Timing
from coral_dagster.runtime.generate import generate
from coral_dagster.runtime.local import LocalDeployment, free_port, local_instances

pytest.importorskip("torch")

MODEL = "tiny-llama"
FAST = Timing(heartbeat_s=0.2, dead_after_s=1.5, request_timeout_s=20.0)


def _gone(pid: int) -> bool:
    """True once `pid` no longer runs (absent, or a zombie waiting for init to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what} within {timeout_s} s"
        time.sleep(0.1)


def test_children_die_with_a_killed_serve_local(tmp_path):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "coral_dagster.cli.serve", "local", "--model", MODEL, "--split",
                             "6,6", "--instances", "1", "--port", str(port), "--json", "--log-dir", str(tmp_path),
                             "--heartbeat-s", "0.2", "--dead-after-s", "1.5"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    pids: list[int] = []
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 90)
        assert ready, "serve local never became ready"
        info = json.loads(proc.stdout.readline())
        pids = list(info["pids"].values())
        assert len(pids) == 4 and not any(_gone(p) for p in pids)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        _wait(lambda: all(_gone(p) for p in pids), 20, "children still running after their parent was killed")
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_killed_engine_is_restarted_and_its_instance_serves_again(tmp_path):
    expected = generate(MODEL, "back again", 6, ignore_eos=True)
    # A back-off longer than failure detection, so the instance is seen leaving rotation before it returns.
    with LocalDeployment(MODEL, local_instances((12,), 2), timing=FAST, log_dir=tmp_path,
                         backoff_s=FAST.dead_after_s + 2.0) as dep:
        dep.wait_ready(60)
        with dep.client(timeout_s=30) as c:
            victim = "agg-0.s0.n0"
            old_pid = dep.procs[victim].pid
            dep.kill(victim)

            def state() -> str | None:
                return next((i["state"] for i in c.status()["instances"] if i["instance"] == "agg-0"), None)

            _wait(lambda: state() == "unhealthy", 10, "the killed engine's instance was not marked unhealthy")
            _wait(lambda: state() == "ready", 30, "the instance did not come back after its engine was restarted")
            assert dep.restarts == {victim: 1} and dep.procs[victim].pid != old_pid and dep.alive(victim)
            before = {i["instance"]: i["served"] for i in c.status()["instances"]}
            done = c.complete(MODEL, ["back again"] * 4, max_tokens=6, ignore_eos=True)
            assert all(e["kind"] == "done" and e["tokens"] == list(expected.tokens) for e in done)
            after = {i["instance"]: i["served"] for i in c.status()["instances"]}
            assert after["agg-0"] - before["agg-0"] == 2 and after["agg-1"] - before["agg-1"] == 2
        # The restarted engine's log follows the first one's: two start-up lines in one file.
        assert (tmp_path / f"{victim}.log").read_text().count(f"engine {victim} layers 0:12") == 2
