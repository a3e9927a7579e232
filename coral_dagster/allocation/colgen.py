"""Exact speed-ups of the allocation ILP: decomposition, the LP by column generation, reduced-cost fixing.

Decomposition. Demand keys are tied together only by availability (C1) and by aggregated templates (which serve
both phases of a model). Writing C1 once per group of tied keys (each group may use all of the availability)
relaxes the ILP into independent problems; when their optima together fit availability, they are optimal for the
whole ILP. Otherwise the whole ILP is solved the same way with C1 as it is.

Column generation. The LP relaxation is solved over a few columns at a time: the restricted LP's duals price
every column in NumPy (reduced cost d_j = c_j − Σ_i a_ij π_i) and the most negative ones join, until none is
negative; the restricted optimum is then the LP optimum z_LP.

Reduced-cost fixing. For any feasible plan ν, cost(ν) ≥ z_LP + Σ_j d_j ν_j (d_j ≥ 0 for columns at their lower
bound), so once a plan of cost z is known no column with d_j > z − z_LP is in a cheaper one. A first plan comes
from the ILP over the columns the LP touched; the ILP is then solved over every column with d_j ≤ z − z_LP, and
its optimum is optimal for all columns. In the decomposed problem this holds per group, with each group's own
z_g − z_LP,g, which keeps far fewer columns than the sum of the gaps would. A group whose threshold would keep
more than MAX_PER_GROUP columns (churn makes the LP weak: it launches a fraction of a new instance) keeps its
MAX_PER_GROUP smallest reduced costs; the plan is then optimal only when its gap fits that threshold, and is
otherwise reported as unproven with the bound min(ILP bound, z_LP + threshold).

Decomposition bound. When the group optima do not fit together, the decomposed solve still bounds the whole
ILP: a feasible plan's part in group g is feasible for g alone, so it costs at least L_g (g's ILP optimum less the
solver's gap) and at least z_LP,g + d_j (split reduced costs d) when it uses column j. A plan of cost at most z
therefore uses only columns with d_j ≤ z − Σ_h L_h + L_g − z_LP,g, a threshold set by how far z is above the
decomposed optimum rather than above the (weaker) whole LP; the whole ILP over those columns is optimal. The
whole ILP starts from the columns a plan within SPLIT_SLACK of the decomposed optimum may use, so when the
optimum is that close (usual: a few nodes collide), one ILP finds and proves it.

Rounded LP. When no ILP found a plan before the time limit, the LP's counts are rounded down (which keeps them within
availability) and what that leaves short of the LP's own routing, per (key, region), is filled with the instances
that cover most of it per $ within the nodes left; the dearest instances are then dropped one at a time while
every model's requests stay routable. That plan is returned unproven, bounded by the LP.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Mapping, Sequence

import numpy as np
from scipy import sparse

from coral_dagster.allocation import ilp
from coral_dagster.allocation.problem import AllocationProblem, DemandKey
from coral_dagster.allocation.prune import PHASE_CODE, Column, prepare
from coral_dagster.errors import CoralError

INITIAL_PER_KEY = 24
FIRST_PER_GROUP = 300
MAX_PER_GROUP = 4000
ADD_PER_ROUND = 200
FALLBACK_THETA = 0.02
SPLIT_SLACK = 0.03
# Each ILP of the decomposed attempt gets this share of the work limit (nodes); the whole ILP, when needed, all of it.
DECOMPOSED_SHARE = 0.4
# The first ILP over the columns fixing keeps gets this share of the work limit (nodes); a wider one all of it.
FIRST_ILP_SHARE = 0.5
TOL = 1e-9
# Up to this many columns the LP and the ILP are solved directly: the detour costs more than it saves.
DIRECT_MAX = 300


@dataclass(frozen=True)
class MinCostSolve:
    """The ILP answer over all columns plus the LP relaxation and what the speed-ups did."""

    result: ilp.SolveResult
    lp_status: str
    lp_objective: float
    lp_columns: int
    lp_rounds: int
    ilp_columns: int
    theta: float
    groups: int = 1
    decomposed: bool = False
    rounded: bool = False


@dataclass(frozen=True)
class _SplitBound:
    """What a decomposed solve whose group optima do not fit together proves (module docstring): per column its
    group and split reduced cost; per group its LP optimum z_LP,g and lower bound L_g."""

    labels: np.ndarray
    reduced: np.ndarray
    z_lp_group: np.ndarray
    lower: np.ndarray

    def needed(self, z: float, tol: float) -> set[int]:
        """The columns a plan of cost at most `z` can use."""
        threshold = z - self.lower.sum() + self.lower - self.z_lp_group + tol
        return {int(j) for j in np.nonzero(self.reduced <= threshold[self.labels])[0]}


def _least_outside(reduced: np.ndarray, keep: Sequence[int]) -> float:
    """The least reduced cost of a column not in `keep` (inf when every column is): a plan using one costs at
    least the LP bound plus it."""
    outside = np.ones(len(reduced), dtype=bool)
    outside[list(keep)] = False
    return float(reduced[outside].min()) if outside.any() else math.inf


def _covers(reduced: np.ndarray, keep: Sequence[int], needed: np.ndarray | float) -> bool:
    """Whether every column with reduced cost up to `needed` (its own, per column, or one for all) is in `keep`:
    then no column left out is in a plan better than the one found."""
    outside = np.ones(len(reduced), dtype=bool)
    outside[list(keep)] = False
    return bool(np.all(reduced[outside] > np.broadcast_to(needed, reduced.shape)[outside]))


def _timed(deadline: float) -> str:
    """`feasible-time-limit` once the wall-clock safety net has passed (a decision taken on it is not
    reproducible), else ""."""
    return "feasible-time-limit" if time.perf_counter() >= deadline else ""


def _infeasible(status: str, n: int, rounds: int = 1, groups: int = 1) -> MinCostSolve:
    return MinCostSolve(ilp.SolveResult("infeasible", (), math.nan, math.nan, 0.0), status, math.nan, n, rounds, 0,
                        math.inf, groups)


@dataclass(frozen=True)
class _Data:
    """The columns as arrays: node counts per configuration, region, model, phase, throughput and price."""

    use: np.ndarray
    configs: tuple
    region_idx: np.ndarray
    regions: tuple[str, ...]
    model_idx: np.ndarray
    models: tuple[str, ...]
    phase_code: np.ndarray
    tokens_per_s: np.ndarray
    price: np.ndarray
    running: np.ndarray


def _data(problem: AllocationProblem, columns: Sequence[Column]) -> _Data:
    regions = tuple(sorted({c.region for c in columns}))
    reg = {r: i for i, r in enumerate(regions)}
    region_idx = np.array([reg[c.region] for c in columns], dtype=np.int64)
    price = np.array([c.usd_per_hour for c in columns], dtype=np.float64)
    running = np.array([c.running for c in columns], dtype=np.float64)
    if all(c.row >= 0 for c in columns):
        lib = prepare(problem.templates)
        rows = np.array([c.row for c in columns], dtype=np.int64)
        return _Data(lib.use[rows], lib.configs, region_idx, regions, lib.model_idx[rows], lib.models,
                     lib.phase_code[rows], lib.tokens_per_s[rows], price, running)
    configs = tuple(sorted({n for c in columns for n, _ in c.template.nodes.counts}))
    col = {n: i for i, n in enumerate(configs)}
    use = np.zeros((len(columns), len(configs)), dtype=np.int64)
    for j, c in enumerate(columns):
        for n, k in c.template.nodes.counts:
            use[j, col[n]] = k
    models = tuple(sorted({c.template.model for c in columns}))
    midx = {m: i for i, m in enumerate(models)}
    return _Data(use, configs, region_idx, regions, np.array([midx[c.template.model] for c in columns], dtype=np.int64),
                 models, np.array([PHASE_CODE[c.template.phase] for c in columns], dtype=np.int64),
                 np.array([c.template.tokens_per_s for c in columns], dtype=np.float64), price, running)


def _demand_matrix(problem: AllocationProblem, d: _Data,
                   targets: Mapping[DemandKey, float] | None = None
                   ) -> tuple[list[tuple[str, str, str]], sparse.csr_matrix]:
    """C2 over the columns as `ilp.min_cost` writes it, one row per (model, phase, region of the columns): rows
    divided by D_m, coefficients capped at the row's target; an aggregated column serves both phases of its model
    (output tokens to decode, the trace's prompt tokens per output token to prefill). The routing shares are not
    columns: every restricted LP has them all."""
    keys = [key for key, dm in sorted(problem.demand_tokens_per_s.items()) if dm > 0]
    n_reg = len(d.regions)
    n = len(d.price)
    row = np.full((len(d.models), 2), -1, dtype=np.int64)
    demand = np.ones((len(d.models), 2))
    for i, (model, phase) in enumerate(keys):
        if model in d.models:
            m = d.models.index(model)
            row[m, PHASE_CODE[phase]] = i
            demand[m, PHASE_CODE[phase]] = problem.demand_tokens_per_s[(model, phase)]
    agg = d.phase_code == PHASE_CODE["aggregated"]
    ratio = np.zeros(n)
    for m in np.unique(d.model_idx[agg]) if n else ():
        model = d.models[int(m)]
        if model not in problem.prompt_per_output:
            raise CoralError(f"no prompt/output ratio for aggregated templates of {model}.",
                             "give prompt_per_output for every model with aggregated templates.")
        ratio[agg & (d.model_idx == m)] = problem.prompt_per_output[model]
    rr, cc, vv = [], [], []
    cols = np.arange(n)
    for code in (0, 1):
        target_row = row[d.model_idx, code] if n else np.zeros(0, dtype=np.int64)
        for mask, factor in ((d.phase_code == code, np.ones(n)), (agg, ratio if code == 0 else np.ones(n))):
            ok = mask & (target_row >= 0)
            rr.append(target_row[ok] * n_reg + d.region_idx[ok])
            cc.append(cols[ok])
            vv.append(d.tokens_per_s[ok] * factor[ok] / demand[d.model_idx[ok], code])
    rows_all = np.concatenate(rr)
    row_keys = [k + (r,) for k in keys for r in d.regions]
    caps = np.array([1.0 if targets is None else targets.get(k[:2], 1.0) for k in row_keys])
    vals = np.minimum(np.concatenate(vv), caps[rows_all]) if len(row_keys) else np.zeros(0)
    a_dem = sparse.csr_matrix((vals, (rows_all, np.concatenate(cc))), shape=(len(row_keys), n))
    a_dem.eliminate_zeros()  # a key with target 0 (a model a fair share serves at 0%) asks nothing of any column
    return row_keys, a_dem


def _avail_matrix(d: _Data, split: np.ndarray | None) -> tuple[list[tuple], sparse.csr_matrix]:
    """C1 over the columns with its row keys: (region, node), or (group, region, node) when split."""
    n = len(d.price)
    groups = np.asarray(split if split is not None else np.zeros(n), dtype=np.int64)
    col_j, cfg = np.nonzero(d.use)
    n_cfg, n_reg = max(1, len(d.configs)), max(1, len(d.regions))
    flat = (groups[col_j] * n_reg + d.region_idx[col_j]) * n_cfg + cfg
    uniq, row_of = np.unique(flat, return_inverse=True)
    names = []
    for u in uniq:
        g, rest = divmod(int(u), n_reg * n_cfg)
        r, c = divmod(rest, n_cfg)
        names.append((d.regions[r], d.configs[c]) if split is None else (g, d.regions[r], d.configs[c]))
    return names, sparse.csr_matrix((d.use[col_j, cfg].astype(float), (row_of, col_j)), shape=(len(uniq), n))


def group_labels(a_dem: sparse.csr_matrix, keys: Sequence[tuple]) -> np.ndarray:
    """Per column, its group of C2 rows (rows of one model, tied by its routing shares, or by a column serving
    several of them); -1 for none."""
    n_keys, n = a_dem.shape
    parent = list(range(n_keys))
    first_of: dict[str, int] = {}
    for i, key in enumerate(keys):
        parent[i] = first_of.setdefault(key[0], i)

    def find(k: int) -> int:
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    csc = a_dem.tocsc()
    nnz = np.diff(csc.indptr)
    for j in np.nonzero(nnz > 1)[0]:
        rows = csc.indices[csc.indptr[j]:csc.indptr[j + 1]]
        for r in rows[1:]:
            parent[find(int(r))] = find(int(rows[0]))
    roots = sorted({find(k) for k in range(n_keys)})
    label_of_key = np.array([roots.index(find(k)) for k in range(n_keys)], dtype=np.int64)
    labels = np.full(n, -1, dtype=np.int64)
    has = nnz > 0
    labels[has] = label_of_key[csc.indices[csc.indptr[:-1][has]]]
    return labels


def _objective_per_column(problem: AllocationProblem, d: _Data, values: np.ndarray) -> np.ndarray:
    """Each column's share of the objective: its cost plus the churn penalty its count implies."""
    k = ilp.churn_factor(problem)
    return d.price * values + k * d.price * np.maximum(0.0, values - d.running)


def _fits(problem: AllocationProblem, d: _Data, values: np.ndarray) -> bool:
    """Whether the counts stay within availability (C1 as it is, not split)."""
    names, a_avail = _avail_matrix(d, None)
    held = a_avail @ values
    return all(h <= problem.available_nodes.get(name, 0) + 1e-7 for name, h in zip(names, held))


def _generate(n: int, cost: np.ndarray, keys, a_dem, names, a_avail, chosen: set[int], solve_subset,
              deadline: float):
    """Column generation: solve over `chosen`, price every column with the duals, add the most negative reduced
    costs, repeat until none is negative. Returns (result over subset, subset, reduced costs, rounds)."""
    rounds = 0
    while True:
        rounds += 1
        subset = sorted(chosen)
        lp = solve_subset(subset, max(1.0, deadline - time.perf_counter()))
        if lp.status != "optimal":
            return lp, subset, None, rounds
        pi_a = np.array([lp.row_duals.get(("avail",) + name, 0.0) for name in names])
        pi_d = np.array([lp.row_duals.get(("demand",) + key, 0.0) for key in keys])
        reduced = cost - a_avail.T @ pi_a - a_dem.T @ pi_d
        pricing = reduced.copy()
        pricing[subset] = np.inf
        scale = max(1.0, abs(lp.objective))
        entering = [int(j) for j in np.argsort(pricing, kind="stable")[:ADD_PER_ROUND] if pricing[j] < -TOL * scale]
        if not entering or len(chosen) == n:
            return lp, subset, reduced, rounds
        chosen.update(entering)


def _best_per_key(a_dem: sparse.csr_matrix, weight: np.ndarray) -> set[int]:
    """The INITIAL_PER_KEY columns of each demand row that give the most per unit of `weight`."""
    out: set[int] = set()
    for i in range(a_dem.shape[0]):
        row = a_dem.getrow(i)
        eff = row.data / np.maximum(weight[row.indices], TOL)
        out.update(int(j) for j in row.indices[np.argsort(-eff, kind="stable")[:INITIAL_PER_KEY]])
    return out


def _lp(problem: AllocationProblem, columns: Sequence[Column], d: _Data, targets, deadline: float,
        split: np.ndarray | None):
    """The LP relaxation of `ilp.min_cost` by column generation: (result over subset, subset, reduced costs or
    None when it had to be settled on all columns, rounds)."""
    n = len(columns)
    keys, a_dem = _demand_matrix(problem, d, targets)
    names, a_avail = _avail_matrix(d, split)
    k = ilp.churn_factor(problem)
    cost = d.price * np.where(d.running > 0, 1.0, 1.0 + k)
    chosen = {int(j) for j in np.nonzero(d.running > 0)[0]} | _best_per_key(a_dem, cost)
    per_key = [float(np.max(cost[a_dem.getrow(i).indices] / a_dem.getrow(i).data)) if a_dem.getrow(i).nnz
               else 1.0 for i in range(len(keys))]
    # Unmet demand is priced far above serving it with the dearest column, so it is used only when needed.
    slack_usd = 100.0 * (sum(per_key) + 1.0)

    def solve_subset(subset, limit):
        return ilp.min_cost(problem, [columns[j] for j in subset], targets, integer=False, time_limit_s=limit,
                            slack_usd=slack_usd, split=split[subset].tolist() if split is not None else None)

    lp, subset, reduced, rounds = _generate(n, cost, keys, a_dem, names, a_avail, chosen, solve_subset, deadline)
    if lp.status == "optimal" and any(v > 1e-9 for v in (lp.overflow or {}).values()):
        # The elastic restricted LP could not meet demand: decide on the full LP, no shortcuts.
        full = ilp.min_cost(problem, columns, targets, integer=False,
                            time_limit_s=max(1.0, deadline - time.perf_counter()),
                            split=split.tolist() if split is not None else None)
        return full, list(range(n)), None, rounds
    return lp, subset, reduced, rounds


def solve_max_level(problem: AllocationProblem, columns: Sequence[Column], groups: Mapping[str, Sequence[DemandKey]],
                    fixed: Mapping[str, float] | None = None, *, integer: bool = True, cap: float = 1.0,
                    time_limit_s: float = 30.0, gap_rel: float = 1e-4,
                    max_nodes: int | None = None) -> ilp.SolveResult:
    """`ilp.max_level` over all columns by column generation and reduced-cost fixing (module docstring), the
    maximisation read as minimising −t, each MIP at most `max_nodes` nodes. Values come back for every column."""
    n = len(columns)
    if n <= DIRECT_MAX:
        return ilp.max_level(problem, columns, groups, fixed, integer=integer, cap=cap, time_limit_s=time_limit_s,
                             gap_rel=gap_rel, max_nodes=max_nodes)
    deadline = time.perf_counter() + time_limit_s
    d = _data(problem, columns)
    keys, a_dem = _demand_matrix(problem, d, {k: cap for k in problem.demand_tokens_per_s})
    names, a_avail = _avail_matrix(d, None)
    chosen = _best_per_key(a_dem, d.use.sum(axis=1).astype(float))

    def solve_subset(subset, limit, mip=False):
        return ilp.max_level(problem, [columns[j] for j in subset], groups, fixed, integer=mip, cap=cap,
                             time_limit_s=limit, gap_rel=gap_rel, max_nodes=max_nodes)

    lp, subset, reduced, _ = _generate(n, np.zeros(n), keys, a_dem, names, a_avail, chosen, solve_subset, deadline)
    if lp.status != "optimal":
        return lp
    if not integer:
        values = np.zeros(n)
        values[subset] = lp.values
        return replace(lp, values=tuple(values.tolist()))
    level_lp = lp.objective
    theta = float(np.sort(reduced)[min(FIRST_PER_GROUP, n) - 1])
    tol = TOL * max(1.0, abs(level_lp))
    proven = False
    while True:
        keep = sorted(set(subset) | {int(j) for j in np.nonzero(reduced <= theta)[0]})
        mip = solve_subset(keep, max(0.5, deadline - time.perf_counter()), mip=True)
        if mip.status in ("infeasible", "no-solution"):
            if len(keep) == n or _timed(deadline):
                return mip
            theta = max(theta * 4, FALLBACK_THETA * max(1.0, abs(level_lp)))
            continue
        # Any plan using a column with reduced cost d reaches at most level_lp − d.
        needed = level_lp - mip.objective + tol
        if _covers(reduced, keep, needed):
            proven = True
            break
        if _timed(deadline) or needed <= theta:  # unproven within the work limit, nothing left to widen to
            break
        theta = needed
    values = np.zeros(n)
    values[keep] = mip.values
    status = mip.status if proven else ilp.unproven(mip.status, _timed(deadline))
    bound = mip.bound if proven else max(mip.bound, level_lp - _least_outside(reduced, keep))
    return replace(mip, status=status, values=tuple(values.tolist()), bound=min(bound, level_lp))


def elastic_lp(problem: AllocationProblem, columns: Sequence[Column], overflow_weight: float, *,
               time_limit_s: float = 30.0) -> ilp.SolveResult:
    """`ilp.min_cost`'s LP with elastic availability (`overflow_weight`), by column generation."""
    n = len(columns)
    if n <= DIRECT_MAX:
        return ilp.min_cost(problem, columns, integer=False, overflow_weight=overflow_weight,
                            time_limit_s=time_limit_s)
    deadline = time.perf_counter() + time_limit_s
    d = _data(problem, columns)
    keys, a_dem = _demand_matrix(problem, d)
    names, a_avail = _avail_matrix(d, None)
    cost = d.price * (1.0 + ilp.churn_factor(problem) * (d.running == 0))

    def solve_subset(subset, limit):
        return ilp.min_cost(problem, [columns[j] for j in subset], integer=False, overflow_weight=overflow_weight,
                            time_limit_s=limit)

    return _generate(n, cost, keys, a_dem, names, a_avail, _best_per_key(a_dem, cost), solve_subset, deadline)[0]


def min_availability_scale(problem: AllocationProblem, columns: Sequence[Column], *,
                           time_limit_s: float = 30.0) -> float:
    """σ* of `ilp.availability_scale_lp` over all columns, by column generation; inf when no σ serves demand."""
    if not columns:
        return math.inf
    deadline = time.perf_counter() + time_limit_s
    d = _data(problem, columns)
    keys, a_dem = _demand_matrix(problem, d)
    names, a_avail = _avail_matrix(d, None)
    chosen = _best_per_key(a_dem, d.use.sum(axis=1).astype(float))

    def solve_subset(subset, limit):
        return ilp.availability_scale_lp(problem, [columns[j] for j in subset], time_limit_s=limit)

    lp = _generate(len(columns), np.zeros(len(columns)), keys, a_dem, names, a_avail, chosen, solve_subset,
                   deadline)[0]
    return float(lp.objective) if lp.status == "optimal" else math.inf


def solve_min_cost(problem: AllocationProblem, columns: Sequence[Column],
                   targets: Mapping[DemandKey, float] | None = None, *, time_limit_s: float = 30.0,
                   gap_rel: float = 1e-4, start: Sequence[float] | None = None,
                   max_nodes: int | None = None) -> MinCostSolve:
    """`ilp.min_cost` over all columns, exactly, touching few of them (see the module docstring). `start` (counts
    per column meeting the targets) is every ILP's first incumbent: its columns are in every ILP. Each ILP explores
    at most `max_nodes` nodes (the work limit); `time_limit_s` is a wall-clock safety net for the whole solve."""
    deadline = time.perf_counter() + time_limit_s
    n = len(columns)
    if n <= DIRECT_MAX:
        lp = ilp.min_cost(problem, columns, targets, integer=False, time_limit_s=time_limit_s)
        if lp.status != "optimal":
            return _infeasible(lp.status, n)
        mip = ilp.min_cost(problem, columns, targets, time_limit_s=max(0.5, deadline - time.perf_counter()),
                           gap_rel=gap_rel, start=start, max_nodes=max_nodes)
        if mip.status == "no-solution":
            return _undecomposed(_finish(problem, columns, _data(problem, columns), mip, list(range(n)), lp.objective,
                                         np.asarray(lp.values), n, 1, math.inf, None, 1, targets, deadline))
        return MinCostSolve(mip, "optimal", lp.objective, n, 1, n, math.inf)
    d = _data(problem, columns)
    keys, a_dem = _demand_matrix(problem, d)
    labels = group_labels(a_dem, keys)
    n_groups = len(set(labels.tolist()))
    start_values = np.asarray(start, dtype=float) if start is not None else None
    split_nodes = None if max_nodes is None else max(1, int(DECOMPOSED_SHARE * max_nodes))
    done = _solve(problem, columns, d, targets, deadline, gap_rel, labels, n_groups, start=start_values,
                  max_nodes=split_nodes)
    if isinstance(done, MinCostSolve) and (done.result.status in ("optimal", "infeasible") or _timed(deadline)):
        return done
    whole = _undecomposed(_solve(problem, columns, d, targets, deadline, gap_rel, None, n_groups,
                                 done if isinstance(done, _SplitBound) else None, start=start_values,
                                 max_nodes=max_nodes))
    if isinstance(done, MinCostSolve) and done.result.status in ilp.FEASIBLE[1:] and (
            whole.result.status in ("infeasible", "no-solution") or done.result.objective < whole.result.objective):
        return done  # the decomposed plan fits availability and the whole ILP found nothing cheaper in time
    return whole


def _undecomposed(done: MinCostSolve | _SplitBound | None) -> MinCostSolve:
    """The answer of a solve without `split`: only a decomposed one ends with None or a `_SplitBound`."""
    if not isinstance(done, MinCostSolve):
        raise RuntimeError(f"a solve without split ended with {done!r}; only a decomposed solve may")
    return done


def _solve(problem: AllocationProblem, columns: Sequence[Column], d: _Data, targets, deadline: float,
           gap_rel: float, split: np.ndarray | None, n_groups: int,
           split_bound: _SplitBound | None = None, start: np.ndarray | None = None, max_nodes: int | None = None
           ) -> MinCostSolve | _SplitBound | None:
    """LP, a first plan, reduced-cost fixing, the ILP. With `split` (decomposed), what it proves (or None) when
    the group optima do not fit availability together; `split_bound` is that proof, used by the whole ILP.
    `start`: counts per column, the first incumbent of every ILP (its columns join every ILP)."""
    n = len(columns)
    labels = np.maximum(split, 0) if split is not None else np.zeros(n, dtype=np.int64)
    n_labels = int(labels.max()) + 1 if n else 1
    lp, subset, reduced, rounds = _lp(problem, columns, d, targets, deadline, split)
    if lp.status != "optimal":
        # The decomposed LP relaxes the whole one: infeasible there means infeasible here.
        return _infeasible(lp.status, len(subset), rounds, n_groups)
    lp_values = np.zeros(n)
    lp_values[subset] = lp.values
    z_lp_group = np.bincount(labels, _objective_per_column(problem, d, lp_values), minlength=n_labels)
    z_lp = float(lp.objective)
    if reduced is None:  # settled on the full LP: no reduced costs to fix by
        mip = ilp.min_cost(problem, columns, targets, time_limit_s=max(0.5, deadline - time.perf_counter()),
                           gap_rel=gap_rel, split=split.tolist() if split is not None else None,
                           start=start.tolist() if start is not None else None, max_nodes=max_nodes)
        return _finish(problem, columns, d, mip, list(range(n)), z_lp, lp_values, n, rounds, math.inf, split,
                       n_groups, targets, deadline)
    running = {int(j) for j in np.nonzero(d.running > 0)[0]}
    first = set(subset) | running | (set(np.nonzero(start > 0)[0].tolist()) if start is not None else set())
    # A first plan from the columns the LP touched and each group's FIRST_PER_GROUP smallest reduced costs.
    sorted_reduced = [np.sort(reduced[labels == g]) for g in range(n_labels)]
    theta = np.array([r[min(FIRST_PER_GROUP, len(r)) - 1] if len(r) else 0.0 for r in sorted_reduced])
    capped = False
    tol = TOL * max(1.0, abs(z_lp))
    proven = fixed = False
    best = None  # (mip, keep, theta) of the cheapest plan found, kept when a larger ILP runs out of time
    bound = -math.inf  # the best lower bound any ILP proved for the whole problem
    incumbent = start  # each ILP starts from the cheapest plan found so far
    extra: set[int] = set()  # the columns the decomposition bound says a cheaper plan may use
    if split_bound is not None:
        # Start from every column a plan within SPLIT_SLACK of the decomposed optimum may use: a plan found there
        # at most that dear is proven optimal by the first ILP.
        extra = split_bound.needed(split_bound.lower.sum() * (1 + SPLIT_SLACK), tol)
        theta = np.zeros(n_labels)
    while True:
        keep = sorted(first | extra | {int(j) for j in np.nonzero(reduced <= theta[labels])[0]})
        # The first ILP leaves time for a wider one (the bound of a narrow ILP stops at the least reduced cost
        # left out).
        share = 1.0 if best is not None or len(keep) == n else FIRST_ILP_SHARE
        nodes = None if max_nodes is None else max(1, int(share * max_nodes))
        mip = ilp.min_cost(problem, [columns[j] for j in keep], targets,
                           time_limit_s=max(0.5, deadline - time.perf_counter()), gap_rel=gap_rel,
                           split=split[keep].tolist() if split is not None else None,
                           start=incumbent[keep].tolist() if incumbent is not None else None, max_nodes=nodes)
        if mip.status in ("infeasible", "no-solution"):
            if best is not None or len(keep) == n or mip.status == "no-solution" or _timed(deadline):
                break
            theta = np.maximum(theta * 4, FALLBACK_THETA * abs(z_lp))
            continue
        values = np.zeros(n)
        values[keep] = mip.values
        # A plan using a column left out costs at least the LP bound plus its reduced cost.
        bound = max(bound, min(mip.bound, z_lp + _least_outside(reduced, keep)))
        if best is None or mip.objective <= best[0].objective:
            best, incumbent = (mip, keep, theta), values
        gap_g = np.bincount(labels, _objective_per_column(problem, d, values), minlength=n_labels) - z_lp_group
        needed = gap_g + tol if split is not None else np.full(n_labels, mip.objective - z_lp + tol)
        by_split = split_bound.needed(mip.objective, tol) if split_bound is not None else None
        # Every column with reduced cost up to what this plan leaves above the LP bound was in the ILP: optimal.
        if _covers(reduced, keep, needed[labels]) or (by_split is not None and by_split <= set(keep)):
            fixed = True  # no column outside the ILP is in a cheaper plan: its bound bounds the whole problem
            proven = mip.status == "optimal" or len(keep) == n
            best = (mip, keep, theta)
            break
        if _timed(deadline) or capped:
            break
        if by_split is not None and len(by_split) < int((reduced <= needed[labels]).sum()):
            extra = by_split | {keep[i] for i, v in enumerate(mip.values) if v > 0}
            continue
        # Widen to what proves this plan, or, when the solver could not prove it within the ILP, to what lets the
        # wider ILP's bound reach the narrow one's.
        unproven = split is None and mip.status != "optimal"
        wider = np.maximum(theta, np.minimum(needed, mip.bound - z_lp + tol) if unproven else needed)
        if not np.any(wider > theta):
            break
        theta = wider
        # A group whose threshold would take more than MAX_PER_GROUP columns gets its MAX_PER_GROUP cheapest in
        # reduced cost instead: one more ILP of bounded size, whose plan is then optimal or reported unproven.
        limit = np.array([sorted_reduced[g][min(MAX_PER_GROUP, len(sorted_reduced[g])) - 1]
                          if len(sorted_reduced[g]) else np.inf for g in range(n_labels)])
        capped = bool(np.any(theta > limit))
        theta = np.minimum(theta, limit)
    if best is not None:
        mip, keep, theta = best
    done = _finish(problem, columns, d, mip, keep, z_lp, lp_values, len(subset), rounds, float(theta.max()),
                   split, n_groups, targets, deadline, proven, bound)
    if done is None and fixed and split is not None:
        values = np.zeros(n)
        values[keep] = mip.values
        found = np.bincount(labels, _objective_per_column(problem, d, values), minlength=n_labels)
        lower = np.maximum(z_lp_group, found - max(0.0, mip.objective - mip.bound))
        return _SplitBound(labels, reduced, z_lp_group, lower)
    return done


def _routable(cov: np.ndarray, weight: np.ndarray, key_model: np.ndarray, n_reg: int) -> bool:
    """Whether every model's requests can be split over regions with each share's phases served there: per model,
    the sum over regions of the least (supply / weight) over its phases reaches 1 (C2, C2')."""
    ratio = np.where(weight > 0, cov / np.where(weight > 0, weight, 1.0), np.inf).reshape(-1, n_reg)
    for m in np.unique(key_model):
        least = ratio[key_model == m].min(axis=0)
        if np.isfinite(least).any() and least[np.isfinite(least)].sum() < 1.0 - 1e-9:
            return False
    return True


def _rounded(problem: AllocationProblem, d: _Data, lp_values: np.ndarray, targets) -> np.ndarray | None:
    """The LP's counts rounded down, each (key, region) shortfall against the LP's own routing filled with the
    instances covering most of it per $ within the nodes left, then the dearest instances dropped while every
    model stays routable (module docstring); None when a shortfall cannot be filled."""
    keys, a_dem = _demand_matrix(problem, d, targets)
    n_reg = max(1, len(d.regions))
    weight = np.array([1.0 if targets is None else targets.get(k[:2], 1.0) for k in keys])
    key_model = np.array([k[0] for k in keys[::n_reg]]) if keys else np.array([])
    lp_cov = a_dem @ lp_values
    ratio = np.where(weight > 0, lp_cov / np.where(weight > 0, weight, 1.0), np.inf).reshape(-1, n_reg)
    need = np.zeros(len(keys))
    for m in np.unique(key_model):
        rows = np.nonzero(key_model == m)[0]
        least = ratio[rows].min(axis=0)
        if not np.isfinite(least).any():
            continue
        least = np.where(np.isfinite(least), least, 0.0)
        for k in rows:  # each phase's share of the model's requests, routed as the LP routes them
            need[k * n_reg:(k + 1) * n_reg] = weight[k * n_reg:(k + 1) * n_reg] * least / least.sum()
    values = np.floor(lp_values + 1e-6)
    left = np.zeros((n_reg, max(1, len(d.configs))))
    for r, region in enumerate(d.regions):
        for c, node in enumerate(d.configs):
            left[r, c] = problem.available_nodes.get((region, node), 0)
    np.subtract.at(left, d.region_idx, d.use * values[:, None])
    cov = a_dem @ values
    csc = a_dem.tocsc()
    for i in np.nonzero(need - cov > 1e-9)[0]:
        cols, vals = a_dem.indices[a_dem.indptr[i]:a_dem.indptr[i + 1]], a_dem.data[a_dem.indptr[i]:a_dem.indptr[i + 1]]
        while need[i] - cov[i] > 1e-9:
            fits = np.all(d.use[cols] <= left[d.region_idx[cols]] + 1e-9, axis=1)
            if not fits.any():
                return None
            score = np.where(fits, np.minimum(vals, need[i] - cov[i]) / np.maximum(d.price[cols], TOL), -np.inf)
            j = int(cols[int(np.argmax(score))])
            values[j] += 1
            left[d.region_idx[j]] -= d.use[j]
            cov[csc.indices[csc.indptr[j]:csc.indptr[j + 1]]] += csc.data[csc.indptr[j]:csc.indptr[j + 1]]
    if not _routable(cov, weight, key_model, n_reg):
        return None
    for j in sorted(np.nonzero(values)[0].tolist(), key=lambda j: -d.price[j]):
        column = csc[:, j].toarray().ravel()
        while values[j] > 0 and _routable(cov - column, weight, key_model, n_reg):
            values[j] -= 1
            cov = cov - column
    return values if _fits(problem, d, values) else None


def _finish(problem, columns, d, mip, keep, z_lp, lp_values, lp_columns, rounds, theta, split, n_groups, targets,
            deadline, proven: bool = True, fixing_bound: float = math.inf) -> MinCostSolve | None:
    """The MinCostSolve of an ILP over `keep`, or None when a decomposed plan does not fit availability.
    `fixing_bound`: the best lower bound the ILPs proved for the whole problem (used when `mip` is unproven).
    With no plan from the ILPs, the rounded LP's (module docstring) when it fits."""
    n = len(columns)
    if mip.status == "no-solution" and split is None:
        values = _rounded(problem, d, lp_values, targets)
        if values is not None:
            cost = float(_objective_per_column(problem, d, values).sum())
            result = ilp.SolveResult(ilp.unproven(mip.status, _timed(deadline)), tuple(values.tolist()), cost,
                                     min(cost, max(z_lp, fixing_bound) if math.isfinite(fixing_bound) else z_lp),
                                     mip.solve_s)
            return MinCostSolve(result, "optimal", z_lp, lp_columns, rounds, len(keep), theta, n_groups,
                                rounded=True)
    if mip.status in ("infeasible", "no-solution"):
        if split is not None and mip.status == "no-solution":
            return None
        return MinCostSolve(mip, "optimal", z_lp, lp_columns, rounds, len(keep), theta, n_groups,
                            split is not None)
    values = np.zeros(n)
    values[keep] = mip.values
    if split is not None:
        if not _fits(problem, d, values):
            return None
        if not _fits(problem, d, lp_values):
            whole, _, _, _ = _lp(problem, columns, d, targets, deadline, None)
            z_lp = whole.objective if whole.status == "optimal" else z_lp
    # Fixing is exact when the plan found leaves no more above the LP bound than the least reduced cost left out.
    proven = proven or len(keep) == n
    bound = mip.bound if proven else fixing_bound
    status = mip.status if proven else ilp.unproven(mip.status, _timed(deadline))
    result = ilp.SolveResult(status, tuple(values.tolist()), mip.objective, max(bound, min(z_lp, mip.objective)),
                             mip.solve_s)
    return MinCostSolve(result, "optimal", z_lp, lp_columns, rounds, len(keep), theta, n_groups, split is not None)
