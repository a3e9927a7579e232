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

import time

from bench._args import bench_parser, cell, evaluate, names, seeds_and_libraries
from bench._results import write_result
from coral_dagster.allocation.demand import DEMAND_MIXES
from coral_dagster.allocation.goodput import fluid_goodput
from coral_dagster.allocation.inputs import mixed_scenario
from coral_dagster.allocation.scenario_plans import plan_scenario
from coral_dagster.app.closed_loop import closed_loop
from coral_dagster.errors import CoralError, UnknownNameError

HEADER = ("scenario", "method", "fixed_usd_per_hour", "fixed_worst_attainment", "fixed_x_coral", "sized_status",
          "sized_usd_per_hour", "loop_worst_window", "sized_worst_attainment", "sized_x_coral", "loop_rounds",
          "reach_usd_per_hour", "reach_served_share", "reach_worst_attainment", "relaxed_availability",
          "relaxed_usd_per_hour", "relaxed_worst_attainment")


def sized(scn, method, templates, time_limit_s, availability_scale=1.0):
    """The closed loop's plan for one method at an availability level; each round's status, cost, boost and worst
    window per model; wall time."""
    t0 = time.perf_counter()
    rates = {m.model: m.rate_req_s for m in scn.models}
    plan, history = closed_loop(
        lambda boost: plan_scenario(scn, method=method, templates=templates, boost=boost, time_limit_s=time_limit_s,
                                    availability_scale=availability_scale), scn, rates)
    rounds = [{"status": r.plan.status, "usd_per_hour": r.plan.cost_usd_per_hour, "mip_gap": r.plan.mip_gap,
               "boost": dict(r.boost), "worst_window": dict(r.attainment)} for r in history]
    return plan, rounds, time.perf_counter() - t0


def row_for(scn, method, templates, args, seeds, label: str | None = None) -> dict:
    """One method on one scenario (`label` names it in the row, default its name): fixed-demand plan, sized plan,
    and where the sized demand cannot be met, what it reaches and what availability it would need."""
    row = {"scenario": label or scn.name, "method": method}
    try:
        fixed = plan_scenario(scn, method=method, templates=templates, burst_aware=False,
                              time_limit_s=args.time_limit_s)
        row.update(fixed_status=fixed.status, fixed_usd_per_hour=fixed.cost_usd_per_hour,
                   fixed_worst_attainment=evaluate(fixed, scn, seeds, args.duration_s)["worst_attainment"])
    except CoralError as exc:
        row["fixed_error"] = str(exc)[:160]
    try:
        plan, rounds, loop_s = sized(scn, method, templates, args.time_limit_s)
        ev = evaluate(plan, scn, seeds, args.duration_s)
        row.update(sized_status=plan.status, sized_usd_per_hour=plan.cost_usd_per_hour, loop_rounds=len(rounds),
                   loop_history=rounds,
                   loop_s=loop_s, loop_worst_window=min(plan.expected_attainment.values()),
                   sized_worst_attainment=ev["worst_attainment"],
                   sized_per_seed=[r["worst_attainment"] for r in ev["runs"]])
        return row
    except CoralError as exc:
        row["sized_error"] = str(exc)[:160]
    try:
        reach = plan_scenario(scn, method=method, templates=templates, scarcity="scale",
                              time_limit_s=args.time_limit_s)
        ev = evaluate(reach, scn, seeds, args.duration_s)
        row.update(reach_status=reach.status, reach_usd_per_hour=reach.cost_usd_per_hour,
                   reach_served_share=min(fluid_goodput(reach).per_model.values()),
                   reach_worst_attainment=ev["worst_attainment"])
    except CoralError as exc:
        row["reach_error"] = str(exc)[:160]
    for factor in (float(x) for x in names(args.relax)):
        try:
            plan, rounds, _ = sized(scn, method, templates, args.time_limit_s, availability_scale=factor)
        except CoralError:
            continue
        row.update(relaxed_availability=factor, relaxed_status=plan.status, relaxed_usd_per_hour=plan.cost_usd_per_hour,
                   relaxed_worst_attainment=evaluate(plan, scn, seeds, args.duration_s)["worst_attainment"])
        break
    return row


def with_ratios(rows: list[dict]) -> list[dict]:
    """The rows with each method's fixed-demand and sized cost over Coral's on the same scenario."""
    for r in rows:
        coral = next((x for x in rows if x["scenario"] == r["scenario"] and x["method"] == "coral"), {})
        for kind in ("fixed", "sized"):
            if r.get(f"{kind}_usd_per_hour") and coral.get(f"{kind}_usd_per_hour"):
                r[f"{kind}_x_coral"] = r[f"{kind}_usd_per_hour"] / coral[f"{kind}_usd_per_hour"]
    return rows


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
