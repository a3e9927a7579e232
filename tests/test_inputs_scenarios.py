"""Scenario files checked where they enter: every field, any file name, and libraries keyed by what they depend on."""

from __future__ import annotations

import dataclasses
import json

import pytest
import yaml
from click.testing import CliRunner
from support.scenario_docs import SMALL, small, with_field

from coral_dagster import paths
from coral_dagster.catalog.scenarios import load_scenario
from coral_dagster.cli.main import main
from coral_dagster.errors import CatalogError, CoralError
from coral_dagster.store import Store
from coral_dagster.templates.library import load_library, store_library

CORE = yaml.safe_load((paths.SCENARIOS_DIR / "core.yaml").read_text())
SMALL_RATE = SMALL["models"][0]["rate_req_s"]

def _write(tmp_path, doc, name="s.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc))
    return path


BAD = [
    ("models.0.rate_req_s", float("nan"), "rate_req_s"),
    ("models.0.rate_req_s", float("inf"), "rate_req_s"),
    ("models.0.rate_req_s", 0, "rate_req_s"),
    ("models.0.prefill_slo_ms", -1, "prefill_slo_ms"),
    ("models.0.decode_slo_ms", float("nan"), "decode_slo_ms"),
    ("models.0.decode_slo_ms", True, "decode_slo_ms"),
    ("models.0.ratereqs", 3, "ratereqs"),
    ("models", [], "models"),
    ("allocation.headroom", 0, "headroom"),
    ("allocation.headroom", float("nan"), "headroom"),
    ("allocation.replan_interval_min", 0, "replan_interval_min"),
    ("allocation.node_startup_min", -5, "node_startup_min"),
    ("templates.n_max", 0, "n_max"),
    ("templates.n_max", 99, "n_max"),
    ("templates.n_max", 2.5, "n_max"),
    ("templates.rho", 0.5, "rho"),
    ("templates.rho", float("inf"), "rho"),
    ("templates.slo_margin", 0, "slo_margin"),
    ("templates.nmax", 6, "nmax"),
    ("link_gbps", 0, "link_gbps"),
    ("link_gbps", float("nan"), "link_gbps"),
    ("availability.default_nodes", -1, "default_nodes"),
    ("availability.default_nodes", 1.5, "default_nodes"),
    ("availability.nodes", {"aws:us-east-2": {"H100:8": 3}}, "aws:us-east-2/H100:8"),
    ("availability.nodes", {"aws:us-east-2": {"L4:1": -2}}, "L4:1"),
    ("regions", ["us-east-2"], "regions"),
    ("regions", ["aws:us-east-2", "aws:us-east-2"], "regions"),
    ("gpus_per_node", [], "gpus_per_node"),
    ("gpus_per_node", [3], "gpus_per_node"),
    ("name", "", "name"),
    ("name", "../../etc", "name"),
    ("name", ..., "name"),
    ("allocation", [1], "allocation"),
    ("colour", "blue", "colour"),
]


@pytest.mark.parametrize("dotted,value,field", BAD, ids=[f"{d}={v!r}" for d, v, _ in BAD])
def test_bad_field_names_file_field_value_and_fix(tmp_path, dotted, value, field):
    path = _write(tmp_path, with_field(CORE, dotted, value))
    with pytest.raises(CatalogError) as err:
        load_scenario(path)
    text = str(err.value)
    assert err.value.field == field and str(path) in text and "Fix:" in text


def test_bad_cli_scenario_is_one_line_not_a_traceback(tmp_path):
    path = _write(tmp_path, with_field(CORE, "allocation.headroom", 0))
    res = CliRunner().invoke(main, ["plan", "--scenario", str(path), "--no-store", "--db", str(tmp_path / "c.db")])
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit)
    assert "headroom" in res.output and "Fix:" in res.output and "Traceback" not in res.output


def test_region_that_sells_nothing_is_named(tmp_path):
    scn = load_scenario(_write(tmp_path, with_field(CORE, "regions", ["aws:us-east-2", "aws:mars-north-1"])))
    with pytest.raises(CoralError, match="aws:mars-north-1"):
        scn.market()


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -1.0])
def test_market_refuses_non_finite_availability_scale(scale):
    with pytest.raises(CoralError, match="availability scale"):
        load_scenario("core").market(availability_scale=scale)


@pytest.mark.parametrize("name", ["my scenario.yml", "x.yaml", "plain-file"])
def test_any_file_name_and_yml(tmp_path, name):
    path = _write(tmp_path, with_field(CORE, "name", "mine"), name)
    scn = load_scenario(str(path))
    assert scn.name == "mine" and scn.models == load_scenario("core").models


def test_edited_file_is_read_again(tmp_path):
    path = _write(tmp_path, CORE)
    assert load_scenario(path).headroom == 1.1
    path.write_text(yaml.safe_dump(with_field(CORE, "allocation.headroom", 1.5)))
    assert load_scenario(path).headroom == 1.5


TEMPLATE_FIELDS = [("models.0.prefill_slo_ms", 1700), ("models.0.decode_slo_ms", 90),
                   ("models.0.trace", "azure-code"), ("templates.n_max", 5), ("templates.rho", 10),
                   ("templates.slo_margin", 0.8), ("link_gbps", 25), ("gpus", ["L40S", "L4"]),
                   ("gpus_per_node", [1, 2, 4])]
PLAN_FIELDS = [("models.0.rate_req_s", 99), ("allocation.headroom", 2), ("regions", ["aws:us-east-2"]),
               ("availability.base_nodes", 3), ("availability.series", {"window_min": 5, "multipliers": [1, 0]}),
               ("name", "renamed"), ("description", "other words")]


@pytest.mark.parametrize("dotted,value", TEMPLATE_FIELDS + PLAN_FIELDS)
def test_library_key_changes_exactly_with_template_settings(tmp_path, dotted, value):
    # The oracle: what `workload_for`, `build_tables` and `enumerate_multisets` read (coral.md §2) changes
    # the key; rates, headroom, regions, availability and names do not (templates are region- and demand-free).
    base = load_scenario("core")
    changed = load_scenario(_write(tmp_path, with_field(CORE, dotted, value)))
    assert (changed.library_key != base.library_key) == ((dotted, value) in TEMPLATE_FIELDS)


def test_user_file_named_like_a_bundled_scenario_keeps_its_own_library(tmp_path):
    db = tmp_path / "c.duckdb"
    store = Store(db)
    core, mine = load_scenario("core"), _write(tmp_path, small(name="core"), "my.yaml")
    user = load_scenario(mine)
    assert user.name == core.name and user.library_key != core.library_key
    # Stand-in for core's library: a distinct set of templates stored under core's key.
    from coral_dagster.templates.library import build_library

    stand_in = build_library(dataclasses.replace(user, n_max=2), processes=1)
    store_library(store, stand_in, "core")
    res = CliRunner().invoke(main, ["templates", "build", "--scenario", str(mine), "--db", str(db), "--json",
                                    "--processes", "1"])
    assert res.exit_code == 0, res.output
    built = json.loads(res.output[res.output.index("{"):])
    assert built["library_key"] == user.library_key and built["templates"] > 0
    assert load_library(store, "core") == sorted(stand_in, key=lambda t: t.template_id)  # untouched
    assert len(load_library(store, user)) == built["templates"] != len(stand_in)
    # The same file with --n-max is a third library; neither earlier one is replaced.
    res = CliRunner().invoke(main, ["templates", "build", "--scenario", str(mine), "--db", str(db), "--n-max", "2",
                                    "--processes", "1", "--json"])
    assert res.exit_code == 0, res.output
    assert len(load_library(store, user)) == built["templates"]
    assert load_library(store, dataclasses.replace(user, n_max=2)) == sorted(stand_in, key=lambda t: t.template_id)


def test_scenario_help_says_what_each_command_accepts():
    """Step-by-step commands take scenario files; `coral run` (whose pipeline is partitioned by the bundled
    scenarios' models) says it takes a bundled scenario, and refuses a file with the commands that take one."""
    for args in (["plan"], ["simulate"], ["templates", "build"], ["templates", "list"], ["templates", "best"]):
        res = CliRunner().invoke(main, [*args, "--help"])
        assert res.exit_code == 0 and ".yml" in res.output, args
    res = CliRunner().invoke(main, ["run", "--help"])
    assert res.exit_code == 0 and "Bundled scenario" in res.output and "--scenario FILE" in res.output


def test_two_files_of_one_name_keep_their_own_plans_and_snapshots(tmp_path):
    """Two files both named `core` (the bundled name) that differ only in one model's rate share a library (rates
    are not template settings) but never a plan, a demand or a market snapshot; each plan's scenario is its file."""
    from coral_dagster.app.plans import find_plan, latest_plan, scenario_of
    from coral_dagster.app.rounds import latest_demand, store_demand
    from coral_dagster.catalog.store import append_snapshot, latest_snapshot

    db = tmp_path / "c.duckdb"
    one = _write(tmp_path, small(name="core"), "one.yaml")
    two = _write(tmp_path, with_field(small(name="core"), "models.0.rate_req_s", SMALL_RATE / 2), "two.yml")
    a, b = load_scenario(one), load_scenario(two)
    assert a.library_key == b.library_key and a.scenario_key != b.scenario_key != load_scenario("core").scenario_key
    run = lambda *args: CliRunner().invoke(main, [*args, "--db", str(db), "--json"])  # noqa: E731
    assert run("templates", "build", "--scenario", str(one), "--processes", "1").exit_code == 0
    plans = {}
    for path in (one, two):
        res = run("plan", "--scenario", str(path), "--no-closed-loop")  # files and keys, not the loop
        assert res.exit_code == 0, res.output
        plans[path] = json.loads(res.output)
    store = Store(db)
    pa, pb = latest_plan(store, a), latest_plan(store, b)
    assert (pa.plan_id, pb.plan_id) == (plans[one]["plan_id"], plans[two]["plan_id"])
    assert find_plan(store, "core") is None  # the bundled core has no plan here
    # Each plan was sized from its own file: demand over its capacity factor is rate × the trace's mean tokens.
    key = ("phi-4", "decode")
    per_rate = [p.demand_tokens_per_s[key] / p.admission.capacity_factors[key] / s.models[0].rate_req_s
                for p, s in ((pa, a), (pb, b))]
    assert per_rate[0] == pytest.approx(per_rate[1])
    assert scenario_of(store, pa).path == str(one.resolve()) and scenario_of(store, pb).path == str(two.resolve())
    # Snapshots of either file are found by its own key only.
    for scn, rate in ((a, 1.0), (b, 5.0)):
        append_snapshot(store, scn.market(availability_scale=rate))
        store_demand(store, scn, {"phi-4": rate}, "uniform")
    assert [latest_snapshot(store, s).snapshot_id[-3:] for s in (a, b)] == ["-x1", "-x5"]
    assert latest_demand(store, a)[1] == {"phi-4": 1.0} and latest_demand(store, b)[1] == {"phi-4": 5.0}
    # A plan named by id is simulated on the traffic of the file it was planned for (one model), not on the
    # default --scenario's (bundled core: three models).
    res = run("simulate", "--plan", pb.plan_id, "--duration-s", "30", "--trace", "poisson")
    assert res.exit_code == 0, res.output
    assert [m["model"] for m in json.loads(res.output)["models"]] == ["phi-4"]
    # A file edited after planning no longer answers for the plan: a sentence, not a silent other scenario.
    one.write_text(yaml.safe_dump(with_field(small(name="core"), "models.0.rate_req_s", SMALL_RATE / 4)))
    with pytest.raises(CoralError, match="other settings"):
        scenario_of(store, pa)
