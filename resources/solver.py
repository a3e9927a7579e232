"""Solver settings shared by the template builder and the allocation ILP."""

import dagster as dg
from pydantic import Field


class SolverSettings(dg.ConfigurableResource):
    """Time limit and re-planning thresholds for the open MILP solver (HiGHS through PuLP)."""

    time_limit_s: float = Field(default=60.0, description="Wall-clock limit of one allocation solve.")
    replan_savings_threshold: float = Field(
        default=0.05, description="Re-plan when a new plan saves more than this fraction of the current cost.")
