"""Throughput-optimal pipeline placement of one node multiset: the paper's ILP, our exact fast method, brute force.

Notation (coral.md §2). A multiset holds `counts[i]` nodes of configuration i (i = 0..m-1), L layers, S stages.
`tables[S][i, j-1]` = T̂_j(config i) at the per-stage budget of an S-stage pipeline: the most tokens/s one node
holding j layers delivers (0 where j layers do not fit). A stage's throughput is the sum of its nodes' T̂ at the
stage's layer count; the pipeline's is the minimum over stages; the template is the best over S = 1..|G'|.

Fast method (ours, exact). Nodes of one configuration are interchangeable, so a placement with S stages is a
partition of the count vector into S non-empty sub-vectors v_1..v_S plus layer counts j_1..j_S summing to L.
For one partition, with stage throughputs f_s(j) = Σ_i v_s[i]·T̂_j(i) non-increasing in j, every stage holds
at least one layer and the remaining L-S layers go one at a time; each stage's extra layers form a prefix of
its list f_s(2), f_s(3), …, so the best bottleneck is min(min_s f_s(1), (L-S)-th largest of all f_s(j), j ≥ 2)
(any split takes L-S prefix entries whose smallest is at most that order statistic; the top L-S entries
themselves are prefixes and reach it). The method enumerates multiset partitions (203 at most for 6 nodes,
cached per count vector) and evaluates them together in NumPy. Tables that are not monotone in j fall back to
an exact max-min DP over layer counts per partition, so the method is exact for any table.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Mapping

import numpy as np

from coral_dagster.errors import CoralError, SolverTimeoutError
from coral_dagster.highs import pulp_solver, quiet_stdout, solve_status

Tables = Mapping[int, np.ndarray]


@dataclass(frozen=True)
class Placement:
    """An optimal placement: per stage the node counts per configuration and the layers it holds."""

    n_stages: int
    groups: tuple[tuple[int, ...], ...]
    layers: tuple[int, ...]
    tokens_per_s: float
    proven_optimal: bool = True

    def stage_tokens_per_s(self, tables: Tables) -> tuple[float, ...]:
        """Each stage's throughput under `tables` (the pipeline's is the minimum)."""
        tab = tables[self.n_stages]
        return tuple(float(np.dot(g, tab[:, j - 1])) for g, j in zip(self.groups, self.layers))


def _check_inputs(counts: tuple[int, ...], tables: Tables, n_layers: int) -> None:
    if any(k < 0 for k in counts) or sum(counts) == 0:
        raise CoralError(f"node counts {counts} are empty or negative.", "give at least one node.")
    for s in range(1, min(sum(counts), n_layers) + 1):
        if s not in tables:
            raise CoralError(f"no throughput table for {s} stages.", "build tables for S = 1..number of nodes.")
        shape = tables[s].shape
        if shape != (len(counts), n_layers):
            raise CoralError(
                f"throughput table for S={s} has shape {shape}, expected {(len(counts), n_layers)}.",
                "give one row per configuration and one column per layer count 1..L.",
            )


@lru_cache(maxsize=None)
def multiset_partitions(counts: tuple[int, ...]) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """All ways to split a count vector into unordered non-empty parts.

    Returns the distinct parts (G × m array) and, per number of parts S, a (P × S) array of part indices.
    """
    subs = [v for v in itertools.product(*(range(k + 1) for k in counts)) if any(v)]
    index = {v: i for i, v in enumerate(subs)}
    by_size: dict[int, list[tuple[int, ...]]] = {}

    def split(rest: tuple[int, ...], max_idx: int, chosen: tuple[int, ...]) -> None:
        if not any(rest):
            by_size.setdefault(len(chosen), []).append(chosen)
            return
        # Parts are taken in non-increasing index order so each multiset of parts appears once.
        for idx in range(min(max_idx, index[rest]), -1, -1):
            v = subs[idx]
            if all(a <= b for a, b in zip(v, rest)):
                split(tuple(b - a for a, b in zip(v, rest)), idx, chosen + (idx,))

    split(tuple(counts), len(subs) - 1, ())
    groups = np.array(subs, dtype=np.float64).reshape(len(subs), len(counts))
    return groups, {s: np.array(p, dtype=np.int64) for s, p in sorted(by_size.items())}


def _monotone(tab: np.ndarray) -> bool:
    return bool(np.all(np.diff(tab, axis=1) <= 0))


def _best_monotone(vals: np.ndarray, n_layers: int) -> np.ndarray:
    """Best bottleneck per partition (the closed form above) for stage curves vals (P × S × L)."""
    n_parts, s, _ = vals.shape
    first = vals[:, :, 0].min(axis=1)
    k = n_layers - s
    if k == 0:
        return first
    # A stage takes at most L-S extra layers, so only f_s(2..L-S+1) can be among the top L-S.
    extras = vals[:, :, 1 : k + 1].reshape(n_parts, s * k)
    kth = np.partition(extras, s * k - k, axis=1)[:, s * k - k]
    return np.minimum(first, kth)


def _layers_monotone(f: np.ndarray, value: float, n_layers: int) -> tuple[int, ...]:
    """Layer counts reaching `value` for stage curves f (S × L), non-increasing in j."""
    most = (f >= value).sum(axis=1).astype(np.int64)
    excess = int(most.sum()) - n_layers
    # Take layers back from the stages holding the most, keeping the split even; fewer layers never hurt.
    while excess > 0:
        s = int(np.argmax(most))
        most[s] -= 1
        excess -= 1
    return tuple(int(j) for j in most)


def _best_general(vals: np.ndarray, n_layers: int) -> tuple[np.ndarray, list[tuple[int, ...]]]:
    """Exact max-min over layer splits for any curves: DP over stages, vectorized over partitions."""
    n_parts, s, n_l = vals.shape
    h = vals[:, 0, :].copy()  # h[p, l-1]: best bottleneck of the first stages holding l layers
    choice = []
    j_idx = np.arange(1, n_l + 1)
    for t in range(1, s):
        # cand[p, l, j] = min(h[p, l-j], f_t(j)) for 1 <= j < l
        prev = np.full((n_parts, n_l, n_l), -np.inf)
        for l in range(2, n_l + 1):
            js = j_idx[: l - 1]
            prev[:, l - 1, : l - 1] = np.minimum(h[:, l - js - 1], vals[:, t, : l - 1])
        best_j = prev.argmax(axis=2)
        h = np.take_along_axis(prev, best_j[:, :, None], axis=2)[:, :, 0]
        choice.append(best_j + 1)
    values = h[:, n_layers - 1]
    splits = []
    for p in range(n_parts):
        layers, rest = [], n_layers
        for t in range(s - 1, 0, -1):
            j = int(choice[t - 1][p, rest - 1])
            layers.append(j)
            rest -= j
        layers.append(rest)
        splits.append(tuple(reversed(layers)))
    return np.where(np.isfinite(values), values, 0.0), splits


def _upper_bound(counts: tuple[int, ...], tab: np.ndarray, s: int, n_layers: int) -> float:
    """A bound on any S-stage bottleneck for monotone tables: some stage holds ≥ ⌈L/S⌉ layers (at most all
    nodes serve it), and the S stage throughputs together are at most Σ_k T̂_1(g_k)."""
    c = np.asarray(counts, dtype=np.float64)
    return float(min(c @ tab[:, -(-n_layers // s) - 1], (c @ tab[:, 0]) / s))


def best_placement_fast(counts: tuple[int, ...], tables: Tables, n_layers: int) -> Placement | None:
    """The exact optimum over S = 1..min(|G'|, L) by multiset partitions; None when every placement gives 0."""
    counts = tuple(int(k) for k in counts)
    _check_inputs(counts, tables, n_layers)
    groups, by_s = multiset_partitions(counts)
    best: Placement | None = None
    for s, parts in by_s.items():
        if s > n_layers:
            break
        tab = np.asarray(tables[s], dtype=np.float64)
        monotone = _monotone(tab)
        if monotone and best is not None and _upper_bound(counts, tab, s, n_layers) <= best.tokens_per_s:
            continue
        vals = (groups @ tab)[parts]  # P × S × L
        if monotone:
            values = _best_monotone(vals, n_layers)
            p = int(np.argmax(values))
            value = float(values[p])
            if value <= 0 or (best is not None and value <= best.tokens_per_s):
                continue
            layers = _layers_monotone(vals[p], value, n_layers)
        else:
            values, splits = _best_general(vals, n_layers)
            p = int(np.argmax(values))
            value = float(values[p])
            if value <= 0 or (best is not None and value <= best.tokens_per_s):
                continue
            layers = splits[p]
        part = tuple(tuple(int(x) for x in groups[g]) for g in parts[p])
        best = Placement(s, part, layers, value)
    return best


def best_placement_brute(counts: tuple[int, ...], tables: Tables, n_layers: int) -> Placement | None:
    """Every assignment of labelled nodes to stages and every layer split (tiny inputs only)."""
    counts = tuple(int(k) for k in counts)
    _check_inputs(counts, tables, n_layers)
    nodes = [i for i, k in enumerate(counts) for _ in range(k)]
    best: Placement | None = None
    for s in range(1, min(len(nodes), n_layers) + 1):
        tab = tables[s]
        splits = [
            tuple(b - a for a, b in zip((0,) + cut, cut + (n_layers,)))
            for cut in itertools.combinations(range(1, n_layers), s - 1)
        ]
        for assign in itertools.product(range(s), repeat=len(nodes)):
            grp = [[0] * len(counts) for _ in range(s)]
            for node, st in zip(nodes, assign):
                grp[st][node] += 1
            for layers in splits:
                value = min(sum(g[i] * tab[i, j - 1] for i in range(len(counts))) for g, j in zip(grp, layers))
                if value > 0 and (best is None or value > best.tokens_per_s):
                    best = Placement(s, tuple(tuple(g) for g in grp), layers, float(value))
    return best


@dataclass(frozen=True)
class IlpSolve:
    """The paper's ILP over all S: the best placement and the solver's evidence."""

    placement: Placement | None
    solve_s: float
    n_variables: int
    n_constraints: int
    all_optimal: bool


def _solve_ilp_s(nodes: list[int], tab: np.ndarray, n_layers: int, s: int, time_limit_s: float):
    """The paper's ILP for a fixed number of stages S.

    Notation: stages s, layer counts j = 1..L, nodes k with configuration g_k.
    Variables: x[s,j] (stage s holds j layers), y[s,k] (node k serves stage s), z[s,j,k] = x·y, T ≥ 0.
    Objective: maximise T.
    """
    import pulp

    prob = pulp.LpProblem(f"placement_S{s}", pulp.LpMaximize)
    stages, js, ks = range(s), range(1, n_layers + 1), range(len(nodes))
    x = {(a, j): prob.add_variable(f"x_{a}_{j}", cat=pulp.LpBinary) for a in stages for j in js}
    y = {(a, k): prob.add_variable(f"y_{a}_{k}", cat=pulp.LpBinary) for a in stages for k in ks}
    # z is only needed where T̂ > 0: a zero coefficient adds nothing to C5.
    z = {
        (a, j, k): prob.add_variable(f"z_{a}_{j}_{k}", cat=pulp.LpBinary)
        for a in stages for j in js for k in ks if tab[nodes[k], j - 1] > 0
    }
    t = prob.add_variable("T", lowBound=0)
    prob += t
    # C1 each stage holds exactly one layer count: Σ_j x[s,j] = 1 (S rows)
    for a in stages:
        prob += pulp.lpSum(x[a, j] for j in js) == 1, f"C1_{a}"
    # C2 every node serves exactly one stage: Σ_s y[s,k] = 1 (|G'| rows)
    for k in ks:
        prob += pulp.lpSum(y[a, k] for a in stages) == 1, f"C2_{k}"
    # C3 the stages hold all layers: Σ_s Σ_j j·x[s,j] = L (1 row)
    prob += pulp.lpSum(j * x[a, j] for a in stages for j in js) == n_layers, "C3"
    # C4 z = x·y linearised: z ≤ x, z ≤ y, z ≥ x + y - 1 (3 rows per z)
    for (a, j, k), v in z.items():
        prob += v <= x[a, j], f"C4x_{a}_{j}_{k}"
        prob += v <= y[a, k], f"C4y_{a}_{j}_{k}"
        prob += v >= x[a, j] + y[a, k] - 1, f"C4xy_{a}_{j}_{k}"
    # C5 the bottleneck: T ≤ Σ_j Σ_k z[s,j,k]·T̂_j(g_k) (S rows)
    for a in stages:
        prob += t <= pulp.lpSum(float(tab[nodes[k], j - 1]) * z[a, j, k] for j in js for k in ks if (a, j, k) in z), f"C5_{a}"
    solver = pulp_solver(time_limit_s, 0.0, gapAbs=0.0)
    with quiet_stdout():
        prob.solve(solver)
    optimal = solve_status(prob, integer=True)[0] == "optimal"
    chosen = [[j for j in js if (x[a, j].varValue or 0) > 0.5] for a in stages]
    if any(len(c) != 1 for c in chosen):  # no incumbent (e.g. the time limit came first)
        return None, optimal, prob.numVariables(), prob.numConstraints()
    groups = [[0] * int(tab.shape[0]) for _ in stages]
    for (a, k), v in y.items():
        if v.varValue is not None and v.varValue > 0.5:
            groups[a][nodes[k]] += 1
    layers = tuple(c[0] for c in chosen)
    # The value is recomputed from the integral solution so it compares exactly with the other methods.
    value = min(float(np.dot(g, tab[:, j - 1])) for g, j in zip(groups, layers))
    placement = Placement(s, tuple(tuple(g) for g in groups), layers, value, optimal)
    return placement, optimal, prob.numVariables(), prob.numConstraints()


def best_placement_ilp(
    counts: tuple[int, ...], tables: Tables, n_layers: int, time_limit_s: float = 60.0
) -> IlpSolve:
    """The paper's ILP (one per S, best over S = 1..min(|G'|, L)) with PuLP and HiGHS."""
    counts = tuple(int(k) for k in counts)
    _check_inputs(counts, tables, n_layers)
    nodes = [i for i, k in enumerate(counts) for _ in range(k)]
    start = time.perf_counter()
    best: Placement | None = None
    all_optimal, n_var, n_con = True, 0, 0
    for s in range(1, min(len(nodes), n_layers) + 1):
        placement, optimal, nv, nc = _solve_ilp_s(nodes, np.asarray(tables[s], dtype=np.float64), n_layers, s, time_limit_s)
        all_optimal &= optimal
        n_var, n_con = n_var + nv, n_con + nc
        if placement is None and not optimal:
            raise SolverTimeoutError(
                f"the placement ILP for {s} stages found no solution within {time_limit_s:g} s.",
                "raise the time limit or use method='fast'.",
            )
        if placement is not None and placement.tokens_per_s > 0 and (
            best is None or placement.tokens_per_s > best.tokens_per_s
        ):
            best = placement
    return IlpSolve(best, time.perf_counter() - start, n_var, n_con, all_optimal)
