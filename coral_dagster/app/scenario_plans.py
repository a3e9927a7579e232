"""One solve of a scenario for the benches (`app.make_plan.solve_once` on its library, today's market and the demand
mix), and the scenario's template library, built when the store lacks it."""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping, Sequence

from coral_dagster.allocation.inputs import scenario_rates, scenario_templates
from coral_dagster.allocation.types import Plan, Scarcity
from coral_dagster.catalog.scenarios import Scenario, load_scenario
from coral_dagster.highs import DEFAULT_MAX_NODES, SAFETY_NET_S
from coral_dagster.templates.types import Template
from coral_dagster.vocab import DEMAND_PHASES


def library_templates(scenario: Scenario, db_path: str | None = None) -> tuple[Template, ...]:
    """The scenario's template library: from the DuckDB store when it holds templates at the scenario's SLOs,
    else built now and stored under the scenario's `library_key` (so no other scenario's library is touched)."""
    from coral_dagster.store import Store
    from coral_dagster.templates.library import build_library, load_library, store_library

    store = Store(db_path)
    stored = tuple(load_library(store, scenario))
    if stored and _covers(scenario, stored):
        return stored
    built = tuple(build_library(scenario, progress=True))
    store_library(store, built, scenario)
    return built


def _covers(scenario: Scenario, templates: Sequence[Template]) -> bool:
    """Whether every model and phase of the scenario has a template at its SLO (whichever engine runs them)."""
    kinds = {(t.model, t.phase) for t in scenario_templates(replace(scenario, engine="coral"), templates)}
    return all((m.model, p) in kinds for m in scenario.models for p in DEMAND_PHASES)


def plan_scenario(scenario: str | Scenario, *, method: str = "coral", availability_scale: float = 1.0,
                  demand_mix: str = "uniform", running: Plan | None = None, scarcity: Scarcity | None = None,
                  time_limit_s: float = SAFETY_NET_S, db_path: str | None = None,
                  templates: Sequence[Template] | None = None, market=None, burst_aware: bool = True,
                  boost: Mapping[str, float] | None = None, max_nodes: int | None = DEFAULT_MAX_NODES,
                  prices=None) -> Plan:
    """A plan for a bundled scenario with one method; `running` is the plan live now (churn is priced against
    it); Helix ignores `templates`, demand mix and `running` (it places one model on the whole cluster). `market`
    replaces the scenario's snapshot, priced from `prices` (a price file's rows; default the bundled ones) and
    scaled by `availability_scale`; `max_nodes` is each MIP's work limit, `time_limit_s` the wall-clock safety
    net."""
    from coral_dagster.app.make_plan import solve_once

    scn = load_scenario(scenario) if isinstance(scenario, str) else scenario
    market = market or scn.market(availability_scale=availability_scale, prices=prices)
    if templates is None and method != "helix":
        templates = library_templates(scn, db_path)
    return solve_once(scn, method, templates, market, scenario_rates(scn, demand_mix), running=running,
                      scarcity=scarcity, time_limit_s=time_limit_s, max_nodes=max_nodes, boost=boost,
                      burst_aware=burst_aware)
