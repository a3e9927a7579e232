"""Hostile inputs bounded before use: YAML alias bombs, nesting, bytes that are not UTF-8, counts of billions, a
SQLite file where the store should be, key files behind symbolic links, IPv6 loopback. Each ends in a clear
error (or works) within seconds, never a hang, a traceback, a download or a key written where it should not be."""

from __future__ import annotations

import os
import sqlite3
import stat
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import pytest
import zmq
from click.testing import CliRunner

from coral_dagster import paths
from coral_dagster.catalog.nodes import MAX_MULTISET_NODES, NodeMultiset
from coral_dagster.catalog.scenarios import load_scenario
from coral_dagster.cli.main import main
from coral_dagster.errors import CatalogError, CoralError
from coral_dagster.runtime.client import Client
from coral_dagster.runtime.config import CoordinatorConfig
from coral_dagster.runtime.coordinator import Coordinator
from coral_dagster.runtime.local import MAX_LOCAL_INSTANCES, LocalDeployment, free_port, local_instances
from coral_dagster.runtime.security import CurveKeys, is_local, write_secret
from coral_dagster.store import Store
from support.runtime_fakes import background

CORE = (paths.SCENARIOS_DIR / "core.yaml").read_text()


def _cli(*args: str, within_s: float = 20.0):
    """`coral ARGS` in this process; a command still running after `within_s` fails the test instead of hanging
    it (the thread is left behind as a daemon)."""
    result = []
    thread = threading.Thread(target=lambda: result.append(CliRunner().invoke(main, list(args))), daemon=True)
    thread.start()
    thread.join(within_s)
    assert result, f"`coral {' '.join(args)}` still ran after {within_s} s"
    return result[0]


def _one_line_error(res, *words: str) -> None:
    """Exit status 2, `error: … Fix: …` naming `words`, and no traceback."""
    assert res.exit_code == 2, res.output
    assert res.output.startswith("error: ") and "Fix:" in res.output and "Traceback" not in res.output
    assert all(w in res.output for w in words), res.output


def _billion_laughs(levels: int = 12) -> str:
    lines = ["a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"a{k}: &a{k} [{', '.join([f'*a{k - 1}'] * 10)}]" for k in range(1, levels)]
    return "\n".join(lines) + f"\nname: *a{levels - 1}\n"


@pytest.mark.parametrize("text, words", [
    (_billion_laughs(), ["alias *a0", "aliases are not allowed"]),
    (CORE.replace("name: core", "name: &n core", 1) + "\nextra: *n\n", ["alias *n"]),
    ("x: " + "[" * 5000 + "]" * 5000 + "\n", ["nests too deep"]),
], ids=["billion-laughs", "one-alias", "deep-nesting"])
def test_scenario_yaml_that_expands_or_nests_without_bound_is_refused(tmp_path, text, words):
    path = tmp_path / "s.yaml"
    path.write_text(text)
    with pytest.raises(CatalogError) as err:
        load_scenario(path)
    assert all(w in str(err.value) for w in words)
    _one_line_error(_cli("templates", "build", "--scenario", str(path), "--db", str(tmp_path / "c.duckdb")), *words)


def test_a_scenario_that_is_not_utf8_is_a_clear_error(tmp_path):
    path = tmp_path / "latin1.yaml"
    data = CORE.replace("name: core", "name: caf\xe9", 1).encode("latin-1")
    path.write_bytes(data)
    # A latin-1 byte above 0x7f followed by ASCII never decodes as UTF-8: the first one is where reading stops.
    first = next(i for i, byte in enumerate(data) if byte > 0x7F)
    _one_line_error(_cli("plan", "--scenario", str(path), "--no-store", "--db", str(tmp_path / "c.duckdb")),
                    "not UTF-8", f"byte {data[first]:#04x} at offset {first}", "save the file as UTF-8")
    folder = tmp_path / "folder.yaml"
    folder.mkdir()
    _one_line_error(_cli("plan", "--scenario", str(folder), "--no-store", "--db", str(tmp_path / "c.duckdb")),
                    str(folder))


@pytest.mark.parametrize("nodes", ["99999999999xL40S:1", "9" * 100_000 + "xL4:1", "200xL4:1,200xL40S:1",
                                   "L40S:" + "9" * 100_000, "0xL4:1"])
def test_node_lists_of_absurd_counts_are_refused_at_once(nodes):
    started = time.monotonic()
    with pytest.raises(CoralError):
        NodeMultiset.parse(nodes)
    assert time.monotonic() - started < 1.0
    res = _cli("templates", "best", "--model", "phi-4", "--phase", "decode", "--nodes", nodes, within_s=10)
    _one_line_error(res, "node")


def test_a_node_list_at_the_bound_still_parses():
    ms = NodeMultiset.parse(f"{MAX_MULTISET_NODES - 1}xL4:1,1xL40S:1")
    assert ms.size == MAX_MULTISET_NODES
    with pytest.raises(CoralError, match=f"more than {MAX_MULTISET_NODES}"):
        NodeMultiset.parse(f"{MAX_MULTISET_NODES}xL4:1,1xL40S:1")


def test_a_sqlite_file_in_place_of_the_store_is_named_and_nothing_is_downloaded(tmp_path):
    path = tmp_path / "coral.duckdb"
    with sqlite3.connect(path) as con:
        con.execute("CREATE TABLE t (x)")
    started = time.monotonic()
    with pytest.raises(CoralError) as err:
        Store(path).tables()
    text = str(err.value)
    assert "SQLite" in text and "not a DuckDB database file" in text and "download" not in text.lower()
    assert time.monotonic() - started < 5
    # Nothing was installed for it either.
    assert not list(Path.home().glob(".duckdb/extensions/*/*/sqlite_scanner*"))


def test_a_key_file_is_never_written_through_a_link_or_left_readable(tmp_path):
    target = tmp_path / "precious"
    target.write_text("do not overwrite")
    links = tmp_path / "links"
    links.mkdir()
    (links / "api_key").symlink_to(target)
    with pytest.raises(CoralError, match="symbolic link"):
        LocalDeployment("tiny-llama", local_instances((12,), 1), log_dir=links)
    assert target.read_text() == "do not overwrite"

    old = tmp_path / "old"
    old.mkdir()
    (old / "api_key").write_text("stale\n")
    os.chmod(old / "api_key", 0o644)
    dep = LocalDeployment("tiny-llama", local_instances((12,), 1), log_dir=old)
    mode = stat.S_IMODE(os.stat(dep.api_key_file).st_mode)
    assert mode == 0o600 and dep.api_key_file.read_text() == dep.api_key + "\n"
    assert [p.name for p in old.iterdir()] == ["api_key"]


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_key_file_owned_by_another_user_is_refused(tmp_path):
    path = tmp_path / "api_key"
    path.write_text("theirs\n")
    os.chown(path, 65534, 65534)
    with pytest.raises(CoralError, match="belongs to user id 65534"):
        write_secret(path, "mine\n")
    assert path.read_text() == "theirs\n"


def test_ipv6_loopback_is_loopback_and_serves():
    assert is_local("tcp://::1:5555") and is_local("tcp://[::1]:5555") and not is_local("tcp://[2001:db8::1]:5")
    keys = CurveKeys.generate()
    with ExitStack() as stack:
        ctx = zmq.Context()
        stack.callback(ctx.term)
        # No API key and not --insecure: allowed only because ::1 is loopback.
        coord = Coordinator(CoordinatorConfig(listen="tcp://::1:*", http_host="::1", http_port=free_port("::1"),
                                              models=("m",)), keys, ctx=ctx)
        background(stack, coord.run)
        assert coord.address.startswith("tcp://[::1]:")
        c = Client(coord.address.replace("[::1]", "::1"), keys=keys, ctx=ctx, timeout_s=10)
        stack.callback(c.close)
        assert c.status()["models"] == ["m"]


def test_hosts_and_counts_that_cannot_work_are_named():
    with pytest.raises(CoralError, match="cannot listen on host 'no such host'"):
        free_port("no such host")
    with pytest.raises(CoralError, match=f"more than {MAX_LOCAL_INSTANCES}"):
        local_instances((12,), 99_999_999_999)


@pytest.mark.parametrize("special", ["device", "fifo"])
def test_a_device_or_fifo_as_the_store_is_named_without_hanging_or_advising_to_move_it(tmp_path, special):
    path = Path("/dev/null") if special == "device" else tmp_path / "pipe.duckdb"
    if special == "fifo":
        os.mkfifo(path)
    started = time.monotonic()
    res = _cli("templates", "list", "--scenario", "core", "--db", str(path), within_s=10)
    _one_line_error(res, str(path), "device" if special == "device" else "FIFO")
    assert "mv " not in res.output and time.monotonic() - started < 10


def test_a_local_deployment_on_ipv6_loopback_serves_over_zeromq_and_http(tmp_path):
    pytest.importorskip("torch")
    import json
    import urllib.request

    with LocalDeployment("tiny-llama", local_instances((12,), 1), host="::1", log_dir=tmp_path) as dep:
        assert dep.wait_ready(60)["serving"] == ["tiny-llama"]
        with dep.client() as c:
            assert c.complete("tiny-llama", ["hi"], max_tokens=2)[0]["kind"] == "done"
        request = urllib.request.Request(f"{dep.http_url}/v1/models",
                                         headers={"Authorization": f"Bearer {dep.api_key}"})
        with urllib.request.urlopen(request, timeout=10) as response:
            assert [m["id"] for m in json.load(response)["data"]] == ["tiny-llama"]
