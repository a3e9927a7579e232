"""`coral run` as a person reads it: one line for rejected price rows, the plan against the previous one and the
baselines, failed checks as sentences and a non-zero exit, and every run recorded in the Dagster instance."""

from __future__ import annotations

import json
import logging
from collections import Counter

import dagster as dg
import pytest
from click.testing import CliRunner

from coral_dagster.catalog.scenarios import load_scenario
from coral_dagster.cli.main import main

PRICES_LOGGER = "coral_dagster.catalog.prices"


def test_rejected_price_rows_are_one_warning_and_each_row_at_info(caplog):
    from coral_dagster.catalog.prices import build_node_prices

    with caplog.at_level(logging.WARNING, logger=PRICES_LOGGER):
        rejected = build_node_prices().rejected
    warnings = [r for r in caplog.records if r.name == PRICES_LOGGER]
    assert len(rejected) > 1 and len(warnings) == 1
    assert f"{len(rejected)} rows or spot values left out" in warnings[0].getMessage()
    assert "coral -v" in warnings[0].getMessage()

    caplog.clear()
    with caplog.at_level(logging.INFO, logger=PRICES_LOGGER):
        build_node_prices()
    rows = [r.getMessage() for r in caplog.records if r.name == PRICES_LOGGER and r.levelno == logging.INFO]
    for row in rejected.itertuples():
        assert any(m.startswith(f"{row.file} row {row.row} ") for m in rows), row


@pytest.mark.parametrize("args, wording", [
    (["--attainment-target", "1.5"], "'1.5' is outside [0, 1]"),
    (["--scenario", "no-such-scenario"], "no-such-scenario"),
])
def test_bad_input_is_one_clear_error_not_a_traceback(tmp_path, args, wording):
    env = {"CORAL_DB": str(tmp_path / "c.duckdb"), "DAGSTER_HOME": str(tmp_path / "home")}
    result = CliRunner(mix_stderr=False).invoke(main, ["run", *args], env=env)
    assert result.exit_code == 2 and wording in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def _instances(store, plan_id: str) -> Counter:
    rows = store.query("SELECT model, phase, region, nodes, count FROM plan_instances WHERE plan_id = ?", [plan_id])
    return Counter({(r.model, r.phase, r.region, r.nodes): int(r.count) for r in rows.itertuples()})


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """`coral run` twice on one DuckDB file and Dagster home: a target every simulation meets, then 100%."""
    from coral_dagster.store import Store

    tmp = tmp_path_factory.mktemp("run")
    env = {"CORAL_DB": str(tmp / "c.duckdb"), "DAGSTER_HOME": str(tmp / "home")}
    runs, libraries = [], []
    for target in ("0", "1"):
        result = CliRunner(mix_stderr=False).invoke(
            main, ["run", "--simulate-s", "30", "--attainment-target", target], env=env, catch_exceptions=False)
        store = Store(tmp / "c.duckdb")
        plan_id = store.query("SELECT plan_id FROM plans WHERE method = 'coral' ORDER BY created_at DESC LIMIT 1")
        runs.append((result, str(plan_id["plan_id"].iloc[0]), float(target)))
        libraries.append(store.query("SELECT * FROM templates ORDER BY template_id"))
    return tmp, Store(tmp / "c.duckdb"), runs, libraries


def _violations(store, plan_id: str) -> list[str]:
    from coral_dagster.allocation.check import plan_violations
    from coral_dagster.allocation.storage import load_plan
    from coral_dagster.app.plans import plan_problem

    plan = load_plan(store, plan_id)
    return plan_violations(plan, plan_problem(store, plan), require_demand=plan.status == "optimal")


@pytest.mark.slow
def test_run_exit_code_follows_the_checks_and_failed_ones_read_as_sentences(two_runs):
    tmp, store, runs, _ = two_runs
    for result, plan_id, target in runs:
        sim = store.query("SELECT model, attainment FROM simulations WHERE plan_id = ?", [plan_id])
        short = sim[sim["attainment"] < target]
        failing = bool(_violations(store, plan_id)) or not short.empty
        assert result.exit_code == (1 if failing else 0), result.stdout + result.stderr
        for row in short.itertuples():
            assert f"{row.model} served {row.attainment:.1%} of requests within SLO" in result.stdout
        assert ("Not materialized, stopped by a failed blocking check: deployment_specs." in result.stdout) == failing
        assert "Metadata" not in result.stdout and "JsonMetadataValue" not in result.stdout
    with dg.DagsterInstance.from_config(str(tmp / "home")) as instance:
        deployed = instance.get_latest_materialization_event(dg.AssetKey("deployment_specs"))
        last_passing = [plan_id for result, plan_id, _ in runs if result.exit_code == 0][-1:]
        assert (deployed.asset_materialization.metadata["plan_id"].value if deployed else None) in (
            last_passing or [None])
        templates = instance.get_materialized_partitions(dg.AssetKey("template_library"))
    from assets.templates import scenario_partitions

    assert templates == set(scenario_partitions("core"))


@pytest.mark.slow
def test_run_summary_names_the_plan_compares_it_and_shows_every_baseline(two_runs):
    _, store, runs, _ = two_runs
    (first, first_id, _), (second, second_id, _) = runs
    assert "This is the first coral plan of core" in first.stdout
    assert f"Against the previous coral plan of core ({first_id})" in second.stdout
    before, after = _instances(store, first_id), _instances(store, second_id)
    launched, removed = sum((after - before).values()), sum((before - after).values())
    moves = (f"launches {launched:,} instance(s) and removes {removed:,}" if launched or removed
             else "keeps every instance")
    assert moves in second.stdout
    for result, plan_id, _ in runs:
        assert result.stdout.count(f"core: coral plan {plan_id}") >= 3  # plan, cost by method, simulation headers
        assert "e+0" not in result.stdout and "e-0" not in result.stdout
        stored = store.query("SELECT method, plan_id FROM plans WHERE run_id = ("
                             "SELECT run_id FROM plans WHERE plan_id = ?)", [plan_id])
        for method in ("homo", "homo-ilp", "cauchy"):
            ids = stored.loc[stored["method"] == method, "plan_id"]
            assert (ids.iloc[0] in result.stdout) if len(ids) else (f"{method} cannot meet demand" in result.stdout)


@pytest.mark.slow
def test_each_coral_run_is_one_named_run_tagged_with_its_scenario_whose_assets_share_one_plan(two_runs):
    """One `coral_pipeline` run per `coral run` (not one run per step), tagged with the scenario; downstream assets
    and checks record the plan id the run's `allocation_plan` made, and no deprecation warning is logged."""
    tmp, store, runs, _ = two_runs
    with dg.DagsterInstance.from_config(str(tmp / "home")) as instance:
        records = instance.get_runs()
        assert [(r.job_name, r.tags["coral/scenario"]) for r in records] == [("coral_pipeline", "core")] * len(runs)
        for record, (result, plan_id, _) in zip(reversed(records), runs):
            recorded = {}
            for entry in instance.all_logs(record.run_id):
                event = entry.dagster_event
                if event is not None and event.event_type == dg.DagsterEventType.ASSET_MATERIALIZATION:
                    mat = event.event_specific_data.materialization
                    if "plan_id" in mat.metadata:
                        recorded[mat.asset_key.to_user_string()] = mat.metadata["plan_id"].value
                if event is None and "Deprecat" in (entry.user_message or ""):
                    raise AssertionError(entry.user_message)
            assert recorded["allocation_plan"] == plan_id
            assert {recorded[a] for a in ("baseline_plans", "plan_simulation", *recorded.keys() & {
                "deployment_specs"})} == {plan_id}
            assert "Deprecat" not in result.stderr


@pytest.mark.slow
def test_a_second_run_keeps_the_library_the_first_built_for_the_same_inputs(two_runs):
    """The first `coral run` builds every core model's templates; the second, on the same DuckDB file and inputs,
    keeps them (its template_library materialization lists every partition as reused and took no build time) and
    the stored library is row for row what the first run built."""
    from pandas.testing import assert_frame_equal

    from assets.templates import scenario_partitions

    tmp, _, _, libraries = two_runs
    with dg.DagsterInstance.from_config(str(tmp / "home")) as instance:
        metadata = []
        for record in reversed(instance.get_runs()):
            # One materialization per partition, each carrying the run's metadata.
            per_partition = [entry.dagster_event.event_specific_data.materialization.metadata
                             for entry in instance.all_logs(record.run_id)
                             if entry.dagster_event is not None
                             and entry.dagster_event.event_type == dg.DagsterEventType.ASSET_MATERIALIZATION
                             and entry.dagster_event.asset_key.to_user_string() == "template_library"]
            assert len(per_partition) == len(scenario_partitions("core"))
            metadata.append(per_partition[0])
    first, second = metadata
    assert first["reused"].value == [] and first["build_s"].value > 0
    assert second["reused"].value == scenario_partitions("core") and second["build_s"].value == 0
    assert second["templates"].value == first["templates"].value == len(libraries[0]) > 0
    assert_frame_equal(libraries[1], libraries[0])


@pytest.mark.slow
def test_documented_sql_returns_rows_on_the_store_coral_run_wrote_and_after_plan_and_simulate(two_runs):
    """Every SQL example of docs/plan-history.md (read from it) returns rows on the store `coral run` wrote; after
    `coral plan` and `coral simulate` of that new plan, "expected vs got" returns its models, with what they got."""
    import re
    from pathlib import Path

    tmp, store, runs, _ = two_runs
    doc = (Path(__file__).resolve().parent.parent / "docs" / "plan-history.md").read_text()
    queries = re.findall(r"```sql\n(.*?)```", doc, re.S)
    expected_vs_got = [q for q in queries if "plan_expectations" in q]
    assert len(queries) >= 4 and len(expected_vs_got) == 1
    (_, first_id, _), (_, second_id, _) = runs
    for sql in queries:
        rows = store.query(sql.strip().rstrip(";"))
        if "FROM plan_diff" in sql:  # the latest plan's changes: none when it equals the one before
            assert rows.empty == (_instances(store, first_id) == _instances(store, second_id)), sql
        else:
            assert not rows.empty, sql
    db = ["--db", str(tmp / "c.duckdb")]
    planned = CliRunner(mix_stderr=False).invoke(main, ["plan", "--scenario", "core", "--json", *db])
    assert planned.exit_code == 0, planned.stdout + planned.stderr
    planned_doc = json.loads(planned.stdout[planned.stdout.index("{"):])
    plan_id = planned_doc["plan_id"]
    simulated = CliRunner(mix_stderr=False).invoke(main, ["simulate", "--duration-s", "30", "--json", *db])
    assert simulated.exit_code == 0, simulated.stdout + simulated.stderr
    assert plan_id in json.loads(simulated.stdout[simulated.stdout.index("{"):])["recorded"]
    got = store.query(expected_vs_got[0].strip().rstrip(";"))
    assert set(got["model"]) == {m.model for m in load_scenario("core").models} and got["got"].notna().all()
    # `coral plan` runs the closed loop by default: the plan expects what its last round's simulation gave (the
    # README query rounds to 3 decimals).
    assert dict(zip(got["model"], got["expected"])) == pytest.approx(planned_doc["expected_attainment"], abs=5e-4)
