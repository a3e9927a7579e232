"""A request can fail only itself: bad requests are refused where they enter, fail alone, and are never retried."""

from __future__ import annotations

import time
from contextlib import ExitStack

import pytest
import zmq

from coral_dagster.runtime import wire
from coral_dagster.runtime.client import FINAL, Client
from coral_dagster.runtime.config import CoordinatorConfig, NodeSettings, SchedulerConfig, Timing
from coral_dagster.runtime.coordinator import Coordinator
from coral_dagster.runtime.generate import generate
from coral_dagster.runtime.limits import ModelLimits
from coral_dagster.runtime.scheduler import Scheduler
from coral_dagster.runtime.security import CurveKeys
from coral_dagster.runtime.tiny import decoder_config
from support.runtime_fakes import FakeScheduler, background

torch_engine = pytest.importorskip("coral_dagster.runtime.torch_engine")

MODEL = "tiny-llama"
CFG = decoder_config(MODEL)
TIMING = Timing(heartbeat_s=0.1, dead_after_s=1.0, request_timeout_s=20.0)


def _final(c: Client, tag: str) -> dict:
    return [e for e in c.events([tag]) if e["kind"] in FINAL][0]


def _instance(stack: ExitStack, keys: CurveKeys, coordinator: str, name: str, split=(6, 6)):
    """A real scheduler with real torch engine nodes, each on its own thread and context."""
    sched = Scheduler(SchedulerConfig(name, MODEL, "aggregated", split, CFG.n_layers, coordinator,
                                      listen="tcp://127.0.0.1:*", timing=TIMING,
                                      limits=ModelLimits(CFG.vocab, CFG.max_context)), keys, ctx=zmq.Context())
    threads = [background(stack, sched.run)]
    start = 0
    for stage, n in enumerate(split):
        from coral_dagster.runtime.node import EngineNode

        settings = NodeSettings(f"{name}.s{stage}", MODEL, start, start + n, CFG.n_layers, stage, sched.address,
                                timing=TIMING)
        node = EngineNode(settings, torch_engine.TorchEngine(CFG, start, start + n), keys, ctx=zmq.Context())
        threads.append(background(stack, node.run))
        start += n
    return threads


def test_hostile_requests_fail_alone_and_good_ones_still_match_the_reference():
    keys = CurveKeys.generate()
    expected = generate(MODEL, "still fine", 8, ignore_eos=True)
    with ExitStack() as stack:
        ctx = zmq.Context()
        stack.callback(ctx.term)
        coord = Coordinator(CoordinatorConfig(listen="tcp://127.0.0.1:*", http_port=None, timing=TIMING,
                                              max_retries=3), keys, ctx=ctx)
        threads = [background(stack, coord.run)]
        for name in ("a", "b"):
            threads += _instance(stack, keys, coord.address, name)
        c = Client(coord.address, keys=keys, ctx=ctx, timeout_s=20)
        stack.callback(c.close)
        c.wait_ready(2, timeout_s=30)
        over = CFG.max_context - 10
        hostile = [({"prompt_tokens": [10 ** 30]}, "vocabulary"),
                   ({"prompt_tokens": [CFG.vocab]}, "vocabulary"),
                   ({"prompt_tokens": [-1]}, "non-negative"),
                   ({"prompt_tokens": [True, 1]}, "True"),
                   ({"prompt_tokens": [1.5]}, "1.5"),
                   ({"prompt_tokens": "abc"}, "list"),
                   ({"prompt_tokens": [1] * over, "max_tokens": 11}, "context"),
                   ({"prompt": "x", "max_tokens": True}, "max_tokens"),
                   ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
                   ({"prompt": "x", "ignore_eos": "yes"}, "ignore_eos"),
                   ({"prompt": ""}, "prompt"),
                   ({"prompt": "x", "model": ["m"]}, "model")]
        for fields, words in hostile:
            tag = c._tag()
            wire.send(c.sock, {"kind": "submit", "tag": tag, "model": MODEL, "max_tokens": 4, **fields}, block=True)
            e = c.next_event({tag})
            assert e["kind"] == "error" and e["status"] == 400 and words in e["problem"], (fields, e)
            assert e["fix"]
        status = c.status()
        assert all(t.is_alive() for t in threads)
        assert status["counts"] == {"submitted": len(hostile), "completed": 0, "failed": len(hostile), "retried": 0,
                                    "abandoned": 0}
        assert [i["state"] for i in status["instances"]] == ["ready", "ready"]
        assert all(i["served"] == 0 for i in status["instances"])
        done = c.complete(MODEL, ["still fine"] * 4, max_tokens=8, ignore_eos=True)
        assert all(e["kind"] == "done" and e["tokens"] == list(expected.tokens) for e in done)
        assert {e["instances"][0] for e in done} == {"a", "b"}


def test_an_instance_survives_requests_that_bypass_the_coordinator():
    """Messages the coordinator would never send (huge ids, ids past the vocabulary) fail alone, as 4xx."""
    keys = CurveKeys.generate()
    with ExitStack() as stack:
        ctx = zmq.Context()
        stack.callback(ctx.term)
        coord = ctx.socket(zmq.ROUTER)
        coord.linger = 0
        coord.curve_server, coord.curve_secretkey, coord.curve_publickey = True, keys.secret, keys.public
        coord.bind("tcp://127.0.0.1:*")
        stack.callback(coord.close)
        threads = _instance(stack, keys, coord.getsockopt_string(zmq.LAST_ENDPOINT), "x")
        ident = None
        deadline = time.monotonic() + 20
        while ident is None and time.monotonic() < deadline:
            if coord.poll(100):
                for sender, h, _ in wire.drain(coord, routed=True):
                    if h["kind"] == "register":
                        ident = sender
                        assert h["limits"] == {"vocab": CFG.vocab, "max_context": CFG.max_context}
        assert ident is not None
        wire.send(coord, {"kind": "registered"}, to=ident)
        for rid, tokens in (("huge", [10 ** 30]), ("vocab", [CFG.vocab + 3]), ("text", "abc"),
                            ("ok", [256, 104, 105])):
            wire.send(coord, {"kind": "generate", "rid": rid, "tokens": tokens, "max_tokens": 2,
                              "ignore_eos": True}, to=ident)
        finals = {}
        deadline = time.monotonic() + 20
        while len(finals) < 4 and time.monotonic() < deadline:
            if coord.poll(100):
                for _, h, _ in wire.drain(coord, routed=True):
                    if h["kind"] in ("error", "done"):
                        finals[h["rid"]] = h
        assert {r: h["kind"] for r, h in finals.items()} == {"huge": "error", "vocab": "error", "text": "error",
                                                             "ok": "done"}
        assert all(finals[r]["status"] == 400 for r in ("huge", "vocab", "text"))
        assert "token ids must lie in [0, 512)" in finals["vocab"]["problem"]
        assert all(t.is_alive() for t in threads)



@pytest.mark.parametrize("status, attempts", [(400, 1), (None, 2)], ids=["request-error", "instance-fault"])
def test_request_errors_are_not_retried_on_another_instance(status, attempts):
    keys = CurveKeys.generate()
    with ExitStack() as stack:
        ctx = zmq.Context()
        stack.callback(ctx.term)
        coord = Coordinator(CoordinatorConfig(listen="tcp://127.0.0.1:*", http_port=None, timing=TIMING,
                                              max_retries=1), keys, ctx=ctx)
        background(stack, coord.run)
        def refuse(name: str, h: dict) -> list[dict]:
            return [{"kind": "error", "instance": name, "rid": h["rid"], "status": status,
                     "problem": f"{name} says no"}]

        fakes = [FakeScheduler(coord.address, name, keys, answer=refuse) for name in ("p", "q")]
        for fake in fakes:
            background(stack, fake.run)
        c = Client(coord.address, keys=keys, ctx=ctx, timeout_s=10)
        stack.callback(c.close)
        c.wait_ready(2, timeout_s=10)
        e = _final(c, c.submit("m", "x", max_tokens=2))
        answered = [n for fake in fakes for n in fake.answered]
        assert e["kind"] == "error" and len(answered) == attempts and len(set(answered)) == attempts
        assert e["status"] == (400 if status else 503) and len(e["instances"]) == attempts
        assert c.status()["counts"]["retried"] == attempts - 1
