"""The "mega" scenario at scale: library build time, online solve time and peak memory (issue 16 item 4).

Builds the template library of `data/scenarios/mega.yaml` (or a slice of it: fewer models, a smaller n_max),
plans once with Coral at the default availability, and prints one JSON line; writes bench/results/mega.json.

    python bench/mega.py [--models phi-4,gpt-oss-20b] [--n-max 6] [--time-limit-s 60]
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="", help="comma-separated slice of the scenario's models (default: all)")
    ap.add_argument("--n-max", type=int, default=None, help="nodes per template (default: the scenario's)")
    ap.add_argument("--time-limit-s", type=float, default=60.0)
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    from coral_dagster.allocation.inputs import scenario_problem
    from coral_dagster.allocation.methods import make_plan
    from coral_dagster.catalog.scenarios import load_scenario
    from coral_dagster.templates.library import build_library

    scn = load_scenario("mega")
    if args.models:
        keep = set(args.models.split(","))
        scn = replace(scn, models=tuple(m for m in scn.models if m.model in keep))
    if args.n_max:
        scn = replace(scn, n_max=args.n_max)
    market = scn.market()
    start = time.perf_counter()
    templates = tuple(build_library(scn))
    build_s = time.perf_counter() - start
    problem = scenario_problem(scn, templates, market)
    plan = make_plan(problem, "coral", time_limit_s=args.time_limit_s)
    row = {"load_avg": os.getloadavg(), "models": [m.model for m in scn.models], "n_max": scn.n_max,
           "regions": len(scn.regions), "offers": len(market.offers), "templates": len(templates),
           "library_build_s": build_s, "status": plan.status, "usd_per_hour": plan.cost_usd_per_hour,
           "mip_gap": plan.mip_gap, "solve_s": plan.solve_s, "prune_s": plan.timings_s.get("prune_s"),
           "columns": (plan.pruning or {}).get("columns_after"),
           "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    print(json.dumps(row))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(row, indent=2))


if __name__ == "__main__":
    main()
