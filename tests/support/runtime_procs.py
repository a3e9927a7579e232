"""Test helpers for process lifetimes: who descends from whom (read from /proc), and a role that starts helper
processes the way vLLM's head does."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import time
from pathlib import Path


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat fields after the command (state, ppid, pgrp, …), or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


# Start time (clock ticks after boot) of each pid seen running: with pid_max at 32,768 a dead process's pid is soon
# another's, possibly the other test worker's, so a pid names the process first seen under it, never its successor.
_BORN: dict[int, str] = {}


def remember(pids) -> None:
    """Record which process each running pid of `pids` is, for `gone` and `kill_all` (`gone` records it)."""
    for pid in pids:
        gone(pid)


def gone(pid: int) -> bool:
    """True once `pid` no longer runs (absent, a zombie waiting for its parent or init to reap it, or its pid taken
    by a process started since); the process running now under `pid` is remembered as its owner."""
    fields = _stat(pid)
    return fields is None or fields[0] == "Z" or _BORN.setdefault(pid, fields[19]) != fields[19]


def pgid(pid: int) -> int | None:
    fields = _stat(pid)
    return None if fields is None else int(fields[2])


def descendants(pid: int) -> set[int]:
    """Live processes below `pid` in the process tree, by their parent links in /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        fields = _stat(int(entry)) if entry.isdigit() else None
        if fields is not None and fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    remember(found | {pid})
    return found


def kill_all(pids) -> None:
    """SIGKILL whichever of `pids` still run (a test's clean-up), never a later process given a dead one's pid."""
    for pid in pids:
        if gone(pid):
            continue
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what} within {timeout_s} s"
        time.sleep(0.1)


def _sleep_forever() -> None:
    time.sleep(3600)


def start_helpers(pid_file: str, then_raise: bool = False) -> None:
    """A role that starts what vLLM's head starts: a non-daemon multiprocessing child (its engine core, which a
    plain interpreter exit would wait for) and a grandchild process; writes their pids, then waits or raises."""
    child = multiprocessing.get_context("spawn").Process(target=_sleep_forever)
    child.start()
    grandchild = subprocess.Popen(["sleep", "3600"])
    tmp = Path(f"{pid_file}.tmp")
    tmp.write_text(json.dumps({"child": child.pid, "grandchild": grandchild.pid}))
    tmp.rename(pid_file)
    if then_raise:
        raise RuntimeError("the role failed after starting its helpers")
    time.sleep(3600)


def read_pids(pid_file: Path, timeout_s: float = 60) -> dict[str, int]:
    wait_for(pid_file.exists, timeout_s, f"{pid_file} was not written")
    pids = json.loads(pid_file.read_text())
    remember(pids.values())
    return pids
