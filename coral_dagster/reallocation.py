"""When to re-plan: the pure decision behind the reallocation sensor."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PlanState:
    """What the running plan serves and uses, priced at today's snapshot."""

    plan_id: str
    served_tokens_per_s: dict[tuple[str, str], float]
    nodes_used: dict[tuple[str, str], int]
    cost_usd_per_hour: float


@dataclass(frozen=True)
class ReplanDecision:
    """Whether to request a re-plan, and every reason for it."""

    replan: bool
    reasons: tuple[str, ...]


def decide_replan(current: PlanState | None, demand_tokens_per_s: dict[tuple[str, str], float],
                  available_nodes: dict[tuple[str, str], int], *, candidate_cost_usd_per_hour: float | None = None,
                  churn_usd_per_hour: float = 0.0, savings_threshold: float = 0.05) -> ReplanDecision:
    """Re-plan when there is no plan, demand is no longer met, a node pool shrank below use, or a new plan
    would save more than `savings_threshold` of today's cost after paying its churn."""
    if current is None:
        return ReplanDecision(True, ("no plan yet",))
    reasons = []
    for key, need in sorted(demand_tokens_per_s.items()):
        have = current.served_tokens_per_s.get(key, 0.0)
        if have < need * (1 - 1e-9):
            reasons.append(f"{key[0]} {key[1]}: serves {have:,.0f} of {need:,.0f} tok/s demanded")
    for key, used in sorted(current.nodes_used.items()):
        free = available_nodes.get(key, 0)
        if used > free:
            reasons.append(f"{key[0]} {key[1]}: uses {used} nodes, {free} available")
    if candidate_cost_usd_per_hour is not None and current.cost_usd_per_hour > 0:
        saving = current.cost_usd_per_hour - candidate_cost_usd_per_hour - churn_usd_per_hour
        if saving > savings_threshold * current.cost_usd_per_hour:
            reasons.append(f"a new plan saves ${saving:,.2f}/h after churn "
                           f"({saving / current.cost_usd_per_hour:.1%} > {savings_threshold:.1%})")
    return ReplanDecision(bool(reasons), tuple(reasons))
