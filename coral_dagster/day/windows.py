"""A day's windows served apart: what a run kept of each window's serving (plan, segments, rates, seed) in the store's
`day_segments`, read back to serve one window request by request on its own, its result in `day_window_served`."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

import duckdb
import pandas as pd

from coral_dagster.allocation.codec import parse_plan_text, plan_from_doc, plan_to_doc
from coral_dagster.allocation.types import Plan, PlannedInstance
from coral_dagster.catalog.scenarios import Scenario
from coral_dagster.day.serve import Segment, WindowServing, serve_window
from coral_dagster.errors import CoralError
from coral_dagster.store import Store
from coral_dagster.store.duck import write_frame

INPUTS_TABLE = "day_segments"
SERVED_TABLE = "day_window_served"
KEEP_FIX = ("run the day again keeping them (`coral day --keep-segments ...`), then materialize `day_window_served` "
            "with that run's id (or none: the newest run that kept them)")


@dataclass(frozen=True)
class WindowInputs:
    """All that serving one window request by request depends on, fixed by the day loop: the window's plan, its
    segments (instances up and when), its rates and the day's seed (`serve.serve_window`)."""

    window: int
    plan: Plan
    segments: tuple[Segment, ...]
    rates: Mapping[str, float]
    seed: int

    def serve(self, scenario: Scenario) -> WindowServing:
        """The window served request by request, as the day loop with `serve_mode="requests"` serves it."""
        return serve_window(scenario, self.plan, self.segments, self.rates, seed=self.seed, window=self.window)


def inputs_to_json(inputs: WindowInputs) -> str:
    """One window's inputs as JSON: the plan and each segment's instances in the plan codec's form."""
    doc = {"window": inputs.window, "seed": inputs.seed, "rates": dict(inputs.rates),
           "plan": plan_to_doc(inputs.plan, derived=False),
           "segments": [{"start_s": s.start_s, "end_s": s.end_s, "instances": _instances_doc(inputs.plan, s.instances),
                         "up_share": {f"{m}/{p}": v for (m, p), v in sorted(s.up_share.items())}}
                        for s in inputs.segments]}
    return json.dumps(doc, allow_nan=False)


def inputs_from_json(text: str, where: str) -> WindowInputs:
    """`inputs_to_json`'s text read back (plans checked by the plan codec, as the store reads plans)."""
    doc = parse_plan_text(text, where)
    try:
        segments = tuple(Segment(float(s["start_s"]), float(s["end_s"]), _instances(s["instances"], where),
                                 {_phase_key(k): float(v) for k, v in s["up_share"].items()})
                         for s in doc["segments"])
        return WindowInputs(int(doc["window"]), plan_from_doc(doc["plan"], where, catalog=False), segments,
                            {str(m): float(r) for m, r in doc["rates"].items()}, int(doc["seed"]))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CoralError(f"the serving inputs {where} are malformed ({exc!r}).", KEEP_FIX + ".") from None


def write_inputs(con: duckdb.DuckDBPyConnection, run_id: str, kept: Sequence[WindowInputs]) -> None:
    """Append a run's kept window inputs to `day_segments` on an open connection (inside the transaction that
    stores the day, so a run and its inputs are stored together or not at all)."""
    if kept:
        write_frame(con, INPUTS_TABLE, pd.DataFrame([{"run_id": run_id, "window": k.window,
                                                      "inputs_json": inputs_to_json(k)} for k in kept]))


def kept_run_id(store: Store) -> str:
    """The newest day run (by `created_at`) that kept its windows' serving inputs."""
    if INPUTS_TABLE not in store.tables():
        raise CoralError(f"no day run in {store.path} kept its windows' serving inputs.", KEEP_FIX + ".")
    found = store.query(f"""SELECT r.run_id FROM day_runs r WHERE r.run_id IN (SELECT run_id FROM {INPUTS_TABLE})
                            ORDER BY r.created_at DESC, r.run_id DESC LIMIT 1""")
    if found.empty:
        raise CoralError(f"no day run in {store.path} kept its windows' serving inputs.", KEEP_FIX + ".")
    return str(found.run_id.iloc[0])


def read_inputs(store: Store, run_id: str, window: int) -> WindowInputs:
    """The serving inputs day run `run_id` kept of `window`; an error naming the fix where it kept none."""
    kept = (store.query(f'SELECT "window", inputs_json FROM {INPUTS_TABLE} WHERE run_id = ? ORDER BY "window"',
                        [run_id]) if INPUTS_TABLE in store.tables() else pd.DataFrame(columns=["window"]))
    if kept.empty:
        known = "day_runs" in store.tables() and not store.query("SELECT 1 FROM day_runs WHERE run_id = ?",
                                                                 [run_id]).empty
        what = "kept no serving inputs of its windows" if known else "is not in day_runs"
        raise CoralError(f"day run {run_id!r} in {store.path} {what}.", KEEP_FIX + ".")
    row = kept[kept.window == window]
    if row.empty:
        raise CoralError(f"day run {run_id!r} kept windows {int(kept.window.min())} to {int(kept.window.max())}; "
                         f"window {window} is not one of them.",
                         "materialize only the partitions of the run's windows (its first hours from 0:00 UTC on the "
                         "day's date), or run a longer day with --keep-segments.")
    return inputs_from_json(str(row.inputs_json.iloc[0]), f"of day run {run_id} window {window}")


def served_frame(run_id: str, window: int, serving: WindowServing) -> pd.DataFrame:
    """One row per model of a window served request by request."""
    served_at = pd.Timestamp.now(tz="UTC")
    return pd.DataFrame([{"run_id": run_id, "window": window, "model": m, "offered": s.offered, "shed": s.shed,
                          "met": s.met, "offered_tokens": s.offered_tokens, "completed_tokens": s.completed_tokens,
                          "slo_tokens": s.slo_tokens, "attainment": s.attainment,
                          "admitted_attainment": s.admitted_attainment, "wall_s": serving.wall_s,
                          "served_at": served_at} for m, s in sorted(serving.by_model.items())])


def store_served(store: Store, run_id: str, window: int, serving: WindowServing) -> pd.DataFrame:
    """Write a window's served rows to `day_window_served` in one transaction, replacing that (run, window)'s rows
    (a window served again is counted once); returns the rows written."""
    rows = served_frame(run_id, window, serving)
    with store.transaction() as con:
        write_frame(con, SERVED_TABLE, rows,
                    before_insert=(f'DELETE FROM {SERVED_TABLE} WHERE run_id = ? AND "window" = ?', [run_id, window]))
    return rows


def _instances_doc(plan: Plan, instances: tuple[PlannedInstance, ...]) -> list[dict[str, Any]]:
    """A segment's instances in the plan codec's instance form."""
    rows: list[dict[str, Any]] = plan_to_doc(replace(plan, instances=instances), derived=False)["instances"]
    return rows


def _instances(rows: list, where: str) -> tuple[PlannedInstance, ...]:
    """A segment's instances read back by the plan codec."""
    return plan_from_doc({"instances": rows, "served": {}}, where, catalog=False).instances


def _phase_key(text: str) -> tuple[str, str]:
    model, _, phase = str(text).rpartition("/")
    return model, phase
