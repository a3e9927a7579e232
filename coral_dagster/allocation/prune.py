"""Lossless pruning of (template, region) columns before the allocation ILP, with counts of what went."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np

from coral_dagster.allocation.problem import AllocationProblem
from coral_dagster.allocation.recent import Recent
from coral_dagster.catalog.nodes import NodeConfig
from coral_dagster.templates.types import Template

PHASE_CODE = {"prefill": 0, "decode": 1, "aggregated": 2}
# Up to this many templates dominance is checked exhaustively; above it, against one-node-smaller sub-multisets.
EXHAUSTIVE_DOMINANCE_MAX = 100_000


@dataclass(frozen=True)
class Column:
    """One ILP column: instances of `template` in `region`, at most `max_count`, with `running` live now.

    `row` is the template's row in the prepared library of the problem's templates (-1 when built by hand).
    """

    template: Template
    region: str
    usd_per_hour: float
    max_count: int
    running: int
    row: int = -1


@dataclass(frozen=True)
class PruneReport:
    """How many (template, region) columns each lossless rule removed.

    `not_sold`: a node configuration of the template is not sold (or has no availability) in the region, or the
    template needs more nodes of one than the region has; `no_demand`: its model and phase have no demand;
    `dominated`: another template of the same model, phase and SLO uses no more nodes of any configuration and
    gives no less throughput (it is never needed: swapping it in costs no more in any region, with any
    availability). Templates running now are never pruned as dominated (keeping them avoids churn).
    """

    templates: int
    columns_before: int
    not_sold: int
    no_demand: int
    dominated: int
    columns_after: int
    per_region: tuple[tuple[str, int, int], ...]
    dominance_rule: str = "exhaustive"

    def as_dict(self) -> dict:
        return {"templates": self.templates, "columns_before": self.columns_before, "not_sold": self.not_sold,
                "no_demand": self.no_demand, "dominated": self.dominated, "columns_after": self.columns_after,
                "dominance_rule": self.dominance_rule,
                "per_region": [{"region": r, "before": b, "after": a} for r, b, a in self.per_region]}


def _vectors(group: list[Template]) -> tuple[list[tuple[int, ...]], dict[tuple[int, ...], float]]:
    nodes = sorted({n for t in group for n, _ in t.nodes.counts})
    col = {n: i for i, n in enumerate(nodes)}
    vecs: list[tuple[int, ...]] = []
    own: dict[tuple[int, ...], float] = {}
    for t in group:
        v = [0] * len(nodes)
        for n, k in t.nodes.counts:
            v[col[n]] = k
        vecs.append(tuple(v))
        own[tuple(v)] = max(own.get(tuple(v), -1.0), t.tokens_per_s)
    return vecs, own


def dominated_ids(templates: tuple[Template, ...] | list[Template], keep: set[str] | frozenset[str] = frozenset(), *,
                  exhaustive: bool = True) -> set[str]:
    """Template ids dominated by another of the same (model, phase, SLO); ids in `keep` are never returned.

    B dominates A when B's node counts are at most A's everywhere (B ≠ A) and B's throughput is at least A's.
    Exhaustive: `best_at_most[v]`, the highest throughput among templates whose count vector is at most v, is
    computed once per distinct sub-vector by dropping one node at a time (O(sub-vectors × configurations), not
    every pair). Otherwise only one-node-smaller dominators are looked for: every template returned is still
    dominated (lossless), some dominated ones may stay.
    """
    groups: dict[tuple, list[Template]] = {}
    for t in templates:
        groups.setdefault((t.model, t.phase, t.slo_ms), []).append(t)
    out: set[str] = set()
    for group in groups.values():
        vecs, own = _vectors(group)
        if exhaustive:
            best_incl: dict[tuple[int, ...], float] = {}
            strict: dict[tuple[int, ...], float] = {}

            def best_strictly_below(v: tuple[int, ...]) -> float:
                if v not in strict:
                    strict[v] = max((best_at_most(v[:i] + (k - 1,) + v[i + 1:]) for i, k in enumerate(v) if k),
                                    default=-1.0)
                return strict[v]

            def best_at_most(v: tuple[int, ...]) -> float:
                if v not in best_incl:
                    best_incl[v] = max(own.get(v, -1.0), best_strictly_below(v))
                return best_incl[v]

            for size in sorted({sum(v) for v in own}):  # small vectors first keeps the recursion shallow
                for v in [v for v in own if sum(v) == size]:
                    best_at_most(v)
            below = best_strictly_below
        else:
            def below(v: tuple[int, ...]) -> float:
                return max((own.get(v[:i] + (k - 1,) + v[i + 1:], -1.0) for i, k in enumerate(v) if k),
                           default=-1.0)
        for t, v in zip(group, vecs):
            if below(v) >= t.tokens_per_s and t.template_id not in keep:
                out.add(t.template_id)
    return out


@dataclass(frozen=True)
class Library:
    """A template tuple prepared once for many solves: ids, node-count matrix, model and phase per row, the
    dominated rows and which dominance rule found them."""

    templates: tuple[Template, ...]
    ids: tuple[str, ...]
    configs: tuple[NodeConfig, ...]
    use: np.ndarray
    models: tuple[str, ...]
    model_idx: np.ndarray
    phase_code: np.ndarray
    tokens_per_s: np.ndarray
    dominated: np.ndarray
    dominance_rule: str


_LIBRARIES: Recent[Library] = Recent(8)


def prepare(templates: tuple[Template, ...], undominated: bool = False) -> Library:
    """The prepared library of a template tuple, remembered for the last few tuples (re-plans reuse one).

    `undominated`: the caller knows no template of the tuple needs pruning as dominated (the stored survivors of
    `allocation.prepared`, plus running templates, which pruning keeps anyway), so dominance is not searched."""
    return _LIBRARIES.get(templates, lambda: prepare_uncached(templates, undominated))


def prepare_uncached(templates: tuple[Template, ...], undominated: bool = False) -> Library:
    """`prepare` without the memo: duplicates collapse to the best, dominance is found once."""
    unique: dict[tuple, Template] = {}
    for t in templates:
        key = (t.model, t.phase, t.slo_ms, t.nodes)
        if key not in unique or unique[key].tokens_per_s < t.tokens_per_s:
            unique[key] = t
    kept = tuple(unique.values())
    ids = tuple(t.template_id for t in kept)
    configs = tuple(sorted({n for t in kept for n, _ in t.nodes.counts}))
    col = {n: i for i, n in enumerate(configs)}
    use = np.zeros((len(kept), len(configs)), dtype=np.int64)
    for i, t in enumerate(kept):
        for n, k in t.nodes.counts:
            use[i, col[n]] = k
    models = tuple(sorted({t.model for t in kept}))
    midx = {m: i for i, m in enumerate(models)}
    exhaustive = len(kept) <= EXHAUSTIVE_DOMINANCE_MAX
    bad = set() if undominated else dominated_ids(kept, exhaustive=exhaustive)
    lib = Library(kept, ids, configs, use, models,
                  np.array([midx[t.model] for t in kept], dtype=np.int64),
                  np.array([PHASE_CODE[t.phase] for t in kept], dtype=np.int64),
                  np.array([t.tokens_per_s for t in kept], dtype=np.float64),
                  np.array([i in bad for i in ids], dtype=bool),
                  "stored" if undominated else "exhaustive" if exhaustive else "one-node-smaller")
    return lib


def demanded_mask(problem: AllocationProblem, lib: Library) -> np.ndarray:
    """Per library row: does the template serve a (model, phase) with positive demand?"""
    wanted = np.zeros((len(lib.models), 3), dtype=bool)
    for (model, phase), d in problem.demand_tokens_per_s.items():
        if d > 0 and model in lib.models:
            m = lib.models.index(model)
            wanted[m, PHASE_CODE[phase]] = True
            wanted[m, PHASE_CODE["aggregated"]] = True
    if not len(lib.templates):
        return np.zeros(0, dtype=bool)
    return wanted[lib.model_idx, lib.phase_code]


def region_caps(lib: Library, usd_per_hour, available_nodes, region: str) -> tuple[np.ndarray, np.ndarray]:
    """Per library row in `region`: p_r(τ) and the most instances availability allows (0: a node is not sold, or
    too few of it)."""
    sold = np.array([(region, c) in usd_per_hour for c in lib.configs], dtype=bool)
    price = np.array([usd_per_hour.get((region, c), 0.0) for c in lib.configs])
    avail = np.array([available_nodes.get((region, c), 0) if sold[i] else 0 for i, c in enumerate(lib.configs)],
                     dtype=np.int64)
    caps = np.where(lib.use > 0, avail[None, :] // np.maximum(lib.use, 1), np.iinfo(np.int64).max)
    cap = caps.min(axis=1) if lib.configs else np.zeros(len(lib.templates), dtype=np.int64)
    return lib.use @ price, cap


def prune_columns(problem: AllocationProblem, *, prune_dominated: bool = True,
                  keep: Iterable[str] = ()) -> tuple[list[Column], PruneReport]:
    """The columns the ILP needs, in the library's order, and the report of what was pruned.

    Dominance is checked once per library: if B dominates A and A fits a region, B fits it too (it uses fewer
    of every node), so the per-region survivors are the global survivors that fit the region. Dominated
    templates running now, and those whose ids are in `keep` (an incumbent plan's), are kept.
    """
    lib = prepare(problem.templates)
    n = len(lib.templates)
    useful = demanded_mask(problem, lib)
    running = {(tid, r): k for (tid, r), k in problem.running.items() if k > 0}
    drop = lib.dominated.copy() if prune_dominated else np.zeros(n, dtype=bool)
    kept = {tid for tid, _ in running} | set(keep)
    if kept and drop.any():
        row_of = {tid: i for i, tid in enumerate(lib.ids)}
        for tid in kept:
            if tid in row_of:
                drop[row_of[tid]] = False
    columns: list[Column] = []
    not_sold = no_demand = n_dominated = 0
    per_region = []
    for region in problem.regions:
        cost, cap = region_caps(lib, problem.usd_per_hour, problem.available_nodes, region)
        fits = cap > 0
        survive = fits & useful & ~drop
        not_sold += int((~fits).sum())
        no_demand += int((fits & ~useful).sum())
        n_dominated += int((fits & useful & drop).sum())
        for i in np.nonzero(survive)[0]:
            columns.append(Column(lib.templates[i], region, float(cost[i]), int(cap[i]),
                                  running.get((lib.ids[i], region), 0), int(i)))
        per_region.append((region, n, int(survive.sum())))
    report = PruneReport(templates=n, columns_before=n * len(per_region), not_sold=not_sold, no_demand=no_demand,
                         dominated=n_dominated, columns_after=len(columns), per_region=tuple(per_region),
                         dominance_rule=lib.dominance_rule)
    return columns, report
