"""One entry point per planning method on the same AllocationProblem: Coral and the baselines."""

from __future__ import annotations

from coral_dagster.allocation.baselines import plan_cauchy, plan_homo, plan_homo_ilp
from coral_dagster.allocation.planner import solve_plan
from coral_dagster.allocation.problem import AllocationProblem
from coral_dagster.allocation.types import Plan, Scarcity
from coral_dagster.errors import UnknownNameError

ALLOCATION_METHODS = ("coral", "homo-ilp", "homo", "cauchy")


def make_plan(problem: AllocationProblem, method: str = "coral", *, scarcity_mode: Scarcity | None = None,
              time_limit_s: float = 30.0, gap_rel: float = 1e-4) -> Plan:
    """Plan with `method` (coral, homo-ilp, homo, cauchy); Helix needs a fixed cluster (see `helix_compare`)."""
    if method == "coral":
        return solve_plan(problem, scarcity_mode=scarcity_mode, time_limit_s=time_limit_s, gap_rel=gap_rel)
    if method == "homo-ilp":
        return plan_homo_ilp(problem, scarcity_mode=scarcity_mode, time_limit_s=time_limit_s, gap_rel=gap_rel)
    if method == "homo":
        return plan_homo(problem, scarcity_mode=scarcity_mode)
    if method == "cauchy":
        return plan_cauchy(problem, scarcity_mode=scarcity_mode)
    raise UnknownNameError("allocation method", method, ALLOCATION_METHODS)
