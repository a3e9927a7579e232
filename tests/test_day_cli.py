"""`coral day --json`: the documented keys, the day stored in `day_runs` and `day_windows`, a timeline plot, and a
clear error for a bad argument."""

from __future__ import annotations

import json

import duckdb
import pytest
import yaml
from click.testing import CliRunner

from support.scenario_docs import small

from coral_dagster.cli.main import main


@pytest.mark.slow  # builds the small library, then two windows: ~15 s idle
def test_day_json_keys_store_and_plot(tmp_path):
    scenario, db, png = tmp_path / "s.yml", tmp_path / "c.duckdb", tmp_path / "day.png"
    scenario.write_text(yaml.safe_dump(small(day={"hourly": [1.0] * 24, "bursts": False})))
    res = CliRunner().invoke(main, ["day", "--scenario", str(scenario), "--hours", "0.2", "--db", str(db),
                                    "--plot", str(png), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output[res.output.index("{"):])
    assert doc["replan_interval_min"] == 6.0 and len(doc["windows"]) == 2
    for key in ("window", "replan_s", "worst_attainment", "served_share", "cost_usd", "nodes_launched",
                "nodes_stopped", "nodes_failed", "mixed_share", "demand_tokens_per_s"):
        assert key in doc["windows"][0]
    assert doc["cost_usd"] == sum(w["cost_usd"] for w in doc["windows"])
    assert doc["usd_per_million_slo_tokens"] == doc["cost_usd"] / doc["slo_tokens"] * 1e6
    with duckdb.connect(str(db), read_only=True) as con:
        assert con.execute("SELECT count(*), max(method) FROM day_runs").fetchone() == (1, "coral")
        assert con.execute("SELECT count(*) FROM day_windows").fetchone() == (2,)
    assert png.read_bytes()[:4] == b"\x89PNG"
    # On spot the same day pays less: every node small uses sells on spot below its on-demand price, so the spot
    # plan costs at most the on-demand plan at spot prices, which is less than that plan on demand.
    res = CliRunner().invoke(main, ["day", "--scenario", str(scenario), "--hours", "0.2", "--db", str(db), "--spot",
                                    "--json"])
    assert res.exit_code == 0, res.output
    spot = json.loads(res.output[res.output.index("{"):])
    assert "nodes_preempted" in spot and "nodes_preempted" in spot["windows"][0]
    assert spot["cost_usd"] < doc["cost_usd"]
    with duckdb.connect(str(db), read_only=True) as con:
        assert con.execute("SELECT list(spot ORDER BY created_at) FROM day_runs").fetchone() == ([False, True],)


def test_day_refuses_an_unknown_method():
    res = CliRunner().invoke(main, ["day", "--method", "fastest"])
    assert res.exit_code == 2 and "fastest" in res.output
