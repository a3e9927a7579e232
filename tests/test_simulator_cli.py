"""`coral simulate`: a stored plan, a plan file and errors, through the click command."""

from __future__ import annotations

import json

from click.testing import CliRunner

from coral_dagster.allocation.codec import plan_to_doc
from coral_dagster.allocation.storage import store_plan
from coral_dagster.allocation.types import Plan, PlannedInstance
from coral_dagster.catalog.nodes import NodeConfig, NodeMultiset
from coral_dagster.catalog.scenarios import load_scenario
from coral_dagster.cli.simulate import cli
from coral_dagster.store import Store
from coral_dagster.templates.types import Stage, Template

L40S = NodeConfig.parse("L40S:1")
L4 = NodeConfig.parse("L4:1")


def small_plan() -> Plan:
    """Phi-4 in core: a two-stage prefill pipeline and two one-node decode instances."""
    pre = Template("phi-4", "prefill", 1200.0, NodeMultiset.of([L40S, L40S]),
                   (Stage(0, 20, (L40S,), (1.0,)), Stage(20, 40, (L40S,), (1.0,))), 9000.0, "compute")
    dec = Template("phi-4", "decode", 60.0, NodeMultiset.of([L40S]), (Stage(0, 40, (L40S,), (1.0,)),), 700.0,
                   "memory")
    instances = (PlannedInstance(pre, "aws:us-east-2", 1, 2.0), PlannedInstance(dec, "aws:us-east-2", 2, 1.0))
    return Plan("core", "coral", "optimal", 4.0, 4.0, 0.0, 0.1, instances,
                {("phi-4", "prefill"): 1.0, ("phi-4", "decode"): 1.0},
                {("phi-4", "prefill"): 9000.0, ("phi-4", "decode"): 1400.0},
                scenario_key=load_scenario("core").scenario_key)


def _run(args):
    return CliRunner().invoke(cli, args, catch_exceptions=False)


def test_stored_plan_by_latest_and_by_file(tmp_path):
    db = tmp_path / "coral.duckdb"
    plan_id = store_plan(Store(db), small_plan(), "test-run", {}).plan_id
    common = ["--scenario", "core", "--duration-s", "60", "--trace", "poisson", "--rate-scale", "0.3",
              "--db", str(db), "--json"]
    latest = _run(["--plan", "latest", *common])
    assert latest.exit_code == 0, latest.output
    doc = json.loads(latest.output)
    models = {m["model"]: m for m in doc["models"]}
    assert set(models) == {"qwen3-32b", "gpt-oss-20b", "phi-4"}
    # Only phi-4 has instances: the other models' requests are unroutable, phi-4's are served.
    assert models["qwen3-32b"]["attainment"] == 0.0 and models["qwen3-32b"]["completed"] == 0
    assert models["phi-4"]["completed"] == models["phi-4"]["arrivals"] > 0
    assert doc["counts"]["no-instance"] == models["qwen3-32b"]["arrivals"] + models["gpt-oss-20b"]["arrivals"]
    assert doc["cost_usd_per_hour"] == 4.0
    assert doc["served_requests_per_s"] == doc["counts"]["completed"] / 60
    assert 0 < doc["end_s"] <= 60 + 600  # the arrival window plus at most the drain limit
    phi = models["phi-4"]
    assert phi["served_requests_per_s"] == phi["completed"] / 60
    assert 0 <= phi["queue_p50_ms"] <= phi["queue_p99_ms"] and phi["decode_queue_mean_ms"] >= 0
    # The file `coral plan --json` prints (plan_id plus instances without stages) resolves through the store.
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps({"plan_id": plan_id, **plan_to_doc(small_plan())}))
    by_file = json.loads(_run(["--plan", str(plan_file), *common]).output)
    assert by_file["models"] == doc["models"]


def test_plan_file_with_stages_and_plots(tmp_path):
    rows = []
    for i in small_plan().instances:
        t = i.template
        rows.append({"model": t.model, "phase": t.phase, "region": i.region, "count": i.count,
                     "tokens_per_s": t.tokens_per_s * i.count, "usd_per_hour": i.usd_per_hour * i.count,
                     "slo_ms": t.slo_ms,
                     "stages": [{"start": s.start, "end": s.end, "nodes": [str(n) for n in s.nodes],
                                 "shares": list(s.shares)} for s in t.stages]})
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps({"scenario": "core", "method": "coral", "instances": rows}))
    out = _run(["--plan", str(plan_file), "--scenario", "core", "--duration-s", "30", "--trace", "gamma",
                "--rate-scale", "0.3", "--plots", str(tmp_path / "png"), "--json"])
    doc = json.loads(out.output)
    assert doc["cost_usd_per_hour"] == 4.0 and doc["arrivals"].startswith("gamma")
    assert (tmp_path / "png" / "latency_cdf.png").stat().st_size > 0
    assert (tmp_path / "png" / "goodput.png").stat().st_size > 0
    table = _run(["--plan", str(plan_file), "--scenario", "core", "--duration-s", "20", "--rate-scale", "0.3"])
    assert "attainment" in table.output and "phi-4" in table.output


def test_errors_say_what_to_fix(tmp_path):
    missing = CliRunner().invoke(cli, ["--plan", str(tmp_path / "nope.json")])
    assert missing.exit_code != 0 and "does not exist" in str(missing.exception)
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"instances": [{"model": "phi-4"}]}))
    res = CliRunner().invoke(cli, ["--plan", str(bare)])
    assert "without their stages" in str(res.exception)
