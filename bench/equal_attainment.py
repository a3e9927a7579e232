"""Cost at equal simulated SLO attainment: every method sized by the same capacity rule and closed loop.

For each scenario and method: the plan at fixed demand (rate × mean tokens × headroom, the old rule) and the plan
the burst-aware capacity rule plus the closed loop (worst 600-s window of every trace loop, seed 0) ends with; each
evaluated on held-out windows of the scenario's own traces (one per seed, seeds the loop does not use), worst
per-model attainment and cost side by side. A method that cannot serve the sized demand within availability is
shown at what it reaches (uniformly scaled, with admission) and, labelled, with availability relaxed ×N until its
closed loop plans. `--mixes` repeats it under imbalanced demand (coral.md §6: 80% of the requests to the largest
or the smallest third of the models, total kept), rows labelled `scenario:mix`. Prints a table and writes
bench/results/equal_attainment.json.

    python -m bench.equal_attainment [--scenarios core,extended] [--methods coral,homo,homo-ilp,cauchy]
        [--mixes uniform,large-heavy,small-heavy] [--seeds 11,12,13,14] [--duration-s 600] [--relax 2,4]
"""

from __future__ import annotations

from bench._args import RESULTS, bench_parser, names, report, seeds_and_libraries
from coral_dagster.allocation.demand import DEMAND_MIXES
from coral_dagster.allocation.inputs import mixed_scenario
from coral_dagster.app.equal_attainment import HEADER, row_for, with_ratios
from coral_dagster.errors import UnknownNameError

def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--relax", default="2,4", help="availability multiples tried when a method cannot plan at ×1")
    ap.add_argument("--mixes", default="uniform", help=f"comma-separated demand mixes of {', '.join(DEMAND_MIXES)}")
    args = ap.parse_args()
    mixes = names(args.mixes)
    for mix in mixes:
        if mix not in DEMAND_MIXES:
            raise UnknownNameError("demand mix", mix, DEMAND_MIXES)
    seeds, libraries = seeds_and_libraries(args)
    rows = []
    for scn, templates in libraries:
        for mix in mixes:
            mixed = mixed_scenario(scn, mix)
            for method in names(args.methods):
                rows.append(row_for(mixed, method, templates, args, seeds,
                                    label=scn.name if mix == "uniform" else f"{scn.name}:{mix}"))
                print(rows[-1], flush=True)
    report(with_ratios(rows), HEADER, args.out or RESULTS / "equal_attainment.json",
           {"seeds": seeds, "duration_s": args.duration_s, "time_limit_s": args.time_limit_s, "mixes": mixes})


if __name__ == "__main__":
    main()
