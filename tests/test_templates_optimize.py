"""The fast placement method against the paper's ILP and against brute-force enumeration."""

from __future__ import annotations

import math

import numpy as np
import pytest

from coral_dagster.errors import CoralError
from coral_dagster.templates.optimize import (
    best_placement_brute,
    best_placement_fast,
    best_placement_ilp,
    multiset_partitions,
)

REL = 1e-6


def random_tables(rng: np.random.Generator, n_configs: int, n_layers: int, max_stages: int,
                  monotone: bool = True) -> dict[int, np.ndarray]:
    """Synthetic T̂: random values, non-increasing in j when `monotone`, zero past a random memory limit."""
    tables = {}
    for s in range(1, max_stages + 1):
        t = rng.uniform(1, 100, (n_configs, n_layers)) / s
        if monotone:
            t = -np.sort(-t, axis=1)
        fits = rng.integers(0, n_layers + 1, n_configs)
        for i, f in enumerate(fits):
            t[i, f:] = 0.0
        tables[s] = t
    return tables


def random_counts(rng: np.random.Generator, n_configs: int, max_nodes: int) -> tuple[int, ...]:
    while True:
        counts = tuple(int(k) for k in rng.integers(0, max_nodes + 1, n_configs))
        if 0 < sum(counts) <= max_nodes:
            return counts


def value(p) -> float:
    return 0.0 if p is None else p.tokens_per_s


def check_placement(p, counts, tables, n_layers) -> None:
    """A placement is a real one: every node used once, layers sum to L, its value is its bottleneck."""
    assert sum(p.layers) == n_layers and all(j >= 1 for j in p.layers)
    assert tuple(map(sum, zip(*p.groups))) == counts
    assert all(any(g) for g in p.groups)
    assert math.isclose(min(p.stage_tokens_per_s(tables)), p.tokens_per_s, rel_tol=1e-12)


@pytest.mark.parametrize("monotone", [True, False])
def test_fast_equals_brute_force_on_tiny_multisets(monotone):
    rng = np.random.default_rng(11 if monotone else 12)
    for _ in range(250):
        m = int(rng.integers(1, 4))
        n_layers = int(rng.integers(1, 7))
        counts = random_counts(rng, m, 4)
        tables = random_tables(rng, m, n_layers, sum(counts), monotone)
        fast = best_placement_fast(counts, tables, n_layers)
        brute = best_placement_brute(counts, tables, n_layers)
        assert math.isclose(value(fast), value(brute), rel_tol=REL, abs_tol=1e-12), (counts, n_layers)
        if fast is not None:
            check_placement(fast, counts, tables, n_layers)


def test_fast_equals_ilp_on_random_multisets():
    rng = np.random.default_rng(7)
    cases = 0
    for i in range(36):
        m = int(rng.integers(1, 4))
        n_layers = int(rng.integers(2, 9))
        counts = random_counts(rng, m, 4)
        tables = random_tables(rng, m, n_layers, sum(counts), monotone=i % 4 != 0)
        fast = best_placement_fast(counts, tables, n_layers)
        ilp = best_placement_ilp(counts, tables, n_layers, time_limit_s=30)
        assert ilp.all_optimal
        assert math.isclose(value(fast), value(ilp.placement), rel_tol=REL, abs_tol=1e-9), (counts, n_layers)
        if ilp.placement is not None:
            check_placement(ilp.placement, counts, tables, n_layers)
        cases += 1
    assert cases == 36


def test_fast_on_larger_multisets_matches_ilp_on_a_few():
    rng = np.random.default_rng(3)
    for counts, n_layers in [((2, 1, 1, 1), 8), ((1, 1, 1, 1, 1), 6)]:
        tables = random_tables(rng, len(counts), n_layers, sum(counts))
        fast = best_placement_fast(counts, tables, n_layers)
        ilp = best_placement_ilp(counts, tables, n_layers, time_limit_s=60)
        assert math.isclose(value(fast), value(ilp.placement), rel_tol=REL)


def bell(n: int) -> int:
    row = [1]
    for _ in range(n):
        nxt = [row[-1]]
        for x in row:
            nxt.append(nxt[-1] + x)
        row = nxt
    return row[0]


def integer_partitions(n: int, most: int | None = None) -> int:
    most = n if most is None else most
    if n == 0:
        return 1
    return sum(integer_partitions(n - k, k) for k in range(1, min(n, most) + 1))


def test_multiset_partitions_count_against_closed_forms():
    for n in range(1, 7):
        _, by_s = multiset_partitions((1,) * n)
        assert sum(len(p) for p in by_s.values()) == bell(n)  # distinct nodes: set partitions
        _, by_s = multiset_partitions((n,))
        assert sum(len(p) for p in by_s.values()) == integer_partitions(n)  # one configuration


def test_zero_when_nothing_fits_and_bad_tables_are_rejected():
    tables = {1: np.zeros((1, 3)), 2: np.zeros((1, 3))}
    assert best_placement_fast((2,), tables, 3) is None
    assert best_placement_brute((2,), tables, 3) is None
    assert best_placement_ilp((2,), tables, 3).placement is None
    with pytest.raises(CoralError, match="shape"):
        best_placement_fast((1,), {1: np.ones((2, 3))}, 3)
