"""The front door's start and end: readiness that means a request would be served (PD needs a prefill and a decode
instance), and a shutdown that answers 503 with Retry-After instead of cutting requests off."""

from __future__ import annotations

import json
import threading
import time
from contextlib import ExitStack

import httpx
import pytest

import zmq

from coral_dagster.runtime.config import CoordinatorConfig, NodeSettings, SchedulerConfig, Timing
from coral_dagster.runtime.coordinator import Coordinator
from coral_dagster.runtime.frontdoor import DRAIN_S, RETRY_AFTER_S
from coral_dagster.runtime.limits import ModelLimits
from coral_dagster.runtime.local import LocalDeployment, free_port, local_instances
from coral_dagster.runtime.node import EngineNode
from coral_dagster.runtime.scheduler import Scheduler
from coral_dagster.runtime.security import CurveKeys
from support.runtime_fakes import background
from support.runtime_procs import gone, kill_all, remember

pytest.importorskip("coral_dagster.runtime.torch_engine")
from support.openai_stack import CFG, KEY, MODEL, PROMPT, TIMING, CountingEngine, Served  # noqa: E402 - needs torch

AUTH = {"Authorization": f"Bearer {KEY}"}


def test_shutdown_drains_short_requests_and_answers_the_rest_503_with_retry_after():
    with ExitStack() as stack:
        served = Served(stack)
        results: dict[str, object] = {}
        long_body = {"model": MODEL, "prompt": PROMPT, "max_tokens": CFG.max_context - 64, "ignore_eos": True}

        def post(name: str, body: dict, stream: bool = False) -> None:
            with httpx.Client(timeout=60) as c:
                if stream:
                    with c.stream("POST", f"{served.url}/v1/completions", json={**body, "stream": True},
                                  headers=AUTH) as r:
                        results[name] = (r.status_code, [line for line in r.iter_lines() if line])
                else:
                    r = c.post(f"{served.url}/v1/completions", json=body, headers=AUTH)
                    results[name] = (r.status_code, r.headers.get("retry-after"), r.json())

        threads = [threading.Thread(target=post, args=("long", long_body)),
                   threading.Thread(target=post, args=("long-stream", long_body, True))]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while served.coord.status()["in_flight"] < 2:
            assert time.monotonic() < deadline, "the long requests never started"
            time.sleep(0.05)
        short = threading.Thread(target=post, args=("short", {"model": MODEL, "prompt": PROMPT, "max_tokens": 8,
                                                              "ignore_eos": True}))
        short.start()
        while served.coord.status()["in_flight"] < 3 and short.is_alive():
            time.sleep(0.01)
        # What SIGTERM/SIGINT does in `coral serve coordinator` (roles.stop_on_signals sets this event).
        stopped_at = time.monotonic()
        served.stop.set()
        time.sleep(0.2)
        late = httpx.post(f"{served.url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1},
                          headers=AUTH, timeout=10)
        assert late.status_code == 503 and late.headers["retry-after"] == str(RETRY_AFTER_S)
        assert late.json()["error"]["code"] == 503
        for t in (*threads, short):
            t.join(timeout=60)
        served.thread.join(timeout=30)
        assert time.monotonic() - stopped_at < DRAIN_S + 10
        # The short request finished during the drain; the long ones got a 503 (JSON, or the stream's last event).
        assert results["short"][0] == 200 and results["short"][2]["usage"]["completion_tokens"] == 8
        status, retry, body = results["long"]
        assert (status, retry) == (503, str(RETRY_AFTER_S)) and body["error"]["type"] == "service_unavailable"
        status, lines = results["long-stream"]
        last = json.loads(lines[-1].removeprefix("data: "))
        assert status == 200 and last["error"]["code"] == 503 and "[DONE]" not in lines[-1]


def _instance(stack: ExitStack, keys: CurveKeys, coordinator: str, name: str, phase: str) -> CountingEngine:
    """A real scheduler of `phase` with one torch engine node holding every layer, on threads; its engine."""
    sched = Scheduler(SchedulerConfig(name, MODEL, phase, (CFG.n_layers,), CFG.n_layers, coordinator,
                                      listen="tcp://127.0.0.1:*", timing=TIMING,
                                      limits=ModelLimits(CFG.vocab, CFG.max_context)), keys, ctx=zmq.Context())
    background(stack, sched.run)
    engine = CountingEngine(CFG, 0, CFG.n_layers, device="cpu")
    node = EngineNode(NodeSettings(f"{name}.s0", MODEL, 0, CFG.n_layers, CFG.n_layers, 0, sched.address,
                                   timing=TIMING), engine, keys, ctx=zmq.Context())
    background(stack, node.run)
    return engine


def test_a_prefill_instance_without_its_decode_partner_is_not_ready():
    """The case readiness lied about: a PD model with its prefill instance up and no decode instance yet is
    neither on /health nor in /v1/models, and completions then are 503; once the decode instance is up, both
    say so and every completion is served."""
    keys = CurveKeys.generate()
    port = free_port()
    with ExitStack() as stack:
        ctx = zmq.Context()
        stack.callback(ctx.term)
        coord = Coordinator(CoordinatorConfig(listen="tcp://127.0.0.1:*", http_port=port, api_key=KEY, timing=TIMING,
                                              models=(MODEL,)), keys, ctx=ctx)
        background(stack, coord.run)
        url = f"http://127.0.0.1:{port}"
        _instance(stack, keys, coord.address, "prefill-0", "prefill")
        deadline = time.monotonic() + 30
        while not any(i["state"] == "ready" for i in coord.status()["instances"]):
            assert time.monotonic() < deadline, "the prefill instance never registered"
            time.sleep(0.05)
        for _ in range(10):
            assert httpx.get(f"{url}/health").status_code == 503
            assert httpx.get(f"{url}/v1/models", headers=AUTH).status_code == 503
            time.sleep(0.05)
        decode = _instance(stack, keys, coord.address, "decode-0", "decode")
        while httpx.get(f"{url}/health").status_code != 200:
            assert time.monotonic() < deadline, "never ready with both phases up"
            time.sleep(0.02)
        assert [m["id"] for m in httpx.get(f"{url}/v1/models", headers=AUTH).json()["data"]] == [MODEL]
        codes = [httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=30,
                            json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2}).status_code for _ in range(5)]
        assert codes == [200] * 5
        # A client hanging up mid-stream stops the decode instance's generation too.
        budget = CFG.max_context - 64
        with httpx.stream("POST", f"{url}/v1/completions", headers=AUTH, timeout=30, json={
                "model": MODEL, "prompt": PROMPT, "max_tokens": budget, "ignore_eos": True, "stream": True}) as r:
            lines = 0
            for line in r.iter_lines():
                lines += bool(line)
                if lines == 5:
                    break
        deadline = time.monotonic() + 30
        while coord.status()["in_flight"] or time.monotonic() - decode.last_step < 1.0:
            assert time.monotonic() < deadline, "the decode instance kept generating after the client left"
            time.sleep(0.1)
        assert max(decode.steps.values()) < budget // 4


def test_pd_readiness_means_a_request_is_served():
    """Poll /health and /v1/models while a PD deployment starts: once either says the model is served, every
    completion is answered (none gets the 503 a prefill instance without its decode partner gave)."""
    dep = LocalDeployment(MODEL, local_instances((6, 6), 2, pd=True),
                          timing=Timing(heartbeat_s=0.1, dead_after_s=3.0, request_timeout_s=30.0))
    pids: list[int] = []
    try:
        dep.start()
        pids = [p.pid for p in dep.procs.values()]
        remember(pids)
        auth = {"Authorization": f"Bearer {dep.api_key}"}
        deadline = time.monotonic() + 120
        seen: list[tuple[str, int]] = []
        after_ready: list[int] = []
        with httpx.Client(timeout=30) as c:
            while time.monotonic() < deadline and len(after_ready) < 20:
                try:
                    health = c.get(f"{dep.http_url}/health").status_code
                    models = c.get(f"{dep.http_url}/v1/models", headers=auth)
                except httpx.TransportError:  # not listening yet: poll, not spin (2 cores boot the stages)
                    time.sleep(0.02)
                    continue
                ready = health == 200 or (models.status_code == 200 and models.json()["data"])
                seen.append(("ready" if ready else "not ready", health))
                if ready or after_ready:
                    r = c.post(f"{dep.http_url}/v1/completions", headers=auth,
                               json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2})
                    after_ready.append(r.status_code)
                else:
                    time.sleep(0.02)
        assert after_ready, f"never ready: {seen[-5:]}"
        assert set(after_ready) == {200}, after_ready
    finally:
        dep.stop()
        time.sleep(0.5)
        left = [p for p in pids if not gone(p)]
        kill_all(left)
        assert not left, f"processes left behind: {left}"
