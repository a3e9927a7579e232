"""Value objects of an allocation plan: instances per (template, region), cost, bound and coverage."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Mapping

from coral_dagster.templates.types import Template
from coral_dagster.vocab import Method, SolveStatus

Scarcity = Literal["scale", "fair"]


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
class Bottleneck:
    """What keeps demand from being met: a (model, phase) short on reachable capacity, or a saturated node.

    kind `demand`: `name` is "model phase"; `needed` and `available` are tokens/s (demanded, reachable alone).
    kind `node`: `name` is the node configuration in `region`; `needed` the nodes the cheapest full-demand plan
    would use, `available` the nodes on offer.
    """

    kind: Literal["demand", "node"]
    name: str
    region: str
    needed: float
    available: float

    @property
    def shortfall(self) -> float:
        return max(0.0, self.needed - self.available)

    def describe(self) -> str:
        if self.kind == "demand":
            return (f"{self.name} needs {self.needed:,.0f} tokens/s, at most {self.available:,.0f} is reachable "
                    f"with this availability")
        return (f"{self.name} in {self.region}: {self.needed:,.1f} nodes needed, {self.available:,.0f} available "
                f"(short {self.shortfall:,.1f})")

    def as_dict(self) -> dict:
        return {"kind": self.kind, "name": self.name, "region": self.region, "needed": self.needed,
                "available": self.available, "shortfall": self.shortfall}


@dataclass(frozen=True)
class AdmissionLimits:
    """What a plan admits of each model, and how much capacity it holds per unit of demand.

    `capacity_factors`: per (model, phase), the capacity the plan holds over the mean demand (the burst-aware
    rule, `allocation.capacity`). `admit_req_s`: per model it serves less of than demanded, the request rate it
    admits (`routing.Admission` sheds the rest); `admit_depth_req` that bucket's depth in requests (the burst of
    the model's own trace the plan carries); `admit_peak` the second bucket (request rate the plan's capacity
    carries, depth in requests)."""

    capacity_factors: Mapping[tuple[str, str], float] = field(default_factory=dict)
    admit_req_s: Mapping[str, float] = field(default_factory=dict)
    admit_depth_req: Mapping[str, float] = field(default_factory=dict)
    admit_peak: Mapping[str, tuple[float, float]] = field(default_factory=dict)

    @property
    def limits(self) -> bool:
        """Whether any model's requests are limited (a coordinator then sheds beyond the rates)."""
        return bool(self.admit_req_s)


@dataclass(frozen=True)
class Plan:
    """An allocation plan with the solver's evidence: status, cost, LP bound, gap and wall time.

    `cost_usd_per_hour` is what the instances cost; `churn_usd_per_hour` the penalty K·p of instances launched
    against the running plan (0 for a fresh plan); the LP bound and `gap` refer to their sum, the objective.
    `lp_bound_usd_per_hour` is the LP relaxation solved on its own; `mip_bound_usd_per_hour` the best bound the
    solve proved (the MIP solver's dual bound or the LP's, whichever is higher; NaN for plans not made by the ILP).
    `mip_gap`, to the proven bound, is the gap users read; `gap` is measured to the LP bound: a plan proven optimal
    has `mip_gap` 0 and still a `gap` where the LP relaxation is weak. `work_nodes` is the work the solve took
    (branch-and-bound nodes over all its MIPs), the same on any machine, beside its wall time `solve_s`.
    """

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
    churn_usd_per_hour: float = 0.0
    mip_bound_usd_per_hour: float = math.nan
    bottlenecks: tuple[Bottleneck, ...] = ()
    pruning: Mapping[str, object] | None = None
    snapshot_id: str = ""
    timings_s: Mapping[str, float] = field(default_factory=dict)
    plan_id: str = ""
    admission: AdmissionLimits = field(default_factory=AdmissionLimits)
    expected_attainment: Mapping[str, float] = field(default_factory=dict)
    expected_from: str = ""
    # The scenario contents it was planned for (`Scenario.scenario_key`): what "latest" is looked up by.
    scenario_key: str = ""
    work_nodes: int = 0

    def __post_init__(self) -> None:
        # A bound that is not finite is no bound (e.g. −∞ before any ILP proved one): one value, NaN, says so.
        for name in ("lp_bound_usd_per_hour", "mip_bound_usd_per_hour", "gap"):
            if not math.isfinite(getattr(self, name)):
                object.__setattr__(self, name, math.nan)

    @property
    def routing_shares(self) -> dict[str, dict[str, float]]:
        """Per model, the share of its requests each region receives under the routing policy
        (`coral_dagster.routing`, the one the simulator and the coordinator run)."""
        from coral_dagster.routing import plan_shares

        return plan_shares(self)

    @property
    def objective_usd_per_hour(self) -> float:
        return self.cost_usd_per_hour + self.churn_usd_per_hour

    @property
    def mip_gap(self) -> float:
        """(objective − the MIP solver's proven bound) / objective: 0 when proven optimal, NaN without an ILP."""
        obj = self.objective_usd_per_hour
        return (obj - self.mip_bound_usd_per_hour) / obj if obj > 0 else 0.0

    def counts(self) -> dict[tuple[str, str], int]:
        """Instances per (template_id, region): the ν' of the next re-plan."""
        out: dict[tuple[str, str], int] = {}
        for inst in self.instances:
            key = (inst.template.template_id, inst.region)
            out[key] = out.get(key, 0) + inst.count
        return out

    def served_fraction(self) -> dict[tuple[str, str], float]:
        """Served over demanded tokens/s per (model, phase), 1.0 where nothing is demanded."""
        return {k: (self.served_tokens_per_s.get(k, 0.0) / d if d > 0 else 1.0)
                for k, d in self.demand_tokens_per_s.items()}

    def nodes_used(self) -> dict[tuple[str, str], int]:
        """Nodes per (region, node configuration) the plan holds."""
        out: dict[tuple[str, str], int] = {}
        for inst in self.instances:
            for node, k in inst.template.nodes.counts:
                key = (inst.region, str(node))
                out[key] = out.get(key, 0) + k * inst.count
        return out
