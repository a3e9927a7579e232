"""Which `slo_margin` a scenario should plan at: cost at equal simulated attainment for each margin tried.

The margin splits each SLO between the templates (every stage step planned within margin × its budget) and the
capacity rule (bursts queue in the (1 − margin) slack). A larger margin buys more throughput per node and a larger
burst factor; a smaller one the reverse. For each scenario and margin: every model's margin set to it, the template
library built (stored in the DuckDB under its own library key), and for each method (default Coral only) its
closed loop sized on the scenario traces (seed 0) and the plan evaluated on held-out windows (seeds the loop does
not use). The margin a scenario file sets is justified when its cost is the least among the margins whose plan
meets the target. Prints a table and writes bench/results/slo_margin.json.

    python -m bench.slo_margin [--scenarios core] [--margins 0.6,0.75,0.9] [--methods coral] [--seeds 11,12]
        [--no-loop]
"""

from __future__ import annotations

import time
from dataclasses import replace

from bench._args import RESULTS, bench_parser, names, report
from coral_dagster.app.equal_attainment import evaluate, sized
from coral_dagster.app.scenario_plans import library_templates, plan_scenario
from coral_dagster.catalog.scenarios import load_scenario
from coral_dagster.errors import CoralError


def at_margin(scn, margin: float):
    """The scenario with every model planned at `margin`."""
    return replace(scn, models=tuple(replace(m, slo_margin=margin) for m in scn.models))


def row_for(scn, margin: float, method: str, library: tuple, args, seeds) -> dict:
    """One method on one scenario at one margin: library size and build time, the sized plan, its held-out
    attainment. `library`: the margin's templates and the seconds they took to load or build."""
    templates, library_s = library
    row = {"scenario": scn.name, "margin": margin, "method": method,
           "file_margin": sorted({m.slo_margin for m in scn.models}), "templates": len(templates),
           "library_s": library_s}
    try:
        if args.no_loop:
            t0 = time.perf_counter()
            plan = plan_scenario(at_margin(scn, margin), method=method, templates=templates,
                                 time_limit_s=args.time_limit_s)
            rounds, loop_s = [], time.perf_counter() - t0
        else:
            plan, rounds, loop_s = sized(at_margin(scn, margin), method, templates, args.time_limit_s)
    except CoralError as exc:
        row["error"] = str(exc)[:160]
        return row
    ev = evaluate(plan, at_margin(scn, margin), seeds, args.duration_s)
    row.update(status=plan.status, usd_per_hour=plan.cost_usd_per_hour, mip_gap=plan.mip_gap,
               loop_rounds=len(rounds), loop_s=loop_s,
               loop_worst_window=min(plan.expected_attainment.values()) if rounds else None,
               worst_attainment=ev["worst_attainment"], per_seed=[r["worst_attainment"] for r in ev["runs"]])
    return row


def main() -> None:
    ap = bench_parser(__doc__, scenarios="core", methods="coral")
    ap.add_argument("--margins", default="0.6,0.75,0.9", help="comma-separated margins in (0, 1]")
    ap.add_argument("--no-loop", action="store_true",
                    help="plan once at the capacity rule's sizing, no closed loop (its whole-trace simulations are "
                         "what a scenario of many models cannot afford); the held-out evaluation alone judges it")
    args = ap.parse_args()
    seeds = [int(s) for s in names(args.seeds)]
    rows = []
    for name in names(args.scenarios):
        scn = load_scenario(name)
        for margin in (float(x) for x in names(args.margins)):
            t0 = time.perf_counter()
            library = (library_templates(at_margin(scn, margin)), time.perf_counter() - t0)
            for method in names(args.methods):
                rows.append(row_for(scn, margin, method, library, args, seeds))
                print(rows[-1], flush=True)
    header = ("scenario", "margin", "method", "file_margin", "templates", "library_s", "status", "usd_per_hour",
              "mip_gap", "loop_rounds", "loop_worst_window", "worst_attainment")
    report(rows, header, args.out or RESULTS / "slo_margin.json",
           {"seeds": seeds, "duration_s": args.duration_s, "time_limit_s": args.time_limit_s})


if __name__ == "__main__":
    main()
