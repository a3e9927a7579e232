"""A day's windows served apart as the `day_window_served` asset's time-window partitions, from the serving inputs a
fluid day kept (`coral day --keep-segments`), against the day loop serving the same windows request by request in
sequence: request for request the same per model; a partition served again replaces its rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import dagster as dg
import pytest
from click.testing import CliRunner

from support.scenario_docs import copy_small

from assets.day import day_window_partitions, day_window_served, partition_window
from coral_dagster.app.scenario_plans import library_templates
from coral_dagster.catalog.prices import load_node_prices
from coral_dagster.catalog.scenarios import load_scenario
from coral_dagster.cli.main import main
from coral_dagster.day.loop import DayLoop
from coral_dagster.day.run import method_planner
from coral_dagster.day.serve import ModelServed
from coral_dagster.day.windows import inputs_from_json, inputs_to_json, kept_run_id, read_inputs
from coral_dagster.errors import CoralError
from coral_dagster.store import Store
from resources import CoralDuckDB, CoralScenario

HOURS, WINDOWS, SEED = 0.3, 3, 7
COUNTS = ["offered", "shed", "met", "offered_tokens", "completed_tokens", "slo_tokens"]


@dataclass(frozen=True)
class Days:
    scenario: Path
    db: Path
    kept_run: str
    plain_run: str
    sequential: DayLoop


@pytest.fixture(scope="module")
def days(small_library, tmp_path_factory) -> Days:
    """The small scenario's day: stored by `coral day --keep-segments` (fluid), then a newer day stored without
    them, and the same day served request by request in sequence by the loop itself (`serve_mode="requests"`)."""
    folder = tmp_path_factory.mktemp("day-windows")
    scenario, db = copy_small(small_library, folder)
    common = ["day", "--scenario", str(scenario), "--db", str(db), "--seed", str(SEED), "--json"]
    res = CliRunner().invoke(main, [*common, "--hours", str(HOURS), "--keep-segments"])
    assert res.exit_code == 0, res.output
    kept = kept_run_id(Store(db))
    res = CliRunner().invoke(main, [*common, "--hours", "0.1"])
    assert res.exit_code == 0, res.output
    runs = Store(db).query("SELECT run_id FROM day_runs ORDER BY created_at")
    assert runs.run_id.tolist()[0] == kept and len(runs) == 2
    scn = load_scenario(scenario)
    planner = method_planner(scn, library_templates(scn, str(db)), "coral", time_limit_s=scn.replan_interval_min * 30)
    loop = DayLoop(scn, "coral", planner, Store(folder / "deployment.duckdb"), load_node_prices(),
                   serve_mode="requests", keep_runs=True, seed=SEED)
    loop.run(HOURS)
    return Days(scenario, db, kept, str(runs.run_id.iloc[1]), loop)


def _materialize(days: Days, window: int, run_id: str = "") -> dg.ExecuteInProcessResult:
    key = day_window_partitions.get_partition_keys()[window]
    return dg.materialize([day_window_served], partition_key=key,
                          resources={"duckdb": CoralDuckDB(database=str(days.db)),
                                     "scenario": CoralScenario(name=str(days.scenario))},
                          run_config={"ops": {"day_window_served": {"config": {"run_id": run_id}}}})


def _served(db: Path) -> dict[tuple[str, int, str], ModelServed]:
    rows = Store(db).query('SELECT * FROM day_window_served ORDER BY run_id, "window", model')
    assert not rows.duplicated(["run_id", "window", "model"]).any()
    return {(r.run_id, int(r.window), r.model): ModelServed(*(getattr(r, c) for c in COUNTS))
            for r in rows.itertuples()}


def test_partitions_are_the_day_windows():
    keys = day_window_partitions.get_partition_keys()
    assert [partition_window(k) for k in keys[:3]] == [0, 1, 2] and keys[1] == "2026-01-05-00:06"
    assert len(keys) == 7 * 24 * 10 and partition_window(keys[-1]) == len(keys) - 1


def test_kept_inputs_are_the_loops_and_round_trip_through_json(days):
    """What the fluid day stored of each window is what the sequential loop fixed (plan, segments, rates); the
    stored JSON reads back to equal values."""
    store = Store(days.db)
    assert len(days.sequential.served) == WINDOWS
    multi = 0
    for w in range(WINDOWS):
        kept = read_inputs(store, days.kept_run, w)
        assert kept.window == w and kept.seed == SEED
        assert kept.plan.counts() == days.sequential.adopted[w].counts(), f"window {w}: the two days planned apart"
        assert kept.segments == tuple(r.segment for r in days.sequential.served[w].runs)
        assert inputs_from_json(inputs_to_json(kept), "again") == kept
        multi += len(kept.segments) > 1
    assert multi > 0, "some window has instances coming up inside it"


def test_partitions_served_apart_equal_the_loop_serving_in_sequence(days):
    """Each window materialized as its own partition run (the newest run that kept inputs, not the newer plain one)
    serves, model by model, the same requests with the same outcomes as the loop serving the day in sequence."""
    for w in range(WINDOWS):
        result = _materialize(days, w)
        assert result.success
        meta = result.asset_materializations_for_node("day_window_served")[0].metadata
        assert meta["run_id"].value == days.kept_run and meta["window"].value == w
        oracle = days.sequential.served[w].by_model
        offered = sum(s.offered for s in oracle.values())
        assert meta["attainment"].value == pytest.approx(sum(s.met for s in oracle.values()) / offered, abs=1e-4)
        assert meta["shed_share"].value == pytest.approx(sum(s.shed for s in oracle.values()) / offered, abs=1e-4)
    served = _served(days.db)
    expected = {(days.kept_run, w, m): s for w in range(WINDOWS) for m, s in days.sequential.served[w].by_model.items()}
    assert served == expected
    assert sum(s.shed for s in expected.values()) > 0 and sum(s.met for s in expected.values()) > 0


def test_a_partition_served_again_replaces_its_rows(days):
    _materialize(days, 1, days.kept_run)
    before = _served(days.db)
    assert _materialize(days, 1, days.kept_run).success
    assert _served(days.db) == before
    window_rows = Store(days.db).query('SELECT count(*) AS n FROM day_window_served WHERE run_id = ? AND "window" = 1',
                                       [days.kept_run])
    assert int(window_rows.n.iloc[0]) == len(days.sequential.served[1].by_model)


@pytest.mark.parametrize("run, problem", [("plain", "kept no serving inputs"), ("nope", "is not in day_runs")])
def test_a_run_without_kept_inputs_is_a_clear_error(days, run, problem):
    run_id = days.plain_run if run == "plain" else run
    with pytest.raises(CoralError) as info:
        _materialize(days, 0, run_id)
    err = info.value
    assert problem in err.problem and run_id in err.problem
    assert "coral day --keep-segments" in err.fix


def test_a_window_the_run_did_not_keep_is_a_clear_error(days):
    with pytest.raises(CoralError, match=f"kept windows 0 to {WINDOWS - 1}; window {WINDOWS} is not"):
        read_inputs(Store(days.db), days.kept_run, WINDOWS)


@pytest.mark.slow  # three `dagster asset materialize` processes loading the code location at once: ~40 s loaded
def test_partitions_materialized_in_parallel_processes_each_count_once(days, tmp_path):
    """Three partition runs at once from the command line, as a backfill launches them, each its own process writing
    the same DuckDB file: every window's rows are there once, equal to the loop's."""
    root = Path(__file__).resolve().parents[1]
    dg_cli = Path(sys.executable).with_name("dg")
    env = {**os.environ, "DAGSTER_HOME": str(tmp_path), "CORAL_DB": str(days.db)}
    (tmp_path / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    dg.DagsterInstance.from_config(str(tmp_path)).dispose()  # its storage made once, not raced by three runs
    config = json.dumps({"ops": {"day_window_served": {"config": {"run_id": days.kept_run}}},
                         "resources": {"scenario": {"config": {"name": str(days.scenario)}}}})
    keys = day_window_partitions.get_partition_keys()[:WINDOWS]
    procs = [subprocess.Popen([str(dg_cli), "launch", "--assets", "day_window_served", "--partition", key,
                               "--config-json", config],
                              cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for key in keys]
    for proc in procs:
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, out
    served = {k: v for k, v in _served(days.db).items() if k[0] == days.kept_run}
    assert served == {(days.kept_run, w, m): s for w in range(WINDOWS)
                      for m, s in days.sequential.served[w].by_model.items()}
