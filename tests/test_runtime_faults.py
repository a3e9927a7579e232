"""Drain and failure on real local processes: bounded detection, resumed or clearly failed requests, no hangs."""

from __future__ import annotations

import time

import pytest

from coral_dagster.runtime.client import FINAL, Client
from coral_dagster.runtime.config import Timing
from coral_dagster.runtime.generate import generate
from coral_dagster.runtime.local import LocalDeployment, local_instances
from support.runtime_fakes import decoding

pytest.importorskip("torch")

MODEL = "tiny-llama"
FAST = Timing(heartbeat_s=0.2, dead_after_s=1.5, request_timeout_s=20.0, kv_timeout_s=5.0)
# Longest a dead engine may go unnoticed: its heartbeat timeout plus one scheduler and one status round.
DETECT_BOUND_S = FAST.dead_after_s + 3 * FAST.heartbeat_s + 0.5
LONG = "a long request that is still decoding when something happens"
SHORT = ["one", "two", "three", "four"]


def _final(c: Client, tag: str) -> dict:
    return [e for e in c.events([tag]) if e["kind"] in FINAL][0]


def _start_long(c: Client, max_tokens: int) -> tuple[str, str]:
    """Submit the long request and wait until it is decoding; returns (tag, its instance)."""
    return decoding(c, MODEL, LONG, max_tokens)


def _wait(predicate, timeout_s: float, poll_s: float = 0.05) -> float:
    """Seconds until `predicate()` holds; fails the test past `timeout_s`."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout_s, f"condition not met within {timeout_s} s"
        time.sleep(poll_s)
    return time.monotonic() - start


def _state(c: Client, name: str) -> str | None:
    return next((i["state"] for i in c.status()["instances"] if i["instance"] == name), None)


def test_drain_finishes_in_flight_work_takes_none_new_and_leaves(tmp_path):
    expected = generate(MODEL, LONG, 150, ignore_eos=True)
    with LocalDeployment(MODEL, local_instances((6, 6), 2), timing=FAST, log_dir=tmp_path) as dep:
        dep.wait_ready(60)
        with dep.client(timeout_s=30) as c:
            tag, victim = _start_long(c, 150)
            other = ({"agg-0", "agg-1"} - {victim}).pop()
            assert c.drain(victim)["in_flight"] == 1
            news = c.complete(MODEL, SHORT, max_tokens=4)
            assert [e["kind"] for e in news] == ["done"] * 4 and all(e["instances"] == [other] for e in news)
            done = _final(c, tag)
            assert done["kind"] == "done" and done["tokens"] == list(expected.tokens)
            assert done["instances"] == [victim] and done["attempts"] == 1
            _wait(lambda: victim in c.status()["departed"], 10)
            procs = [n for n in dep.procs if n.startswith(victim + ".")]
            _wait(lambda: not any(dep.alive(n) for n in procs), 10)
            counts = c.status()["counts"]
            assert counts == {"submitted": 5, "completed": 5, "failed": 0, "retried": 0, "abandoned": 0}


def test_killed_engine_is_detected_in_bounded_time_and_work_resumes_or_fails_clearly(tmp_path):
    expected = generate(MODEL, LONG, 150, ignore_eos=True)
    with LocalDeployment(MODEL, local_instances((6, 6), 2), timing=FAST, max_retries=1,
                         log_dir=tmp_path, restart=False) as dep:
        dep.wait_ready(60)
        with dep.client(timeout_s=30) as c:
            tag, victim = _start_long(c, 150)
            survivor = ({"agg-0", "agg-1"} - {victim}).pop()
            dep.kill(f"{victim}.s1.n0")
            assert _wait(lambda: _state(c, victim) == "unhealthy", DETECT_BOUND_S) <= DETECT_BOUND_S

            # The in-flight request resumes on the survivor from the tokens it already streamed.
            done = _final(c, tag)
            assert done["kind"] == "done" and done["tokens"] == list(expected.tokens)
            assert done["instances"] == [victim, survivor] and done["attempts"] == 2
            news = c.complete(MODEL, SHORT, max_tokens=4)
            assert all(e["kind"] == "done" and e["instances"] == [survivor] for e in news)

            # With no healthy instance left, the in-flight request fails naming the node, new ones fail at once.
            tag, _ = _start_long(c, 150)
            dep.kill(f"{survivor}.s0.n0")
            started = time.monotonic()
            failed = _final(c, tag)
            assert time.monotonic() - started <= DETECT_BOUND_S
            assert failed["kind"] == "error" and f"{survivor}.s0.n0" in failed["problem"]
            assert "stopped responding" in failed["problem"] and failed["fix"] and failed["status"] == 503
            started = time.monotonic()
            refused = c.complete(MODEL, ["x"], max_tokens=2)[0]
            assert refused["kind"] == "error" and "no ready instance" in refused["problem"]
            assert time.monotonic() - started < 1.0

            # A scheduler that dies is noticed by the coordinator's own heartbeat check.
            dep.kill(f"{survivor}.scheduler")
            assert _wait(lambda: _state(c, survivor) == "lost", DETECT_BOUND_S) <= DETECT_BOUND_S
            counts = c.status()["counts"]
            assert counts["submitted"] == counts["completed"] + counts["failed"] == 7
