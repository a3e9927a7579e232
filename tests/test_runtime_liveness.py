"""Liveness independent of compute, on real processes over ZeroMQ: a long forward pass is not a death, a killed and
quickly restarted process is one, and its in-flight requests resume on another instance at once."""

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
LONG = "a long request that is still decoding when its process is killed"
# The restart path alone must notice a replaced process: silence would take 30 s to count.
RESTART = Timing(heartbeat_s=0.2, dead_after_s=30.0, request_timeout_s=60.0, kv_timeout_s=5.0)


def _final(c: Client, tag: str, timeout_s: float = 60.0) -> dict:
    return [e for e in c.events([tag], timeout_s) if e["kind"] in FINAL][0]


def test_a_forward_pass_longer_than_the_dead_after_limit_does_not_kill_its_node(tmp_path):
    """One stage holds every layer; a 2,048-token prompt's prefill holds its engine's loop for seconds."""
    timing = Timing(heartbeat_s=0.2, dead_after_s=1.0, request_timeout_s=120.0)
    prompt = [(7 * i) % 500 for i in range(2048)]
    with LocalDeployment(MODEL, local_instances((12,), 2), timing=timing, log_dir=tmp_path, restart=False) as dep:
        dep.wait_ready(60)
        with dep.client(timeout_s=120) as c:
            tag = c.submit(MODEL, prompt_tokens=prompt, max_tokens=2, ignore_eos=True)
            accepted = c.next_event({tag})
            started = time.monotonic()
            first = c.next_event({tag}, timeout_s=120)
            prefill_s = time.monotonic() - started
            done = _final(c, tag, 120)
            status = c.status()
    # The case under test happened: the forward outlasted the limit a silent node is dead after.
    assert first["kind"] == "token" and prefill_s > timing.dead_after_s
    assert done["kind"] == "done" and done["attempts"] == 1 and done["instances"] == [accepted["instances"][
        "aggregated"]]
    assert {i["instance"]: i["state"] for i in status["instances"]} == {"agg-0": "ready", "agg-1": "ready"}
    assert status["counts"] == {"submitted": 1, "completed": 1, "failed": 0, "retried": 0, "abandoned": 0}
    assert "stopped responding" not in (tmp_path / f"{accepted['instances']['aggregated']}.scheduler.log").read_text()


@pytest.mark.parametrize("victim_role", ["s1.n0", "scheduler"])
def test_a_process_killed_and_restarted_at_once_sends_its_requests_to_the_other_instance(tmp_path, victim_role):
    expected = generate(MODEL, LONG, 120, ignore_eos=True)
    with LocalDeployment(MODEL, local_instances((6, 6), 2), timing=RESTART, log_dir=tmp_path, restart=True,
                         backoff_s=0.01) as dep:
        dep.wait_ready(60)
        with dep.client(timeout_s=60) as c:
            tag, victim = decoding(c, MODEL, LONG, 120)
            survivor = ({"agg-0", "agg-1"} - {victim}).pop()
            old_pid = dep.procs[f"{victim}.{victim_role}"].pid
            killed = time.monotonic()
            dep.kill(f"{victim}.{victim_role}")
            done = _final(c, tag)
            moved_s = time.monotonic() - killed
            # It came back (restarted in well under the dead-after limit, so silence never marked it)...
            assert dep.procs[f"{victim}.{victim_role}"].pid != old_pid
            c.wait_ready(2, timeout_s=60)
            # ... and the request moved on at once, to the survivor only, from the tokens it had streamed.
            assert done["kind"] == "done" and done["tokens"] == list(expected.tokens)
            assert done["instances"] == [victim, survivor] and done["attempts"] == 2
            assert moved_s < RESTART.dead_after_s / 2
            news = c.complete(MODEL, ["one", "two", "three", "four"], max_tokens=3)
            assert all(e["kind"] == "done" for e in news)
            assert {e["instances"][0] for e in news} == {victim, survivor}


def test_a_request_whose_client_closed_without_cancelling_stops(tmp_path):
    """A client that goes away without a word (its cancel lost, its process killed): the next event the coordinator
    cannot deliver stops the request on its instance. Had it run on, it would end `completed`, not `abandoned`."""
    timing = Timing(heartbeat_s=0.2, dead_after_s=10.0, request_timeout_s=60.0)
    with LocalDeployment(MODEL, local_instances((12,), 1), timing=timing, log_dir=tmp_path, restart=False) as dep:
        dep.wait_ready(60)
        leaving = dep.client()
        tag = leaving.submit(MODEL, LONG, max_tokens=2000, ignore_eos=True)
        assert leaving.next_event({tag})["kind"] == "accepted"
        assert leaving.next_event({tag})["kind"] == "token"
        leaving.close()
        with dep.client() as c:
            deadline = time.monotonic() + 60
            while (status := c.status())["in_flight"]:
                assert time.monotonic() < deadline, status
                time.sleep(0.1)
    assert status["counts"] == {"submitted": 1, "completed": 0, "failed": 0, "retried": 0, "abandoned": 1}
    assert status["instances"][0]["in_flight"] == 0
