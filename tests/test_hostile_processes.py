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

from runtime_procs import descendants, gone, kill_all, wait_for

ROOT = Path(__file__).resolve().parent.parent


def _build(db: Path) -> subprocess.Popen:
    """The whole core library over two workers: minutes of work, so a signal lands mid-build."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "coral_dagster", "templates", "build", "--scenario", "core",
                             "--processes", "2", "--db", str(db), "--json"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=["ctrl-c", "timeout", "kill-9"])
def test_a_stopped_library_build_leaves_no_worker_and_no_lock(tmp_path, sig):
    db = tmp_path / "c.duckdb"
    with duckdb.connect(str(db)) as con:
        con.execute("CREATE TABLE kept AS SELECT 42 AS answer")
    proc = _build(db)
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
