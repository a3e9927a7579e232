"""Protocol pieces in isolation: router weights, stage-node shares, a decode node waiting for its KV handoff."""

from __future__ import annotations

import time
from collections import Counter
from contextlib import ExitStack

import numpy as np
import pytest
import zmq

from coral_dagster.errors import CoralError
from coral_dagster.runtime import wire
from coral_dagster.runtime.client import Client
from coral_dagster.runtime.config import CoordinatorConfig, NodeSettings, SchedulerConfig, Timing
from coral_dagster.runtime.coordinator import Coordinator
from coral_dagster.runtime.engine import Step
from coral_dagster.runtime.scheduler import Scheduler
from coral_dagster.runtime.tokenizer import ByteTokenizer
from support.runtime_fakes import FakeScheduler, background

TIMING = Timing(heartbeat_s=0.1, dead_after_s=1.0, request_timeout_s=10.0, kv_timeout_s=0.5)


def _recv(sock: zmq.Socket, timeout_s: float = 5.0, routed: bool = False):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sock.poll(100)
        for msg in wire.drain(sock, routed=routed, limit=1):
            return msg
    raise AssertionError(f"no message within {timeout_s} s")



def test_router_shares_requests_by_template_throughput():
    """Weights 3 and 1 tok/s: over 40 requests exactly 30 and 10 (smooth WRR is exact over whole cycles)."""
    with ExitStack() as stack:
        ctx = zmq.Context()
        stack.callback(ctx.term)
        coord = Coordinator(CoordinatorConfig(listen="tcp://127.0.0.1:*", http_port=None, timing=TIMING), ctx=ctx,
                            insecure=True)
        background(stack, coord.run)
        background(stack, FakeScheduler(coord.address, "fast", tokens_per_s=3.0).run)
        background(stack, FakeScheduler(coord.address, "slow", tokens_per_s=1.0).run)
        c = Client(coord.address, ctx=ctx, timeout_s=10, insecure=True)
        stack.callback(c.close)
        c.wait_ready(2, timeout_s=10)
        done = c.complete("m", ["p"] * 40, max_tokens=1)
        assert Counter(e["instances"][0] for e in done) == {"fast": 30, "slow": 10}
        assert all(e["text"] == "A" for e in done)


def test_scheduler_spreads_a_stage_over_its_nodes_by_share():
    """One stage, nodes with shares 2 and 1: 30 requests reach them 20 and 10 times."""
    with ExitStack() as stack:
        ctx = zmq.Context()
        stack.callback(ctx.term)
        coord = ctx.socket(zmq.ROUTER)
        coord.linger = 0
        coord.bind("tcp://127.0.0.1:*")
        stack.callback(coord.close)
        sched = Scheduler(SchedulerConfig("i", "tiny-llama", "aggregated", (12,), 12,
                                          coord.getsockopt_string(zmq.LAST_ENDPOINT), listen="tcp://127.0.0.1:*",
                                          timing=TIMING), insecure=True)
        background(stack, sched.run)
        nodes = {}
        for name, share in (("big", 2.0), ("small", 1.0)):
            ctl, data = ctx.socket(zmq.DEALER), ctx.socket(zmq.PULL)
            ctl.linger = data.linger = 0
            ctl.setsockopt(zmq.IDENTITY, name.encode())
            ctl.connect(sched.address)
            data.bind("tcp://127.0.0.1:*")
            stack.callback(ctl.close)
            stack.callback(data.close)
            wire.send(ctl, {"kind": "hello", "node": name, "stage": 0, "start": 0, "end": 12, "share": share,
                            "model": "tiny-llama", "data": data.getsockopt_string(zmq.LAST_ENDPOINT)})
            nodes[name] = (ctl, data)
        for ctl, _ in nodes.values():
            assert _recv(ctl)[1]["kind"] == "welcome"
        ident, register, _ = _recv(coord, routed=True)
        while register["kind"] == "heartbeat":  # a loaded machine may let a heartbeat go out first
            ident, register, _ = _recv(coord, routed=True)
        assert register["kind"] == "register"
        wire.send(coord, {"kind": "registered"}, to=ident)
        for i in range(30):
            wire.send(coord, {"kind": "generate", "rid": f"r{i}", "tokens": [1, 2], "max_tokens": 1}, to=ident)
        hits: Counter[str] = Counter()
        deadline = time.monotonic() + 10
        while sum(hits.values()) < 30 and time.monotonic() < deadline:
            for name, (ctl, data) in nodes.items():
                for _, h, (tokens,) in wire.drain(data, tensors=True):
                    assert h["kind"] == "forward" and tokens.tolist() == [1, 2]
                    hits[name] += 1
                    wire.send(ctl, {"kind": "token", "node": name, "rid": h["rid"], "token": 7, "pos": 2})
            time.sleep(0.01)
        assert hits == {"big": 20, "small": 10}
        finals = []
        while len(finals) < 30:
            _, h, _ = _recv(coord, routed=True)
            if h["kind"] == "done":
                finals.append(h["rid"])
        assert sorted(finals) == sorted(f"r{i}" for i in range(30))


def test_decode_node_parks_steps_until_kv_arrives_and_fails_clearly_without_it():
    torch_engine = pytest.importorskip("coral_dagster.runtime.torch_engine")
    from coral_dagster.runtime.node import EngineNode
    from coral_dagster.runtime.tiny import decoder_config

    cfg = decoder_config("tiny-llama")
    prompt = ByteTokenizer().encode("handoff")
    full = torch_engine.TorchEngine(cfg, 0, 12)
    first = torch_engine.TorchEngine(cfg, 0, 6)
    prefill_hidden = first.forward([Step("r", 0, tokens=np.asarray(prompt))])[0].hidden
    expected_first = full.forward([Step("r", 0, tokens=np.asarray(prompt))])[0].token
    expected_second = full.forward([Step("r", len(prompt), tokens=np.asarray([expected_first]))])[0].token
    step_hidden = first.forward([Step("r", len(prompt), tokens=np.asarray([expected_first]))])[0].hidden
    source = torch_engine.TorchEngine(cfg, 6, 12)
    assert source.forward([Step("r", 0, hidden=prefill_hidden)])[0].token == expected_first

    with ExitStack() as stack:
        ctx = zmq.Context()
        stack.callback(ctx.term)
        sched = ctx.socket(zmq.ROUTER)
        sched.linger = 0
        sched.bind("tcp://127.0.0.1:*")
        stack.callback(sched.close)
        settings = NodeSettings("d1", "tiny-llama", 6, 12, 12, 1, sched.getsockopt_string(zmq.LAST_ENDPOINT),
                                timing=TIMING)
        node = EngineNode(settings, torch_engine.TorchEngine(cfg, 6, 12), ctx=zmq.Context(), insecure=True)
        background(stack, node.run)
        push = ctx.socket(zmq.PUSH)
        push.linger = 0
        push.connect(node.address)
        stack.callback(push.close)
        route = ["tcp://unused", node.address]
        step = {"kind": "forward", "pos": len(prompt), "stage": 1, "route": route, "handoff": None}
        # The decode step overtakes its KV: the node parks it, then runs it when the KV lands.
        wire.send(push, {**step, "rid": "r"}, [step_hidden], block=True)
        time.sleep(0.2)
        wire.send(push, {"kind": "kv", "rid": "r", "start": 6, "end": 12}, source.export_kv("r", 6, 12), block=True)
        # A second request's KV never comes: it fails after kv_timeout_s with a message naming the wait.
        wire.send(push, {**step, "rid": "lost"}, [step_hidden], block=True)
        got = {}
        while len(got) < 2:
            _, h, _ = _recv(sched, routed=True)
            if h["kind"] in ("token", "error"):
                got[h["rid"]] = h
        assert got["r"]["kind"] == "token" and got["r"]["token"] == expected_second
        assert got["lost"]["kind"] == "error" and "did not arrive within 0.5 s" in got["lost"]["problem"]


def test_front_door_requires_the_api_key_when_one_is_set():
    import json
    import urllib.error
    import urllib.request

    from coral_dagster.runtime.local import free_port

    port = free_port()
    with ExitStack() as stack:
        ctx = zmq.Context()
        stack.callback(ctx.term)
        coord = Coordinator(CoordinatorConfig(listen="tcp://127.0.0.1:*", http_port=port, models=("m",),
                                              api_key="s3cret", timing=TIMING), ctx=ctx, insecure=True)
        background(stack, coord.run)
        url = f"http://127.0.0.1:{port}/admin/instances"
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10)
            assert err.value.code == 401
        ok = urllib.request.urlopen(urllib.request.Request(url, headers={"Authorization": "Bearer s3cret"}),
                                    timeout=10)
        assert json.load(ok)["models"] == ["m"]
    with pytest.raises(CoralError, match="API key"):
        Coordinator(CoordinatorConfig(listen="tcp://127.0.0.1:*", http_host="0.0.0.0", http_port=free_port()))
