"""The real drainer against the runtime's own coordinator (CURVE on loopback) and a scheduler played by hand."""

from __future__ import annotations

import threading

import pytest
import zmq

from coral_dagster.deploy.drain import CoordinatorDrainer
from coral_dagster.runtime import wire
from coral_dagster.runtime.config import CoordinatorConfig
from coral_dagster.runtime.coordinator import Coordinator
from coral_dagster.runtime.security import CurveKeys, Security


@pytest.fixture
def coordinator():
    keys = CurveKeys.generate()
    ctx = zmq.Context()
    coord = Coordinator(CoordinatorConfig(listen="tcp://127.0.0.1:*", http_port=None), keys=keys, ctx=ctx)
    stop = threading.Event()
    thread = threading.Thread(target=coord.run, args=(stop,), daemon=True)
    thread.start()
    yield coord, keys, ctx
    stop.set()
    thread.join(timeout=5)
    ctx.term()


def _scheduler(ctx: zmq.Context, keys: CurveKeys, endpoint: str, name: str, leave_after_drain: bool):
    """Registers instance `name`; on `drain` it reports draining and, if told to, leaves."""
    security = Security(ctx, keys)
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    security.connect(sock, endpoint)
    wire.send(sock, {"kind": "register", "instance": name, "model": "phi-4", "phase": "decode",
                     "tokens_per_s": 100.0}, block=True)
    seen: list[str] = []
    done, registered = threading.Event(), threading.Event()

    def loop() -> None:
        while not done.is_set():
            if not sock.poll(50):
                continue
            header, _ = wire.unpack(sock.recv_multipart())
            seen.append(header["kind"])
            if header["kind"] == "registered":
                registered.set()
            if header["kind"] == "drain":
                wire.send(sock, {"kind": "draining", "instance": name}, block=True)
                if leave_after_drain:
                    wire.send(sock, {"kind": "left", "instance": name}, block=True)
        sock.close(linger=0)
        security.close()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    assert registered.wait(5), f"{name} never registered"
    return seen, done, thread


def test_drain_waits_until_the_instance_has_left(coordinator):
    coord, keys, ctx = coordinator
    seen, done, thread = _scheduler(ctx, keys, coord.address, "abc123-i0", leave_after_drain=True)
    drainer = CoordinatorDrainer(poll_s=0.02, environ=keys.env())
    assert drainer.drain(coord.address, "abc123-i0", timeout_s=10) is True
    assert "drain" in seen and "abc123-i0" in coord.departed
    done.set()
    thread.join(timeout=5)


def test_drain_reports_an_instance_that_does_not_leave_in_time(coordinator):
    coord, keys, ctx = coordinator
    seen, done, thread = _scheduler(ctx, keys, coord.address, "abc123-i1", leave_after_drain=False)
    drainer = CoordinatorDrainer(poll_s=0.02, environ=keys.env())
    assert drainer.drain(coord.address, "abc123-i1", timeout_s=0.2) is False
    assert coord.instances["abc123-i1"].state == "draining"
    done.set()
    thread.join(timeout=5)


def test_unknown_instance_has_nothing_to_drain(coordinator):
    coord, keys, _ = coordinator
    assert CoordinatorDrainer(poll_s=0.02, environ=keys.env()).drain(coord.address, "never-registered", 1) is True
