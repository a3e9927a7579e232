"""Goodput under scarcity with admission control: what a plan promises (fluid) against what it delivers (simulated).

For each availability level, Coral plans what it can serve (uniform scaling or max-min fair), the router admits per
model only the request rate the plan serves and sheds the rest (429); the plan is simulated on the scenario's own
traces. "Fluid" is what the plan promises: each model's served share of its requests (`fluid_goodput`) times the
tokens/s the simulation offered of it. Prints a table and writes bench/results/scarcity_goodput.json.

    python bench/scarcity_goodput.py [--scenario core] [--levels 0.5,0.25] [--modes scale,fair] [--seeds 0,7]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from coral_dagster.allocation.goodput import fluid_goodput
from coral_dagster.allocation.scenario_plans import library_templates, plan_scenario
from coral_dagster.catalog.scenarios import load_scenario
from coral_dagster.simulator.simulate import simulate_plan

OUT = Path(__file__).resolve().parent / "results" / "scarcity_goodput.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", default="core")
    ap.add_argument("--levels", default="0.5,0.25")
    ap.add_argument("--modes", default="scale,fair")
    ap.add_argument("--seeds", default="0,7")
    ap.add_argument("--duration-s", type=float, default=300.0)
    ap.add_argument("--time-limit-s", type=float, default=30.0)
    args = ap.parse_args()
    scn = load_scenario(args.scenario)
    templates = library_templates(scn)
    rows = []
    for level in (float(x) for x in args.levels.split(",")):
        for mode in args.modes.split(","):
            plan = plan_scenario(scn, availability_scale=level, scarcity=mode, templates=templates,
                                 time_limit_s=args.time_limit_s)
            fluid = fluid_goodput(plan)
            for seed in (int(s) for s in args.seeds.split(",")):
                res = simulate_plan(plan, scn, trace="scenario", duration_s=args.duration_s, seed=seed)
                by = res.by_model
                req = res.requests
                offered = ((req.prompt_tokens + req.output_tokens).groupby(req.model).sum() / res.duration_s)
                promised = sum(fluid.per_model.get(m, 0.0) * float(v) for m, v in offered.items())
                row = {"scenario": scn.name, "availability_scale": level, "mode": mode, "seed": seed,
                       "status": plan.status, "usd_per_hour": plan.cost_usd_per_hour,
                       "admit_req_s": dict(plan.admit_req_s),
                       "fluid_goodput_tokens_per_s": promised,
                       "simulated_goodput_tokens_per_s": res.goodput_tokens_per_s,
                       "simulated_over_fluid": res.goodput_tokens_per_s / promised if promised else None,
                       "shed": int(by.shed.sum()), "arrivals": int(by.arrivals.sum()),
                       "worst_admitted_attainment": float(by.admitted_attainment.min())}
                rows.append(row)
                print(json.dumps(row), flush=True)
    header = ("availability_scale", "mode", "seed", "usd_per_hour", "fluid_goodput_tokens_per_s",
              "simulated_goodput_tokens_per_s", "simulated_over_fluid", "shed", "worst_admitted_attainment")
    print(" | ".join(header))
    for r in rows:
        print(" | ".join(f"{r[k]:,.3f}" if isinstance(r[k], float) else str(r[k]) for k in header))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"duration_s": args.duration_s, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
