"""The deployment as recorded in DuckDB: one row per cluster, an event history and one row per reconcile run."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Iterable, Literal

import duckdb
import pandas as pd

from coral_dagster.deploy.spec import CPU_ROLES, NodeSpec
from coral_dagster.store import Store

NodeStatus = Literal["pending", "launched", "draining", "down", "failed"]
# pending: launch decided, not confirmed; draining: removal decided, not yet down. Both resume on the next run.
ACTIVE: tuple[NodeStatus, ...] = ("pending", "launched")
SETTLED: tuple[NodeStatus, ...] = ("down", "failed")

NODE_COLUMNS = ("cluster_name", "role", "slot", "instance_id", "plan_id", "region", "model", "phase",
                "template_id", "replica", "instance_index", "stage", "node_index", "node", "instance_type",
                "use_spot", "usd_per_hour", "address", "status", "message", "run_id", "updated_at")

SCHEMA = (
    """CREATE TABLE IF NOT EXISTS deployment_nodes (
        cluster_name VARCHAR PRIMARY KEY, role VARCHAR NOT NULL, slot VARCHAR NOT NULL,
        instance_id VARCHAR NOT NULL, plan_id VARCHAR NOT NULL, region VARCHAR NOT NULL, model VARCHAR,
        phase VARCHAR, template_id VARCHAR, replica INTEGER, instance_index INTEGER, stage INTEGER,
        node_index INTEGER, node VARCHAR, instance_type VARCHAR, use_spot BOOLEAN, usd_per_hour DOUBLE,
        address VARCHAR, status VARCHAR NOT NULL, message VARCHAR, run_id VARCHAR, updated_at TIMESTAMP)""",
    """CREATE TABLE IF NOT EXISTS deployment_events (
        run_id VARCHAR, at_time TIMESTAMP, cluster_name VARCHAR, instance_id VARCHAR, action VARCHAR,
        status VARCHAR, message VARCHAR)""",
    """CREATE TABLE IF NOT EXISTS deployments (
        run_id VARCHAR PRIMARY KEY, plan_id VARCHAR, started_at TIMESTAMP, finished_at TIMESTAMP,
        status VARCHAR, launched INTEGER, failed INTEGER, drained INTEGER, downed INTEGER, kept INTEGER,
        message VARCHAR)""",
)


def now_utc() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None)


def ensure_tables(con: duckdb.DuckDBPyConnection) -> None:
    for sql in SCHEMA:
        con.execute(sql)


def _has(store: Store, table: str) -> bool:
    return table in store.tables()


def read_nodes(store: Store) -> pd.DataFrame:
    """Every recorded cluster (empty frame with the columns when nothing was ever deployed)."""
    if not _has(store, "deployment_nodes"):
        return pd.DataFrame(columns=list(NODE_COLUMNS))
    return store.query(f"SELECT {', '.join(NODE_COLUMNS)} FROM deployment_nodes ORDER BY cluster_name")


def read_events(store: Store) -> pd.DataFrame:
    if not _has(store, "deployment_events"):
        return pd.DataFrame(columns=["run_id", "at_time", "cluster_name", "instance_id", "action", "status", "message"])
    return store.query("SELECT * FROM deployment_events ORDER BY at_time, cluster_name")


def read_runs(store: Store) -> pd.DataFrame:
    if not _has(store, "deployments"):
        return pd.DataFrame(columns=["run_id", "plan_id", "started_at", "finished_at", "status", "launched",
                                     "failed", "drained", "downed", "kept", "message"])
    return store.query("SELECT * FROM deployments ORDER BY started_at, run_id")


def record_nodes(con: duckdb.DuckDBPyConnection, nodes: Iterable[NodeSpec], status: NodeStatus, run_id: str,
                 message: str = "") -> None:
    """Insert (or overwrite) one row per node with `status`."""
    at = now_utc()
    for n in nodes:
        con.execute(
            f"INSERT OR REPLACE INTO deployment_nodes ({', '.join(NODE_COLUMNS)}) VALUES "
            f"({', '.join('?' * len(NODE_COLUMNS))})",
            [n.cluster_name, n.role, n.slot, n.instance_id, n.plan_id, n.region, n.model, n.phase,
             n.template_id, n.replica, n.instance_index, n.stage, n.node_index, n.node, n.instance_type,
             n.use_spot, n.usd_per_hour, None, status, message, run_id, at])
        add_event(con, run_id, n.cluster_name, n.instance_id, "plan", status, message)


def set_status(con: duckdb.DuckDBPyConnection, cluster_name: str, status: NodeStatus, run_id: str, action: str,
               message: str = "", address: str | None = None) -> None:
    """Move one cluster to `status` and log the action that did it."""
    con.execute(
        "UPDATE deployment_nodes SET status = ?, message = ?, run_id = ?, updated_at = ?, "
        "address = coalesce(?, address) WHERE cluster_name = ?",
        [status, message, run_id, now_utc(), address, cluster_name])
    instance_id = con.execute("SELECT instance_id FROM deployment_nodes WHERE cluster_name = ?",
                              [cluster_name]).fetchone()
    add_event(con, run_id, cluster_name, instance_id[0] if instance_id else "", action, status, message)


def add_event(con: duckdb.DuckDBPyConnection, run_id: str, cluster_name: str, instance_id: str, action: str,
              status: str, message: str = "") -> None:
    con.execute("INSERT INTO deployment_events VALUES (?, ?, ?, ?, ?, ?, ?)",
                [run_id, now_utc(), cluster_name, instance_id, action, status, message])


def start_run(con: duckdb.DuckDBPyConnection, run_id: str, plan_id: str) -> None:
    """Open a run; runs a crash left open are marked interrupted (their nodes resume from their status)."""
    con.execute("UPDATE deployments SET status = 'interrupted', finished_at = ? WHERE status = 'running'",
                [now_utc()])
    con.execute("INSERT INTO deployments VALUES (?, ?, ?, NULL, 'running', 0, 0, 0, 0, 0, '')",
                [run_id, plan_id, now_utc()])


def finish_run(con: duckdb.DuckDBPyConnection, run_id: str, status: str, *, launched: int, failed: int,
               drained: int, downed: int, kept: int, message: str = "") -> None:
    con.execute("UPDATE deployments SET finished_at = ?, status = ?, launched = ?, failed = ?, drained = ?, "
                "downed = ?, kept = ?, message = ? WHERE run_id = ?",
                [now_utc(), status, launched, failed, drained, downed, kept, message, run_id])


def summarize(nodes: pd.DataFrame, runs: pd.DataFrame) -> dict:
    """The deployment at a glance: live plan(s), node counts by status and role, $/h of the GPU nodes up and the
    clusters up without a price (the CPU VMs of the coordinators and the endpoint)."""
    live = nodes[nodes.status.isin([*ACTIVE, "draining"])]
    up = nodes[nodes.status == "launched"]
    last = runs.iloc[-1] if len(runs) else None
    return {
        "plans": sorted(set(live.plan_id)),
        "instances": int(live[~live.role.isin(CPU_ROLES)].instance_id.nunique()),
        "nodes_by_status": {str(k): int(v) for k, v in nodes.status.value_counts().sort_index().items()},
        "live_nodes_by_role": {str(k): int(v) for k, v in live.role.value_counts().sort_index().items()},
        "gpu_usd_per_hour": float(up[~up.role.isin(CPU_ROLES)].usd_per_hour.sum()),
        "unpriced_clusters": sorted(up[up.usd_per_hour.isna()].cluster_name),
        "last_run": None if last is None else {
            "run_id": str(last.run_id), "plan_id": str(last.plan_id), "status": str(last.status),
            "started_at": str(last.started_at), "finished_at": str(last.finished_at),
            "launched": int(last.launched), "failed": int(last.failed), "drained": int(last.drained),
            "downed": int(last.downed), "kept": int(last.kept)},
    }
