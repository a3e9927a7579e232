"""Admission control (requests conserved, never shed below the planned rate, the simulator and the coordinator
shedding alike) and the closed loop (bounded, never worse than where it started)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from coral_dagster.allocation.types import Plan
from coral_dagster.app.closed_loop import closed_loop
from coral_dagster.catalog.nodes import NodeConfig
from coral_dagster.catalog.scenarios import load_scenario
from coral_dagster.errors import CoralError
from support.admission_plans import aggregated_plan
from coral_dagster.routing import Admission

L40S = NodeConfig.parse("L40S:1")


def _simulate(plan: Plan, arrivals: np.ndarray):
    from coral_dagster.simulator import ConstantLatencyModel, Engine, Workload
    from coral_dagster.simulator.engine import FAILURES

    n = len(arrivals)
    w = Workload(("phi-4",), arrivals, np.zeros(n, dtype=int), np.full(n, 16), np.full(n, 2),
                 float(arrivals.max()) + 1.0)
    out = Engine(plan, w, ConstantLatencyModel(0.1, 0.1)).run()
    return np.array(FAILURES, dtype=object)[out.status]


@pytest.mark.parametrize("seed, share", [(0, 0.3), (1, 0.55), (2, 0.76)])
def test_overload_is_shed_down_to_exactly_its_share(seed, share):
    """Poisson at 15 req/s for 200 s against a plan serving `share` of phi-4 (admitting share × 5 req/s, no second
    bucket): admitted + shed = arrivals, and exactly ⌊share × arrivals⌋ are admitted, whatever the plan's rate."""
    arrivals = np.sort(np.random.default_rng(seed).uniform(0, 200, 3000))
    status = _simulate(aggregated_plan({"phi-4": 5.0 * share}, served=share), arrivals)
    shed = int((status == "shed").sum())
    admitted = len(status) - shed
    assert admitted + shed == len(arrivals) and shed > 0
    assert admitted == int(np.floor(share * len(arrivals) + 1e-9))


def _thinned(arrivals: np.ndarray, share: float) -> np.ndarray:
    """The stream thinned evenly to `share` of its requests (every request whose index crosses a multiple of
    1/share), so any run of k consecutive requests keeps within one of share × k."""
    k = np.arange(len(arrivals))
    return arrivals[np.floor((k + 1) * share) > np.floor(k * share)]


def _largest_backlog(arrivals: np.ndarray, rate: float) -> float:
    """Independently of the code: the most requests any stretch [a_i, a_j] holds above `rate` × its length, by
    a prefix minimum over the stretch starts (j + 1 − rate·a_j) − (i − rate·a_i)."""
    k = np.arange(len(arrivals))
    end = k + 1 - rate * arrivals
    return float(np.max(end - np.minimum.accumulate(k - rate * arrivals)))


@pytest.mark.parametrize("share", [0.5, 0.76])
def test_the_trace_is_admitted_its_share_exactly_and_a_burst_past_capacity_is_cut(share):
    """A plan serving `share` of phi-4's 10 req/s on the Azure conversation trace (capacity factors 4 and 6): each
    bucket's depth is within rounding of the share-thinned trace's largest backlog over two loops (every stretch of
    the looped trace) against its rate; the trace as the simulator replays it (three starting rows, one loop each)
    is admitted exactly as an even thinning to the share picks its requests (the second bucket never bites at the
    plan's rate); a stream at 2× the admitted rate for 3,000 s is admitted ⌊share × arrivals⌋ (its share, the
    capacity holding 4× the admitted rate); a burst far above the rate the plan's capacity carries is cut to the
    second bucket's closed form (depth + rate × span, to one request)."""
    from coral_dagster.allocation.capacity import trace_period_s
    from coral_dagster.allocation.planner import with_admission
    from coral_dagster.simulator.workload import ModelLoad, make_workload

    factors = {("phi-4", "prefill"): 4.0, ("phi-4", "decode"): 6.0}
    phi4 = next(m for m in load_scenario("core").models if m.model == "phi-4")
    plan = with_admission(aggregated_plan({}, served=share, factors=factors), {"phi-4": 10.0}, [phi4])
    rate, depth = plan.admission.admit_req_s["phi-4"], plan.admission.admit_depth_req["phi-4"]
    peak_rate, peak_depth = plan.admission.admit_peak["phi-4"]
    assert rate == pytest.approx(10.0 * share) and peak_rate == pytest.approx(4.0 * rate)
    period_s = trace_period_s("azure-conv", 10.0)
    worst, worst_peak = 0.0, 0.0
    for seed in (0, 1, 2):
        trace = make_workload([ModelLoad("phi-4", "azure-conv", 10.0)], 2 * period_s, seed).arrival_s
        thinned = _thinned(trace, share)
        one_loop = trace[trace < period_s]
        assert np.array_equal(one_loop[_simulate(plan, one_loop) != "shed"], _thinned(one_loop, share))
        worst = max(worst, _largest_backlog(thinned, rate))
        worst_peak = max(worst_peak, _largest_backlog(thinned, peak_rate))
    assert worst <= depth <= worst + 3.0 and worst_peak <= peak_depth <= worst_peak + 3.0
    overload = np.sort(np.random.default_rng(5).uniform(0, 3000.0, int(2 * rate * 3000.0)))
    admitted = int((_simulate(plan, overload) != "shed").sum())
    assert admitted == int(np.floor(share * len(overload) + 1e-9))
    burst = np.linspace(0.0, 10.0, 2001)
    admitted = int((_simulate(plan, burst) != "shed").sum())
    assert admitted == pytest.approx(peak_depth + peak_rate * 10.0, abs=1.0)


def test_a_model_served_in_full_or_unlimited_is_never_shed():
    arrivals = np.arange(1000) / 5.0  # exactly 5 req/s
    assert not (_simulate(aggregated_plan({"phi-4": 5.0}, served=1.0), arrivals) == "shed").any()
    assert not (_simulate(aggregated_plan({}), arrivals * 0.01) == "shed").any()


def test_coordinator_sheds_the_same_requests_with_429():
    """The coordinator, fed the same arrival times, sheds exactly the requests the simulator sheds, each with a
    429 that says when to retry."""
    import zmq

    from coral_dagster.runtime.config import CoordinatorConfig
    from coral_dagster.runtime.coordinator import Coordinator

    arrivals = np.sort(np.random.default_rng(4).uniform(0, 60, 900))
    made = aggregated_plan({"phi-4": 5.0}, {"phi-4": 40.0}, served=0.4)
    plan = replace(made, admission=replace(made.admission, admit_peak={"phi-4": (12.0, 4.0)}))
    simulated = _simulate(plan, arrivals) == "shed"
    ctx = zmq.Context()
    coord = Coordinator(CoordinatorConfig(listen="tcp://127.0.0.1:0", http_port=None, admit_req_s={"phi-4": 5.0},
                                          admit_depth_req={"phi-4": 40.0}, admit_peak={"phi-4": (12.0, 4.0)},
                                          admit_share={"phi-4": 0.4}),
                        insecure=True, ctx=ctx)
    errors = []
    coord._finish_error = lambda r, problem, fix, status, **extra: errors.append((r.rid, status, extra, problem))
    coord._dispatch = lambda r, now: None
    try:
        for k, t in enumerate(arrivals.tolist()):
            coord._submit(coord.front, b"c", {"model": "phi-4", "prompt_tokens": [1, 2], "max_tokens": 2}, t)
        shed_ids = {rid for rid, status, extra, _ in errors if status == 429 and extra["type"] == "rate_limited"}
        assert all(extra["retry_after_s"] >= 0 for _, _, extra, _ in errors)
        assert all("40.0% of the requests it sends (5 req/s at the plan's demand), saving up to 40 requests' "
                   "credit, at most 12 req/s over 4 requests" in problem for *_, problem in errors)
        assert shed_ids == {f"req-{coord.incarnation}-{k}" for k in np.flatnonzero(simulated)}
    finally:
        coord.router.close(linger=0)
        coord.front.close(linger=0)
        ctx.term()


def test_the_plan_admission_is_stored_reaches_the_coordinator_task_and_reads_back(tmp_path):
    """The plan's rates and depths survive the store (detail_json); deploy writes them into the coordinator's
    CORAL_ADMIT, which `--admit` parses back exactly; a malformed entry is a CoralError naming the form."""
    from coral_dagster.allocation.storage import load_plan, store_plan
    from coral_dagster.deploy.spec import build_coordinator
    from coral_dagster.runtime.config import parse_admit
    from coral_dagster.store import Store

    store = Store(str(tmp_path / "admit.duckdb"))
    admission = ({"phi-4": 4.7, "qwen3-32b": 1.0 / 3.0}, {"phi-4": 812.0}, {"phi-4": (18.8, 9.0)})
    made = aggregated_plan(admission[0], admission[1])
    made = replace(made, admission=replace(made.admission, admit_peak=admission[2]))
    plan = load_plan(store, store_plan(store, made, "r", {}).plan_id)
    adm = plan.admission
    assert (adm.admit_req_s, adm.admit_depth_req, adm.admit_peak) == admission
    envs = dict(build_coordinator("p1", "r", (), plan).envs)
    assert parse_admit(envs["CORAL_ADMIT"])[:3] == admission
    assert "CORAL_ADMIT" not in dict(build_coordinator("p1", "r", (), aggregated_plan({})).envs)
    for bad in ("phi-4", "phi-4=x", "phi-4=1:-2", "=3", "phi-4=1:2:3", "phi-4=1@1.5", "phi-4=1@x", "phi-4=1:2@"):
        with pytest.raises(CoralError, match="model=rate"):
            parse_admit(bad)


def test_admit_text_reads_old_entries_as_rates_and_shares_after_an_at():
    """`--admit` written before shares still reads (no share: the first bucket refills at the rate); `@share` adds
    the share, and what `format_admit` writes `parse_admit` reads back exactly, into the same text."""
    from coral_dagster.runtime.config import format_admit, parse_admit

    assert parse_admit("phi-4=4.5:800:20:9,qwen3-32b=2") == (
        {"phi-4": 4.5, "qwen3-32b": 2.0}, {"phi-4": 800.0}, {"phi-4": (20.0, 9.0)}, {})
    limits = ({"phi-4": 4.5, "qwen3-32b": 1.0 / 3.0, "gpt-oss-20b": 0.0}, {"phi-4": 800.0}, {"phi-4": (20.0, 9.0)},
              {"phi-4": 0.54123, "qwen3-32b": 1.0 / 7.0, "gpt-oss-20b": 0.0})
    text = format_admit(*limits)
    assert "phi-4=4.5:800.0:20.0:9.0@0.54123" in text.split(",")
    assert parse_admit(text) == limits and format_admit(*parse_admit(text)) == text


def test_bucket_retry_after_is_the_time_to_the_next_token():
    a = Admission({"m": 2.0}, burst_s=0.5)
    assert a.admit("m", 0.0) and not a.admit("m", 0.0)
    assert a.retry_after_s("m", 0.0) == pytest.approx(0.5)
    assert a.admit("m", 0.5) and a.admit("other", 0.0)


def test_a_model_the_plan_serves_none_of_is_always_shed():
    """A plan serving 0% of a model admits none of its requests (no instance could serve one), from the first."""
    arrivals = np.arange(50) / 5.0
    assert (_simulate(aggregated_plan({"phi-4": 0.0}), arrivals) == "shed").all()
    assert Admission({"m": 0.0}).retry_after_s("m", 0.0) == 60.0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.0, 1.0), min_size=2, max_size=2), st.lists(st.floats(0.0, 0.5), min_size=2,
                                                                       max_size=2), st.integers(1, 4))
def test_closed_loop_is_bounded_and_never_worse_than_its_start(start, gain, rounds):
    """Whatever a model's simulated attainment does as its capacity rises (here linear in its boost, made up by
    Hypothesis), the loop makes at most `rounds` plans, returns one that meets every target when some round
    did (the cheapest such), and never one with a larger worst shortfall than round 0's."""
    scn = load_scenario("core")
    models = [m.model for m in scn.models][:2]
    scn = replace(scn, models=tuple(m for m in scn.models if m.model in models))
    base = aggregated_plan({})

    def make(boost):
        return replace(base, cost_usd_per_hour=sum(boost.get(m, 1.0) for m in models))

    def measure(plan, scenario, rates, simulate_s, seeds):
        return {m: min(1.0, start[i] + gain[i] * (plan.cost_usd_per_hour - len(models))) for i, m in
                enumerate(models)}

    rates = {m: 1.0 for m in models}
    chosen, history = closed_loop(make, scn, rates, rounds=rounds, measure=measure)
    targets = {m.model: m.attainment_target for m in scn.models}
    assert 1 <= len(history) <= rounds
    assert chosen.expected_attainment and "closed loop round" in chosen.expected_from
    shortfall = max([0.0] + [targets[m] - a for m, a in chosen.expected_attainment.items()])
    assert shortfall <= history[0].shortfall(targets) + 1e-12
    meeting = [r for r in history if r.shortfall(targets) == 0]
    if meeting:
        assert shortfall == 0 and chosen.cost_usd_per_hour == min(r.plan.cost_usd_per_hour for r in meeting)


def test_closed_loop_keeps_its_rounds_when_a_later_round_finds_no_plan():
    """A re-plan that hits the solver limit ends the loop with the best plan so far, the reason in its notes; a
    first round that finds no plan is the caller's error."""
    scn = load_scenario("core")
    base = aggregated_plan({})
    calls = []

    def make(boost):
        calls.append(dict(boost))
        if len(calls) > 1:
            raise CoralError("the coral allocation ILP found no plan within 30 s.", "raise the time limit.")
        return replace(base, cost_usd_per_hour=1.0)

    rates = {m.model: 1.0 for m in scn.models}
    chosen, history = closed_loop(make, scn, rates, rounds=3, measure=lambda *a: {m: 0.5 for m in rates})
    assert len(history) == 1 and len(calls) == 2
    assert chosen.cost_usd_per_hour == 1.0 and "round 2 found no plan" in chosen.notes[-1]
    with pytest.raises(CoralError):
        closed_loop(lambda boost: make(boost), scn, rates, measure=lambda *a: {})
