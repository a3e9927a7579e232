"""One multiset's best template: optimize its placement, turn it into stages with shares, and verify it."""

from __future__ import annotations

import numpy as np

from coral_dagster.catalog.nodes import NodeMultiset
from coral_dagster.errors import CoralError, InfeasibleError, UnknownNameError
from coral_dagster.templates.optimize import (
    Placement,
    best_placement_fast,
    best_placement_ilp,
)
from coral_dagster.layer_split import parse_split
from coral_dagster.templates.throughput import ThroughputTables
from coral_dagster.templates.types import Stage, Template
from coral_dagster.vocab import BOUNDS, PHASES, T_HAT_RULE_NAMES

#: Relative slack when re-checking floats the optimizer produced.
REL_TOL = 1e-9


def one_path_only(phase: str, n_stages: int, n_nodes: int) -> bool:
    """Whether a decode or aggregated placement of `n_nodes` over `n_stages` is ruled out: with S > 1 it must put
    one node on every stage (S = |G'|). A data-parallel node of a multi-stage decode pipeline is shared by several
    paths whose micro-batches reach it out of step, so it runs them in separate iterations that each pay the weight
    read; its stage then falls far short of the summed T̂ (measured: BENCHMARKS.md, "Template reach"), and vLLM
    runs no data parallelism inside a stage. Prefill chunks of all paths batch together, so prefill keeps them."""
    return phase != "prefill" and 1 < n_stages < n_nodes


def optimize(tables: ThroughputTables, nodes: NodeMultiset, method: str = "fast",
             time_limit_s: float = 60.0) -> Placement | None:
    """The optimal placement of `nodes` with `method` "fast" (ours) or "ilp" (the paper's); None when T = 0.
    Stage counts `one_path_only` rules out get a zero table, so no method places there."""
    configs = tuple(n for n, _ in nodes.counts)
    counts = tuple(k for _, k in nodes.counts)
    phase = tables.workload.phase
    sub = {s: np.zeros_like(t) if one_path_only(phase, s, nodes.size) else t
           for s, t in tables.rows(configs).items() if s <= nodes.size}
    if method == "fast":
        return best_placement_fast(counts, sub, tables.n_layers)
    if method == "ilp":
        return best_placement_ilp(counts, sub, tables.n_layers, time_limit_s).placement
    raise CoralError(f"unknown placement method {method!r}.", "use 'fast' or 'ilp'.")


def make_template(tables: ThroughputTables, nodes: NodeMultiset, placement: Placement) -> Template:
    """Stages `[start, end)` with each node's share of its stage (in proportion to its T̂) and the bound."""
    configs = tuple(n for n, _ in nodes.counts)
    stages, start = [], 0
    bottleneck, bottleneck_value = None, np.inf
    for group, layers in zip(placement.groups, placement.layers):
        members = tuple(c for c, k in zip(configs, group) for _ in range(k))
        points = [tables.point(placement.n_stages, c, layers) for c in members]
        values = [p.tokens_per_s for p in points]
        total = sum(values)
        shares = tuple(v / total for v in values) if total > 0 else tuple(1.0 / len(members) for _ in members)
        batches = tuple(p.batch for p in points) if tables.workload.phase != "decode" else ()
        stage = Stage(start, start + layers, members, shares, batches)
        stages.append(stage)
        if total < bottleneck_value:
            bottleneck, bottleneck_value = stage, total
        start += layers
    if bottleneck is None:
        raise RuntimeError(f"placement {placement} has no stage with a finite T̂ to bound the template")
    lead = max(zip(bottleneck.nodes, bottleneck.shares), key=lambda ns: ns[1])[0]
    bound = tables.point(placement.n_stages, lead, bottleneck.layers).bound
    if bound not in BOUNDS:
        raise RuntimeError(f"T̂ point bound {bound!r} is none of {BOUNDS}")
    w = tables.workload
    return Template(w.model, w.phase, w.slo_ms, nodes, tuple(stages), float(placement.tokens_per_s), bound)


def best_template(tables: ThroughputTables, nodes: NodeMultiset, method: str = "fast",
                  time_limit_s: float = 60.0) -> Template:
    """The throughput-optimal template of one node multiset; `InfeasibleError` says why when none serves."""
    missing = [str(n) for n, _ in nodes.counts if n not in tables.configs]
    if missing:
        raise CoralError(f"no throughput table for {', '.join(missing)}.",
                         f"use configurations of the table: {', '.join(map(str, tables.configs))}.")
    placement = optimize(tables, nodes, method, time_limit_s)
    if placement is None:
        w = tables.workload
        raise InfeasibleError(
            f"{nodes} cannot serve {w.model} {w.phase} within {w.slo_ms:g} ms: no placement reaches a positive "
            f"throughput (the weights do not fit or no batch meets the per-stage budget).",
            "add nodes with more memory or faster GPUs, or relax the SLO.",
        )
    template = make_template(tables, nodes, placement)
    problems = verify_template(template, tables)
    if problems:
        raise CoralError(f"template {template.template_id} fails its own check: {'; '.join(problems)}.",
                         "report this as a bug with the command that produced it.")
    return template


def verify_template(template: Template, tables: ThroughputTables) -> list[str]:
    """Independent re-check of a template against the tables and the latency rule; returns what is wrong."""
    problems = []
    n_stages = len(template.stages)
    try:
        parse_split(template.pp_partition, tables.n_layers, n_stages)
    except CoralError as exc:
        problems.append(str(exc))
    used = NodeMultiset.of([n for s in template.stages for n in s.nodes])
    if used != template.nodes:
        problems.append(f"stages use {used}, the template lists {template.nodes}")
    if one_path_only(template.phase, n_stages, used.size):
        problems.append(f"{template.phase} over {n_stages} stages shares a stage between {used.size} nodes")
    budget = tables.budget_ms(n_stages)
    pipeline_ms, stage_values = 0.0, []
    for s in template.stages:
        points = [tables.point(n_stages, n, s.layers) for n in s.nodes]
        stage_values.append(sum(p.tokens_per_s for p in points))
        slowest = max(p.stage_ms for p in points)
        if slowest > budget * (1 + REL_TOL):
            problems.append(f"stage [{s.start},{s.end}) takes {slowest:.3f} ms > its budget {budget:.3f} ms")
        pipeline_ms += slowest
        if abs(sum(s.shares) - 1) > 1e-6:
            problems.append(f"shares of stage [{s.start},{s.end}) sum to {sum(s.shares)}")
    if pipeline_ms > tables.workload.slo_ms * (1 + REL_TOL):
        problems.append(f"stage latencies sum to {pipeline_ms:.3f} ms > SLO {tables.workload.slo_ms:g} ms")
    if abs(min(stage_values) - template.tokens_per_s) > REL_TOL * max(1.0, template.tokens_per_s):
        problems.append(f"bottleneck stage gives {min(stage_values)} tokens/s, the template says {template.tokens_per_s}")
    return problems


def scenario_model_for(model: str, scenario: str | None = None):
    """(scenario, its entry for `model`): the named scenario, else the first bundled one that serves the model."""
    from coral_dagster.catalog.models import model_name
    from coral_dagster.catalog.scenarios import load_scenario, scenario_names

    alias = model_name(model)
    names = [scenario] if scenario else scenario_names()
    for name in names:
        scn = load_scenario(name)
        if any(m.model == alias for m in scn.models):
            return scn, scn.model(alias)
    if scenario:
        return scn, scn.model(alias)  # raises UnknownNameError listing the scenario's models
    raise CoralError(f"no bundled scenario serves {alias}.", "pass --scenario with a scenario YAML that lists it.")


def best_for_nodes(model: str, phase: str, nodes: NodeMultiset | str, *, slo_ms: float | None = None,
                   prefill_slo_ms: float | None = None, scenario: str | None = None, method: str = "fast",
                   time_limit_s: float = 60.0, t_hat_rule: str | None = None
                   ) -> tuple[Template, ThroughputTables, float]:
    """The best template of one multiset with the SLO, trace, network and T̂ rule of a scenario (defaults from it).

    Returns the template, the T̂ tables it was optimized over (the multiset's configurations, S up to its size)
    and the optimizer's wall time in seconds.
    """
    import dataclasses
    import time

    from coral_dagster.templates.throughput import build_tables, workload_for

    ms = NodeMultiset.parse(nodes) if isinstance(nodes, str) else nodes
    scn, entry = scenario_model_for(model, scenario)
    rule = t_hat_rule or scn.t_hat_rule
    if phase not in PHASES:
        raise UnknownNameError("phase", phase, PHASES)
    if rule not in T_HAT_RULE_NAMES:
        raise UnknownNameError("T̂ rule", rule, T_HAT_RULE_NAMES)
    workload = workload_for(entry, phase, scn.link_gbps, slo_ms, rule=rule)
    if prefill_slo_ms is not None:
        workload = dataclasses.replace(workload, prefill_slo_ms=float(prefill_slo_ms))
    configs = tuple(n for n, _ in ms.counts)
    tables = build_tables(workload, configs, ms.size)
    start = time.perf_counter()
    template = best_template(tables, ms, method, time_limit_s)
    return template, tables, time.perf_counter() - start
