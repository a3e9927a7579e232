"""When to re-plan: the pure decision behind the reallocation sensor."""

from __future__ import annotations

from dataclasses import dataclass

# Work limit (nodes per MIP) of the sensor's savings estimate: a quarter of a re-plan's (`highs.DEFAULT_MAX_NODES`),
# so the estimate stays inside the sensor's tick; reproducible all the same.
ESTIMATE_MAX_NODES = 1000


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


def evaluate(store, scenario_name: str, *, savings_threshold: float = 0.05, time_limit_s: float = 10.0,
             estimate_savings: bool = True, max_nodes: int | None = ESTIMATE_MAX_NODES,
             evaluated_key: str | None = None) -> tuple[str, ReplanDecision | None]:
    """(inputs key, decision) for the newest stored snapshot and demand against the newest Coral plan.

    The key names the snapshot and demand the decision saw, so a caller can act once per new input: when it equals
    `evaluated_key` the decision is None and nothing else is computed. The savings estimate (a plan within
    `max_nodes` nodes per MIP, under the safety net `time_limit_s`) is made only when nothing else already asks for
    a re-plan: unmet demand or a shrunken pool decide at once, without a scarcity solve."""
    from coral_dagster.allocation.demand import demand_tokens
    from coral_dagster.allocation.inputs import capacity_factors, scenario_problem, scenario_traces
    from coral_dagster.allocation.methods import make_plan
    from coral_dagster.catalog.scenarios import load_scenario
    from coral_dagster.catalog.store import latest_snapshot
    from coral_dagster.errors import CoralError
    from coral_dagster.app.plans import find_plan
    from coral_dagster.app.rounds import latest_demand
    from coral_dagster.templates.library import load_library

    scenario = load_scenario(scenario_name)
    snap = latest_snapshot(store, scenario)
    demand_id, rates = latest_demand(store, scenario)
    key = f"{snap.snapshot_id}|{demand_id}"
    if key == evaluated_key:
        return key, None
    demand = demand_tokens(rates, scenario_traces(scenario), capacity_factors(scenario, rates))
    available = {(o.region, str(o.node)): o.available_nodes for o in snap.offers}
    plan = find_plan(store, scenario)
    if plan is None:
        return key, decide_replan(None, demand, available)
    cost_now = sum(i.count * sum(k * snap.price(i.region, n) for n, k in i.template.nodes.counts)
                   for i in plan.instances if all(snap.offer(i.region, n) for n, _ in i.template.nodes.counts))
    state = PlanState(plan.plan_id, dict(plan.served_tokens_per_s), plan.nodes_used(), cost_now)
    decision = decide_replan(state, demand, available, savings_threshold=savings_threshold)
    if decision.replan or not estimate_savings:
        return key, decision
    problem = scenario_problem(scenario, load_library(store, scenario), snap, rates=rates, running=plan.counts())
    try:
        best = make_plan(problem, "coral", time_limit_s=time_limit_s, max_nodes=max_nodes)
    except CoralError as exc:  # an infeasible or timed-out candidate is itself a reason to re-plan
        return key, ReplanDecision(True, (f"candidate plan failed: {exc}",))
    return key, decide_replan(state, demand, available, candidate_cost_usd_per_hour=best.cost_usd_per_hour,
                              churn_usd_per_hour=best.churn_usd_per_hour, savings_threshold=savings_threshold)
