"""Speed and outcome of the event-driven simulator on the extended scenario: 30 minutes of traffic, 25 req/s per model.

The plan is the Coral ILP's. `--plan auto` (default) plans over the scenario's template library when the DuckDB
store holds one (`coral templates build`), else over one-node templates whose throughput is the profiles' T̂ at
each SLO; `library` builds the library if it is missing (slow); `latest` simulates the newest stored plan.
Prints a table and writes bench/results/simulator.json plus the latency-CDF and goodput PNGs next to it.

    python bench/simulator.py [--duration-s 1800] [--trace scenario|poisson|gamma] [--plan auto|library|one-node|latest]
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from rich.table import Table

from coral_dagster.allocation.inputs import scenario_problem
from coral_dagster.allocation.planner import solve_plan
from coral_dagster.catalog.models import get_model
from coral_dagster.catalog.nodes import NodeMultiset
from coral_dagster.catalog.scenarios import load_scenario
from coral_dagster.profiles import default_perf_model
from coral_dagster.simulator import simulate_plan, trace_means
from coral_dagster.simulator.plots import plot_goodput, plot_latency_cdf
from coral_dagster.templates.types import Stage, Template

RESULTS = Path(__file__).resolve().parent / "results"
TARGET_WALL_S = 120.0


def one_node_templates(scenario) -> list[Template]:
    """Per (model, phase, node configuration) a one-stage template with the profiles' T̂ at the SLO."""
    perf = default_perf_model()
    out = []
    for sm in scenario.models:
        layers = get_model(sm.model).n_layers
        prompt, output = trace_means(sm.trace)
        for node in scenario.node_configs:
            for phase, slo, ctx in (("prefill", sm.prefill_slo_ms, 0),
                                    ("decode", sm.decode_slo_ms, int(prompt + output))):
                t_hat = perf.t_hat(sm.model, node, phase, layers, slo, context_tokens=ctx)
                if t_hat.tokens_per_s > 0:
                    out.append(Template(sm.model, phase, slo, NodeMultiset.of([node]),
                                        (Stage(0, layers, (node,), (1.0,)),), t_hat.tokens_per_s, t_hat.bound))
    return out


def bench_plan(scenario, source: str):
    """(plan, what it was planned over)."""
    from coral_dagster.store import Store

    if source == "latest":
        from coral_dagster.app.plans import latest_plan

        return latest_plan(Store(), scenario), "stored latest plan"
    templates: list[Template] | tuple[Template, ...] = ()
    if source in ("auto", "library"):
        from coral_dagster.app.scenario_plans import library_templates
        from coral_dagster.templates.library import load_library

        store = Store()
        stored = load_library(store, scenario) if store.path.exists() else []
        if stored or source == "library":
            templates = stored or library_templates(scenario)
    label = "one-node T̂ templates"
    if templates:
        kept = runnable(templates)
        label = f"template library ({len(kept)} of {len(templates)} templates consistent)"
        templates = kept
    templates = templates or one_node_templates(scenario)
    return solve_plan(scenario_problem(scenario, templates)), label


def runnable(templates) -> list[Template]:
    """Templates whose stages hold exactly their nodes over contiguous layers (the simulator refuses others)."""
    from coral_dagster.errors import CoralError
    from coral_dagster.simulator.engine import check_template

    out = []
    for t in templates:
        try:
            check_template(t, get_model(t.model).n_layers)
        except CoralError:
            continue
        out.append(t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration-s", type=float, default=1800.0)
    ap.add_argument("--trace", default="scenario", choices=("scenario", "poisson", "gamma"))
    ap.add_argument("--plan", default="auto", choices=("auto", "library", "one-node", "latest"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    logging.disable(logging.WARNING)
    scenario = load_scenario("extended")
    t0 = time.perf_counter()
    plan, plan_source = bench_plan(scenario, args.plan)
    plan_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    res = simulate_plan(plan, scenario, trace=args.trace, duration_s=args.duration_s, seed=args.seed)
    total_s = time.perf_counter() - t0
    RESULTS.mkdir(parents=True, exist_ok=True)
    cdf = plot_latency_cdf(res, RESULTS / "simulator_latency_cdf.png")
    goodput = plot_goodput(res, RESULTS / "simulator_goodput.png")
    c = res.counts
    run = {
        "scenario": scenario.name, "plan_source": plan_source, "plan_cost_usd_per_hour": res.cost_usd_per_hour,
        "instances": sum(i.count for i in plan.instances), "nodes": len(res.nodes),
        "multi_stage_instances": sum(i.count for i in plan.instances if len(i.template.stages) > 1),
        "trace": res.arrivals, "duration_s": args.duration_s, "seed": args.seed, "requests": c["arrivals"],
        "events": res.events, "engine_wall_s": round(res.wall_s, 2), "total_wall_s": round(total_s, 2),
        "plan_s": round(plan_s, 2), "requests_per_wall_s": round(c["arrivals"] / total_s),
        "events_per_wall_s": round(res.events / res.wall_s), "target_wall_s": TARGET_WALL_S,
        "meets_target": total_s < TARGET_WALL_S, "counts": c, "attainment": round(res.attainment, 4),
        "goodput_tokens_per_s": round(res.goodput_tokens_per_s, 1),
        "offered_tokens_per_s": round(res.offered_tokens_per_s, 1),
        "usd_per_million_tokens": round(res.usd_per_million_tokens, 4),
        "models": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}
                   for r in res.by_model.to_dict("records")],
        "plots": [str(cdf.relative_to(RESULTS.parent.parent)), str(goodput.relative_to(RESULTS.parent.parent))],
        "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    (RESULTS / "simulator.json").write_text(json.dumps(run, indent=2) + "\n")
    console = Console(width=160)
    t = Table(title=f"simulator: {scenario.name}, {res.arrivals}, {args.duration_s:g} s, plan over {plan_source}")
    for col in ("requests", "events", "engine s", "total s", "req / wall s", "events / s", "target"):
        t.add_column(col, justify="right")
    t.add_row(f"{c['arrivals']:,}", f"{res.events:,}", f"{res.wall_s:.1f}", f"{total_s:.1f}",
              f"{run['requests_per_wall_s']:,}", f"{run['events_per_wall_s']:,}",
              ("met" if run["meets_target"] else "MISSED") + f" (< {TARGET_WALL_S:g} s)")
    console.print(t)
    m = Table(title=f"per model (plan {res.cost_usd_per_hour:,.2f} $/h, {run['instances']} instances, "
                    f"{run['nodes']} nodes; attainment {res.attainment:.1%})")
    for col in ("model", "arrivals", "attainment", "goodput tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99",
                "busy"):
        m.add_column(col, justify="left" if col == "model" else "right")
    for r in res.by_model.itertuples(index=False):
        m.add_row(r.model, f"{r.arrivals:,}", f"{r.attainment:.1%}", f"{r.goodput_tokens_per_s:,.0f}",
                  f"{r.ttft_p50_ms:,.0f}", f"{r.ttft_p99_ms:,.0f}", f"{r.tpot_p50_ms:.1f}", f"{r.tpot_p99_ms:.1f}",
                  f"{r.mean_busy_fraction:.0%}")
    console.print(m)
    console.print(f"wrote {RESULTS / 'simulator.json'}, {cdf.name}, {goodput.name}")


if __name__ == "__main__":
    main()
