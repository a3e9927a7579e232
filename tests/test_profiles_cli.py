"""`coral profile …` commands through the real `coral` group: JSON outputs, errors, and the profiling job."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import pytest
from click.testing import CliRunner

from coral_dagster.cli.main import main
from coral_dagster.cli.profile import cli as profile_cli
from coral_dagster.profiles import default_perf_model

ROOT = Path(__file__).resolve().parent.parent
if "profile" not in main.commands:
    main.add_command(profile_cli, "profile")


def _run(*args: str):
    result = CliRunner().invoke(main, ["profile", *args])
    return result


def _json(*args: str):
    result = _run(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_latency_prefill_and_decode_json_match_the_model():
    perf = default_perf_model()
    out = _json("latency", "--model", "qwen3-32b", "--node", "L40S:2", "--phase", "prefill", "--tokens", "2048")
    assert out["ms_per_layer"] == pytest.approx(perf.prefill_ms_per_layer("qwen3-32b", "L40S:2", 2048))
    assert out["source"] == "measured:aiconfigurator"
    out = _json("latency", "--model", "phi-4", "--node", "L4:1", "--phase", "decode", "--batch", "32",
                "--context", "1500")
    assert out["ms_per_layer"] == pytest.approx(perf.decode_ms_per_layer("phi-4", "L4:1", 32, 1500))
    assert out["source"] == "model:roofline-calibrated"


def test_throughput_json():
    out = _json("throughput", "--model", "llama-2-70b", "--node", "A100:1", "--phase", "decode", "--layers", "10",
                "--budget-ms", "40", "--context", "1300")
    expected = default_perf_model().t_hat("llama-2-70b", "A100:1", "decode", 10, 40.0, 1300)
    assert out["tokens_per_s"] == pytest.approx(expected.tokens_per_s)
    assert out["batch"] == expected.batch and out["bound"] == expected.bound
    assert out["max_layers"] >= 10


def test_show_json_lists_the_table():
    rows = _json("show", "--model", "gpt-oss-20b", "--node", "L4:1", "--node", "H100:1", "--phase", "decode")
    assert {r["node"] for r in rows} == {"L4:1", "H100:1"} and {r["phase"] for r in rows} == {"decode"}
    assert all(r["ms_per_layer"] > 0 for r in rows)


def test_unknown_names_exit_2_listing_valid_ones():
    bad_model = _run("latency", "--model", "gpt-5", "--node", "L4:1", "--phase", "prefill", "--tokens", "10")
    assert bad_model.exit_code == 2 and "qwen3-32b" in bad_model.output and "gpt-5" in bad_model.output
    bad_node = _run("throughput", "--model", "phi-4", "--node", "B300:1", "--phase", "decode", "--layers", "1",
                    "--budget-ms", "10")
    assert bad_node.exit_code == 2 and "L40S" in bad_node.output
    missing = _run("latency", "--model", "phi-4", "--node", "L4:1", "--phase", "decode", "--batch", "4")
    assert missing.exit_code == 2 and "--context" in missing.output


def test_profile_run_measures_on_cpu_and_stores(tmp_path):
    db = tmp_path / "p.duckdb"
    out = _json("run", "--model", "gpt-oss-20b", "--node", "L4:1", "--layers", "1", "--store", "--db", str(db))
    table, notes = out["table"], out["notes"]
    assert {r["phase"] for r in table} == {"prefill", "decode"}
    assert all(r["source"] == "measured:torch-cpu" and r["ms_per_layer"] > 0 for r in table)
    assert notes["hidden_scale"] < 1 and "hidden_scale" in notes["note"]
    assert notes["dims"]["n_experts"] == 16 and notes["dims"]["sliding"]
    with duckdb.connect(str(db), read_only=True) as con:
        stored = con.execute("SELECT count(*), min(source) FROM profiles_measured").fetchall()[0]
    assert stored == (len(table), "measured:torch-cpu")


def test_profile_run_rejects_vllm_on_cpu():
    result = _run("run", "--model", "phi-4", "--node", "L4:1", "--engine", "vllm")
    assert result.exit_code == 2 and "CUDA" in result.output


def test_sky_task_runs_the_same_command():
    """The SkyPilot task parses, is parameterised by envs, installs the project and vLLM (setup_node.sh), and runs
    `coral profile run` with those envs."""
    import sky

    task = sky.Task.from_yaml(str(ROOT / "sky_tasks" / "profile.yaml"))
    assert {"CORAL_MODEL", "CORAL_PROFILE_NODE", "CORAL_PROFILE_LAYERS", "CORAL_ENGINE", "CORAL_DEVICE"} <= set(
        task.envs)
    assert "bash sky_tasks/setup_node.sh" in task.setup and "pip install -e ." in task.setup
    assert 'coral profile run --model "${CORAL_MODEL}" --node "${CORAL_PROFILE_NODE}"' in task.run
    for flag in ("--layers", "--device", "--engine", "--out", "--json"):
        assert flag in task.run
    ctx = main.make_context("coral", ["profile", "run", "--model", "phi-4", "--node", "L4:1", "--layers", "2",
                                      "--device", "cuda", "--engine", "vllm", "--out", "x.csv", "--json"],
                            resilient_parsing=True)
    assert ctx.protected_args == ["profile"]


def test_store_scenario_profiles_replaces_only_that_scenario(tmp_path):
    from coral_dagster.profiles.store import store_scenario_profiles
    from coral_dagster.store import Store

    store = Store(tmp_path / "s.duckdb")
    helix = store_scenario_profiles(store, "helix")
    core = store_scenario_profiles(store, "core")
    again = store_scenario_profiles(store, "helix")
    counts = dict(store.query("SELECT scenario, count(*) AS n FROM profiles GROUP BY scenario").itertuples(
        index=False))
    assert counts == {"helix": len(again), "core": len(core)} and len(again) == len(helix)
    sources = set(store.query("SELECT DISTINCT source FROM profiles")["source"])
    assert {"measured:aiconfigurator", "model:roofline-calibrated"} <= sources
