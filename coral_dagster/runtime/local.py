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
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coral_dagster.errors import CoralError
from coral_dagster.runtime.client import Client
from coral_dagster.runtime.config import Timing, stage_ranges
from coral_dagster.runtime.security import CurveKeys

log = logging.getLogger(__name__)
ENV_API_KEY = "CORAL_API_KEY"


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


def local_instances(split: tuple[int, ...], instances: int, pd: bool = False,
                    decode_split: tuple[int, ...] | None = None,
                    nodes_per_stage: tuple[int, ...] = ()) -> list[InstanceLayout]:
    """`instances` aggregated instances, or with `pd` ceil(n/2) prefill and floor(n/2) decode instances."""
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
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def timing_args(t: Timing) -> list[str]:
    return ["--heartbeat-s", f"{t.heartbeat_s:g}", "--dead-after-s", f"{t.dead_after_s:g}",
            "--request-timeout-s", f"{t.request_timeout_s:g}", "--kv-timeout-s", f"{t.kv_timeout_s:g}",
            "--orphan-after-s", f"{t.orphan_after_s:g}"]


# Children fork from a server that imported torch once, instead of each paying seconds of imports.
_PRELOAD = ["torch", "coral_dagster.runtime.torch_engine", "coral_dagster.runtime.coordinator",
            "coral_dagster.runtime.scheduler", "coral_dagster.runtime.node"]


def _process_context() -> multiprocessing.context.BaseContext:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def die_with(pid: int) -> None:
    """SIGKILL this process as soon as process `pid` exits, however it exits (a pidfd watched by a thread).

    `serve local`'s children are forked by multiprocessing's fork server, which does not pass its parent's death
    on; a parent-death signal would fire only when the fork server goes, so each child watches `serve local` itself.
    """
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        os._exit(1)

    def watch() -> None:
        select.select([fd], [], [])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="coral-die-with-parent", daemon=True).start()


def _child(argv: list[str], log_path: str, env: dict[str, str], parent: int) -> None:
    """Run `coral serve <argv>` in this process, logging to `log_path` (the body of every local process)."""
    die_with(parent)
    # Appended to, so that a restarted process's log follows the one it replaces.
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.environ.update(env)
    from coral_dagster.cli.serve import serve

    try:
        serve.main(args=argv, prog_name="coral serve", standalone_mode=False)
    except CoralError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


@dataclass
class LocalDeployment:
    """Runs each role as `coral serve <role> …` in its own process; `stop()` ends all of them.

    Every socket is CURVE-encrypted with keys generated for this deployment, and the HTTP front door needs an API
    key (generated unless given) written to `<log_dir>/api_key`. Once ready, a supervisor restarts any scheduler
    or engine that exits with an error, after a back-off that doubles per restart up to `max_backoff_s`.
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
    backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    # "vllm": each instance is one vLLM head (its split is vLLM's partition) behind a one-stage scheduler.
    engine: str = "torch"
    # Extra `coral serve engine` flags for vLLM heads (memory share, context length, eager mode).
    vllm_args: tuple[str, ...] = ()
    procs: dict[str, multiprocessing.Process] = field(default_factory=dict)
    restarts: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.http_port = self.http_port or free_port(self.host)
        self.zmq_port = free_port(self.host)
        self.keys = CurveKeys.generate()
        self.api_key = self.api_key or secrets.token_urlsafe(32)
        self.log_dir = Path(self.log_dir or tempfile.mkdtemp(prefix="coral-serve-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.api_key_file = self.log_dir / "api_key"
        fd = os.open(self.api_key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.api_key + "\n")
        self._argv: dict[str, list[str]] = {}
        self._own_children: dict[str, bool] = {}
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None

    @property
    def coordinator(self) -> str:
        return f"tcp://{self.host}:{self.zmq_port}"

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    def _spawn(self, name: str, argv: list[str], own_children: bool = False) -> None:
        """Start `coral serve <argv>`; `own_children` (vLLM, which starts its own processes) spawns a fresh
        interpreter that may have children, instead of a daemon forked from the preloaded server."""
        # Secrets travel in the environment, never on a command line that `ps` shows.
        env = {"OMP_NUM_THREADS": "1", **self.keys.env(), ENV_API_KEY: self.api_key}
        log_path = self.log_dir / f"{name}.log"
        if name not in self.procs:
            log_path.unlink(missing_ok=True)
        ctx = multiprocessing.get_context("spawn") if own_children else _process_context()
        proc = ctx.Process(target=_child, args=(argv, str(log_path), env, os.getpid()), name=name,
                           daemon=not own_children)
        proc.start()
        self.procs[name] = proc
        self._argv[name] = argv
        self._own_children[name] = own_children

    def start(self) -> None:
        """Launch the coordinator, then each instance's scheduler and engine nodes."""
        t = timing_args(self.timing)
        self._spawn("coordinator", ["coordinator", "--listen", self.coordinator, "--http-host", self.host,
                                    "--http-port", str(self.http_port), "--model", self.model,
                                    "--max-retries", str(self.max_retries), *t])
        for inst in self.instances:
            listen = f"tcp://{self.host}:{free_port(self.host)}"
            split = ",".join(map(str, inst.split))
            self._spawn(f"{inst.name}.scheduler", [
                "scheduler", "--instance", inst.name, "--model", self.model, "--phase", inst.phase,
                "--split", str(sum(inst.split)) if self.engine == "vllm" else split,
                "--coordinator", self.coordinator, "--listen", listen, "--tokens-per-s", f"{inst.tokens_per_s:g}",
                *t])
            if self.engine == "vllm":
                self._spawn(f"{inst.name}.vllm", ["engine", "--engine", "vllm", "--node", f"{inst.name}.vllm",
                                                  "--model", self.model, "--layers", f"0:{sum(inst.split)}",
                                                  "--split", split, "--stage-rank", "0", "--scheduler", listen,
                                                  "--listen", f"tcp://{self.host}:*",
                                                  "--vllm-port", str(free_port(self.host)), *self.vllm_args, *t],
                            own_children=True)
                continue
            for stage, ((start, end), count) in enumerate(zip(stage_ranges(inst.split), inst.nodes)):
                for k in range(count):
                    node = f"{inst.name}.s{stage}.n{k}"
                    self._spawn(node, ["engine", "--node", node, "--model", self.model, "--layers", f"{start}:{end}",
                                       "--stage-rank", str(stage), "--scheduler", listen,
                                       "--listen", f"tcp://{self.host}:*", *t])

    def client(self, timeout_s: float = 60.0) -> Client:
        return Client(self.coordinator, keys=self.keys, timeout_s=timeout_s)

    def wait_ready(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """Block until every instance is registered and ready, then supervise; raises naming processes that died."""
        deadline = time.monotonic() + timeout_s
        with self.client(timeout_s=2.0) as c:
            while True:
                dead = {n: p.exitcode for n, p in self.procs.items() if p.exitcode is not None}
                if dead:
                    raise CoralError(f"processes exited during start-up: {dead}; logs in {self.log_dir}.",
                                     "read those logs; the first error names the fix")
                try:
                    status = c.wait_ready(len(self.instances), timeout_s=min(1.0, deadline - time.monotonic()))
                    break
                except CoralError:
                    if time.monotonic() > deadline:
                        raise
        if self.restart and self._supervisor is None:
            self._supervisor = threading.Thread(target=self._supervise, name="coral-supervisor", daemon=True)
            self._supervisor.start()
        return status

    def _supervise(self, poll_s: float = 0.1) -> None:
        """Restart schedulers and engines that exit with an error (a clean exit, as after a drain, stays down)."""
        due: dict[str, float] = {}
        while not self._stopping.wait(poll_s):
            now = time.monotonic()
            for name, proc in list(self.procs.items()):
                if name == "coordinator" or proc.exitcode in (None, 0):
                    continue
                if name not in due:
                    n = self.restarts.get(name, 0)
                    due[name] = now + min(self.max_backoff_s, self.backoff_s * 2 ** n)
                    log.warning("%s exited with %s; restarting in %.1f s", name, proc.exitcode, due[name] - now)
                elif now >= due[name]:
                    del due[name]
                    self.restarts[name] = self.restarts.get(name, 0) + 1
                    self._spawn(name, self._argv[name], self._own_children[name])

    def info(self) -> dict[str, Any]:
        return {"http": self.http_url, "coordinator": self.coordinator, "log_dir": str(self.log_dir),
                "curve": True, "api_key_file": str(self.api_key_file), "pids": {n: p.pid for n, p in self.procs.items()},
                "instances": [{"instance": i.name, "phase": i.phase, "split": list(i.split)} for i in self.instances]}

    def alive(self, name: str) -> bool:
        return self.procs[name].is_alive()

    def kill(self, name: str) -> None:
        """SIGKILL one process, as a machine failure would."""
        self.procs[name].kill()
        self.procs[name].join(timeout=10)

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM every process still running, then SIGKILL whatever outlives `timeout_s`."""
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join(timeout=5)
        for p in self.procs.values():
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + timeout_s
        for p in self.procs.values():
            p.join(timeout=max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(timeout=5)

    def __enter__(self) -> LocalDeployment:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
