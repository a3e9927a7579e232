"""No orphans, and self-healing: children die with a killed `serve local` or `serve engine`; a killed engine is
restarted."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys

import pytest

from coral_dagster import paths
from coral_dagster.runtime.client import Client
from coral_dagster.runtime.config import Timing
from coral_dagster.runtime.generate import generate
from coral_dagster.runtime.local import LocalDeployment, free_port, local_instances
from coral_dagster.runtime.security import CurveKeys
from support.runtime_procs import descendants, gone, kill_all, pgid, read_pids, start_helpers, wait_for

pytest.importorskip("torch")

MODEL = "tiny-llama"
FAST = Timing(heartbeat_s=0.2, dead_after_s=1.5, request_timeout_s=20.0)


def bindable(port: int) -> bool:
    """Whether a new front door could bind `port` now (like uvicorn, reusing TIME_WAIT ports)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_clean_up_never_kills_a_later_process_given_a_dead_ones_pid(monkeypatch):
    """The machine recycles pids (pid_max 32,768), so the tests' clean-up names a process by pid and start time: a
    process running under a pid first seen on another (the remembered start time differs) counts as gone, and
    `kill_all` leaves it running; the process first seen there is killed."""
    from support import runtime_procs

    first, later = (subprocess.Popen(["sleep", "60"]) for _ in range(2))
    try:
        runtime_procs.remember([first.pid, later.pid])
        assert not gone(first.pid) and not gone(later.pid)
        monkeypatch.setitem(runtime_procs._BORN, later.pid, "0")  # as if seen at boot, before this process
        assert gone(later.pid)
        kill_all([first.pid, later.pid])
        assert first.wait(timeout=10) == -signal.SIGKILL
        assert later.poll() is None
    finally:
        for p in (first, later):
            p.kill()
            p.wait()


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
        # Coordinator, its standby, scheduler, two engine nodes.
        assert len(pids) == 5 and not any(gone(p) for p in pids)
        # Each leads its own process group, which takes along whatever the process starts.
        assert [pgid(p) for p in pids] == pids
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        wait_for(lambda: all(gone(p) for p in pids), 20, "children still running after their parent was killed")
        # Free for a new front door soon after: a killed process reads as a zombie once its main thread has exited,
        # while its other threads, which share its sockets, may still be tearing down.
        wait_for(lambda: bindable(port), 10, f"port {port} still held after every child died")
    finally:
        if proc.poll() is None:
            proc.kill()
        kill_all(pids)


def test_a_killed_node_takes_the_processes_it_started_with_it(tmp_path):
    """kill -9 of a node that started helpers (as vLLM's head starts its engine core and workers): none survives."""
    dep = LocalDeployment(MODEL, [], log_dir=tmp_path)
    helpers: dict[str, int] = {}
    try:
        dep.spawn("node", start_helpers, {"pid_file": str(tmp_path / "pids")}, own_children=True)
        dep.supervise()
        helpers = read_pids(tmp_path / "pids")
        node = dep.procs["node"].pid
        assert set(helpers.values()) <= descendants(node)
        os.kill(node, signal.SIGKILL)
        wait_for(lambda: all(gone(p) for p in helpers.values()), 20, "the node's helpers still running after it died")
    finally:
        dep.stop()
        kill_all(helpers.values())


def test_a_failing_role_logs_why_and_leaves_nothing_behind(tmp_path):
    """A role that raises after starting a non-daemon child exits at once with its traceback in its log, instead of
    waiting silently for that child (how a vLLM head used to vanish), and its helpers die with it."""
    dep = LocalDeployment(MODEL, [], log_dir=tmp_path, restart=False)
    helpers: dict[str, int] = {}
    try:
        dep.spawn("node", start_helpers, {"pid_file": str(tmp_path / "pids"), "then_raise": True}, own_children=True)
        helpers = read_pids(tmp_path / "pids")
        dep.procs["node"].join(timeout=20)
        assert dep.procs["node"].exitcode == 1
        wait_for(lambda: all(gone(p) for p in helpers.values()), 20, "the failed role's helpers still running")
        assert "RuntimeError: the role failed after starting its helpers" in (tmp_path / "node.log").read_text()
    finally:
        dep.stop()
        kill_all(helpers.values())


SUPERVISOR = """
import json, sys, time
from coral_dagster.runtime.local import LocalDeployment
from support.runtime_procs import start_helpers
if __name__ == "__main__":
    dep = LocalDeployment("tiny-llama", [], log_dir=sys.argv[1])
    dep.spawn("node", start_helpers, {"pid_file": sys.argv[1] + "/pids"}, own_children=True)
    dep.supervise()
    print(json.dumps({"node": dep.procs["node"].pid}), flush=True)
    time.sleep(3600)
"""


def test_a_node_and_its_helpers_die_with_a_killed_supervisor(tmp_path):
    """kill -9 of the supervising process: the node's parent-death watch takes its whole group down."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(paths.REPO_ROOT), str(paths.REPO_ROOT / "tests")])}
    proc = subprocess.Popen([sys.executable, "-c", SUPERVISOR, str(tmp_path)], stdout=subprocess.PIPE, env=env)
    pids: list[int] = []
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready, "the supervisor never started its node"
        pids = [json.loads(proc.stdout.readline())["node"], *read_pids(tmp_path / "pids").values()]
        assert not any(gone(p) for p in pids)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        wait_for(lambda: all(gone(p) for p in pids), 20,
                 "the node or its helpers still running after the supervisor died")
    finally:
        if proc.poll() is None:
            proc.kill()
        kill_all(pids)


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

            wait_for(lambda: state() == "unhealthy", 10, "the killed engine's instance was not marked unhealthy")
            wait_for(lambda: state() == "ready", 30, "the instance did not come back after its engine was restarted")
            assert dep.restarts == {victim: 1} and dep.procs[victim].pid != old_pid and dep.alive(victim)
            before = {i["instance"]: i["served"] for i in c.status()["instances"]}
            done = c.complete(MODEL, ["back again"] * 4, max_tokens=6, ignore_eos=True)
            assert all(e["kind"] == "done" and e["tokens"] == list(expected.tokens) for e in done)
            after = {i["instance"]: i["served"] for i in c.status()["instances"]}
            assert after["agg-0"] - before["agg-0"] == 2 and after["agg-1"] - before["agg-1"] == 2
        # The restarted engine's log follows the first one's: two start-up lines in one file.
        assert (tmp_path / f"{victim}.log").read_text().count(f"engine {victim} layers 0:12") == 2


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def test_killing_the_fork_server_stops_no_role_and_restarts_still_work(tmp_path):
    with LocalDeployment(MODEL, local_instances((12,), 2), timing=FAST, log_dir=tmp_path, backoff_s=0.1) as dep:
        dep.wait_ready(60)
        roles = {n: p.pid for n, p in dep.procs.items()}
        forkserver = _ppid(roles["coordinator"])
        assert forkserver != os.getpid() and _ppid(roles["agg-0.s0.n0"]) == forkserver
        os.kill(forkserver, signal.SIGKILL)
        wait_for(lambda: gone(forkserver), 10, "the fork server gone")
        with dep.client(timeout_s=30) as c:
            done = c.complete(MODEL, ["still here"] * 4, max_tokens=3)
            assert all(e["kind"] == "done" for e in done)
            # Every role still runs, as the same process: none was read as exited and stopped or restarted.
            assert {n: p.pid for n, p in dep.procs.items()} == roles and all(dep.alive(n) for n in roles)
            assert not any(gone(pid) for pid in roles.values()) and dep.restarts == {}
            # A role that dies now is still restarted (through a new fork server).
            dep.kill("agg-1.s0.n0")
            wait_for(lambda: dep.restarts == {"agg-1.s0.n0": 1} and dep.alive("agg-1.s0.n0"), 30,
                     "the killed engine restarted")
            c.wait_ready(2, timeout_s=30)
            assert all(e["kind"] == "done" for e in c.complete(MODEL, ["again"] * 4, max_tokens=3))


def _serve(*args: str, keys_env: dict[str, str]) -> subprocess.Popen:
    """`coral serve …` as the SkyPilot tasks run it: a process of its own, its output to files."""
    env = {**os.environ, **keys_env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(paths.REPO_ROOT)}
    return subprocess.Popen([sys.executable, "-m", "coral_dagster.cli.serve", *args, "--heartbeat-s", "0.2",
                             "--dead-after-s", "1.5"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _group_leaders(pid: int) -> set[int]:
    """Processes below `pid` that lead their own process group (the supervised node)."""
    return {p for p in descendants(pid) if pgid(p) == p}


def test_a_directly_started_engine_node_is_restarted_and_dies_with_its_command(tmp_path):
    """`coral serve engine` (what a SkyPilot task runs) holds its node as a child in its own group: kill -9 of the
    node brings a new one back into rotation; kill -9 of the command leaves no process of it behind."""
    keys = CurveKeys.generate()
    coord, sched = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    procs = [_serve("coordinator", "--listen", coord, "--http-port", "-1", "--model", MODEL, keys_env=keys.env()),
             _serve("scheduler", "--instance", "agg-0", "--model", MODEL, "--split", "12", "--coordinator", coord,
                    "--listen", sched, keys_env=keys.env())]
    engine = _serve("engine", "--model", MODEL, "--layers", "0:12", "--stage-rank", "0", "--node", "n0",
                    "--scheduler", sched, keys_env=keys.env())
    procs.append(engine)
    seen: set[int] = set()
    expected = generate(MODEL, "on its own", 5, ignore_eos=True)
    try:
        with Client(coord, keys=keys, timeout_s=30) as c:
            c.wait_ready(1, timeout_s=120)
            (node,) = _group_leaders(engine.pid)
            seen.add(node)
            os.kill(node, signal.SIGKILL)

            def state() -> str | None:
                return next((i["state"] for i in c.status()["instances"] if i["instance"] == "agg-0"), None)

            # A node restarted within the dead-after time is told apart by its new incarnation when it says hello
            # (the old one's requests fail then, and never come back to it); until then requests may still meet the
            # old node. So: a new process in the group, then the instance serving a new request again.
            wait_for(lambda: _group_leaders(engine.pid) - {node}, 20, "the killed node was not restarted")
            answers: list = []

            def serves() -> bool:
                answers[:] = c.complete(MODEL, ["on its own"], max_tokens=5, ignore_eos=True)
                return answers[0]["kind"] == "done"

            wait_for(serves, 90, "the node did not come back into rotation after it was killed")
            (again,) = _group_leaders(engine.pid)
            seen |= descendants(engine.pid)
            assert again != node and gone(node) and engine.poll() is None and state() == "ready"
            assert answers[0]["tokens"] == list(expected.tokens)
            engine.send_signal(signal.SIGKILL)
            engine.wait(timeout=10)
            wait_for(lambda: all(gone(p) for p in seen), 20, "the node outlived its killed `coral serve engine`")
            wait_for(lambda: state() == "unhealthy", 20, "the instance stayed in rotation without its node")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        kill_all(seen)


SUPERVISED = """
import sys
from coral_dagster.runtime.groups import supervise
from support.runtime_procs import start_helpers
if __name__ == "__main__":
    sys.exit(supervise("node", start_helpers, {"pid_file": sys.argv[1]}, restart=sys.argv[2] == "restart",
                       backoff_s=0.2))
"""


@pytest.mark.parametrize("restart", ["restart", "no-restart"])
def test_a_killed_supervised_node_takes_its_group_along(tmp_path, restart):
    """kill -9 of the node under `groups.supervise` (what `coral serve engine` runs it with): the helpers it started
    die with it; the node starts again, or without restarts the command exits with the node's status (128 + 9)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(paths.REPO_ROOT), str(paths.REPO_ROOT / "tests")])}
    pid_file = tmp_path / "pids"
    proc = subprocess.Popen([sys.executable, "-c", SUPERVISED, str(pid_file), restart], env=env)
    seen: set[int] = set()
    try:
        first = read_pids(pid_file)
        (node,) = _group_leaders(proc.pid)
        seen |= {node, *first.values()}
        assert set(first.values()) <= descendants(node)
        pid_file.unlink()
        os.kill(node, signal.SIGKILL)
        wait_for(lambda: all(gone(p) for p in seen), 20, "the killed node's helpers still running")
        if restart == "restart":
            second = read_pids(pid_file)
            seen |= set(second.values())
            assert not any(gone(p) for p in second.values()) and proc.poll() is None
            assert set(second.values()) <= descendants(proc.pid)
        else:
            assert proc.wait(timeout=20) == 128 + signal.SIGKILL and not pid_file.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        kill_all(seen)
