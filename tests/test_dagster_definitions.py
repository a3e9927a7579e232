"""The Dagster code location: one Definitions that loads, its groups and checks, and the reallocation sensor."""

from __future__ import annotations

import dagster as dg
import pytest

from assets.automation import reallocation_sensor
from coral_dagster.catalog.scenarios import load_scenario, scenario_names
from coral_dagster.catalog.store import append_snapshot
from coral_dagster.definitions import defs
from coral_dagster.app.rounds import store_demand
from coral_dagster.store import Store
from resources import CoralDuckDB, SolverSettings

GROUPS = {"catalog", "market", "profiling", "templates", "planning", "simulation", "deployment"}


def test_definitions_load_with_every_group_check_job_schedule_and_sensor():
    repo = defs.get_repository_def()
    groups = {node.group_name for node in repo.asset_graph.asset_nodes}
    assert groups == GROUPS
    checks = {k.name for k in repo.asset_graph.asset_check_keys}
    assert {"snapshot_is_sane", "layer_splits_sum_to_layers", "plan_meets_demand",
            "slo_attainment_meets_target"} <= checks
    assert {s.name for s in repo.schedule_defs} == {"refresh_inputs_every_6_min", "replan_every_6_min"}
    assert repo.get_schedule_def("replan_every_6_min").cron_schedule == "3-59/6 * * * *"
    assert [s.name for s in repo.sensor_defs] == ["reallocation_sensor"]


def test_template_partitions_are_exactly_the_scenario_model_pairs():
    """No partition without templates to build: the keys are the bundled scenarios' (scenario, model) pairs."""
    from assets.templates import template_partitions

    pairs = {(name, m.model) for name in scenario_names() for m in load_scenario(name).models}
    keys = template_partitions.get_partition_keys()
    assert len(keys) == len(pairs) and {tuple(k.split("/", 1)) for k in keys} == pairs


def test_checks_that_gate_deployment_are_blocking_and_upstream_of_it():
    graph = defs.get_repository_def().asset_graph
    gating = {"plan_meets_demand": "allocation_plan", "slo_attainment_meets_target": "plan_simulation"}
    for check, asset in gating.items():
        spec = graph.get_check_spec(dg.AssetCheckKey(dg.AssetKey(asset), check))
        assert spec.blocking, check
        assert dg.AssetKey(asset) in graph.get(dg.AssetKey("deployment_specs")).parent_keys


def _context(path, cursor=None):
    return dg.build_sensor_context(cursor=cursor, resources={"duckdb": CoralDuckDB(database=str(path)),
                                                             "solver": SolverSettings()})


def test_sensor_skips_until_inputs_exist_then_requests_one_run_per_new_input(tmp_path):
    path = tmp_path / "c.duckdb"
    first = reallocation_sensor(_context(path))
    assert isinstance(first, dg.SkipReason) and "cannot evaluate yet" in first.skip_message

    store, scenario = Store(path), load_scenario("core")
    append_snapshot(store, scenario.market())
    store_demand(store, scenario, {m.model: m.rate_req_s for m in scenario.models}, "uniform")
    ctx = _context(path)
    request = reallocation_sensor(ctx)
    assert isinstance(request, dg.RunRequest)
    assert request.run_key.startswith("replan:core-") and "no plan yet" in request.tags["coral/reasons"]
    replan = defs.resolve_job_def("replan")
    assert dg.validate_run_config(replan, request.run_config)
    assert request.tags["coral/scenario"] == "core" and defs.resources["scenario"].name == "core"
    assert request.run_config["resources"]["scenario"]["config"]["name"] == "core"

    again = reallocation_sensor(_context(path, cursor=ctx.cursor))
    assert isinstance(again, dg.SkipReason) and "already evaluated" in again.skip_message

    store_demand(store, scenario, {m.model: 2 * m.rate_req_s for m in scenario.models}, "uniform")
    fresh = reallocation_sensor(_context(path, cursor=ctx.cursor))
    assert isinstance(fresh, dg.RunRequest) and fresh.run_key != request.run_key


def test_dagster_cli_validates_the_workspace(tmp_path):
    """`dagster definitions validate` from the repository root, as a user would run it."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    dagster = Path(sys.executable).with_name("dagster")
    env = {**os.environ, "DAGSTER_HOME": str(tmp_path), "CORAL_DB": str(tmp_path / "c.duckdb")}
    out = subprocess.run([str(dagster), "definitions", "validate", "-w", "workspace.yaml"], cwd=root, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "All code locations passed validation" in out.stdout + out.stderr


def test_coral_run_records_into_the_project_dagster_home_by_default_which_git_ignores(monkeypatch):
    import subprocess

    from coral_dagster.definitions import dagster_home
    from coral_dagster.paths import REPO_ROOT

    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    assert dagster_home() == (REPO_ROOT / ".dagster").resolve()
    ignored = subprocess.run(["git", "check-ignore", "-q", str(dagster_home() / "dagster.yaml")], cwd=REPO_ROOT)
    assert ignored.returncode == 0
    monkeypatch.setenv("DAGSTER_HOME", str(REPO_ROOT / "elsewhere"))
    assert dagster_home() == REPO_ROOT / "elsewhere"


def test_the_scenario_is_one_resource_and_no_asset_config_names_it():
    """Which scenario a run plans for is the `scenario` resource alone: no asset's config has a scenario field."""
    graph = defs.get_repository_def().asset_graph
    configured = {node.key.to_user_string(): set(getattr(node.assets_def.op.config_field.config_type, "fields", {}))
                  for node in graph.asset_nodes if node.assets_def.op.config_field is not None}
    assert {"allocation_plan", "plan_simulation", "demand", "market_snapshot"} <= set(configured)
    assert {name for name, fields in configured.items() if "scenario" in fields} == set()


def test_the_replan_job_is_limited_to_one_run_in_progress(tmp_path):
    """The instance `coral run` creates limits runs carrying the replan job's tag to one; the job carries it."""
    from assets.automation import REPLAN_TAG
    from coral_dagster.definitions import INSTANCE_YAML

    (tmp_path / "dagster.yaml").write_text(INSTANCE_YAML)
    with dg.DagsterInstance.from_config(str(tmp_path)) as instance:
        limits = instance.get_concurrency_config().run_queue_config.tag_concurrency_limits
    (key, value), = REPLAN_TAG.items()
    assert [(lim["key"], lim.get("value"), lim["limit"]) for lim in limits] == [(key, value, 1)]
    assert defs.resolve_job_def("replan").tags.items() >= REPLAN_TAG.items()


def test_dg_loads_the_same_code_location_the_package_defines():
    """`dg check defs` passes and `dg list defs --json` lists what `coral_dagster.definitions.defs` holds."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    dg_cli = Path(sys.executable).parent / "dg"
    root = Path(__file__).resolve().parents[1]
    check = subprocess.run([str(dg_cli), "check", "defs"], cwd=root, capture_output=True, text=True, timeout=600)
    assert check.returncode == 0, check.stdout + check.stderr
    listed = json.loads(subprocess.run([str(dg_cli), "list", "defs", "--json"], cwd=root, capture_output=True,
                                       text=True, timeout=600, check=True).stdout)
    repo = defs.get_repository_def()
    keys = repo.asset_graph.get_all_asset_keys()
    assert {a["asset_key"] for a in listed["assets"]} == {k.to_user_string() for k in keys}
    assert {c["name"] for c in listed["asset_checks"]} == {k.name for k in repo.asset_graph.asset_check_keys}
    assert {j["name"] for j in listed["jobs"]} == {j.name for j in repo.get_all_jobs()
                                                   if not j.name.startswith("__")}
    assert {s["name"] for s in listed["sensors"]} == {s.name for s in repo.sensor_defs}
    assert {s["name"] for s in listed["schedules"]} == {s.name for s in repo.schedule_defs}


def test_sensor_estimates_savings_only_when_nothing_else_asks_for_a_replan(tmp_path, monkeypatch, small_store):
    """With the plan meeting demand the sensor prices a candidate plan (one solve); demand beyond what the plan
    serves (read off the plan itself) requests a re-plan at once, naming the shortfall, with no solve; inputs already
    evaluated read nothing past the snapshot and demand ids."""
    import assets.automation as automation
    from coral_dagster.allocation import methods
    from coral_dagster.app.rounds import plan_round
    from coral_dagster.templates import library

    path, db = small_store
    monkeypatch.setattr(automation, "SENSOR_SCENARIO", str(path))
    store, scenario = Store(db), load_scenario(path)
    append_snapshot(store, scenario.market())
    store_demand(store, scenario, {m.model: m.rate_req_s for m in scenario.models}, "uniform")
    plan = plan_round(store, scenario, "coral", time_limit_s=20).plan
    solves = []
    real = methods.make_plan
    monkeypatch.setattr(methods, "make_plan", lambda *a, **k: solves.append(1) or real(*a, **k))

    steady = reallocation_sensor(_context(db))
    assert isinstance(steady, dg.SkipReason) and "plan still right" in steady.skip_message and len(solves) == 1

    store_demand(store, scenario, {m.model: 3 * m.rate_req_s for m in scenario.models}, "uniform")
    ctx = _context(db)
    short = reallocation_sensor(ctx)
    assert isinstance(short, dg.RunRequest) and len(solves) == 1
    served = dict(plan.served_tokens_per_s)
    reasons = short.tags["coral/reasons"].split("; ")
    assert reasons and all(r.startswith(tuple(f"{m} {p}: serves {have:,.0f} of " for (m, p), have in served.items()))
                           for r in reasons)

    monkeypatch.setattr(library, "load_library", lambda *a, **k: pytest.fail("read the library again"))
    again = reallocation_sensor(_context(db, cursor=ctx.cursor))
    assert isinstance(again, dg.SkipReason) and "already evaluated" in again.skip_message and len(solves) == 1
