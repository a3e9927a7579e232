"""Files the CLI writes (dry-run task YAMLs and launch.sh, bench results, plots, keys) never follow a symbolic link,
get the mode they document whatever the umask, and a folder that cannot be written or a full disk is one sentence
with the fix, with nothing half-written left behind."""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner

from coral_dagster.allocation.codec import plan_to_json
from coral_dagster.allocation.types import Plan, PlannedInstance
from coral_dagster.catalog.nodes import NodeConfig, NodeMultiset
from coral_dagster.cli.main import main
from coral_dagster.errors import CoralError
from coral_dagster.files import OUTPUT_MODE, PRIVATE_MODE, SCRIPT_MODE, write_file
from coral_dagster.templates.types import Stage, Template


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory) -> Path:
    """A one-instance phi-4 plan (L40S:1 in aws:us-east-2) as a plan file: a dry run of it writes a coordinator
    YAML, an engine YAML and launch.sh."""
    l40s = NodeConfig.parse("L40S:1")
    template = Template("phi-4", "aggregated", 60.0, NodeMultiset.of([l40s]), (Stage(0, 40, (l40s,), (1.0,)),),
                        1000.0, "compute")
    plan = Plan("small", "coral", "optimal", 1.0, 1.0, 0.0, 0.0, (PlannedInstance(template, "aws:us-east-2", 1, 1.0),),
                {("phi-4", "prefill"): 10.0}, {("phi-4", "prefill"): 5.0})
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    path.write_text(plan_to_json(plan))
    return path


def _dry_run(plan_file: Path, out: Path, db: Path):
    return CliRunner().invoke(main, ["launch", "--plan", str(plan_file), "--dry-run", "--out", str(out), "--json",
                                     "--db", str(db)])


def _written(res) -> list[Path]:
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output[res.output.index("{"):])
    return [Path(p) for p in doc["yaml"]] + [Path(doc["script"])]


def _one_sentence(res, *words: str) -> str:
    """The command failed with exit status 2 and one `error: … Fix: …` line naming `words`, no traceback."""
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and " Fix: " in lines[0], res.output
    assert "Traceback" not in res.output and all(w in lines[0] for w in words), lines[0]
    return lines[0]


def test_a_dry_run_writes_each_file_with_its_documented_mode_whatever_the_umask(plan_file, tmp_path):
    old = os.umask(0o077)
    try:
        files = _written(_dry_run(plan_file, tmp_path / "d", tmp_path / "s.duckdb"))
    finally:
        os.umask(old)
    assert {p.suffix for p in files} == {".yaml", ".sh"} and len(files) >= 3
    assert {p.name: _mode(p) for p in files} == {p.name: SCRIPT_MODE if p.suffix == ".sh" else OUTPUT_MODE
                                                for p in files}
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == sorted(p.name for p in files)


@pytest.mark.parametrize("planted", ["launch.sh", "yaml"])
def test_a_dry_run_never_writes_through_a_link_planted_in_its_folder(plan_file, tmp_path, planted):
    """The names a dry run writes are learnt from a first run elsewhere; a link of that name in the folder of a
    second run, pointing at a file of ours, leaves the file's text and mode as they were."""
    names = [p.name for p in _written(_dry_run(plan_file, tmp_path / "first", tmp_path / "s.duckdb"))]
    name = "launch.sh" if planted == "launch.sh" else next(n for n in names if n.endswith(".yaml"))
    target = tmp_path / "precious"
    target.write_text("do not overwrite\n")
    target.chmod(0o600)
    out = tmp_path / "d"
    out.mkdir()
    (out / name).symlink_to(target)
    res = _dry_run(plan_file, out, tmp_path / "s.duckdb")
    _one_sentence(res, str(out / name), "symbolic link", "--out")
    assert target.read_text() == "do not overwrite\n" and _mode(target) == 0o600
    assert (out / name).is_symlink() and not [p for p in out.iterdir() if p.name.startswith(".")]


def _unwritable(tmp_path: Path) -> Path:
    """A folder this process may not write in: /sys as root (sysfs refuses root too), else a folder made 0555."""
    if os.geteuid() == 0:
        return Path("/sys/coral-dry-run")
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    return folder / "d"


def test_an_unwritable_out_folder_is_one_sentence(plan_file, tmp_path):
    out = _unwritable(tmp_path)
    _one_sentence(_dry_run(plan_file, out, tmp_path / "s.duckdb"), str(out), "--out")
    assert not out.exists()


@pytest.mark.parametrize("code,words", [(errno.EROFS, "mounted read-only"), (errno.EACCES, "may not write"),
                                        (errno.ENOSPC, "full"), (errno.EDQUOT, "full")])
def test_a_refused_or_full_disk_at_open_is_one_sentence(plan_file, tmp_path, monkeypatch, code, words):
    out = tmp_path / "d"
    real_open = os.open

    def refusing(path, flags, mode=0o777, *args, **kw):
        if str(path).startswith(str(out)):
            raise OSError(code, os.strerror(code), str(path))
        return real_open(path, flags, mode, *args, **kw)

    monkeypatch.setattr(os, "open", refusing)
    _one_sentence(_dry_run(plan_file, out, tmp_path / "s.duckdb"), words, "--out")


def test_a_disk_full_while_writing_keeps_the_earlier_files_whole(plan_file, tmp_path, monkeypatch):
    """ENOSPC from os.write: the command says the disk is full; the files of an earlier run stay as they were and
    no partial file is left."""
    out = tmp_path / "d"
    files = _written(_dry_run(plan_file, out, tmp_path / "s.duckdb"))
    before = {p.name: p.read_bytes() for p in files}

    def full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", full)
    _one_sentence(_dry_run(plan_file, out, tmp_path / "s.duckdb"), "disk", "full", "free space", "--out")
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_bench_results_plots_and_keys_write_as_outputs(tmp_path):
    """bench._results.write_result, files.write_figure (plots) and a key file: each refuses a planted link, and
    writes its documented mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench._results import write_result
    from coral_dagster.files import write_figure
    from coral_dagster.runtime.security import write_secret

    target = tmp_path / "precious"
    target.write_text("keep\n")
    target.chmod(0o600)
    writers = {
        "result.json": lambda p: write_result("x", {"rows": []}, command="test", out=p),
        "plot.png": lambda p: write_figure(plt.subplots()[0], p),
        "api_key": lambda p: write_secret(p, "secret\n"),
    }
    modes = {"result.json": OUTPUT_MODE, "plot.png": OUTPUT_MODE, "api_key": PRIVATE_MODE}
    for name, write in writers.items():
        link = tmp_path / "links" / name
        link.parent.mkdir(exist_ok=True)
        link.symlink_to(target)
        with pytest.raises(CoralError, match="symbolic link"):
            write(link)
        assert target.read_text() == "keep\n" and _mode(target) == 0o600
        path = tmp_path / "files" / name
        path.parent.mkdir(exist_ok=True)
        write(path)
        assert _mode(path) == modes[name] and path.stat().st_size > 0
    assert json.loads((tmp_path / "files" / "result.json").read_text())["meta"]["command"] == "test"


def test_a_folder_in_place_of_a_file_or_a_file_in_place_of_a_folder_is_refused(tmp_path):
    (tmp_path / "launch.sh").mkdir()
    with pytest.raises(CoralError, match="not a regular file"):
        write_file(tmp_path / "launch.sh", "x")
    (tmp_path / "plan.json").write_text("{}")
    with pytest.raises(CoralError, match="is a file, not a folder"):
        write_file(tmp_path / "plan.json" / "inside", "x")
