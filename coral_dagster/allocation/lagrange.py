"""A Lagrangian bound on the cost ILP: availability priced, each model's ILP solved alone.

Models meet only in the availability rows (C1 of `ilp`). Pricing every (region, node) row at λ ≥ 0 and moving it
into the objective leaves one ILP per model (its own columns at p_r(τ) + Σ_c λ_r(c) U_c(τ), its demand and routing
rows, and C1 with all of the availability, which every plan's part for the model meets anyway), so

    L(λ) = Σ_μ z_μ(λ) − Σ_{r,c} λ_r(c) A_r(c)

bounds every plan meeting the targets from below, for any λ ≥ 0, when each z_μ is a lower bound on its model's
optimum (the sub-solve's proven bound, never its incumbent). λ starts at the LP relaxation's availability duals,
where L(λ) is already at least the LP bound (each model's ILP costs at least its LP), and moves by subgradient steps
(Polyak's, towards the plan's cost; halved after `PATIENCE` steps without a better bound). This is the bound of the
decomposition by model (Dantzig–Wolfe), reached from below. Every sub-solve keeps the node limit, so the bound is
the same on any machine. It needs no running plan: the churn penalty is not linear in a column's price.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Mapping, Sequence

from coral_dagster.allocation import ilp
from coral_dagster.allocation.problem import AllocationProblem, DemandKey
from coral_dagster.allocation.prune import Column
from coral_dagster.highs import nodes_explored

ITERATIONS = 4
PATIENCE = 2
STEP = 0.5


@dataclass(frozen=True)
class LagrangeBound:
    """The best bound found, the LP bound it started above, and the work it took."""

    bound: float
    lp_bound: float
    iterations: int
    nodes: int
    statuses: tuple[str, ...]

    def note(self) -> str:
        """One line for the plan's notes."""
        return (f"Lagrangian bound (availability priced, each model's ILP alone): {self.bound:.2f} $/h after "
                f"{self.iterations} iterations from the LP's {self.lp_bound:.2f}, {self.nodes} nodes")


def applies(problem: AllocationProblem) -> bool:
    """Whether the bound is written for this problem: no running plan to pay churn against."""
    return not (problem.churn_k > 0 and any(n > 0 for n in problem.running.values()))


def bound(problem: AllocationProblem, columns: Sequence[Column], targets: Mapping[DemandKey, float] | None,
          upper: float, *, iterations: int = ITERATIONS, max_nodes: int | None,
          time_limit_s: float) -> LagrangeBound:
    """A lower bound on the cost of every plan over `columns` serving `targets` (default: all demand); `upper` is a
    plan's cost (the step aims at it). NaN when a sub-solve proves no bound or the problem pays churn."""
    if not applies(problem):
        return LagrangeBound(math.nan, math.nan, 0, 0, ())
    lp = ilp.min_cost(problem, columns, targets, integer=False, time_limit_s=time_limit_s)
    if lp.status != "optimal":
        return LagrangeBound(math.nan, lp.objective, 0, 0, ())
    price = {key[1:]: max(0.0, -v) for key, v in (lp.row_duals or {}).items() if key[0] == "avail"}
    models = sorted({k[0] for k, d in problem.demand_tokens_per_s.items() if d > 0})
    own = {m: [c for c in columns if c.template.model == m] for m in models}
    subs = {m: problem.with_changes(demand_tokens_per_s={k: d for k, d in problem.demand_tokens_per_s.items()
                                                         if k[0] == m}) for m in models}
    wanted = {m: None if targets is None else {k: v for k, v in targets.items() if k[0] == m} for m in models}
    before, best, step, stale, statuses, done = nodes_explored(), -math.inf, STEP, 0, [], 0
    for _ in range(iterations):
        value = -sum(lam * problem.available_nodes.get(key, 0) for key, lam in price.items())
        used: dict[tuple, float] = {}
        for m in models:
            priced = [replace(c, usd_per_hour=c.usd_per_hour + sum(price.get((c.region, node), 0.0) * k
                                                                    for node, k in c.template.nodes.counts))
                      for c in own[m]]
            r = ilp.min_cost(subs[m], priced, wanted[m], max_nodes=max_nodes, time_limit_s=time_limit_s)
            statuses.append(r.status)
            if r.status not in ilp.FEASIBLE or not math.isfinite(r.bound):
                value = math.nan
                break
            value += r.bound
            for c, v in zip(priced, r.values):
                for node, k in c.template.nodes.counts:
                    used[(c.region, node)] = used.get((c.region, node), 0.0) + v * k
        done += 1
        if math.isnan(value):
            break
        stale = 0 if value > best else stale + 1
        best = max(best, value)
        if stale >= PATIENCE:
            step, stale = step / 2, 0
        slope = {key: used.get(key, 0.0) - problem.available_nodes.get(key, 0)
                 for key in set(used) | set(price)}
        slope = {key: g for key, g in slope.items() if g > 0 or price.get(key, 0.0) > 0}
        norm = sum(g * g for g in slope.values())
        if norm == 0 or upper <= value:
            break
        price = {key: max(0.0, price.get(key, 0.0) + step * (upper - value) / norm * g) for key, g in
                 slope.items()} | {key: lam for key, lam in price.items() if key not in slope}
    return LagrangeBound(best if math.isfinite(best) else math.nan, lp.objective, done, nodes_explored() - before,
                         tuple(statuses))
