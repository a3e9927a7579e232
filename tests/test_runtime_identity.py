"""Node identity, on real processes (`coral serve local`) with torch engines: a process holding the deployment's CURVE
key, or another instance's node credential, cannot join a scheduler as an engine node; it is never welcomed, never
sent a prompt, and has no say in any answer, while the honest nodes serve every request."""

from __future__ import annotations

import time
from contextlib import ExitStack

import pytest
import zmq

from coral_dagster.runtime import credentials, wire
from coral_dagster.runtime.config import Timing
from coral_dagster.runtime.generate import generate
from coral_dagster.runtime.local import LocalDeployment, local_instances
from coral_dagster.runtime.security import Security, tcp_endpoint

pytest.importorskip("torch")

MODEL = "tiny-llama"
TIMING = Timing(heartbeat_s=0.2, dead_after_s=3.0, request_timeout_s=60.0)
PROMPTS = [f"user {i} asks something private" for i in range(6)]


class Impostor:
    """A process on the deployment's network with its CURVE key: it says hello to `scheduler` as an extra stage-0
    node with a huge share and a data socket of its own, proving with `credential` (a node credential of its own
    choosing) when challenged, and records every control message and every byte sent to its data socket."""

    def __init__(self, stack: ExitStack, dep: LocalDeployment, scheduler: str, credential: str, name: str,
                 end: int = 12) -> None:
        self.ctx = zmq.Context()
        stack.callback(self.ctx.term)
        self.security = Security(self.ctx, dep.keys)
        stack.callback(self.security.close)
        self.data = self.ctx.socket(zmq.PULL)
        self.data.linger = 0
        stack.callback(self.data.close)
        self.address = self.security.bind(self.data, tcp_endpoint(dep.host, "*"))
        self.ctl = self.ctx.socket(zmq.DEALER)
        self.ctl.linger = 0
        stack.callback(self.ctl.close)
        self.security.connect(self.ctl, scheduler)
        self.credential, self.name, self.end = credential, name, end
        self.control: list[dict] = []
        self.received: list[dict] = []

    def hello(self, nonce: str | None = None) -> None:
        proof = ({"proof": credentials.node_proof(self.credential, nonce, 0, self.name, "evil")}
                 if nonce is not None else {})
        wire.send(self.ctl, {"kind": "hello", "node": self.name, "stage": 0, "start": 0, "end": self.end,
                             "share": 1e6, "data": self.address, "model": MODEL, "engine": "torch",
                             "incarnation": "evil", **proof})

    def pump(self) -> None:
        """Read what came back; answer a challenge with a proof of its credential, and claim tokens for any
        request it learns of."""
        for _, h, _ in wire.drain(self.ctl):
            self.control.append(h)
            if h["kind"] == "challenge":
                self.hello(h["nonce"])
        for _, h, _ in wire.drain(self.data, tensors=True):
            self.received.append(h)
            wire.send(self.ctl, {"kind": "token", "node": self.name, "rid": h["rid"], "token": 66,
                                 "pos": h["pos"] + 1})


def test_a_key_holder_without_its_slot_credential_never_joins_and_the_honest_nodes_serve(tmp_path):
    expected = {p: generate(MODEL, p, 4, ignore_eos=True).tokens for p in PROMPTS}
    with ExitStack() as stack:
        dep = stack.enter_context(LocalDeployment(MODEL, local_instances((6, 6), 2), timing=TIMING,
                                                  log_dir=tmp_path, restart=False))
        dep.wait_ready(90)
        scheduler = dep._roles["agg-0.scheduler"][1]["cfg"].listen
        # One knows only the CURVE key (its credential is made up); one holds a real node credential of the other
        # instance, for the same stage and a name of its own; one holds agg-1's credential for agg-0's own node name.
        impostors = [Impostor(stack, dep, scheduler, credential, name) for credential, name in (
            ("0" * 64, "intruder"),
            (credentials.node_credential_of(dep.registration_key, "agg-1", 0, "agg-1.s0.n9"), "agg-1.s0.n9"),
            (credentials.node_credential_of(dep.registration_key, "agg-1", 0, "agg-0.s0.n7"), "agg-0.s0.n7"))]
        for imp in impostors:
            imp.hello()
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            for imp in impostors:
                imp.pump()
            time.sleep(0.05)
        with dep.client(timeout_s=60) as c:
            tags = {c.submit(MODEL, p, max_tokens=4, ignore_eos=True): p for p in PROMPTS}
            done: dict[str, dict] = {}
            while len(done) < len(tags):
                for imp in impostors:
                    imp.pump()
                e = c.next_event(set(tags) - set(done), timeout_s=60)
                if e["kind"] in ("done", "error"):
                    done[e["tag"]] = e
            status = c.status()
        for imp in impostors:
            imp.pump()
    # Each was challenged, then rejected for its proof; none was welcomed or sent a step of any request.
    for imp in impostors:
        kinds = [h["kind"] for h in imp.control]
        assert kinds[:2] == ["challenge", "reject"], kinds
        assert "welcome" not in kinds and imp.received == []
        assert "does not prove node" in imp.control[1]["problem"]
    # Every answer is the one the model computes alone, and both instances served (agg-0 kept its own nodes).
    assert {tags[t]: tuple(e.get("tokens", ())) for t, e in done.items()} == expected
    assert {i for e in done.values() for i in e["instances"]} == {"agg-0", "agg-1"}
    stage0 = {i["instance"]: [n["node"] for n in i["stages"][0]["nodes"]] for i in status["instances"]}
    assert stage0 == {"agg-0": ["agg-0.s0.n0"], "agg-1": ["agg-1.s0.n0"]}
    assert "rejected a hello" in (tmp_path / "agg-0.scheduler.log").read_text()


def test_a_key_holder_pushing_steps_into_a_nodes_data_socket_has_no_say_in_the_answer(tmp_path):
    """It knows a live request's id (a client sees its own) and the data address of the instance's last stage (the
    coordinator's status shows it); every step it pushes there, at every position the request will pass, lacks the
    scheduler's MAC (or carries a forged one) and is dropped: the request decodes as the model alone does."""
    import numpy as np

    prompt = "a request decoding while a key holder pushes steps at it"
    expected = generate(MODEL, prompt, 40, ignore_eos=True)
    with ExitStack() as stack:
        dep = stack.enter_context(LocalDeployment(MODEL, local_instances((6, 6), 1), timing=TIMING,
                                                  log_dir=tmp_path, restart=False))
        dep.wait_ready(90)
        ctx = zmq.Context()
        stack.callback(ctx.term)
        security = Security(ctx, dep.keys)
        stack.callback(security.close)
        with dep.client(timeout_s=60) as c:
            stage1 = c.status()["instances"][0]["stages"][1]["nodes"][0]["data"]
            tag = c.submit(MODEL, prompt, max_tokens=40, ignore_eos=True)
            rid = c.next_event({tag})["rid"]
            push = security.push(stage1)
            hidden = np.ones((1, 256), dtype=np.float32)
            start = len(prompt)
            for pos in range(start, start + 40):
                for forged in ({}, {"mac": "0" * 64}):
                    wire.send(push, {"kind": "forward", "rid": rid, "pos": pos, "stage": 1, "route": [stage1, stage1],
                                     **forged}, [hidden])
            events = list(c.events([tag], timeout_s=60))
    done = events[-1]
    assert done["kind"] == "done" and done["tokens"] == list(expected.tokens) and done["attempts"] == 1
    assert "without its scheduler's MAC" in (tmp_path / "agg-0.s1.n0.log").read_text()


def test_node_credentials_are_bound_to_instance_stage_and_name():
    """The derivation's own properties, checked against HMAC-SHA256 computed here (the independent oracle)."""
    import hashlib
    import hmac

    key = credentials.generate()
    inst = credentials.instance_credential(key, "agg-0")
    cred = credentials.node_credential_of(key, "agg-0", 1, "agg-0.s1.n0")
    assert cred == hmac.new(inst.encode(), b"coral-node:1:agg-0.s1.n0", hashlib.sha256).hexdigest()
    others = {credentials.node_credential_of(key, i, s, n) for i, s, n in (
        ("agg-1", 1, "agg-0.s1.n0"), ("agg-0", 0, "agg-0.s1.n0"), ("agg-0", 1, "agg-0.s1.n1"))}
    assert cred not in others and len(others) == 3
    answer = credentials.node_proof(cred, "nonce", 1, "agg-0.s1.n0", "inc")
    assert credentials.verify_node(inst, "nonce", 1, "agg-0.s1.n0", "inc", answer)
    for args in (("other", 1, "agg-0.s1.n0", "inc"), ("nonce", 0, "agg-0.s1.n0", "inc"),
                 ("nonce", 1, "agg-0.s1.n1", "inc"), ("nonce", 1, "agg-0.s1.n0", "other")):
        assert not credentials.verify_node(inst, *args, answer)


def test_serve_keys_prints_the_node_credential_a_scheduler_accepts(monkeypatch):
    from click.testing import CliRunner

    from coral_dagster.cli import serve as serve_cli
    from coral_dagster.errors import CoralError

    key = credentials.generate()
    monkeypatch.setenv("CORAL_REGISTRATION_KEY", key)
    runner = CliRunner()
    args = ["keys", "--credential", "agg-0", "--node", "agg-0.s1.n0", "--stage", "1"]
    printed = runner.invoke(serve_cli.serve, args, catch_exceptions=False).output.strip()
    answer = credentials.node_proof(printed, "n", 1, "agg-0.s1.n0", "i")
    assert credentials.verify_node(credentials.instance_credential(key, "agg-0"), "n", 1, "agg-0.s1.n0", "i", answer)
    alone = runner.invoke(serve_cli.serve, ["keys", "--node", "agg-0.s1.n0"])
    assert isinstance(alone.exception, CoralError) and "--credential INSTANCE --node NODE" in str(alone.exception)


def test_a_second_answer_to_a_proved_challenge_is_not_taken_for_a_forgery(tmp_path):
    """A node answers every challenge, and the scheduler re-sends its challenge to each hello without proof (a node
    says hello on every heartbeat until welcomed): so an honest node can answer nonce N twice with a hello without
    proof between, which draws a new nonce. The second answer to N comes from the connection that proved N; it
    must not get the node rejected (the order a loaded machine produced in 2026-12-06's runs)."""
    with ExitStack() as stack:
        dep = stack.enter_context(LocalDeployment(MODEL, local_instances((6, 6), 1), timing=TIMING,
                                                  log_dir=tmp_path, restart=False))
        dep.wait_ready(90)
        scheduler = dep._roles["agg-0.scheduler"][1]["cfg"].listen
        name = "agg-0.s0.n5"
        node = Impostor(stack, dep, scheduler, credentials.node_credential_of(dep.registration_key, "agg-0", 0, name),
                        name, end=6)
        node.hello()
        first = _next(node)
        assert first["kind"] == "challenge"
        node.hello(first["nonce"])
        node.hello()
        node.hello(first["nonce"])
        replies = [first]
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            replies += [h for _, h, _ in wire.drain(node.ctl)]
            time.sleep(0.05)
    kinds = [h["kind"] for h in replies]
    assert "reject" not in kinds and "welcome" in kinds, replies


def _next(node: Impostor, timeout_s: float = 10.0) -> dict:
    """The next control message the node is sent."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for _, h, _ in wire.drain(node.ctl):
            return h
        time.sleep(0.02)
    raise AssertionError("the scheduler sent nothing")
