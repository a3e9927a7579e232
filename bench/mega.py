"""The "mega" scenario at scale: library build or load, online solve time, gap and peak memory (issue 16 item 4).

Reads the library of `data/scenarios/mega.yaml` (or of a slice: fewer models, another n_max) from the DuckDB file
(`--db`, else `CORAL_DB`), building and storing it first when none is stored (build it apart, and timed, with
`coral templates build --scenario mega`); plans once with Coral at the default availability; prints a table and
writes bench/results/mega.json.

    python bench/mega.py [--models phi-4,phi-4-support] [--n-max 3] [--time-limit-s 60] [--scarcity fair]
                         [--fixed-demand] [--out bench/results/mega.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from dataclasses import replace
from pathlib import Path

OUT = Path(__file__).resolve().parent / "results" / "mega.json"


def _rss_mib() -> float:
    """Resident memory of this process now (VmRSS), MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="", help="comma-separated slice of the scenario's models (default: all)")
    ap.add_argument("--n-max", type=int, default=None, help="nodes per template (default: the scenario's)")
    ap.add_argument("--time-limit-s", type=float, default=60.0)
    ap.add_argument("--scarcity", choices=("scale", "fair"), default=None,
                    help="plan under scarcity in this mode (default: demand must be met)")
    ap.add_argument("--fixed-demand", action="store_true",
                    help="demand = rate x mean tokens x headroom (the paper's), not the burst-sized capacity rule")
    ap.add_argument("--db", default=None, help="DuckDB file (default: CORAL_DB, else data/coral.duckdb)")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    from coral_dagster.allocation.inputs import scenario_problem
    from coral_dagster.allocation.methods import make_plan
    from coral_dagster.catalog.scenarios import load_scenario
    from coral_dagster.store import Store
    from coral_dagster.templates.library import build_library_with_stats, load_library, store_library

    load_start = os.getloadavg()
    scn = load_scenario("mega")
    if args.models:
        keep = set(args.models.split(","))
        scn = replace(scn, models=tuple(m for m in scn.models if m.model in keep))
    if args.n_max:
        scn = replace(scn, n_max=args.n_max)
    market = scn.market()
    store = Store(args.db)
    start = time.perf_counter()
    templates = tuple(load_library(store, scn))
    load_s, build_s = time.perf_counter() - start, None
    if not templates:
        start = time.perf_counter()
        built, _ = build_library_with_stats(scn)
        store_library(store, built, scn)
        templates, build_s, load_s = tuple(built), time.perf_counter() - start, None
    rss_library_mib = _rss_mib()
    start = time.perf_counter()
    problem = scenario_problem(scn, templates, market, burst_aware=not args.fixed_demand)
    problem_s = time.perf_counter() - start
    plan = make_plan(problem, "coral", scarcity_mode=args.scarcity, time_limit_s=args.time_limit_s)
    served = plan.served_fraction()
    row = {"load_avg_start": load_start, "load_avg_end": os.getloadavg(), "cpus": os.cpu_count(),
           "models": len(scn.models), "bases": len({m.base for m in scn.models}),
           "template_keys": len({m.template_key for m in scn.models}), "n_max": scn.n_max,
           "regions": len(scn.regions), "node_configs": len(scn.node_configs), "offers": len(market.offers),
           "templates": len(templates), "library_load_s": load_s, "library_build_s": build_s,
           "problem_s": problem_s, "prune_s": plan.timings_s.get("prune_s"), "solve_s": plan.solve_s,
           "columns": (plan.pruning or {}).get("columns_after"), "status": plan.status,
           "usd_per_hour": plan.cost_usd_per_hour, "lp_bound_usd_per_hour": plan.lp_bound_usd_per_hour,
           "mip_gap": plan.mip_gap, "min_served_fraction": min(served.values()) if served else None,
           "instances": sum(i.count for i in plan.instances), "scarcity": args.scarcity,
           "demand": "fixed" if args.fixed_demand else "burst-sized",
           "rss_with_library_mib": rss_library_mib,
           "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
           "peak_rss_children_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
           "timings_s": dict(plan.timings_s)}
    for key, value in row.items():
        print(f"{key:24} {value}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(row, indent=2))


if __name__ == "__main__":
    main()
