"""The DuckDB store: transactions roll back whole, a locked file fails fast and clearly, history survives."""

from __future__ import annotations

import subprocess
import sys
import time

import pandas as pd
import pytest

from coral_dagster.errors import StoreLockedError
from coral_dagster.store import Store

HOLDER = """
import duckdb, sys, time
con = duckdb.connect(sys.argv[1])
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
"""


def test_append_and_replace(tmp_path):
    store = Store(tmp_path / "c.duckdb")
    store.write("t", pd.DataFrame({"a": [1, 2]}))
    store.write("t", pd.DataFrame({"a": [3]}))
    assert store.query("SELECT sum(a) AS s FROM t")["s"][0] == 6
    store.write("t", pd.DataFrame({"a": [5]}), mode="replace")
    assert store.query("SELECT sum(a) AS s FROM t")["s"][0] == 5


def test_failed_transaction_leaves_previous_rows(tmp_path):
    store = Store(tmp_path / "c.duckdb")
    store.write("plans", pd.DataFrame({"plan_id": ["p1"], "cost": [1.0]}))
    with pytest.raises(RuntimeError):
        with store.transaction() as con:
            con.execute("INSERT INTO plans VALUES ('p2', 2.0)")
            con.execute("DELETE FROM plans WHERE plan_id = 'p1'")
            raise RuntimeError("solver crashed half way")
    assert store.query("SELECT plan_id FROM plans")["plan_id"].tolist() == ["p1"]


def test_locked_file_gives_clear_error_after_bounded_wait(tmp_path):
    path = tmp_path / "c.duckdb"
    Store(path).write("plans", pd.DataFrame({"plan_id": ["p1"]}))
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(path), "30"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        started = time.monotonic()
        with pytest.raises(StoreLockedError) as err:
            Store(path, lock_timeout_s=1.0).write("plans", pd.DataFrame({"plan_id": ["p2"]}))
        assert time.monotonic() - started < 10
        assert "locked by another process" in str(err.value) and "CORAL_DB" in str(err.value)
    finally:
        holder.kill()
        holder.wait()
    assert Store(path).query("SELECT plan_id FROM plans")["plan_id"].tolist() == ["p1"]


def test_waits_for_a_short_lock_then_writes(tmp_path):
    path = tmp_path / "c.duckdb"
    Store(path).write("plans", pd.DataFrame({"plan_id": ["p1"]}))
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(path), "1"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        Store(path, lock_timeout_s=20).write("plans", pd.DataFrame({"plan_id": ["p2"]}))
    finally:
        holder.wait()
    assert sorted(Store(path).query("SELECT plan_id FROM plans")["plan_id"]) == ["p1", "p2"]


def test_replace_rows_touches_only_its_key(tmp_path):
    from coral_dagster.store.duck import replace_rows

    store = Store(tmp_path / "c.duckdb")
    store.write("t", pd.DataFrame({"scenario": ["core", "core", "ext"], "v": [1, 2, 3]}))
    with store.transaction() as con:
        replace_rows(con, "t", pd.DataFrame({"scenario": ["core"], "v": [10]}), {"scenario": "core"})
    got = store.query("SELECT scenario, v FROM t ORDER BY v")
    assert got.values.tolist() == [["ext", 3], ["core", 10]]
