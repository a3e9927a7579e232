"""The plain inputs of one allocation: templates, offers per (region, node), demand and the running plan."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

from coral_dagster.catalog.market import MarketSnapshot
from coral_dagster.catalog.nodes import NodeConfig
from coral_dagster.errors import CoralError
from coral_dagster.templates.types import Template
from coral_dagster.vocab import DEMAND_PHASES

DemandKey = tuple[str, str]
Offers = Mapping[tuple[str, NodeConfig], float]


@dataclass(frozen=True)
class AllocationProblem:
    """Everything one allocation solve reads, as plain values (no catalog or store lookups).

    `demand_tokens_per_s[(model, phase)]` is the tokens/s to serve for phase prefill or decode.
    `running[(template_id, region)]` is the plan running now (ν'); `churn_k` is K = start-up / re-plan interval.
    An aggregated template serves whole requests of its model: its `tokens_per_s` counts output tokens (as the
    template library rates it, `templates/throughput.py`), so it gives that to decode and
    `prompt_per_output[model]` (mean prompt over mean output tokens of the model's trace) times it to prefill.
    """

    scenario: str
    templates: tuple[Template, ...]
    usd_per_hour: Offers
    available_nodes: Mapping[tuple[str, NodeConfig], int]
    demand_tokens_per_s: Mapping[DemandKey, float]
    running: Mapping[tuple[str, str], int] = field(default_factory=dict)
    churn_k: float = 0.0
    prompt_per_output: Mapping[str, float] = field(default_factory=dict)
    snapshot_id: str = ""
    capacity_factors: Mapping[DemandKey, float] = field(default_factory=dict)
    scenario_key: str = ""

    def __post_init__(self) -> None:
        for key, value in self.demand_tokens_per_s.items():
            if value < 0:
                raise CoralError(f"demand for {key[0]} {key[1]} is {value} tokens/s.", "give demand >= 0 tokens/s.")
            if key[1] not in DEMAND_PHASES:
                raise CoralError(f"demand phase {key[1]!r} of {key[0]}.", "give demand per prefill and decode.")
        for (region, node), price in self.usd_per_hour.items():
            if price < 0:
                raise CoralError(f"{node} in {region} costs {price} $/h.", "prices must be >= 0.")
        if self.churn_k < 0:
            raise CoralError(f"churn factor K={self.churn_k}.", "K = node start-up time / re-plan interval >= 0.")
        object.__setattr__(self, "_serves", {})

    @property
    def regions(self) -> tuple[str, ...]:
        return tuple(sorted({r for r, _ in self.usd_per_hour}))

    def sells(self, region: str, node: NodeConfig) -> bool:
        return (region, node) in self.usd_per_hour and self.available_nodes.get((region, node), 0) > 0

    def instance_usd_per_hour(self, template: Template, region: str) -> float:
        """p_r(τ): the price of every node of the template in the region."""
        return sum(k * self.usd_per_hour[(region, n)] for n, k in template.nodes.counts)

    def max_instances(self, template: Template, region: str) -> int:
        """The most instances availability allows, 0 when the region lacks one of its nodes."""
        caps = [self.available_nodes.get((region, n), 0) // k if (region, n) in self.usd_per_hour else 0
                for n, k in template.nodes.counts]
        return min(caps) if caps else 0

    def contribution(self, template: Template, phase: str) -> float:
        """Tokens/s one instance of `template` adds to (template.model, phase)."""
        if template.phase == phase:
            return template.tokens_per_s
        if template.phase == "aggregated":
            if phase == "decode":
                return template.tokens_per_s
            if template.model not in self.prompt_per_output:
                raise CoralError(f"no prompt/output ratio for aggregated templates of {template.model}.",
                                 "give prompt_per_output for every model with aggregated templates.")
            return template.tokens_per_s * self.prompt_per_output[template.model]
        return 0.0

    def serves(self, template: Template) -> tuple[DemandKey, ...]:
        """The demand keys one instance of `template` contributes to."""
        kind = (template.model, template.phase)
        known = self._serves.get(kind)  # type: ignore[attr-defined]
        if known is None:
            phases = DEMAND_PHASES if template.phase == "aggregated" else (template.phase,)
            known = tuple((template.model, p) for p in phases if (template.model, p) in self.demand_tokens_per_s)
            self._serves[kind] = known  # type: ignore[attr-defined]
        return known

    def with_changes(self, **changes) -> "AllocationProblem":
        """A copy with some fields replaced."""
        values = {f: getattr(self, f) for f in self.__dataclass_fields__}
        values.update(changes)
        return AllocationProblem(**values)

    def scaled_demand(self, scale: float) -> dict[DemandKey, float]:
        return {k: v * scale for k, v in self.demand_tokens_per_s.items()}


def offers_from_market(market: MarketSnapshot, nodes: Iterable[NodeConfig] | None = None,
                       regions: Iterable[str] | None = None) -> tuple[dict, dict]:
    """Prices and availability per (region, node) from a snapshot, optionally only some nodes and regions."""
    keep_nodes = set(nodes) if nodes is not None else None
    keep_regions = set(regions) if regions is not None else None
    prices, avail = {}, {}
    for o in market.offers:
        if (keep_nodes is not None and o.node not in keep_nodes) or (
                keep_regions is not None and o.region not in keep_regions):
            continue
        prices[(o.region, o.node)] = o.usd_per_hour
        avail[(o.region, o.node)] = o.available_nodes
    return prices, avail
