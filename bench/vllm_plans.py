"""What serving on vLLM costs beside Coral's runtime: each scenario's plan per engine and T̂ rule, fixed demand.

For each scenario and T̂ rule (`templates: {t_hat_rule}`; each library built under its own key): the Coral ILP's
plan with every template (engine `coral`), with the templates vLLM runs with a KV-transfer connector (engine
`vllm`: aggregated, prefill and decode instances of one node per stage and one GPU count) and without one (engine
`vllm-aggregated`), and the Homo baseline (one-node aggregated replicas). Fluid plans at the scenario's demand and
its availability times each `--availability-scales` factor: cost, whether demand is met, and the error when it
cannot be. Prints a table and writes bench/results/vllm_plans.json with `headline` rows (cost ratios against the
Coral-runtime plan at the same availability).

    python -m bench.vllm_plans [--scenarios core,extended] [--rules slo,paper] [--availability-scales 1,10]
        [--n-max N] [--time-limit-s 60]

`--n-max` overrides the scenarios' most nodes per template (a smaller library where the full one cannot be built in
time; the library key keeps it apart).
"""

from __future__ import annotations

import time
from dataclasses import replace

from bench._args import RESULTS, bench_parser, cell, names
from bench._results import write_result
from coral_dagster.app.scenario_plans import library_templates, plan_scenario
from coral_dagster.catalog.scenarios import load_scenario
from coral_dagster.errors import CoralError

#: (row label, planning method, serving engine) of each plan compared.
PLANS = (("coral", "coral", "coral"), ("vllm", "coral", "vllm"), ("vllm-aggregated", "coral", "vllm-aggregated"),
         ("homo", "homo", "coral"))


def plan_row(scn, rule: str, scale: float, label: str, method: str, engine: str, templates,
             time_limit_s: float) -> dict:
    """One plan: its cost and worst served share of demand, or the planner's error."""
    row = {"scenario": scn.name, "rule": rule, "availability_scale": scale, "plan": label, "method": method,
           "engine": engine}
    t0 = time.perf_counter()
    try:
        plan = plan_scenario(replace(scn, engine=engine), method=method, templates=templates,
                             time_limit_s=time_limit_s, availability_scale=scale)
    except CoralError as exc:
        row.update(error=str(exc)[:240], wall_s=time.perf_counter() - t0)
        return row
    served = plan.served_fraction()
    row.update(status=plan.status, usd_per_hour=plan.cost_usd_per_hour, demand_scale=plan.demand_scale,
               worst_served=min(served.values()) if served else 1.0, instances=sum(i.count for i in plan.instances),
               phases=sorted({i.template.phase for i in plan.instances}), wall_s=time.perf_counter() - t0)
    return row


def headline(rows: list[dict]) -> list[dict]:
    """Cost of each vLLM and Homo plan ÷ the Coral-runtime plan's, per scenario, rule and availability, where both
    meet demand, with both solver statuses (a plan stopped at the time limit may be dearer than its optimum)."""
    out = []
    for r in rows:
        base = next((b for b in rows if b["scenario"] == r["scenario"] and b["rule"] == r["rule"]
                     and b["availability_scale"] == r["availability_scale"] and b["plan"] == "coral"), None)
        if r["plan"] == "coral" or base is None:
            continue
        meets = all(x.get("worst_served", 0) >= 1 - 1e-6 and x.get("demand_scale", 0) >= 1 - 1e-9 for x in (r, base))
        ratio = r["usd_per_hour"] / base["usd_per_hour"] if meets else None
        out.append({"figure": f"{r['plan']} plan cost ÷ Coral-runtime plan cost, {r['scenario']}", "paper": None,
                    "ours": ratio, "rule": r["rule"], "n_max": r.get("n_max"),
                    "availability": f"scenario file × {r['availability_scale']:g} (fixed demand)",
                    "section": "vLLM plans", "statuses": [r.get("status"), base.get("status")],
                    **({} if meets else {"note": r.get("error", "demand not met")[:160]})})
    return out


def main() -> None:
    ap = bench_parser(__doc__, methods="coral")
    ap.add_argument("--rules", default="slo,paper", help="comma-separated T̂ rules")
    ap.add_argument("--availability-scales", default="1,10", help="comma-separated availability factors")
    ap.add_argument("--n-max", type=int, default=None, help="most nodes per template (default: the scenario's)")
    args = ap.parse_args()
    rows = []
    for name in names(args.scenarios):
        for rule in names(args.rules):
            scn = replace(load_scenario(name), t_hat_rule=rule)
            scn = scn if args.n_max is None else replace(scn, n_max=args.n_max)
            t0 = time.perf_counter()
            templates = library_templates(scn)
            library_s = time.perf_counter() - t0
            for scale in (float(x) for x in names(args.availability_scales)):
                for label, method, engine in PLANS:
                    rows.append({**plan_row(scn, rule, scale, label, method, engine, templates, args.time_limit_s),
                                 "n_max": scn.n_max, "library_key": scn.library_key, "library_s": library_s})
                    print(" | ".join(cell(rows[-1].get(k)) for k in (
                        "scenario", "rule", "availability_scale", "plan", "status", "usd_per_hour", "worst_served",
                        "error")), flush=True)
    path = write_result("vllm_plans", {"time_limit_s": args.time_limit_s, "rows": rows, "headline": headline(rows)},
                        out=args.out or RESULTS / "vllm_plans.json")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
