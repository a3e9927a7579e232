"""The one registry of planning methods on the same AllocationProblem: Coral and the baselines."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from coral_dagster.allocation.baselines import plan_cauchy, plan_homo, plan_homo_ilp
from coral_dagster.allocation.planner import solve_plan
from coral_dagster.allocation.problem import AllocationProblem
from coral_dagster.allocation.types import Plan, Scarcity
from coral_dagster.errors import CoralError, UnknownNameError
from coral_dagster.highs import DEFAULT_MAX_NODES, SAFETY_NET_S


def plan_coral(problem: AllocationProblem, scarcity_mode: Scarcity | None, time_limit_s: float, gap_rel: float,
               max_nodes: int | None) -> Plan:
    """Coral's plan, never dearer than the Homo-ILP plan on the same inputs (its library contains every
    homogeneous template): that plan, made under the same limits, is one of the solve's incumbents. Under
    scarcity, Homo-ILP's plan under the same mode: Coral's never serves less, nor costs more serving as much."""
    try:
        homo = plan_homo_ilp(problem, time_limit_s=time_limit_s, gap_rel=gap_rel, max_nodes=max_nodes,
                             diagnose=False)
    except CoralError:  # demand cannot be met (or no plan within the limits): nothing to start from
        homo = None
    if homo is None and scarcity_mode is not None:
        try:
            homo = plan_homo_ilp(problem, scarcity_mode=scarcity_mode, time_limit_s=time_limit_s,
                                 gap_rel=gap_rel, max_nodes=max_nodes, diagnose=False)
        except CoralError:
            homo = None
    plan = solve_plan(problem, scarcity_mode=scarcity_mode, time_limit_s=time_limit_s, gap_rel=gap_rel,
                      max_nodes=max_nodes, incumbents={"the Homo-ILP plan": homo})
    if homo is None:
        return plan
    return replace(plan, work_nodes=plan.work_nodes + homo.work_nodes,
                   timings_s={**plan.timings_s, "homo_ilp_s": homo.solve_s})  # its solve is part of the work


# method -> planner(problem, scarcity_mode, time_limit_s, gap_rel, max_nodes); the greedy baselines have no gap to
# close and no work limit (their last-part ILPs are small).
PLANNERS: dict[str, Callable[[AllocationProblem, Scarcity | None, float, float, int | None], Plan]] = {
    "coral": plan_coral,
    "homo-ilp": lambda p, mode, limit, gap, nodes: plan_homo_ilp(p, scarcity_mode=mode, time_limit_s=limit,
                                                                 gap_rel=gap, max_nodes=nodes),
    "homo": lambda p, mode, limit, gap, nodes: plan_homo(p, scarcity_mode=mode, time_limit_s=limit),
    "cauchy": lambda p, mode, limit, gap, nodes: plan_cauchy(p, scarcity_mode=mode, time_limit_s=limit),
}
ALLOCATION_METHODS = tuple(PLANNERS)


def make_plan(problem: AllocationProblem, method: str = "coral", *, scarcity_mode: Scarcity | None = None,
              time_limit_s: float = SAFETY_NET_S, gap_rel: float = 1e-4,
              max_nodes: int | None = DEFAULT_MAX_NODES) -> Plan:
    """Plan with `method` (coral, homo-ilp, homo, cauchy) in scarcity mode `scale`, `fair` or none, each MIP at
    most `max_nodes` nodes (reproducible work) under the wall-clock safety net `time_limit_s`; Helix needs a fixed
    cluster (see `helix_compare`)."""
    if method not in PLANNERS:
        raise UnknownNameError("allocation method", method, ALLOCATION_METHODS)
    return PLANNERS[method](problem, scarcity_mode, time_limit_s, gap_rel, max_nodes)
