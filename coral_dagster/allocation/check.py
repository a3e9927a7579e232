"""An independent verifier of a plan against its inputs (availability, demand, prices), kept apart from the ILP."""

from __future__ import annotations

from collections import defaultdict

from coral_dagster.allocation.problem import AllocationProblem
from coral_dagster.allocation.types import Plan

REL_TOL = 1e-6


def plan_violations(plan: Plan, problem: AllocationProblem, *, require_demand: bool = True,
                    same_region: bool = True) -> list[str]:
    """Every way `plan` breaks its inputs, as sentences; empty when it is sound.

    Checks: counts are positive integers; each region sells every node of its instances; nodes held per (region,
    node) stay within availability; the instance prices and the plan's cost add up from the offers; and, when
    `require_demand`, every (model, phase) gets `demand_scale` × its demand or more and, when `same_region`,
    with each request's phases in one region: Σ_region min over the model's phases of (served there / needed)
    reaches 1 (the greedy baselines do not plan by region).
    """
    problems: list[str] = []
    held: dict[tuple, int] = defaultdict(int)
    cost = 0.0
    served: dict[tuple[str, str], float] = defaultdict(float)
    local: dict[tuple[str, str, str], float] = defaultdict(float)
    for inst in plan.instances:
        t = inst.template
        if int(inst.count) != inst.count or inst.count <= 0:
            problems.append(f"{t.template_id} in {inst.region}: count {inst.count} is not a positive integer")
        price = 0.0
        for node, k in t.nodes.counts:
            if (inst.region, node) not in problem.usd_per_hour:
                problems.append(f"{t.template_id}: {inst.region} does not sell {node}")
                continue
            held[(inst.region, node)] += k * inst.count
            price += k * problem.usd_per_hour[(inst.region, node)]
        if abs(price - inst.usd_per_hour) > REL_TOL * max(1.0, price):
            problems.append(f"{t.template_id} in {inst.region}: priced {inst.usd_per_hour}, offers say {price}")
        cost += price * inst.count
        if t.phase == "aggregated":  # output tokens/s, with the trace's prompt tokens per output token
            gives = {"prefill": t.tokens_per_s * problem.prompt_per_output[t.model], "decode": t.tokens_per_s}
        else:
            gives = {t.phase: t.tokens_per_s}
        for phase, tokens in gives.items():
            served[(t.model, phase)] += tokens * inst.count
            local[(t.model, phase, inst.region)] += tokens * inst.count
    for (region, node), n in sorted(held.items()):
        avail = problem.available_nodes.get((region, node), 0)
        if n > avail:
            problems.append(f"{node} in {region}: {n} nodes held, {avail} available")
    if abs(cost - plan.cost_usd_per_hour) > REL_TOL * max(1.0, cost):
        problems.append(f"plan cost {plan.cost_usd_per_hour} $/h, instances add up to {cost} $/h")
    if require_demand:
        for key, d in sorted(problem.demand_tokens_per_s.items()):
            need = d * plan.demand_scale
            if served[key] < need * (1.0 - REL_TOL) - 1e-9:
                problems.append(f"{key[0]} {key[1]}: {served[key]:.3f} tokens/s served, {need:.3f} needed")
        wanted = {k: d * plan.demand_scale for k, d in problem.demand_tokens_per_s.items()
                  if same_region and d * plan.demand_scale > 0}
        regions = sorted({r for r, _ in problem.usd_per_hour})
        for model in sorted({m for m, _ in wanted}):
            phases = [k for k in wanted if k[0] == model]
            routed = sum(min(1.0, *(local[k + (r,)] / wanted[k] for k in phases)) for r in regions)
            if routed < 1.0 - REL_TOL:
                problems.append(f"{model}: only {routed:.1%} of its requests find both phases in one region")
    return problems
