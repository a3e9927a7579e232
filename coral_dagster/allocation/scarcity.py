"""When demand cannot be met: what binds and by how much, and plans that serve less (uniform scale, fair share)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Sequence

from coral_dagster.allocation import colgen, ilp
from coral_dagster.allocation.problem import AllocationProblem, DemandKey
from coral_dagster.allocation.prune import Column
from coral_dagster.allocation.types import Bottleneck, Plan

# Extra nodes cost this many times their price in the diagnosis, so the fewest extra dollars come first.
OVERFLOW_WEIGHT = 1000.0
TOL = 1e-6
# A level solve that ends unproven at 0 is tried once more with this many times its work limit (nodes).
RETRY_WORK_FACTOR = 3


@dataclass(frozen=True)
class Diagnosis:
    """Why demand cannot be met: the jointly servable fraction and the bottlenecks, cheapest fix first."""

    joint_level: float
    bottlenecks: tuple[Bottleneck, ...]
    integer: bool

    def message(self) -> str:
        kind = "" if self.integer else " (LP bound)"
        parts = [f"demand cannot be met: at most {self.joint_level:.1%} of every model's demand can be served "
                 f"together{kind}."]
        short = [b.describe() for b in self.bottlenecks if b.kind == "demand"]
        if short:
            parts.append("Short even alone: " + "; ".join(short) + ".")
        nodes = [b.describe() for b in self.bottlenecks if b.kind == "node"]
        if nodes:
            parts.append("Binding nodes (fewest extra $/h to meet all demand): " + "; ".join(nodes) + ".")
        return " ".join(parts)


def diagnose(problem: AllocationProblem, columns: Sequence[Column], *, integer: bool = False,
             time_limit_s: float = 10.0, max_nodes: int | None = None) -> Diagnosis:
    """Name the (model, phase) keys and (region, node) configurations that keep demand from being met."""
    keys = [k for k, d in sorted(problem.demand_tokens_per_s.items()) if d > 0]
    bottlenecks: list[Bottleneck] = []
    for key in keys:
        alone = problem.with_changes(demand_tokens_per_s={key: problem.demand_tokens_per_s[key]})
        own = [c for c in columns if key in alone.serves(c.template)]
        reach = 0.0
        if own:
            r = colgen.solve_max_level(alone, own, {"k": [key]}, integer=False, cap=1e6,
                                       time_limit_s=time_limit_s)
            reach = r.level if r.status in ilp.FEASIBLE else 0.0
        if reach < 1.0 - TOL:
            d = problem.demand_tokens_per_s[key]
            bottlenecks.append(Bottleneck("demand", f"{key[0]} {key[1]}", "", d, reach * d))
    joint = 0.0
    if columns:
        r = colgen.solve_max_level(problem, columns, {"all": keys}, integer=integer, time_limit_s=time_limit_s,
                                   max_nodes=max_nodes)
        joint = r.level if r.status in ilp.FEASIBLE else 0.0
    if columns and not any(b.kind == "demand" and b.available == 0 for b in bottlenecks):
        r = colgen.elastic_lp(problem, columns, OVERFLOW_WEIGHT, time_limit_s=time_limit_s)
        if r.overflow:
            for (region, node), extra in sorted(r.overflow.items(), key=lambda kv: (-kv[1], kv[0])):
                if extra > TOL:
                    avail = problem.available_nodes.get((region, node), 0)
                    bottlenecks.append(Bottleneck("node", str(node), region, avail + extra, avail))
    return Diagnosis(joint, tuple(bottlenecks), integer)


LevelOracle = Callable[[Mapping[str, float], Sequence[str]], float]
"""(levels held by some models, the free models) -> the largest level the free models reach together, the
held ones keeping at least theirs."""


def uniform_levels(models: Sequence[str], reach: LevelOracle,
                   proven: Callable[[], bool] = lambda: True) -> dict[str, float]:
    """The paper's mode: one level for every model, the largest all reach together.

    When that level is 0 because some models cannot be served alongside the others (a model no plan serves at
    all, or models competing for the same scarce nodes), scaling every model alike would serve nothing: the
    models max-min fair share leaves at 0 stay at 0 (named by `uniform_note`) and the others share the largest
    level they reach together. When fair share leaves none at 0, the level solve was cut short (a time limit):
    fair share's least level is served by every model at once, so the uniform level is at least that. `proven` as
    for `fair_levels`.
    """
    level = reach({}, models)
    if level > TOL or len(models) < 2:
        return {m: level for m in models}
    fair = fair_levels(models, reach, proven)
    dead = [m for m, v in fair.items() if v <= TOL]
    rest = [m for m in models if m not in dead]
    if not dead or not rest:  # a solve cut short may have missed the level fair share's plan serves all together
        level = max(level, min(fair.values()))
        return {m: level for m in models}
    level = reach({m: 0.0 for m in dead}, rest)
    return {**{m: 0.0 for m in dead}, **{m: level for m in rest}}


def fair_levels(models: Sequence[str], reach: LevelOracle,
                proven: Callable[[], bool] = lambda: True) -> dict[str, float]:
    """Max-min fair levels by progressive filling, then a raising pass (Pareto optimal for `reach`).

    Raise the common level of the models not yet fixed as far as it goes; fix every model that cannot go above
    it with the others held there; when none is stuck alone (integer plans: each can rise, not all together),
    fix the one with the least room. Repeat with the rest. Last, raise each model in turn (lowest first) as far
    as it goes with every other held at its level: no model is then left below what it can reach without
    lowering another, so none sits at 0% where a positive share is reachable. `proven()` says whether `reach`'s
    last answer was proven (a solve cut short by its time limit may answer below what is reachable): a model found
    stuck by an unproven answer, and any model fixed at 0, is raised too.
    """
    fixed: dict[str, float] = {}
    unstuck: set[str] = set()  # fixed with room left (or on an unproven answer): the raising pass tries these
    while len(fixed) < len(models):
        free = [m for m in models if m not in fixed]
        level = reach(fixed, free)
        if level >= 1.0 - TOL:
            fixed.update({m: 1.0 for m in free})
            break
        room = {}
        for m in free:
            room[m] = reach({**fixed, **{o: level for o in free if o != m}}, [m])
            if not proven():
                unstuck.add(m)
        stuck = [m for m in free if room[m] <= level + TOL]
        if not stuck:
            stuck = [min(free, key=lambda m: (room[m], m))]
            unstuck.update(stuck)
        fixed.update({m: level for m in stuck})
    # A stuck model could not rise with the others at the level it was fixed at; they end at or above it, so with
    # a proven answer it cannot rise at the end either.
    for m in sorted(unstuck | {m for m, v in fixed.items() if v <= TOL}, key=lambda m: (fixed[m], m)):
        fixed[m] = max(fixed[m], reach({o: v for o, v in fixed.items() if o != m}, [m]))
    return fixed


class IlpReach:
    """The allocation ILP as a LevelOracle (`colgen.solve_max_level`, one group per model); it keeps the counts
    of every solve, so a plan reaching the levels found is at hand (`witness`). A solve ending unproven at level 0
    (no incumbent, or only the empty one, at its work limit) is retried once with `RETRY_WORK_FACTOR` × the nodes.
    `statuses` keeps every solve's status (a wall-clock stop among them makes the levels unreproducible)."""

    def __init__(self, problem: AllocationProblem, columns: Sequence[Column], *, integer: bool = True,
                 time_limit_s: float = 30.0, gap_rel: float = 1e-4, max_nodes: int | None = None):
        self.problem, self.columns = problem, columns
        self.integer, self.time_limit_s, self.gap_rel, self.max_nodes = integer, time_limit_s, gap_rel, max_nodes
        self.statuses: list[str] = []
        self.groups: dict[str, list[DemandKey]] = {}
        for k, d in sorted(problem.demand_tokens_per_s.items()):
            if d > 0:
                self.groups.setdefault(k[0], []).append(k)
        self.models = sorted(self.groups)
        self.solutions: list[tuple[dict[str, float], tuple[float, ...]]] = []
        self.last_proven = True
        self.first_bound = math.nan  # the upper bound the first solve proved on every model's common level

    def __call__(self, held: Mapping[str, float], free: Sequence[str]) -> float:
        floors = {m: v for m, v in held.items() if m not in free}
        nodes = self.max_nodes
        for nodes in (nodes, None if nodes is None else RETRY_WORK_FACTOR * nodes):
            r = colgen.solve_max_level(self.problem, self.columns, self.groups, floors, integer=self.integer,
                                       time_limit_s=self.time_limit_s, gap_rel=self.gap_rel, max_nodes=nodes)
            self.statuses.append(r.status)
            if r.status == "optimal" or (r.status in ilp.FEASIBLE and r.level > TOL) or nodes is None:
                break  # an unproven 0 is retried once with more work: it would fix a model at 0
        self.last_proven = r.status == "optimal"
        if math.isnan(self.first_bound) and not floors:
            self.first_bound = r.bound if r.status in ilp.FEASIBLE and math.isfinite(r.bound) else math.nan
        if r.status not in ilp.FEASIBLE:
            return 0.0
        self.solutions.append((ilp.routed_fractions(self.problem, self.columns, r.values), r.values))
        return r.level

    def witness(self, levels: Mapping[str, float]) -> tuple[float, ...] | None:
        """Counts of a solve that serve every model its level (None when no solve did)."""
        for served, values in reversed(self.solutions):
            if all(served.get(m, 0.0) >= v - TOL for m, v in levels.items()):
                return values
        return None


def uniform_scale(reach: IlpReach) -> tuple[float, dict[DemandKey, float], tuple[float, ...] | None]:
    """`uniform_levels` on the allocation ILP (`reach`): the least level served (0 when a model cannot be served at
    all), the targets per key and counts that reach them (see `IlpReach.witness`)."""
    levels = uniform_levels(reach.models, reach, lambda: reach.last_proven)
    return min(levels.values(), default=0.0), _targets(reach.problem, levels), reach.witness(levels)


def fair_share(reach: IlpReach) -> tuple[dict[str, float], dict[DemandKey, float], tuple[float, ...] | None]:
    """`fair_levels` on the allocation ILP (`reach`; a model's served fraction is the smaller of its phases': a
    request needs both); returns the level per model, the targets per key and counts that reach them."""
    levels = fair_levels(reach.models, reach, lambda: reach.last_proven)
    return levels, _targets(reach.problem, levels), reach.witness(levels)


def uniform_note(levels: Mapping[str, float], bound: float = math.nan) -> str:
    """What a uniform plan serves, naming the models it leaves at 0, and the level's proven upper `bound` when the
    level solve stopped short of proving its level the largest."""
    level = max(levels.values(), default=0.0)
    dead = sorted(m for m, v in levels.items() if v <= TOL < level)
    if not dead:
        note = f"uniform scarcity: every model served at {level:.2%} of its demand"
        if bound > level + TOL:
            note += (f"; the level solve stopped at its work limit with no plan proven to serve every model more "
                     f"than {min(bound, 1.0):.2%} (raise `--max-nodes` to close it)")
        return note
    return (f"uniform scarcity: {', '.join(dead)} cannot be served alongside the others with this availability "
            f"(0%); every other model served at {level:.2%} of its demand")


def _targets(problem: AllocationProblem, levels: Mapping[str, float]) -> dict[DemandKey, float]:
    return {k: levels[k[0]] for k, d in sorted(problem.demand_tokens_per_s.items()) if d > 0}


def served_levels(plan: Plan) -> tuple[float, ...]:
    """Each model's served share of its requests (`goodput.fluid_goodput`: both phases in one region), ascending:
    max-min fairness compares plans by these, least first (a uniform plan's least level is its level)."""
    from coral_dagster.allocation.goodput import fluid_goodput

    return tuple(sorted(fluid_goodput(plan).per_model.values()))


def serves_more(a: Plan, b: Plan) -> bool:
    """Whether plan `a` serves more than plan `b` in the max-min order of their `served_levels` (beyond TOL)."""
    for x, y in zip(served_levels(a), served_levels(b)):
        if abs(x - y) > TOL:
            return x > y
    return False


def never_serves_less(plan: Plan, other: Plan | None, name: str) -> Plan:
    """`plan`, or `other` (named `name`, e.g. the Homo-ILP plan under the same scarcity mode: a plan over a subset
    of the library) where that serves more in the max-min order, or as much for less: a scarcity plan never
    serves less than a plan it contains, and at equal service never costs more."""
    if other is None or not other.instances:
        return plan
    if serves_more(other, plan):
        why = "serves more (" + ", ".join(f"{x:.1%}" for x in served_levels(other)) + " against " + \
            ", ".join(f"{x:.1%}" for x in served_levels(plan)) + ")"
    elif not serves_more(plan, other) and other.cost_usd_per_hour < plan.cost_usd_per_hour - TOL:
        why = f"serves as much for less ({other.cost_usd_per_hour:.2f} against {plan.cost_usd_per_hour:.2f} $/h)"
    else:
        return plan
    return replace(other, method=plan.method, scenario=plan.scenario, solve_s=plan.solve_s + other.solve_s,
                   notes=tuple(plan.notes) + (f"{name} {why}: that plan is returned",))
