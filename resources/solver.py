"""Solver settings shared by the template builder and the allocation ILP."""

import dagster as dg
from pydantic import Field

from coral_dagster.highs import DEFAULT_MAX_NODES, SAFETY_NET_S


class SolverSettings(dg.ConfigurableResource):
    """Work limit, safety net and re-planning thresholds for the open MILP solver (HiGHS through PuLP)."""

    max_nodes: int = Field(default=DEFAULT_MAX_NODES, description="Work limit of an allocation solve: "
                           "branch-and-bound nodes per MIP (the same plan on an idle or a loaded machine).")
    time_limit_s: float = Field(default=SAFETY_NET_S, description="Wall-clock safety net of one allocation solve; "
                                "a plan it stops is reported as not reproducible.")
    replan_savings_threshold: float = Field(
        default=0.05, description="Re-plan when a new plan saves more than this fraction of the current cost.")
