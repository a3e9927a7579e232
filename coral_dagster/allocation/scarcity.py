"""When demand cannot be met: what binds and by how much, and plans that serve less (uniform scale, fair share)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from coral_dagster.allocation import colgen
from coral_dagster.allocation.problem import AllocationProblem, DemandKey
from coral_dagster.allocation.prune import Column
from coral_dagster.allocation.types import Bottleneck

# Extra nodes cost this many times their price in the diagnosis, so the fewest extra dollars come first.
OVERFLOW_WEIGHT = 1000.0
TOL = 1e-6


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
             time_limit_s: float = 10.0) -> Diagnosis:
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
            reach = r.level if r.status in ("optimal", "feasible-time-limit") else 0.0
        if reach < 1.0 - TOL:
            d = problem.demand_tokens_per_s[key]
            bottlenecks.append(Bottleneck("demand", f"{key[0]} {key[1]}", "", d, reach * d))
    joint = 0.0
    if columns:
        r = colgen.solve_max_level(problem, columns, {"all": keys}, integer=integer, time_limit_s=time_limit_s)
        joint = r.level if r.status in ("optimal", "feasible-time-limit") else 0.0
    if columns and not any(b.kind == "demand" and b.available == 0 for b in bottlenecks):
        r = colgen.elastic_lp(problem, columns, OVERFLOW_WEIGHT, time_limit_s=time_limit_s)
        if r.overflow:
            for (region, node), extra in sorted(r.overflow.items(), key=lambda kv: (-kv[1], kv[0])):
                if extra > TOL:
                    avail = problem.available_nodes.get((region, node), 0)
                    bottlenecks.append(Bottleneck("node", str(node), region, avail + extra, avail))
    return Diagnosis(joint, tuple(bottlenecks), integer)


def uniform_scale(problem: AllocationProblem, columns: Sequence[Column], *, integer: bool = True,
                  time_limit_s: float = 30.0, gap_rel: float = 1e-4) -> tuple[float, dict[DemandKey, float]]:
    """The paper's mode: the largest s ≤ 1 with s·D_m servable for every m at once; targets per key."""
    keys = [k for k, d in sorted(problem.demand_tokens_per_s.items()) if d > 0]
    r = colgen.solve_max_level(problem, columns, {"all": keys}, integer=integer, time_limit_s=time_limit_s,
                               gap_rel=gap_rel)
    level = r.level if r.status in ("optimal", "feasible-time-limit") else 0.0
    return level, {k: level for k in keys}


def fair_share(problem: AllocationProblem, columns: Sequence[Column], *, integer: bool = True,
               time_limit_s: float = 30.0, gap_rel: float = 1e-4) -> tuple[dict[str, float], dict[DemandKey, float]]:
    """Max-min fair service over models (lexicographic, by progressive filling).

    A model's served fraction is the smaller of its phases' (a request needs both). Raise the common level of
    the models not yet fixed as far as it goes; fix every model that cannot go above it with the others held at
    it; repeat with the rest. Returns the level per model and the targets per key.
    """
    keys = [k for k, d in sorted(problem.demand_tokens_per_s.items()) if d > 0]
    groups: dict[str, list[DemandKey]] = {}
    for k in keys:
        groups.setdefault(k[0], []).append(k)
    fixed: dict[str, float] = {}
    while len(fixed) < len(groups):
        r = colgen.solve_max_level(problem, columns, groups, fixed, integer=integer, time_limit_s=time_limit_s,
                                   gap_rel=gap_rel)
        level = r.level if r.status in ("optimal", "feasible-time-limit") else 0.0
        free = [g for g in sorted(groups) if g not in fixed]
        if level >= 1.0 - TOL:
            fixed.update({g: 1.0 for g in free})
            break
        stuck = []
        for g in free:
            held = {**fixed, **{o: level for o in free if o != g}}
            rg = colgen.solve_max_level(problem, columns, groups, held, integer=integer,
                                        time_limit_s=time_limit_s, gap_rel=gap_rel)
            if rg.status not in ("optimal", "feasible-time-limit") or rg.level <= level + TOL:
                stuck.append(g)
        fixed.update({g: level for g in (stuck or free)})
    return fixed, {k: fixed[k[0]] for k in keys}
