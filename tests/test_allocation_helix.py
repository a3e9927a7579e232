"""The Helix max-flow MILP against brute force over layer ranges with an LP max flow, and its verifier."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
from scipy.optimize import linprog

from coral_dagster.allocation.helix import heuristic_layout, solve_helix, verify
from coral_dagster.catalog.nodes import NodeConfig


def brute_max_flow(cluster, n_layers, rate, link):
    """Best max flow over every choice of layer range per node (or unused), each flow solved by an LP."""
    options = [[None] + [(s, s + k) for k in range(1, n_layers + 1) for s in range(0, n_layers - k + 1)
                         if rate(node, k) > 0] for node in cluster]
    best = 0.0
    for choice in itertools.product(*options):
        used = [i for i, c in enumerate(choice) if c]
        arcs = [("s", i) for i in used if choice[i][0] == 0] + [(i, "t") for i in used if choice[i][1] == n_layers]
        arcs += [(i, j) for i in used for j in used if i != j and choice[j][0] <= choice[i][1] < choice[j][1]]
        if not any(a == "s" for a, _ in arcs) or not any(b == "t" for _, b in arcs):
            continue
        cost = np.array([-1.0 if a == "s" else 0.0 for a, _ in arcs])
        bounds = [(0, None if "s" in (a, b) or "t" in (a, b) else link) for a, b in arcs]
        a_eq = [[(1.0 if b == i else 0.0) - (1.0 if a == i else 0.0) for a, b in arcs] for i in used]
        a_ub = [[1.0 if b == i else 0.0 for a, b in arcs] for i in used]
        b_ub = [rate(cluster[i], choice[i][1] - choice[i][0]) for i in used]
        res = linprog(cost, A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=[0.0] * len(used), bounds=bounds,
                      method="highs")
        best = max(best, -res.fun)
    return best


def make_rate(seed: int):
    rng = random.Random(seed)
    speed = {g: rng.uniform(1.0, 4.0) for g in ("A", "B")}
    most = {g: rng.randint(2, 4) for g in ("A", "B")}

    def rate(node: NodeConfig, k: int) -> float:
        return 0.0 if k > most[node.gpu] else speed[node.gpu] / k
    return rate


@pytest.mark.parametrize("seed", range(3))
def test_helix_milp_equals_brute_force(seed):
    rng = random.Random(seed)
    cluster = [NodeConfig(rng.choice(["A", "B"]), 1) for _ in range(3)]
    rate = make_rate(seed)
    link = rng.choice([0.5, 1.0, 10.0])
    result = solve_helix(cluster, 4, rate, link, time_limit_s=20, gap_rel=1e-9)
    assert result.status == "optimal"
    assert result.throughput_req_s == pytest.approx(brute_max_flow(cluster, 4, rate, link), rel=1e-6, abs=1e-9)
    assert verify(result, 4, rate, link) == []


def test_helix_beats_or_matches_its_warm_start_and_verifier_catches_breaks():
    cluster = [NodeConfig("A", 1)] * 3 + [NodeConfig("B", 1)] * 3
    rate = make_rate(7)
    result = solve_helix(cluster, 6, rate, 100.0, time_limit_s=2)
    layout = heuristic_layout(cluster, 6, rate)
    warm = sum(min(rate(cluster[i], k) for i, k in pipe) for pipe in layout)
    assert result.throughput_req_s >= warm - 1e-9
    assert result.throughput_req_s <= result.bound_req_s + 1e-9
    assert verify(result, 6, rate, 100.0) == []
    if result.links:
        i, j, flow = result.links[0]
        broken = type(result)(result.status, result.throughput_req_s, result.bound_req_s, result.solve_s,
                              result.nodes, ((i, j, flow * 1e3),) + result.links[1:])
        assert verify(broken, 6, rate, 100.0)
