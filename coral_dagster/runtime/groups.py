"""Process groups that die as one: a runtime process leads a group holding everything it starts (vLLM's engine
core and workers), and that group is killed when the process exits, when it is killed, or when its parent goes."""

from __future__ import annotations

import os
import select
import signal
import threading


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
