"""The allocation benchmark: every method on the same inputs in the paper's settings, and Helix on its cluster.

Settings (coral.md §6): `core` and `extended` with default demand; imbalanced demand (80% of requests to the
largest or smallest third of the models); scarcity, where the offered availability is 25% or 75% above what the
estimated demand needs, planned with uniform demand scaling. "What it needs" is σ*·A, σ* the least uniform
scale of the availability A at which the LP over Coral's templates serves the demand; scaling A itself down
rounds 16 nodes per offer to 1 or 2 and loses the setting, so the demand is scaled up by 1/(1.25·σ*) or
1/(1.75·σ*) instead (σ* is linear in demand, so the ratio of availability to need is the same). Re-planning
every 6 minutes over 30 minutes with each model's rate following its trace window by window (churn priced
against the running plan for the ILP methods; the greedy baselines re-plan from scratch). Helix vs Coral on
Helix's fixed cluster.

Goodput is given twice per plan: fluid (`goodput.fluid_goodput`, the served share of each model's scarcer phase)
and simulated (the request-level simulator serving the rates the plan was made for, without the planning
headroom; under scarcity the full offered rates, of which the plan serves only part). Each scenario's template
libraries (Coral's and the homogeneous baselines') are prepared once before any timed solve; that time is
reported apart from the solve times.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

from coral_dagster.allocation.demand import window_rates
from coral_dagster.allocation.baselines import homogeneous_problem
from coral_dagster.allocation.goodput import GoodputEstimator, fluid_goodput
from coral_dagster.allocation.colgen import min_availability_scale, solve_max_level
from coral_dagster.allocation.inputs import scenario_problem, scenario_rates, scenario_traces
from coral_dagster.allocation.methods import ALLOCATION_METHODS, make_plan
from coral_dagster.allocation.problem import AllocationProblem
from coral_dagster.allocation.prune import PruneReport, prune_columns
from coral_dagster.allocation.types import Plan, Scarcity
from coral_dagster.catalog.market import MarketSnapshot
from coral_dagster.catalog.scenarios import Scenario, load_scenario
from coral_dagster.errors import CoralError, InfeasibleError
from coral_dagster.templates.types import Template

if TYPE_CHECKING:
    import pandas as pd

TemplateSource = Callable[[Scenario], Sequence[Template]]
Simulator = Callable[[Scenario, Mapping[str, float]], GoodputEstimator]
SCARCITY_HEADROOM = (1.25, 1.75)
MIXES = ("large-heavy", "small-heavy")


@dataclass(frozen=True)
class BenchConfig:
    """What the benchmark runs and how long each solve may take."""

    scenarios: tuple[str, ...] = ("core", "extended")
    methods: tuple[str, ...] = ALLOCATION_METHODS
    time_limit_s: dict[str, float] = field(default_factory=lambda: {"core": 10.0, "extended": 60.0})
    replan_window_min: float = 6.0
    replan_horizon_min: float = 30.0
    helix: bool = True
    helix_time_limit_s: float = 120.0
    # Helix publishes no SLO, and the scenario's 1500/80 ms cannot be met on this cluster by a 70B fp16 model
    # (one layer's decode step takes 1.34 ms on an A100-40GB, 80 layers 107 ms): compare at a throughput-oriented
    # SLO instead (prefill ms, decode ms per token); None keeps the scenario's.
    helix_slo_ms: tuple[float, float] | None = (20000.0, 1000.0)
    settings: tuple[str, ...] = ("default", "imbalanced", "scarcity", "replan", "attainment")
    # Simulated goodput: seconds of arrivals per plan (0: no simulation), arrival process and seed. Poisson
    # arrivals at exactly the planned rates with the traces' request lengths: a replayed trace's short windows run
    # well off its mean rate, so they would measure the window rather than the plan.
    sim_duration_s: float = 120.0
    sim_trace: str = "poisson"
    sim_seed: int = 0
    sim_replan: bool = True
    # Equal attainment (`app.equal_attainment`): held-out seeds and seconds per seed, solver limit per solve.
    attainment_seeds: tuple[int, ...] = (11, 12, 13, 14)
    attainment_duration_s: float = 600.0
    attainment_time_limit_s: float = 30.0
    # A price CSV (`coral bench allocation --prices`) every market is priced from; None: the bundled rows.
    prices_path: str | None = None


def bench_simulator(config: BenchConfig) -> Simulator | None:
    """(scenario, rates per model) -> a simulated GoodputEstimator at those rates; None when simulation is off."""
    if config.sim_duration_s <= 0:
        return None
    from coral_dagster.simulator.latency import ProfileLatencyModel
    from coral_dagster.simulator.simulate import goodput_estimator

    latency = ProfileLatencyModel()  # shared: its per-stage latency tables are built once for every plan

    def make(scenario: Scenario, rates: Mapping[str, float]) -> GoodputEstimator:
        return goodput_estimator(scenario, trace=config.sim_trace, duration_s=config.sim_duration_s,
                                 seed=config.sim_seed, latency=latency, rates=dict(rates))

    return make


def sim_columns(plan: Plan, simulated: GoodputEstimator | None, headroom: float) -> dict:
    """Simulated goodput of a plan as row fields (empty values when there is no simulator)."""
    if simulated is None:
        return {"goodput_sim_fraction": None}
    t0 = time.perf_counter()
    g = simulated(plan, headroom)
    return {"goodput_sim_fraction": g.fraction, "goodput_sim_tokens_per_s": g.tokens_per_s,
            "sim_attainment_by_model": dict(g.per_model), "sim_s": time.perf_counter() - t0}


def plan_row(setting: str, scenario: str, plan: Plan, goodput: GoodputEstimator, headroom: float,
             extra: dict | None = None, simulated: GoodputEstimator | None = None) -> dict:
    """One method's plan as a benchmark row: fluid goodput from `goodput`, simulated from `simulated`."""
    g = goodput(plan, headroom)
    return {
        "setting": setting, "scenario": scenario, "method": plan.method, "status": plan.status,
        "cost_usd_per_hour": plan.cost_usd_per_hour, "goodput_tokens_per_s": g.tokens_per_s,
        "goodput_fraction": g.fraction, "goodput_estimator": g.estimator,
        **sim_columns(plan, simulated, headroom), "demand_scale": plan.demand_scale,
        "solve_s": plan.solve_s, "gap_to_lp": _num(plan.gap),
        "gap_to_mip_bound": _num((plan.objective_usd_per_hour - plan.mip_bound_usd_per_hour)
                                 / plan.objective_usd_per_hour) if plan.objective_usd_per_hour > 0 else None,
        "instances": sum(i.count for i in plan.instances),
        "nodes": sum(plan.nodes_used().values()),
        "mixed_instances": sum(i.count for i in plan.instances if len(i.template.nodes.counts) > 1),
        **(extra or {}),
    }


def _num(x: float) -> float | None:
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None


def _run_methods(setting: str, scenario: Scenario, problem, config: BenchConfig, goodput: GoodputEstimator,
                 scarcity_mode: Scarcity | None = None, extra: dict | None = None,
                 simulated: GoodputEstimator | None = None) -> list[dict]:
    rows = []
    for method in config.methods:
        try:
            mode: Scarcity | None = scarcity_mode
            note: str | None = None
            try:
                plan = make_plan(problem, method, scarcity_mode=mode,
                                 time_limit_s=config.time_limit_s.get(scenario.name, 30.0))
            except InfeasibleError:
                if mode is not None:
                    raise
                # A method that cannot meet the demand shows what it serves: the largest common fraction.
                mode, note = "scale", "cannot meet the demand within availability: largest common fraction served"
                plan = make_plan(problem, method, scarcity_mode=mode,
                                 time_limit_s=config.time_limit_s.get(scenario.name, 30.0))
            row = plan_row(setting, scenario.name, plan, goodput, scenario.headroom, extra, simulated)
            if note:
                row["note"] = note
            rows.append(row)
        except CoralError as exc:
            rows.append({"setting": setting, "scenario": scenario.name, "method": method, "status": "error",
                         "error": str(exc), **(extra or {})})
    coral = next((r for r in rows if r["method"] == "coral" and r.get("cost_usd_per_hour")), None)
    for r in rows:
        if coral and r.get("cost_usd_per_hour") is not None:
            r["cost_ratio_to_coral"] = r["cost_usd_per_hour"] / coral["cost_usd_per_hour"]
            r["goodput_ratio_coral_over"] = (coral["goodput_tokens_per_s"] / r["goodput_tokens_per_s"]
                                             if r["goodput_tokens_per_s"] > 0 else None)
    return rows


def scarcity_scale(scenario: Scenario, templates: Sequence[Template], market: MarketSnapshot | None = None) -> float:
    """σ*: the least uniform availability scale at which Coral's LP serves the estimated demand (on `market`,
    default the scenario's)."""
    problem = scenario_problem(scenario, templates, market)
    columns, _ = prune_columns(problem)
    return min_availability_scale(problem, columns)


def replan_rows(scenario: Scenario, templates: Sequence[Template], config: BenchConfig,
                goodput: GoodputEstimator, simulator: Simulator | None = None,
                prices: pd.DataFrame | None = None) -> tuple[list[dict], list[dict]]:
    """Re-plan every window with the trace-following rates, on the scenario's market priced from `prices` (a price
    file's rows; default the bundled ones); per method a summary and per window a row (each window's plan
    simulated at that window's rates when `simulator` is given)."""
    rates = scenario_rates(scenario)
    windows = window_rates(rates, scenario_traces(scenario), config.replan_window_min, config.replan_horizon_min)
    market = scenario.market(prices=prices)
    summary: list[dict[str, Any]] = []
    detail: list[dict] = []
    for method in config.methods:
        running: dict = {}
        costs, solves, gaps, launched, torn_down, statuses, fractions, sim_fractions = [], [], [], 0, 0, [], [], []
        for w, window in enumerate(windows):
            problem = scenario_problem(scenario, templates, market, rates=window,
                                       running=running if method in ("coral", "homo-ilp") else {})
            try:
                plan = make_plan(problem, method, time_limit_s=config.time_limit_s.get(scenario.name, 30.0))
            except CoralError:
                plan = make_plan(problem, method, scarcity_mode="scale",
                                 time_limit_s=config.time_limit_s.get(scenario.name, 30.0))
            counts = plan.counts()
            up = sum(max(0, n - running.get(k, 0)) for k, n in counts.items())
            down = sum(max(0, n - counts.get(k, 0)) for k, n in running.items())
            if w > 0:
                launched += up
                torn_down += down
            g = goodput(plan, scenario.headroom)
            costs.append(plan.cost_usd_per_hour)
            solves.append(plan.solve_s)
            gaps.append(plan.gap)
            statuses.append(plan.status)
            fractions.append(g.fraction)
            sim = sim_columns(plan, simulator(scenario, window) if simulator else None, scenario.headroom)
            if sim["goodput_sim_fraction"] is not None:
                sim_fractions.append(sim["goodput_sim_fraction"])
            detail.append({"scenario": scenario.name, "method": method, "window": w,
                           "minute": w * config.replan_window_min, "rates_req_s": window,
                           "cost_usd_per_hour": plan.cost_usd_per_hour,
                           "churn_usd_per_hour": plan.churn_usd_per_hour, "launched": up, "torn_down": down,
                           "solve_s": plan.solve_s, "gap_to_lp": _num(plan.gap), "status": plan.status,
                           "goodput_fraction": g.fraction, **sim})
            running = counts
        finite_gaps = [g for g in gaps if isinstance(g, float) and math.isfinite(g)]
        summary.append({"scenario": scenario.name, "method": method, "windows": len(windows),
                        "mean_cost_usd_per_hour": statistics.fmean(costs), "launched": launched,
                        "torn_down": torn_down, "solve_s_mean": statistics.fmean(solves),
                        "solve_s_max": max(solves), "gap_to_lp_max": max(finite_gaps) if finite_gaps else None,
                        "goodput_fraction_mean": statistics.fmean(fractions),
                        "goodput_sim_fraction_mean": statistics.fmean(sim_fractions) if sim_fractions else None,
                        "statuses": statuses})
    coral = next((r for r in summary if r["method"] == "coral"), None)
    for r in summary:
        if coral:
            r["cost_ratio_to_coral"] = r["mean_cost_usd_per_hour"] / coral["mean_cost_usd_per_hour"]
    return summary, detail


def helix_section(templates_for: TemplateSource, config: BenchConfig, goodput: GoodputEstimator,
                  prices: pd.DataFrame | None = None) -> dict:
    """Helix's max-flow placement vs Coral restricted to the same cluster (availability = the cluster), priced
    from `prices` (a price file's rows; default the bundled ones)."""
    from coral_dagster.allocation.helix import helix_plan

    scenario = load_scenario("helix")
    if config.helix_slo_ms:
        pre, dec = config.helix_slo_ms
        scenario = replace(scenario, models=tuple(replace(m, prefill_slo_ms=pre, decode_slo_ms=dec)
                                                  for m in scenario.models))
    market = scenario.market(prices=prices)
    hplan, hres = helix_plan(scenario, time_limit_s=config.helix_time_limit_s, market=market)
    templates = templates_for(scenario)
    problem = scenario_problem(scenario, templates, market)
    out: dict[str, Any] = {
        "slo_ms": {"prefill": scenario.models[0].prefill_slo_ms, "decode": scenario.models[0].decode_slo_ms},
        "cluster_nodes": sum(o.available_nodes for o in market.offers),
        "cluster_usd_per_hour": sum(o.usd_per_hour * o.available_nodes for o in market.offers),
        "helix": {"status": hres.status, "throughput_req_s": hres.throughput_req_s,
                  "bound_req_s": hres.bound_req_s, "solve_s": hres.solve_s,
                  "cost_usd_per_hour": hplan.cost_usd_per_hour,
                  "nodes_used": sum(1 for n in hres.nodes if n.used and n.flow_req_s > 1e-9)},
        "templates": len(problem.templates)}
    try:
        coral = make_plan(problem, "coral", time_limit_s=config.helix_time_limit_s)
        out["coral_min_cost"] = plan_row("helix", scenario.name, coral, goodput, scenario.headroom)
    except CoralError as exc:
        out["coral_min_cost"] = {"status": "error", "error": str(exc)}
    # Coral's most throughput on the cluster: the largest common fraction of a demand far above what fits.
    big = problem.with_changes(demand_tokens_per_s=problem.scaled_demand(100.0))
    columns, _ = prune_columns(big)
    keys = [k for k, d in big.demand_tokens_per_s.items() if d > 0]
    t0 = time.perf_counter()
    most = solve_max_level(big, columns, {"all": keys}, time_limit_s=config.helix_time_limit_s)
    req_s = 100.0 * scenario.models[0].rate_req_s * scenario.headroom
    if most.status in ("optimal", "feasible-time-limit"):
        out["coral_max_throughput"] = {"status": most.status, "throughput_req_s": most.level * req_s,
                                       "bound_req_s": min(1.0, most.bound) * req_s,
                                       "solve_s": time.perf_counter() - t0,
                                       "cost_usd_per_hour": sum(c.usd_per_hour * v for c, v in
                                                                zip(columns, most.values))}
        out["coral_max_throughput_req_s"] = most.level * req_s
    if out.get("coral_min_cost", {}).get("cost_usd_per_hour") and hplan.cost_usd_per_hour:
        out["coral_cost_saving_vs_helix"] = 1 - out["coral_min_cost"]["cost_usd_per_hour"] / hplan.cost_usd_per_hour
    if out.get("coral_max_throughput_req_s") and hres.throughput_req_s > 0:
        out["coral_throughput_gain_vs_helix"] = out["coral_max_throughput_req_s"] / hres.throughput_req_s - 1
    return out


def equal_attainment_rows(scenario: Scenario, templates: Sequence[Template], config: BenchConfig,
                          prices: pd.DataFrame | None = None) -> list[dict]:
    """Per method its fixed-demand cost and the cost at which its plan, sized by the capacity rule and the closed
    loop, meets the attainment target on held-out windows of the scenario's traces (`app.equal_attainment`),
    with both as ratios to Coral's; priced from `prices` (a price file's rows; default the bundled ones)."""
    from types import SimpleNamespace

    from coral_dagster.app.equal_attainment import row_for, with_ratios

    args = SimpleNamespace(time_limit_s=config.attainment_time_limit_s, duration_s=config.attainment_duration_s,
                           relax="2,4")
    return with_ratios([row_for(scenario, method, templates, args, list(config.attainment_seeds), prices=prices)
                        for method in config.methods])


def prepare_libraries(problem: AllocationProblem) -> tuple[float, PruneReport]:
    """Prepare (dominance once per library) Coral's and the homogeneous baselines' libraries of a scenario, so
    no timed solve pays it; returns the seconds it took and Coral's pruning report."""
    t0 = time.perf_counter()
    _, report = prune_columns(problem)
    prune_columns(homogeneous_problem(problem))
    return time.perf_counter() - t0, report


def bench_notes(config: BenchConfig) -> list[str]:
    """What the reader of the JSON needs to know about how the figures were taken."""
    notes = ["solve_s excludes library preparation (libraries[scenario].prepare_s, once per library).",
             "goodput_fraction: fluid estimate; goodput_sim_fraction: simulated SLO-meeting tokens over offered "
             "tokens at the rates the plan was made for (no headroom; under scarcity the full offered rates)."]
    if config.sim_duration_s <= 0:
        notes.append("simulation disabled (sim_duration_s = 0): goodput_sim_fraction is empty.")
    elif not config.sim_replan:
        notes.append("re-plan windows not simulated (sim_replan = False).")
    if config.helix:
        notes.append("Helix section: fluid goodput only.")
    return notes


def run_allocation_bench(templates_for: TemplateSource, config: BenchConfig = BenchConfig(), *,
                         goodput: GoodputEstimator = fluid_goodput,
                         progress: Callable[[Iterable, str], Iterable] | None = None) -> dict:
    """Run every setting, every market priced from `config.prices_path` (default: the bundled rows); returns the
    JSON document `bench/results/allocation.json` holds."""
    from coral_dagster.app.prices import price_table

    step = progress or (lambda it, _desc: it)
    prices = price_table(config.prices_path)
    started = time.perf_counter()
    rows: list[dict] = []
    replan_summary: list[dict] = []
    replan_detail: list[dict] = []
    attainment: list[dict] = []
    libraries = {}
    simulator = bench_simulator(config)
    for name in step(config.scenarios, "scenarios"):
        scenario = load_scenario(name)
        t0 = time.perf_counter()
        templates = templates_for(scenario)
        market = scenario.market(prices=prices)
        problem = scenario_problem(scenario, templates, market)
        load_s = time.perf_counter() - t0
        prepare_s, report = prepare_libraries(problem)
        libraries[name] = {"templates": len(problem.templates), "load_s": load_s, "prepare_s": prepare_s,
                           "pruning": report.as_dict(),
                           "demand_tokens_per_s": {f"{m}/{p}": d for (m, p), d in problem.demand_tokens_per_s.items()}}
        base_rates = scenario_rates(scenario)

        def sim_at(rates: Mapping[str, float]) -> GoodputEstimator | None:
            return simulator(scenario, rates) if simulator else None

        if "default" in config.settings:
            rows += _run_methods("default", scenario, problem, config, goodput, simulated=sim_at(base_rates))
        if "imbalanced" in config.settings:
            for mix in MIXES:
                mixed = scenario_problem(scenario, templates, market, demand_mix=mix)
                rows += _run_methods(f"imbalanced:{mix}", scenario, mixed, config, goodput, extra={"mix": mix},
                                     simulated=sim_at(scenario_rates(scenario, mix)))
        if "scarcity" in config.settings:
            sigma = scarcity_scale(scenario, templates, market)
            libraries[name]["sigma_star"] = sigma
            for head in SCARCITY_HEADROOM:
                factor = 1.0 / (head * sigma)
                scarce = problem.with_changes(demand_tokens_per_s=problem.scaled_demand(factor))
                rows += _run_methods(f"scarcity:+{round((head - 1) * 100)}%", scenario, scarce, config, goodput,
                                     scarcity_mode="scale", extra={"demand_factor": factor},
                                     simulated=sim_at({m: r * factor for m, r in base_rates.items()}))
        if "attainment" in config.settings:
            attainment += equal_attainment_rows(scenario, templates, config, prices)
        if "replan" in config.settings:
            summary, detail = replan_rows(scenario, templates, config, goodput,
                                          simulator if config.sim_replan else None, prices)
            replan_summary += summary
            replan_detail += detail
    helix = helix_section(templates_for, config, goodput, prices) if config.helix else None
    return {
        "generated_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "solver": "HiGHS via PuLP"},
        "config": {"scenarios": list(config.scenarios), "methods": list(config.methods),
                   "time_limit_s": dict(config.time_limit_s), "settings": list(config.settings),
                   "replan_window_min": config.replan_window_min, "replan_horizon_min": config.replan_horizon_min,
                   "helix_time_limit_s": config.helix_time_limit_s, "prices": config.prices_path or "bundled",
                   "simulation": {"duration_s": config.sim_duration_s, "arrivals": config.sim_trace,
                                  "seed": config.sim_seed, "replan": config.sim_replan}},
        "notes": bench_notes(config),
        "libraries": libraries,
        "rows": rows,
        "replan": replan_summary,
        "replan_windows": replan_detail,
        "equal_attainment": attainment,
        "helix": helix,
        "wall_s": time.perf_counter() - started,
    }


ROW_COLUMNS = ("setting", "scenario", "method", "status", "cost_usd_per_hour", "cost_ratio_to_coral",
               "goodput_fraction", "goodput_sim_fraction", "solve_s", "gap_to_lp", "instances", "mixed_instances")
REPLAN_COLUMNS = ("scenario", "method", "windows", "mean_cost_usd_per_hour", "cost_ratio_to_coral", "launched",
                  "torn_down", "solve_s_mean", "solve_s_max", "gap_to_lp_max", "goodput_fraction_mean",
                  "goodput_sim_fraction_mean")


def bench_tables(doc: dict) -> list[tuple[str, pd.DataFrame]]:
    """The benchmark document as printable tables: [(title, DataFrame)] — library preparation, the rows (fluid
    and simulated goodput side by side) and re-planning."""
    import pandas as pd

    tables = []
    if doc.get("libraries"):
        libs = pd.DataFrame([{"scenario": name, "templates": lib.get("templates"), "load_s": lib.get("load_s"),
                              "prepare_s": lib.get("prepare_s"), "sigma_star": lib.get("sigma_star")}
                             for name, lib in doc["libraries"].items()])
        tables.append(("library preparation, once per library (not in solve_s)", libs))
    if doc.get("rows"):
        tables.append(("allocation: cost, goodput (fluid | simulated) and solve time per method",
                       pd.DataFrame(doc["rows"]).reindex(columns=list(ROW_COLUMNS))))
    if doc.get("equal_attainment"):
        from coral_dagster.app.equal_attainment import HEADER

        tables.append(("equal attainment: each method's cost at which its plan meets the target on held-out trace "
                       "windows, beside its fixed-demand cost", pd.DataFrame(doc["equal_attainment"]).reindex(
                           columns=list(HEADER))))
    if doc.get("replan"):
        window = doc.get("config", {}).get("replan_window_min", 6.0)
        horizon = doc.get("config", {}).get("replan_horizon_min", 30.0)
        tables.append((f"re-planning every {window:g} min over {horizon:g} min",
                       pd.DataFrame(doc["replan"]).reindex(columns=list(REPLAN_COLUMNS))))
    return tables


def write_bench(doc: dict, out_path: str) -> str:
    """The bench's JSON document written to `out_path` and its plot beside it (same name, .png); the plot's
    path."""
    import json
    from pathlib import Path

    from coral_dagster.files import make_dir, write_file
    from coral_dagster.plots import bench_png

    out = Path(out_path)
    make_dir(out.parent, "pass another --out path")
    write_file(out, json.dumps(doc, indent=2, default=str), fix="pass another --out path")
    write_file(out.with_suffix(".png"), bench_png(doc), fix="pass another --out path")
    return str(out.with_suffix(".png"))
