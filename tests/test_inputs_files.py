"""Plan JSON files (`simulate`/`launch --plan FILE`) and price files (`--prices FILE`) checked where they enter."""

from __future__ import annotations

import json
import os

import pandas as pd
import pytest
from click.testing import CliRunner
from support.scenario_docs import copy_small

from coral_dagster.catalog.nodes import NodeMultiset
from coral_dagster.cli.main import main

# Our own prices for every node configuration SMALL uses (made-up numbers, far from the bundled ones).
PRICES = {"L40S:1": 7.0, "L40S:4": 20.0, "L4:1": 0.5, "L4:4": 1.9}


def _json(res) -> dict:
    assert res.exit_code == 0, res.output
    return json.loads(res.output[res.output.index("{"):])


@pytest.fixture(scope="module")
def setup(tmp_path_factory, small_library):
    """SMALL's file, its library in a DuckDB file, and one plan as `coral plan --json` prints it."""
    folder = tmp_path_factory.mktemp("files")
    scenario, db = copy_small(small_library, folder)
    plan = _json(CliRunner().invoke(main, ["plan", "--scenario", str(scenario), "--no-store", "--json", "--db",
                                           str(db), "--no-closed-loop"]))
    assert plan["instances"]
    return folder, scenario, db, plan


def _plan_file(folder, doc, name="plan.json"):
    path = folder / name
    path.write_text(json.dumps(doc) if not isinstance(doc, str) else doc)
    return path


def test_valid_plan_file_launches_its_instances(setup, tmp_path):
    folder, scenario, db, plan = setup
    path = _plan_file(tmp_path, plan)
    out = _json(CliRunner().invoke(main, ["launch", "--plan", str(path), "--dry-run", "--out", str(tmp_path / "d"),
                                          "--json", "--db", str(tmp_path / "state.duckdb")]))
    engines = sorted(a["node"] for a in out["actions"] if a["role"] == "engine")
    expected = sorted(str(n) for i in plan["instances"] for _ in range(i["count"])
                      for n in NodeMultiset.parse(i["nodes"]).nodes())
    assert engines == expected and out["plan_id"].startswith("file-")


def _broken(plan, change):
    doc = json.loads(json.dumps(plan))
    change(doc)
    return doc


BROKEN = [
    ("count zero", lambda d: d["instances"][0].update(count=0), "count"),
    ("count text", lambda d: d["instances"][0].update(count="2"), "count"),
    ("count bool", lambda d: d["instances"][0].update(count=True), "count"),
    ("negative $", lambda d: d["instances"][0].update(usd_per_hour=-1.0), "usd_per_hour"),
    ("zero tokens", lambda d: d["instances"][0].update(tokens_per_s=0), "tokens_per_s"),
    ("unknown model", lambda d: d["instances"][0].update(model="gpt-9"), "model"),
    ("bad phase", lambda d: d["instances"][0].update(phase="both"), "phase"),
    ("bad region", lambda d: d["instances"][0].update(region="mars"), "region"),
    ("layer gap", lambda d: d["instances"][0]["stages"][0].update(start=1), "start/end"),
    ("too few layers", lambda d: d["instances"][0]["stages"][-1].update(end=d["instances"][0]["stages"][-1]["end"] - 1),
     "stages"),
    ("bad node", lambda d: d["instances"][0]["stages"][0].update(nodes=["L40S"]), "nodes"),
    ("share above 1", lambda d: d["instances"][0]["stages"][0].update(shares=[1.5]), "shares"),
    ("no stages", lambda d: d["instances"][0].update(stages=[]), "stages"),
    ("cost text", lambda d: d.update(cost_usd_per_hour="cheap"), "cost_usd_per_hour"),
]


@pytest.mark.parametrize("command", ["simulate", "launch"])
@pytest.mark.parametrize("label,change,field", BROKEN, ids=[b[0] for b in BROKEN])
def test_broken_plan_file_names_file_field_and_fix(setup, tmp_path, command, label, change, field):
    folder, scenario, db, plan = setup
    path = _plan_file(tmp_path, _broken(plan, change))
    args = (["simulate", "--scenario", str(scenario), "--duration-s", "5"] if command == "simulate"
            else ["launch", "--dry-run", "--out", str(tmp_path / "d")])
    res = CliRunner().invoke(main, [*args, "--plan", str(path), "--db", str(db)])
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.output
    assert str(path) in res.output and f"'{field}'" in res.output and "Fix:" in res.output


@pytest.mark.parametrize("text", ['{"instances": [{"count": NaN}]}', '{"instances": Infinity}', "[1, 2]", "{",
                                  '{"instances": "all"}'])
def test_plan_file_that_is_not_a_plan(setup, tmp_path, text):
    folder, scenario, db, plan = setup
    path = _plan_file(tmp_path, text)
    res = CliRunner().invoke(main, ["simulate", "--scenario", str(scenario), "--plan", str(path), "--db", str(db)])
    assert res.exit_code == 2 and str(path) in res.output and "Fix:" in res.output


def _price_file(path, prices, region="aws:us-east-2"):
    rows = [{"region": region, "node": n, "instance_type": f"my-{n.replace(':', '-')}", "usd_per_hour": p,
             "spot_usd_per_hour": ""} for n, p in prices.items()]
    pd.DataFrame(rows).to_csv(path, index=False)
    return path


def test_prices_file_prices_the_plan(setup, tmp_path, monkeypatch):
    monkeypatch.setenv("CORAL_PRICES", "")  # the shell's $CORAL_PRICES would be --prices' default
    folder, scenario, db, plan = setup
    prices = _price_file(tmp_path / "p.csv", PRICES)
    out = _json(CliRunner().invoke(main, ["plan", "--scenario", str(scenario), "--no-store", "--json", "--db", str(db),
                                          "--prices", str(prices), "--no-closed-loop"]))
    # Oracle: each instance costs the sum of our prices over its nodes, and nothing else is priced.
    for i in out["instances"]:
        nodes = NodeMultiset.parse(i["nodes"])
        assert i["instance_usd_per_hour"] == pytest.approx(sum(PRICES[str(n)] * k for n, k in nodes.counts))
    assert out["cost_usd_per_hour"] == pytest.approx(sum(i["usd_per_hour"] for i in out["instances"]))
    shown = json.loads(CliRunner().invoke(main, ["catalog", "prices", "--json", "--prices", str(prices)]).output)
    assert {(r["node"], r["usd_per_hour"]) for r in shown} == set(PRICES.items())


@pytest.mark.parametrize("edit,column", [
    (lambda df: df.assign(usd_per_hour=["nan", "1", "2", "3"]), "usd_per_hour"),
    (lambda df: df.assign(usd_per_hour=["-1", "1", "2", "3"]), "usd_per_hour"),
    (lambda df: df.assign(spot_usd_per_hour=["99", "", "", ""]), "spot_usd_per_hour"),
    (lambda df: df.assign(region=["us-east-2"] * 4), "region"),
    (lambda df: df.assign(node=["L40S:3", "L40S:4", "L4:1", "L4:4"]), "node"),
    (lambda df: df.assign(node=["L4:1", "L4:1", "L4:2", "L4:4"]), "node"),
    (lambda df: df.drop(columns=["instance_type"]), "instance_type"),
])
def test_bad_prices_file_is_a_usage_error_naming_line_and_column(tmp_path, monkeypatch, edit, column):
    monkeypatch.setenv("CORAL_PRICES", "")
    path = _price_file(tmp_path / "p.csv", PRICES)
    edit(pd.read_csv(path, dtype=str, keep_default_na=False)).to_csv(path, index=False)
    res = CliRunner().invoke(main, ["catalog", "prices", "--prices", str(path)])
    assert res.exit_code == 2 and str(path) in res.output and f"'{column}'" in res.output, res.output
    assert "Traceback" not in res.output


def test_documented_price_example_is_a_valid_price_file(tmp_path, monkeypatch):
    from coral_dagster import paths

    text = (paths.REPO_ROOT / "docs" / "scenarios.md").read_text().split("```csv\n", 1)[1].split("```", 1)[0]
    path = tmp_path / "readme.csv"
    path.write_text(text)
    monkeypatch.setenv("CORAL_PRICES", str(path))
    from coral_dagster.catalog.prices import load_node_prices

    table = load_node_prices()
    assert len(table) == len(text.strip().splitlines()) - 1 and table.usd_per_hour.gt(0).all()


def _gpu_usd_per_hour(plan: dict, prices: dict[str, float]) -> float:
    """Oracle: what the plan's GPU nodes cost at `prices` ($/node-hour per node configuration), summed by hand."""
    return sum(prices[str(n)] * k * i["count"]
               for i in plan["instances"] for n, k in NodeMultiset.parse(i["nodes"]).counts)


def test_launch_prices_a_plan_file_from_the_price_file_it_is_given_without_touching_the_environment(
        setup, tmp_path, monkeypatch):
    monkeypatch.delenv("CORAL_PRICES", raising=False)
    folder, scenario, db, plan = setup
    path = _plan_file(tmp_path, plan)
    used = next(NodeMultiset.parse(plan["instances"][0]["nodes"]).nodes())
    dearer = {**PRICES, str(used): 2 * PRICES[str(used)]}
    before = dict(os.environ)
    costs = []
    for name, table in (("p.csv", PRICES), ("dearer.csv", dearer)):
        out = _json(CliRunner().invoke(main, ["launch", "--plan", str(path), "--dry-run", "--json", "--out",
                                              str(tmp_path / f"{name}.out"), "--db", str(tmp_path / f"{name}.duckdb"),
                                              "--prices", str(_price_file(tmp_path / name, table))]))
        assert dict(os.environ) == before  # the price file went in as an argument, not through the environment
        assert out["gpu_usd_per_hour"] == pytest.approx(_gpu_usd_per_hour(plan, table), abs=1e-3)
        assert {a["usd_per_hour"] for a in out["actions"] if a["node"]} <= set(table.values())
        costs.append(out["gpu_usd_per_hour"])
    assert costs[1] > costs[0]


def test_launch_reads_coral_prices_at_the_command_line_as_the_default(setup, tmp_path, monkeypatch):
    folder, scenario, db, plan = setup
    path = _plan_file(tmp_path, plan)
    monkeypatch.setenv("CORAL_PRICES", str(_price_file(tmp_path / "p.csv", PRICES)))
    out = _json(CliRunner().invoke(main, ["launch", "--plan", str(path), "--dry-run", "--json", "--out",
                                          str(tmp_path / "d"), "--db", str(tmp_path / "s.duckdb")]))
    assert out["gpu_usd_per_hour"] == pytest.approx(_gpu_usd_per_hour(plan, PRICES), abs=1e-3)
    monkeypatch.setenv("CORAL_PRICES", str(tmp_path / "missing.csv"))
    res = CliRunner().invoke(main, ["launch", "--plan", str(path), "--dry-run", "--out", str(tmp_path / "d")])
    assert res.exit_code == 2 and str(tmp_path / "missing.csv") in res.output and "Fix:" in res.output, res.output


def test_run_passes_its_price_file_to_the_pipeline_as_an_argument(tmp_path, monkeypatch):
    from coral_dagster import definitions
    from coral_dagster.errors import CoralError

    monkeypatch.delenv("CORAL_PRICES", raising=False)
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))
    asked = {}

    def stop(scenario, **kwargs):  # stands for the Dagster run, tested on its own below
        asked.update(kwargs)
        raise CoralError("stopped before the pipeline.", "nothing to fix")

    monkeypatch.setattr(definitions, "materialize_pipeline", stop)
    prices = _price_file(tmp_path / "p.csv", PRICES)
    before = dict(os.environ)
    res = CliRunner().invoke(main, ["run", "--prices", str(prices), "--db", str(tmp_path / "r.duckdb")])
    assert "stopped before the pipeline" in res.output, res.output
    assert asked["prices_path"] == str(prices.resolve()) and dict(os.environ) == before


def test_pipeline_catalogs_and_market_snapshot_hold_the_price_file_rows(setup, tmp_path, monkeypatch):
    import dagster as dg

    from assets.catalog import catalogs
    from assets.market import market_snapshot
    from coral_dagster.store.duck import Store
    from resources import BundledMarketFeed, CoralDuckDB, CoralScenario

    monkeypatch.delenv("CORAL_PRICES", raising=False)
    folder, scenario, db, plan = setup
    prices = _price_file(tmp_path / "p.csv", PRICES)
    store = tmp_path / "pipeline.duckdb"
    result = dg.materialize([catalogs, market_snapshot], resources={
        "duckdb": CoralDuckDB(database=str(store)), "scenario": CoralScenario(name=str(scenario)),
        "market": BundledMarketFeed(prices_file=str(prices))})
    assert result.success
    snap = Store(store).query("SELECT node, instance_type, usd_per_hour FROM market_snapshots")
    assert {(r.node, r.usd_per_hour) for r in snap.itertuples()} == set(PRICES.items())
    assert snap.instance_type.str.startswith("my-").all()
    listed = Store(store).query("SELECT node, usd_per_hour FROM catalog_prices")
    assert {(r.node, r.usd_per_hour) for r in listed.itertuples()} == set(PRICES.items())


def test_bench_allocation_prices_every_method_from_its_price_file(setup, tmp_path, monkeypatch):
    monkeypatch.delenv("CORAL_PRICES", raising=False)
    folder, scenario, db, plan = setup
    before = dict(os.environ)
    costs = []
    for name, scale in (("p.csv", 1.0), ("double.csv", 2.0)):
        prices = _price_file(tmp_path / name, {n: p * scale for n, p in PRICES.items()})
        doc = _json(CliRunner().invoke(main, ["bench", "allocation", "--scenarios", str(scenario), "--settings",
                                              "default", "--no-helix", "--sim-duration-s", "0", "--prices",
                                              str(prices), "--db", str(db), "--json"]))
        assert dict(os.environ) == before and doc["config"]["prices"] == str(prices)
        costs.append({r["method"]: r["cost_usd_per_hour"] for r in doc["rows"]})
    # Oracle: doubling every price keeps each method's choice and doubles its cost, which the bundled prices (the
    # same in both runs) could not do.
    assert costs[0] and costs[1] == pytest.approx({m: 2 * c for m, c in costs[0].items()})
