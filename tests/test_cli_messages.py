"""Mistakes an operator makes get one sentence that points the right way, never a traceback: Dagster's home and
configuration for `coral run`, a scenario file given to `coral run`, ports past 65535, `--stage-nodes`, an SLO no
GPU of the scenario can meet, and a DuckDB file on a full disk."""

from __future__ import annotations

import yaml
from click.testing import CliRunner
from support.scenario_docs import small

from coral_dagster.catalog.gpus import get_gpu
from coral_dagster.catalog.models import get_model
from coral_dagster.cli.main import main


def _one_sentence(res, *words: str) -> str:
    """Exit status 2 and one error line with the fix, naming `words`; no traceback."""
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.output
    assert "Traceback" not in res.output, res.output
    lines = [line for line in res.output.splitlines()
             if line.strip() and not line.startswith(("Usage:", "Try ")) and "multiset/s" not in line]  # progress
    assert len(lines) == 1, res.output
    assert all(w in lines[0] for w in words), lines[0]
    return lines[0]


def test_a_dagster_home_that_is_a_file_is_named_before_any_work(tmp_path):
    home = tmp_path / "home"
    home.write_text("not a folder")
    res = CliRunner(env={"DAGSTER_HOME": str(home)}).invoke(main, ["run", "--db", str(tmp_path / "c.duckdb")])
    line = _one_sentence(res, f"DAGSTER_HOME {home} is not a folder", "Fix: point DAGSTER_HOME at a folder")
    assert "materialize" not in res.output and not (tmp_path / "c.duckdb").exists(), line


def test_a_dagster_yaml_dagster_cannot_read_is_named_with_its_fault(tmp_path):
    """Broken YAML (the line is named) and YAML Dagster refuses (its first complaint is quoted) both name the file
    and say to correct or delete it."""
    for text, fault in (("telemetry: [unclosed\n", "line 2"),
                        ("storage: {nope: 1}\n", 'unexpected config entry "nope"')):
        home = tmp_path / f"home-{len(text)}"
        home.mkdir()
        (home / "dagster.yaml").write_text(text)
        res = CliRunner(env={"DAGSTER_HOME": str(home)}).invoke(main, ["run", "--db", str(tmp_path / "c.duckdb")])
        _one_sentence(res, str(home / "dagster.yaml"), fault, "Fix: correct or delete that file")
        assert "materialize" not in res.output


def test_coral_run_help_and_behaviour_agree_on_scenario_files(tmp_path):
    """`coral run` runs the bundled scenarios only (its library is partitioned by their models): the help says so
    and names the commands that take a file, and a file is refused at once, pointing at those commands."""
    help_text = " ".join(CliRunner().invoke(main, ["run", "--help"]).output.split())
    assert "Bundled scenario to run: core, core-uniform, extended, helix or mega" in help_text
    assert "path of a scenario file" not in help_text and "coral plan --scenario FILE" in help_text
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(small()))
    res = CliRunner().invoke(main, ["run", "--scenario", str(path), "--db", str(tmp_path / "c.duckdb")])
    assert res.exit_code == 2 and "not a bundled scenario" in res.output and "coral templates build" in res.output
    assert "Traceback" not in res.output and not (tmp_path / "c.duckdb").exists()


def test_a_port_past_65535_is_refused_by_name():
    for args, option in ((["serve", "local", "--port", "70000"], "--port"),
                         (["serve", "coordinator", "--http-port", "65536"], "--http-port"),
                         (["serve", "engine", "--vllm-port", "99999"], "--vllm-port")):
        res = CliRunner().invoke(main, args)
        assert res.exit_code == 2 and f"Invalid value for '{option}'" in res.output and "65535" in res.output, \
            res.output


def test_a_stage_nodes_mistake_names_stage_nodes_not_the_layer_split(tmp_path):
    for value in ("0,1,1", "1,x,1", "two"):
        res = CliRunner().invoke(main, ["serve", "local", "--stage-nodes", value, "--log-dir", str(tmp_path)])
        line = _one_sentence(res, f"--stage-nodes {value!r}", "node counts", "one per stage of --split")
        assert "layer" not in line.split(" Fix: ")[0]
    assert list(tmp_path.iterdir()) == []  # nothing was started


def test_an_slo_no_gpu_of_the_scenario_can_meet_says_to_change_the_slo(tmp_path):
    """phi-4 on one L40S:1 node: every decode step reads all its weights from HBM, so no template can
    take under weights / bandwidth (about 34 ms, the oracle below); a 5 ms decode SLO is named, with the fix to
    raise it or add faster GPUs, not to raise availability or plan under scarcity."""
    model, gpu = get_model("phi-4"), get_gpu("L40S")
    floor_ms = model.published_params * 1e9 * 2 / (gpu.hbm_gb_s * 1e9) * 1e3
    assert floor_ms > 25
    doc = small(gpus=["L40S"], gpus_per_node=[1], templates={"n_max": 1, "rho": 12})
    doc["models"][0]["decode_slo_ms"] = 5
    path = tmp_path / "tight.yaml"
    path.write_text(yaml.safe_dump(doc))
    res = CliRunner().invoke(main, ["plan", "--scenario", str(path), "--db", str(tmp_path / "c.duckdb"),
                                    "--no-store", "--no-closed-loop"])
    line = _one_sentence(res, "no template on the scenario's nodes meets the SLO of phi-4 decode (decode_slo_ms)",
                         "no availability can meet", "Fix: raise that SLO in the scenario file, or add faster GPUs")
    assert "availability-scale" not in line and "scarcity" not in line


def test_a_full_disk_under_the_store_says_so(tmp_path):
    """DuckDB's own words for a write on a full disk (as it raised them on 2026-12-06 on a 300 KiB tmpfs) become
    'the disk is full' with the fix to free space or move the file, not 'the file is broken'."""
    import duckdb

    from coral_dagster.store.duck import explain

    path = tmp_path / "c.duckdb"
    for exc in (duckdb.IOException(f'IO Error: Could not write file "{path}": No space left on device'),
                duckdb.TransactionException(f'TransactionContext Error: Failed to commit: Could not write file '
                                            f'"{path}.wal": No space left on device')):
        text = str(explain(exc, path))
        assert f"the disk holding DuckDB file {path} is full" in text and "Fix: free space on that disk" in text
        assert "broken" not in text and "bug" not in text
