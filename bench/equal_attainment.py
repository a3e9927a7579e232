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

from bench._args import bench_parser, cell, names, seeds_and_libraries
from bench._results import write_result
from coral_dagster.allocation.demand import DEMAND_MIXES
from coral_dagster.allocation.inputs import mixed_scenario
from coral_dagster.app.equal_attainment import HEADER, row_for, with_ratios
from coral_dagster.errors import UnknownNameError

#: The paper's ratios at fixed demand (coral.md §6), by (scenario, method); imbalanced: "up to 2.79×" overall.
PAPER = {("core", "homo"): "1.62×", ("core", "cauchy"): "1.60×", ("extended", "homo"): "3.14×",
         ("extended", "cauchy"): "2.66×"}


def headline(rows: list[dict], scenarios: dict) -> list[dict]:
    """Each baseline's sized cost over Coral's per scenario (and mix), with the rule and availability it ran at."""
    out = []
    for r in rows:
        if r["method"] == "coral":
            continue
        name = r["scenario"].split(":")[0]
        scn = scenarios[name]
        ours = (f"{r['sized_x_coral']:.3f}×" if r.get("sized_x_coral") else
                f"cannot be sized (serves {r['reach_served_share']:.1%})" if r.get("reach_served_share") is not None
                else "cannot be sized")
        paper = PAPER.get((r["scenario"], r["method"])) or ("up to 2.79× over the best baseline"
                                                            if ":" in r["scenario"] else None)
        out.append({"figure": f"{r['scenario']}, equal attainment: {r['method']} ÷ Coral", "paper": paper,
                    "ours": ours, "rule": getattr(scn, "t_hat_rule", "slo"),
                    "availability": f"{scn.availability_model.profile} profile, window 0 (data/scenarios/MARKET.md)",
                    "section": "equal attainment"})
    return out


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
    rows = with_ratios(rows)
    print(" | ".join(HEADER))
    for r in rows:
        print(" | ".join(cell(r.get(k)) for k in HEADER))
    scenarios = {scn.name: scn for scn, _ in libraries}
    path = write_result("equal_attainment", {
        "seeds": seeds, "duration_s": args.duration_s, "time_limit_s": args.time_limit_s, "mixes": mixes,
        "headline": headline(rows, scenarios), "rows": rows}, out=args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
