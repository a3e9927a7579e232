"""A `coral templates build` stopped by Ctrl-C, `timeout` (SIGTERM) or kill -9 leaves no worker computing and no
lock on its DuckDB file, and Ctrl-C stops it within seconds: real commands, real signals, the process tree read
from /proc."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pytest

from support.runtime_procs import descendants, gone, kill_all, wait_for

ROOT = Path(__file__).resolve().parent.parent


COMMANDS = {
    # The whole core library over two workers: minutes of work, so a signal lands mid-build.
    "build": ["templates", "build", "--scenario", "core", "--processes", "2", "--json"],
    # A plan on an empty store builds that library first, over min(2, CPUs) workers.
    "plan": ["plan", "--scenario", "core", "--json"],
}


def _start(command: str, db: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # As from a terminal: a test run started in the background (`cmd &`) would pass SIGINT on ignored.
    return subprocess.Popen([sys.executable, "-m", "coral_dagster", *COMMANDS[command], "--db", str(db)], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


@pytest.mark.parametrize("command, sig", [("build", signal.SIGINT), ("build", signal.SIGTERM),
                                          ("build", signal.SIGKILL), ("plan", signal.SIGKILL)],
                         ids=["build-ctrl-c", "build-timeout", "build-kill-9", "plan-kill-9"])
def test_a_stopped_command_leaves_no_worker_and_no_lock(tmp_path, command, sig):
    if (os.cpu_count() or 1) < 2 and command == "plan":
        pytest.skip("a plan builds its library in this process on one CPU")
    db = tmp_path / "c.duckdb"
    with duckdb.connect(str(db)) as con:
        con.execute("CREATE TABLE kept AS SELECT 42 AS answer")
    proc = _start(command, db)
    workers: set[int] = set()
    try:
        def computing() -> bool:
            workers.update(descendants(proc.pid))
            return len(workers) >= 2 and proc.poll() is None
        wait_for(computing, 120, "two pool workers running")
        time.sleep(1.0)
        # Ctrl-C in a terminal reaches the whole foreground group; `timeout` and kill -9 only the command.
        os.killpg(proc.pid, sig) if sig == signal.SIGINT else proc.send_signal(sig)
        stopped = time.monotonic()
        proc.wait(timeout=30)
        took = time.monotonic() - stopped
        wait_for(lambda: all(gone(pid) for pid in workers), 10, "every worker gone")
    finally:
        kill_all(workers | {proc.pid})
    err = proc.stderr.read().decode()
    assert took < 10
    if sig != signal.SIGKILL:
        assert proc.returncode != 0 and "Traceback" not in err
    with duckdb.connect(str(db)) as con:
        assert con.execute("SELECT answer FROM kept").fetchall() == [(42,)]


def test_only_the_cancelled_pool_teardown_is_kept_quiet():
    """The hook `worker_pool` installs on its way out drops the executor manager thread's InvalidStateError (the
    CPython 3.11 race behind a traceback on SIGTERM) and passes every other thread exception on, once installed."""
    import threading
    from concurrent.futures import InvalidStateError, ProcessPoolExecutor

    from coral_dagster.lifetimes import quiet_cancelled_teardown

    seen = []
    hook = quiet_cancelled_teardown(seen.append)
    assert quiet_cancelled_teardown(hook) is hook
    with ProcessPoolExecutor(1) as pool:
        pool.submit(int, "1").result()
        manager = pool._executor_manager_thread
        other = threading.Thread(target=int)
        cases = [(InvalidStateError("CANCELLED"), manager), (RuntimeError("boom"), manager),
                 (InvalidStateError("CANCELLED"), other)]
        for exc, thread in cases:
            hook(threading.ExceptHookArgs([type(exc), exc, None, thread]))
    assert [(type(a.exc_value), a.thread) for a in seen] == [(RuntimeError, manager), (InvalidStateError, other)]
