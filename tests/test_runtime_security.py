"""CURVE: without the deployment key a client cannot submit work, inject activations or read them on the wire."""

from __future__ import annotations

import json
import socket
import threading
import time
from contextlib import ExitStack
from types import SimpleNamespace

import numpy as np
import pytest
import zmq
from click.testing import CliRunner

from coral_dagster.cli import serve as serve_cli
from coral_dagster.errors import CoralError
from coral_dagster.runtime import credentials, wire
from coral_dagster.runtime.client import Client
from coral_dagster.runtime.config import CoordinatorConfig, NodeSettings, SchedulerConfig, Timing
from coral_dagster.runtime.coordinator import Coordinator
from coral_dagster.runtime.engine import Step
from coral_dagster.runtime.generate import generate
from coral_dagster.runtime.local import free_port
from coral_dagster.runtime.node import EngineNode
from coral_dagster.runtime.scheduler import Scheduler
from coral_dagster.runtime.security import CurveKeys
from coral_dagster.runtime.tiny import decoder_config
from coral_dagster.runtime.tokenizer import ByteTokenizer
from support.runtime_fakes import background

torch_engine = pytest.importorskip("coral_dagster.runtime.torch_engine")

MODEL = "tiny-llama"
CFG = decoder_config(MODEL)
TIMING = Timing(heartbeat_s=0.1, dead_after_s=1.0, request_timeout_s=20.0)
PROMPT = "secret activations"


class Relay:
    """A TCP relay that records every byte sent towards the server: a wiretap on the activation link."""

    def __init__(self, target_port: int) -> None:
        self.target = target_port
        self.captured = bytearray()
        self.lock = threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = [self.listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            self.sockets += [conn, upstream]
            threading.Thread(target=self._pump, args=(conn, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, conn, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, record: bool) -> None:
        while True:
            try:
                data = src.recv(65536)
                if not data:
                    return
                if record:
                    with self.lock:
                        self.captured += data
                dst.sendall(data)
            except OSError:
                return

    def close(self) -> None:
        for s in self.sockets:
            s.close()


def _deploy(stack: ExitStack, keys: CurveKeys | None, registration_key: str = "") -> tuple[str, EngineNode, Relay]:
    """Coordinator, scheduler and two engine nodes (layers 0:6, 6:12) as threads, each with its own context;
    stage 1 is reached through a recording relay. With `registration_key`, instance i0 proves its credential."""
    contexts = [zmq.Context() for _ in range(4)]
    for ctx in contexts:
        stack.callback(ctx.term)
    insecure = keys is None
    coord = Coordinator(CoordinatorConfig(listen="tcp://127.0.0.1:*", http_port=None, timing=TIMING), keys,
                        insecure, ctx=contexts[0], registration_key=registration_key)
    background(stack, coord.run)
    credential = credentials.instance_credential(registration_key, "i0") if registration_key else ""
    sched = Scheduler(SchedulerConfig("i0", MODEL, "aggregated", (6, 6), CFG.n_layers, coord.address,
                                      listen="tcp://127.0.0.1:*", timing=TIMING), keys, insecure,
                      ctx=contexts[1], credential=credential)
    background(stack, sched.run)
    port1 = free_port()
    relay = Relay(port1)
    stack.callback(relay.close)
    nodes = []
    for stage, (start, end), listen, advertise in ((0, (0, 6), "tcp://127.0.0.1:*", ""),
                                                   (1, (6, 12), f"tcp://127.0.0.1:{port1}",
                                                    f"tcp://127.0.0.1:{relay.port}")):
        settings = NodeSettings(f"n{stage}", MODEL, start, end, CFG.n_layers, stage, sched.address, listen=listen,
                                advertise=advertise, timing=TIMING)
        node = EngineNode(settings, torch_engine.TorchEngine(CFG, start, end), keys, insecure,
                          ctx=contexts[2 + stage],
                          credential=credentials.node_credential(credential, stage, f"n{stage}") if credential else "")
        background(stack, node.run)
        nodes.append(node)
    return coord.address, nodes[1], relay


def _stage0_activations() -> bytes:
    e = torch_engine.TorchEngine(CFG, 0, 6)
    out = e.forward([Step("x", 0, tokens=np.asarray(ByteTokenizer().encode(PROMPT)))])[0]
    return out.hidden.tobytes()


def _intruder(address: str, ctx: zmq.Context, keys: CurveKeys | None) -> Client:
    """A client on another machine: either no CURVE at all, or its own keypair (it knows the server's public key)."""
    c = Client(address, ctx=ctx, timeout_s=1.0, insecure=True)
    if keys is not None:
        c.sock.close(linger=0)
        c.sock = ctx.socket(zmq.DEALER)
        c.sock.linger = 0
        c.sock.curve_secretkey, c.sock.curve_publickey, c.sock.curve_serverkey = keys.secret, keys.public, keys.server
        c.sock.connect(address)
    return c


class _Stranger:
    def __init__(self, server_public: bytes) -> None:
        public, self.secret = zmq.curve_keypair()
        self.public, self.server = public, server_public


@pytest.mark.parametrize("curve", [True, False], ids=["curve", "insecure-control"])
def test_without_the_key_no_work_is_accepted_and_activations_are_unreadable(curve):
    keys = CurveKeys.generate() if curve else None
    expected = generate(MODEL, PROMPT, 6, ignore_eos=True)
    with ExitStack() as stack:
        address, node1, relay = _deploy(stack, keys)
        owner = Client(address, keys=keys, ctx=zmq.Context.instance(), timeout_s=20.0, insecure=not curve)
        stack.callback(owner.close)
        owner.wait_ready(1, timeout_s=20.0)
        done = owner.complete(MODEL, [PROMPT], max_tokens=6, ignore_eos=True)[0]
        assert done["kind"] == "done" and done["tokens"] == list(expected.tokens)

        # Wiretap: the stage-0 output for this prompt crosses the relay in the clear only without CURVE.
        with relay.lock:
            leaked = _stage0_activations()[:512] in relay.captured
        assert len(relay.captured) > 0 and leaked is (not curve)

        ctx = zmq.Context()
        stack.callback(ctx.term)
        intruders = [_intruder(address, ctx, None)]
        if curve:
            intruders.append(_intruder(address, ctx, _Stranger(keys.public)))
        for c in intruders:
            stack.callback(c.close)
            c.submit(MODEL, PROMPT, max_tokens=2)
        for c in intruders:
            if curve:
                with pytest.raises(CoralError, match="no reply"):
                    c.next_event(timeout_s=1.0)
            else:
                assert c.next_event(timeout_s=10.0)["kind"] == "accepted"
        submitted = owner.status()["counts"]["submitted"]
        assert submitted == (1 if curve else 1 + len(intruders))

        # Forged activations pushed straight at stage 1's data port run only without CURVE.
        before = node1.steps_run
        push = ctx.socket(zmq.PUSH)
        push.linger = 0
        stack.callback(push.close)
        push.connect(node1.s.listen)
        hidden = np.zeros((3, CFG.hidden), dtype=np.float32)
        wire.send(push, {"kind": "forward", "rid": "forged", "pos": 0, "stage": 1, "route": ["x", "x"],
                         "handoff": None}, [hidden], block=False)
        deadline = time.monotonic() + (1.0 if curve else 10.0)
        while time.monotonic() < deadline and node1.steps_run == before:
            time.sleep(0.05)
        assert (node1.steps_run > before) is (not curve)


def test_every_role_refuses_plain_tcp_unless_told_the_network_is_trusted():
    ctx = zmq.Context()
    try:
        for make in (lambda: Coordinator(CoordinatorConfig(listen="tcp://127.0.0.1:*", http_port=None), ctx=ctx),
                     lambda: Client("tcp://127.0.0.1:1", ctx=ctx),
                     lambda: Scheduler(SchedulerConfig("i", MODEL, "aggregated", (12,), 12, "tcp://127.0.0.1:1",
                                                       listen="tcp://127.0.0.1:*"), ctx=ctx)):
            with pytest.raises(CoralError, match="CORAL_CURVE_SECRET_KEY.*--insecure"):
                make()
    finally:
        ctx.term()


def _ready(stack: ExitStack, keys: CurveKeys, registration_key: str = "") -> tuple[str, Client, zmq.Context]:
    """A deployed, ready instance: its coordinator address, the owner's client, a context for other peers."""
    address, _, _ = _deploy(stack, keys, registration_key)
    owner = Client(address, keys=keys, ctx=zmq.Context.instance(), timeout_s=20.0)
    stack.callback(owner.close)
    owner.wait_ready(1, timeout_s=20.0)
    ctx = zmq.Context()
    stack.callback(ctx.term)
    return address, owner, ctx


def _replies(sock: zmq.Socket, window_s: float = 1.5) -> list[str]:
    """Kinds of every message `sock` receives within `window_s`."""
    kinds: list[str] = []
    deadline = time.monotonic() + window_s
    while (left := deadline - time.monotonic()) > 0:
        if sock.poll(max(1, int(1000 * left))):
            kinds += [h["kind"] for _, h, _ in wire.drain(sock)]
    return kinds


def _insider(keys: CurveKeys) -> SimpleNamespace:
    """The deployment's own keypair, shaped like `_Stranger`: what any process of the deployment holds."""
    return SimpleNamespace(secret=keys.secret, public=keys.public, server=keys.public)


def _peer(ctx: zmq.Context, address: str, identity: bytes, keys=None) -> zmq.Socket:
    """A DEALER with a chosen routing id, CURVE-configured with `keys` (deployment or stranger) or plain."""
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.setsockopt(zmq.IDENTITY, identity)
    if keys is not None:
        sock.curve_secretkey, sock.curve_publickey, sock.curve_serverkey = keys.secret, keys.public, keys.server
    sock.connect(address)
    return sock


def test_no_peer_can_register_heartbeat_or_displace_a_live_instance_without_its_connection():
    keys = CurveKeys.generate()
    insider = _insider(keys)
    with ExitStack() as stack:
        address, owner, ctx = _ready(stack, keys)
        # Outsiders (no CURVE, or a key the deployment never issued) take the scheduler's routing id; an insider
        # holding the deployment key tries from a second connection under another id.
        peers = [_peer(ctx, address, b"scheduler:i0"), _peer(ctx, address, b"scheduler:i0", _Stranger(keys.public)),
                 _peer(ctx, address, b"scheduler:evil", insider)]
        for sock in peers:
            stack.callback(sock.close)
            for header in ({"kind": "register", "instance": "i0", "model": "evil", "phase": "aggregated",
                            "tokens_per_s": 1e9}, {"kind": "register", "instance": "new", "model": "evil",
                                                   "phase": "aggregated", "tokens_per_s": 1e9},
                           {"kind": "heartbeat", "instance": "i0", "healthy": False},
                           {"kind": "health", "instance": "i0", "healthy": False, "problem": "forged"},
                           {"kind": "left", "instance": "i0"}):
                wire.send(sock, header, block=True)
        outsider, stranger, insider_replies = (_replies(sock) for sock in peers)
        status = owner.status()
        live = {i["instance"]: (i["model"], i["state"]) for i in status["instances"]}
        # Only the insider, holding the deployment's key, may add an instance of its own; none may touch i0.
        assert live.pop("i0") == (MODEL, "ready") and list(live) == ["new"]
        assert status["departed"] == []
        assert outsider == [] and stranger == []
        assert "refused" in insider_replies and "reregister" in insider_replies
        done = owner.complete(MODEL, [PROMPT], max_tokens=3, ignore_eos=True)[0]
        assert done["kind"] == "done" and done["instances"] == ["i0"]


def _register(sock: zmq.Socket, name: str, credential: str, incarnation: str) -> list[str]:
    """Register `name` as a scheduler does: answer the coordinator's challenge with a proof of `credential`."""
    header = {"kind": "register", "instance": name, "model": MODEL, "phase": "aggregated", "tokens_per_s": 1e9,
              "incarnation": incarnation}
    wire.send(sock, header, block=True)
    assert sock.poll(5000)
    (_, challenge, _), = wire.drain(sock)
    assert challenge["kind"] == "challenge"
    answer = credentials.proof(credential, challenge["nonce"], name, incarnation)
    wire.send(sock, {**header, "proof": answer}, block=True)
    return _replies(sock, 1.0)


def test_an_instance_name_is_bound_to_its_credential_so_an_insider_cannot_take_it_over():
    keys, registration_key = CurveKeys.generate(), credentials.generate()
    of = {name: credentials.instance_credential(registration_key, name) for name in ("i0", "x", "insider")}
    with ExitStack() as stack:
        # The real scheduler answers the challenge with its credential: i0 becomes ready.
        address, owner, ctx = _ready(stack, keys, registration_key)
        insider = _peer(ctx, address, b"insider", _insider(keys))
        stack.callback(insider.close)
        # An insider holds the deployment's CURVE key and its own instance's credential, not another's.
        assert _register(insider, "i0", of["insider"], "a") == ["refused"]
        assert _register(insider, "new", of["insider"], "b") == ["refused"]
        wire.send(insider, {"kind": "register", "instance": "new", "model": MODEL, "phase": "aggregated",
                            "tokens_per_s": 1e9, "proof": "0" * 64}, block=True)
        assert _replies(insider, 1.0) == ["challenge"]
        # Instance x registers, and its connection closes (its process is gone, as in a restart).
        genuine = _peer(ctx, address, b"x-1", _insider(keys))
        assert _register(genuine, "x", of["x"], "first") == ["registered"]
        genuine.close()
        time.sleep(0.5)
        assert _register(insider, "x", of["insider"], "c") == ["refused"]
        # Its restart, holding x's credential, takes the name back from a new connection.
        restarted = _peer(ctx, address, b"x-2", _insider(keys))
        stack.callback(restarted.close)
        assert _register(restarted, "x", of["x"], "second") == ["registered"]
        # The insider may register only the instance whose credential it holds.
        assert _register(insider, "insider", of["insider"], "d") == ["registered"]
        live = {i["instance"] for i in owner.status()["instances"]}
        assert live == {"i0", "x", "insider"}
        done = owner.complete(MODEL, [PROMPT], max_tokens=3, ignore_eos=True)[0]
        assert done["kind"] == "done"


def test_a_scheduler_without_its_credential_is_challenged_and_never_registered(caplog):
    keys, registration_key = CurveKeys.generate(), credentials.generate()
    with ExitStack() as stack:
        contexts = [zmq.Context() for _ in range(3)]
        for ctx in contexts:
            stack.callback(ctx.term)
        coord = Coordinator(CoordinatorConfig(listen="tcp://127.0.0.1:*", http_port=None, timing=TIMING), keys,
                            ctx=contexts[0], registration_key=registration_key)
        background(stack, coord.run)
        sched = Scheduler(SchedulerConfig("i0", MODEL, "aggregated", (12,), CFG.n_layers, coord.address,
                                          listen="tcp://127.0.0.1:*", timing=TIMING), keys, ctx=contexts[1])
        background(stack, sched.run)
        node = EngineNode(NodeSettings("n0", MODEL, 0, 12, CFG.n_layers, 0, sched.address,
                                       listen="tcp://127.0.0.1:*", timing=TIMING),
                          torch_engine.TorchEngine(CFG, 0, 12), keys, ctx=contexts[2])
        background(stack, node.run)
        with caplog.at_level("WARNING"):
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline and "CORAL_INSTANCE_CREDENTIAL is not set" not in caplog.text:
                time.sleep(0.1)
        assert "CORAL_INSTANCE_CREDENTIAL is not set" in caplog.text
        assert sched.healthy and not sched.registered and coord.instances == {}


def test_serve_keys_prints_keys_and_credentials_a_coordinator_accepts(monkeypatch):
    """`coral serve keys` gives a working CURVE pair and a registration key; `--credential NAME` run with that key
    prints what a coordinator holding it accepts for NAME, and only for NAME."""
    runner = CliRunner()
    doc = json.loads(runner.invoke(serve_cli.serve, ["keys", "--json"], catch_exceptions=False).output)
    assert set(doc) == {"CORAL_CURVE_SECRET_KEY", "CORAL_CURVE_PUBLIC_KEYS", "CORAL_REGISTRATION_KEY"}
    keys = CurveKeys.from_env(doc)
    assert keys.public == zmq.curve_public(keys.secret) == doc["CORAL_CURVE_PUBLIC_KEYS"].encode()
    monkeypatch.delenv("CORAL_REGISTRATION_KEY", raising=False)
    refused = runner.invoke(serve_cli.serve, ["keys", "--credential", "i0"])
    assert isinstance(refused.exception, CoralError) and "CORAL_REGISTRATION_KEY is not set" in str(refused.exception)
    monkeypatch.setenv("CORAL_REGISTRATION_KEY", doc["CORAL_REGISTRATION_KEY"])
    printed = runner.invoke(serve_cli.serve, ["keys", "--credential", "i0"], catch_exceptions=False).output.strip()
    with ExitStack() as stack:
        ctx = zmq.Context()
        stack.callback(ctx.term)
        coord = Coordinator(CoordinatorConfig(listen="tcp://127.0.0.1:*", http_port=None, timing=TIMING), keys,
                            ctx=ctx, registration_key=doc["CORAL_REGISTRATION_KEY"])
        background(stack, coord.run)
        peer = _peer(ctx, coord.address, b"p", _insider(keys))
        stack.callback(peer.close)
        assert _register(peer, "i1", printed, "a") == ["refused"]
        assert _register(peer, "i0", printed, "b") == ["registered"]


def test_a_proof_answers_one_nonce_for_one_name_and_incarnation():
    key = credentials.generate()
    cred = credentials.instance_credential(key, "i0")
    answer = credentials.proof(cred, "n1", "i0", "inc")
    assert credentials.verify(key, "n1", "i0", "inc", answer)
    for nonce, name, incarnation in (("n2", "i0", "inc"), ("n1", "i1", "inc"), ("n1", "i0", "other")):
        assert not credentials.verify(key, nonce, name, incarnation, answer)
    assert not credentials.verify(credentials.generate(), "n1", "i0", "inc", answer)
    with pytest.raises(CoralError, match="CORAL_REGISTRATION_KEY holds 5 characters"):
        credentials.from_env(credentials.Env.REGISTRATION_KEY, {"CORAL_REGISTRATION_KEY": "short"})


def test_oversized_messages_are_dropped_before_they_are_read():
    keys = CurveKeys.generate()
    with ExitStack() as stack:
        address, owner, ctx = _ready(stack, keys)
        big = _peer(ctx, address, b"big", _insider(keys))
        stack.callback(big.close)
        big.send_multipart([json.dumps({"kind": "status", "tag": "x", "pad": "a" * (wire.MAX_CONTROL_BYTES + 1)})
                            .encode()])
        assert not big.poll(1000), "an oversized message was answered"
        with pytest.raises(wire.WireError, match="frames"):
            wire.unpack([b'{"kind": "x"}'] * (wire.MAX_FRAMES + 1))
        deep = b"[" * 100_000 + b"]" * 100_000
        with pytest.raises(wire.WireError, match="RecursionError"):
            wire.unpack([deep])
        big.send_multipart([deep])
        assert not big.poll(500), "a header nested too deep was answered"
        assert owner.status()["instances"][0]["state"] == "ready"
        done = owner.complete(MODEL, [PROMPT], max_tokens=2, ignore_eos=True)[0]
        assert done["kind"] == "done"
