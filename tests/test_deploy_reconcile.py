"""Reconcile against a recording launcher: launch order and wiring, idempotence, drains, rollback, resume, dry run."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from coral_dagster.allocation.types import AdmissionLimits, Plan, PlannedInstance
from coral_dagster.catalog.models import get_model
from coral_dagster.catalog.nodes import NodeConfig
from coral_dagster.cli import launch as launch_cli
from coral_dagster.deploy import state
from coral_dagster.deploy.launcher import LaunchRequest, LaunchResult, resolve_secrets
from support.deploy_fakes import RecordingDrainer, RecordingLauncher
from support.deploy_plans import GPT, PHI, PRICES, QWEN, plan, store_on_snapshot, template
from coral_dagster.deploy.dry_run import write_dry_run
from coral_dagster.deploy.reconcile import plan_diff, reconcile
from coral_dagster.deploy.spec import GPU_ROLES
from coral_dagster.deploy.tasks import role_template
from coral_dagster.errors import CoralError
from coral_dagster.runtime import credentials
from coral_dagster.runtime.config import format_admit, parse_admit
from coral_dagster.store import Store

SECRETS = {"HF_TOKEN": "hf_SENTINEL_7f3a9", "CORAL_CURVE_SECRET_KEY": "curve_SENTINEL_e41c",
           "CORAL_CURVE_PUBLIC_KEYS": "curvepub_SENTINEL_0b2d",
           "CORAL_REGISTRATION_KEY": "registration_SENTINEL_5c81_never_on_a_node", "CORAL_API_KEY": "api_SENTINEL_77d1"}


P1 = plan((QWEN, "aws:us-east-2", 2), (PHI, "aws:us-east-2", 1))
P2 = plan((QWEN, "aws:us-east-2", 1), (GPT, "gcp:us-central1", 1))


def clusters_of(p: Plan) -> int:
    """Clusters a plan needs, counted from the plan itself: its GPU nodes, the coordinator pair and its endpoint."""
    return 3 + sum(i.count * i.template.nodes.size for i in p.instances)


def heads(rows):
    """The recorded node of each instance that runs its scheduler: stage 0, node 0."""
    return rows[rows.role.isin(GPU_ROLES) & (rows.stage == 0) & (rows.node_index == 0)]


def nodes(store: Store):
    return state.read_nodes(store)


def primary(rows):
    """The primary of the recorded coordinator pair (its standby's name is the primary's plus `-b`)."""
    return rows[(rows.role == "coordinator") & (rows.slot == "primary")]


def launched(calls):
    return [c for a, c in calls if a == "launch"]


def downed(calls):
    return [c for a, c in calls if a == "down"]


@pytest.fixture
def store(tmp_path):
    return Store(tmp_path / "deploy.duckdb")


def test_first_run_launches_every_node_once_in_wiring_order(store):
    launcher = RecordingLauncher()
    report = reconcile(P1, "p1", store, launcher, RecordingDrainer(), PRICES)
    names = launched(launcher.calls)
    assert len(names) == len(set(names)) == clusters_of(P1)
    assert downed(launcher.calls) == [] and report.status == "done"
    rows = nodes(store)
    assert set(rows.cluster_name) == set(names) and set(rows.status) == {"launched"}
    role = rows.set_index("cluster_name").role
    assert role[names[0]] == "coordinator"
    order = {n: i for i, n in enumerate(names)}
    assert role[names[2]] == "endpoint"
    for _, inst in rows[rows.role.isin(GPU_ROLES)].groupby("instance_id"):
        head = heads(inst).cluster_name.item()
        assert all(order[head] < order[e] for e in inst.cluster_name if e != head)
    engines = rows[rows.role.isin(GPU_ROLES)]
    assert set(engines.role) == {"engine"}
    sizes = {"qwen3-32b": QWEN.nodes.size, "phi-4": PHI.nodes.size}
    assert engines.groupby("instance_id").size().to_dict() == \
        {i: sizes[m] for i, m in engines.groupby("instance_id").model.first().items()}
    assert Counter(heads(rows).model) == {"qwen3-32b": 2, "phi-4": 1}


def test_every_node_is_wired_to_its_scheduler_and_the_coordinator(store):
    launcher = RecordingLauncher()
    reconcile(P1, "p1", store, launcher, RecordingDrainer(), PRICES)
    addr = {name: f"tcp://{ip}:5555" for name, ip in launcher.ips.items()}
    rows = nodes(store)
    coord = primary(rows).cluster_name.item()
    standby = f"{coord}-b"
    for c in (coord, standby):
        assert launcher.requests[c].config["envs"]["CORAL_MODEL"].split() == ["phi-4", "qwen3-32b"]
    assert launcher.requests[standby].config["envs"]["CORAL_PRIMARY"] == addr[coord]
    for iid, inst in rows[rows.role == "engine"].groupby("instance_id"):
        head = heads(inst).cluster_name.item()
        sched = launcher.requests[head].config
        engines = [launcher.requests[c].config for c in inst.cluster_name]
        model = get_model(sched["envs"]["CORAL_MODEL"])
        assert sched["envs"]["CORAL_INSTANCE"] == iid and sched["envs"]["CORAL_HEAD"] == "1"
        assert sched["envs"]["CORAL_COORDINATOR"] == f"{addr[coord]},{addr[standby]}"
        assert sched["resources"]["ports"] == [5555, 5556]
        split = [int(x) for x in sched["envs"]["CORAL_SPLIT"].split(",")]
        # Layer ranges tile [0, n_layers) in the split the scheduler and vLLM are given.
        ranges = sorted({tuple(map(int, c["envs"]["CORAL_LAYERS"].split(":"))) for c in engines})
        assert ranges[0][0] == 0 and ranges[-1][1] == model.n_layers == sum(split)
        assert [b - a for a, b in ranges] == split
        shares: dict[int, float] = {}
        for c in engines:
            e = c["envs"]
            if c["name"] != head:
                # The others reach the head's scheduler; only the head reports to the coordinator.
                assert e["CORAL_SCHEDULER"] == addr[head] and e["CORAL_HEAD"] == "0"
                assert e["CORAL_COORDINATOR"] == "" and c["resources"]["ports"] == 5555
            assert e["CORAL_MODEL"] == model.alias and e["CORAL_SPLIT"] == e["VLLM_PP_LAYER_PARTITION"]
            assert e["CORAL_SPLIT"] == sched["envs"]["CORAL_SPLIT"] and e["CORAL_ENGINE"] == "torch"
            assert ranges[int(e["CORAL_STAGE_RANK"])] == tuple(map(int, e["CORAL_LAYERS"].split(":")))
            shares[int(e["CORAL_STAGE_RANK"])] = shares.get(int(e["CORAL_STAGE_RANK"]), 0) + float(e["CORAL_SHARE"])
            node = NodeConfig.parse(c["resources"]["accelerators"])
            assert e["CORAL_TP"] == str(node.count)
            assert (c["resources"]["cloud"], c["resources"]["region"]) == ("aws", "us-east-2")
            assert c["resources"]["use_spot"] is False
        assert shares == pytest.approx({s: 1.0 for s in range(len(split))})


def test_same_plan_twice_changes_nothing(store):
    launcher = RecordingLauncher()
    reconcile(P1, "p1", store, launcher, RecordingDrainer(), PRICES)
    before = (list(launcher.calls), nodes(store).drop(columns=["updated_at", "run_id"]))
    report = reconcile(P1, "p1", store, launcher, RecordingDrainer(), PRICES)
    assert launcher.calls == before[0]
    assert report.launched == () and report.downed == ()
    assert len(report.kept) == sum(i.count for i in P1.instances)
    after = nodes(store).drop(columns=["updated_at", "run_id"])
    assert after.equals(before[1])
    # A different plan id with the same content also leaves everything running.
    report = reconcile(P1, "p1-again", store, launcher, RecordingDrainer(), PRICES)
    assert launcher.calls == before[0] and len(report.kept) == 3


def test_new_plan_launches_added_drains_then_downs_removed_and_keeps_the_rest(store):
    calls: list[tuple[str, str]] = []
    launcher, drainer = RecordingLauncher(calls=calls), RecordingDrainer(calls=calls)
    reconcile(P1, "p1", store, launcher, drainer, PRICES)
    first = nodes(store)
    qwen = first[(first.model == "qwen3-32b")]
    replica = {iid: int(g.replica.iloc[0]) for iid, g in qwen.groupby("instance_id")}
    stays = min(replica, key=replica.get)
    goes = {max(replica, key=replica.get), first[first.model == "phi-4"].instance_id.iloc[0]}
    n_before = len(calls)

    report = reconcile(P2, "p2", store, launcher, drainer, PRICES)
    new_calls = calls[n_before:]
    removed_clusters = set(first[first.instance_id.isin(goes)].cluster_name)
    assert set(downed(new_calls)) == removed_clusters
    assert {i for a, i in new_calls if a == "drain"} == goes
    for iid in goes:
        drain_at = new_calls.index(("drain", iid))
        assert all(new_calls.index(("down", c)) > drain_at for c in first[first.instance_id == iid].cluster_name)
    added = launched(new_calls)
    assert len(added) == GPT.nodes.size
    assert all(launcher.requests[c].config["envs"].get("CORAL_MODEL") == "gpt-oss-20b" for c in added)
    untouched = set(first[first.instance_id == stays].cluster_name)
    assert untouched.isdisjoint(c for _, c in new_calls)
    assert report.kept == (stays,)
    rows = nodes(store).set_index("cluster_name")
    assert set(rows.loc[list(removed_clusters), "status"]) == {"down"}
    assert set(rows.loc[list(untouched), "status"]) == {"launched"}
    # The new instance's head (its scheduler) reports to the coordinator started by the first plan.
    coord = primary(first).address.item()
    standby = first[(first.role == "coordinator") & (first.slot == "standby")].address.item()
    pair = f"{coord},{standby}"
    new_head = heads(nodes(store).set_index("cluster_name").loc[added].reset_index()).cluster_name.item()
    assert {c: launcher.requests[c].config["envs"]["CORAL_COORDINATOR"] for c in added} == \
        {c: pair if c == new_head else "" for c in added}
    assert set(drainer.coordinators) == {coord}


def test_a_replan_hands_the_live_coordinator_its_admission_limits_once(store):
    """The coordinator a first plan started keeps running; a second plan that serves less than the demand reaches
    it as `CORAL_ADMIT` text (what a fresh coordinator reads) after the new instances launch and before any drain,
    a third run of the same plan changes nothing, and a plan serving everything lifts the limits."""
    calls: list[tuple[str, str]] = []
    launcher, drainer = RecordingLauncher(calls=calls), RecordingDrainer(calls=calls)
    reconcile(P1, "p1", store, launcher, drainer, PRICES)
    assert ("admit", "") not in calls and not [c for c in calls if c[0] == "admit"]
    coord = primary(nodes(store)).address.item()
    # Half of gpt-oss-20b's demand served: admission holds it to half of what it sends.
    short = replace(P2, demand_tokens_per_s={("gpt-oss-20b", "prefill"): 100.0},
                    served_tokens_per_s={("gpt-oss-20b", "prefill"): 50.0},
                    admission=AdmissionLimits(admit_req_s={"gpt-oss-20b": 1.5}, admit_depth_req={"gpt-oss-20b": 40.0}))
    n_before = len(calls)
    reconcile(short, "p2", store, launcher, drainer, PRICES)
    new = calls[n_before:]
    adm = short.admission
    text = format_admit(adm.admit_req_s, adm.admit_depth_req, adm.admit_peak, {"gpt-oss-20b": 0.5})
    assert parse_admit(text) == ({"gpt-oss-20b": 1.5}, {"gpt-oss-20b": 40.0}, {}, {"gpt-oss-20b": 0.5})
    assert drainer.limits == {coord: text}
    at = new.index(("admit", text))
    assert all(i < at for i, c in enumerate(new) if c[0] == "launch")
    assert all(i > at for i, c in enumerate(new) if c[0] in ("drain", "down"))
    n_before = len(calls)
    again = reconcile(short, "p2", store, launcher, drainer, PRICES)
    assert calls[n_before:] == [] and again.status == "done"
    reconcile(P2, "p2b", store, launcher, drainer, PRICES)
    assert drainer.limits == {coord: ""} and calls[-1] == ("admit", "")


def test_failed_node_rolls_back_its_instance_and_is_marked_failed(store):
    diff = plan_diff(P1, "p1", nodes(store), PRICES)
    victim = next(i for i in diff.launch if i.shape.template.model == "qwen3-32b")
    stage0 = next(n.cluster_name for n in victim.nodes if n.stage == 0)
    launcher = RecordingLauncher(fail={stage0})
    report = reconcile(P1, "p1", store, launcher, RecordingDrainer(), PRICES)
    assert report.status == "failed" and report.failed == (victim.instance_id,)
    started = [c for c in launched(launcher.calls) if c in {n.cluster_name for n in victim.nodes}]
    assert started[-1] == stage0
    assert set(downed(launcher.calls)) == set(started)
    rows = nodes(store)
    assert set(rows[rows.instance_id == victim.instance_id].status) == {"failed"}
    assert set(rows[rows.instance_id != victim.instance_id].status) == {"launched"}
    events = state.read_events(store)
    failed_event = events[(events.cluster_name == stage0) & (events.action == "launch-failed")]
    assert len(failed_event) == 1 and "simulated" in failed_event.message.item()
    runs = state.read_runs(store)
    assert runs.status.tolist() == ["failed"] and runs.failed.tolist() == [1]

    retry = RecordingLauncher()
    report = reconcile(P1, "p1", store, retry, RecordingDrainer(), PRICES)
    fresh = launched(retry.calls)
    assert len(fresh) == QWEN.nodes.size and report.status == "done"
    assert set(fresh).isdisjoint(n.cluster_name for n in victim.nodes)
    live = nodes(store)
    live = live[live.status == "launched"]
    assert heads(live).groupby("model").size().to_dict() == {"qwen3-32b": 2, "phi-4": 1}


class Crash(BaseException):
    """The process dying (not a launch failure): nothing in reconcile may catch it."""


class CrashingLauncher(RecordingLauncher):
    def __init__(self, after: int) -> None:
        super().__init__()
        self.after = after

    def launch(self, request: LaunchRequest) -> LaunchResult:
        if len(self.ips) == self.after:
            self.calls.append(("launch", request.cluster_name))
            raise Crash()
        return super().launch(request)


def test_run_that_dies_part_way_is_resumed_by_the_next(tmp_path):
    reference = RecordingLauncher()
    reconcile(P1, "p1", Store(tmp_path / "ref.duckdb"), reference, RecordingDrainer(), PRICES)

    store = Store(tmp_path / "crash.duckdb")
    crashing = CrashingLauncher(after=4)
    with pytest.raises(Crash):
        reconcile(P1, "p1", store, crashing, RecordingDrainer(), PRICES)
    rows = nodes(store)
    assert Counter(rows.status) == {"launched": 4, "pending": clusters_of(P1) - 4}
    assert state.read_runs(store).status.tolist() == ["running"]

    resumed = RecordingLauncher()
    report = reconcile(P1, "p1", store, resumed, RecordingDrainer(), PRICES)
    again = launched(resumed.calls)
    assert set(again).isdisjoint(crashing.ips)
    assert sorted(again + list(crashing.ips)) == sorted(reference.ips)
    assert downed(resumed.calls) == [] and report.status == "done"
    assert set(nodes(store).status) == {"launched"}
    assert state.read_runs(store).status.tolist() == ["interrupted", "done"]


def test_coordinator_that_fails_stops_the_run_and_the_next_run_starts_everything(store):
    diff = plan_diff(P1, "p1", nodes(store), PRICES)
    coord = diff.coordinator.cluster_name
    failing = RecordingLauncher(fail={coord})
    with pytest.raises(CoralError, match="did not start"):
        reconcile(P1, "p1", store, failing, RecordingDrainer(), PRICES)
    assert failing.calls == [("launch", coord), ("down", coord)]
    rows = nodes(store).set_index("cluster_name")
    assert rows.status[coord] == "failed"
    assert set(rows.drop(index=coord).status) == {"pending"}
    assert state.read_runs(store).status.tolist() == ["failed"]
    launcher = RecordingLauncher()
    reconcile(P1, "p1", store, launcher, RecordingDrainer(), PRICES)
    assert sorted(launched(launcher.calls)) == sorted(rows.index)
    assert launched(launcher.calls)[0] == coord and set(nodes(store).status) == {"launched"}


def test_failed_down_is_retried_by_the_next_run(store):
    launcher = RecordingLauncher()
    reconcile(P1, "p1", store, launcher, RecordingDrainer(), PRICES)
    phi = nodes(store)
    stuck = heads(phi[phi.model == "phi-4"]).cluster_name.item()
    launcher.fail_down = {stuck}
    p = plan((QWEN, "aws:us-east-2", 2))
    report = reconcile(p, "p2", store, launcher, RecordingDrainer(), PRICES)
    assert any(stuck in m for m in report.messages)
    assert nodes(store).set_index("cluster_name").status[stuck] == "draining"
    launcher.fail_down = set()
    n = len(launcher.calls)
    reconcile(p, "p2", store, launcher, RecordingDrainer(), PRICES)
    assert launcher.calls[n:] == [("down", stuck)]
    assert nodes(store).set_index("cluster_name").status[stuck] == "down"


def test_empty_plan_drains_everything_and_downs_the_coordinator_last(store):
    calls: list[tuple[str, str]] = []
    launcher, drainer = RecordingLauncher(calls=calls), RecordingDrainer(calls=calls)
    reconcile(P1, "p1", store, launcher, drainer, PRICES)
    pair = set(nodes(store).query("role in ('coordinator', 'endpoint')").cluster_name)
    n = len(calls)
    reconcile(plan(), "p0", store, launcher, drainer, PRICES)
    tail = calls[n:]
    assert len([c for c in tail if c[0] == "drain"]) == sum(i.count for i in P1.instances)
    assert {c for _, c in tail[-3:]} == pair and {a for a, _ in tail[-3:]} == {"down"}
    assert set(nodes(store).status) == {"down"}


FAKE_SKY = """#!/usr/bin/env python3
import json, os, sys
args = sys.argv[1:]
if args[:2] == ["status", "--ip"]:
    print(json.load(open(os.environ["FAKE_SKY_IPS"]))[args[2]])
    sys.exit(0)
with open(os.environ["FAKE_SKY_LOG"], "a") as log:
    log.write(json.dumps(args) + "\\n")
# What `--secret NAME` hands SkyPilot: $NAME of the launching shell.
names = [args[i + 1] for i in range(len(args) - 1) if args[i] == "--secret"]
with open(os.environ["FAKE_SKY_LOG"] + ".secrets", "a") as log:
    log.write(json.dumps({n: os.environ.get(n) for n in names}) + "\\n")
"""


def _run_script(dry, ips: dict[str, str], tmp_path) -> list[list[str]]:
    """Run the dry run's launch.sh with a `sky` on PATH that records each call and answers `sky status --ip`
    with `ips` (the far side of the cloud boundary); the recorded launch and down calls, in order."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "sky").write_text(FAKE_SKY)
    (bin_dir / "sky").chmod(0o755)
    (tmp_path / "ips.json").write_text(json.dumps(ips))
    log = tmp_path / "sky.log"
    log.write_text("")
    env = {**os.environ, **SECRETS, "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
           "FAKE_SKY_LOG": str(log), "FAKE_SKY_IPS": str(tmp_path / "ips.json")}
    done = subprocess.run(["bash", str(dry.script)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in log.read_text().splitlines()], done.stdout


def _handed_secrets(tmp_path) -> list[dict[str, str | None]]:
    """The secret values each recorded `sky launch` was handed, in call order."""
    return [json.loads(line) for line in (tmp_path / "sky.log.secrets").read_text().splitlines()]


def _launched_config(call: list[str], folder) -> tuple[str, dict, list[str]]:
    """(cluster, the task `sky launch` runs: its YAML with the --env values applied, --secret names)."""
    assert call[:4] == ["launch", "-y", "-d", "-c"]
    cluster, cfg = call[4], yaml.safe_load((folder / call[-1]).read_text())
    secrets, i = [], 5
    while i < len(call) - 1:
        flag, value = call[i], call[i + 1]
        if flag == "--env":
            key, _, v = value.partition("=")
            cfg["envs"][key] = v
        else:
            assert flag == "--secret"
            secrets.append(value)
        i += 2
    return cluster, cfg, secrets


def test_dry_run_script_launches_what_a_real_run_launches_from_one_yaml_per_kind(store, tmp_path):
    """launch.sh, run against a recording `sky`, launches the same clusters in the same order with the same
    resources, envs (addresses included) and secrets as `coral launch` itself; from one YAML per cluster kind."""
    diff = plan_diff(P1, "p1", nodes(store), PRICES)
    dry = write_dry_run(diff, tmp_path / "yaml")
    assert not store.path.exists()
    launcher = RecordingLauncher()
    reconcile(P1, "p1", Store(tmp_path / "real.duckdb"), launcher, RecordingDrainer(), PRICES)
    calls, out = _run_script(dry, launcher.ips, tmp_path)
    assert [c[4] for c in calls] == launched(launcher.calls)
    kinds = {(r.config["resources"]["accelerators"] if "accelerators" in r.config["resources"] else None,
              r.config["resources"]["region"], r.config["envs"].get("CORAL_HEAD"), r.config["resources"]["ports"]
              .__repr__()) for r in launcher.requests.values()}
    assert len(dry.yaml_paths) == len(kinds) < clusters_of(P1)
    for call, handed in zip(calls, _handed_secrets(tmp_path), strict=True):
        cluster, cfg, secrets = _launched_config(call, dry.script.parent)
        real = launcher.requests[cluster]
        assert cfg["resources"] == real.config["resources"] and cfg["envs"] == real.config["envs"], cluster
        assert cfg["run"] == real.config["run"] and sorted(secrets) == sorted(real.secret_names)
        # Each instance's nodes get the credential of their own instance, as `coral launch` derives it.
        assert handed == resolve_secrets(real.secret_names, SECRETS, real.config["envs"])
        # The registration key goes to the coordinator only.
        assert ("CORAL_REGISTRATION_KEY" in handed) == (cluster in diff.coordinator_clusters)
        assert ("CORAL_INSTANCE_CREDENTIAL" in handed) == ("accelerators" in real.config["resources"])
    coordinator = diff.coordinator.cluster_name
    assert diff.endpoint is not None
    assert f"OpenAI API: https://{launcher.ips[diff.endpoint.cluster_name]}:8000/v1" in out
    # Each wired cluster's address is looked up once, into a variable, not once per use.
    text = dry.script.read_text()
    assert text.count(f"sky status --ip {coordinator}") == 0 and text.count(f"$(address {coordinator})") == 1

    reconcile(P1, "p1", store, RecordingLauncher(), RecordingDrainer(), PRICES)
    before = nodes(store)
    diff = plan_diff(P2, "p2", before, PRICES)
    dry = write_dry_run(diff, tmp_path / "yaml2")
    calls, _ = _run_script(dry, {}, tmp_path / "yaml2")
    removed = {c for r in diff.remove for c in r.clusters}
    assert {c[-1] for c in calls if c[0] == "down"} == removed
    launches = [c for c in calls if c[0] == "launch"]
    assert len(launches) == GPT.nodes.size
    # Known addresses are written in: the live coordinator's is never looked up.
    coord = before.query("role == 'coordinator'").sort_values("cluster_name")
    for call in launches:
        cluster, cfg, _ = _launched_config(call, dry.script.parent)
        if cfg["envs"].get("CORAL_COORDINATOR"):
            assert cfg["envs"]["CORAL_COORDINATOR"] == ",".join(coord.address)
    for name in coord.cluster_name:
        assert name not in dry.script.read_text().split("down -y")[0].split("sky status")[-1]
    assert nodes(store).equals(before)


def test_every_env_the_builder_sets_is_declared_in_the_role_yaml(store):
    launcher = RecordingLauncher()
    reconcile(P1, "p1", store, launcher, RecordingDrainer(), PRICES)
    roles = nodes(store).set_index("cluster_name").role
    for req in launcher.requests.values():
        role = roles[req.cluster_name]
        declared = set(role_template(role)["envs"])
        assert set(req.config["envs"]) == declared, role
        assert req.secret_names == tuple(sorted(role_template(role)["secrets"]))


def test_plan_with_node_missing_from_prices_is_refused(store):
    odd = template("phi-4", "decode", [(40, ["L40S:1"], [1.0])])
    p = Plan("core", "coral", "optimal", 1.0, 1.0, 0.0, 0.0, (PlannedInstance(odd, "gcp:us-central1", 1, 1.0),),
             {}, {})
    with pytest.raises(CoralError, match="L40S:1 is not sold in gcp:us-central1"):
        plan_diff(p, "px", nodes(store), PRICES)


def _cli(monkeypatch, args, p: Plan, plan_id: str):
    from dataclasses import replace

    from coral_dagster.app import deployment

    monkeypatch.setattr(launch_cli, "_load_plan", lambda *_: replace(p, plan_id=plan_id))
    monkeypatch.setattr(deployment, "snapshot_prices", lambda *_: (PRICES, "the test price table"))
    command = launch_cli.launch if args[0] == "launch" else launch_cli.status
    result = CliRunner().invoke(command, args[1:], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def test_secrets_never_reach_yaml_duckdb_logs_or_output(monkeypatch, tmp_path, caplog, store):
    for k, v in SECRETS.items():
        monkeypatch.setenv(k, v)
    caplog.set_level(logging.DEBUG)
    out = _cli(monkeypatch, ["launch", "--dry-run", "--json", "--db", str(store.path), "--out",
                             str(tmp_path / "dry")], P1, "p1")
    doc = json.loads(out)
    assert 1 < len(doc["yaml"]) < clusters_of(P1) and doc["script"].endswith("launch.sh")
    launcher = RecordingLauncher()
    reconcile(P1, "p1", store, launcher, RecordingDrainer(), PRICES)
    reconcile(P2, "p2", store, launcher, RecordingDrainer(), PRICES)
    out += _cli(monkeypatch, ["status", "--json", "--all", "--db", str(store.path)], P1, "p1")
    texts = [out, caplog.text, json.dumps([r.config for r in launcher.requests.values()])]
    texts += [p.read_text() for p in (tmp_path / "dry").iterdir()]
    for table in ("deployment_nodes", "deployment_events", "deployments"):
        texts.append(store.query(f"SELECT * FROM {table}").to_csv())
    blob = store.path.read_bytes()
    derived = [credentials.instance_credential(SECRETS["CORAL_REGISTRATION_KEY"], r.config["envs"]["CORAL_INSTANCE"])
               for r in launcher.requests.values() if "CORAL_INSTANCE" in r.config["envs"]]
    assert derived
    for value in [*SECRETS.values(), *derived]:
        assert all(value not in t for t in texts)
        assert value.encode() not in blob
    for p in (tmp_path / "dry").glob("*.yaml"):
        secrets = yaml.safe_load(p.read_text())["secrets"]
        assert (secrets or p.name.startswith("endpoint-")) and all(v is None for v in secrets.values())


def test_status_shows_live_nodes_and_their_price(monkeypatch, store):
    reconcile(P1, "p1", store, RecordingLauncher(), RecordingDrainer(), PRICES)
    doc = json.loads(_cli(monkeypatch, ["status", "--json", "--db", str(store.path)], P1, "p1"))
    assert doc["instances"] == sum(i.count for i in P1.instances)
    assert doc["gpu_usd_per_hour"] == pytest.approx(P1.cost_usd_per_hour)
    assert len(doc["nodes"]) == clusters_of(P1) and doc["last_run"]["status"] == "done"
    cpu = [n["cluster_name"] for n in doc["nodes"] if n["role"] in ("coordinator", "endpoint")]
    assert doc["unpriced_clusters"] == sorted(cpu) and len(cpu) == 3
    text = _cli(monkeypatch, ["status", "--db", str(store.path)], P1, "p1")
    assert "3 instance(s)" in text
    # The endpoint's OpenAI URL, on the address it was launched at.
    rows = state.read_nodes(store)
    address = rows[rows.role == "endpoint"].address.item()
    url = f"https://{address.removeprefix('tcp://').rsplit(':', 1)[0]}:8000/v1"
    assert doc["url"] == url and f"OpenAI API: {url}" in text


def test_deploy_prices_nodes_from_the_plans_own_snapshot(store, tmp_path):
    """Two plans of the same instances on snapshots whose prices differ 3×: each dry run prices its GPU nodes from
    its own snapshot, and the sum is what the bundled price table gives times that snapshot's factor."""
    from coral_dagster.app.deployment import deploy
    from coral_dagster.allocation.storage import load_plan

    rows = PRICES.set_index(["region", "node"]).usd_per_hour
    bundled = sum(i.count * k * rows[(i.region, str(n))] for i in P1.instances for n, k in i.template.nodes.counts)
    for scale in (1.0, 3.0):
        plan = load_plan(store, store_on_snapshot(store, P1, scale))
        report = deploy(store, plan, out=tmp_path / f"x{scale:g}").as_dict()
        assert report["plan_id"] == plan.plan_id
        assert report["gpu_usd_per_hour"] == pytest.approx(bundled * scale, rel=1e-6)
        assert report["plan_usd_per_hour"] == pytest.approx(P1.cost_usd_per_hour, rel=1e-6)


def test_cli_launches_the_latest_stored_plan(monkeypatch, store, tmp_path):
    from coral_dagster.deploy import sky_adapter

    plan_id = store_on_snapshot(store, P1)
    runner = CliRunner()
    dry = runner.invoke(launch_cli.launch, ["--dry-run", "--json", "--db", str(store.path), "--out",
                                            str(tmp_path / "y")], catch_exceptions=False)
    doc = json.loads(dry.output)
    assert doc["plan_id"] == plan_id and len([c for c in doc["commands"] if c.startswith("sky launch")]) == \
        clusters_of(P1)
    assert state.read_nodes(store).empty
    launcher = RecordingLauncher()
    monkeypatch.setattr(sky_adapter, "SkyLauncher", lambda retry_until_up: launcher)
    real = runner.invoke(launch_cli.launch, ["--plan", plan_id, "--json", "--db", str(store.path)],
                         catch_exceptions=False)
    report = json.loads(real.output)
    assert report["status"] == "done" and sorted(report["launched"]) == sorted(launcher.ips)
    front = next(c for c in launcher.ips if c.endswith("-endpoint"))
    assert report["url"] == f"https://{launcher.ips[front]}:8000/v1"
    assert len(launcher.ips) == clusters_of(P1)
    assert set(state.read_nodes(store).plan_id) == {plan_id}
