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


def test_a_live_coordinator_takes_new_admission_limits_and_sheds_by_them(coordinator):
    """The drainer hands the running coordinator a plan's `CORAL_ADMIT` text: its status reports it, a request
    beyond the new bucket is shed with 429 naming the limits, the same text again is no change, and text that
    does not parse is refused with the limits left as they were."""
    from coral_dagster.errors import CoralError
    from coral_dagster.runtime.client import Client

    coord, keys, _ = coordinator
    seen, done, thread = _scheduler(ctx=coordinator[2], keys=keys, endpoint=coord.address, name="abc123-i2",
                                    leave_after_drain=False)
    drainer = CoordinatorDrainer(poll_s=0.02, environ=keys.env())
    text = "phi-4=0.001:2.0"
    assert drainer.admit(coord.address, text) is True
    assert drainer.admit(coord.address, text) is False
    with Client(coord.address, keys=keys) as client:
        assert client.status()["admit"] == "phi-4=0.001:2.0"
        tags = [client.submit("phi-4", prompt="hi", max_tokens=2) for _ in range(3)]
        shed = client.next_event({tags[2]}, timeout_s=5)
        assert (shed["kind"], shed.get("status")) == ("error", 429)
        assert "0.001 req/s with bursts of up to 2 requests" in shed["problem"]
        for tag in tags[:2]:  # admitted: they wait for a route, never shed
            first = client.next_event({tag}, timeout_s=5)
            assert first.get("status") != 429, first
    with pytest.raises(CoralError, match="not model=rate"):
        drainer.admit(coord.address, "phi-4=fast")
    assert coord.admit_text == "phi-4=0.001:2.0"
    assert drainer.admit(coord.address, "") is True and coord.admission.rates == {}
    done.set()
    thread.join(timeout=5)


def test_with_a_registration_key_only_its_holder_drains_or_sets_admission():
    """A coordinator holding the registration key takes `drain` and `admit` over ZeroMQ only with a proof of it:
    the launching machine's drainer (key in its environment) drains and sets limits; a process holding just the
    deployment's CURVE key (any engine node) is told what is missing, and a wrong key gets 403, changing nothing."""
    from coral_dagster.errors import CoralError
    from coral_dagster.runtime import credentials
    from coral_dagster.runtime.client import Client

    keys, registration_key = CurveKeys.generate(), credentials.generate()
    ctx = zmq.Context()
    coord = Coordinator(CoordinatorConfig(listen="tcp://127.0.0.1:*", http_port=None), keys=keys, ctx=ctx,
                        registration_key=registration_key)
    stop = threading.Event()
    thread = threading.Thread(target=coord.run, args=(stop,), daemon=True)
    thread.start()
    try:
        # The scheduler played by hand answers the registration challenge with its credential.
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        security = Security(ctx, keys)
        security.connect(sock, coord.address)
        header = {"kind": "register", "instance": "i1", "model": "phi-4", "phase": "decode", "tokens_per_s": 1.0,
                  "incarnation": "x"}
        wire.send(sock, header, block=True)
        assert sock.poll(5000)
        challenge, _ = wire.unpack(sock.recv_multipart())
        answer = credentials.proof(credentials.instance_credential(registration_key, "i1"), challenge["nonce"], "i1",
                                   "x")
        wire.send(sock, {**header, "proof": answer}, block=True)
        assert sock.poll(5000) and wire.unpack(sock.recv_multipart())[0]["kind"] == "registered"

        with Client(coord.address, keys=keys) as insider:
            for call in (lambda: insider.drain("i1"), lambda: insider.admit("phi-4=0.001")):
                with pytest.raises(CoralError, match="only with a proof of the deployment's CORAL_REGISTRATION_KEY"):
                    call()
        with Client(coord.address, keys=keys, registration_key=credentials.generate()) as wrong:
            assert wrong.drain("i1")["status"] == 403 and wrong.admit("phi-4=0.001")["status"] == 403
        assert coord.instances["i1"].state != "draining" and coord.admit_text == ""

        env = {**keys.env(), "CORAL_REGISTRATION_KEY": registration_key}
        drainer = CoordinatorDrainer(poll_s=0.02, environ=env)
        assert drainer.admit(coord.address, "phi-4=0.001") is True and coord.admit_text == "phi-4=0.001"
        assert drainer.drain(coord.address, "i1", 0.2) is False and coord.instances["i1"].state == "draining"
        sock.close(linger=0)
        security.close()
    finally:
        stop.set()
        thread.join(timeout=5)
        ctx.term()
