"""Baselines on Coral's inputs: Homo and Cauchy (greedy, homogeneous replicas) and Homo-ILP (Coral's ILP on them).

Each baseline's template space is a subset of Coral's, and every request has both phases served in one region,
so Coral's optimum is never dearer on the same inputs.

- Homo (SkyServe / Mélange style, coral.md §4): one node per replica (tensor parallelism inside the node),
  prefill and decode colocated. Per model the units are its one-node aggregated templates in each region; an
  instance serves the fraction min over phases of (tokens it gives the phase / the phase's demand).
- Cauchy: homogeneous prefill and decode pools. Per model the units are `a` prefill and `b` decode instances
  of homogeneous templates (k × one configuration) in one region, one side of the ratio 1 and the other
  1..MAX_RATIO (one prefill replica may feed several decode replicas, or the reverse for prompt-heavy traces);
  a unit serves the fraction min(a·T_P / D_prefill, b·T_D / D_decode) of the model's requests.
- Both cover each model's target fraction greedily: the unit with the most served fraction per $ (Cauchy: the
  fraction capped at what is left to serve), replicated while whole units do not overshoot and availability
  lasts. When
  the best unit would overshoot, what is left (the last part) is bought at least cost: the cheapest integer mix
  of the baseline's templates of that model, within the nodes left, that serves it with each request's phases
  in one region (`least_cost_cover`, a small ILP solved by HiGHS). Models are served in name order; the nodes
  one leaves are what the next gets.
- Scarcity: `scale` gives every model the largest common level the greedy meets (bisection; a model it cannot
  serve at all is left at 0 and named), `fair` the max-min fair levels (`scarcity.fair_levels`).
- Homo-ILP (ours): the allocation ILP over the homogeneous templates (multi-node pipelines of one configuration
  allowed), the ablation that tells the gain of mixing GPU types apart from pipelining and solving jointly.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from coral_dagster.allocation import scarcity
from coral_dagster.allocation.planner import SCARCITY_FIX, build_plan, solve_plan
from coral_dagster.allocation.problem import AllocationProblem
from coral_dagster.allocation.prune import Column, prune_columns
from coral_dagster.allocation.recent import Recent
from coral_dagster.allocation.types import Plan, PlannedInstance, Scarcity
from coral_dagster.errors import CoralError, InfeasibleError
from coral_dagster.highs import DEFAULT_MAX_NODES, SAFETY_NET_S, quiet_stdout
from coral_dagster.templates.types import Template
from coral_dagster.vocab import DEMAND_PHASES, Method, SolveStatus

MAX_RATIO = 8
BISECTION_STEPS = 24
TOL = 1e-9
# HiGHS accepts rows and integrality within 1e-6: the last part asks that much more, so rounded counts serve it.
SOLVER_SLACK = 1e-6
MEMO_STATES = 20_000

Pool = dict  # nodes left per (region, node configuration)


def is_one_node(template: Template) -> bool:
    """A single node (one VM; tensor parallelism inside it)."""
    return template.nodes.counts[0][1] == 1 and template.homogeneous


_HOMOGENEOUS: Recent[tuple[Template, ...]] = Recent(4)


def homogeneous_problem(problem: AllocationProblem) -> AllocationProblem:
    """The same problem over its homogeneous templates (the selection is remembered per template tuple)."""
    chosen = _HOMOGENEOUS.get(problem.templates,
                              lambda: tuple(t for t in problem.templates if t.homogeneous))
    return problem.with_changes(templates=chosen)


@dataclass(frozen=True)
class Options:
    """A model's greedy steps as arrays: unit o is `p_mult[o]` instances of column `p_col[o]` plus `q_mult[o]` of
    `q_col[o]` (-1: none), in one region, serving `fraction[o]` of the model's requests at `usd_per_hour[o]`."""

    p_col: np.ndarray
    p_mult: np.ndarray
    q_col: np.ndarray
    q_mult: np.ndarray
    fraction: np.ndarray
    usd_per_hour: np.ndarray


def _fraction(problem: AllocationProblem, col: Column, model: str) -> dict[str, float]:
    """Per phase with demand: the fraction of the model's demand one instance of the column gives."""
    return {p: problem.contribution(col.template, p) / d for (m, p), d in problem.demand_tokens_per_s.items()
            if m == model and d > 0}


def homo_options(problem: AllocationProblem, columns: Sequence[Column], model: str) -> Options:
    """One aggregated instance per unit: it serves the smaller of its phase fractions of the model."""
    idx = [j for j, c in enumerate(columns) if c.template.model == model and c.template.phase == "aggregated"]
    frac = [min(_fraction(problem, columns[j], model).values(), default=0.0) for j in idx]
    one = np.ones(len(idx), dtype=np.int64)
    return Options(np.array(idx, dtype=np.int64), one, -one, 0 * one, np.array(frac, dtype=float),
                   np.array([columns[j].usd_per_hour for j in idx], dtype=float))


def cauchy_options(problem: AllocationProblem, columns: Sequence[Column], model: str) -> Options:
    """Units of a prefill and b decode instances in one region (module docstring)."""
    d_pre = problem.demand_tokens_per_s.get((model, "prefill"), 0.0)
    d_dec = problem.demand_tokens_per_s.get((model, "decode"), 0.0)
    ratios = np.array([(1, b) for b in range(1, MAX_RATIO + 1)] + [(a, 1) for a in range(2, MAX_RATIO + 1)])
    parts: list[tuple[np.ndarray, ...]] = []
    for region in problem.regions:
        pre = np.array([j for j, c in enumerate(columns) if c.region == region and c.template.model == model
                        and c.template.phase == "prefill"], dtype=np.int64)
        dec = np.array([j for j, c in enumerate(columns) if c.region == region and c.template.model == model
                        and c.template.phase == "decode"], dtype=np.int64)
        if not len(pre) or not len(dec):
            continue
        i, k, r = (x.ravel() for x in np.meshgrid(np.arange(len(pre)), np.arange(len(dec)),
                                                  np.arange(len(ratios)), indexing="ij"))
        a, b = ratios[r, 0], ratios[r, 1]
        t_p = np.array([columns[j].template.tokens_per_s for j in pre])[i]
        t_d = np.array([columns[j].template.tokens_per_s for j in dec])[k]
        frac = np.minimum(a * t_p / d_pre if d_pre > 0 else np.inf, b * t_d / d_dec if d_dec > 0 else np.inf)
        cost = (a * np.array([columns[j].usd_per_hour for j in pre])[i]
                + b * np.array([columns[j].usd_per_hour for j in dec])[k])
        ok = np.isfinite(frac)
        parts.append((pre[i][ok], a[ok], dec[k][ok], b[ok], frac[ok], cost[ok]))
    if not parts:
        empty = np.zeros(0, dtype=np.int64)
        return Options(empty, empty, empty, empty, np.zeros(0), np.zeros(0))
    return Options(*(np.concatenate(x) for x in zip(*parts)))


def _need(col: Column) -> dict:
    return {(col.region, node): k for node, k in col.template.nodes.counts}


def _fits(need: Mapping, pool: Pool) -> int:
    return min((pool.get(key, 0) // k for key, k in need.items()), default=0)


def least_cost_cover(problem: AllocationProblem, columns: Sequence[Column], model: str, fraction: float,
                     pool: Pool, time_limit_s: float = 10.0) -> dict[int, int] | None:
    """The cheapest integer counts of `columns` (the model's) serving `fraction` of its requests with each
    request's phases in one region, within the nodes in `pool`; None when no counts do.

    Variables n_j ∈ ℤ≥0 per column and the routed share x_r ≥ 0 per region; minimise Σ p_j n_j subject to
    Σ_r x_r ≥ fraction, Σ_{j in r} (T_jp / D_p) n_j ≥ x_r per region and phase p with demand, and
    Σ_j U_c(j) n_j ≤ left_r(c) per (region, node).
    """
    from scipy.optimize import Bounds, LinearConstraint, milp

    cols = [c for c in columns if c.template.model == model]
    if fraction <= TOL:
        return {}
    regions = sorted({c.region for c in cols})
    phases = sorted(p for (m, p), d in problem.demand_tokens_per_s.items() if m == model and d > 0)
    nodes = sorted({(c.region, n) for c in cols for n, _ in c.template.nodes.counts})
    n, nr = len(cols), len(regions)
    if not cols or not phases:
        return None
    rows, lo, hi = [], [], []
    route = np.zeros(n + nr)
    route[n:] = 1.0
    rows.append(route)
    lo.append(fraction + SOLVER_SLACK)
    hi.append(np.inf)
    for r, region in enumerate(regions):
        for phase in phases:
            row = np.zeros(n + nr)
            for j, c in enumerate(cols):
                if c.region == region:
                    row[j] = _fraction(problem, c, model).get(phase, 0.0)
            row[n + r] = -1.0
            rows.append(row)
            lo.append(0.0)
            hi.append(np.inf)
    for key in nodes:
        row = np.zeros(n + nr)
        for j, c in enumerate(cols):
            if c.region == key[0]:
                row[j] = c.template.node_count(key[1])
        rows.append(row)
        lo.append(-np.inf)
        hi.append(pool.get(key, 0))
    cost = np.concatenate([[c.usd_per_hour for c in cols], np.zeros(nr)])
    upper = np.concatenate([[_fits(_need(c), pool) for c in cols],
                            np.full(nr, np.inf)])
    with quiet_stdout():
        res = milp(cost, constraints=LinearConstraint(np.array(rows), lo, hi), bounds=Bounds(0, upper),
                   integrality=np.concatenate([np.ones(n), np.zeros(nr)]),
                   options={"time_limit": time_limit_s, "mip_rel_gap": 0.0})
    if res.x is None:
        return None
    index = {id(c): i for i, c in enumerate(columns)}
    return {index[id(c)]: int(round(v)) for c, v in zip(cols, res.x[:n]) if round(v) > 0}


def cover_model(problem: AllocationProblem, columns: Sequence[Column], options: Options, model: str,
                target: float, pool: Pool, capped: bool, time_limit_s: float = 10.0) -> tuple[float, dict[int, int]]:
    """Greedy cover of `target` (a fraction of the model's requests) from `options`, ranked by fraction per $
    (`capped`: the fraction capped at what is left), the last part at least cost from `columns` (module
    docstring); takes the nodes from `pool`. Homogeneous columns only (one configuration each). Returns
    (fraction left, counts per column)."""
    keys = sorted({key for c in columns for key in _need(c)}, key=str)
    at = {key: i for i, key in enumerate(keys)}
    col_key = np.array([at[next(iter(_need(c)))] for c in columns] + [0], dtype=np.int64)
    col_k = np.array([next(iter(_need(c).values())) for c in columns] + [0], dtype=np.int64)
    k1, k2 = col_key[options.p_col], col_key[options.q_col]
    n1 = col_k[options.p_col] * options.p_mult
    n2 = col_k[options.q_col] * options.q_mult
    same = k1 == k2
    n1, n2 = np.where(same, n1 + n2, n1), np.where(same, 0, n2)
    frac, cost = options.fraction, options.usd_per_hour
    counts: dict[int, int] = {}
    left = target
    while left > TOL and len(frac):
        free = np.array([pool.get(key, 0) for key in keys], dtype=np.int64)
        fits = np.minimum(free[k1] // np.maximum(n1, 1), np.where(n2 > 0, free[k2] // np.maximum(n2, 1), 1 << 40))
        if not fits.any():
            break
        eff = np.divide(np.minimum(frac, left) if capped else frac, cost, out=np.full(len(cost), np.inf), where=cost > 0)
        eff[fits == 0] = -np.inf
        best = int(np.lexsort((cost, -eff))[0])
        if frac[best] > left + TOL:  # the best whole unit would overshoot: buy the last part at least cost
            rest = least_cost_cover(problem, columns, model, left, pool, time_limit_s)
            if rest is None:
                break
            for j, n in rest.items():
                counts[j] = counts.get(j, 0) + n
                for key, k in _need(columns[j]).items():
                    pool[key] -= k * n
            return 0.0, counts
        n = int(min(max(1, math.floor(left / frac[best] + TOL)), fits[best]))
        for col, mult in ((options.p_col[best], options.p_mult[best]), (options.q_col[best], options.q_mult[best])):
            if col >= 0 and mult > 0:
                counts[int(col)] = counts.get(int(col), 0) + int(mult) * n
                for key, k in _need(columns[col]).items():
                    pool[key] -= k * int(mult) * n
        left -= n * frac[best]
    return max(0.0, left), counts


class _Greedy:
    """One baseline's greedy over a problem: its columns and options per model, and attempts at target levels."""

    def __init__(self, problem: AllocationProblem, method: str, time_limit_s: float):
        # The homogeneous library (prepared once, shared with Homo-ILP), unpruned: a dominated one-node template
        # may be what a one-node baseline needs.
        self.problem = homogeneous_problem(problem)
        columns, self.report = prune_columns(self.problem, prune_dominated=False)
        self.models = sorted({m for (m, _), d in problem.demand_tokens_per_s.items() if d > 0})
        build = homo_options if method == "homo" else cauchy_options
        if method == "homo":
            self.columns = [c for c in columns if c.template.phase == "aggregated" and is_one_node(c.template)]
        else:
            self.columns = [c for c in columns if c.template.phase in DEMAND_PHASES]
        self.options = {m: build(self.problem, self.columns, m) for m in self.models}
        self.time_limit_s = time_limit_s
        self.capped = method == "cauchy"
        self._after: dict[tuple, tuple[bool, Pool, dict[int, int]]] = {}

    def attempt(self, targets: Mapping[str, float]) -> tuple[bool, list[PlannedInstance]]:
        """Serve each model its target fraction in name order; whether all are met, and the instances.

        The state after each prefix of (model, target) is remembered: a search that moves one model's target
        re-plays only the models after it."""
        state: tuple[bool, Pool, dict[int, int]] = (True, dict(self.problem.available_nodes), {})
        prefix: tuple = ()
        for model in self.models:
            prefix += ((model, targets.get(model, 1.0)),)
            known = self._after.get(prefix)
            if known is None:
                ok, pool, counts = state[0], dict(state[1]), dict(state[2])
                left, got = cover_model(self.problem, self.columns, self.options[model], model, prefix[-1][1],
                                        pool, self.capped, self.time_limit_s)
                for j, n in got.items():
                    counts[j] = counts.get(j, 0) + n
                known = (ok and left <= TOL, pool, counts)
                if len(self._after) >= MEMO_STATES:
                    self._after.clear()
                self._after[prefix] = known
            state = known
        ok, _, counts = state
        return ok, [PlannedInstance(self.columns[j].template, self.columns[j].region, n,
                                    self.columns[j].usd_per_hour) for j, n in sorted(counts.items())]

    def reach(self, held: Mapping[str, float], free: Sequence[str]) -> float:
        """`scarcity.LevelOracle` of this greedy: the largest common level of `free` it meets (bisection)."""
        base = {m: v for m, v in held.items() if m not in free}
        if self.attempt({**base, **{m: 1.0 for m in free}})[0]:
            return 1.0
        lo, hi = 0.0, 1.0
        if not self.attempt({**base, **{m: 0.0 for m in free}})[0]:
            return 0.0
        for _ in range(BISECTION_STEPS):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if self.attempt({**base, **{m: mid for m in free}})[0] else (lo, mid)
        return lo


def _greedy_plan(problem: AllocationProblem, method: Method, scarcity_mode: Scarcity | None,
                 time_limit_s: float) -> Plan:
    if scarcity_mode not in (None, "scale", "fair"):
        raise CoralError(f"unknown scarcity mode {scarcity_mode!r}.", "use scale, fair, or none.")
    start = time.perf_counter()
    greedy = _Greedy(problem, method, time_limit_s)
    notes = [f"{method}: greedy over {len(greedy.columns)} (template, region) pairs, the last part of "
             f"each model's demand at least cost"]
    ok, instances = greedy.attempt({})
    status: SolveStatus = "heuristic"
    level = 1.0
    if not ok:
        if scarcity_mode is None:
            raise InfeasibleError(f"{method} cannot meet demand with this availability (greedy over "
                                  f"{'one-node aggregated' if method == 'homo' else 'homogeneous'} replicas).",
                                  SCARCITY_FIX)
        if scarcity_mode == "scale":
            levels = scarcity.uniform_levels(greedy.models, greedy.reach)
            notes.append(scarcity.uniform_note(levels))
            status = "scaled"
        else:
            levels = scarcity.fair_levels(greedy.models, greedy.reach)
            notes.append("max-min fair share: " + ", ".join(f"{m} {f:.1%}" for m, f in sorted(levels.items())))
            status = "fair-share"
        ok_level, instances = greedy.attempt(levels)
        if not ok_level:  # the greedy met each level while searching; re-met here, so this is a bug guard
            raise CoralError(f"{method}: the greedy no longer meets the levels it found ({levels}).",
                             "report this plan's inputs.")
        level = min(levels.values(), default=0.0)
    return build_plan(problem, method, status, instances, lp_bound=math.nan,
                      solve_s=time.perf_counter() - start, demand_scale=level, notes=notes,
                      pruning=greedy.report.as_dict())


def plan_homo(problem: AllocationProblem, *, scarcity_mode: Scarcity | None = None,
              time_limit_s: float = 30.0) -> Plan:
    """Homo: per model the one-node aggregated replica with the most tokens/s per $, replicated within
    availability, the last part at least cost (`time_limit_s` per last-part ILP)."""
    return _greedy_plan(problem, "homo", scarcity_mode, time_limit_s)


def plan_cauchy(problem: AllocationProblem, *, scarcity_mode: Scarcity | None = None,
                time_limit_s: float = 30.0) -> Plan:
    """Cauchy: homogeneous prefill/decode units ranked by capped demand served per $, replicated within
    availability, the last part at least cost (`time_limit_s` per last-part ILP)."""
    return _greedy_plan(problem, "cauchy", scarcity_mode, time_limit_s)


def plan_homo_ilp(problem: AllocationProblem, *, scarcity_mode: Scarcity | None = None,
                  time_limit_s: float = SAFETY_NET_S, gap_rel: float = 1e-4,
                  max_nodes: int | None = DEFAULT_MAX_NODES, diagnose: bool = True) -> Plan:
    """Homo-ILP: Coral's allocation ILP over the homogeneous templates only (`solve_plan`'s limits)."""
    return solve_plan(homogeneous_problem(problem), method="homo-ilp", scarcity_mode=scarcity_mode,
                      time_limit_s=time_limit_s, gap_rel=gap_rel, max_nodes=max_nodes, diagnose=diagnose)
