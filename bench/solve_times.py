"""Solve times of Coral's planner: core and extended, default and scarcity (×0.5, ×0.25; scale and fair).

A setting `A@S` (e.g. `0.25@0.2`) is the cost solve alone at availability ×A with every key's target S (no level
solves, whose time limits make the levels, and so the costs, differ run to run): the comparable figure for the
solver. S must be reachable: at most the level `A:scale` serves (core: ≈0.546 at ×0.5, ≈0.226 at ×0.25), else the
row ends with no plan. Per row: status, cost, gap to the MIP bound, `solve_s` (the solve alone), `prepare_s` (pruning and
preparation of the library, once per library), `load_s` (reading the library from DuckDB), each the median of
`--repeats` runs; per scenario the wall time of a re-plan in a fresh process (the sensor -> `replan` path:
`app.rounds.plan_round` in a new Python process, imports included). Prints a table and writes
bench/results/solve_times.json.

    python bench/solve_times.py [--scenarios core,extended] [--settings default,0.5:scale,0.5@0.5] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "results" / "solve_times.json"
SETTINGS = ("default", "0.5:scale", "0.5:fair", "0.25:scale", "0.25:fair")
TIME_LIMIT_S = {"core": 10.0, "extended": 60.0}


def _load(scn, db_path):
    """The scenario's library and the seconds reading it took (built first when the store lacks it)."""
    from coral_dagster.allocation.scenario_plans import library_templates

    library_templates(scn, db_path)  # builds and stores it once when missing
    start = time.perf_counter()
    templates = library_templates(scn, db_path)
    return templates, time.perf_counter() - start


def _prepare_s(problem) -> float:
    """Seconds preparing the scenario's templates from scratch (the in-process memo bypassed)."""
    from coral_dagster.allocation.prune import prepare_uncached

    start = time.perf_counter()
    prepare_uncached(problem.templates)
    return time.perf_counter() - start


def _row(scn, templates, setting: str, repeats: int, time_limit_s: float) -> dict:
    from coral_dagster.allocation.inputs import scenario_problem
    from coral_dagster.allocation.methods import make_plan

    scale, mode = (1.0, None) if setting == "default" else (float(setting.split(":")[0]), setting.split(":")[1])
    problem = scenario_problem(scn, templates, scn.market(availability_scale=scale))
    prepare_s = statistics.median(_prepare_s(problem) for _ in range(repeats))
    runs = []
    for _ in range(repeats):
        plan = make_plan(problem, "coral", scarcity_mode=mode, time_limit_s=time_limit_s)
        runs.append(plan)
    plan = runs[-1]
    served = plan.served_fraction()
    return {"scenario": scn.name, "setting": setting, "status": plan.status, "usd_per_hour": plan.cost_usd_per_hour,
            "mip_gap": plan.mip_gap, "gap_to_lp": plan.gap,
            "solve_s": statistics.median(p.solve_s for p in runs), "solve_s_runs": [p.solve_s for p in runs],
            "prepare_s": prepare_s, "min_served": min(served.values(), default=1.0),
            "costs": [p.cost_usd_per_hour for p in runs], "timings_s": dict(plan.timings_s)}


def _cost_row(scn, templates, setting: str, time_limit_s: float) -> dict:
    """The cost solve at fixed targets (`A@S`): status, cost, proven bound and MIP gap, LP bound, columns."""
    from coral_dagster.allocation import colgen
    from coral_dagster.allocation.inputs import scenario_problem
    from coral_dagster.allocation.prune import prune_columns

    scale, target = map(float, setting.split("@"))
    problem = scenario_problem(scn, templates, scn.market(availability_scale=scale))
    columns, _ = prune_columns(problem)
    targets = {k: target for k, d in problem.demand_tokens_per_s.items() if d > 0}
    start = time.perf_counter()
    cg = colgen.solve_min_cost(problem, columns, targets, time_limit_s=time_limit_s)
    solve_s = time.perf_counter() - start
    r = cg.result
    gap = (r.objective - r.bound) / r.objective if r.objective > 0 else 0.0
    return {"scenario": scn.name, "setting": setting, "status": r.status, "usd_per_hour": r.objective,
            "mip_gap": gap, "bound_usd_per_hour": r.bound, "lp_usd_per_hour": cg.lp_objective,
            "solve_s": solve_s, "columns": len(columns), "ilp_columns": cg.ilp_columns, "prepare_s": 0.0}


def _fresh_replan(scn_name: str, db_path: str, time_limit_s: float, repeats: int) -> dict:
    """Median wall time of `plan_round` in a new Python process (and the plan it stores) over `repeats` runs."""
    from coral_dagster.app.rounds import store_demand
    from coral_dagster.allocation.inputs import scenario_rates
    from coral_dagster.catalog.scenarios import load_scenario
    from coral_dagster.catalog.store import append_snapshot
    from coral_dagster.store import Store

    scn = load_scenario(scn_name)
    store = Store(db_path)
    append_snapshot(store, scn.market())
    store_demand(store, scn, scenario_rates(scn), "uniform")
    env = {**os.environ, "CORAL_DB": db_path}
    walls, inner = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        out = subprocess.run([sys.executable, __file__, "--child-replan", scn_name, "--time-limit-s",
                              str(time_limit_s)], env=env, check=True, capture_output=True, text=True)
        walls.append(time.perf_counter() - start)
        inner.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return {"wall_s": statistics.median(walls), "wall_s_runs": walls, "runs": inner}


def _child_replan(scn_name: str, time_limit_s: float) -> None:
    """One re-plan as the `replan` job makes it, in this (fresh) process; prints its timings as JSON."""
    start = time.perf_counter()
    from coral_dagster.app.rounds import plan_round
    from coral_dagster.catalog.scenarios import load_scenario
    from coral_dagster.store import Store

    imported = time.perf_counter()
    rnd = plan_round(Store(), load_scenario(scn_name), "coral", time_limit_s=time_limit_s)
    print(json.dumps({"import_s": imported - start, "plan_round_s": time.perf_counter() - imported,
                      "plan_id": rnd.plan_id, "status": rnd.plan.status, "usd_per_hour": rnd.plan.cost_usd_per_hour,
                      "solve_s": rnd.plan.solve_s, "timings_s": dict(rnd.plan.timings_s)}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenarios", default="core,extended")
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--time-limit-s", type=float, default=None, help="default: core 10 s, extended 60 s")
    ap.add_argument("--no-fresh", action="store_true", help="skip the fresh-process re-plan")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--child-replan", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_replan:
        _child_replan(args.child_replan, args.time_limit_s or TIME_LIMIT_S.get(args.child_replan, 30.0))
        return
    from coral_dagster.catalog.scenarios import load_scenario
    from coral_dagster.paths import default_db_path

    db_path = os.environ.get("CORAL_DB") or str(default_db_path())
    doc = {"load_avg_start": os.getloadavg(), "repeats": args.repeats, "rows": [], "fresh_replan": {}, "load_s": {}}
    for name in args.scenarios.split(","):
        scn = load_scenario(name)
        limit = args.time_limit_s or TIME_LIMIT_S.get(name, 30.0)
        settings = [s for s in args.settings.split(",") if s]
        if settings:
            loads = []
            for _ in range(args.repeats):
                templates, load_s = _load(scn, db_path)
                loads.append(load_s)
            doc["load_s"][name] = statistics.median(loads)
        for setting in settings:
            row = _cost_row(scn, templates, setting, limit) if "@" in setting else _row(
                scn, templates, setting, args.repeats, limit)
            row["load_s"] = doc["load_s"][name]
            doc["rows"].append(row)
            print(json.dumps(row), flush=True)
        if not args.no_fresh:
            doc["fresh_replan"][name] = _fresh_replan(name, db_path, limit, args.repeats)
            print(json.dumps({name: doc["fresh_replan"][name]}), flush=True)
    doc["load_avg_end"] = os.getloadavg()
    print("| scenario | setting | status | $/h | MIP gap | solve s | prepare s | load s | fresh re-plan s |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for r in doc["rows"]:
        fresh = doc["fresh_replan"].get(r["scenario"], {}).get("wall_s") if r["setting"] == "default" else None
        print(f"| {r['scenario']} | {r['setting']} | {r['status']} | {r['usd_per_hour']:,.2f} | "
              f"{r['mip_gap']:.4f} | {r['solve_s']:.2f} | {r['prepare_s']:.2f} | {r['load_s']:.2f} | "
              f"{'' if fresh is None else f'{fresh:.1f}'} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2, default=str))


if __name__ == "__main__":
    main()
