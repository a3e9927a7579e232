"""The fast method over a whole library: multisets in size order, each pruned by its sub-multisets' optima.

Adding a node never lowers the optimum (it can join any stage), so T*(u) ≥ LB(u) = max_i T*(u - e_i). With
tables non-increasing in j, a partition reaches a bottleneck above LB exactly when each of its stages is above LB
with one layer and Σ_s m_s(LB) ≥ L, where m_s(LB) counts the layer counts j with f_s(j) > LB. So per multiset
one pass over its groups' curves finds the few partitions that can beat LB; only those get the exact closed form
of `optimize`. When none can, T*(u) = LB and the sub-multiset's placement with the new node added to its
bottleneck stage attains it. Non-monotone tables go through `best_placement_fast` multiset by multiset.

With `one_path` (decode and aggregated: `best.one_path_only`) a multi-stage placement puts one node on every stage,
so adding a node no longer keeps the sub-multiset's placement; each multiset is then solved on its own over its
two shapes, one stage of all its nodes and one stage per node.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Iterable

import numpy as np

from coral_dagster.templates.optimize import (
    Placement,
    _best_monotone,
    _layers_monotone,
    _monotone,
    best_placement_fast,
    multiset_partitions,
)


@lru_cache(maxsize=None)
def _shape(counts: tuple[int, ...]):
    """Groups, all partitions padded to one array (sentinel group G), and each partition's stage count."""
    groups, by_s = multiset_partitions(counts)
    width = max(by_s)
    parts, sizes = [], []
    for s, p in by_s.items():
        parts.append(np.pad(p, ((0, 0), (0, width - s)), constant_values=len(groups)))
        sizes.append(np.full(len(p), s))
    return groups, np.concatenate(parts), np.concatenate(sizes)


def _extend(p: Placement, config: int, stacked: np.ndarray) -> Placement:
    """`p` with one more node of `config` in its bottleneck stage, valued by its new bottleneck."""
    tab = stacked[p.n_stages - 1]
    groups = [list(g) for g in p.groups]
    values = [float(np.dot(g, tab[:, j - 1])) for g, j in zip(groups, p.layers)]
    groups[int(np.argmin(values))][config] += 1
    value = min(float(np.dot(g, tab[:, j - 1])) for g, j in zip(groups, p.layers))
    return Placement(p.n_stages, tuple(tuple(g) for g in groups), p.layers, value)


def sweep(tables: dict[int, np.ndarray], n_layers: int, multisets: Iterable[tuple[int, ...]],
          one_path: bool = False) -> dict[tuple[int, ...], Placement]:
    """Optimal placements of count vectors over all the tables' configurations; infeasible ones are absent.

    `tables[S]` is C × L over every configuration; placements' groups are full-length count vectors.
    """
    ordered = sorted(multisets, key=lambda c: (sum(c), c))
    n_configs = next(iter(tables.values())).shape[0]
    if one_path or not all(_monotone(t) for t in tables.values()):
        return _one_by_one(tables, n_layers, ordered, n_configs, one_path)
    max_s = max(tables)
    stacked = np.stack([np.asarray(tables[s], dtype=np.float64) for s in range(1, max_s + 1)])
    done: dict[tuple[int, ...], Placement] = {}
    for counts in ordered:
        size = sum(counts)
        present = [i for i, k in enumerate(counts) if k]
        lower: Placement | None = None
        for i in present:
            pred = done.get(counts[:i] + (counts[i] - 1,) + counts[i + 1:])
            if pred is not None and (lower is None or pred.tokens_per_s > lower.tokens_per_s):
                lower, added = pred, i
        lb = lower.tokens_per_s if lower is not None else 0.0
        found = _beat(stacked, n_layers, counts, present, min(size, n_layers, max_s), lb)
        if found is not None:
            done[counts] = found
        elif lower is not None:
            done[counts] = _extend(lower, added, stacked)
    return done


def _beat(stacked: np.ndarray, n_layers: int, counts: tuple[int, ...], present: list[int], max_s: int,
          lb: float) -> Placement | None:
    """The best placement with a bottleneck above `lb`, or None when no partition gets above it."""
    sub = tuple(counts[i] for i in present)
    groups, parts, sizes = _shape(sub)
    curves = groups @ stacked[:max_s][:, present, :]  # S × G × L: f_v(j) per stage count
    above = curves > lb
    m = np.concatenate([above.sum(axis=2), np.zeros((max_s, 1), dtype=np.int64)], axis=1)
    first = np.concatenate([above[:, :, 0], np.ones((max_s, 1), dtype=bool)], axis=1)
    keep = sizes <= max_s
    parts_k, sizes_k = parts[keep], sizes[keep]
    rows = (sizes_k - 1)[:, None]
    can = (m[rows, parts_k].sum(axis=1) >= n_layers) & first[rows, parts_k].all(axis=1)
    if not can.any():
        return None
    best: Placement | None = None
    for s in np.unique(sizes_k[can]):
        sel = parts_k[can & (sizes_k == s)][:, :s]
        vals = curves[s - 1][sel]
        values = _best_monotone(vals, n_layers)
        p = int(np.argmax(values))
        value = float(values[p])
        if value > lb and (best is None or value > best.tokens_per_s):
            layers = _layers_monotone(vals[p], value, n_layers)
            full = []
            for g in sel[p]:
                row = [0] * stacked.shape[1]
                for i, k in zip(present, groups[g]):
                    row[i] = int(k)
                full.append(tuple(row))
            best = Placement(int(s), tuple(full), layers, value)
    return best


def _one_by_one(tables, n_layers, ordered, n_configs, one_path: bool = False) -> dict[tuple[int, ...], Placement]:
    out = {}
    for counts in ordered:
        present = [i for i, k in enumerate(counts) if k]
        size = sum(counts)
        sub = {s: np.zeros((len(present), t.shape[1])) if one_path and 1 < s < size else t[present]
               for s, t in tables.items() if s <= size}
        p = best_placement_fast(tuple(counts[i] for i in present), sub, n_layers)
        if p is not None:
            full = []
            for g in p.groups:
                row = [0] * n_configs
                for i, k in zip(present, g):
                    row[i] = k
                full.append(tuple(row))
            out[counts] = Placement(p.n_stages, tuple(full), p.layers, p.tokens_per_s)
    return out
