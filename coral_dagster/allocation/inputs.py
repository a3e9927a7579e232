"""Build an AllocationProblem from a scenario, a template library, a market snapshot and a demand mix."""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping, Sequence

from coral_dagster.allocation.demand import demand_tokens, mix_rates, trace_stats
from coral_dagster.allocation.problem import AllocationProblem, offers_from_market
from coral_dagster.allocation.recent import Recent
from coral_dagster.catalog.market import MarketSnapshot
from coral_dagster.catalog.scenarios import Scenario
from coral_dagster.templates.engines import runnable
from coral_dagster.templates.types import Template
from coral_dagster.vocab import DEMAND_PHASES


def model_params(scenario: Scenario) -> dict[str, float]:
    """Parameter count per model of the scenario (what the large/small-heavy mixes sort by)."""
    from coral_dagster.catalog.models import get_model

    return {m.model: float(get_model(m.model).total_params) for m in scenario.models}


def scenario_rates(scenario: Scenario, demand_mix: str = "uniform") -> dict[str, float]:
    """Request rate per model under a demand mix (total rate kept)."""
    return mix_rates({m.model: m.rate_req_s for m in scenario.models}, model_params(scenario), demand_mix)


def mixed_scenario(scenario: Scenario, demand_mix: str) -> Scenario:
    """The scenario with every model's request rate under a demand mix: planning, the closed loop and the
    simulator then all read the mixed rates."""
    rates = scenario_rates(scenario, demand_mix)
    return replace(scenario, models=tuple(replace(m, rate_req_s=rates[m.model]) for m in scenario.models))


def scenario_traces(scenario: Scenario) -> dict[str, str]:
    return {m.model: m.trace for m in scenario.models}


_SELECTED: Recent[tuple[Template, ...]] = Recent(4)


def scenario_templates(scenario: Scenario, templates: Sequence[Template]) -> tuple[Template, ...]:
    """The templates a scenario can use (in library order): its models, at its SLO per phase, on its nodes,
    that its serving engine can execute (`templates/engines.py`).

    Aggregated templates carry the per-token (decode) SLO, as the library builds them. The selection is
    remembered for the same template sequence, so re-plans share one prepared library.
    """
    return _SELECTED.get(templates, lambda: _select(scenario, templates), key=scenario)


def _select(scenario: Scenario, templates: Sequence[Template]) -> tuple[Template, ...]:
    """`scenario_templates` without the memo."""
    slo = {(m.model, "prefill"): m.prefill_slo_ms for m in scenario.models}
    slo.update({(m.model, "decode"): m.decode_slo_ms for m in scenario.models})
    models = {m.model for m in scenario.models}
    nodes = set(scenario.node_configs)
    keep = []
    for t in templates:
        if t.model not in models or any(n not in nodes for n, _ in t.nodes.counts):
            continue
        if abs(t.slo_ms - slo[(t.model, "decode" if t.phase == "aggregated" else t.phase)]) > 1e-9:
            continue
        keep.append(t)
    return runnable(scenario.engine, keep)


def scenario_problem(scenario: Scenario, templates: Sequence[Template], market: MarketSnapshot | None = None, *,
                     availability_scale: float = 1.0, demand_mix: str = "uniform",
                     rates: Mapping[str, float] | None = None,
                     running: Mapping[tuple[str, str], int] | None = None,
                     boost: Mapping[str, float] | None = None, burst_aware: bool = True) -> AllocationProblem:
    """The allocation inputs of one scenario: its templates, the snapshot's offers and the demand of the mix.

    `rates` overrides the request rate per model (e.g. one re-plan window of a trace); `running` is the plan
    live now as {(template_id, region): count}; K = node start-up time / re-plan interval. Demand per (model,
    phase) is sized by `capacity_factors` (the burst-aware rule, times the closed loop's `boost` per model), or
    by the scenario's headroom alone with `burst_aware=False` (plans for smooth, e.g. Poisson, arrivals).
    """
    market = market or scenario.market(availability_scale=availability_scale)
    prices, avail = offers_from_market(market, scenario.node_configs, scenario.regions)
    rates = dict(rates) if rates is not None else scenario_rates(scenario, demand_mix)
    traces = scenario_traces(scenario)
    factors: dict[tuple[str, str], float] = capacity_factors(scenario, rates, boost) if burst_aware else {
        (m, p): scenario.headroom for m in rates for p in DEMAND_PHASES}
    return AllocationProblem(
        scenario=scenario.name,
        templates=scenario_templates(scenario, templates),
        usd_per_hour=prices,
        available_nodes=avail,
        demand_tokens_per_s=demand_tokens(rates, traces, factors),
        capacity_factors=factors,
        running=dict(running or {}),
        churn_k=scenario.node_startup_min / scenario.replan_interval_min,
        prompt_per_output={m: trace_stats(t).prompt_per_output for m, t in traces.items()},
        snapshot_id=market.snapshot_id,
        scenario_key=scenario.scenario_key,
    )


def capacity_factors(scenario: Scenario, rates: Mapping[str, float],
                     boost: Mapping[str, float] | None = None) -> dict[tuple[str, str], float]:
    """Per (model, phase): max(the scenario's headroom, the capacity rule's burst factor × `boost`)."""
    from coral_dagster.allocation.capacity import scenario_capacity

    caps = scenario_capacity(scenario, rates, boost)
    return {(m, p): max(scenario.headroom, caps[(m, p)].factor) if (m, p) in caps else scenario.headroom
            for m in rates for p in DEMAND_PHASES}
