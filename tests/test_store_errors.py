"""Broken DuckDB files are sentences naming the file and the fix; tables of an older schema migrate on write."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import duckdb
import pandas as pd
import pytest
from click.testing import CliRunner

from coral_dagster.allocation.storage import load_plan, store_plan
from coral_dagster.allocation.types import Plan
from coral_dagster.cli.main import main
from coral_dagster.errors import StoreFileError
from coral_dagster.store import Store
from coral_dagster.templates.library import FRAME_COLUMNS, load_library, store_library


def _real_file(path: Path, rows: int = 100_000) -> Path:
    Store(path).write("t", pd.DataFrame({"a": range(rows), "b": [f"row {i}" for i in range(rows)]}))
    return path


def _truncate(path: Path, keep: float) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 4, len(data) // 2):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage,words", [
    (lambda p: _truncate(p, 0.4), "truncated"),
    (lambda p: _truncate(p, 0.0), "not a DuckDB database file"),
    (lambda p: p.write_bytes(b"plans,cost\np1,3\n" * 100), "not a DuckDB database file"),
    (_flip, "corrupted"),
])
def test_damaged_file_is_a_sentence_with_the_fix(tmp_path, damage, words):
    path = _real_file(tmp_path / "c.duckdb")
    assert Store(path).query("SELECT count(*) AS n FROM t")["n"][0] == 100_000  # sound before the damage
    damage(path)
    with pytest.raises(StoreFileError) as err:
        Store(path).query("SELECT sum(a) AS s, max(b) AS m FROM t")
    text = str(err.value)
    assert words in text and str(path) in text and f"mv {path}" in text and "CORAL_DB" in text


def test_damaged_file_through_the_cli_is_one_line(tmp_path):
    path = _real_file(tmp_path / "c.duckdb", rows=10)
    _truncate(path, 0.5)
    res = CliRunner().invoke(main, ["templates", "list", "--scenario", "core", "--db", str(path)])
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit)
    assert str(path) in res.output and "Fix:" in res.output and "Traceback" not in res.output


def test_folder_instead_of_file(tmp_path):
    with pytest.raises(StoreFileError, match="is a folder"):
        Store(tmp_path).write("t", pd.DataFrame({"a": [1]}))


READ_ONLY_CHILD = """
import os, sys
import pandas as pd
from coral_dagster.errors import StoreFileError
from coral_dagster.store import Store
if os.getuid() == 0:
    os.setgid(65534); os.setuid(65534)  # root writes anything; drop to nobody (all imports are done)
store = Store(sys.argv[1])
print("read", int(store.query("SELECT count(*) AS n FROM t")["n"][0]))
try:
    store.write("t", pd.DataFrame({"a": [1], "b": ["x"]}))
    print("wrote")
except StoreFileError as exc:
    print("error", exc)
"""


def test_read_only_file_reads_and_refuses_writes_with_the_fix():
    folder = Path(tempfile.mkdtemp(prefix="coral-ro-"))
    try:
        path = _real_file(folder / "c.duckdb", rows=5)
        os.chmod(path, 0o444)
        os.chmod(folder, 0o555)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        out = subprocess.run([sys.executable, "-c", READ_ONLY_CHILD, str(path)], capture_output=True, text=True,
                             env=env, timeout=120, cwd="/")
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert lines[0] == "read 5"
        assert lines[1].startswith("error") and "cannot be written" in lines[1] and str(path) in lines[1]
        assert "chmod u+w" in lines[1]
    finally:
        os.chmod(folder, 0o755)
        for f in folder.iterdir():
            f.unlink()
        folder.rmdir()


def _plan(cost: float) -> Plan:
    return Plan("core", "coral", "optimal", cost, cost, 0.0, 0.1, (), {("phi-4", "prefill"): 1.0}, {})


def test_older_plans_table_migrates_and_keeps_its_rows(tmp_path):
    path = tmp_path / "old.duckdb"
    store = Store(path)
    first = store_plan(store, _plan(1.0), "r1", {}).plan_id
    with duckdb.connect(str(path)) as con:  # an older Coral: no MIP bound, no detail columns
        con.execute("ALTER TABLE plans DROP COLUMN mip_bound_usd_per_hour")
        con.execute("ALTER TABLE plans DROP COLUMN detail_json")
    second = store_plan(store, _plan(2.0), "r2", {}).plan_id
    assert {"mip_bound_usd_per_hour", "detail_json"} <= set(store.columns("plans"))
    assert load_plan(store, second).cost_usd_per_hour == 2.0
    rows = store.query("SELECT plan_id, detail_json FROM plans ORDER BY cost_usd_per_hour")
    assert rows.plan_id.tolist() == [first, second] and rows.detail_json.isna().tolist() == [True, False]


def test_older_template_library_is_rebuilt_not_trusted(tmp_path):
    path = tmp_path / "old.duckdb"
    old = pd.DataFrame([{c: None for c in FRAME_COLUMNS if c != "library_key"}]).astype(str)
    Store(path).write("templates", old)
    store = Store(path)
    assert load_library(store, "core") == []  # no key: never reused for any scenario
    from coral_dagster.templates.types import Stage, Template
    from coral_dagster.catalog.nodes import NodeConfig, NodeMultiset

    node = NodeConfig("L4", 1)
    t = Template("phi-4", "prefill", 1200.0, NodeMultiset.of([node]), (Stage(0, 40, (node,), (1.0,)),), 10.0,
                 "compute")
    assert store_library(store, [t], "core") == 1
    assert load_library(store, "core") == [t]
    assert len(store.query("SELECT * FROM templates")) == 2  # the old row is kept, unused


def test_a_failed_write_reports_its_own_error_not_the_aborted_transaction(tmp_path):
    store = Store(tmp_path / "c.duckdb")
    store.write("t", pd.DataFrame({"a": [1]}))
    with pytest.raises(StoreFileError) as err:
        store.write("t", pd.DataFrame({"a": ["not a number"]}))
    assert "aborted" not in str(err.value) and "not a number" in str(err.value)
    assert store.query("SELECT a FROM t")["a"].tolist() == [1]
