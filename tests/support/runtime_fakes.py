"""Test helpers: runtime loops on background threads, and a scheduler played by a script."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import zmq

from coral_dagster.runtime import wire
from coral_dagster.runtime.security import CurveKeys


def background(stack: ExitStack, target, *args) -> threading.Thread:
    """Start `target(stop, *args)` on a daemon thread; on exit set `stop` and join it."""
    stop = threading.Event()
    t = threading.Thread(target=target, args=(stop, *args), daemon=True)
    t.start()

    def end() -> None:
        stop.set()
        t.join(timeout=10)
    stack.callback(end)
    return t


def one_token(name: str, h: dict[str, Any]) -> list[dict[str, Any]]:
    """Answer a request with the token 'A' and finish it."""
    return [{"kind": "token", "instance": name, "rid": h["rid"], "token": 65},
            {"kind": "done", "instance": name, "rid": h["rid"], "finish_reason": "length"}]


class FakeScheduler:
    """Registers instance `name` of model "m", heartbeats, and answers each `generate` with `answer(name, h)`;
    clearing `healthy` reports the instance unhealthy."""

    def __init__(self, address: str, name: str, keys: CurveKeys | None = None, tokens_per_s: float = 1.0,
                 answer: Callable[[str, dict[str, Any]], list[dict[str, Any]]] = one_token,
                 limits: dict[str, int] | None = None, heartbeat_s: float = 0.1) -> None:
        self.address, self.name, self.keys, self.tokens_per_s = address, name, keys, tokens_per_s
        self.answer, self.limits, self.heartbeat_s = answer, limits, heartbeat_s
        self.healthy = threading.Event()
        self.healthy.set()
        self.answered: list[str] = []

    def run(self, stop: threading.Event) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        if self.keys is not None:
            sock.curve_secretkey, sock.curve_publickey = self.keys.secret, self.keys.public
            sock.curve_serverkey = self.keys.public
        sock.setsockopt(zmq.IDENTITY, f"scheduler:{self.name}".encode())
        sock.connect(self.address)
        wire.send(sock, {"kind": "register", "instance": self.name, "model": "m", "phase": "aggregated",
                         "tokens_per_s": self.tokens_per_s, "stages": [], "limits": self.limits})
        beat, was = 0.0, True
        while not stop.is_set():
            healthy = self.healthy.is_set()
            if healthy != was:
                was = healthy
                wire.send(sock, {"kind": "health", "instance": self.name, "healthy": healthy, "problem": "test"})
            if time.monotonic() - beat > self.heartbeat_s:
                beat = time.monotonic()
                wire.send(sock, {"kind": "heartbeat", "instance": self.name, "healthy": healthy})
            if sock.poll(10):
                for _, h, _ in wire.drain(sock):
                    if h["kind"] == "generate":
                        self.answered.append(self.name)
                        for reply in self.answer(self.name, h):
                            wire.send(sock, reply)
        sock.close()
        ctx.term()


def decoding(c, model: str, prompt: str, max_tokens: int) -> tuple[str, str]:
    """Submit `prompt` on client `c` and wait until three tokens streamed; returns (tag, its instance)."""
    tag = c.submit(model, prompt, max_tokens=max_tokens, ignore_eos=True)
    accepted = c.next_event({tag})
    assert accepted["kind"] == "accepted"
    for _ in range(3):
        assert c.next_event({tag})["kind"] == "token"
    return tag, accepted["instances"]["aggregated"]
