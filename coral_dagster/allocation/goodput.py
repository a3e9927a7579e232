"""Expected goodput of a plan: requests it serves within SLO, as tokens/s and as a fraction of the demand.

The default estimator is fluid: a model's requests are served in the fraction its scarcer phase covers, against
demand without the planning headroom (the templates already meet the SLO at their rated throughput). The
request-level simulator plugs in through the same signature (`GoodputEstimator`) once it can replay a plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from coral_dagster.allocation.types import Plan


@dataclass(frozen=True)
class Goodput:
    """Served tokens/s that meet their SLO, per model and in total, and the fraction of demand they are."""

    tokens_per_s: float
    fraction: float
    per_model: dict[str, float]
    estimator: str

    def as_dict(self) -> dict:
        return {"tokens_per_s": self.tokens_per_s, "fraction": self.fraction, "per_model": dict(self.per_model),
                "estimator": self.estimator}


GoodputEstimator = Callable[[Plan, float], Goodput]


def fluid_goodput(plan: Plan, headroom: float = 1.0) -> Goodput:
    """Each model serves min(1, served / (demand / headroom)) of its requests, over its scarcer phase."""
    by_model: dict[str, list[tuple[float, float]]] = {}
    for (model, phase), demand in plan.demand_tokens_per_s.items():
        by_model.setdefault(model, []).append((demand / headroom, plan.served_tokens_per_s.get((model, phase), 0.0)))
    per_model, total, wanted = {}, 0.0, 0.0
    for model, pairs in sorted(by_model.items()):
        need = sum(d for d, _ in pairs)
        frac = min([1.0] + [s / d for d, s in pairs if d > 0])
        per_model[model] = frac
        total += frac * need
        wanted += need
    return Goodput(total, total / wanted if wanted > 0 else 1.0, per_model, "fluid")
