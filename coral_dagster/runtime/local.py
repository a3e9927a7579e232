"""A whole deployment on one machine: coordinator, schedulers and engine nodes as separate local processes."""

from __future__ import annotations

import logging
import math
import multiprocessing
import os
import secrets
import select
import signal
import socket
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from coral_dagster.errors import CoralError
from coral_dagster.runtime import credentials, groups, roles
from coral_dagster.runtime.client import Client
from coral_dagster.layer_split import stage_ranges
from coral_dagster.runtime.config import CoordinatorConfig, NodeSettings, SchedulerConfig, Timing
from coral_dagster.runtime.endpoint import run_endpoint
from coral_dagster.runtime.protocol import Env
from coral_dagster.runtime.security import CurveKeys, tcp_endpoint, write_secret

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class InstanceLayout:
    """One serving instance: phase, layer split, nodes per stage and the throughput the router weighs it by."""

    name: str
    phase: str
    split: tuple[int, ...]
    nodes_per_stage: tuple[int, ...] = ()
    tokens_per_s: float = 1.0

    @property
    def nodes(self) -> tuple[int, ...]:
        return self.nodes_per_stage or (1,) * len(self.split)


# Instances (and engine nodes per stage) one machine is asked to run: far above what fits, far below a fork bomb.
MAX_LOCAL_INSTANCES = 64


def local_instances(split: tuple[int, ...], instances: int, pd: bool = False,
                    decode_split: tuple[int, ...] | None = None,
                    nodes_per_stage: tuple[int, ...] = ()) -> list[InstanceLayout]:
    """`instances` aggregated instances, or with `pd` ceil(n/2) prefill and floor(n/2) decode instances."""
    if instances > MAX_LOCAL_INSTANCES or sum(nodes_per_stage) > MAX_LOCAL_INSTANCES:
        raise CoralError(f"--instances {instances} with --stage-nodes {nodes_per_stage or 'one each'} would start more "
                         f"than {MAX_LOCAL_INSTANCES} of anything on one machine.",
                         f"pass at most {MAX_LOCAL_INSTANCES} instances and nodes per stage")
    if instances < (2 if pd else 1):
        raise CoralError(f"--instances {instances} is too few{' for PD (one prefill and one decode)' if pd else ''}.",
                         f"pass --instances {2 if pd else 1} or more")
    if nodes_per_stage and len(nodes_per_stage) != len(split):
        raise CoralError(f"--stage-nodes has {len(nodes_per_stage)} entries for {len(split)} stages.",
                         "give one node count per stage of --split")
    if not pd:
        return [InstanceLayout(f"agg-{i}", "aggregated", split, nodes_per_stage) for i in range(instances)]
    n_prefill = math.ceil(instances / 2)
    decode_split = decode_split or split
    return ([InstanceLayout(f"prefill-{i}", "prefill", split, nodes_per_stage) for i in range(n_prefill)]
            + [InstanceLayout(f"decode-{i}", "decode", decode_split, nodes_per_stage if decode_split == split else ())
               for i in range(instances - n_prefill)])


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.bind((host, 0))
            return s.getsockname()[1]
    except OSError as exc:
        raise CoralError(f"cannot listen on host {host!r} ({exc.strerror or exc}).",
                         "pass an address of this machine, e.g. --host 127.0.0.1 or --host ::1") from None


# Children fork from a server that imported torch once, instead of each paying seconds of imports.
_PRELOAD = ["torch", "coral_dagster.runtime.torch_engine", "coral_dagster.runtime.coordinator",
            "coral_dagster.runtime.scheduler", "coral_dagster.runtime.node", "coral_dagster.runtime.roles"]


# How long a standby coordinator waits for its primary's ports to be free once the primary has died.
TAKEOVER_BIND_S = 10.0


def _port_free(host: str, port: int) -> bool:
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
        return True
    except OSError:
        return False


def standby_coordinator(cfg: CoordinatorConfig, primary: int, ports: tuple[int, ...]) -> None:
    """A warm standby: wait while coordinator process `primary` serves; once it has died, serve in its place on the
    same ZeroMQ and HTTP ports (one endpoint), where the schedulers' heartbeats find it and register again. SIGTERM
    while waiting ends it without taking over."""
    stop = threading.Event()
    roles.stop_on_signals(stop)
    try:
        fd: int | None = os.pidfd_open(primary)
    except ProcessLookupError:
        fd = None
    while fd is not None and not stop.is_set() and not select.select([fd], [], [], 0.2)[0]:
        pass
    if stop.is_set():
        return
    log.warning("coordinator %d is gone; this standby takes over %s", primary, cfg.listen)
    deadline = time.monotonic() + TAKEOVER_BIND_S
    while not all(_port_free(cfg.http_host, p) for p in ports) and time.monotonic() < deadline:
        time.sleep(0.05)
    roles.run_coordinator(cfg)


def _process_context() -> multiprocessing.context.ForkServerContext:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _pid(proc: BaseProcess) -> int:
    """The id of a started process (a deployment keeps only started ones)."""
    if proc.pid is None:
        raise RuntimeError(f"process {proc.name} was never started")
    return proc.pid


@dataclass
class LocalDeployment:
    """Runs each role (`runtime/roles.py`) in its own process and process group; `stop()` ends all of them.

    With `standby`, a second coordinator waits warm beside the serving one and takes over its ports (the same
    endpoint) the moment it dies, kill -9 included; the schedulers register with it on their next heartbeat, and a
    new standby is started. Requests in flight on the dead one fail with their connections (none is answered twice:
    the new coordinator drops whatever the instances still send for them). With `endpoint` as well, the pair runs
    as `coral launch` deploys it: each coordinator on ports of its own, every scheduler given both, and HAProxy
    (`runtime/endpoint.py`) on `http_port` in front, sending requests to whichever serves.

    Every socket is CURVE-encrypted with keys generated for this deployment, and the HTTP front door needs an API
    key (generated unless given) written to `<log_dir>/api_key`. A supervisor kills whatever an exited process
    leaves in its group and, once ready, restarts any scheduler or engine that exits with an error, after a
    back-off that doubles per restart up to `max_backoff_s`.
    """

    model: str
    instances: list[InstanceLayout]
    host: str = "127.0.0.1"
    http_port: int | None = None
    timing: Timing = field(default_factory=Timing)
    max_retries: int = 1
    log_dir: Path | None = None
    api_key: str | None = None
    restart: bool = True
    standby: bool = False
    endpoint: bool = False
    backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    # "vllm": each instance is one vLLM head (its split is vLLM's partition) behind a one-stage scheduler.
    engine: str = "torch"
    # VllmLaunch fields for vLLM heads (memory share, context length, eager mode, tp).
    vllm_launch: dict[str, Any] = field(default_factory=dict)
    # PD with vLLM: each phase's `--kv-transfer-config` JSON (`templates.engines.vllm_kv_transfer_config`).
    kv_transfer: dict[str, str] = field(default_factory=dict)
    procs: dict[str, BaseProcess] = field(default_factory=dict)
    restarts: dict[str, int] = field(default_factory=dict)
    # A pidfd per role: whether it runs is read from the kernel, not from multiprocessing, which reads every child
    # of a dead fork server as exited (status 255).
    pidfds: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.http_port = self.http_port or free_port(self.host)
        if self.endpoint and not self.standby:
            raise CoralError("an endpoint in front of one coordinator adds nothing.", "run the endpoint with a standby")
        serving = (free_port(self.host), free_port(self.host) if self.endpoint else self.http_port)
        # (ZeroMQ port, HTTP port) of the serving coordinator, then of its standby: the same pair without `endpoint`.
        self.pair = [serving, (free_port(self.host), free_port(self.host)) if self.endpoint else serving]
        self.keys = CurveKeys.generate()
        self.registration_key = credentials.generate()
        self.api_key = self.api_key or secrets.token_urlsafe(32)
        self.log_dir = Path(self.log_dir or tempfile.mkdtemp(prefix="coral-serve-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.api_key_file = self.log_dir / "api_key"
        write_secret(self.api_key_file, self.api_key + "\n")
        self._roles: dict[str, tuple[Callable[..., None], dict[str, Any], bool]] = {}
        # The instance each engine node serves (its credential is bound to it).
        self._instance_of: dict[str, str] = {}
        self._stopping = threading.Event()
        self._stopped = False
        self._ready = threading.Event()
        self._supervisor: threading.Thread | None = None
        # Held while a standby is promoted, so that `alive` never reads a half-swapped table.
        self._swap = threading.Lock()

    @property
    def coordinator(self) -> str:
        """The serving coordinator's ZeroMQ address."""
        return tcp_endpoint(self.host, self.pair[0][0])

    @property
    def coordinators(self) -> str:
        """What schedulers are given: the pair's addresses (one, when the standby takes over the same ports)."""
        return ",".join(dict.fromkeys(tcp_endpoint(self.host, z) for z, _ in self.pair))

    def _url(self, port: int | None) -> str:
        return f"http://[{self.host}]:{port}" if ":" in self.host else f"http://{self.host}:{port}"

    @property
    def http_url(self) -> str:
        return self._url(self.http_port)

    def spawn(self, name: str, target: Callable[..., None], kwargs: dict[str, Any],
              own_children: bool = False) -> None:
        """Start `target(**kwargs)` as process `name`, leading its own process group; `own_children` (vLLM, which
        starts its own processes) spawns a fresh interpreter instead of forking from the preloaded server."""
        # Keys travel in the environment (and the API key in the coordinator's config), never on a command line.
        env = {"OMP_NUM_THREADS": "1", **self.keys.env(), **self._secrets(kwargs)}
        if self.log_dir is None:
            raise RuntimeError("a deployment's log_dir is set when it is created (__post_init__)")
        log_path = self.log_dir / f"{name}.log"
        if name not in self.procs:
            log_path.unlink(missing_ok=True)
        ctx = multiprocessing.get_context("spawn") if own_children else _process_context()
        proc = ctx.Process(target=groups.run_child, args=(target, kwargs, os.getpid(), str(log_path), env), name=name,
                           daemon=not own_children)
        proc.start()
        self.procs[name] = proc
        if name in self.pidfds:
            os.close(self.pidfds.pop(name))
        try:
            self.pidfds[name] = os.pidfd_open(_pid(proc))
        except ProcessLookupError:
            pass  # It has already ended (and its fork server reaped it): `exitcode` reads its status.
        self._roles[name] = (target, kwargs, own_children)

    def _secrets(self, kwargs: dict[str, Any]) -> dict[str, str]:
        """The coordinator's registration key, a scheduler's instance credential, or an engine node's credential for
        its slot (instance, stage, name): each process gets only its own."""
        cfg, settings = kwargs.get("cfg"), kwargs.get("settings")
        if isinstance(cfg, CoordinatorConfig):
            return {Env.REGISTRATION_KEY.value: self.registration_key}
        if isinstance(cfg, SchedulerConfig):
            return {Env.INSTANCE_CREDENTIAL.value: credentials.instance_credential(self.registration_key, cfg.instance)}
        if isinstance(settings, NodeSettings):
            return {Env.NODE_CREDENTIAL.value: credentials.node_credential_of(
                self.registration_key, self._instance_of[settings.node], settings.stage, settings.node)}
        return {}

    def exitcode(self, name: str, wait_s: float = 0.0) -> int | None:
        """Role `name`'s exit status once its process has ended (waiting up to `wait_s`), else None."""
        fd = self.pidfds.get(name)
        if fd is not None and not select.select([fd], [], [], wait_s)[0]:
            return None
        proc = self.procs[name]
        if proc.exitcode is None:
            # Its status travels through the fork server, a moment after the kernel says it ended.
            proc.join(1.0)
        return proc.exitcode if proc.exitcode is not None else 255

    def start(self) -> None:
        """Launch the coordinator, then each instance's scheduler and engine nodes, and supervise them."""
        t, vllm = self.timing, self.engine == "vllm"
        self.spawn("coordinator", roles.run_coordinator, {"cfg": CoordinatorConfig(
            listen=self.coordinator, http_host=self.host, http_port=self.pair[0][1], models=(self.model,),
            max_retries=self.max_retries, api_key=self.api_key, timing=t)})
        if self.standby:
            self._spawn_standby()
        if self.endpoint:
            self.spawn("endpoint", run_endpoint, {"upstreams": [self._url(h) for _, h in self.pair],
                                                  "host": self.host, "port": self.http_port, "config_dir": self.log_dir})
        n_layers = roles.model_layers(self.model)
        for inst in self.instances:
            listen = tcp_endpoint(self.host, free_port(self.host))
            self.spawn(f"{inst.name}.scheduler", roles.run_scheduler, {"cfg": SchedulerConfig(
                instance=inst.name, model=self.model, phase=inst.phase, split=(n_layers,) if vllm else inst.split,
                n_layers=n_layers, coordinator=self.coordinators, listen=listen, tokens_per_s=inst.tokens_per_s,
                timing=t, limits=roles.model_limits(self.model))})
            if vllm:
                node = f"{inst.name}.vllm"
                self._instance_of[node] = inst.name
                settings = NodeSettings(node=node, model=self.model, start=0, end=n_layers, n_layers=n_layers,
                                        stage=0, scheduler=listen, listen=tcp_endpoint(self.host, "*"), engine="vllm",
                                        split=inst.split, tp=self.vllm_launch.get("tp", 1), timing=t)
                launch = {"master_addr": self.host, "master_port": free_port(self.host), **self.vllm_launch}
                if inst.phase in self.kv_transfer:
                    launch["kv_transfer_config"] = self.kv_transfer[inst.phase]
                self.spawn(node, roles.run_engine, {"settings": settings, "launch": launch}, own_children=True)
                continue
            for stage, ((start, end), count) in enumerate(zip(stage_ranges(inst.split), inst.nodes)):
                for k in range(count):
                    node = f"{inst.name}.s{stage}.n{k}"
                    self._instance_of[node] = inst.name
                    self.spawn(node, roles.run_engine, {"settings": NodeSettings(
                        node=node, model=self.model, start=start, end=end, n_layers=n_layers, stage=stage,
                        scheduler=listen, listen=tcp_endpoint(self.host, "*"), timing=t)})
        self.supervise()

    @property
    def _standby_name(self) -> str:
        """The standby's process name (each its own log: a promoted standby keeps writing to its own)."""
        return f"coordinator.standby{self.restarts.get('coordinator', 0)}"

    def _spawn_standby(self) -> None:
        zmq_port, http_port = self.pair[1]
        cfg = replace(self._roles["coordinator"][1]["cfg"], listen=tcp_endpoint(self.host, zmq_port),
                      http_port=http_port)
        self.spawn(self._standby_name, standby_coordinator, {"cfg": cfg, "primary": _pid(self.procs["coordinator"]),
                                                             "ports": self.pair[1]})

    def _promote_standby(self) -> None:
        """The standby now serves (its primary died): it becomes the coordinator, and a new standby waits on it."""
        name = self._standby_name
        self.procs["coordinator"] = self.procs.pop(name)
        self.pidfds["coordinator"] = self.pidfds.pop(name)
        self._roles["coordinator"] = self._roles.pop(name)
        self.restarts["coordinator"] = self.restarts.get("coordinator", 0) + 1
        self.pair.reverse()
        log.warning("the standby coordinator took over; starting a new standby")
        self._spawn_standby()

    def client(self, timeout_s: float = 60.0) -> Client:
        return Client(self.coordinator, keys=self.keys, timeout_s=timeout_s, registration_key=self.registration_key)

    def wait_ready(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """Block until every instance is registered and ready (restarts begin then); raises naming processes that died."""
        deadline = time.monotonic() + timeout_s
        with self.client(timeout_s=2.0) as c:
            while True:
                dead = {n: code for n in self.procs if (code := self.exitcode(n)) is not None}
                if dead:
                    raise CoralError(f"processes exited during start-up: {dead}; logs in {self.log_dir}.",
                                     "read those logs; the first error names the fix")
                try:
                    status = c.wait_ready(len(self.instances), timeout_s=min(1.0, deadline - time.monotonic()))
                    break
                except CoralError:
                    if time.monotonic() > deadline:
                        raise
        if self.endpoint:
            self._wait_endpoint(deadline)
        self._ready.set()
        return status

    def _wait_endpoint(self, deadline: float) -> None:
        """Block until the endpoint passes a request through to a serving coordinator (`/ping` answers 200)."""
        while True:
            try:
                with urllib.request.urlopen(f"{self.http_url}/ping", timeout=1.0) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline or self.exitcode("endpoint") is not None:
                raise CoralError(f"the endpoint at {self.http_url} never reached a coordinator; logs in "
                                 f"{self.log_dir}.", "read endpoint.log; the first error names the fix")
            time.sleep(0.1)

    def supervise(self) -> None:
        """Start the supervisor thread (once)."""
        if self._supervisor is None:
            self._supervisor = threading.Thread(target=self._supervise, name="coral-supervisor", daemon=True)
            self._supervisor.start()

    def _supervise(self, poll_s: float = 0.1) -> None:
        """Kill what an exited process leaves in its group; once ready, restart schedulers and engines that exit
        with an error (a clean exit, as after a drain, stays down) after the back-off."""
        due: dict[str, float] = {}
        swept: set[int] = set()
        while not self._stopping.wait(poll_s):
            now = time.monotonic()
            for name, proc in list(self.procs.items()):
                if self.procs.get(name) is not proc:
                    continue  # Promoted or replaced earlier in this sweep.
                code = self.exitcode(name)
                if code is None:
                    continue
                if (pid := _pid(proc)) not in swept:
                    swept.add(pid)
                    groups.kill_group(pid)
                standby = self._standby_name
                if name == "coordinator" and self.standby and standby in self.procs and self.alive(standby):
                    with self._swap:
                        os.close(self.pidfds.pop("coordinator"))
                        self._promote_standby()
                    continue
                if name.startswith("coordinator") or code == 0 or not (self.restart and self._ready.is_set()):
                    continue
                if name not in due:
                    n = self.restarts.get(name, 0)
                    due[name] = now + groups.restart_delay_s(n, self.backoff_s, self.max_backoff_s)
                    log.warning("%s exited with %s; restarting in %.1f s", name, code, due[name] - now)
                elif now >= due[name]:
                    del due[name]
                    self.restarts[name] = self.restarts.get(name, 0) + 1
                    target, kwargs, own_children = self._roles[name]
                    self.spawn(name, target, kwargs, own_children)

    def info(self) -> dict[str, Any]:
        return {"http": self.http_url, "coordinator": self.coordinator, "log_dir": str(self.log_dir),
                "curve": True, "api_key_file": str(self.api_key_file), "pids": {n: p.pid for n, p in self.procs.items()},
                "instances": [{"instance": i.name, "phase": i.phase, "split": list(i.split)} for i in self.instances]}

    def alive(self, name: str) -> bool:
        """Whether role `name` runs; the coordinator counts as running while its standby lives to take over."""
        with self._swap:
            if name == "coordinator" and self.standby and self._standby_name in self.procs:
                return self.exitcode(name) is None or self.exitcode(self._standby_name) is None
            return self.exitcode(name) is None

    def _signal(self, name: str, signum: int) -> None:
        try:
            os.kill(_pid(self.procs[name]), signum)
        except ProcessLookupError:
            pass

    def kill(self, name: str) -> None:
        """SIGKILL one process and its group, as a machine failure would."""
        self._signal(name, signal.SIGKILL)
        groups.kill_group(_pid(self.procs[name]))
        self.exitcode(name, wait_s=10)

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM every process still running, then SIGKILL whatever outlives `timeout_s`, with its group."""
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join(timeout=5)
        if self._stopped:
            return
        self._stopped = True
        standby = self._standby_name
        if standby in self.procs and self.alive(standby):
            # First, so that it does not take over from the coordinator this stop ends.
            self._signal(standby, signal.SIGTERM)
            self.exitcode(standby, wait_s=timeout_s)
        for name in self.procs:
            if self.alive(name):
                self._signal(name, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for name, p in self.procs.items():
            if self.exitcode(name, wait_s=max(0.1, deadline - time.monotonic())) is None:
                self._signal(name, signal.SIGKILL)
            groups.kill_group(_pid(p))
            p.join(timeout=5)
        for fd in self.pidfds.values():
            os.close(fd)
        self.pidfds.clear()

    def __enter__(self) -> LocalDeployment:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
