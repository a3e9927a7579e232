"""The paper's scarcity experiment: availability below demand, every method plans what it can serve, goodput simulated
with admission control.

For each scenario, availability level and mode (uniform `scale`, max-min `fair`), every method plans what it can
serve; the router admits per model only the share of its requests the plan serves (its served fraction, counted
request by request, and no faster than the plan's capacity carries) and sheds the rest (429); the plan is simulated
on the scenario's own traces (one window per seed). Goodput is tokens/s of requests meeting both SLOs;
"fluid" is what the plan promises: each model's served share of its requests (`fluid_goodput`) times the tokens/s
the simulation offered of it. The share bucket saves credit for each model's trace bursts (`admit_depth_req`),
behind a second bucket at the rate the plan's capacity carries; with `--ablate-depth` the same plan is also
simulated saving 10 s of its rate and without the second bucket (`*_10s_bucket` columns). The
ratios Coral/Cauchy and Coral/Homo are of simulated goodput (paper, extended: 2.39× and 7.64×). `--windows`
replays the scenario's availability series (data/scenarios/MARKET.md §5): each level is applied to each window's
counts (`all`: every window). Per model, the share the plan promises (its served fraction) beside the share the
simulation delivers (completed requests and their tokens over those offered, each seed), as a ratio: the plan's
promise is kept where every ratio lies within 1 ± 0.1 and admitted attainment is at least 0.95. `mixed_share`:
of the plan's instances (and of its cost), those whose template mixes GPU types. Prints a table and writes
bench/results/scarcity_goodput.json (headline rows: `bench._results.write_result`).

    python -m bench.scarcity_goodput [--scenarios core,extended] [--levels 0.5,0.25,0.15] [--modes scale,fair]
        [--methods coral,homo,homo-ilp,cauchy] [--seeds 11,12] [--duration-s 300] [--ablate-depth] [--windows 0]
"""

from __future__ import annotations

import time
from dataclasses import replace

from bench._args import bench_parser, cell, names, seeds_and_libraries
from bench._results import write_result
from coral_dagster.allocation.goodput import fluid_goodput
from coral_dagster.app.scenario_plans import plan_scenario
from coral_dagster.errors import CoralError
from coral_dagster.routing import admission_shares

PROMISE_TOLERANCE, ATTAINMENT_FLOOR = 0.1, 0.95
PAPER = {"cauchy": "2.39× (extended)", "homo": "7.64× (extended)"}


def mixed_share(plan) -> dict:
    """Of the plan's instances and of its cost, the share in templates whose nodes mix GPU types."""
    mixed = [i for i in plan.instances if len({n.gpu for n, _ in i.template.nodes.counts}) > 1]
    count, cost = sum(i.count for i in plan.instances), sum(i.count * i.usd_per_hour for i in plan.instances)
    return {"instances": sum(i.count for i in mixed) / count if count else 0.0,
            "cost": sum(i.count * i.usd_per_hour for i in mixed) / cost if cost else 0.0}


def evaluate(plan, scn, seeds, duration_s: float) -> dict:
    """The plan simulated on the scenario's own traces, one window per seed: goodput, offered tokens/s per model,
    shed and arrivals, and per model and seed the share delivered (completed requests and their tokens over those
    offered) and the attainment of its admitted requests."""
    from coral_dagster.simulator.simulate import simulate_plan

    runs = []
    for seed in seeds:
        res = simulate_plan(plan, scn, trace="scenario", duration_s=duration_s, seed=seed)
        req = res.requests
        tokens = req.prompt_tokens + req.output_tokens
        done = req.status == "completed"
        per_model = {}
        for model, sub in req.groupby("model"):
            ok = done[sub.index]
            admitted = sub[sub.status != "shed"]
            per_model[str(model)] = {
                "requests": float(ok.mean()), "tokens": float(tokens[sub.index][ok].sum() / tokens[sub.index].sum()),
                "served_req_s": float(ok.sum()) / res.duration_s, "offered_req_s": len(sub) / res.duration_s,
                "admitted_attainment": float(admitted.met_slo.mean()) if len(admitted) else 1.0}
        runs.append({"seed": seed, "goodput_tokens_per_s": float(res.goodput_tokens_per_s),
                     "offered_tokens_per_s": {str(m): float(v) for m, v in
                                              (tokens.groupby(req.model).sum() / res.duration_s).items()},
                     "delivered": per_model, "shed": int(res.by_model.shed.sum()),
                     "arrivals": int(res.by_model.arrivals.sum())})
    return {"runs": runs, "goodput_tokens_per_s": sum(r["goodput_tokens_per_s"] for r in runs) / len(runs),
            "worst_attainment": min(d["admitted_attainment"] for r in runs for d in r["delivered"].values())}


def promise(plan, ev) -> dict:
    """Per model: the share promised (what `coral plan` prints and admission keeps, `routing.admission_shares`,
    for a model the plan serves less than its demand; the fluid share of the others), the delivered shares over
    seeds (requests, tokens) and their ratios to it; the requests/s served and offered per seed, and served over
    the rate the plan admits at its demand (the admission keeps the share, so a window offering more or less than
    the plan's demand is served more or less than that rate)."""
    promised = {**fluid_goodput(plan).per_model, **(admission_shares(plan) if plan.admission.limits else {})}
    out = {}
    for model, share in sorted(promised.items()):
        got = [r["delivered"][model] for r in ev["runs"] if model in r["delivered"]]
        ratios = [d[k] / share for d in got for k in ("requests", "tokens")] if share > 0 else []
        admit = plan.admission.admit_req_s.get(model)
        out[model] = {"promised": share, "delivered_requests": [d["requests"] for d in got],
                      "delivered_tokens": [d["tokens"] for d in got],
                      "served_req_s": [d["served_req_s"] for d in got],
                      "offered_req_s": [d["offered_req_s"] for d in got],
                      "served_over_admitted_rate": [d["served_req_s"] / admit for d in got] if admit else None,
                      "worst_ratio": max(ratios, key=lambda x: abs(x - 1.0)) if ratios else None,
                      "admitted_attainment": min(d["admitted_attainment"] for d in got) if got else None}
    return out


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
    per_model = promise(plan, ev)
    ratios = [p["worst_ratio"] for p in per_model.values() if p["worst_ratio"] is not None]
    row.update(served_share={m: round(f, 4) for m, f in fluid.per_model.items()}, per_model=per_model,
               worst_delivered_over_promised=max(ratios, key=lambda x: abs(x - 1.0)) if ratios else None,
               promise_kept=bool(ratios) and all(abs(x - 1.0) <= PROMISE_TOLERANCE for x in ratios)
               and ev["worst_attainment"] >= ATTAINMENT_FLOOR,
               mixed_share=mixed_share(plan)["instances"], mixed_cost_share=mixed_share(plan)["cost"],
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
              "mixed_share", "fluid_goodput_tokens_per_s", "simulated_goodput_tokens_per_s", "simulated_over_fluid",
              "coral_over_method", "worst_delivered_over_promised", "promise_kept", "shed", "arrivals",
              "worst_admitted_attainment", "simulated_over_fluid_10s_bucket", "shed_10s_bucket",
              "worst_admitted_attainment_10s_bucket")
    print(" | ".join(header))
    for r in rows:
        print(" | ".join(cell(r.get(k)) for k in header))
    for r in rows:
        for model, p in sorted(r.get("per_model", {}).items()):
            print(f"{r['scenario']} x{r['availability_scale']:g} {r['mode']} {r['method']} {model}: promised "
                  f"{p['promised']:.3f}, delivered requests {', '.join(f'{x:.3f}' for x in p['delivered_requests'])}"
                  f", tokens {', '.join(f'{x:.3f}' for x in p['delivered_tokens'])}, admitted attainment "
                  f"{cell(p['admitted_attainment'])}")
    doc = {"seeds": seeds, "duration_s": args.duration_s, "time_limit_s": args.time_limit_s,
           "headline": headline(rows), "rows": rows}
    print(f"wrote {write_result('scarcity_goodput', doc, out=args.out)}")


def headline(rows: list[dict]) -> list[dict]:
    """Per cell: Coral's simulated goodput over each baseline's, and whether Coral delivered the shares it
    promised (worst delivered/promised ratio over models, seeds, requests and tokens; worst admitted attainment)."""
    out = []
    for r in rows:
        where = f"{r['scenario']} x{r['availability_scale']:g} {r['mode']}"
        availability = f"{r['availability_scale']:g} × the scenario's market, window {r['window']}"
        if r["method"] == "coral" and r.get("worst_delivered_over_promised") is not None:
            out.append({"figure": f"{where}: Coral's delivered ÷ promised share (worst model)",
                        "paper": None, "ours": f"{r['worst_delivered_over_promised']:.3f} (admitted attainment "
                        f"{r['worst_admitted_attainment']:.3f}, mixed {r['mixed_share']:.0%} of instances)",
                        "rule": "slo", "availability": availability, "section": "scarcity"})
        elif r["method"] in ("cauchy", "homo") and r.get("coral_over_method"):
            out.append({"figure": f"{where}: Coral ÷ {r['method']} simulated goodput",
                        "paper": PAPER.get(r["method"]) if r["scenario"] == "extended" else None,
                        "ours": f"{r['coral_over_method']:.2f}×", "rule": "slo",
                        "availability": availability, "section": "scarcity"})
    return out


if __name__ == "__main__":
    main()
