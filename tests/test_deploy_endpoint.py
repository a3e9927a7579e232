"""No single coordinator in a launched deployment: a primary and a warm standby, every scheduler given both, one
endpoint (HAProxy) in front of them, HTTPS by default, and the dry run showing the URL clients call."""

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


def test_the_dry_run_launches_two_coordinators_and_their_endpoint_first_and_shows_one_https_endpoint(store, tmp_path):
    doc = _dry_run_json(store, tmp_path / "y")
    launches = _launch_lines(doc["commands"])
    # The registration key is handed to the coordinators only.
    coordinators = [a[a.index("-c") + 1] for a in launches if "CORAL_REGISTRATION_KEY" in a]
    # Counted from the plan: its GPU nodes, and the two coordinators and the endpoint launched before any of them.
    n_gpu = sum(i.count * i.template.nodes.size for i in SMALL.instances)
    assert len(launches) == n_gpu + 3 and len(coordinators) == 2
    assert [a[a.index("-c") + 1] for a in launches[:2]] == coordinators
    primary, standby = coordinators
    endpoint = launches[2][launches[2].index("-c") + 1]
    assert endpoint.endswith("-endpoint") and not any(a.startswith("CORAL_") and "KEY" in a for a in launches[2])
    var = {c: "${ADDR_" + c.replace("-", "_").upper() + "}" for c in coordinators}
    assert f"CORAL_PRIMARY={var[primary]}" in launches[1]
    # The endpoint is handed both coordinators, primary first, and nothing secret.
    assert f"CORAL_COORDINATOR={var[primary]},{var[standby]}" in launches[2] and "--secret" not in launches[2]
    # Every launch that runs a scheduler is handed both coordinators' addresses, primary first.
    wired = [x for a in launches for x in a if x.startswith("CORAL_COORDINATOR=")]
    assert wired and set(wired) == {f"CORAL_COORDINATOR={var[primary]},{var[standby]}"}
    assert len(wired) == sum(i.count for i in SMALL.instances) + 1
    # One URL clients call, the endpoint's, HTTPS, in the JSON and on launch.sh's last line.
    assert doc["endpoint"] == f"https://<IP of {endpoint}>:8000/v1"
    assert doc["coordinators"] == [f"https://<IP of {c}>:8000/v1" for c in (primary, standby)]
    last = Path(doc["script"]).read_text().splitlines()[-1]
    assert last.startswith(f'echo "OpenAI API: https://$(sky status --ip {endpoint}):8000/v1')
    kinds = [yaml.safe_load(Path(p).read_text()) for p in doc["yaml"]]
    cpu_kinds = [k for k in kinds if "accelerators" not in k["resources"]]
    assert len(cpu_kinds) == 2 and {k["envs"]["CORAL_PLAIN_HTTP"] for k in cpu_kinds} == {"0"}
    assert [k["resources"]["ports"] for k in cpu_kinds if "CORAL_PRIMARY" not in k["envs"]] == [[8000]]


def test_plain_http_is_an_explicit_opt_out(store, tmp_path):
    doc = _dry_run_json(store, tmp_path / "y", "--plain-http")
    assert doc["endpoint"].startswith("http://<IP of ") and all(c.startswith("http://<IP of ")
                                                                 for c in doc["coordinators"])
    assert 'OpenAI API: http://' in Path(doc["script"]).read_text().splitlines()[-1]
    kinds = [yaml.safe_load(Path(p).read_text()) for p in doc["yaml"]]
    assert [k["envs"]["CORAL_PLAIN_HTTP"] for k in kinds if "accelerators" not in k["resources"]] == ["1", "1"]


def test_reconcile_launches_the_pair_and_endpoint_first_wires_schedulers_to_both_and_down_ends_with_them(store):
    calls: list[tuple[str, str]] = []
    launcher, drainer = RecordingLauncher(calls=calls), RecordingDrainer(calls=calls)
    report = reconcile(SMALL, "p1", store, launcher, drainer, PRICES)
    assert report.status == "done"
    rows = state.read_nodes(store)
    pair = rows[rows.role == "coordinator"].sort_values("slot")  # primary, standby
    primary, standby = pair.cluster_name
    assert list(pair.slot) == ["primary", "standby"]
    launched = [c for a, c in calls if a == "launch"]
    (front,) = rows[rows.role == "endpoint"].cluster_name
    assert launched[:3] == [primary, standby, front]
    address = {c: f"tcp://{ip}:5555" for c, ip in launcher.ips.items()}
    assert launcher.requests[standby].config["envs"]["CORAL_PRIMARY"] == address[primary]
    assert launcher.requests[primary].config["envs"]["CORAL_PRIMARY"] == ""
    assert launcher.requests[front].config["envs"]["CORAL_COORDINATOR"] == f"{address[primary]},{address[standby]}"
    assert launcher.requests[front].config["resources"]["ports"] == [8000] and not launcher.requests[front].secret_names
    gpu = rows[~rows.role.isin(("coordinator", "endpoint"))]
    heads = gpu[(gpu.stage == 0) & (gpu.node_index == 0)]
    assert len(heads) == sum(i.count for i in SMALL.instances)
    for head in heads.cluster_name:
        assert launcher.requests[head].config["envs"]["CORAL_COORDINATOR"] == f"{address[primary]},{address[standby]}"
    others = gpu[~gpu.cluster_name.isin(heads.cluster_name)]
    assert all(launcher.requests[c].config["envs"]["CORAL_COORDINATOR"] == "" for c in others.cluster_name)
    # All three serve HTTPS; `coral status`'s URL is the endpoint's.
    from coral_dagster.app.deployment import endpoint
    assert endpoint(rows) == f"https://{launcher.ips[front]}:8000/v1"
    assert {launcher.requests[c].config["envs"]["CORAL_PLAIN_HTTP"] for c in (primary, standby, front)} == {"0"}
    # A second run changes nothing; `coral down` drains every instance, then takes the pair down last.
    again = RecordingLauncher()
    assert reconcile(SMALL, "p1", store, again, RecordingDrainer(), PRICES).launched == () and again.calls == []
    n = len(calls)
    down = teardown(store, launcher, drainer)
    tail = calls[n:]
    assert down.status == "done" and {c for _, c in tail[-3:]} == {primary, standby, front}
    assert all(a == "down" for a, _ in tail[-3:]) and [a for a, _ in tail].count("drain") == len(heads)
    assert set(state.read_nodes(store).status) == {"down"}


def test_a_live_coordinator_without_a_standby_gets_one_and_an_endpoint_serving_its_scheme(store):
    """A deployment recorded before the pair (one coordinator, phase empty: it served plain HTTP) gets a standby
    wired to it and an endpoint wired to both on the next run, serving plain HTTP as the primary does."""
    reconcile(SMALL, "p1", store, RecordingLauncher(), RecordingDrainer(), PRICES)
    with store.transaction() as con:
        con.execute("DELETE FROM deployment_nodes WHERE slot IN ('standby', 'endpoint')")
        con.execute("UPDATE deployment_nodes SET phase = '' WHERE role = 'coordinator'")
    launcher = RecordingLauncher()
    reconcile(SMALL, "p1", store, launcher, RecordingDrainer(), PRICES)
    standby, front = launcher.requests
    assert standby.endswith("-coord-b") and launcher.requests[standby].config["envs"]["CORAL_PLAIN_HTTP"] == "1"
    assert front.endswith("-endpoint") and launcher.requests[front].config["envs"]["CORAL_PLAIN_HTTP"] == "1"
    assert plan_diff(SMALL, "p1", state.read_nodes(store), PRICES).plain_http


def _run_section(tmp_path: Path, envs: dict[str, str], role: str = "coordinator") -> subprocess.Popen:
    """A task's `run` script (the coordinator's unless `role`) under bash with the task's envs, `envs` over them, and
    a `python` on PATH that records its arguments and the TLS envs instead of serving."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "python"
    fake.write_text('#!/bin/sh\necho "$* cert=$CORAL_TLS_CERTFILE key=$CORAL_TLS_KEYFILE" > "$SERVED"\n')
    fake.chmod(0o755)
    task = role_template(role)
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


@pytest.mark.parametrize("plain", [False, True], ids=["https", "plain-http"])
def test_the_endpoint_task_sends_to_the_pair_in_order_with_a_config_haproxy_accepts(tmp_path, plain):
    """The endpoint's `run` script turns the pair's recorded addresses into front-door URLs, primary first, and (HTTPS)
    a PEM only it reads; `coral serve endpoint` with those arguments writes a configuration HAProxy itself checks."""
    from coral_dagster.runtime.endpoint import Upstream, haproxy_config

    pair = "tcp://10.0.0.1:5555,tcp://10.0.0.2:5555"
    done = _run_section(tmp_path, {"CORAL_COORDINATOR": pair, "CORAL_PLAIN_HTTP": "1" if plain else "0"}, "endpoint")
    assert done.wait(60) == 0, done.stderr.read() if done.stderr else ""
    args = (tmp_path / "served").read_text().split(" cert=")[0].split()
    scheme = "http" if plain else "https"
    assert args[:3] == ["-m", "coral_dagster.cli.serve", "endpoint"]
    upstreams = [args[k + 1] for k, a in enumerate(args) if a == "--upstream"]
    assert upstreams == [f"{scheme}://10.0.0.1:8000", f"{scheme}://10.0.0.2:8000"]
    pem = Path(args[args.index("--tls-pemfile") + 1]) if "--tls-pemfile" in args else None
    assert (pem is None) == plain
    if pem is not None:
        assert pem.stat().st_mode & 0o777 == 0o600 and "PRIVATE KEY" in pem.read_text()
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(haproxy_config([Upstream.parse(u) for u in upstreams], "127.0.0.1", 8443, pem))
    text = cfg.read_text()
    # The primary first and active, the standby its backup, each over the scheme the pair serves.
    servers = [line.split() for line in text.splitlines() if line.strip().startswith("server ")]
    assert [s[2] for s in servers] == ["10.0.0.1:8000", "10.0.0.2:8000"] and servers[1][-1] == "backup"
    assert all(("ssl" in s) != plain for s in servers)
    checked = subprocess.run(["haproxy", "-c", "-f", str(cfg)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_an_upstream_that_is_not_a_url_is_refused_naming_it():
    from coral_dagster.errors import CoralError
    from coral_dagster.runtime.endpoint import Upstream

    for bad in ("10.0.0.1:8000", "tcp://10.0.0.1:5555", "https://10.0.0.1"):
        with pytest.raises(CoralError, match="is not an http"):
            Upstream.parse(bad)


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
