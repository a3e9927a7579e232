"""The Helix baseline: one model on a fixed heterogeneous cluster, placed by a max-flow MILP (Helix, ASPLOS'25).

Notation
    i, j      nodes of the cluster (every physical node, as Helix models them); s source, t sink
    L         the model's layers;  k a number of layers a node may hold (its weights and some KV fit)
    R_i(k)    requests/s node i sustains holding k layers (prefill and decode of each request time-shared)
    C         requests/s one link carries: bandwidth / ((prompt + output tokens) × activation bytes per token)
Variables
    b[i,k] ∈ {0,1}   node i holds k layers;  u_i = Σ_k b[i,k] ≤ 1 (a node may stay unused)
    a_i ∈ ℤ, 0..L-1  first layer of node i;  e_i = a_i + Σ_k k·b[i,k] its end (exclusive)
    c[i,j] ∈ {0,1}   link i→j used (also c[s,i], c[i,t]);  f[i,j] ≥ 0 its flow, requests/s
Objective
    maximise  Σ_i f[s,i]
Constraints
    H1 one range      Σ_k b[i,k] ≤ 1 and e_i ≤ L                               ∀ i           (N + N rows)
    H2 link validity  c[i,j] ⇒ a_j ≤ e_i ≤ e_j − 1 (j holds the next layer)     ∀ i ≠ j       (2·N(N−1))
                      c[s,i] ⇒ a_i = 0;  c[i,t] ⇒ e_i = L;  c ≤ u at both ends                (…)
    H3 link capacity  f[i,j] ≤ C·c[i,j];  f[s,i], f[i,t] ≤ max_k R_i(k)·c                      (N(N−1) + 2N)
    H4 node capacity  Σ_j f[j,i] + f[s,i] ≤ Σ_k R_i(k)·b[i,k]                ∀ i           (N)
    H5 conservation   Σ_j f[j,i] + f[s,i] = Σ_j f[i,j] + f[i,t]              ∀ i           (N)
Big-M implications use M = L + 1. The reported bound is the smaller of the solver's and the layer-work bound
Σ_i max_k k·R_i(k) / L (every request needs L layer passes). A node's capacity is charged for all k layers it
holds, as in Helix, even when a flow enters it past its first layer. `verify` re-checks a solution without the
solver.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

from coral_dagster.catalog.nodes import NodeConfig

if TYPE_CHECKING:
    from coral_dagster.allocation.types import Plan
    from coral_dagster.vocab import SolveStatus

RateFn = Callable[[NodeConfig, int], float]


@dataclass(frozen=True)
class HelixNode:
    """One node of the cluster placement: layers [start, end) (empty when unused) and the flow through it."""

    node: NodeConfig
    start: int
    end: int
    flow_req_s: float

    @property
    def used(self) -> bool:
        return self.end > self.start


@dataclass(frozen=True)
class HelixResult:
    """The Helix placement, its max-flow throughput, the solver's bound and status, and the links used."""

    status: str
    throughput_req_s: float
    bound_req_s: float
    solve_s: float
    nodes: tuple[HelixNode, ...]
    links: tuple[tuple[int, int, float], ...]

    @property
    def gap(self) -> float:
        return (self.bound_req_s - self.throughput_req_s) / self.bound_req_s if self.bound_req_s > 0 else 0.0


def _pipeline_layers(members: Sequence[int], n_layers: int, rates: dict[int, dict[int, float]]):
    """Best bottleneck rate of one pipeline over `members` and the layers each holds (0 = left out)."""
    values = sorted({r for i in members for r in rates[i].values() if r > 0}, reverse=True)

    def most_layers(i: int, tau: float) -> int:
        return max((k for k, r in rates[i].items() if r >= tau), default=0)

    best = None
    lo, hi = 0, len(values) - 1
    while lo <= hi:  # values descending: find the largest tau still covering L layers
        mid = (lo + hi) // 2
        if sum(most_layers(i, values[mid]) for i in members) >= n_layers:
            best, hi = mid, mid - 1
        else:
            lo = mid + 1
    if best is None:
        return 0.0, {}
    tau = values[best]
    layers = {i: most_layers(i, tau) for i in members}
    extra = sum(layers.values()) - n_layers
    for i in sorted(members, key=lambda i: (rates[i].get(1, 0.0), i)):  # trim the slowest nodes first
        cut = min(extra, layers[i])
        layers[i] -= cut
        extra -= cut
    layers = {i: k for i, k in layers.items() if k > 0}
    return min(rates[i][k] for i, k in layers.items()), layers


def heuristic_layout(cluster: Sequence[NodeConfig], n_layers: int, rate: RateFn) -> list[list[tuple[int, int]]]:
    """Disjoint pipelines, each a list of (node index, layers), as a warm start for the MILP.

    Nodes sorted by their most layer-throughput are dealt in snake order into P pipelines; each pipeline's
    layers maximise its bottleneck rate; the P with the largest total rate wins.
    """
    n = len(cluster)
    rates = {i: {k: rate(cluster[i], k) for k in range(1, n_layers + 1)} for i in range(n)}
    power = {i: max((k * r for k, r in rates[i].items()), default=0.0) for i in range(n)}
    order = sorted(range(n), key=lambda i: (-power[i], i))
    best_total, best = 0.0, []
    for p in range(1, n + 1):
        groups: list[list[int]] = [[] for _ in range(p)]
        for pos, i in enumerate(order):
            lap, idx = divmod(pos, p)
            groups[idx if lap % 2 == 0 else p - 1 - idx].append(i)
        pipes = [_pipeline_layers(g, n_layers, rates) for g in groups]
        total = sum(t for t, _ in pipes)
        if total > best_total + 1e-12:
            best_total = total
            best = [sorted(layers.items(), key=lambda kv: (-power[kv[0]], kv[0])) for t, layers in pipes if t > 0]
    return best


def solve_helix(cluster: Sequence[NodeConfig], n_layers: int, rate: RateFn, link_req_s: float, *,
                time_limit_s: float = 60.0, gap_rel: float = 1e-4) -> HelixResult:
    """Helix's max-flow placement of one model over `cluster` (one entry per physical node)."""
    from coral_dagster.allocation.ilp import _pulp, solver, warm_solver

    pulp = _pulp()
    start_t = time.perf_counter()
    n, big = len(cluster), n_layers + 1
    rates = {i: {k: rate(cluster[i], k) for k in range(1, n_layers + 1)} for i in range(n)}
    ks = {i: [k for k, r in rates[i].items() if r > 0] for i in range(n)}
    top = {i: max((rates[i][k] for k in ks[i]), default=0.0) for i in range(n)}
    prob = pulp.LpProblem("helix_max_flow", pulp.LpMaximize)
    b = {(i, k): prob.add_variable(f"b_{i}_{k}", 0, 1, pulp.LpInteger) for i in range(n) for k in ks[i]}
    a = {i: prob.add_variable(f"a_{i}", 0, n_layers - 1, pulp.LpInteger) for i in range(n)}
    used = {i: pulp.lpSum(b[(i, k)] for k in ks[i]) for i in range(n)}
    end = {i: a[i] + pulp.lpSum(k * b[(i, k)] for k in ks[i]) for i in range(n)}
    live = [i for i in range(n) if ks[i]]
    edges = [(i, j) for i in live for j in live if i != j]
    c = {e: prob.add_variable(f"c_{e[0]}_{e[1]}", 0, 1, pulp.LpInteger) for e in edges}
    f = {e: prob.add_variable(f"f_{e[0]}_{e[1]}", 0) for e in edges}
    cs = {i: prob.add_variable(f"cs_{i}", 0, 1, pulp.LpInteger) for i in live}
    ct = {i: prob.add_variable(f"ct_{i}", 0, 1, pulp.LpInteger) for i in live}
    fs = {i: prob.add_variable(f"fs_{i}", 0) for i in live}
    ft = {i: prob.add_variable(f"ft_{i}", 0) for i in live}
    prob += pulp.lpSum(fs.values())
    # H1 one range
    for i in live:
        prob += used[i] <= 1, f"one_range_{i}"
        prob += end[i] <= n_layers, f"end_{i}"
    # H2 link validity
    for (i, j), var in c.items():
        prob += a[j] - end[i] <= big * (1 - var), f"next_start_{i}_{j}"
        prob += end[i] - end[j] + 1 <= big * (1 - var), f"next_end_{i}_{j}"
        prob += var <= used[i], f"used_from_{i}_{j}"
        prob += var <= used[j], f"used_to_{i}_{j}"
    for i in live:
        prob += a[i] <= big * (1 - cs[i]), f"source_{i}"
        prob += n_layers - end[i] <= big * (1 - ct[i]), f"sink_{i}"
        prob += cs[i] <= used[i], f"used_source_{i}"
        prob += ct[i] <= used[i], f"used_sink_{i}"
    # H3 link capacity (an unlimited link carries at most what the whole cluster does)
    link_cap = min(link_req_s, sum(top.values()) or 1.0)
    for e, var in c.items():
        prob += f[e] <= link_cap * var, f"link_{e[0]}_{e[1]}"
    for i in live:
        prob += fs[i] <= top[i] * cs[i], f"source_cap_{i}"
        prob += ft[i] <= top[i] * ct[i], f"sink_cap_{i}"
    # H4 node capacity and H5 conservation
    for i in live:
        inflow = fs[i] + pulp.lpSum(f[(j, i)] for j in live if j != i)
        outflow = ft[i] + pulp.lpSum(f[(i, j)] for j in live if j != i)
        prob += inflow <= pulp.lpSum(rates[i][k] * b[(i, k)] for k in ks[i]), f"node_cap_{i}"
        prob += inflow == outflow, f"conserve_{i}"
    # Warm start: Helix seeds its MILP with a heuristic layout; ours is `heuristic_layout`.
    start: dict = {}
    for pipe in heuristic_layout(cluster, n_layers, rate):
        tau = min(rates[i][k] for i, k in pipe)
        first = 0
        for pos, (i, k) in enumerate(pipe):
            start[b[(i, k)]] = 1.0
            start[a[i]] = float(first)
            first += k
            if pos == 0:
                start[cs[i]], start[fs[i]] = 1.0, tau
            else:
                prev = pipe[pos - 1][0]
                start[c[(prev, i)]], start[f[(prev, i)]] = 1.0, min(tau, link_cap)
            if pos == len(pipe) - 1:
                start[ct[i]], start[ft[i]] = 1.0, tau
    warm_rate = sum(start[v] for v in fs.values() if v in start)
    prob.solve(warm_solver(start, time_limit_s, gap_rel) if warm_rate <= sum(top.values()) else solver(
        time_limit_s, gap_rel))
    model = prob.solverModel
    import highspy

    st = model.getModelStatus()
    info = model.getInfo()
    if st == highspy.HighsModelStatus.kOptimal:
        status = "optimal"
    elif info.primal_solution_status == 2:
        status = "feasible-time-limit"
    else:
        return HelixResult("no-solution", 0.0, float("inf"), time.perf_counter() - start_t, (), ())
    nodes = []
    for i in range(n):
        k = next((k for k in ks[i] if (b[(i, k)].varValue or 0) > 0.5), 0)
        s = int(round(a[i].varValue or 0)) if k else 0
        through = (fs[i].varValue or 0.0) + sum((f[(j, i)].varValue or 0.0) for j in live if j != i) if k else 0.0
        nodes.append(HelixNode(cluster[i], s, s + k, float(through)))
    links = tuple((i, j, float(v.varValue)) for (i, j), v in f.items() if (v.varValue or 0) > 1e-9)
    links += tuple((-1, i, float(v.varValue)) for i, v in fs.items() if (v.varValue or 0) > 1e-9)
    links += tuple((i, -1, float(v.varValue)) for i, v in ft.items() if (v.varValue or 0) > 1e-9)
    total = float(sum(v.varValue or 0.0 for v in fs.values()))
    # PuLP hands HiGHS the negated objective of a maximisation, so its dual bound comes back negated.
    bound = -float(info.mip_dual_bound) if status != "optimal" else total
    # Each request needs L layer passes and node i gives at most k·R_i(k) of them per second: a bound the
    # big-M relaxation does not see.
    work_bound = sum(max((k * r for k, r in rates[i].items()), default=0.0) for i in range(n)) / n_layers
    bound = min(bound, work_bound)
    return HelixResult(status, total, max(bound, total), time.perf_counter() - start_t, tuple(nodes), links)


def verify(result: HelixResult, n_layers: int, rate: RateFn, link_req_s: float, tol: float = 1e-6) -> list[str]:
    """Re-check a Helix solution: ranges in [0, L], links only to the next layer, capacities and conservation."""
    problems = []
    inflow = {i: 0.0 for i in range(len(result.nodes))}
    outflow = dict(inflow)
    for i, j, flow in result.links:
        if i == -1:
            if result.nodes[j].start != 0:
                problems.append(f"source feeds node {j}, which starts at layer {result.nodes[j].start}")
            inflow[j] += flow
            continue
        if j == -1:
            if result.nodes[i].end != n_layers:
                problems.append(f"node {i} feeds the sink but ends at layer {result.nodes[i].end}")
            outflow[i] += flow
            continue
        ni, nj = result.nodes[i], result.nodes[j]
        if not (nj.start <= ni.end < nj.end):
            problems.append(f"link {i}->{j}: node {j} holds [{nj.start},{nj.end}), not layer {ni.end}")
        if flow > link_req_s * (1 + tol):
            problems.append(f"link {i}->{j} carries {flow} req/s over its {link_req_s}")
        outflow[i] += flow
        inflow[j] += flow
    for i, node in enumerate(result.nodes):
        if node.end > n_layers or node.start < 0:
            problems.append(f"node {i} holds [{node.start},{node.end}) outside [0,{n_layers})")
        cap = rate(node.node, node.end - node.start) if node.used else 0.0
        if inflow[i] > cap * (1 + tol) + tol:
            problems.append(f"node {i} carries {inflow[i]} req/s over its {cap}")
        if abs(inflow[i] - outflow[i]) > tol * max(1.0, inflow[i]):
            problems.append(f"node {i}: {inflow[i]} in, {outflow[i]} out")
    total = sum(flow for i, _, flow in result.links if i == -1)
    if abs(total - result.throughput_req_s) > tol * max(1.0, total):
        problems.append(f"throughput {result.throughput_req_s} != source flow {total}")
    return problems


def helix_rate_fn(model: str, prompt_tokens: float, output_tokens: float, prefill_slo_ms: float,
                  decode_slo_ms: float, link_gbps: float | None, perf=None) -> RateFn:
    """R_i(k) from the profiles: requests/s of a node holding k of L layers, prefill and decode time-shared.

    Each phase gets the share k/L of its SLO (a path through nodes covering L layers then meets the SLO);
    decode runs at the mean context of a request half-way through its output.
    """
    from coral_dagster.catalog.models import get_model
    from coral_dagster.profiles import default_perf_model

    perf = perf or default_perf_model()
    n_layers = get_model(model).n_layers
    context = int(round(prompt_tokens + output_tokens / 2))
    cache: dict[tuple[NodeConfig, int], float] = {}

    def rate(node: NodeConfig, k: int) -> float:
        if (node, k) not in cache:
            pre = perf.t_hat(model, node, "prefill", k, prefill_slo_ms * k / n_layers, 0, link_gbps).tokens_per_s
            dec = perf.t_hat(model, node, "decode", k, decode_slo_ms * k / n_layers, context,
                             link_gbps).tokens_per_s
            cache[(node, k)] = 1.0 / (prompt_tokens / pre + output_tokens / dec) if pre > 0 and dec > 0 else 0.0
        return cache[(node, k)]

    return rate


def link_req_s(model: str, prompt_tokens: float, output_tokens: float, link_gbps: float | None) -> float:
    """Requests/s one link carries: every prompt and output token's activations cross it once."""
    from coral_dagster.catalog.models import get_model

    if not link_gbps:
        return float("inf")
    per_request_bytes = (prompt_tokens + output_tokens) * get_model(model).activation_bytes_per_token
    return link_gbps * 1e9 / 8 / per_request_bytes


def helix_plan(scenario, *, time_limit_s: float = 60.0, perf=None, slo_ms: tuple[float, float] | None = None,
               market=None) -> tuple["Plan", HelixResult]:
    """Helix on a single-model scenario's whole cluster (its availability), as a Plan plus the raw result.

    The plan holds one aggregated instance over the nodes Helix uses; it serves flow × mean prompt tokens of
    prefill and flow × mean output tokens of decode. `slo_ms` overrides (prefill, decode) SLOs.
    """
    from coral_dagster.allocation.demand import trace_stats
    from coral_dagster.allocation.inputs import scenario_problem
    from coral_dagster.allocation.planner import build_plan
    from coral_dagster.allocation.types import PlannedInstance
    from coral_dagster.catalog.models import get_model
    from coral_dagster.catalog.nodes import NodeMultiset
    from coral_dagster.errors import CoralError
    from coral_dagster.templates.types import Stage, Template

    if len(scenario.models) != 1:
        raise CoralError(f"Helix places one model; scenario {scenario.name} has {len(scenario.models)}.",
                         "use `--scenario helix` (or any single-model scenario) with `--method helix`.")
    sm = scenario.models[0]
    pre_slo, dec_slo = slo_ms or (sm.prefill_slo_ms, sm.decode_slo_ms)
    stats = trace_stats(sm.trace)
    market = market or scenario.market()
    cluster = [o.node for o in market.offers for _ in range(o.available_nodes)]
    region = {o.node: o.region for o in market.offers if o.available_nodes > 0}
    if len(set(region.values())) > 1:
        raise CoralError("Helix's cluster must sit in one region.", "give the scenario one region.")
    n_layers = get_model(sm.model).n_layers
    rate = helix_rate_fn(sm.model, stats.mean_prompt_tokens, stats.mean_output_tokens, pre_slo, dec_slo,
                         scenario.link_gbps, perf)
    link = link_req_s(sm.model, stats.mean_prompt_tokens, stats.mean_output_tokens, scenario.link_gbps)
    result = solve_helix(cluster, n_layers, rate, link, time_limit_s=time_limit_s)
    problem = scenario_problem(scenario, (), market)
    used = [n for n in result.nodes if n.used and n.flow_req_s > 1e-9]
    instances = []
    if used:
        ranges = sorted({(n.start, n.end) for n in used})
        stages = []
        for lo, hi in ranges:
            members = [n for n in used if (n.start, n.end) == (lo, hi)]
            flow = sum(n.flow_req_s for n in members)
            stages.append(Stage(lo, hi, tuple(n.node for n in members),
                                tuple(n.flow_req_s / flow for n in members)))
        tokens = result.throughput_req_s * stats.mean_output_tokens  # aggregated templates count output tokens
        template = Template(sm.model, "aggregated", dec_slo, NodeMultiset.of([n.node for n in used]),
                            tuple(stages), tokens, "compute")
        price = sum(market.price(region[n.node], n.node) for n in used)
        instances.append(PlannedInstance(template, region[used[0].node], 1, price))
    demand_req_s = sm.rate_req_s * scenario.headroom
    scale = min(1.0, result.throughput_req_s / demand_req_s) if demand_req_s > 0 else 1.0
    status: SolveStatus = "optimal" if result.status == "optimal" and scale >= 1.0 else (
        "scaled" if scale < 1.0 else "feasible-time-limit")
    notes = [f"helix max flow {result.throughput_req_s:.3f} req/s (bound {result.bound_req_s:.3f}, solver "
             f"{result.status}) over {len(used)} of {len(cluster)} nodes; SLO split k/L per node "
             f"(prefill {pre_slo:g} ms, decode {dec_slo:g} ms)"]
    plan = build_plan(problem, "helix", status, instances, lp_bound=float("nan"), solve_s=result.solve_s,
                      demand_scale=scale, notes=notes)
    return plan, result
