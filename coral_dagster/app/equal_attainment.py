"""Cost at equal simulated SLO attainment: a method's plan at fixed demand beside the plan the burst-aware capacity
rule and the closed loop size, each evaluated on held-out windows of the scenario's own traces (`bench.equal_attainment`
prints and writes it; `coral bench allocation` runs it as its attainment setting)."""

from __future__ import annotations

import time

from coral_dagster.allocation.goodput import fluid_goodput
from coral_dagster.app.scenario_plans import plan_scenario
from coral_dagster.app.closed_loop import closed_loop
from coral_dagster.errors import CoralError


def evaluate(plan, scenario, seeds, duration_s: float) -> dict:
    """The plan simulated on the scenario's own traces, one window per seed: per seed the worst model's share of
    admitted requests meeting both SLOs, goodput (tokens/s meeting SLO) and offered tokens/s; with the worst seed."""
    from coral_dagster.simulator.simulate import simulate_plan

    runs = []
    for seed in seeds:
        res = simulate_plan(plan, scenario, trace="scenario", duration_s=duration_s, seed=seed)
        req, by = res.requests, res.by_model
        offered = (req.prompt_tokens + req.output_tokens).groupby(req.model).sum() / res.duration_s
        runs.append({"seed": seed, "worst_attainment": float(by.admitted_attainment.min()),
                     "worst_model": str(by.model[by.admitted_attainment.astype(float).idxmin()]),
                     "goodput_tokens_per_s": float(res.goodput_tokens_per_s),
                     "offered_tokens_per_s": {str(m): float(v) for m, v in offered.items()},
                     "shed": int(by.shed.sum()), "arrivals": int(by.arrivals.sum())})
    return {"runs": runs, "worst_attainment": min(r["worst_attainment"] for r in runs),
            "goodput_tokens_per_s": sum(r["goodput_tokens_per_s"] for r in runs) / len(runs)}


HEADER = ("scenario", "method", "fixed_usd_per_hour", "fixed_worst_attainment", "fixed_x_coral", "sized_status",
          "sized_usd_per_hour", "loop_worst_window", "sized_worst_attainment", "sized_x_coral", "loop_rounds",
          "reach_usd_per_hour", "reach_served_share", "reach_worst_attainment", "relaxed_availability",
          "relaxed_usd_per_hour", "relaxed_worst_attainment")


def sized(scn, method, templates, time_limit_s, availability_scale=1.0, prices=None):
    """The closed loop's plan for one method at an availability level (priced from `prices`, a price file's rows;
    default the bundled ones); each round's status, cost, boost and worst window per model; wall time."""
    t0 = time.perf_counter()
    rates = {m.model: m.rate_req_s for m in scn.models}
    plan, history = closed_loop(
        lambda boost: plan_scenario(scn, method=method, templates=templates, boost=boost, time_limit_s=time_limit_s,
                                    availability_scale=availability_scale, prices=prices), scn, rates)
    rounds = [{"status": r.plan.status, "usd_per_hour": r.plan.cost_usd_per_hour, "mip_gap": r.plan.mip_gap,
               "boost": dict(r.boost), "worst_window": dict(r.attainment)} for r in history]
    return plan, rounds, time.perf_counter() - t0


def row_for(scn, method, templates, args, seeds, label: str | None = None, prices=None) -> dict:
    """One method on one scenario (`label` names it in the row, default its name; priced from `prices`, a price
    file's rows, default the bundled ones): fixed-demand plan, sized plan, and where the sized demand cannot be
    met, what it reaches and what availability it would need."""
    row = {"scenario": label or scn.name, "method": method}
    try:
        fixed = plan_scenario(scn, method=method, templates=templates, burst_aware=False,
                              time_limit_s=args.time_limit_s, prices=prices)
        row.update(fixed_status=fixed.status, fixed_usd_per_hour=fixed.cost_usd_per_hour,
                   fixed_worst_attainment=evaluate(fixed, scn, seeds, args.duration_s)["worst_attainment"])
    except CoralError as exc:
        row["fixed_error"] = str(exc)[:160]
    try:
        plan, rounds, loop_s = sized(scn, method, templates, args.time_limit_s, prices=prices)
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
                              time_limit_s=args.time_limit_s, prices=prices)
        ev = evaluate(reach, scn, seeds, args.duration_s)
        row.update(reach_status=reach.status, reach_usd_per_hour=reach.cost_usd_per_hour,
                   reach_served_share=min(fluid_goodput(reach).per_model.values()),
                   reach_worst_attainment=ev["worst_attainment"])
    except CoralError as exc:
        row["reach_error"] = str(exc)[:160]
    for factor in (float(x) for x in args.relax.split(",") if x):
        try:
            plan, rounds, _ = sized(scn, method, templates, args.time_limit_s, availability_scale=factor,
                                    prices=prices)
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
