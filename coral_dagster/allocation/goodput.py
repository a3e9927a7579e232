"""Expected goodput of a plan: requests it serves within SLO, as tokens/s and as a fraction of the demand.

The default estimator is fluid: a model's requests are served in the fraction that both phases cover within one
region (a request's KV cache does not cross regions), against demand without the planning headroom (the
templates already meet the SLO at their rated throughput). The request-level simulator
(`simulator.simulate.goodput_estimator`) plugs in through the same signature (`GoodputEstimator`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from coral_dagster.allocation.types import Plan
from coral_dagster.vocab import DEMAND_PHASES


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


def regional_supply(plan: Plan) -> dict[tuple[str, str, str], float]:
    """Tokens/s per (model, phase, region). An aggregated instance gives its output tokens/s to decode and the
    model's prompt tokens per output token times that to prefill; the ratio is read back from the plan's totals."""
    out: dict[tuple[str, str, str], float] = {}
    agg: dict[str, float] = {}
    for inst in plan.instances:
        t = inst.template
        tokens = t.tokens_per_s * inst.count
        if t.phase == "aggregated":
            agg[t.model] = agg.get(t.model, 0.0) + tokens
            for phase in DEMAND_PHASES:
                out[(t.model, phase, inst.region)] = out.get((t.model, phase, inst.region), 0.0)
        else:
            out[(t.model, t.phase, inst.region)] = out.get((t.model, t.phase, inst.region), 0.0) + tokens
    for model, total in agg.items():
        own = sum(v for (m, p, _), v in out.items() if m == model and p == "prefill")
        ratio = (plan.served_tokens_per_s.get((model, "prefill"), 0.0) - own) / total
        for inst in plan.instances:
            t = inst.template
            if t.model == model and t.phase == "aggregated":
                out[(model, "decode", inst.region)] += t.tokens_per_s * inst.count
                out[(model, "prefill", inst.region)] += t.tokens_per_s * inst.count * ratio
    return out


def fluid_goodput(plan: Plan, headroom: float = 1.0) -> Goodput:
    """Each model serves min(1, Σ_region min over its phases of served there / (demand / headroom)) of its
    requests."""
    local = regional_supply(plan)
    regions = sorted({r for _, _, r in local} | {i.region for i in plan.instances})
    by_model: dict[str, list[tuple[str, float]]] = {}
    for (model, phase), demand in plan.demand_tokens_per_s.items():
        by_model.setdefault(model, []).append((phase, demand / headroom))
    per_model, total, wanted = {}, 0.0, 0.0
    for model, phases in sorted(by_model.items()):
        need = sum(d for _, d in phases)
        wanted_phases = [(p, d) for p, d in phases if d > 0]
        frac = min(1.0, sum(min([1.0] + [local.get((model, p, r), 0.0) / d for p, d in wanted_phases])
                            for r in regions)) if wanted_phases else 1.0
        per_model[model] = frac
        total += frac * need
        wanted += need
    return Goodput(total, total / wanted if wanted > 0 else 1.0, per_model, "fluid")
