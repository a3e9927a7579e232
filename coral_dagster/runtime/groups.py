"""Process groups that die as one: a runtime process leads a group holding everything it starts (vLLM's engine
core and workers), and that group is killed when the process exits, when it is killed, or when its parent goes."""

from __future__ import annotations

import multiprocessing
import os
import select
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from coral_dagster.errors import CoralError

# Exit codes of a supervised role: a clean stop (a drain, the scheduler gone), and a CoralError that names a fix.
CLEAN_EXIT, CORAL_ERROR_EXIT = 0, 2


def lead_group() -> None:
    """Make this process the leader of a new session and process group, which its descendants inherit."""
    os.setsid()


def kill_group(pgid: int) -> None:
    """SIGKILL every process still in group `pgid` (its leader may be gone: the group outlives it)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def group_members(pgid: int) -> list[int]:
    """Pids of the live (non-zombie) processes in group `pgid`, read from /proc."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # After the command: state, ppid, pgrp.
        if fields[0] != "Z" and int(fields[2]) == pgid:
            pids.append(int(entry))
    return pids


def kill_own_group_but_me() -> None:
    """SIGKILL every other process of the group this process leads (on its way out)."""
    me = os.getpid()
    if os.getpgrp() != me:
        return
    for pid in group_members(me):
        if pid != me:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def die_with(pid: int) -> None:
    """SIGKILL this process, and the group it leads, as soon as process `pid` exits, however it exits.

    A pidfd watched by a thread: `serve local`'s children are forked by multiprocessing's fork server, which does
    not pass its parent's death on (a parent-death signal would fire only when the fork server goes).
    """
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        os._exit(1)

    def watch() -> None:
        select.select([fd], [], [])
        me = os.getpid()
        kill_group(me) if os.getpgrp() == me else os.kill(me, signal.SIGKILL)

    threading.Thread(target=watch, name="coral-die-with-parent", daemon=True).start()


def restart_delay_s(restarts: int, backoff_s: float, max_backoff_s: float) -> float:
    """The wait before a role's next start after `restarts` earlier restarts: doubling per restart, capped."""
    return min(max_backoff_s, backoff_s * 2 ** restarts)


def run_child(target: Callable[..., None], kwargs: dict[str, Any], parent: int, log_path: str | None = None,
              env: dict[str, str] | None = None) -> None:
    """Run `target(**kwargs)` (a role) in this process, logging to `log_path` (else the inherited stdout/stderr):
    the body of every supervised process.

    The process leads its own group, so that whatever it starts dies with it, and dies with `parent`; it ends by
    `os._exit`, because multiprocessing's exit would first join children (vLLM's engine core) that wait for it, and
    then say nothing.
    """
    lead_group()
    die_with(parent)
    if log_path is not None:
        # Appended to, so that a restarted process's log follows the one it replaces.
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.environ.update(env or {})
    code = CLEAN_EXIT
    try:
        target(**kwargs)
    except CoralError as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = CORAL_ERROR_EXIT
    except BaseException:  # noqa: BLE001 - whatever ends a role is logged before the process goes
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    kill_own_group_but_me()
    os._exit(code)


def supervise(name: str, target: Callable[..., None], kwargs: dict[str, Any], restart: bool = True,
              backoff_s: float = 0.5, max_backoff_s: float = 30.0, grace_s: float = 30.0) -> int:
    """Run the role `target(**kwargs)` as a child that leads its own group and dies with this process, as
    `serve local` runs each of its processes; return the exit status this process should end with.

    When the child exits its group is killed (vLLM's engine core and workers go with it). A child that fails
    (killed, or an unexpected error) is started again after the back-off of `restart_delay_s`, unless `restart` is
    off; a clean stop, or a CoralError (a configuration that a restart would not fix), ends supervision. SIGTERM
    and SIGINT are passed on to the child, which is not restarted then (and is killed after `grace_s`).
    """
    ctx = multiprocessing.get_context("spawn")
    stopping = threading.Event()
    child: list[multiprocessing.process.BaseProcess] = []

    def on_signal(signum: int, frame: Any) -> None:
        stopping.set()
        if child and child[0].pid is not None:
            try:
                os.kill(child[0].pid, signum)
            except ProcessLookupError:
                pass

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    restarts = 0
    while True:
        proc = ctx.Process(target=run_child, args=(target, kwargs, os.getpid()), name=name)
        child[:] = [proc]
        proc.start()
        pid = proc.pid
        if pid is None:
            raise RuntimeError(f"{name} has no process id once started")
        if stopping.is_set():
            on_signal(signal.SIGTERM, None)
        deadline = None
        while proc.exitcode is None:
            proc.join(0.2)
            if stopping.is_set():
                deadline = deadline or time.monotonic() + grace_s
                if time.monotonic() > deadline:
                    kill_group(pid)
        kill_group(pid)
        code = proc.exitcode
        status = code if code >= 0 else 128 - code
        if stopping.is_set() or not restart or code in (CLEAN_EXIT, CORAL_ERROR_EXIT):
            return status
        delay = restart_delay_s(restarts, backoff_s, max_backoff_s)
        print(f"coral: {name} exited with {code}; restarting in {delay:.1f} s", file=sys.stderr, flush=True)
        if stopping.wait(delay):
            return status
        restarts += 1
