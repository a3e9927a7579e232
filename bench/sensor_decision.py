"""The reallocation sensor's decision at tripled demand: decided from the running plan alone (now) against solving
the savings estimate's candidate plan first (before), side by side on one copy of the store.

Run: `python -m bench.sensor_decision [--scenario core] [--factor 3] [--repeats 3] [--db data/coral.duckdb]`; the
store must hold the scenario's template library (`coral templates build --scenario core`). Writes
bench/results/sensor_decision.json and prints a table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench._results import write_result
from coral_dagster import paths
from coral_dagster.allocation.inputs import scenario_problem
from coral_dagster.allocation.methods import make_plan
from coral_dagster.app.plans import find_plan
from coral_dagster.app.rounds import latest_demand, plan_round, store_demand
from coral_dagster.catalog.scenarios import load_scenario
from coral_dagster.catalog.store import append_snapshot, latest_snapshot
from coral_dagster.errors import CoralError
from coral_dagster.reallocation import ESTIMATE_MAX_NODES, evaluate
from coral_dagster.store import Store
from coral_dagster.templates.library import load_library

SENSOR_TIME_LIMIT_S = 20.0
console = Console(width=120)


def _candidate_s(store: Store, name: str) -> tuple[float, str]:
    """Seconds of the savings estimate's solve (what the sensor did first before), and how it ended."""
    scn = load_scenario(name)
    start = time.perf_counter()
    _, rates = latest_demand(store, scn)
    problem = scenario_problem(scn, load_library(store, scn), latest_snapshot(store, scn), rates=rates,
                               running=find_plan(store, scn).counts())
    try:
        plan = make_plan(problem, "coral", time_limit_s=SENSOR_TIME_LIMIT_S, max_nodes=ESTIMATE_MAX_NODES)
        outcome = f"{plan.cost_usd_per_hour:.2f} $/h"
    except CoralError as exc:
        outcome = f"failed: {exc.problem[:60]}"
    return time.perf_counter() - start, outcome


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", default="core")
    ap.add_argument("--factor", type=float, default=3.0, help="demand multiple after the plan is made")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--db", type=Path, default=paths.REPO_ROOT / "data" / "coral.duckdb")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "sensor.duckdb"
        shutil.copy(args.db, db)
        store, scn = Store(db), load_scenario(args.scenario)
        append_snapshot(store, scn.market())
        store_demand(store, scn, {m.model: m.rate_req_s for m in scn.models}, "uniform")
        plan_round(store, scn, "coral", time_limit_s=30.0)
        store_demand(store, scn, {m.model: args.factor * m.rate_req_s for m in scn.models}, "uniform")
        rows = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            _, decision = evaluate(store, args.scenario, time_limit_s=SENSOR_TIME_LIMIT_S)
            now_s = time.perf_counter() - start
            solve_s, outcome = _candidate_s(store, args.scenario)
            rows.append({"now_s": now_s, "before_s": now_s + solve_s, "replan": decision.replan,
                         "reasons": list(decision.reasons), "candidate": outcome})
    now, before = statistics.median(r["now_s"] for r in rows), statistics.median(r["before_s"] for r in rows)
    doc = {"scenario": args.scenario, "demand_factor": args.factor, "repeats": rows, "median_now_s": now,
           "median_before_s": before, "ratio": before / now, "loadavg_1min": os.getloadavg()[0],
           "note": "before = today's decision plus the candidate solve the sensor made first until 6aec4eb"}
    table = Table(title=f"Sensor decision, {args.scenario} at {args.factor:g}x demand (median of {args.repeats})")
    for col in ("decided from the plan (s)", "candidate solved first (s)", "ratio", "re-plan", "candidate"):
        table.add_column(col, justify="right")
    table.add_row(f"{now:.2f}", f"{before:.2f}", f"{before / now:.0f}x", str(rows[0]["replan"]), rows[0]["candidate"])
    console.print(table)
    console.print(f"wrote {write_result('sensor_decision', doc)}")


if __name__ == "__main__":
    main()
