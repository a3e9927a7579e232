"""Liveness independent of compute, on real processes over ZeroMQ: a long forward pass is not a death, a killed and
quickly restarted process is one, and its in-flight requests resume on another instance at once; work-aware
progress: a heavy valid request is prefilled in chunks and never holds up a light one, and an instance holding work
without progress is "degraded" on /health."""

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


def _light_and_heavy(url: str, api_key: str, heavy: dict, light: dict) -> tuple[dict, float, dict, float]:
    """Post `heavy`, then `light` a moment later, concurrently; each answer's JSON and seconds from its own start."""
    import concurrent.futures

    import httpx

    def post(body: dict, delay_s: float) -> tuple[dict, float]:
        time.sleep(delay_s)
        started = time.monotonic()
        r = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {api_key}"},
                       timeout=600)
        return {"status": r.status_code, **r.json()}, time.monotonic() - started

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        heavy_f, light_f = pool.submit(post, heavy, 0.0), pool.submit(post, light, 3.0)
        (heavy_answer, heavy_s), (light_answer, light_s) = heavy_f.result(), light_f.result()
    return heavy_answer, heavy_s, light_answer, light_s


@pytest.mark.slow
def test_a_heavy_valid_request_completes_and_never_holds_up_a_light_one(tmp_path):
    """`serve local --instances 2`: n=8 copies of a 4,094-byte prompt (inside every limit), and a 2-token request
    sent while they prefill. Before chunked prefill, each instance ran 4 × 4,094 prompt tokens as one quadratic
    pass of minutes: the light request waited behind it and the heavy one failed after 2 × 60 s without progress.
    The oracle for "promptly": the light request alone on an idle instance takes well under a second; it may wait
    for the prefill chunks already in flight (a budget of PREFILL_BUDGET_TOKENS), never for the heavy request."""
    from coral_dagster.runtime.scheduler import PREFILL_BUDGET_TOKENS

    prompt = "".join(chr(97 + (7 * i) % 26) for i in range(4094))
    heavy = {"model": MODEL, "prompt": prompt, "n": 8, "max_tokens": 1}
    light = {"model": MODEL, "prompt": "hello", "max_tokens": 2, "temperature": 0}
    expected = generate(MODEL, "hello", 2)
    with LocalDeployment(MODEL, local_instances((12,), 2), log_dir=tmp_path, restart=False) as dep:
        dep.wait_ready(90)
        h, heavy_s, lt, light_s = _light_and_heavy(dep.http_url, dep.api_key, heavy, light)
        with dep.client() as c:
            status = c.status()
    assert lt["status"] == 200 and lt["choices"][0]["text"] == expected.text
    assert h["status"] == 200 and len(h["choices"]) == 8, h
    # The light request finished long before the heavy one: it shared the stages, it did not queue behind them.
    assert light_s < 30 and light_s < heavy_s / 3, (light_s, heavy_s)
    assert status["counts"]["failed"] == 0 and status["counts"]["retried"] == 0
    assert PREFILL_BUDGET_TOKENS < 4094


def test_an_instance_holding_work_without_progress_is_degraded_on_health_and_recovers(tmp_path):
    """An engine node frozen (SIGSTOP) mid-request: the scheduler still sees it (silence takes 30 s here), but no
    token comes; within a quarter of the progress limit /health says "degraded", and "ok" once it runs again."""
    import os
    import signal

    import httpx

    timing = Timing(heartbeat_s=0.2, dead_after_s=30.0, request_timeout_s=8.0)
    with LocalDeployment(MODEL, local_instances((12,), 1), timing=timing, log_dir=tmp_path, restart=False) as dep:
        dep.wait_ready(60)
        health = lambda: httpx.get(f"{dep.http_url}/health", timeout=10).json()  # noqa: E731
        assert health()["status"] == "ok"
        node = dep.procs["agg-0.s0.n0"].pid
        with dep.client(timeout_s=60) as c:
            tag, _ = decoding(c, MODEL, LONG, 2000)
            os.kill(node, signal.SIGSTOP)
            try:
                frozen = time.monotonic()
                while (h := health())["status"] != "degraded":
                    assert time.monotonic() - frozen < timing.request_timeout_s, h
                    time.sleep(0.2)
                assert h["degraded"] == ["agg-0"] and c.status()["instances"][0]["progress"] == "degraded"
            finally:
                os.kill(node, signal.SIGCONT)
            while (h := health())["status"] != "ok":
                assert time.monotonic() - frozen < 2 * timing.request_timeout_s, h
                time.sleep(0.2)


@pytest.mark.parametrize("pd", [False, True], ids=["aggregated", "pd-handoff"])
def test_a_prompt_sent_in_chunks_through_two_stages_decodes_as_the_model_alone_does(tmp_path, pd):
    """A 700-token prompt crosses PREFILL_CHUNK_TOKENS: its chunks go through both stages (and, with PD, the KV of
    all of them is handed over with the last); the tokens are those of the whole model run in one process."""
    from coral_dagster.runtime.scheduler import PREFILL_CHUNK_TOKENS

    prompt = "".join(chr(97 + (5 * i) % 26) for i in range(700))
    assert len(prompt) > 2 * PREFILL_CHUNK_TOKENS
    expected = generate(MODEL, prompt, 3, ignore_eos=True)
    with LocalDeployment(MODEL, local_instances((6, 6), 2, pd=pd), log_dir=tmp_path, restart=False) as dep:
        dep.wait_ready(120)
        with dep.client(timeout_s=120) as c:
            done = c.complete(MODEL, [prompt], max_tokens=3, ignore_eos=True)[0]
    assert done["kind"] == "done" and done["tokens"] == list(expected.tokens) and done["attempts"] == 1
