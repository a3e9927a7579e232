"""The allocation ILP of coral.md §3 in PuLP, solved with HiGHS under a time limit.

Notation
    τ         a template (after lossless pruning), r a region, c a node configuration
    m         a demand key (model, phase), phase ∈ {prefill, decode}
    U_c(τ)    nodes of configuration c in τ
    T_m(τ)    tokens/s one instance of τ gives m: its throughput; an aggregated template (rated in output
              tokens/s) gives that to decode and the trace's prompt tokens per output token times it to prefill
    p_r(τ)    Σ_c U_c(τ) p_r(c), $/h of one instance of τ in r
    A_r(c)    nodes of c available in r
    D_m       demanded tokens/s of m;  s_m the fraction of D_m to serve (1, or a scarcity level)
    μ(m)      the model of demand key m
    ν'_r(τ)   instances running now;  K = node start-up time / re-plan interval
Variables
    ν_r(τ) ∈ ℤ, 0 ≤ ν_r(τ) ≤ min_c ⌊A_r(c) / U_c(τ)⌋   instances of τ in r (the bound follows from C1)
    x_r(μ) ≥ 0                                          share of model μ's requests routed to region r
    I_r(τ) ≥ 0                                          churn penalty, $/h
Objective
    minimise  Σ_r Σ_τ p_r(τ) ν_r(τ) + I_r(τ)
Constraints
    C1 availability   Σ_τ U_c(τ) ν_r(τ) ≤ A_r(c)                         ∀ r, c
    C2 demand         Σ_{τ in r} min(T_m(τ), s_m D_m) ν_r(τ) ≥ s_m D_m x_r(μ(m))   ∀ m, r   (rows ÷ D_m)
    C2' routing       Σ_r x_r(μ) = 1                                                ∀ μ
    C3 churn          I_r(τ) ≥ (ν_r(τ) − ν'_r(τ)) p_r(τ) K               ∀ r, τ

C2 with C2' keeps a request's prefill and decode in one region: a region gets a share of a model's requests and
must serve that share of both phases there (the KV cache moves between nodes of a region, never across regions).

Exact reformulations: C2's coefficients are capped at its right-hand side, which changes no integer solution
(an instance covering the demand alone satisfies the row either way) and tightens the LP relaxation. Where
ν'_r(τ) = 0, C3 with the minimisation gives I = p K ν, so that penalty goes into ν's cost and no I variable is
made. With no running plan at all every plan's objective is (1 + K) Σ p ν, a constant factor, so it is dropped
and the objective is the provisioning cost.

Scarcity variant (`max_level`): demand keys are split into groups g (all keys: uniform scaling; one group per
model: max-min fair share); s_m = f_g for m in g, f_g ≤ 1, f_g ≥ t for free groups and f_g ≥ its level for
fixed ones; the routed shares y_r(μ) = f_g x_r(μ) make C2 linear (Σ_r y_r(μ) = f_g); maximise t subject to C1
and C2 (no churn: serving more comes first)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Any, Literal, Mapping, Sequence, get_args

from coral_dagster.allocation.problem import AllocationProblem, DemandKey
from coral_dagster.allocation.prune import Column
from coral_dagster.highs import pulp_solver, silence_banner, solve_status

# The most rows per model the routing shares' elimination may write (phases ** regions): 2 phases, up to 4 regions.
PROJECTED_MAX_ROWS = 16
RawStatus = Literal["optimal", "feasible-work-limit", "feasible-time-limit", "infeasible", "no-solution"]
# A plan, proven optimal or stopped by the work limit (reproducible) or by the wall-clock safety net (not).
FEASIBLE = ("optimal", "feasible-work-limit", "feasible-time-limit")


def unproven(*statuses: str) -> Literal["feasible-work-limit", "feasible-time-limit"]:
    """The status of a plan not proven optimal: `feasible-time-limit` when the wall clock stopped any solve that
    made it (not reproducible), else `feasible-work-limit`."""
    return "feasible-time-limit" if "feasible-time-limit" in statuses else "feasible-work-limit"


def _raw_status(status: str) -> RawStatus:
    """`status` (as `highs.solve_status` reads it) as a RawStatus; any other string is a bug in that reader."""
    for known in get_args(RawStatus):
        if status == known:
            return known
    raise ValueError(f"solver status {status!r} is none of {get_args(RawStatus)}")


@dataclass(frozen=True)
class SolveResult:
    """One solver run: counts per column, objective, the solver's proven bound and its wall time.

    `row_duals` (LP runs only) maps a row (`("avail", region, node)`, `("demand", model, phase, region)`) to its
    dual.
    """

    status: RawStatus
    values: tuple[float, ...]
    objective: float
    bound: float
    solve_s: float
    level: float = 1.0
    row_duals: Mapping[tuple, float] | None = None
    overflow: Mapping[tuple, float] | None = None


def _pulp():
    import pulp  # lazy: only planning needs the solver

    silence_banner()
    return pulp


def solver(time_limit_s: float, gap_rel: float, mip: bool = True, feasibility_jump: bool = False,
           max_nodes: int | None = None):
    """HiGHS through its Python API; CBC when highspy is missing.

    HiGHS's feasibility-jump heuristic is off by default: on the allocation ILP's small knapsack-like models it
    took 70–90 ms of a 100 ms solve and found nothing the search did not. Its root reduced-cost heuristic is off
    too: on core's coupled ILPs (~300 columns, solved at the root) it took a third to a half of the solve (0.10 vs
    0.16 s, 0.12 vs 0.25 s, 0.14 vs 0.25 s). Both are heuristics: optima unchanged.
    """
    return pulp_solver(time_limit_s, gap_rel, mip, max_nodes, mip_heuristic_run_feasibility_jump=feasibility_jump,
                       mip_heuristic_run_root_reduced_cost=False)


def churn_factor(problem: AllocationProblem) -> float:
    """K when a plan is running, else 0: with nothing running every plan pays (1 + K) × its cost, a constant
    factor that is dropped."""
    return problem.churn_k if any(n > 0 for n in problem.running.values()) else 0.0


def warm_solver(start: Mapping, time_limit_s: float, gap_rel: float, partial: bool = False,
                max_nodes: int | None = None):
    """HiGHS handed a starting solution (`start`: variable -> value; others start at 0, or with `partial` are
    left for HiGHS to complete); plain HiGHS without highspy's API.

    Presolve is off: HiGHS 1.16 with presolve on and a user solution reports it as optimal, objective 0,
    without searching (seen on a 36-column allocation ILP; presolve off finds the true optimum).
    """
    pulp = _pulp()
    base = solver(time_limit_s, gap_rel, feasibility_jump=True, max_nodes=max_nodes)
    if not isinstance(base, pulp.HiGHS):
        return base

    highs_class: Any = type(base)  # the PuLP HiGHS subclass `solver` built (PuLP is untyped)

    class WarmHighs(highs_class):
        def callSolver(self, lp):
            import numpy as np

            variables = [v for v in lp.variables() if v in start] if partial else lp.variables()
            index = np.array([v.index for v in variables], dtype=np.int32)
            value = np.array([float(start.get(v, 0.0)) for v in variables])
            lp.solverModel.setOptionValue("presolve", "off")
            lp.solverModel.setSolution(len(index), index, value)
            lp.solverModel.run()

    return WarmHighs(msg=False, timeLimit=time_limit_s, gapRel=gap_rel, **base.optionsDict)


def _supply_terms(problem: AllocationProblem, columns: Sequence[Column],
                  caps: Mapping[DemandKey, float] | float = 1.0) -> dict[tuple, list[tuple[int, float]]]:
    """Per (model, phase, region) with D_m > 0, every region of the problem: (column index in that region,
    min(T_m(τ) / D_m, cap_m)), cap_m the row's largest target.

    Capping a coefficient at the right-hand side is exact for integers (one instance that covers the target
    alone satisfies the row either way) and tightens the LP relaxation: a fraction of one huge instance no longer
    passes for the whole demand of a small model.
    """
    keys = [k for k, d in sorted(problem.demand_tokens_per_s.items()) if d > 0]
    terms: dict[tuple, list[tuple[int, float]]] = {k + (r,): [] for k in keys for r in problem.regions}
    for i, col in enumerate(columns):
        for key in problem.serves(col.template):
            row = key + (col.region,)
            if row in terms:
                cap = caps if isinstance(caps, (int, float)) else caps.get(key, 1.0)
                coef = problem.contribution(col.template, key[1]) / problem.demand_tokens_per_s[key]
                terms[row].append((i, min(coef, cap)))
    return terms


def _routed_demand(prob, rows: dict, problem: AllocationProblem, columns: Sequence[Column], nu: list,
                   caps: Mapping[DemandKey, float] | float, weight: Mapping[DemandKey, float] | float) -> dict:
    """C2 per (model, phase, region): supply in the region ≥ weight_m × the model's routed share there.

    Returns the share variables x_r(μ) per model, for the caller's routing rows (C2').
    """
    pulp = _pulp()
    share: dict[str, dict[str, object]] = {}
    for (model, phase, region), terms in _supply_terms(problem, columns, caps).items():
        per_model = share.setdefault(model, {})
        if region not in per_model:
            per_model[region] = prob.add_variable(f"x_{len(rows)}", lowBound=0)
        w = weight if isinstance(weight, (int, float)) else weight.get((model, phase), 1.0)
        expr = [(nu[i], coef) for i, coef in terms] + [(per_model[region], -w)]
        _row(prob, rows, ("demand", model, phase, region), pulp.LpConstraint(
            pulp.LpAffineExpression(expr), pulp.LpConstraintGE, None, 0.0))
    return share


def _projected_demand(prob, rows: dict, problem: AllocationProblem, columns: Sequence[Column], nu: list,
                      goal: Mapping[DemandKey, float] | float) -> bool:
    """C2 and C2' with the routing shares eliminated (Fourier–Motzkin), when that takes at most PROJECTED_MAX_ROWS
    rows per model: a model's requests can be routed iff Σ_r min over its phases p of S_pr / w_p ≥ 1 (S_pr its
    supply in r over D_p, w_p the target), i.e. iff for every choice of one phase per region Σ_r S_{p(r)r} / w_{p(r)}
    ≥ 1. Exact for integer plans and the same LP. Issue 30's study saw HiGHS prove core's scarcity instances
    1.3–2× faster without the shares; at equal work (nodes) we measured no gain: core default at 4000 nodes per MIP,
    Coral 5.05% vs 3.21% with the shares, HiGHS alone 7.19% vs 13.96%, core ×0.5 at 50% 15.3% vs 10.9%.
    Returns False (nothing added) when too many rows."""
    import itertools

    pulp = _pulp()
    terms = _supply_terms(problem, columns, 1.0)
    weight = {k: (goal if isinstance(goal, (int, float)) else goal.get(k, 1.0)) for k in problem.demand_tokens_per_s}
    phases: dict[str, list[str]] = {}
    for model, phase, _ in terms:
        if weight[(model, phase)] > 0 and phase not in phases.setdefault(model, []):
            phases[model].append(phase)
    regions = list(problem.regions)
    if any(len(p) ** len(regions) > PROJECTED_MAX_ROWS for p in phases.values()):
        return False
    for model, own in sorted(phases.items()):
        for choice in itertools.product(own, repeat=len(regions)):
            expr: dict = {}
            for phase, region in zip(choice, regions):
                w = weight[(model, phase)]
                for i, coef in terms[(model, phase, region)]:
                    expr[i] = max(expr.get(i, 0.0), min(1.0, coef / w))
            _row(prob, rows, ("routed", model) + choice, pulp.LpConstraint(
                pulp.LpAffineExpression([(nu[i], c) for i, c in expr.items()]), pulp.LpConstraintGE, None, 1.0))
    return True


def _availability_terms(columns: Sequence[Column], split: Sequence[int] | None = None) -> dict[tuple, list]:
    """Per C1 row, (column index, nodes used): rows are (region, node), or (group, region, node) when split."""
    terms: dict[tuple, list[tuple[int, int]]] = {}
    for i, col in enumerate(columns):
        for node, k in col.template.nodes.counts:
            key = (col.region, node) if split is None else (split[i], col.region, node)
            terms.setdefault(key, []).append((i, k))
    return dict(sorted(terms.items()))


def _row(prob, rows: dict, key: tuple, constraint) -> None:
    """Add a constraint under a short unique name and remember it by its structured key (PuLP rewrites names)."""
    prob += constraint, f"r{len(rows)}"
    rows[key] = constraint


def _run(prob, columns_vars, time_limit_s: float, gap_rel: float, mip: bool,
         rows: Mapping[tuple, Any] | None = None, start_values: Sequence[float] | None = None,
         max_nodes: int | None = None) -> SolveResult:
    """Solve and read status, values, objective and bound the same way for every variant; `start_values` (one per
    column) is handed to HiGHS as a first incumbent; `max_nodes` is the MIP's work limit."""
    pulp = _pulp()
    start = time.perf_counter()
    if start_values is not None and mip:
        slv = warm_solver(dict(zip(columns_vars, start_values)), time_limit_s, gap_rel, partial=True,
                          max_nodes=max_nodes)
    else:
        slv = solver(time_limit_s, gap_rel, mip, max_nodes=max_nodes)
    prob.solve(slv)
    solve_s = time.perf_counter() - start
    read, bound = solve_status(prob, mip and any(v.cat == pulp.LpInteger for v in columns_vars))
    status = _raw_status(read)
    if status in ("infeasible", "no-solution"):
        return SolveResult(status, (), math.nan, math.nan, solve_s)
    integer = mip and any(v.cat == pulp.LpInteger for v in columns_vars)
    values = tuple(float(round(v.varValue or 0.0)) if integer else float(v.varValue or 0.0) for v in columns_vars)
    objective = float(pulp.value(prob.objective))
    duals = None
    if not integer:
        duals = {key: float(c.pi or 0.0) for key, c in (rows or {}).items()}
    if bound is None or not math.isfinite(bound):
        bound = objective
    return SolveResult(status, values, objective, float(bound), solve_s, row_duals=duals)


def min_cost(problem: AllocationProblem, columns: Sequence[Column], targets: Mapping[DemandKey, float] | None = None,
             *, integer: bool = True, time_limit_s: float = 30.0, gap_rel: float = 1e-4,
             overflow_weight: float | None = None, slack_usd: float | None = None,
             split: Sequence[int] | None = None, start: Sequence[float] | None = None,
             max_nodes: int | None = None, project: bool = False, keep_running: bool = False) -> SolveResult:
    """Minimise provisioning cost plus churn penalty so every key m gets `targets[m]` (default 1) of D_m, the MIP
    exploring at most `max_nodes` nodes (the work limit; `time_limit_s` is a wall-clock safety net). With
    `project`, an integer solve writes C2 and C2' without the routing shares (`_projected_demand`): off by
    default, since at equal work it did not help (`bench/solve_times.py`, `highs` vs `highs-shares`).

    `start` (counts per column meeting the targets, e.g. the level solve's plan under scarcity) is the solver's
    first incumbent: it never returns a plan dearer than that, and prunes by its cost from the start.
    With `split` (a group label per column), C1 is written once per group: each group may use all of the
    availability, which relaxes C1 into independent problems per group (see `colgen`).
    With `overflow_weight`, C1 becomes elastic (diagnosis only): extra nodes `over_r(c)` may be bought at
    `overflow_weight × p_r(c)` each; their values come back in `overflow` keyed by (region, node).
    With `slack_usd`, C2 becomes elastic (column generation only): unmet demand costs `slack_usd` per unit of
    D_m; the unmet fraction comes back in `overflow` keyed by `(model,)`.
    With `keep_running`, every column keeps at least the instances running now (the running plan topped up).
    """
    pulp = _pulp()
    cat = pulp.LpInteger if integer else pulp.LpContinuous
    prob = pulp.LpProblem("coral_allocation", pulp.LpMinimize)
    k = churn_factor(problem)
    # Variables ν with their bounds (elastic: availability alone bounds ν)
    nu = [prob.add_variable(f"nu_{i}", lowBound=min(c.running, c.max_count) if keep_running else 0,
                            upBound=None if overflow_weight else c.max_count, cat=cat)
          for i, c in enumerate(columns)]
    churn = {i: prob.add_variable(f"churn_{i}", lowBound=0) for i, c in enumerate(columns) if c.running and k > 0}
    objective = [(nu[i], c.usd_per_hour * (1.0 if i in churn or c.running else 1.0 + k)) for i, c in
                 enumerate(columns)]
    objective += [(v, 1.0) for v in churn.values()]
    prob.setObjective(pulp.LpAffineExpression(objective))
    rows: dict[tuple, Any] = {}
    # C1 availability
    over: dict[tuple, Any] = {}
    for row, terms in _availability_terms(columns, split).items():
        region, node = row[-2:]
        avail = problem.available_nodes.get((region, node), 0)
        expr = [(nu[i], kk) for i, kk in terms]
        if overflow_weight is not None:
            over[row] = prob.add_variable(f"over_{len(over)}", lowBound=0, cat=cat)
            expr.append((over[row], -1.0))
            objective.append((over[row], overflow_weight * problem.usd_per_hour[(region, node)]))
        _row(prob, rows, ("avail",) + row, pulp.LpConstraint(pulp.LpAffineExpression(expr), pulp.LpConstraintLE,
                                                            None, avail))
    if over:
        prob.setObjective(pulp.LpAffineExpression(objective))
    # C2 demand in each region, C2' routing of every model's requests (an integer solve: shares eliminated)
    short: dict[tuple, Any] = {}
    goal = targets if targets is not None else 1.0
    projected = integer and project and slack_usd is None and _projected_demand(prob, rows, problem, columns, nu,
                                                                                goal)
    for model, by_region in ({} if projected else _routed_demand(prob, rows, problem, columns, nu, goal,
                                                                 goal)).items():
        expr = [(x, 1.0) for x in by_region.values()]
        if slack_usd is not None:
            short[(model,)] = prob.add_variable(f"short_{len(short)}", lowBound=0)
            expr.append((short[(model,)], 1.0))
            objective.append((short[(model,)], slack_usd))
        _row(prob, rows, ("routing", model), pulp.LpConstraint(pulp.LpAffineExpression(expr), pulp.LpConstraintEQ,
                                                              None, 1.0))
    if short:
        prob.setObjective(pulp.LpAffineExpression(objective))
    # C3 churn
    for i, var in churn.items():
        c = columns[i]
        _row(prob, rows, ("churn", i), pulp.LpConstraint(
            pulp.LpAffineExpression([(var, 1.0), (nu[i], -c.usd_per_hour * k)]), pulp.LpConstraintGE, None,
            -c.running * c.usd_per_hour * k))
    result = _run(prob, nu, time_limit_s, gap_rel, integer, rows, start, max_nodes)
    extra = {**over, **short}
    if extra and result.status not in ("infeasible", "no-solution"):
        result = replace(result, overflow={key: float(v.varValue or 0.0) for key, v in extra.items()})
    return result


def max_level(problem: AllocationProblem, columns: Sequence[Column], groups: Mapping[str, Sequence[DemandKey]],
              fixed: Mapping[str, float] | None = None, *, integer: bool = True, cap: float = 1.0,
              time_limit_s: float = 30.0, gap_rel: float = 1e-4, max_nodes: int | None = None) -> SolveResult:
    """Maximise the served fraction t shared by the free groups, the fixed ones keeping their levels (at most
    `max_nodes` MIP nodes).

    Returns the counts reaching the optimum; `level` is the exact t those counts reach (recomputed from them).
    """
    pulp = _pulp()
    fixed = dict(fixed or {})
    cat = pulp.LpInteger if integer else pulp.LpContinuous
    prob = pulp.LpProblem("coral_scarcity", pulp.LpMaximize)
    # Variables ν with their bounds, the level t and the groups' fractions f_g
    nu = [prob.add_variable(f"nu_{i}", lowBound=0, upBound=c.max_count, cat=cat) for i, c in enumerate(columns)]
    t = prob.add_variable("level", lowBound=0, upBound=cap)
    frac = {g: prob.add_variable(f"frac_{j}", lowBound=fixed.get(g, 0.0), upBound=cap)
            for j, g in enumerate(sorted(groups))}
    prob.setObjective(pulp.LpAffineExpression([(t, 1.0)]))
    rows: dict[tuple, Any] = {}
    # C1 availability
    for (region, node), terms in _availability_terms(columns).items():
        avail = problem.available_nodes.get((region, node), 0)
        _row(prob, rows, ("avail", region, node), pulp.LpConstraint(
            pulp.LpAffineExpression([(nu[i], kk) for i, kk in terms]), pulp.LpConstraintLE, None, avail))
    # C2 demand in each region (routed shares y_r(μ)), C2' the shares add up to the group's level
    group_of = {key[0]: g for g, keys in groups.items() for key in keys}
    for model, by_region in _routed_demand(prob, rows, problem, columns, nu, cap, 1.0).items():
        _row(prob, rows, ("routing", model), pulp.LpConstraint(
            pulp.LpAffineExpression([(y, 1.0) for y in by_region.values()] + [(frac[group_of[model]], -1.0)]),
            pulp.LpConstraintEQ, None, 0.0))
    free = [g for g in groups if g not in fixed]
    for j, g in enumerate(sorted(free)):
        _row(prob, rows, ("level", g), pulp.LpConstraint(pulp.LpAffineExpression([(frac[g], 1.0), (t, -1.0)]),
                                                         pulp.LpConstraintGE, None, 0.0))
    result = _run(prob, nu, time_limit_s, gap_rel, integer, rows, max_nodes=max_nodes)
    if result.status in ("infeasible", "no-solution"):
        return result
    routed = routed_fractions(problem, columns, result.values, cap)
    levels = [min(routed.get(k[0], cap) for k in groups[g]) for g in free] or [cap]
    return SolveResult(result.status, result.values, result.objective, result.bound, result.solve_s,
                       level=min(cap, min(levels)), row_duals=result.row_duals)


def routed_fractions(problem: AllocationProblem, columns: Sequence[Column], values: Sequence[float],
                     cap: float = 1.0) -> dict[str, float]:
    """Per model with demand, the share of its requests the counts serve with each request's phases in one
    region: Σ_r min over its phases of min(cap, served in r / D) (the most C2 and C2' allow), capped at `cap`."""
    served: dict[tuple, float] = {}
    for col, v in zip(columns, values):
        for key in problem.serves(col.template):
            served[key + (col.region,)] = served.get(key + (col.region,), 0.0) + v * problem.contribution(
                col.template, key[1])
    keys = [k for k, d in problem.demand_tokens_per_s.items() if d > 0]
    out: dict[str, float] = {}
    for model in sorted({k[0] for k in keys}):
        phases = [k for k in keys if k[0] == model]
        total = sum(min([cap] + [served.get(k + (r,), 0.0) / problem.demand_tokens_per_s[k] for k in phases])
                    for r in problem.regions)
        out[model] = min(cap, total)
    return out


def availability_scale_lp(problem: AllocationProblem, columns: Sequence[Column], *,
                          time_limit_s: float = 30.0) -> SolveResult:
    """LP: the least σ (the objective) with all demand servable when every A_r(c) becomes σ·A_r(c).

    C1 becomes Σ_τ U_c(τ) ν_r(τ) ≤ σ A_r(c); C4 is dropped (the bounds scale with σ); minimise σ.
    """
    pulp = _pulp()
    prob = pulp.LpProblem("coral_min_availability", pulp.LpMinimize)
    nu = [prob.add_variable(f"nu_{i}", lowBound=0) for i in range(len(columns))]
    sigma = prob.add_variable("sigma", lowBound=0)
    prob.setObjective(pulp.LpAffineExpression([(sigma, 1.0)]))
    rows: dict[tuple, Any] = {}
    # C1 availability, scaled by σ
    for (region, node), terms in _availability_terms(columns).items():
        avail = problem.available_nodes.get((region, node), 0)
        _row(prob, rows, ("avail", region, node), pulp.LpConstraint(
            pulp.LpAffineExpression([(nu[i], kk) for i, kk in terms] + [(sigma, -avail)]), pulp.LpConstraintLE,
            None, 0.0))
    # C2 demand in each region, C2' routing
    for model, by_region in _routed_demand(prob, rows, problem, columns, nu, 1.0, 1.0).items():
        _row(prob, rows, ("routing", model), pulp.LpConstraint(
            pulp.LpAffineExpression([(x, 1.0) for x in by_region.values()]), pulp.LpConstraintEQ, None, 1.0))
    return _run(prob, nu, time_limit_s, 0.0, False, rows)
