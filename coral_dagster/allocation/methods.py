"""The one registry of planning methods on the same AllocationProblem: Coral and the baselines."""

from __future__ import annotations

from typing import Callable

from coral_dagster.allocation.baselines import plan_cauchy, plan_homo, plan_homo_ilp
from coral_dagster.allocation.planner import solve_plan
from coral_dagster.allocation.problem import AllocationProblem
from coral_dagster.allocation.types import Plan, Scarcity
from coral_dagster.errors import UnknownNameError

# method -> planner(problem, scarcity_mode, time_limit_s, gap_rel); the greedy baselines have no gap to close.
PLANNERS: dict[str, Callable[[AllocationProblem, Scarcity | None, float, float], Plan]] = {
    "coral": lambda p, mode, limit, gap: solve_plan(p, scarcity_mode=mode, time_limit_s=limit, gap_rel=gap),
    "homo-ilp": lambda p, mode, limit, gap: plan_homo_ilp(p, scarcity_mode=mode, time_limit_s=limit, gap_rel=gap),
    "homo": lambda p, mode, limit, gap: plan_homo(p, scarcity_mode=mode, time_limit_s=limit),
    "cauchy": lambda p, mode, limit, gap: plan_cauchy(p, scarcity_mode=mode, time_limit_s=limit),
}
ALLOCATION_METHODS = tuple(PLANNERS)


def make_plan(problem: AllocationProblem, method: str = "coral", *, scarcity_mode: Scarcity | None = None,
              time_limit_s: float = 30.0, gap_rel: float = 1e-4) -> Plan:
    """Plan with `method` (coral, homo-ilp, homo, cauchy) in scarcity mode `scale`, `fair` or none; Helix needs
    a fixed cluster (see `helix_compare`)."""
    if method not in PLANNERS:
        raise UnknownNameError("allocation method", method, ALLOCATION_METHODS)
    return PLANNERS[method](problem, scarcity_mode, time_limit_s, gap_rel)
