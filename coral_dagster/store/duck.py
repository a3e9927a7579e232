"""Transactional access to Coral's DuckDB file: bounded retries when another process holds it, older tables
migrated by adding the columns a write brings, and broken files reported as sentences naming the file and the fix."""

from __future__ import annotations

import contextlib
import logging
import re
import stat
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import duckdb
import pandas as pd

from coral_dagster.errors import CoralError, StoreFileError, StoreLockedError
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
        kind = _special_file(self.path)
        if kind:
            # Opening a FIFO would block for ever; "move it aside" would be wrong advice for a device.
            raise StoreFileError(f"{self.path} is {kind}, not a DuckDB database file.",
                                 "point CORAL_DB (or --db) at a regular file path (a new one is created).")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreFileError(f"the folder of DuckDB file {self.path} cannot be created ({exc.strerror}).",
                                 "point CORAL_DB (or --db) at a file in a folder you can write.") from None
        deadline, delay = time.monotonic() + self.lock_timeout_s, 0.05
        while True:
            try:
                con = duckdb.connect(str(self.path), read_only=read_only, config=NO_EXTENSION_LOADING)
                break
            except duckdb.Error as exc:
                if not (isinstance(exc, duckdb.IOException) and "lock" in str(exc).lower()):
                    raise explain(exc, self.path) from None
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
        except duckdb.Error as exc:
            raise explain(exc, self.path) from exc
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
                with contextlib.suppress(duckdb.Error):  # a broken file may refuse even this; the first error counts
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

    def columns(self, table: str) -> list[str]:
        """Column names of `table`, in order; empty when the file or the table does not exist."""
        if not self.path.exists():
            return []
        return self.query("SELECT column_name FROM information_schema.columns WHERE table_name = ? "
                          "ORDER BY ordinal_position", [table])["column_name"].tolist()


# A file of another database (SQLite) makes DuckDB reach for the extension that reads it, downloading it from the
# network if allowed; a store never needs one (duckdb.org/docs/stable/configuration/overview: these two settings).
NO_EXTENSION_LOADING: dict[str, str | bool | int | float | list[str]] = {"autoload_known_extensions": False,
                                                                        "autoinstall_known_extensions": False}

def _special_file(path: Path) -> str:
    """What `path` is when it exists and is neither a regular file nor a folder (a device, a FIFO, a socket)."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return ""
    for test, kind in ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return ""


_BROKEN_FIX = ("move it aside (`mv {path} {path}.broken`) and run `coral run` (or the command again) to start a "
               "fresh file, or point CORAL_DB (or --db) at another file; restore it from a backup if its plan "
               "history matters.")


def explain(exc: duckdb.Error, path: Path) -> CoralError:
    """A DuckDB error as a sentence naming the file and the fix (errors of no known kind keep DuckDB's text)."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    low = text.lower()
    if "not a valid duckdb database file" in low:
        return StoreFileError(f"{path} is not a DuckDB database file (empty, truncated at its header, or another "
                              "kind of file).", _BROKEN_FIX.format(path=path))
    if "extension" in low and ("sqlite" in low or "postgres" in low or "mysql" in low):
        kind = next(k for k in ("SQLite", "PostgreSQL", "MySQL") if k[:5].lower() in low)
        return StoreFileError(f"{path} is a {kind} database (or another program's file), not a DuckDB "
                              "database file.", _BROKEN_FIX.format(path=path))
    if "could not read enough bytes" in low:
        return StoreFileError(f"DuckDB file {path} is truncated ({text}).", _BROKEN_FIX.format(path=path))
    if "corrupt database file" in low or "checksum" in low:
        return StoreFileError(f"DuckDB file {path} is corrupted ({text}).", _BROKEN_FIX.format(path=path))
    if "no space left on device" in low or "disk quota exceeded" in low:
        return StoreFileError(f"the disk holding DuckDB file {path} is full ({text}).",
                              "free space on that disk and run the command again, or point CORAL_DB (or --db) at a "
                              "file on another disk.")
    if "permission denied" in low or "read-only file system" in low or "read-only mode" in low:
        return StoreFileError(f"DuckDB file {path} cannot be written ({text}).",
                              f"make it writable (`chmod u+w {path}` and its folder), or point CORAL_DB (or --db) "
                              "at a file you can write.")
    if "is a directory" in low:
        return StoreFileError(f"{path} is a folder, not a DuckDB file.", "point CORAL_DB (or --db) at a file path.")
    if isinstance(exc, duckdb.SerializationException) or "version" in low and ("database file" in low
                                                                                or "storage" in low):
        return StoreFileError(f"DuckDB file {path} was written by another DuckDB version ({text}).",
                              f"open it with that version and `EXPORT DATABASE`, then `IMPORT DATABASE` with "
                              f"duckdb {duckdb.__version__}; or {_BROKEN_FIX.format(path=path)}")
    if isinstance(exc, duckdb.BinderException) and ("column" in low and ("not found" in low or "does not have" in low)):
        return StoreFileError(f"DuckDB file {path} holds a table of an older schema ({text}).",
                              "Coral adds missing columns when it writes a table: rerun the command that writes it "
                              f"(`coral run` writes all), or {_BROKEN_FIX.format(path=path)}")
    return StoreFileError(f"DuckDB file {path} refused a statement ({text}).",
                          "if the file was changed by hand or by another program, "
                          f"{_BROKEN_FIX.format(path=path)} Otherwise report this message as a bug.")


def newest_snapshot(store: Store, table: str, id_column: str, scenario, what: str, fix: str) -> pd.DataFrame:
    """The rows of the newest snapshot (by `taken_at`) that `table` holds for a scenario's `scenario_key`; raises
    naming `what` and `fix` when the table is missing, older than keys, or holds none of the scenario's."""
    if table not in store.tables():
        raise CoralError(f"no {what} is stored in {store.path}.", fix)
    if "scenario_key" not in store.columns(table):
        raise CoralError(f"the {what}s in {store.path} were stored before snapshots were keyed by scenario contents.",
                         fix)
    df = store.query(f"""SELECT * FROM {table} WHERE {id_column} = (
                           SELECT {id_column} FROM {table} WHERE scenario_key = ?
                           ORDER BY taken_at DESC, {id_column} DESC LIMIT 1)""", [scenario.scenario_key])
    if df.empty:
        raise CoralError(f"no {what} of scenario {scenario.ref} is stored in {store.path}.", fix)
    return df


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
        columns = _frame_columns(con)
        ddl = ", ".join(f'"{name}" {sql_type}' for name, sql_type in columns)
        if mode == "replace":
            con.execute(f"CREATE OR REPLACE TABLE {table} ({ddl})")
        else:
            con.execute(f"CREATE TABLE IF NOT EXISTS {table} ({ddl})")
            _add_missing_columns(con, table, columns)
            if before_insert:
                con.execute(*before_insert)
        con.execute(f"INSERT INTO {table} BY NAME SELECT * FROM _coral_frame")
    finally:
        # After a failed statement the transaction is aborted and DuckDB refuses even this; the first error counts.
        with contextlib.suppress(duckdb.TransactionException):
            con.unregister("_coral_frame")


def _frame_columns(con: duckdb.DuckDBPyConnection) -> list[tuple[str, str]]:
    """(name, SQL type) of `_coral_frame`; a column with no value to type it (an empty frame's text) is VARCHAR,
    so a table first written empty still takes rows later."""
    return [(name, "VARCHAR" if sql_type.strip('"') == "NULL" else sql_type)
            for name, sql_type, *_ in con.execute("DESCRIBE SELECT * FROM _coral_frame").fetchall()]


def _add_missing_columns(con: duckdb.DuckDBPyConnection, table: str, columns: list[tuple[str, str]]) -> None:
    """Migrate a table of an older schema: add (as NULL in old rows) the columns of the frame it lacks."""
    have = {r[0] for r in con.execute("SELECT column_name FROM information_schema.columns WHERE table_name = ?",
                                      [table]).fetchall()}
    for name, sql_type in columns:
        if name not in have:
            log.info("migrating %s: adding column %s %s", table, name, sql_type)
            con.execute(f'ALTER TABLE {table} ADD COLUMN "{name}" {sql_type}')


def replace_rows(con: duckdb.DuckDBPyConnection, table: str, df: pd.DataFrame, key: dict[str, object]) -> None:
    """Replace the rows of `table` whose columns equal `key` by `df` (use inside `Store.transaction()`)."""
    if not all(_IDENT.match(c) for c in key):
        raise CoralError(f"key columns {list(key)} are not plain identifiers.", "use letters, digits and underscores.")
    write_frame(con, table, df, mode="append", before_insert=(
        f"DELETE FROM {table} WHERE " + " AND ".join(f"{col} = ?" for col in key), list(key.values())))
