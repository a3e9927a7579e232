"""The prepared library in DuckDB: the templates pruning keeps under a market's availability, so a fresh process
reads only those.

A template can be a column only if no other template dominates it (`prune.dominated_ids`) and it fits at least
one region (every node sold, enough of each available). Those template ids are stored in `prepared_templates`
under a key of the library's stored content (a digest of every template id with its throughput, computed in SQL),
the scenario's selection (its `library_key` and serving engine) and the snapshot's availability per (region,
configuration). A library whose rows change, or other availability, gets a new key: nothing stale is ever read.
Prices and demand are not in the key: neither decides whether a template fits (the planner drops templates of a
model without demand per solve).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
from typing import Iterator, Sequence

import numpy as np
import pandas as pd

from coral_dagster.allocation.problem import offers_from_market
from coral_dagster.allocation.prune import prepare, region_caps
from coral_dagster.catalog.market import MarketSnapshot
from coral_dagster.catalog.scenarios import Scenario
from coral_dagster.templates.library import TEMPLATES_TABLE, templates_from_frame
from coral_dagster.templates.types import Template

PREPARED_TABLE = "prepared_templates"


def availability_digest(scenario: Scenario, market: MarketSnapshot) -> str:
    """What of a snapshot decides which templates fit: the nodes available per (region, configuration) of the
    scenario (prices do not; a later snapshot with the same availability shares the survivors)."""
    _, avail = offers_from_market(market, scenario.node_configs, scenario.regions)
    return hashlib.sha256(repr(sorted((r, str(n), k) for (r, n), k in avail.items())).encode()).hexdigest()[:16]


def prepared_key(store, scenario: Scenario, market: MarketSnapshot) -> str | None:
    """The key of the scenario's stored library as it is now under the snapshot's availability (None when no
    library is stored)."""
    if TEMPLATES_TABLE not in store.tables() or "library_key" not in store.columns(TEMPLATES_TABLE):
        return None
    # XOR of DuckDB's row hashes: order-free and a scan of two columns (an ordered md5 of 366k rows took 2.7 s)
    row = store.query(f"""SELECT count(*) AS n, CAST(bit_xor(hash(template_id, tokens_per_s)) AS VARCHAR) AS digest
                          FROM {TEMPLATES_TABLE} WHERE library_key = ?""", [scenario.library_key]).iloc[0]
    if int(row["n"]) == 0:
        return None
    own = f"{scenario.library_key}|{scenario.engine}|{availability_digest(scenario, market)}|{int(row['n'])}|" \
          f"{row['digest']}"
    return hashlib.sha256(own.encode()).hexdigest()[:24]


def survivor_ids(scenario: Scenario, selected: Sequence[Template], market: MarketSnapshot) -> list[str]:
    """Ids of the selected templates that no other dominates and that fit at least one region of the market."""
    lib = prepare(tuple(selected))
    prices, avail = offers_from_market(market, scenario.node_configs, scenario.regions)
    fits = np.zeros(len(lib.templates), dtype=bool)
    for region in sorted({r for r, _ in prices}):
        fits |= region_caps(lib, prices, avail, region)[1] > 0
    return [tid for tid, ok in zip(lib.ids, fits & ~lib.dominated) if ok]


def store_survivors(store, key: str, ids: Sequence[str]) -> None:
    """Write the survivors under `key` in one transaction (a failure writes nothing)."""
    from coral_dagster.store.duck import replace_rows

    frame = pd.DataFrame({"prepared_key": key, "template_id": list(ids)}, columns=["prepared_key", "template_id"])
    with store.transaction() as con:
        replace_rows(con, PREPARED_TABLE, frame.astype(object), {"prepared_key": key})


def load_survivors(store, scenario: Scenario, key: str, keep: Sequence[str] = ()) -> list[Template] | None:
    """The stored survivors under `key` and the library's templates with ids in `keep` (a running plan's: dominated
    ones stay columns, keeping them avoids churn), in library order; None when no survivors are stored."""
    if PREPARED_TABLE not in store.tables():
        return None
    if store.query(f"SELECT count(*) AS n FROM {PREPARED_TABLE} WHERE prepared_key = ?", [key])["n"].iloc[0] == 0:
        return None
    df = store.query(f"""SELECT t.* FROM {TEMPLATES_TABLE} t LEFT JOIN {PREPARED_TABLE} p
                           ON p.template_id = t.template_id AND p.prepared_key = ?
                         WHERE t.library_key = ? AND (p.template_id IS NOT NULL OR list_contains(?, t.template_id))
                         ORDER BY t.template_id""", [key, scenario.library_key, list(keep)])
    with _gc_paused():
        return templates_from_frame(df)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off while tens of thousands of small immutable objects are built: none can be
    freed, and each collection would walk all of them (core's 10.7k templates: 1.6–2.7 s instead of 4.2–5.7 s)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def planning_templates(store, scenario: Scenario, market: MarketSnapshot,
                       running: Sequence[str] = ()) -> tuple[Template, ...]:
    """What Coral's planner needs of the stored library under `market`: the stored survivors and the running
    plan's templates (`running`: their ids).

    The first time (nothing stored under the library's current key and the snapshot) the whole library is read,
    its survivors are stored, and the whole library is returned; later calls, in any process, read only the
    survivors. Empty when no library is stored.
    """
    from coral_dagster.allocation.inputs import scenario_templates
    from coral_dagster.templates.library import load_library

    key = prepared_key(store, scenario, market)
    if key is None:
        return ()
    found = load_survivors(store, scenario, key, running)
    if found is not None:
        survivors = tuple(found)
        # Planning selects from this tuple and prepares the selection (both memoised by identity): prepare it now
        # without the dominance search the stored survivors already passed.
        prepare(scenario_templates(scenario, survivors), undominated=True)
        return survivors
    library = tuple(load_library(store, scenario))
    store_survivors(store, key, survivor_ids(scenario, scenario_templates(scenario, library), market))
    return library
