"""The day loop served request by request (`serve_mode="requests"`), against the simulator run directly: with no
start-up lag each window is its plan serving the window's arrivals; an instance not yet up is routed nothing; and
start-up lag costs attainment only in the windows that add capacity."""

from __future__ import annotations

from dataclasses import replace
import json
from pathlib import Path

import duckdb
import numpy as np
import pytest
import yaml
from click.testing import CliRunner

from support.scenario_docs import copy_small, small

from coral_dagster.app.scenario_plans import library_templates
from coral_dagster.catalog.prices import load_node_prices
from coral_dagster.catalog.scenarios import load_scenario
from coral_dagster.cli.main import main
from coral_dagster.day.loop import DayLoop
from coral_dagster.day.run import method_planner
from coral_dagster.day.shape import day_spec, window_rates
from coral_dagster.errors import CoralError
from coral_dagster.simulator.engine import FAILURES, OK, Engine
from coral_dagster.simulator.latency import ProfileLatencyModel
from coral_dagster.simulator.workload import ModelLoad, make_workload
from coral_dagster.store import Store

# A flat day, or one whose demand doubles at hour 1; instant weights, so start-up is boot alone (3 minutes in STEP).
FLAT = {"hourly": [1.0] * 24, "bursts": False, "boot_min": 0, "setup_min": 0, "weight_gbytes_per_s": 1000}
STEP = {**FLAT, "hourly": [0.5] + [1.0] * 23, "boot_min": 3}
NO_LAG = {**STEP, "boot_min": 0}


def _scenario(folder: Path, day: dict, nodes: int = 1000):
    doc = small(day=day, availability={"default_nodes": nodes},
                allocation={"headroom": 1.1, "replan_interval_min": 60, "node_startup_min": 10})
    path = folder / f"day-{abs(hash(yaml.safe_dump(doc))) % 10**8}.yml"
    path.write_text(yaml.safe_dump(doc))
    return load_scenario(path)


@pytest.fixture(scope="module")
def library(small_library, tmp_path_factory) -> Path:
    return copy_small(small_library, tmp_path_factory.mktemp("day-requests"))[1]


def _day(scn, library: Path, folder: Path, hours: float) -> DayLoop:
    planner = method_planner(scn, library_templates(scn, str(library)), "coral", time_limit_s=60)
    loop = DayLoop(scn, "coral", planner, Store(folder / f"dep-{len(list(folder.iterdir()))}.duckdb"),
                   load_node_prices(), serve_mode="requests", keep_runs=True, seed=7, sizing="window")
    loop.run(hours=hours)
    return loop


def _met(scn, workload, out) -> dict[str, float]:
    """SLO attainment per model from the engine's raw times, by the scenario's SLOs (shed and failed: not met)."""
    slo = {m.model: m for m in scn.models}
    res = {}
    for k, name in enumerate(workload.models):
        mine = workload.model == k
        ttft_ms = (out.ttft_s[mine] - workload.arrival_s[mine]) * 1000.0
        decode = workload.output_tokens[mine] - 1
        with np.errstate(invalid="ignore", divide="ignore"):
            tpot_ms = np.where(decode > 0, (out.finish_s[mine] - out.ttft_s[mine]) * 1000.0 / np.maximum(decode, 1), 0)
        met = (out.status[mine] == OK) & (ttft_ms <= slo[name].prefill_slo_ms) & (tpot_ms <= slo[name].decode_slo_ms)
        res[name] = float(met.mean())
    return res


@pytest.mark.parametrize("nodes", [1000, 2])
def test_zero_startup_windows_are_the_plan_serving_the_arrivals(library, tmp_path, nodes):
    """Weights load in no time (below a float's step at 1 h; a scenario file caps the speed, so it is set here):
    each window is one segment, and it is the Engine, run here, of the window's adopted plan (with its admission)
    on the arrivals drawn here from the scenario's trace at the window's rate: the same first-token times, the
    same attainment. With 2 nodes of each kind the plans serve part of the demand, and admission sheds."""
    scn = _scenario(tmp_path, NO_LAG, nodes)
    scn = replace(scn, day=replace(day_spec(scn), weight_gbytes_per_s=1e16))
    loop = _day(scn, library, tmp_path, hours=2.0)
    assert len(loop.served) == 2
    assert (loop.adopted[0].counts() != loop.adopted[1].counts()) == (nodes == 1000)
    assert (loop.served[1].by_model["phi-4"].shed > 0) == (nodes == 2)
    for w, serving in enumerate(loop.served):
        (run,) = serving.runs
        seed = int(np.random.SeedSequence([7, w]).generate_state(1)[0])
        workload = make_workload([ModelLoad("phi-4", "azure-conv", window_rates(scn, w)["phi-4"])], 3600.0, seed)
        assert np.array_equal(workload.arrival_s, run.workload.arrival_s) and len(workload) > 300
        out = Engine(loop.adopted[w], workload, ProfileLatencyModel(), link_gbps=scn.link_gbps).run()
        direct = _met(scn, workload, out)
        assert np.array_equal(out.ttft_s, run.output.ttft_s, equal_nan=True)
        assert np.array_equal(out.status, run.output.status)
        assert serving.by_model["phi-4"].attainment == pytest.approx(direct["phi-4"], abs=1e-12), f"window {w}"
        assert serving.by_model["phi-4"].offered == len(workload)


def test_an_instance_not_up_yet_is_routed_nothing(library, tmp_path):
    """Demand doubles at hour 1 and the new instances serve 3 minutes after launch: the first segment of window 1
    holds only the instances up at its start, and the engine routes that segment's requests to them alone."""
    scn = _scenario(tmp_path, STEP)
    loop = _day(scn, library, tmp_path, hours=2.0)
    first, *rest = loop.served[1].runs
    assert rest, "the step up adds instances, so window 1 has a segment after they come up"
    assert first.segment.end_s - first.segment.start_s == pytest.approx(180.0, abs=1.0)
    up_then = {}
    for inst in loop.instances.values():
        if inst.ready_s <= first.segment.start_s and inst.serve_until_s >= first.segment.end_s:
            key = (inst.template.template_id, inst.region)
            up_then[key] = up_then.get(key, 0) + 1
    later = {}
    for inst in loop.instances.values():
        if first.segment.start_s < inst.ready_s < first.segment.end_s + 1.0:
            key = (inst.template.template_id, inst.region)
            later[key] = later.get(key, 0) + 1
    assert later, "some instance comes up at the segment's end"
    routed = {"prefill": 0, "decode": 0}
    for row in first.output.instances:
        tid, region, copy = row["key"]
        assert copy < up_then.get((tid, region), 0), f"{row['key']} was not up in the first segment"
        routed[row["phase"]] += row["routed_requests"]
    admitted = int((first.output.status != FAILURES.index("shed")).sum())
    assert routed == {"prefill": admitted, "decode": admitted} and admitted > 0, "each admitted request: one of each"
    second = rest[0].output.instances
    assert sum(1 for r in second if (r["key"][0], r["key"][1]) in later) > 0


@pytest.mark.slow  # two 3-hour days at 1 req/s in the simulator: ~70 s on a loaded machine
def test_startup_lag_lowers_request_attainment_only_where_capacity_is_added(library, tmp_path):
    """Demand quadruples at hour 1 at 1 req/s. With a 10-minute start-up the old instances alone face it at first,
    and admission sheds what they cannot carry: window 1 attains less than with no lag, on the same arrivals; the
    windows that add nothing (the warm start, the plan kept at hour 2) are the same request for request."""
    day = {**FLAT, "hourly": [0.25] + [1.0] * 23}

    def scenario(boot_min: float):
        doc = small(day={**day, "boot_min": boot_min}, availability={"default_nodes": 1000},
                    allocation={"headroom": 1.1, "replan_interval_min": 60, "node_startup_min": 10})
        doc["models"][0]["rate_req_s"] = 1.0
        path = tmp_path / f"lag-{boot_min:g}.yml"
        path.write_text(yaml.safe_dump(doc))
        return load_scenario(path)

    lagged = _day(scenario(10), library, tmp_path, hours=3.0)
    instant = _day(scenario(0), library, tmp_path, hours=3.0)
    assert [p.counts() for p in lagged.adopted] == [p.counts() for p in instant.adopted]
    adds = [w for w in range(1, 3) if any(lagged.adopted[w].counts().get(k, 0) > n
                                          for k, n in lagged.adopted[w - 1].counts().items())
            or set(lagged.adopted[w].counts()) - set(lagged.adopted[w - 1].counts())]
    assert adds == [1], "only the step up at hour 1 adds capacity"
    for w, (a, b) in enumerate(zip(lagged.served, instant.served)):
        lag, none = a.by_model["phi-4"], b.by_model["phi-4"]
        assert lag.offered == none.offered and lag.offered_tokens == none.offered_tokens, "the same arrivals"
        if w in adds:
            assert lag.attainment < none.attainment, f"window {w}"
            assert lag.shed > none.shed, f"window {w}: the old instances' admission sheds during the lag"
        else:
            assert lag == none, f"window {w}"


@pytest.mark.slow  # two 6-minute windows of the default day: ~14 s on a loaded machine
def test_the_command_serves_requests_and_stores_the_mode(small_store):
    """`coral day --serve requests --json`: the windows' figures come from the requests (whole counts of them over
    the offered tokens), and `day_runs` records the mode."""
    scenario, db = small_store
    res = CliRunner().invoke(main, ["day", "--scenario", str(scenario), "--hours", "0.2", "--db", str(db),
                                    "--serve", "requests", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output[res.output.index("{"):])
    assert doc["serve_mode"] == "requests" and len(doc["windows"]) == 2
    for w in doc["windows"]:
        assert 0.0 <= w["worst_attainment"] <= w["worst_admitted_attainment"] <= 1.0
        assert 0 < w["slo_tokens"] <= w["demanded_tokens"] and w["demanded_tokens"] == int(w["demanded_tokens"])
    with duckdb.connect(str(db), read_only=True) as con:
        assert con.execute("SELECT serve_mode FROM day_runs").fetchall() == [("requests",)]


def test_an_unknown_serve_mode_is_refused(tmp_path):
    scn = _scenario(tmp_path, FLAT)
    with pytest.raises(CoralError, match="serve mode"):
        DayLoop(scn, "coral", lambda *a: None, Store(tmp_path / "d.duckdb"), load_node_prices(), serve_mode="exact")
