"""Transactional access to Coral's DuckDB file, with bounded retries when another process holds it."""

from __future__ import annotations

import logging
import re
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import duckdb
import pandas as pd

from coral_dagster.errors import CoralError, StoreLockedError
from coral_dagster.paths import default_db_path

log = logging.getLogger(__name__)
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class Store:
    """One DuckDB file; each operation opens, works inside a transaction and closes, so processes take turns."""

    def __init__(self, path: str | Path | None = None, *, lock_timeout_s: float = 10.0) -> None:
        self.path = Path(path) if path else default_db_path()
        self.lock_timeout_s = lock_timeout_s

    @contextmanager
    def connect(self, read_only: bool = False) -> Iterator[duckdb.DuckDBPyConnection]:
        """A connection, retried with back-off while another process holds the file's lock."""
        if read_only and not self.path.exists():
            raise CoralError(f"DuckDB file {self.path} does not exist yet.",
                             "run `coral catalog load` (or the main job) first, or set CORAL_DB.")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        deadline, delay = time.monotonic() + self.lock_timeout_s, 0.05
        while True:
            try:
                con = duckdb.connect(str(self.path), read_only=read_only)
                break
            except duckdb.IOException as exc:
                if "lock" not in str(exc).lower():
                    raise
                if time.monotonic() >= deadline:
                    raise StoreLockedError(
                        f"DuckDB file {self.path} is locked by another process ({exc}).",
                        "stop the other writer (e.g. `dagster dev` or a running `coral` command), or point "
                        "CORAL_DB at another file.") from exc
                log.info("store %s is locked; retrying in %.2fs", self.path, delay)
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
        try:
            yield con
        finally:
            con.close()

    @contextmanager
    def transaction(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """A connection inside BEGIN … COMMIT; any exception rolls everything back."""
        with self.connect() as con:
            con.begin()
            try:
                yield con
            except BaseException:
                con.rollback()
                raise
            con.commit()

    def write(self, table: str, df: pd.DataFrame, mode: str = "append") -> int:
        """Append `df` to `table` (created from its columns if new) or replace the table; returns rows written."""
        with self.transaction() as con:
            write_frame(con, table, df, mode)
        return len(df)

    def query(self, sql: str, params: list | tuple | None = None) -> pd.DataFrame:
        """Run a read query and return a DataFrame."""
        with self.connect(read_only=self.path.exists()) as con:
            return con.execute(sql, params or []).df()

    def tables(self) -> list[str]:
        """Names of the tables and views in the file."""
        if not self.path.exists():
            return []
        return sorted(self.query("SELECT table_name FROM information_schema.tables")["table_name"])


def write_frame(con: duckdb.DuckDBPyConnection, table: str, df: pd.DataFrame, mode: str = "append",
                before_insert: tuple[str, list] | None = None) -> None:
    """Write `df` into `table` on an open connection (use inside `Store.transaction()`); `before_insert` is a
    statement with parameters run once the table surely exists, before the rows go in."""
    if not _IDENT.match(table):
        raise CoralError(f"table name {table!r} is not a plain identifier.", "use letters, digits and underscores.")
    if mode not in ("append", "replace"):
        raise CoralError(f"write mode {mode!r} is unknown.", "use 'append' or 'replace'.")
    con.register("_coral_frame", df)
    try:
        if mode == "replace":
            con.execute(f"CREATE OR REPLACE TABLE {table} AS SELECT * FROM _coral_frame")
        else:
            con.execute(f"CREATE TABLE IF NOT EXISTS {table} AS SELECT * FROM _coral_frame LIMIT 0")
            if before_insert:
                con.execute(*before_insert)
            con.execute(f"INSERT INTO {table} BY NAME SELECT * FROM _coral_frame")
    finally:
        con.unregister("_coral_frame")


def replace_rows(con: duckdb.DuckDBPyConnection, table: str, df: pd.DataFrame, key: dict[str, object]) -> None:
    """Replace the rows of `table` whose columns equal `key` by `df` (use inside `Store.transaction()`)."""
    if not all(_IDENT.match(c) for c in key):
        raise CoralError(f"key columns {list(key)} are not plain identifiers.", "use letters, digits and underscores.")
    write_frame(con, table, df, mode="append", before_insert=(
        f"DELETE FROM {table} WHERE " + " AND ".join(f"{col} = ?" for col in key), list(key.values())))
