"""The paper's scarcity experiment: availability below demand, every method plans what it can serve, goodput simulated
with admission control.

For each scenario, availability level and mode (uniform `scale`, max-min `fair`), every method plans what it can
serve; the router admits per model only the request rate the plan serves and sheds the rest (429); the plan is
simulated on the scenario's own traces (one window per seed). Goodput is tokens/s of requests meeting both SLOs;
"fluid" is what the plan promises: each model's served share of its requests (`fluid_goodput`) times the tokens/s
the simulation offered of it. The admission bucket holds each model's trace bursts (`admit_depth_req`); with
`--ablate-depth` the same plan is also simulated with a bucket of 10 s of its rate (`*_10s_bucket` columns). The
ratios Coral/Cauchy and Coral/Homo are of simulated goodput (paper, extended: 2.39× and 7.64×). `--windows`
replays the scenario's availability series (data/scenarios/MARKET.md §5): each level is applied to each window's
counts (`all`: every window). Prints a table and writes bench/results/scarcity_goodput.json.

    python -m bench.scarcity_goodput [--scenarios core,extended] [--levels 0.5,0.25,0.15] [--modes scale,fair]
        [--methods coral,homo,homo-ilp,cauchy] [--seeds 11,12] [--duration-s 300] [--ablate-depth] [--windows 0]
"""

from __future__ import annotations

import time
from dataclasses import replace

from bench._args import RESULTS, bench_parser, names, report, seeds_and_libraries
from coral_dagster.app.equal_attainment import evaluate
from coral_dagster.allocation.goodput import fluid_goodput
from coral_dagster.app.scenario_plans import plan_scenario
from coral_dagster.errors import CoralError


def row_for(scn, templates, level, mode, method, args, seeds, window: int = 0) -> dict:
    """One method's plan at one availability level, window of the series and mode, simulated with shedding."""
    row = {"scenario": scn.name, "window": window, "availability_scale": level, "mode": mode, "method": method}
    t0 = time.perf_counter()
    try:
        plan = plan_scenario(scn, method=method, scarcity=mode, templates=templates, time_limit_s=args.time_limit_s,
                             market=scn.market(availability_scale=level, window=window))
    except CoralError as exc:
        return {**row, "error": str(exc)[:160], "plan_s": time.perf_counter() - t0}
    row.update(status=plan.status, plan_s=time.perf_counter() - t0, usd_per_hour=plan.cost_usd_per_hour,
               notes=list(plan.notes))
    fluid = fluid_goodput(plan)
    ev = evaluate(plan, scn, seeds, args.duration_s)
    promised = sum(sum(fluid.per_model.get(m, 0.0) * v for m, v in r["offered_tokens_per_s"].items())
                   for r in ev["runs"]) / len(ev["runs"])
    row.update(served_share={m: round(f, 4) for m, f in fluid.per_model.items()},
               fluid_goodput_tokens_per_s=promised, simulated_goodput_tokens_per_s=ev["goodput_tokens_per_s"],
               simulated_over_fluid=ev["goodput_tokens_per_s"] / promised if promised else None,
               shed=sum(r["shed"] for r in ev["runs"]), arrivals=sum(r["arrivals"] for r in ev["runs"]),
               worst_admitted_attainment=ev["worst_attainment"])
    if args.ablate_depth and plan.admission.admit_depth_req:
        unbuffered = replace(plan.admission, admit_depth_req={}, admit_peak={})
        old = evaluate(replace(plan, admission=unbuffered), scn, seeds, args.duration_s)
        row.update(simulated_over_fluid_10s_bucket=old["goodput_tokens_per_s"] / promised if promised else None,
                   shed_10s_bucket=sum(r["shed"] for r in old["runs"]),
                   worst_admitted_attainment_10s_bucket=old["worst_attainment"])
    return row


def main() -> None:
    ap = bench_parser(__doc__, duration_s=300.0)
    ap.add_argument("--levels", default="0.5,0.25,0.15", help="availability multiples below demand")
    ap.add_argument("--modes", default="scale,fair", help="scarcity modes: uniform scale, max-min fair")
    ap.add_argument("--ablate-depth", action="store_true",
                    help="also simulate each plan with a bucket of 10 s of its rate instead of its trace's bursts")
    ap.add_argument("--windows", default="0", help="windows of the scenario's availability series, or all")
    ap.set_defaults(seeds="11,12")
    args = ap.parse_args()
    seeds, libraries = seeds_and_libraries(args)
    rows = []
    for scn, templates in libraries:
        windows = range(scn.availability_model.windows) if args.windows == "all" else map(int, names(args.windows))
        for window in windows:
            for level in (float(x) for x in names(args.levels)):
                for mode in names(args.modes):
                    for method in names(args.methods):
                        rows.append(row_for(scn, templates, level, mode, method, args, seeds, window))
                        print({k: v for k, v in rows[-1].items() if k != "notes"}, flush=True)
    for r in rows:
        key = ("scenario", "window", "availability_scale", "mode")
        same = [x for x in rows if all(x[k] == r[k] for k in key)]
        coral = next((x for x in same if x["method"] == "coral"), {})
        if r.get("simulated_goodput_tokens_per_s") and coral.get("simulated_goodput_tokens_per_s"):
            r["coral_over_method"] = coral["simulated_goodput_tokens_per_s"] / r["simulated_goodput_tokens_per_s"]
    header = ("scenario", "window", "availability_scale", "mode", "method", "status", "usd_per_hour", "plan_s",
              "fluid_goodput_tokens_per_s", "simulated_goodput_tokens_per_s", "simulated_over_fluid",
              "coral_over_method", "shed", "arrivals", "worst_admitted_attainment", "simulated_over_fluid_10s_bucket",
              "shed_10s_bucket", "worst_admitted_attainment_10s_bucket")
    report(rows, header, args.out or RESULTS / "scarcity_goodput.json",
           {"seeds": seeds, "duration_s": args.duration_s, "time_limit_s": args.time_limit_s})


if __name__ == "__main__":
    main()
