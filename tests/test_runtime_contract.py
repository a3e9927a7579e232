"""The runtime protocol's contract: every kind the code sends is declared, every declared kind is sent and handled
by its receiver, every handler's kind is declared, every message a real deployment sends has its declared shape;
and every `CORAL_*` variable that `coral serve`, the deployment specs and the SkyPilot tasks use is in one table."""

from __future__ import annotations

import ast
import re
import threading
from contextlib import ExitStack
from pathlib import Path

import pytest
import zmq

from coral_dagster.cli.serve import serve
from coral_dagster.runtime import wire
from coral_dagster.runtime.client import FINAL, Client
from coral_dagster.runtime.config import CoordinatorConfig, NodeSettings, SchedulerConfig, Timing
from coral_dagster.runtime.coordinator import Coordinator
from coral_dagster.runtime.node import EngineNode
from coral_dagster.runtime.protocol import MESSAGES, Env, Kind, Link, ProtocolError, check
from coral_dagster.runtime.scheduler import Scheduler
from coral_dagster.runtime.tiny import decoder_config
from support.runtime_fakes import background

ROOT = Path(__file__).resolve().parent.parent
RUNTIME = ROOT / "coral_dagster" / "runtime"
MODEL = "tiny-llama"


def _sent_kinds() -> dict[str, set[str]]:
    """Per runtime file, the kinds written as `{"kind": …}` in a dict literal (a string or `Kind.X`)."""
    found: dict[str, set[str]] = {}
    for path in RUNTIME.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Dict):
                continue
            for key, value in zip(node.keys, node.values):
                if not (isinstance(key, ast.Constant) and key.value == "kind"):
                    continue
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    found.setdefault(path.name, set()).add(value.value)
                elif (isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name)
                      and value.value.id == "Kind"):
                    found.setdefault(path.name, set()).add(Kind[value.attr].value)
    return found


def test_every_kind_sent_is_declared_and_every_declared_kind_is_sent():
    sent = _sent_kinds()
    everything = set().union(*sent.values())
    assert everything - {k.value for k in Kind} == set()
    assert {k.value for k in Kind} - everything == set()
    # Every kind travels on some link, and every link's kinds are kinds.
    assert set().union(*(set(kinds) for kinds in MESSAGES.values())) == set(Kind)


def test_every_received_kind_has_a_handler_and_every_handler_a_declared_kind():
    tables = {(Link.CLIENT_TO_COORDINATOR, Coordinator): Coordinator.CLIENT_HANDLERS,
              (Link.SCHEDULER_TO_COORDINATOR, Coordinator): Coordinator.SCHEDULER_HANDLERS,
              (Link.COORDINATOR_TO_SCHEDULER, Scheduler): Scheduler.COORDINATOR_HANDLERS,
              (Link.NODE_TO_SCHEDULER, Scheduler): Scheduler.ENGINE_HANDLERS}
    for (link, cls), handlers in tables.items():
        assert set(handlers) == set(MESSAGES[link]), link
        assert all(callable(getattr(cls, name)) for name in handlers.values()), link
    assert EngineNode.CONTROL_KINDS == set(MESSAGES[Link.SCHEDULER_TO_NODE])
    assert set(MESSAGES[Link.DATA]) == {Kind.FORWARD, Kind.KV}
    # Clients read every event by its tag and stop at these.
    assert set(FINAL) <= set(MESSAGES[Link.COORDINATOR_TO_CLIENT])


@pytest.mark.parametrize("header, words", [
    ({"kind": "generate", "rid": "r", "tokens": [1], "max_tokens": True}, ["max_tokens", "bool"]),
    ({"kind": "forward", "rid": "r", "pos": 0, "stage": 0}, ["lacks", "route"]),
    ({"kind": "hello", "node": "n", "stage": 0, "start": 0, "end": "6", "data": "x", "model": "m"}, ["end", "str"]),
    ({"kind": "teleport"}, ["teleport", "does not travel"]),
])
def test_a_message_of_the_wrong_shape_is_refused_naming_the_field(header, words):
    with pytest.raises(ProtocolError) as err:
        check(tuple(Link), header)
    assert all(w in str(err.value) for w in words)


def _run_everything(stack: ExitStack) -> Client:
    """An aggregated instance and a prefill/decode pair (torch engines, one context per role, on threads)."""
    from coral_dagster.runtime.torch_engine import TorchEngine

    cfg, timing = decoder_config(MODEL), Timing(heartbeat_s=0.1, dead_after_s=2.0, request_timeout_s=30.0)
    contexts = []

    def ctx() -> zmq.Context:
        contexts.append(zmq.Context())
        stack.callback(contexts[-1].term)
        return contexts[-1]
    coord = Coordinator(CoordinatorConfig(listen="tcp://127.0.0.1:*", http_port=None, timing=timing), None, True,
                        ctx=ctx())
    background(stack, coord.run)
    for name, phase in (("agg", "aggregated"), ("pre", "prefill"), ("dec", "decode")):
        sched = Scheduler(SchedulerConfig(name, MODEL, phase, (6, 6), cfg.n_layers, coord.address,
                                          listen="tcp://127.0.0.1:*", timing=timing), None, True, ctx=ctx())
        background(stack, sched.run)
        for stage, (start, end) in enumerate(((0, 6), (6, 12))):
            settings = NodeSettings(f"{name}{stage}", MODEL, start, end, cfg.n_layers, stage, sched.address,
                                    timing=timing)
            background(stack, EngineNode(settings, TorchEngine(cfg, start, end), None, True, ctx=ctx()).run)
    client = Client(coord.address, ctx=ctx(), timeout_s=30, insecure=True)
    stack.callback(client.close)
    client.wait_ready(3, timeout_s=30)
    return client


def test_every_message_a_deployment_sends_has_its_declared_shape(monkeypatch):
    pytest.importorskip("torch")
    sent: list[dict] = []
    lock = threading.Lock()
    real = wire.send

    def recording(sock, header, *args, **kw):
        with lock:
            sent.append(dict(header))
        return real(sock, header, *args, **kw)

    monkeypatch.setattr(wire, "send", recording)
    with ExitStack() as stack:
        c = _run_everything(stack)
        finals = c.complete(MODEL, ["one", "two", "three", "four"], max_tokens=4, ignore_eos=True)
        assert all(e["kind"] == "done" for e in finals)
        tag = c.submit(MODEL, "to cancel", max_tokens=200, ignore_eos=True)
        rid = c.next_event({tag})["rid"]
        c.cancel(rid)
        c.admit("tiny-llama=100")
        c.status()
        c.drain("agg")
        threading.Event().wait(1.0)
    kinds = {h["kind"] for h in sent}
    assert {Kind.PREFILL, Kind.DECODE, Kind.KV_ROUTE, Kind.KV, Kind.PREFILLED, Kind.FIRST_TOKEN, Kind.GENERATE,
            Kind.PULSE, Kind.HELLO, Kind.FREE, Kind.DRAIN, Kind.DRAINING, Kind.CANCEL} <= kinds
    for header in sent:
        header.pop("tag", None)
        check(tuple(Link), header)


def _serve_envvars() -> set[str]:
    return {p.envvar for cmd in serve.commands.values() for p in cmd.params if getattr(p, "envvar", None)}


def test_one_table_names_every_coral_variable_of_the_runtime():
    table = {e.value for e in Env}
    options = _serve_envvars()
    assert options <= table
    # Variables no option reads: the keys (secrets travel in the environment, never on a command line) and those of
    # the task scripts.
    assert table - options == {Env.CURVE_SECRET_KEY, Env.CURVE_PUBLIC_KEYS, Env.REGISTRATION_KEY,
                               Env.INSTANCE_CREDENTIAL, Env.NODE_CREDENTIAL,
                               Env.HEAD, Env.VLLM_SPEC, Env.PROFILE_NODE, Env.PROFILE_LAYERS,
                               Env.MODELS_DIR, Env.PLAIN_HTTP, Env.PRIMARY, Env.TLS_PEMFILE,
                               Env.COORDINATOR_HTTP_PORT}
    # What the deployment specs and SkyPilot tasks set, and what any runtime module reads, is in the table.
    written = set()
    for path in [ROOT / "coral_dagster" / "deploy" / "spec.py", ROOT / "coral_dagster" / "deploy" / "tasks.py",
                 *(ROOT / "sky_tasks").glob("*.yaml"), *RUNTIME.glob("*.py")]:
        text = path.read_text()
        written |= set(re.findall(r'"(CORAL_[A-Z_]+)"', text)) | set(re.findall(r"^\s+(CORAL_[A-Z_]+):", text, re.M))
    assert written and written <= table, written - table
