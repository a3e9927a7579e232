"""`coral plan` (one allocation plan, stored in DuckDB) and `coral bench allocation` (every method side by side)."""

from __future__ import annotations

import json

import click

from coral_dagster.app.make_plan import DEFAULT_MAX_NODES, SAFETY_NET_S
from coral_dagster.cli._out import (NON_NEGATIVE, POSITIVE, SCENARIO_HELP, db_option, emit_json, emit_table,
                                   json_option)
from coral_dagster.cli.templates import t_hat_rule_option
from coral_dagster.cli.types import prices_path_option
from coral_dagster.vocab import METHODS, SERVING_ENGINES

MIXES = ("uniform", "large-heavy", "small-heavy")


def _print_plan(plan) -> None:
    import pandas as pd

    rows = [{"model": i.template.model, "phase": i.template.phase, "region": i.region,
             "nodes": str(i.template.nodes), "count": i.count, "tokens_per_s": i.tokens_per_s,
             "usd_per_hour": i.usd_per_hour * i.count} for i in plan.instances]
    emit_table(pd.DataFrame(rows, columns=["model", "phase", "region", "nodes", "count", "tokens_per_s",
                                           "usd_per_hour"]),
               title=f"{plan.scenario}: {plan.method} plan {plan.plan_id or '(not stored)'}: {plan.status}")
    served = [{"model": m, "phase": p, "capacity_factor": plan.admission.capacity_factors.get((m, p)),
               "demand_tokens_per_s": d, "served_tokens_per_s": plan.served_tokens_per_s.get((m, p), 0.0)}
              for (m, p), d in sorted(plan.demand_tokens_per_s.items())]
    emit_table(pd.DataFrame(served), title="served vs demanded (demand = rate × mean tokens × capacity factor)")
    gap = f"{plan.gap:.2%}" if plan.gap == plan.gap else "n/a"
    mip_gap = f"{plan.mip_gap:.2%}" if plan.mip_gap == plan.mip_gap else "n/a"
    click.echo(f"cost {plan.cost_usd_per_hour:,.2f} $/h (churn penalty {plan.churn_usd_per_hour:,.2f}), "
               f"gap {mip_gap} to the proven bound {plan.mip_bound_usd_per_hour:,.2f} "
               f"(LP bound {plan.lp_bound_usd_per_hour:,.2f}, {gap} to it), {plan.work_nodes:,} nodes of work in "
               f"{plan.solve_s:.2f} s, demand scale {plan.demand_scale:.2%}")
    from coral_dagster.app.plans import admission_shares

    shares = admission_shares(plan) if plan.admission.limits else {}
    for m, rate in sorted(plan.admission.admit_req_s.items()):
        depth = plan.admission.admit_depth_req.get(m)
        peak = plan.admission.admit_peak.get(m)
        click.echo(f"admission: {m} admits its promised {shares.get(m, 1.0):.1%} of the requests it sends "
                   f"({rate:.3g} req/s at the planned demand)" + (f", bursts up to {depth:,.0f} requests" if depth
                   else "") + (f", let in at most {peak[0]:.3g} req/s (a second bucket {peak[1]:,.0f} deep)" if peak
                                else "")
                   + " (the rest are shed with 429)")
    for b in plan.bottlenecks:
        click.echo(f"bottleneck: {b.describe()}")
    for note in plan.notes:
        click.echo(f"note: {note}")
    if plan.plan_id:
        click.echo(f"stored as plan {plan.plan_id} (market snapshot {plan.snapshot_id})")


@click.command("plan")
@click.option("--scenario", default="core", show_default=True, help=f"Scenario: {SCENARIO_HELP}.")
@click.option("--method", type=click.Choice(METHODS), default="coral", show_default=True,
              help="Coral's ILP, or a baseline on the same inputs (helix: single-model scenarios only).")
@click.option("--availability-scale", type=NON_NEGATIVE, default=1.0, show_default=True,
              help="Multiply every region's node availability (below 1 to plan under scarcity).")
@click.option("--engine", type=click.Choice(SERVING_ENGINES), default=None,
              help="What runs the instances (default: the scenario's `engine`): vLLM runs fewer templates.")
@click.option("--demand-mix", type=click.Choice(MIXES), default="uniform", show_default=True,
              help="Move 80% of requests to the largest or smallest third of the models (total kept).")
@click.option("--running", "running_id", default=None,
              help="Plan id (or `latest`: the scenario's newest plan of --method) of the plan running now; "
                   "launching beyond it pays the churn penalty.")
@click.option("--scarcity", type=click.Choice(["none", "scale", "fair"]), default="none", show_default=True,
              help="When demand cannot be met: error (none), scale every model alike, or max-min fair share.")
@click.option("--max-nodes", type=click.IntRange(min=1), default=DEFAULT_MAX_NODES, show_default=True,
              help="Work limit: branch-and-bound nodes per MIP (the same plan on an idle or a loaded machine).")
@click.option("--time-limit-s", type=POSITIVE, default=SAFETY_NET_S, show_default=True,
              help="Wall-clock safety net of a solve; a plan it stops is reported as not reproducible.")
@click.option("--closed-loop/--no-closed-loop", default=True, show_default=True,
              help="As `coral run`: simulate the plan on each model's own trace and re-plan with more capacity for "
                   "models below their attainment target (at most 3 plans); off: the capacity rule's plan alone.")
@click.option("--store/--no-store", "save", default=True, show_default=True,
              help="Write the plan to the DuckDB file (tables plans, plan_instances).")
@t_hat_rule_option
@prices_path_option
@db_option
@json_option
def plan(scenario: str, method: str, availability_scale: float, engine: str | None, demand_mix: str,
         running_id: str | None, scarcity: str, max_nodes: int, time_limit_s: float, closed_loop: bool, save: bool,
         t_hat_rule: str | None, prices_path: str | None, db_path: str | None, as_json: bool) -> None:
    """Choose how many instances of which templates to run in which region, at least cost.

    Demand per (model, phase) is the scenario's request rate × the trace's mean prompt (prefill) or output
    (decode) tokens × its headroom. Prints instances, served vs demanded tokens/s, cost, the LP-relaxation
    bound and gap; under scarcity, which models and node configurations bind.
    """
    from coral_dagster.app.documents import plan_to_doc
    from coral_dagster.app.make_plan import PlanRequest, make_plan

    result = make_plan(PlanRequest(
        scenario, method, scarcity=None if scarcity == "none" else scarcity, availability_scale=availability_scale,
        demand_mix=demand_mix, t_hat_rule=t_hat_rule, engine=engine, max_nodes=max_nodes, time_limit_s=time_limit_s,
        closed_loop=closed_loop, running=running_id, db_path=db_path, prices_path=prices_path, save=save)).plan
    if as_json:
        emit_json(plan_to_doc(result))
    else:
        _print_plan(result)


@click.group("bench")
def bench() -> None:
    """Benchmarks that put Coral beside its baselines and the paper's figures."""


@bench.command("allocation")
@click.option("--scenarios", default="core,extended", show_default=True,
              help=f"Comma-separated scenarios, each {SCENARIO_HELP}.")
@click.option("--settings", default="default,imbalanced,scarcity,replan,attainment", show_default=True,
              help="Comma-separated: default, imbalanced, scarcity, replan, attainment (each method's cost at "
                   "equal simulated attainment beside its fixed-demand cost: closed loops and held-out "
                   "simulations, the longest setting).")
@click.option("--helix/--no-helix", default=True, show_default=True, help="Also run Helix vs Coral on its cluster.")
@click.option("--helix-slo-ms", default="20000,1000", show_default=True,
              help="prefill,decode SLO (ms) of the Helix comparison; `scenario` keeps the scenario's.")
@click.option("--sim-duration-s", type=NON_NEGATIVE, default=120.0, show_default=True,
              help="Seconds of arrivals each plan is simulated for (simulated goodput); 0 skips it.")
@click.option("--sim-trace", default="poisson", show_default=True,
              help="Arrivals of the simulation: poisson, gamma, scenario (each model's trace), azure-conv, azure-code.")
@click.option("--sim-replan/--no-sim-replan", default=True, show_default=True,
              help="Also simulate every re-planning window.")
@click.option("--attainment-seeds", default="11,12,13,14", show_default=True,
              help="Held-out seeds of the attainment setting (the closed loop uses seed 0).")
@click.option("--attainment-duration-s", type=POSITIVE, default=600.0, show_default=True,
              help="Seconds of each held-out simulation of the attainment setting.")
@click.option("--out", "out_path", type=click.Path(dir_okay=False), default=None,
              help="Also write the JSON document here, and its plot beside it (same name, .png).")
@prices_path_option
@db_option
@json_option
def allocation(scenarios: str, settings: str, helix: bool, helix_slo_ms: str, sim_duration_s: float, sim_trace: str,
               sim_replan: bool, attainment_seeds: str, attainment_duration_s: float, out_path: str | None,
               prices_path: str | None, db_path: str | None, as_json: bool) -> None:
    """Coral, Homo-ILP, Homo and Cauchy on the same inputs: cost, ratio to Coral, goodput, churn, solve time."""
    from tqdm import tqdm

    BenchConfig, run_allocation_bench = _harness().BenchConfig, _harness().run_allocation_bench
    from coral_dagster.app.scenario_plans import library_templates

    slo = None if helix_slo_ms == "scenario" else tuple(float(x) for x in helix_slo_ms.split(","))
    config = BenchConfig(scenarios=tuple(s for s in scenarios.split(",") if s),
                         settings=tuple(s for s in settings.split(",") if s), helix=helix, helix_slo_ms=slo,
                         sim_duration_s=sim_duration_s, sim_trace=sim_trace, sim_replan=sim_replan,
                         attainment_seeds=tuple(int(x) for x in attainment_seeds.split(",") if x),
                         attainment_duration_s=attainment_duration_s, prices_path=prices_path)
    progress = None if as_json else (lambda it, desc: tqdm(list(it), desc=desc))
    doc = run_allocation_bench(lambda scn: library_templates(scn, db_path), config, progress=progress)
    png = _harness().write_bench(doc, out_path) if out_path else None
    if as_json:
        emit_json(doc)
    else:
        print_bench(doc)
        if out_path:
            click.echo(f"wrote {out_path} and {png}")


def _harness():
    """The allocation bench (`coral_dagster.app.allocation_bench`), imported when a bench command runs."""
    from coral_dagster.app import allocation_bench

    return allocation_bench


def print_bench(doc: dict) -> None:
    """The benchmark's tables (library preparation, one row per setting × scenario × method with fluid and
    simulated goodput, equal attainment, re-planning), then Helix's comparison as JSON."""
    for title, table in _harness().bench_tables(doc):
        emit_table(table, title=title)
    if doc.get("helix"):
        click.echo(json.dumps(doc["helix"], indent=2, default=str))
    if "wall_s" in doc:
        click.echo(f"wall time {doc['wall_s']:.1f} s")
