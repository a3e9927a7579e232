"""Hostile peers and poisonous requests against a real coordinator over CURVE-encrypted ZeroMQ: an insider holding the
deployment key cannot take a live instance's routing id, announce a model that is not the deployment's, or make the
coordinator buffer a many-frame message; a request is never retried where it failed, a request that kills its
instances fails alone, and every request ends by its deadline."""

from __future__ import annotations

import json
import threading
import time
from contextlib import ExitStack

import pytest
import zmq

from coral_dagster.runtime import wire
from coral_dagster.runtime.client import FINAL, Client
from coral_dagster.runtime.config import CoordinatorConfig, Timing
from coral_dagster.runtime.coordinator import MAX_DEATHS, MAX_INSTANCES, MAX_NAME_CHARS, MAX_STAGES_BYTES, Coordinator
from coral_dagster.runtime.security import CurveKeys
from support.runtime_fakes import FakeScheduler, background

TIMING = Timing(heartbeat_s=0.1, dead_after_s=1.0, request_timeout_s=10.0)
LIMITS = {"vocab": 512, "max_context": 4096}


class Deployment:
    """A coordinator on a thread, fake schedulers registered with it, and a client: all holding one keypair."""

    def __init__(self, stack: ExitStack, max_retries: int = 1) -> None:
        self.stack, self.keys = stack, CurveKeys.generate()
        self.ctx = zmq.Context()
        stack.callback(self.ctx.term)
        self.coord = Coordinator(CoordinatorConfig(listen="tcp://127.0.0.1:*", http_port=None, timing=TIMING,
                                                   max_retries=max_retries), self.keys, ctx=self.ctx)
        background(stack, self.coord.run)
        self.client = Client(self.coord.address, keys=self.keys, ctx=self.ctx, timeout_s=10)
        stack.callback(self.client.close)

    def scheduler(self, name: str, **kw) -> FakeScheduler:
        fake = FakeScheduler(self.coord.address, name, self.keys, limits=kw.pop("limits", LIMITS), **kw)
        background(self.stack, fake.run)
        return fake

    def insider(self, identity: bytes | None = None) -> zmq.Socket:
        """A DEALER holding the deployment's key, with a routing id of its choosing."""
        sock = self.ctx.socket(zmq.DEALER)
        sock.linger = 0
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity)
        sock.curve_secretkey, sock.curve_publickey = self.keys.secret, self.keys.public
        sock.curve_serverkey = self.keys.public
        sock.connect(self.coord.address)
        self.stack.callback(sock.close)
        return sock

    def final(self, tag: str) -> dict:
        return [e for e in self.client.events([tag]) if e["kind"] in FINAL][0]


@pytest.fixture
def ready():
    """A deployment with one fake instance "i0" ready."""
    with ExitStack() as stack:
        d = Deployment(stack)
        d.scheduler("i0")
        d.client.wait_ready(1, timeout_s=10)
        yield d


def _heard(sock: zmq.Socket, window_s: float = 1.0) -> list[dict]:
    """Every message `sock` receives within `window_s`."""
    got: list[dict] = []
    deadline = time.monotonic() + window_s
    while (left := deadline - time.monotonic()) > 0:
        if sock.poll(max(1, int(1000 * left))):
            got += [h for _, h, _ in wire.drain(sock)]
    return got


def _register(sock: zmq.Socket, name: str, limits=LIMITS, **extra) -> None:
    wire.send(sock, {"kind": "register", "instance": name, "model": "m", "phase": "aggregated", "tokens_per_s": 1e9,
                     "stages": [], "limits": limits, **extra}, block=True)


def test_an_insider_cannot_take_over_a_live_instances_routing_id():
    with ExitStack() as stack:
        d = Deployment(stack)
        owner = d.scheduler("i0")
        d.client.wait_ready(1, timeout_s=10)
        # The same routing id the real scheduler connected with, the deployment's key, and a re-registration.
        thief = d.insider(b"scheduler:i0")
        _register(thief, "i0")
        wire.send(thief, {"kind": "heartbeat", "instance": "i0", "healthy": True}, block=True)
        time.sleep(0.3)
        done = d.client.complete("m", ["x"] * 10, max_tokens=1)
        stolen = [h for h in _heard(thief, 0.5) if h["kind"] == "generate"]
    assert [e["kind"] for e in done] == ["done"] * 10 and owner.answered == ["i0"] * 10
    assert stolen == []


def test_an_instance_announcing_another_vocabulary_is_refused_and_requests_still_serve(ready):
    rogue = ready.insider()
    _register(rogue, "rogue", limits={"vocab": 2, "max_context": 4096})
    replies = _heard(rogue, 0.5)
    status = ready.client.status()
    done = ready.client.complete("m", ["hello"], max_tokens=1)[0]
    refused = [h for h in replies if h["kind"] == "refused"]
    assert refused and "vocab 512" in refused[0]["problem"] and "vocab 2" in refused[0]["problem"]
    assert [i["instance"] for i in status["instances"]] == ["i0"]
    # "hello" holds byte tokens above 2: the rogue's vocabulary would have made this a 400.
    assert done["kind"] == "done"


def test_a_control_message_of_many_frames_is_dropped_whole_and_the_coordinator_keeps_serving(ready):
    peer = ready.insider()
    pad = b"x" * (wire.MAX_CONTROL_BYTES - 1024)
    # Every frame is under the per-frame cap; together they are four times over it.
    peer.send_multipart([json.dumps({"kind": "status", "tag": "big"}).encode(), pad, pad, pad, pad])
    assert _heard(peer, 1.0) == []
    peer.send_multipart([json.dumps({"kind": "status", "tag": "ok"}).encode()])
    assert [h["tag"] for h in _heard(peer, 1.0)] == ["ok"]
    assert ready.client.complete("m", ["x"], max_tokens=1)[0]["kind"] == "done"


def test_a_failed_attempt_is_never_retried_on_the_instance_it_failed_on():
    seen: dict[str, list[str]] = {}

    def crash(name: str, h: dict) -> list[dict]:
        seen.setdefault(h["rid"], []).append(name)
        return [{"kind": "error", "instance": name, "rid": h["rid"], "status": None,
                 "problem": f"engine node {name}.s0 was restarted (its process was replaced)"}]

    with ExitStack() as stack:
        d = Deployment(stack, max_retries=3)
        # The crashing instance weighs a hundred times more, so the router would pick it again and again.
        bad = d.scheduler("bad", tokens_per_s=100.0, answer=crash)
        good = d.scheduler("good", tokens_per_s=1.0)
        d.client.wait_ready(2, timeout_s=10)
        finals = d.client.complete("m", ["p"] * 20, max_tokens=1)
    assert all(e["kind"] == "done" and e["instances"][-1] == "good" for e in finals)
    assert all(names == ["bad"] for names in seen.values()) and len(seen) == len(bad.answered)
    assert len(good.answered) == 20


def test_a_request_that_kills_the_instances_it_runs_on_fails_alone():
    def die(name: str, h: dict) -> list[dict]:
        return [{"kind": "error", "instance": name, "rid": h["rid"], "status": None,
                 "problem": f"engine node {name}.s0 (stage 0) of instance {name} stopped responding"}]

    with ExitStack() as stack:
        d = Deployment(stack, max_retries=5)
        fakes = [d.scheduler(f"i{k}", answer=die) for k in range(MAX_DEATHS + 2)]
        d.client.wait_ready(len(fakes), timeout_s=10)
        e = d.final(d.client.submit("m", "poison", max_tokens=1))
    answered = [n for f in fakes for n in f.answered]
    assert e["kind"] == "error" and e["status"] == 503 and len(answered) == MAX_DEATHS == len(set(answered))
    assert f"in flight on {MAX_DEATHS} instances that died" in e["problem"]


def test_a_request_that_never_progresses_ends_by_its_deadline():
    with ExitStack() as stack:
        d = Deployment(stack)
        d.scheduler("mute", answer=lambda name, h: [])
        d.client.wait_ready(1, timeout_s=10)
        wire.send(d.client.sock, {"kind": "submit", "tag": "t", "model": "m", "prompt": "x", "max_tokens": 4,
                                  "timeout_s": 0.5}, block=True)
        started = time.monotonic()
        e = d.final("t")
        took = time.monotonic() - started
        wire.send(d.client.sock, {"kind": "submit", "tag": "u", "model": "m", "prompt": "x", "max_tokens": 4,
                                  "timeout_s": -1}, block=True)
        bad = d.final("u")
    assert e["kind"] == "error" and e["status"] == 504 and "deadline of 0.5 s" in e["problem"]
    assert took < TIMING.request_timeout_s / 2
    assert bad["kind"] == "error" and bad["status"] == 400 and "timeout_s" in bad["problem"]


@pytest.mark.parametrize("header, reply", [
    ({"kind": "register", "instance": "x", "model": "m", "phase": "aggregated", "tokens_per_s": "nan"}, "refused"),
    ({"kind": "register", "instance": "x", "model": "m", "phase": "aggregated", "tokens_per_s": 1, "stages": 5},
     "refused"),
    ({"kind": "register", "instance": "x", "model": "m", "phase": "aggregated", "tokens_per_s": 1, "limits": "big"},
     "refused"),
    ({"kind": "register", "instance": ["x"], "model": "m", "phase": "aggregated", "tokens_per_s": 1}, "refused"),
    ({"kind": "submit", "tag": "s", "model": ["m"], "prompt": "x"}, "error"),
    ({"kind": "submit", "tag": "s", "model": "m", "prompt_tokens": [1, -2]}, "error"),
    ({"kind": "submit", "tag": "s", "model": "m", "prompt": "x", "max_tokens": 1e9}, "error"),
    ({"kind": "cancel"}, "error"),
    ({"kind": "no-such-kind"}, "error"),
    ({"kind": "token", "instance": "i0", "rid": "r", "token": 1}, "reregister"),
])
def test_malformed_messages_fail_alone_with_a_reason(ready, header, reply):
    peer = ready.insider()
    wire.send(peer, header, block=True)
    replies = _heard(peer, 0.5)
    assert [h["kind"] for h in replies] == [reply]
    assert replies[0].get("problem", "x") and (reply != "error" or replies[0]["status"] == 400)
    assert [i["instance"] for i in ready.client.status()["instances"]] == ["i0"]
    assert ready.client.complete("m", ["x"], max_tokens=1)[0]["kind"] == "done"


class _Instance:
    """A real scheduler (one stage of 12 layers) whose coordinator is a bare ROUTER, and node connections played
    by the test."""

    def __init__(self, stack: ExitStack) -> None:
        from coral_dagster.runtime.config import SchedulerConfig
        from coral_dagster.runtime.scheduler import Scheduler

        self.stack, self.ctx = stack, zmq.Context()
        stack.callback(self.ctx.term)
        self.coord = self.ctx.socket(zmq.ROUTER)
        self.coord.linger = 0
        self.coord.bind("tcp://127.0.0.1:*")
        stack.callback(self.coord.close)
        self.sched = Scheduler(SchedulerConfig("i", "tiny-llama", "aggregated", (12,), 12,
                                               self.coord.getsockopt_string(zmq.LAST_ENDPOINT),
                                               listen="tcp://127.0.0.1:*", timing=TIMING), insecure=True)
        background(stack, self.sched.run)
        self.data = self.ctx.socket(zmq.PULL)
        self.data.linger = 0
        self.data.bind("tcp://127.0.0.1:*")
        stack.callback(self.data.close)

    def node(self, incarnation: str) -> zmq.Socket:
        """A node connection named "n" that says hello as process `incarnation`."""
        ctl = self.ctx.socket(zmq.DEALER)
        ctl.linger = 0
        ctl.connect(self.sched.address)
        self.stack.callback(ctl.close)
        wire.send(ctl, {"kind": "hello", "node": "n", "stage": 0, "start": 0, "end": 12, "model": "tiny-llama",
                        "data": self.data.getsockopt_string(zmq.LAST_ENDPOINT), "incarnation": incarnation},
                  block=True)
        return ctl

    def pulse(self, incarnation: str) -> threading.Event:
        """Pulse for node "n" as process `incarnation` from a thread, until the returned event is set."""
        stop = threading.Event()

        def run() -> None:
            beat = self.ctx.socket(zmq.DEALER)
            beat.linger = 0
            beat.connect(self.sched.address)
            while not stop.wait(TIMING.heartbeat_s):
                wire.send(beat, {"kind": "pulse", "node": "n", "incarnation": incarnation})
            beat.close()
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        self.stack.callback(thread.join, 5)
        self.stack.callback(stop.set)
        return stop

    def to_coordinator(self, window_s: float) -> list[dict]:
        got: list[dict] = []
        deadline = time.monotonic() + window_s
        while (left := deadline - time.monotonic()) > 0:
            if self.coord.poll(max(1, int(1000 * left))):
                for ident, h, _ in wire.drain(self.coord, routed=True):
                    if h["kind"] == "register":
                        wire.send(self.coord, {"kind": "registered"}, to=ident)
                    self.ident = ident
                    got.append(h)
        return got


def test_a_live_nodes_name_is_not_taken_and_forged_pulses_do_not_keep_a_silent_node_alive():
    with ExitStack() as stack:
        inst = _Instance(stack)
        first = inst.node("A")
        alive = inst.pulse("A")
        assert [h["kind"] for h in _heard(first, 0.5)][:1] == ["welcome"]
        assert any(h["kind"] == "register" for h in inst.to_coordinator(1.0))
        # Another connection claiming the live node's name is rejected ...
        second = inst.node("B")
        replies = [h for h in _heard(second, 0.5) if h["kind"] != "ping"]
        assert [h["kind"] for h in replies] == ["reject"] and "already connected" in replies[0]["problem"]
        # ... and pulses under the right incarnation kept the node alive well past the dead-after limit ...
        time.sleep(2 * TIMING.dead_after_s)
        assert not any(h["kind"] == "health" for h in inst.to_coordinator(0.1))
        # ... where pulses under another incarnation do not.
        alive.set()
        forged = inst.pulse("forged")
        health = [h for h in inst.to_coordinator(2 * TIMING.dead_after_s) if h["kind"] == "health"]
        forged.set()
        assert health and health[-1]["healthy"] is False and "stage 0" in health[-1]["problem"]


def test_a_node_restarted_under_its_name_fails_what_the_old_process_had_in_flight_at_once():
    with ExitStack() as stack:
        inst = _Instance(stack)
        old = inst.node("A")
        inst.pulse("A")
        assert [h["kind"] for h in _heard(old, 0.5)][:1] == ["welcome"]
        inst.to_coordinator(1.0)
        wire.send(inst.coord, {"kind": "generate", "rid": "r1", "tokens": [1, 2, 3], "max_tokens": 4},
                  to=inst.ident)
        assert inst.data.poll(5000)
        # The old process dies (its connection closes) and a new one says hello long before silence would count.
        old.close(linger=0)
        time.sleep(0.2)
        started = time.monotonic()
        new = inst.node("B")
        errors: list[dict] = []
        while not errors and time.monotonic() - started < TIMING.dead_after_s:
            errors = [h for h in inst.to_coordinator(0.05) if h["kind"] == "error"]
        assert [h["rid"] for h in errors] == ["r1"] and "was restarted" in errors[0]["problem"]
        assert [h["kind"] for h in _heard(new, 0.5)][:1] == ["welcome"]


def test_an_insider_cannot_make_every_status_reply_too_large_to_read(ready):
    peer = ready.insider()
    huge = [{"start": 0, "end": 1, "nodes": [{"node": "n" * 1000, "share": 1.0, "data": "x"}] * 100}]
    _register(peer, "bloated", stages=huge)
    _register(peer, "x" * 10_000)
    replies = _heard(peer, 0.5)
    assert [h["kind"] for h in replies] == ["refused", "refused"]
    assert [i["instance"] for i in ready.client.status()["instances"]] == ["i0"]
    # The bounds together keep the largest status reply inside one control frame.
    assert MAX_INSTANCES * (MAX_STAGES_BYTES + MAX_NAME_CHARS + 512) < wire.MAX_CONTROL_BYTES


def test_a_first_instance_is_checked_against_the_catalog_not_trusted(ready):
    rogue = ready.insider()
    wire.send(rogue, {"kind": "register", "instance": "rogue", "model": "tiny-llama", "phase": "aggregated",
                      "tokens_per_s": 1.0, "split": [6, 6], "limits": {"vocab": 2, "max_context": 4096}}, block=True)
    wire.send(rogue, {"kind": "register", "instance": "short", "model": "tiny-llama", "phase": "aggregated",
                      "tokens_per_s": 1.0, "split": [6], "limits": {"vocab": 512, "max_context": 4096}}, block=True)
    replies = _heard(rogue, 0.5)
    assert [h["kind"] for h in replies] == ["refused", "refused"]
    assert "vocab 512" in replies[0]["problem"] and "12 layers" in replies[1]["problem"]
    assert [i["instance"] for i in ready.client.status()["instances"]] == ["i0"]


def test_a_freed_request_is_not_computed_when_its_step_arrives_late():
    """The coordinator moved a request on and its scheduler freed it; a step still on its way is dropped, so an
    abandoned request does not keep running through the stages."""
    torch_engine = pytest.importorskip("coral_dagster.runtime.torch_engine")
    import numpy as np

    from coral_dagster.runtime.config import NodeSettings
    from coral_dagster.runtime.node import EngineNode
    from coral_dagster.runtime.tiny import decoder_config

    cfg = decoder_config("tiny-llama")
    with ExitStack() as stack:
        ctx = zmq.Context()
        stack.callback(ctx.term)
        sched = ctx.socket(zmq.ROUTER)
        sched.linger = 0
        sched.bind("tcp://127.0.0.1:*")
        stack.callback(sched.close)
        node = EngineNode(NodeSettings("n", "tiny-llama", 0, 12, 12, 0, sched.getsockopt_string(zmq.LAST_ENDPOINT),
                                       timing=TIMING), torch_engine.TorchEngine(cfg, 0, 12), insecure=True)
        background(stack, node.run)
        push = ctx.socket(zmq.PUSH)
        push.linger = 0
        push.connect(node.address)
        stack.callback(push.close)
        ctl = None
        while ctl is None:
            assert sched.poll(5000)
            for ident, h, _ in wire.drain(sched, routed=True):
                if h["kind"] == "hello":
                    ctl = ident
        wire.send(sched, {"kind": "welcome"}, to=ctl)
        wire.send(sched, {"kind": "free", "rid": "gone"}, to=ctl)
        time.sleep(0.3)
        for rid in ("gone", "live"):
            wire.send(push, {"kind": "forward", "rid": rid, "pos": 0, "stage": 0, "route": [node.address]},
                      [np.asarray([1, 2, 3], dtype=np.int64)], block=True)
        tokens: list[str] = []
        deadline = time.monotonic() + 5
        while "live" not in tokens and time.monotonic() < deadline:
            if sched.poll(100):
                tokens += [h["rid"] for _, h, _ in wire.drain(sched, routed=True) if h["kind"] == "token"]
        assert tokens == ["live"] and node.steps_run == 1
