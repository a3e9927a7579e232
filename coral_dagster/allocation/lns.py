"""Large-neighbourhood search on a plan's counts: one or two models' columns re-solved exactly, the rest held.

Models meet only in the availability rows (C1 of `ilp`): a model's demand rows (C2, C2') hold its own columns
alone. So with every other model's counts held, the nodes those use come off the availability, and the freed
models' problem is a small ILP of its own, started from their current counts (so never worse). A pass tries every
model alone, then every pair; the search ends after a pass that improves nothing, after `ROUNDS` passes, or once
its sub-solves have explored `BUDGET_FACTOR` × the node limit, so the result is the same on any machine.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from itertools import combinations
from typing import Callable, Mapping, Sequence

from coral_dagster.allocation import ilp
from coral_dagster.allocation.problem import AllocationProblem, DemandKey
from coral_dagster.allocation.prune import Column
from coral_dagster.highs import nodes_explored

ROUNDS = 3
# The search's work budget, in multiples of one MIP's node limit.
BUDGET_FACTOR = 10
# A change counts as an improvement when it saves more than this share of the objective.
REL_TOL = 1e-9


@dataclass(frozen=True)
class LnsResult:
    """Counts after the search, their objective and the start's, and the work it took."""

    values: tuple[float, ...]
    objective: float
    start_objective: float
    solves: int
    improvements: int
    nodes: int
    statuses: tuple[str, ...]

    def note(self) -> str:
        """One line for the plan's notes."""
        return (f"large-neighbourhood search: {self.solves} sub-solves (one and two models at a time, the rest "
                f"held), {self.improvements} improving, {self.start_objective:.2f} -> {self.objective:.2f} $/h, "
                f"{self.nodes} nodes")


def improve(problem: AllocationProblem, columns: Sequence[Column], values: Sequence[float],
            objective: Callable[[Sequence[float]], float], targets: Mapping[DemandKey, float] | None = None, *,
            max_nodes: int | None, time_limit_s: float) -> LnsResult:
    """Counts meeting `targets` (default: all demand) that cost no more than `values`, by re-solving each model,
    then each pair of models, with the others held at their counts; `objective(counts)` is the plan's $/h."""
    models = sorted({k[0] for k, d in problem.demand_tokens_per_s.items() if d > 0})
    hoods = [h for size in (1, 2) for h in combinations(models, size) if len(h) < len(models)]
    budget = None if max_nodes is None else BUDGET_FACTOR * max_nodes
    x, start = list(values), objective(values)
    best, solves, improvements, spent, statuses = start, 0, 0, 0, []
    for _ in range(ROUNDS):
        improved = False
        for hood in hoods:
            if budget is not None and spent >= budget:
                break
            before = nodes_explored()
            y, status = _resolve(problem, columns, x, set(hood), targets, max_nodes, time_limit_s)
            spent += nodes_explored() - before
            solves += 1
            statuses.append(status)
            if y is not None and (cost := objective(y)) < best - REL_TOL * max(1.0, abs(best)):
                x, best, improved = y, cost, True
                improvements += 1
        if not improved or (budget is not None and spent >= budget):
            break
    return LnsResult(tuple(x), best, start, solves, improvements, spent, tuple(statuses))


def _resolve(problem: AllocationProblem, columns: Sequence[Column], x: Sequence[float], hood: set[str],
             targets: Mapping[DemandKey, float] | None, max_nodes: int | None,
             time_limit_s: float) -> tuple[list[float] | None, str]:
    """`x` with the columns of the models in `hood` re-solved (None when the sub-solve found nothing)."""
    free = [i for i, c in enumerate(columns) if c.template.model in hood]
    held: Counter = Counter()
    for i, c in enumerate(columns):
        if c.template.model not in hood and x[i] > 0:
            for node, k in c.template.nodes.counts:
                held[(c.region, node)] += k * round(x[i])
    sub = replace(problem, available_nodes={key: a - held[key] for key, a in problem.available_nodes.items()},
                  demand_tokens_per_s={k: d for k, d in problem.demand_tokens_per_s.items() if k[0] in hood})
    wanted = None if targets is None else {k: v for k, v in targets.items() if k[0] in hood}
    r = ilp.min_cost(sub, [columns[i] for i in free], wanted, max_nodes=max_nodes, time_limit_s=time_limit_s,
                     start=[x[i] for i in free])
    if r.status not in ilp.FEASIBLE:
        return None, r.status
    y = list(x)
    for j, i in enumerate(free):
        y[i] = float(round(r.values[j]))
    return y, r.status
