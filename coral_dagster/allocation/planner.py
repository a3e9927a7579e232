"""Coral's planner: prune, solve the LP relaxation and the ILP, fall back to a scarcity mode, build the Plan."""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Mapping, Sequence

from coral_dagster.allocation import colgen, ilp, lagrange, lns, scarcity
from coral_dagster.allocation.problem import AllocationProblem, DemandKey
from coral_dagster.allocation.prune import Column, prune_columns
from coral_dagster.allocation.types import AdmissionLimits, Bottleneck, PlannedInstance, Plan, Scarcity
from coral_dagster.catalog.scenarios import ScenarioModel
from coral_dagster.errors import CoralError, InfeasibleError, SolverTimeoutError
from coral_dagster.vocab import DEMAND_PHASES, DemandPhase, Method, SolveStatus
from coral_dagster.highs import DEFAULT_MAX_NODES, SAFETY_NET_S, nodes_explored

# An incumbent plan counts as meeting demand when every model's routed share is within this of 1 (HiGHS's
# feasibility tolerance is 1e-6) or its objective within this of the solver's.
INCUMBENT_TOL = 1e-6
RUNNING = "the running plan"  # the incumbent a re-plan starts from

SCARCITY_FIX = ("raise availability (`--availability-scale`), lower demand, or plan under scarcity with "
                "`--scarcity scale` (every model scaled down alike) or `--scarcity fair` (max-min fair share).")


def served_tokens(problem: AllocationProblem, instances: Sequence[PlannedInstance]) -> dict[DemandKey, float]:
    """Tokens/s the instances give each demand key."""
    out = {k: 0.0 for k in problem.demand_tokens_per_s}
    for inst in instances:
        for key in problem.serves(inst.template):
            out[key] += inst.count * problem.contribution(inst.template, key[1])
    return out


def churn_usd_per_hour(problem: AllocationProblem, instances: Sequence[PlannedInstance]) -> float:
    """K × the price of every instance launched beyond the running plan (0 when nothing runs)."""
    if not any(n > 0 for n in problem.running.values()):
        return 0.0
    return sum(max(0, i.count - problem.running.get((i.template.template_id, i.region), 0)) * i.usd_per_hour
               for i in instances) * problem.churn_k


def build_plan(problem: AllocationProblem, method: Method, status: SolveStatus, instances: list[PlannedInstance],
               *, lp_bound: float, mip_bound: float = math.nan, solve_s: float, demand_scale: float = 1.0,
               notes: Sequence[str] = (), bottlenecks: Sequence[Bottleneck] = (), pruning=None,
               timings: Mapping[str, float] | None = None, work_nodes: int = 0) -> Plan:
    """Assemble a Plan: cost, churn and gaps recomputed from the instances, never taken from a solver; the proven
    bound is the best of the solver's and the LP's (each bounds every plan), never above the plan's objective."""
    instances = sorted(instances, key=lambda i: (i.template.model, i.template.phase, i.region, i.template.template_id))
    cost = sum(i.count * i.usd_per_hour for i in instances)
    churn = churn_usd_per_hour(problem, instances)
    objective = cost + churn
    gap = (objective - lp_bound) / objective if objective > 0 and math.isfinite(lp_bound) else (
        0.0 if objective == 0 else math.nan)
    proven = max([b for b in (mip_bound, lp_bound) if math.isfinite(b)], default=math.nan)
    if math.isfinite(proven):
        proven = min(proven, objective)
    return Plan(scenario=problem.scenario, method=method, status=status, cost_usd_per_hour=cost,
                lp_bound_usd_per_hour=lp_bound, gap=max(0.0, gap) if math.isfinite(gap) else gap, solve_s=solve_s,
                instances=tuple(instances), demand_tokens_per_s=dict(problem.demand_tokens_per_s),
                served_tokens_per_s=served_tokens(problem, instances), demand_scale=demand_scale,
                notes=tuple(notes), churn_usd_per_hour=churn, mip_bound_usd_per_hour=proven,
                bottlenecks=tuple(bottlenecks), pruning=pruning, snapshot_id=problem.snapshot_id,
                scenario_key=problem.scenario_key, timings_s=dict(timings or {}),
                admission=AdmissionLimits(capacity_factors=dict(problem.capacity_factors)), work_nodes=work_nodes)


def _instances(columns: Sequence[Column], values: Sequence[float]) -> list[PlannedInstance]:
    return [PlannedInstance(c.template, c.region, int(v), c.usd_per_hour) for c, v in zip(columns, values) if v > 0]


def _refuse_unmet_slo(problem: AllocationProblem, missing: Sequence[DemandKey]) -> None:
    """Raise when a key lacks columns because no template meets its SLO on the scenario's nodes at all: then no
    availability helps, and the diagnosis (which speaks of availability) would point the wrong way."""
    kinds = {(t.model, p) for t in problem.templates for p in (DEMAND_PHASES if t.phase == "aggregated"
                                                                 else (t.phase,))}
    unmet = [k for k in missing if k not in kinds]
    if unmet:
        what = "; ".join(f"{m} {p} ({p}_slo_ms)" for m, p in unmet)
        raise InfeasibleError(f"no template on the scenario's nodes meets the SLO of {what}, so no availability "
                              "can meet that demand.", "raise that SLO in the scenario file, or add faster GPUs (or "
                              "more nodes per template: `gpus_per_node`, `templates: {n_max}`) to it.")


def unserved_keys(problem: AllocationProblem, columns: Sequence[Column]) -> list[DemandKey]:
    """Demand keys no column can serve at all."""
    kinds = {(c.template.model, c.template.phase) for c in columns}
    covered = {(m, p) for m, ph in kinds for p in (DEMAND_PHASES if ph == "aggregated" else (ph,))}
    return [k for k, d in sorted(problem.demand_tokens_per_s.items()) if d > 0 and k not in covered]


def incumbent_counts(problem: AllocationProblem, columns: Sequence[Column],
                     counts: Mapping[tuple[str, str], int]) -> tuple[tuple[float, ...], float] | None:
    """`counts` per (template id, region) as counts per column with their objective (cost plus churn), or None
    when they use a column not there, exceed availability or leave some demand unmet: a plan to start from."""
    index = {(c.template.template_id, c.region): j for j, c in enumerate(columns)}
    values = [0.0] * len(columns)
    for key, n in counts.items():
        if n <= 0:
            continue
        if key not in index:
            return None
        values[index[key]] = float(n)
    held: dict[tuple, int] = {}
    for c, v in zip(columns, values):
        for node, k in c.template.nodes.counts:
            held[(c.region, node)] = held.get((c.region, node), 0) + int(v) * k
    if any(n > problem.available_nodes.get(key, 0) for key, n in held.items()):
        return None
    routed = ilp.routed_fractions(problem, columns, values)
    models = {k[0] for k, d in problem.demand_tokens_per_s.items() if d > 0}
    if any(routed.get(m, 0.0) < 1.0 - INCUMBENT_TOL for m in models):
        return None
    instances = _instances(columns, values)
    return tuple(values), sum(i.count * i.usd_per_hour for i in instances) + churn_usd_per_hour(problem, instances)


def _topped_up(problem: AllocationProblem, columns: Sequence[Column], result: ilp.SolveResult, time_limit_s: float,
               max_nodes: int | None, notes: list[str]) -> ilp.SolveResult:
    """When the solve found no plan: the running plan with the cheapest instances added (cost plus churn) that
    meet demand, none taken away (a small MIP: every running count is a lower bound), else `result` unchanged."""
    topped = ilp.min_cost(problem, columns, time_limit_s=time_limit_s, max_nodes=max_nodes, keep_running=True)
    if topped.status not in ilp.FEASIBLE:
        return result
    counts = {(c.template.template_id, c.region): int(v) for c, v in zip(columns, topped.values) if v > 0}
    found = incumbent_counts(problem, columns, counts)
    if found is None:
        return result
    notes.append(f"the solve found no plan within its limits: {RUNNING} topped up (nothing taken away), "
                 f"{found[1]:.2f} $/h, is returned")
    return replace(result, status=ilp.unproven(topped.status), values=found[0], objective=found[1], bound=math.nan)


def solve_plan(problem: AllocationProblem, *, method: Method = "coral", scarcity_mode: Scarcity | None = None,
               time_limit_s: float = SAFETY_NET_S, gap_rel: float = 1e-4, prune: bool = True,
               max_nodes: int | None = DEFAULT_MAX_NODES, incumbents: Mapping[str, Plan | None] | None = None,
               diagnose: bool = True) -> Plan:
    """The cheapest plan meeting demand (plus churn penalty against `problem.running`), each MIP at most
    `max_nodes` nodes (work: the same plan on any machine; `time_limit_s` is a wall-clock safety net).

    Never dearer than what it contains: the plan running now (when it still fits and meets demand) and every plan
    of `incumbents` (name -> plan on the same problem, e.g. the Homo-ILP plan) whose instances meet demand start
    the solve (the cheapest as HiGHS's first incumbent, their columns kept through pruning), and the cheapest of
    them is returned whenever the solve ends with nothing cheaper, its status saying the solve was cut short.
    Under scarcity, never serving less than an incumbent made under the same mode, nor at equal service costing
    more (`scarcity.never_serves_less`).
    When demand cannot be met: with no `scarcity_mode`, raise InfeasibleError naming the models and node
    configurations that bind (`diagnose`: False skips naming them); with `scale`, serve the largest common fraction
    of every model's demand; with `fair`, the max-min fair fractions; either way at least cost for what is served.
    Raises SolverTimeoutError when the limits pass before any plan is found.
    """
    if scarcity_mode not in (None, "scale", "fair"):
        raise CoralError(f"unknown scarcity mode {scarcity_mode!r}.", "use scale, fair, or none.")
    start = time.perf_counter()
    nodes_before = nodes_explored()
    timings: dict[str, float] = {}
    given = {name: p.counts() for name, p in (incumbents or {}).items() if p is not None}
    if any(n > 0 for n in problem.running.values()):
        given[RUNNING] = dict(problem.running)
    columns, report = prune_columns(problem, prune_dominated=prune, keep={tid for c in given.values() for tid, _ in c})
    timings["prune_s"] = time.perf_counter() - start
    start = time.perf_counter()  # `solve_s` is the solve alone; preparation and pruning are `prune_s`
    notes = [f"columns: {report.columns_before} (template, region) pairs -> {report.columns_after} after pruning "
             f"({report.not_sold} not sold, {report.no_demand} without demand, {report.dominated} dominated)"]
    missing = unserved_keys(problem, columns)
    if missing and scarcity_mode is None:
        _refuse_unmet_slo(problem, missing)
    wanted = any(d > 0 for d in problem.demand_tokens_per_s.values())
    if not wanted:
        return build_plan(problem, method, "optimal", [], lp_bound=0.0, mip_bound=0.0,
                          solve_s=time.perf_counter() - start, notes=notes, pruning=report.as_dict(),
                          timings=timings)
    limits = f"{max_nodes} nodes per MIP" if max_nodes is not None else "no work limit"
    feasible_lp = False
    if not missing:
        t0 = time.perf_counter()
        candidates = {name: incumbent_counts(problem, columns, counts) for name, counts in given.items()}
        found = {name: v for name, v in candidates.items() if v is not None}
        best_name = min(found, key=lambda name: (found[name][1], name)) if found else None
        for name, (_, obj) in sorted(found.items()):
            notes.append(f"incumbent: {name}, {obj:.2f} $/h (the plan is never dearer)")
        cg = colgen.solve_min_cost(problem, columns, time_limit_s=time_limit_s, gap_rel=gap_rel,
                                   start=found[best_name][0] if best_name else None, max_nodes=max_nodes)
        timings["solve_s"] = time.perf_counter() - t0
        notes.append(_speedup_note(cg, len(columns)))
        feasible_lp = cg.lp_status == "optimal"
        result = cg.result
        if best_name is not None and (result.status not in ilp.FEASIBLE
                                      or result.objective > found[best_name][1] + INCUMBENT_TOL):
            solved = f"{result.objective:.2f} $/h" if result.status in ilp.FEASIBLE else result.status
            notes.append(f"the solve ended ({solved}) no cheaper than {best_name}: that plan is returned")
            bound = result.bound if result.status in ilp.FEASIBLE else math.nan
            result = replace(result, status=ilp.unproven(result.status), values=found[best_name][0],
                             objective=found[best_name][1], bound=bound)
            feasible_lp = True
        if feasible_lp and result.status == "no-solution" and RUNNING in given:
            result = _topped_up(problem, columns, result, time_limit_s, max_nodes, notes)
        if feasible_lp and result.status == "no-solution":
            raise SolverTimeoutError(
                f"the {method} allocation ILP found no plan within {limits} and {time_limit_s:g} s "
                f"({len(columns)} columns).", "raise `--max-nodes` (or the safety net `--time-limit-s`).")
        if feasible_lp and result.status != "infeasible":
            values, status = _searched(problem, columns, result.values, result.status, None, notes, timings,
                                       max_nodes, time_limit_s)
            proven = _bounded(problem, columns, values, status, None, result.bound, notes, timings, max_nodes,
                              time_limit_s)
            return build_plan(problem, method, status, _instances(columns, values),
                              lp_bound=cg.lp_objective, mip_bound=proven,
                              solve_s=time.perf_counter() - start, notes=_limit_notes(notes, status, limits),
                              pruning=report.as_dict(), timings=timings, work_nodes=nodes_explored() - nodes_before)
    if scarcity_mode is None and not diagnose:
        raise InfeasibleError(f"{method}: demand cannot be met with this availability.", SCARCITY_FIX)
    t0 = time.perf_counter()
    diag = scarcity.diagnose(problem, columns, integer=feasible_lp, time_limit_s=time_limit_s, max_nodes=max_nodes)
    timings["diagnose_s"] = time.perf_counter() - t0
    if scarcity_mode is None:
        raise InfeasibleError(f"{method}: {diag.message()}", SCARCITY_FIX)
    t0 = time.perf_counter()
    reach = scarcity.IlpReach(problem, columns, time_limit_s=time_limit_s, gap_rel=gap_rel, max_nodes=max_nodes)
    if scarcity_mode == "scale":
        level, targets, witness = scarcity.uniform_scale(reach)
        notes.append(scarcity.uniform_note({k[0]: v for k, v in targets.items()}, reach.first_bound))
        status, scale = "scaled", level
    else:
        levels, targets, witness = scarcity.fair_share(reach)
        notes.append("max-min fair share: " + ", ".join(f"{m} {f:.1%}" for m, f in sorted(levels.items())))
        status, scale = "fair-share", min(levels.values(), default=0.0)
    timings["scarcity_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    # The level solve's plan meets the targets: the cost solve starts from it (never dearer, prunes from the start).
    cg = colgen.solve_min_cost(problem, columns, targets, time_limit_s=time_limit_s, gap_rel=gap_rel,
                               start=witness, max_nodes=max_nodes)
    timings["solve_s"] = time.perf_counter() - t0
    values = cg.result.values
    if cg.result.status in ("infeasible", "no-solution"):
        if witness is None:
            raise SolverTimeoutError(
                f"the {method} scarcity plan found no solution within {limits} and {time_limit_s:g} s.",
                "raise `--max-nodes` (or the safety net `--time-limit-s`).")
        # The level solve's own counts reach the levels: a plan, not proven cheapest.
        values = witness
        notes.append(f"the cost solve at that level found no plan within {limits}: the counts of the level solve "
                     f"are the plan (not cost-minimised; raise `--max-nodes`)")
    notes.append(_speedup_note(cg, len(columns)))
    notes.append(f"status of the cost solve at that level: {cg.result.status}")
    solved = cg.result.status if cg.result.status in ilp.FEASIBLE else ilp.unproven()
    values, solved = _searched(problem, columns, values, solved, targets, notes, timings, max_nodes, time_limit_s)
    every = reach.statuses + [cg.result.status, solved]
    proven = _bounded(problem, columns, values, solved, targets, cg.result.bound, notes, timings, max_nodes,
                      time_limit_s)
    plan = build_plan(problem, method, status, _instances(columns, values),
                      lp_bound=cg.lp_objective, mip_bound=proven, solve_s=time.perf_counter() - start,
                      demand_scale=scale, notes=_limit_notes(notes, ilp.unproven(*every), limits),
                      bottlenecks=diag.bottlenecks, pruning=report.as_dict(), timings=timings,
                      work_nodes=nodes_explored() - nodes_before)
    # Under scarcity an incumbent made under the same mode (e.g. the Homo-ILP plan) bounds what is served.
    for name, other in sorted((incumbents or {}).items()):
        if other is not None and other.status == status:
            plan = scarcity.never_serves_less(plan, other, name)
    return plan


def _searched(problem: AllocationProblem, columns: Sequence[Column], values: Sequence[float], status: str,
              targets: Mapping[DemandKey, float] | None, notes: list[str], timings: dict[str, float],
              max_nodes: int | None, time_limit_s: float) -> tuple[Sequence[float], SolveStatus]:
    """Counts a solve left unproven, improved by large-neighbourhood search (`lns`), and their status: the search
    keeps the solve's limits, so a wall-clock stop in it makes the plan unreproducible too."""
    if status == "optimal":
        return values, "optimal"
    t0 = time.perf_counter()
    found = lns.improve(problem, columns, values, lambda v: _objective(problem, columns, v), targets,
                        max_nodes=max_nodes, time_limit_s=time_limit_s)
    timings["lns_s"] = time.perf_counter() - t0
    notes.append(found.note())
    return found.values, ilp.unproven(status, *found.statuses)


def _bounded(problem: AllocationProblem, columns: Sequence[Column], values: Sequence[float], status: str,
             targets: Mapping[DemandKey, float] | None, solver_bound: float, notes: list[str],
             timings: dict[str, float], max_nodes: int | None, time_limit_s: float) -> float:
    """The best proven bound on a plan's cost: the solver's, raised by the Lagrangian bound (`lagrange`) when the
    plan is unproven and that bound is stronger."""
    if status == "optimal" or not lagrange.applies(problem):
        return solver_bound
    t0 = time.perf_counter()
    lag = lagrange.bound(problem, columns, targets, _objective(problem, columns, values), max_nodes=max_nodes,
                         time_limit_s=time_limit_s)
    timings["lagrange_s"] = time.perf_counter() - t0
    notes.append(lag.note())
    return max([b for b in (solver_bound, lag.bound) if math.isfinite(b)], default=math.nan)


def _objective(problem: AllocationProblem, columns: Sequence[Column], values: Sequence[float]) -> float:
    instances = _instances(columns, values)
    return sum(i.count * i.usd_per_hour for i in instances) + churn_usd_per_hour(problem, instances)


def _limit_notes(notes: list[str], status: str, limits: str) -> list[str]:
    """`notes` plus what stopped the solve: the work limit (reproducible) or the wall-clock safety net (not)."""
    if status == "feasible-time-limit":
        return notes + ["the wall-clock safety net (`--time-limit-s`) stopped a solve: this plan depends on the "
                        "machine's speed and load and is not reproducible; raise `--time-limit-s`"]
    if status == "feasible-work-limit":
        return notes + [f"stopped at the work limit ({limits}): the same inputs give this plan on any machine"]
    return notes


def _speedup_note(cg: colgen.MinCostSolve, n_columns: int) -> str:
    rest = "provably unused" if cg.result.status == "optimal" else "not proven unused"
    how = f"{cg.groups} independent groups" if cg.decomposed else "one coupled problem"
    note = (f"LP relaxation by column generation: {cg.lp_columns} of {n_columns} columns, {cg.lp_rounds} rounds; "
            f"ILP ({how}) over {cg.ilp_columns} columns with reduced cost <= {cg.theta:.4g} $/h (the rest {rest})")
    if cg.rounded:
        note += ("; no ILP found a plan in time: the plan is the LP rounded (down, shortfalls filled within the "
                 "nodes left, the dearest instances then dropped while demand stays met; unproven, bounded by the LP; "
                 "raise `--time-limit-s`)")
    return note


def with_admission(plan: Plan, rates: Mapping[str, float], models: Sequence[ScenarioModel] = ()) -> Plan:
    """The plan with admission rates for the models it serves less than their demand of: the request rate times
    the share of both phases it serves (`routing.Admission` admits that share of what each model sends,
    `routing.admission_shares`, and sheds the rest), and per model of `models` (its trace,
    SLOs, margin and target) the bucket depth at which that trace thinned to the share is never shed
    (`capacity.admission_depth_req`): the plan was sized for the trace's bursts, so the bucket admits them and sheds
    only overload sustained past them. A second bucket refills at the request rate the plan's capacity carries (the
    rate times the least served share × capacity factor over the phases), as deep as that thinned trace needs
    against it, but no deeper, and if need be refilling slower, than lets what the buckets admit of the whole trace
    keep the capacity rule's target, and never so shallow that it sheds more than 2% of what the first bucket
    passes, so the model gets the share the plan promises (`capacity.peak_bucket`): a bucket admits a burst's head
    whole, so an admitted burst must arrive no faster, and queue no longer, than the plan serves it within its
    SLO."""
    from coral_dagster.allocation.capacity import admission_depth_req, peak_bucket

    served = plan.served_fraction()
    described = {m.model: m for m in models}
    admit, depth, peak = {}, {}, {}
    for model, rate in rates.items():
        share = min([served.get((model, p), 1.0) for p in DEMAND_PHASES])
        if share < 1.0 - 1e-9:
            admit[model] = rate * share
            m = described.get(model)
            if m is not None and share > 0 and rate > 0:
                rate, share = float(rate), float(share)
                depth[model] = admission_depth_req(m.trace, rate, share, rate * share)
                capacity = {p: served.get((model, p), 1.0) * plan.admission.capacity_factors.get((model, p), 1.0)
                            for p in DEMAND_PHASES}
                carried = rate * min(capacity.values())
                slos: tuple[tuple[DemandPhase, float], ...] = (("prefill", m.prefill_slo_ms),
                                                               ("decode", m.decode_slo_ms))
                phases = ((p, float(slo), capacity[p]) for p, slo in slos)
                peak[model] = peak_bucket(m.trace, rate, rate * share, depth[model], carried,
                                          admission_depth_req(m.trace, rate, share, carried), tuple(phases),
                                          float(m.slo_margin), float(m.attainment_target))
    return replace(plan, admission=replace(plan.admission, admit_req_s=admit, admit_depth_req=depth, admit_peak=peak)) \
        if admit else plan
