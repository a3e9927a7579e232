"""No single coordinator in `coral serve local`: kill -9 of the serving coordinator under load; a warm standby takes
over the same endpoint (its ports, or, as `coral launch` deploys the pair, behind HAProxy on ports of its own), new
requests succeed within 10 s, and none is answered twice."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest

from coral_dagster.runtime.config import Timing
from coral_dagster.runtime.generate import generate
from coral_dagster.runtime.local import LocalDeployment, local_instances

httpx = pytest.importorskip("httpx")
pytest.importorskip("torch")

MODEL = "tiny-llama"
TIMING = Timing(heartbeat_s=0.2, dead_after_s=3.0, request_timeout_s=30.0)
PROMPTS = [f"load {k}" for k in range(4)]


def _load(url: str, api_key: str, stop: threading.Event, results: list[dict], worker: int) -> None:
    """Post completions one after another until `stop`; record each one's start, end, status and text."""
    k = 0
    while not stop.is_set():
        prompt = PROMPTS[(worker + k) % len(PROMPTS)]
        k += 1
        started = time.monotonic()
        try:
            r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4,
                                                          "temperature": 0},
                           headers={"Authorization": f"Bearer {api_key}"}, timeout=30)
            outcome = {"status": r.status_code, "text": r.json()["choices"][0]["text"] if r.status_code == 200
                       else None}
        except httpx.HTTPError as exc:
            outcome = {"status": None, "text": None, "error": type(exc).__name__}
            time.sleep(0.05)
        results.append({"prompt": prompt, "started": started, "ended": time.monotonic(), **outcome})


@pytest.mark.slow
@pytest.mark.parametrize("endpoint", [False, True], ids=["same-ports", "haproxy"])
def test_a_killed_coordinator_is_replaced_on_the_same_endpoint_under_load(tmp_path, endpoint):
    expected = {p: generate(MODEL, p, 4).text for p in PROMPTS}
    results: list[dict] = []
    stop = threading.Event()
    with LocalDeployment(MODEL, local_instances((12,), 2), timing=TIMING, log_dir=tmp_path, restart=False,
                         standby=True, endpoint=endpoint) as dep:
        dep.wait_ready(90)
        workers = [threading.Thread(target=_load, args=(dep.http_url, dep.api_key, stop, results, w), daemon=True)
                   for w in range(3)]
        for w in workers:
            w.start()
        try:
            time.sleep(3.0)
            before = len([r for r in results if r["status"] == 200])
            primary = dep.procs["coordinator"].pid
            killed = time.monotonic()
            os.kill(primary, signal.SIGKILL)
            time.sleep(15.0)
        finally:
            stop.set()
            for w in workers:
                w.join(timeout=40)
        with dep.client(timeout_s=10) as c:
            status = c.wait_ready(2, timeout_s=30)
        promoted = dep.procs["coordinator"].pid
        standbys = [n for n in dep.procs if n.startswith("coordinator.standby") and dep.alive(n)]
    assert before > 0 and promoted != primary and len(standbys) == 1
    # Every answer is the model's own: nothing mixed, nothing doubled.
    ok = [r for r in results if r["status"] == 200]
    assert all(r["text"] == expected[r["prompt"]] for r in ok)
    # New requests succeed within 10 s of the kill, and every request started 10 s after it succeeds.
    after = [r for r in ok if r["started"] > killed]
    assert after and min(r["ended"] for r in after) - killed < 10.0
    late = [r for r in results if r["started"] > killed + 10.0]
    assert late and all(r["status"] == 200 for r in late), [r for r in late if r["status"] != 200]
    # The new coordinator completed exactly the requests sent to it: each answered once, none from the dead one's.
    # Behind HAProxy, which retries a request whose connection to the dead one failed before anything was sent,
    # those are the ones its own log shows the standby answering (one may have started just before the kill).
    sent = _answered_by_standby(tmp_path / "endpoint.log") if endpoint else len(after)
    assert status["counts"]["completed"] == sent >= len(after)


def _answered_by_standby(log: Path) -> int:
    """Requests HAProxy's log shows the standby server answering with 200."""
    lines = [m.groups() for m in re.finditer(r" coral coordinators/(\S+) \S+ (\d{3}) ", log.read_text())]
    return sum(server == "standby1" and code == "200" for server, code in lines)
