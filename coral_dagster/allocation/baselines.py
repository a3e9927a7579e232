"""Baselines on Coral's inputs: Homo, Cauchy (greedy, homogeneous templates) and Homo-ILP (Coral's ILP on them).

Homogeneous means every node of the template has one configuration (k × c, k ≥ 1), so each baseline's template
space is a subset of Coral's; Coral's optimum is never dearer than Homo-ILP's or Cauchy's (whose units keep both
phases in one region) on the same inputs.

- Homo (SkyServe / SageServe / Mélange style): per (model, phase), rank the homogeneous (template, region)
  pairs by tokens/s per $ and replicate the best until the demand is met, moving to the next when availability
  runs out. An aggregated template is ranked by the tokens it gives that phase and credited to both phases.
  With `last_part="cheapest"` (a stronger variant, ours) the part of the demand smaller than one instance of the
  best template goes to whichever single template covers it at least cost.
  Homo places each phase on its own, so a model's prefill and decode may land in different regions; its
  plans are then not all servable (the goodput columns count only what both phases serve in one region).
- Cauchy: per model, units of `a` prefill and `b` decode instances of homogeneous templates in one region, with
  one side of the ratio 1 and the other 1..8 (one prefill may feed several decode instances, or the reverse for
  prompt-heavy traces); a unit serves the fraction min(a·T_P / D_prefill, b·T_D / D_decode) of the model's demand;
  units are ranked by that fraction per $ and replicated like Homo's templates (the same last-part rule).
- Homo-ILP: the allocation ILP restricted to homogeneous templates, telling the gain of mixing GPU types apart
  from the gain of solving jointly.

Models are served in the order of their demand keys; availability left by one model is what the next gets. Under
scarcity (`scale`) the greedy baselines serve the largest common fraction their greedy reaches (bisection).
"""

from __future__ import annotations

import math
import time
from typing import Mapping

import numpy as np

from coral_dagster.allocation.planner import SCARCITY_FIX, build_plan, solve_plan
from coral_dagster.allocation.problem import AllocationProblem, DemandKey
from coral_dagster.allocation.prune import Column, prune_columns
from coral_dagster.allocation.recent import Recent
from coral_dagster.allocation.types import Plan, PlannedInstance, Scarcity
from coral_dagster.errors import CoralError, InfeasibleError
from coral_dagster.templates.types import Template

MAX_RATIO = 8
LAST_PART = ("replicate", "cheapest")
BISECTION_STEPS = 30
TOL = 1e-9


def is_homogeneous(template: Template) -> bool:
    """All nodes of one configuration."""
    return len(template.nodes.counts) == 1


_HOMOGENEOUS: Recent[tuple[Template, ...]] = Recent(4)


def homogeneous_problem(problem: AllocationProblem) -> AllocationProblem:
    """The same problem over its homogeneous templates (the selection is remembered per template tuple)."""
    chosen = _HOMOGENEOUS.get(problem.templates,
                              lambda: tuple(t for t in problem.templates if is_homogeneous(t)))
    return problem.with_changes(templates=chosen)


class _Pool:
    """Nodes left per (region, node) while a greedy baseline places instances."""

    def __init__(self, problem: AllocationProblem):
        self.left = dict(problem.available_nodes)

    def fits(self, need: Mapping, region: str) -> int:
        return min((self.left.get((region, n), 0) // k for n, k in need.items()), default=0)

    def take(self, need: Mapping, region: str, count: int) -> None:
        for n, k in need.items():
            self.left[(region, n)] -= k * count


def _cover(remaining: float, eff: np.ndarray, cap: np.ndarray, cost: np.ndarray, fits, take,
           last_part: str) -> float:
    """Greedy cover of `remaining` with options (served per unit `cap`, `cost` per unit), best `eff` first.

    `replicate` (the baselines as specified): units of the most efficient option that fits until the demand is
    met. `cheapest`: whole units of it while one unit does not overshoot, and the last part from whichever
    single option covers it at least cost (replication alone may buy a large template for a small remainder).
    Returns what is left uncovered.
    """
    order = np.lexsort((cost, -eff))
    tol = TOL * max(1.0, remaining)
    while remaining > tol:
        best = next((int(o) for o in order if fits(int(o)) > 0), None)
        if best is None:
            break
        if last_part == "replicate":
            n = min(max(1, int(math.ceil(remaining / cap[best] - TOL))), fits(best))
            take(best, n)
            remaining -= n * cap[best]
            continue
        if cap[best] <= remaining + tol:
            n = min(max(1, int(math.floor(remaining / cap[best] + TOL))), fits(best))
            take(best, n)
            remaining -= n * cap[best]
            continue
        units = np.maximum(1.0, np.ceil(remaining / cap - TOL))
        chosen = None
        for o in np.lexsort((-eff, units * cost)):
            if fits(int(o)) >= units[o]:
                chosen = int(o)
                break
        if chosen is None:  # nothing covers the rest alone: take what the best option still can
            n = fits(best)
            take(best, n)
            remaining -= n * cap[best]
            continue
        take(chosen, int(units[chosen]))
        remaining -= units[chosen] * cap[chosen]
    return remaining


def _homo_greedy(problem: AllocationProblem, columns: list[Column], targets: Mapping[DemandKey, float],
                 last_part: str):
    pool = _Pool(problem)
    placed: dict[tuple[str, str], list] = {}
    remaining = {k: problem.demand_tokens_per_s[k] * targets.get(k, 1.0) for k in problem.demand_tokens_per_s}
    for key in sorted(remaining):
        options = [c for c in columns if key in problem.serves(c.template)]
        if not options or remaining[key] <= TOL * max(1.0, problem.demand_tokens_per_s[key]):
            continue
        cap = np.array([problem.contribution(c.template, key[1]) for c in options])
        cost = np.array([c.usd_per_hour for c in options])
        needs = [c.template.nodes.as_dict() for c in options]

        def take(o: int, n: int) -> None:
            col = options[o]
            pool.take(needs[o], col.region, n)
            entry = placed.setdefault((col.template.template_id, col.region), [col, 0])
            entry[1] += n
            for other in problem.serves(col.template):
                if other != key:  # an aggregated instance also serves the model's other phase
                    remaining[other] -= n * problem.contribution(col.template, other[1])

        remaining[key] = _cover(remaining[key], cap / np.maximum(cost, TOL), cap, cost,
                                lambda o: pool.fits(needs[o], options[o].region), take, last_part)
    ok = all(r <= 1e-9 * max(1.0, problem.demand_tokens_per_s[k]) for k, r in remaining.items())
    instances = [PlannedInstance(c.template, c.region, n, c.usd_per_hour) for c, n in placed.values()]
    return ok, instances


def _cauchy_units(problem: AllocationProblem, columns: list[Column], model: str):
    """Every unit of the model: arrays (fraction of demand served, cost) and (prefill col, a, decode col, b)."""
    d_pre = problem.demand_tokens_per_s.get((model, "prefill"), 0.0)
    d_dec = problem.demand_tokens_per_s.get((model, "decode"), 0.0)
    fracs, costs, units = [], [], []
    for region in problem.regions:
        pre = [c for c in columns if c.region == region and c.template.model == model
               and c.template.phase == "prefill"]
        dec = [c for c in columns if c.region == region and c.template.model == model
               and c.template.phase == "decode"]
        if not pre or not dec:
            continue
        t_p = np.array([c.template.tokens_per_s for c in pre])
        p_p = np.array([c.usd_per_hour for c in pre])
        t_d = np.array([c.template.tokens_per_s for c in dec])
        p_d = np.array([c.usd_per_hour for c in dec])
        ratios = [(1, b) for b in range(1, MAX_RATIO + 1)] + [(a, 1) for a in range(2, MAX_RATIO + 1)]
        for a, b in ratios:
            f_p = a * t_p[:, None] / d_pre if d_pre > 0 else np.full((len(pre), 1), np.inf)
            f_d = b * t_d[None, :] / d_dec if d_dec > 0 else np.full((1, len(dec)), np.inf)
            frac = np.broadcast_to(np.minimum(f_p, f_d), (len(pre), len(dec)))
            cost = a * p_p[:, None] + b * p_d[None, :]
            i, j = np.nonzero(np.isfinite(frac))
            fracs.append(frac[i, j])
            costs.append(cost[i, j])
            units += [(pre[x], a, dec[y], b) for x, y in zip(i, j)]
    if not units:
        return np.zeros(0), np.zeros(0), []
    return np.concatenate(fracs), np.concatenate(costs), units


def _cauchy_greedy(problem: AllocationProblem, targets: Mapping[DemandKey, float], units_by_model: dict,
                   last_part: str):
    pool = _Pool(problem)
    placed: dict[tuple[str, str], list] = {}
    ok = True
    for model in sorted(units_by_model):
        keys = [k for k in problem.demand_tokens_per_s if k[0] == model and problem.demand_tokens_per_s[k] > 0]
        frac, cost, units = units_by_model[model]
        if not keys:
            continue
        needs: dict[int, dict] = {}

        def need_of(o: int) -> dict:
            if o not in needs:
                pre, a, dec, b = units[o]
                need: dict = {}
                for col, mult in ((pre, a), (dec, b)):
                    for n, k in col.template.nodes.counts:
                        need[n] = need.get(n, 0) + k * mult
                needs[o] = need
            return needs[o]

        def take(o: int, n_units: int) -> None:
            pre, a, dec, b = units[o]
            pool.take(need_of(o), pre.region, n_units)
            for col, mult in ((pre, a), (dec, b)):
                entry = placed.setdefault((col.template.template_id, col.region), [col, 0])
                entry[1] += n_units * mult

        left = _cover(max(targets.get(k, 1.0) for k in keys), frac / np.maximum(cost, TOL), frac, cost,
                      lambda o: pool.fits(need_of(o), units[o][0].region), take, last_part)
        ok = ok and left <= 1e-9
    instances = [PlannedInstance(c.template, c.region, n, c.usd_per_hour) for c, n in placed.values()]
    return ok, instances


def _greedy_plan(problem: AllocationProblem, method: str, scarcity_mode: Scarcity | None, last_part: str) -> Plan:
    if last_part not in LAST_PART:
        raise CoralError(f"unknown last-part rule {last_part!r}.", f"use one of: {', '.join(LAST_PART)}.")
    start = time.perf_counter()
    hp = homogeneous_problem(problem)
    columns, report = prune_columns(hp, prune_dominated=False)
    keys = [k for k, d in problem.demand_tokens_per_s.items() if d > 0]
    if method == "homo":
        def attempt(level: float):
            return _homo_greedy(hp, columns, {k: level for k in keys}, last_part)
    else:
        units = {m: _cauchy_units(hp, columns, m) for m in sorted({k[0] for k in keys})}

        def attempt(level: float):
            return _cauchy_greedy(hp, {k: level for k in keys}, units, last_part)
    ok, instances = attempt(1.0)
    level, notes = 1.0, [f"{method}: greedy over {len(columns)} homogeneous (template, region) pairs, last part "
                         f"by `{last_part}`"]
    if not ok:
        if scarcity_mode is None:
            raise InfeasibleError(f"{method} cannot meet demand with this availability (greedy over homogeneous "
                                  f"templates).", SCARCITY_FIX)
        if scarcity_mode != "scale":
            raise CoralError(f"{method} supports only the uniform scarcity mode.", "use `--scarcity scale`.")
        lo, hi, best = 0.0, 1.0, []
        for _ in range(BISECTION_STEPS):
            mid = (lo + hi) / 2
            ok_mid, inst_mid = attempt(mid)
            if ok_mid:
                lo, best = mid, inst_mid
            else:
                hi = mid
        level, instances = lo, best
        notes.append(f"uniform scarcity: every model served at {level:.2%} of its demand (bisection)")
    return build_plan(problem, method, "heuristic" if ok else "scaled", instances, lp_bound=math.nan,
                      solve_s=time.perf_counter() - start, demand_scale=level, notes=notes,
                      pruning=report.as_dict())


def plan_homo(problem: AllocationProblem, *, scarcity_mode: Scarcity | None = None,
              last_part: str = "replicate") -> Plan:
    """Homo: best tokens/s-per-$ homogeneous template per (model, phase), replicated within availability."""
    return _greedy_plan(problem, "homo", scarcity_mode, last_part)


def plan_cauchy(problem: AllocationProblem, *, scarcity_mode: Scarcity | None = None,
                last_part: str = "replicate") -> Plan:
    """Cauchy: homogeneous prefill/decode units ranked by demand served per $, replicated within availability."""
    return _greedy_plan(problem, "cauchy", scarcity_mode, last_part)


def plan_homo_ilp(problem: AllocationProblem, *, scarcity_mode: Scarcity | None = None, time_limit_s: float = 30.0,
                  gap_rel: float = 1e-4) -> Plan:
    """Homo-ILP: Coral's allocation ILP over the homogeneous templates only."""
    return solve_plan(homogeneous_problem(problem), method="homo-ilp", scarcity_mode=scarcity_mode,
                      time_limit_s=time_limit_s, gap_rel=gap_rel)
