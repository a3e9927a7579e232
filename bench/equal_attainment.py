"""Cost at equal simulated SLO attainment: every method sized by the same capacity rule and closed loop.

For each scenario and method: the plan at fixed demand (rate × mean tokens × headroom, the old rule) and the plan
the burst-aware capacity rule plus the closed loop ends with; each simulated on the scenario's own traces (seeds
given), worst per-model attainment and cost side by side. Prints a table and writes bench/results/equal_attainment.json.

    python bench/equal_attainment.py [--scenarios core] [--methods coral,homo,homo-ilp,cauchy] [--seeds 0,7]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from coral_dagster.allocation.scenario_plans import library_templates, plan_scenario
from coral_dagster.app.closed_loop import closed_loop
from coral_dagster.catalog.scenarios import load_scenario
from coral_dagster.errors import CoralError
from coral_dagster.simulator.simulate import simulate_plan

OUT = Path(__file__).resolve().parent / "results" / "equal_attainment.json"


def worst(plan, scn, seeds, duration_s):
    """Worst per-model share of admitted requests meeting both SLOs over the seeds, on the scenario traces."""
    out = []
    for seed in seeds:
        res = simulate_plan(plan, scn, trace="scenario", duration_s=duration_s, seed=seed)
        out.append(float(res.by_model.admitted_attainment.min()))
    return min(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenarios", default="core")
    ap.add_argument("--methods", default="coral,homo,homo-ilp,cauchy")
    ap.add_argument("--seeds", default="0,7")
    ap.add_argument("--duration-s", type=float, default=600.0)
    ap.add_argument("--time-limit-s", type=float, default=30.0)
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = []
    for name in args.scenarios.split(","):
        scn = load_scenario(name)
        templates = library_templates(scn)
        rates = {m.model: m.rate_req_s for m in scn.models}
        for method in args.methods.split(","):
            row = {"scenario": name, "method": method}
            try:
                fixed = plan_scenario(scn, method=method, templates=templates, burst_aware=False,
                                      time_limit_s=args.time_limit_s)
                row.update(fixed_usd_per_hour=fixed.cost_usd_per_hour,
                           fixed_worst_attainment=worst(fixed, scn, seeds, args.duration_s))
                t0 = time.perf_counter()
                sized, history = closed_loop(
                    lambda boost: plan_scenario(scn, method=method, templates=templates, boost=boost,
                                                time_limit_s=args.time_limit_s), scn, rates)
                row.update(sized_usd_per_hour=sized.cost_usd_per_hour, loop_rounds=len(history),
                           loop_s=time.perf_counter() - t0, sized_status=sized.status,
                           sized_worst_attainment=worst(sized, scn, seeds, args.duration_s))
            except CoralError as exc:
                row["error"] = str(exc)[:200]
            rows.append(row)
            print(json.dumps(row), flush=True)
    for r in rows:
        coral = next((x for x in rows if x["scenario"] == r["scenario"] and x["method"] == "coral"), {})
        if "sized_usd_per_hour" in r and coral.get("sized_usd_per_hour"):
            r["x_coral_at_equal_attainment"] = r["sized_usd_per_hour"] / coral["sized_usd_per_hour"]
    header = ("scenario", "method", "fixed_usd_per_hour", "fixed_worst_attainment", "sized_usd_per_hour",
              "sized_worst_attainment", "x_coral_at_equal_attainment", "loop_rounds")
    print(" | ".join(header))
    for r in rows:
        print(" | ".join(f"{r[k]:,.3f}" if isinstance(r.get(k), float) else str(r.get(k, r.get("error", "-")))
                         for k in header))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"seeds": seeds, "duration_s": args.duration_s, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
