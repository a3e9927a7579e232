"""The re-plan sensor replaying an availability series window by window: it asks for exactly the re-plans that a
direct comparison of the running plan's nodes with each window's counts predicts."""

from __future__ import annotations

import math
from datetime import datetime, timedelta, timezone

import dagster as dg
import pytest
import yaml
from click.testing import CliRunner
from support.scenario_docs import small

import assets.automation as automation
from coral_dagster.app.rounds import plan_round, store_demand
from coral_dagster.catalog.scenarios import load_scenario
from coral_dagster.catalog.store import append_snapshot
from coral_dagster.cli.main import main
from coral_dagster.store import Store
from resources import CoralDuckDB, SolverSettings

WINDOW_MIN = 60
DEFAULT_NODES = 64
# Per window: all GPUs, and L40S on its own; window 0 is where the plan is made.
MULTIPLIERS = [1, 1, 0.5, 0.25, 1, 0, 0.75, 1]
L40S = [1, 0.5, 1, 0.25, 0, 1, 1, 0.75]


def _context(db, cursor):
    return dg.build_sensor_context(cursor=cursor, resources={"duckdb": CoralDuckDB(database=str(db)),
                                                             "solver": SolverSettings()})


@pytest.mark.slow
def test_sensor_replans_exactly_when_a_window_leaves_the_plan_short(tmp_path, monkeypatch):
    doc = small(availability={"profile": "uniform", "default_nodes": DEFAULT_NODES,
                              "series": {"window_min": WINDOW_MIN, "multipliers": MULTIPLIERS,
                                         "gpus": {"L40S": L40S}}})
    path, db = tmp_path / "series.yaml", tmp_path / "c.duckdb"
    path.write_text(yaml.safe_dump(doc))
    res = CliRunner().invoke(main, ["templates", "build", "--scenario", str(path), "--db", str(db),
                                    "--processes", "1", "--json"])
    assert res.exit_code == 0, res.output
    scn, store = load_scenario(path), Store(db)
    monkeypatch.setattr(automation, "SENSOR_SCENARIO", str(path))

    # Times whose window (whole windows since the epoch, mod the series' length) is 0, 1, 2, ... in turn.
    period = WINDOW_MIN * 60
    t0 = datetime.fromtimestamp((1_800_000_000 // (period * len(MULTIPLIERS))) * period * len(MULTIPLIERS),
                                tz=timezone.utc)
    append_snapshot(store, scn.market(taken_at=t0))
    store_demand(store, scn, {m.model: m.rate_req_s for m in scn.models}, "uniform")
    used = plan_round(store, scn, "coral", time_limit_s=20).plan.nodes_used()
    assert used and all(k <= DEFAULT_NODES for k in used.values())

    def available(region_node, window):  # the direct computation, from the scenario file's numbers alone
        factor = (L40S if region_node[1].startswith("L40S:") else MULTIPLIERS)[window]
        return math.floor(DEFAULT_NODES * factor)

    predicted, requested, cursor = [], [], None
    for window in range(len(MULTIPLIERS)):
        when = t0 + timedelta(minutes=WINDOW_MIN * window + 7)
        assert int(when.timestamp() // period) % len(MULTIPLIERS) == window
        append_snapshot(store, scn.market(taken_at=when))
        with _context(db, cursor) as ctx:
            out = automation.reallocation_sensor(ctx)
            cursor = ctx.cursor
        assert cursor and cursor.split("|")[0].endswith(f"-w{window}")
        if isinstance(out, dg.RunRequest):
            requested.append(window)
            assert "available" in out.tags["coral/reasons"] or "candidate plan failed" in out.tags["coral/reasons"]
        else:
            assert "plan still right" in out.skip_message
        if any(k > available(key, window) for key, k in used.items()):
            predicted.append(window)
        with _context(db, cursor) as ctx:
            again = automation.reallocation_sensor(ctx)
        assert isinstance(again, dg.SkipReason) and "already evaluated" in again.skip_message
    print("nodes used", used, "re-plans in windows", requested)
    assert requested == predicted
    assert 0 < len(predicted) < len(MULTIPLIERS)
