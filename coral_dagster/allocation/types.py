"""Value objects of an allocation plan: instances per (template, region), cost, bound and coverage."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from coral_dagster.templates.types import Template

SolveStatus = Literal["optimal", "feasible-time-limit", "infeasible", "scaled", "fair-share"]
Method = Literal["coral", "homo", "homo-ilp", "cauchy", "helix"]


@dataclass(frozen=True)
class PlannedInstance:
    """`count` instances of one template in one region; `usd_per_hour` is the price of one instance."""

    template: Template
    region: str
    count: int
    usd_per_hour: float

    @property
    def tokens_per_s(self) -> float:
        return self.template.tokens_per_s * self.count


@dataclass(frozen=True)
class Plan:
    """An allocation plan with the solver's evidence: status, cost, LP bound, gap and wall time."""

    scenario: str
    method: Method
    status: SolveStatus
    cost_usd_per_hour: float
    lp_bound_usd_per_hour: float
    gap: float
    solve_s: float
    instances: tuple[PlannedInstance, ...]
    demand_tokens_per_s: dict[tuple[str, str], float]
    served_tokens_per_s: dict[tuple[str, str], float]
    demand_scale: float = 1.0
    notes: tuple[str, ...] = field(default=())
