"""No single coordinator in a launched deployment: a primary and a warm standby, every scheduler given both, HTTPS
by default, and the dry run showing the URL clients call."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import threading
import time
from contextlib import ExitStack
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
import zmq
from click.testing import CliRunner

from coral_dagster.cli import launch as launch_cli
from coral_dagster.deploy import state
from coral_dagster.deploy.reconcile import plan_diff, reconcile, teardown
from coral_dagster.deploy.tasks import role_template
from coral_dagster.runtime import wire
from coral_dagster.runtime.config import SchedulerConfig, Timing
from coral_dagster.runtime.scheduler import Scheduler
from coral_dagster.store import Store
from support.deploy_fakes import RecordingDrainer, RecordingLauncher
from support.deploy_plans import PHI, PRICES, QWEN, plan, store_on_snapshot
from support.runtime_fakes import background

SMALL = plan((QWEN, "aws:us-east-2", 1), (PHI, "aws:us-east-2", 2))


@pytest.fixture
def store(tmp_path):
    return Store(tmp_path / "deploy.duckdb")


def _dry_run_json(store: Store, out: Path, *flags: str) -> dict:
    store_on_snapshot(store, SMALL)
    done = CliRunner().invoke(launch_cli.launch, ["--dry-run", "--json", "--db", str(store.path), "--out", str(out),
                                                  *flags], catch_exceptions=False)
    return json.loads(done.output)


def _launch_lines(commands: list[str]) -> list[list[str]]:
    return [shlex.split(c) for c in commands if c.startswith("sky launch")]


def test_the_dry_run_launches_two_coordinators_first_and_shows_one_https_endpoint(store, tmp_path):
    doc = _dry_run_json(store, tmp_path / "y")
    launches = _launch_lines(doc["commands"])
    # The registration key is handed to the coordinators only.
    coordinators = [a[a.index("-c") + 1] for a in launches if "CORAL_REGISTRATION_KEY" in a]
    # Counted from the plan: its GPU nodes, and the two coordinators launched before any of them.
    n_gpu = sum(i.count * i.template.nodes.size for i in SMALL.instances)
    assert len(launches) == n_gpu + 2 and len(coordinators) == 2
    assert [a[a.index("-c") + 1] for a in launches[:2]] == coordinators
    primary, standby = coordinators
    var = {c: "${ADDR_" + c.replace("-", "_").upper() + "}" for c in coordinators}
    assert f"CORAL_PRIMARY={var[primary]}" in launches[1]
    # Every launch that runs a scheduler is handed both coordinators' addresses, primary first.
    wired = [x for a in launches for x in a if x.startswith("CORAL_COORDINATOR=")]
    assert wired and set(wired) == {f"CORAL_COORDINATOR={var[primary]},{var[standby]}"}
    assert len(wired) == sum(i.count for i in SMALL.instances)
    # One URL clients call, HTTPS, in the JSON and on launch.sh's last line.
    assert doc["endpoint"] == f"https://<IP of {primary}>:8000/v1"
    assert doc["failover"] == f"https://<IP of {standby}>:8000/v1"
    last = Path(doc["script"]).read_text().splitlines()[-1]
    assert last.startswith(f'echo "OpenAI API: https://$(host "{var[primary]}"):8000/v1')
    assert f'its standby serves at https://$(host "{var[standby]}"):8000/v1' in last
    kinds = [yaml.safe_load(Path(p).read_text()) for p in doc["yaml"]]
    coordinator_kinds = [k for k in kinds if "accelerators" not in k["resources"]]
    assert len(coordinator_kinds) == 1 and coordinator_kinds[0]["envs"]["CORAL_PLAIN_HTTP"] == "0"


def test_plain_http_is_an_explicit_opt_out(store, tmp_path):
    doc = _dry_run_json(store, tmp_path / "y", "--plain-http")
    assert doc["endpoint"].startswith("http://<IP of ") and doc["failover"].startswith("http://<IP of ")
    assert 'OpenAI API: http://' in Path(doc["script"]).read_text().splitlines()[-1]
    kinds = [yaml.safe_load(Path(p).read_text()) for p in doc["yaml"]]
    assert [k["envs"]["CORAL_PLAIN_HTTP"] for k in kinds if "accelerators" not in k["resources"]] == ["1"]


def test_reconcile_launches_both_coordinators_first_wires_every_scheduler_to_both_and_down_ends_with_them(store):
    calls: list[tuple[str, str]] = []
    launcher, drainer = RecordingLauncher(calls=calls), RecordingDrainer(calls=calls)
    report = reconcile(SMALL, "p1", store, launcher, drainer, PRICES)
    assert report.status == "done"
    rows = state.read_nodes(store)
    pair = rows[rows.role == "coordinator"].sort_values("slot")  # primary, standby
    primary, standby = pair.cluster_name
    assert list(pair.slot) == ["primary", "standby"]
    launched = [c for a, c in calls if a == "launch"]
    assert launched[:2] == [primary, standby]
    address = {c: f"tcp://{ip}:5555" for c, ip in launcher.ips.items()}
    assert launcher.requests[standby].config["envs"]["CORAL_PRIMARY"] == address[primary]
    assert launcher.requests[primary].config["envs"]["CORAL_PRIMARY"] == ""
    heads = rows[(rows.role != "coordinator") & (rows.stage == 0) & (rows.node_index == 0)]
    assert len(heads) == sum(i.count for i in SMALL.instances)
    for head in heads.cluster_name:
        assert launcher.requests[head].config["envs"]["CORAL_COORDINATOR"] == f"{address[primary]},{address[standby]}"
    others = rows[(rows.role != "coordinator") & ~rows.cluster_name.isin(heads.cluster_name)]
    assert all(launcher.requests[c].config["envs"]["CORAL_COORDINATOR"] == "" for c in others.cluster_name)
    # Both serve HTTPS; `coral status`'s URL is the primary's.
    from coral_dagster.app.deployment import endpoint
    assert endpoint(rows) == f"https://{launcher.ips[primary]}:8000/v1"
    assert {launcher.requests[c].config["envs"]["CORAL_PLAIN_HTTP"] for c in (primary, standby)} == {"0"}
    # A second run changes nothing; `coral down` drains every instance, then takes the pair down last.
    again = RecordingLauncher()
    assert reconcile(SMALL, "p1", store, again, RecordingDrainer(), PRICES).launched == () and again.calls == []
    n = len(calls)
    down = teardown(store, launcher, drainer)
    tail = calls[n:]
    assert down.status == "done" and {c for _, c in tail[-2:]} == {primary, standby}
    assert all(a == "down" for a, _ in tail[-2:]) and [a for a, _ in tail].count("drain") == len(heads)
    assert set(state.read_nodes(store).status) == {"down"}


def test_a_live_coordinator_without_a_standby_gets_one_serving_its_scheme(store):
    """A deployment recorded before the pair (one coordinator, phase empty: it served plain HTTP) gets a standby
    wired to it on the next run, serving plain HTTP as the primary does."""
    reconcile(SMALL, "p1", store, RecordingLauncher(), RecordingDrainer(), PRICES)
    with store.transaction() as con:
        con.execute("DELETE FROM deployment_nodes WHERE slot = 'standby'")
        con.execute("UPDATE deployment_nodes SET phase = '' WHERE role = 'coordinator'")
    launcher = RecordingLauncher()
    reconcile(SMALL, "p1", store, launcher, RecordingDrainer(), PRICES)
    (standby,) = launcher.requests
    assert standby.endswith("-coord-b") and launcher.requests[standby].config["envs"]["CORAL_PLAIN_HTTP"] == "1"
    assert plan_diff(SMALL, "p1", state.read_nodes(store), PRICES).plain_http


def _run_section(tmp_path: Path, envs: dict[str, str]) -> subprocess.Popen:
    """The coordinator task's `run` script under bash with the task's envs, `envs` over them, and a `python` on PATH
    that records its arguments and the TLS envs instead of serving."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "python"
    fake.write_text('#!/bin/sh\necho "$* cert=$CORAL_TLS_CERTFILE key=$CORAL_TLS_KEYFILE" > "$SERVED"\n')
    fake.chmod(0o755)
    task = role_template("coordinator")
    env = {**os.environ, **{k: str(v) for k, v in task["envs"].items()}, **envs, "HOME": str(tmp_path / "home"),
           "SERVED": str(tmp_path / "served"), "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    return subprocess.Popen(["bash", "-c", task["run"]], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def test_without_a_certificate_the_coordinator_serves_https_with_a_key_only_it_reads(tmp_path):
    done = _run_section(tmp_path, {})
    assert done.wait(60) == 0, done.stderr.read() if done.stderr else ""
    served = (tmp_path / "served").read_text().split()
    tls = tmp_path / "home" / ".coral" / "tls"
    assert served[:4] == ["-m", "coral_dagster.cli.serve", "coordinator", f"cert={tls / 'cert.pem'}"]
    assert served[4] == f"key={tls / 'key.pem'}"
    assert (tls / "key.pem").stat().st_mode & 0o777 == 0o600 and tls.stat().st_mode & 0o777 == 0o700
    text = subprocess.run(["openssl", "x509", "-in", str(tls / "cert.pem"), "-noout", "-subject"], check=True,
                          capture_output=True, text=True).stdout
    assert "coral-coordinator" in text


class _Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args) -> None:
        """Quiet."""


@pytest.mark.slow
def test_the_standby_waits_while_its_primary_answers_and_serves_once_it_stops(tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    proc = _run_section(tmp_path, {"CORAL_PLAIN_HTTP": "1", "CORAL_HTTP_PORT": str(port),
                                   "CORAL_PRIMARY": "tcp://127.0.0.1:5555"})
    try:
        time.sleep(6.0)  # three probe intervals, all answered
        assert proc.poll() is None and not (tmp_path / "served").exists()
        server.shutdown()
        server.server_close()
        stopped = time.monotonic()
        assert proc.wait(30) == 0
        took_s = time.monotonic() - stopped
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # Three missed probes 2 s apart: at least 4 s after the primary stopped, and well inside the schedulers' 60 s.
    assert 4.0 <= took_s < 30.0
    assert (tmp_path / "served").read_text().startswith("-m coral_dagster.cli.serve coordinator cert= key=")


TIMING = Timing(heartbeat_s=0.1, dead_after_s=1.0, request_timeout_s=10.0)


def _kinds(sock: zmq.Socket, n: int, timeout_s: float = 10.0) -> list[str]:
    """The kinds of the next `n` messages a coordinator's ROUTER receives."""
    kinds: list[str] = []
    deadline = time.monotonic() + timeout_s
    while len(kinds) < n and time.monotonic() < deadline:
        sock.poll(100)
        kinds += [h["kind"] for _, h, _ in wire.drain(sock, routed=True)]
    assert len(kinds) >= n, kinds
    return kinds[:n]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_scheduler_given_the_pair_talks_only_to_the_one_listening_and_moves_when_it_changes():
    """Scheduler-side half of the failover, on real sockets: given `primary,standby`, every message (each beat's
    `register` and `heartbeat`) reaches the one coordinator listening, none is queued for the silent one (a plain
    DEALER would deal every other message to it); once the first is gone and the other listens, it hears the
    scheduler and, on `reregister`, gets its registration."""
    first, second = f"tcp://127.0.0.1:{_free_port()}", f"tcp://127.0.0.1:{_free_port()}"
    with ExitStack() as stack:
        ctx = zmq.Context()
        stack.callback(ctx.term)
        serving = ctx.socket(zmq.ROUTER)
        serving.linger = 0
        stack.callback(serving.close)
        serving.bind(second)
        sched = Scheduler(SchedulerConfig("i", "tiny-llama", "aggregated", (12,), 12, f"{first},{second}",
                                          listen="tcp://127.0.0.1:*", timing=TIMING), insecure=True)
        background(stack, sched.run)
        node = ctx.socket(zmq.DEALER)
        node.linger = 0
        stack.callback(node.close)
        node.setsockopt(zmq.IDENTITY, b"n0")
        node.connect(sched.address)
        data = ctx.socket(zmq.PULL)
        data.linger = 0
        stack.callback(data.close)
        data.bind("tcp://127.0.0.1:*")
        wire.send(node, {"kind": "hello", "node": "n0", "stage": 0, "start": 0, "end": 12, "share": 1.0,
                         "model": "tiny-llama", "data": data.getsockopt_string(zmq.LAST_ENDPOINT)})
        # Unanswered, the scheduler sends `register` then `heartbeat` every beat: all of them arrive here.
        kinds = _kinds(serving, 12)
        start = kinds.index("register")
        assert kinds[start:start + 8] == ["register", "heartbeat"] * 4
        serving.close()
        taking_over = ctx.socket(zmq.ROUTER)
        taking_over.linger = 0
        stack.callback(taking_over.close)
        taking_over.bind(first)
        deadline = time.monotonic() + 10
        heard = None
        while heard is None and time.monotonic() < deadline:
            taking_over.poll(100)
            for ident, h, _ in wire.drain(taking_over, routed=True):
                heard = ident
        assert heard is not None
        wire.send(taking_over, {"kind": "registered"}, to=heard)
        wire.send(taking_over, {"kind": "reregister"}, to=heard)
        assert "register" in _kinds(taking_over, 6)
