"""Serving templates for the command line: the best placement of one node multiset, and a scenario's stored
library (built, or read back)."""

from __future__ import annotations

import dataclasses

import pandas as pd

from coral_dagster.catalog.scenarios import MAX_N_MAX as MAX_N_MAX, MAX_RHO as MAX_RHO, Scenario


def best_template(model: str, phase: str, nodes: str, **options):
    """(template, T̂ tables, solve seconds) of one node multiset (`templates.best.best_for_nodes`)."""
    from coral_dagster.templates.best import best_for_nodes

    return best_for_nodes(model, phase, nodes, **options)


def library_scenario(scenario: str, t_hat_rule: str | None = None, n_max: int | None = None,
                     rho: float | None = None) -> Scenario:
    """The scenario a library is built for: its T̂ rule, most nodes and memory per template as asked (None: its
    own)."""
    from coral_dagster.catalog.scenarios import load_scenario

    scn = load_scenario(scenario)
    return dataclasses.replace(scn, t_hat_rule=t_hat_rule or scn.t_hat_rule,
                               n_max=scn.n_max if n_max is None else n_max, rho=scn.rho if rho is None else rho)


def build_and_store(scn: Scenario, db_path: str | None, *, processes: int | None, progress: bool, prune: bool,
                    models: list[str] | None):
    """Build the scenario's library and store it under its library key: (rows stored, build stats, DuckDB path)."""
    from coral_dagster.store import Store
    from coral_dagster.templates.library import build_library_with_stats, store_library

    templates, stats = build_library_with_stats(scn, processes=processes, progress=progress, prune=prune,
                                                models=models)
    store = Store(db_path)
    return store_library(store, templates, scn), stats, store.path


def stored_templates(scenario: str, t_hat_rule: str | None, db_path: str | None, model: str | None,
                     phase: str | None, limit: int) -> pd.DataFrame:
    """A scenario's stored templates, highest throughput first (optionally of one model and phase)."""
    from coral_dagster.errors import CoralError
    from coral_dagster.store import Store
    from coral_dagster.templates.library import TEMPLATES_TABLE

    store, key = Store(db_path), library_scenario(scenario, t_hat_rule).library_key
    if "library_key" not in store.columns(TEMPLATES_TABLE):
        raise CoralError(f"no template library of the current format in {store.path}.",
                         f"run `coral templates build --scenario {scenario}`.")
    sql = (f"SELECT model, phase, slo_ms, nodes, n_stages, tokens_per_s, bound, pp_partition FROM {TEMPLATES_TABLE} "
           "WHERE library_key = ? AND (? IS NULL OR model = ?) AND (? IS NULL OR phase = ?) "
           "ORDER BY tokens_per_s DESC, nodes LIMIT ?")
    return store.query(sql, [key, model, model, phase, phase, limit])
