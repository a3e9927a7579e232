"""A serving instance's scheduler: admits its engine nodes, routes each request through one node per stage."""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from coral_dagster.runtime import credentials, wire
from coral_dagster.layer_split import stage_ranges
from coral_dagster.runtime.config import SchedulerConfig
from coral_dagster.runtime.protocol import Env, Kind, Link, check
from coral_dagster.runtime.security import CurveKeys, Security
from coral_dagster.runtime.tokenizer import finish_reason
from coral_dagster.routing import WeightedRoundRobin

log = logging.getLogger(__name__)

# A prompt is sent through the stages in chunks of this many tokens, each one forward pass: a long prompt's prefill
# never holds a stage for one huge (quadratic) pass, and other requests' steps run between its chunks.
PREFILL_CHUNK_TOKENS = 256
# Prefill tokens in flight on the instance at once; chunks past it wait, the request with the fewest prompt tokens
# left first (shortest remaining first): a light request waits at most for the chunks in flight, never behind a heavy
# one (many long prompts), and the heavy one's prompts finish one after another rather than all at the end.
PREFILL_BUDGET_TOKENS = 512
# Engine connections awaiting their proof that the scheduler remembers a nonce for (a flood forgets the oldest).
MAX_NODE_NONCES = 1024


@dataclass
class _Node:
    node: str
    stage: int
    share: float
    address: str
    last_seen: float
    # The node generates a whole request from one submission (vLLM) instead of one forward per token.
    streams: bool = False
    # The connection that said hello (its routing id) and the process behind it (a restart is another).
    ident: bytes = b""
    incarnation: str = ""
    # Its KV cache as its pulses last said: tokens held and tokens it can hold (0: not said).
    kv_used_tokens: int = 0
    kv_capacity_tokens: int = 0


@dataclass
class _Request:
    """One request on this instance; `mode` is aggregated, prefill (hand KV over, one token) or decode."""

    rid: str
    mode: str
    route: list[str]
    pos: int
    max_tokens: int
    ignore_eos: bool
    n_out: int = 0
    last_progress: float = field(default_factory=time.monotonic)
    streamed: bool = False
    # Sampling parameters as the coordinator sent them (`runtime/sampling.py`), passed to the last stage.
    sampling: dict[str, Any] | None = None
    # Prompt tokens not yet sent (chunked prefill), the KV handoff that goes with the last chunk, and the tokens of
    # the chunk now in flight (counted against the instance's prefill budget).
    prompt_left: list[int] = field(default_factory=list)
    handoff: list | None = None
    chunk_tokens: int = 0
    # When the request reached this instance: the prefill queue's tie-break.
    arrived: float = field(default_factory=time.monotonic)
    # The prompt's log-probabilities (positions 1.., as messages) gathered chunk by chunk until the first token goes
    # out with them; None where the request ran no prompt here or asked for none.
    prompt_logprobs: list | None = None

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.sampling is not None and self.sampling.get("prompt_logprobs") is not None


class Scheduler:
    """Registers the instance with the coordinator once every stage has a live node, and drives requests.

    From the coordinator: `registered`, `reregister`, `refused`, `challenge {nonce}`, `ack`,
    `generate {rid, tokens, max_tokens, ignore_eos}`,
    `prefill {rid, tokens, handoff}`, `decode {rid, prompt_len, max_tokens, ignore_eos}` (answered with
    `kv_route`), `first_token {rid, token}` (from a vLLM prefill also `tokens`, `kv_transfer_params`),
    `cancel {rid}`, `drain`. To it: `register`, `heartbeat`, `health`, `token`, `done`, `prefilled`, `kv_route`,
    `error`, `draining`, `left`.

    A node is bound to the connection that said hello: routing ids are never handed over to a newer connection,
    and a hello under a known name is taken only once the old connection is gone (a restart), whose requests then
    fail at once, to resume on another instance.

    A coordinator that holds a registration key answers `register` with `challenge {nonce}`; the registration is
    then sent again with a proof of `credential` (the instance's, from `credentials.instance_credential`).

    With a `credential`, an engine node joins only by proving its own slot's (`credentials.node_credential` of this
    instance, its stage and its name): a `hello` without a proof is answered with `challenge {nonce}` and nothing
    else, a wrong proof with `reject`, so a process holding only the deployment's CURVE key is never welcomed and is
    never routed a request. Without one (no registration key in the deployment) nodes are bound to their connection
    only.
    """

    def __init__(self, cfg: SchedulerConfig, keys: CurveKeys | None = None, insecure: bool = False,
                 ctx: zmq.Context | None = None, credential: str = "") -> None:
        self.cfg = cfg
        self.credential = credential
        self._nonce: str | None = None
        # The nonce each engine connection must answer in its hello, oldest dropped first.
        self._node_nonces: OrderedDict[bytes, str] = OrderedDict()
        # The nonce each engine connection last proved: a second answer to it (the node answers every challenge,
        # and a hello without proof sent meanwhile draws a new one) is that connection's, not a forgery.
        self._node_proved: OrderedDict[bytes, str] = OrderedDict()
        self.ranges = stage_ranges(cfg.split)
        # An own context is terminated on close, which flushes the last messages before the process exits.
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.Context()
        self.security = Security(self.ctx, keys, insecure)
        self.engines = self.ctx.socket(zmq.ROUTER)
        self.engines.linger = 0
        self.address = self.security.bind(self.engines, cfg.listen, router=True)
        self.coord = self.ctx.socket(zmq.DEALER)
        self.coord.linger = 0
        coordinators = [e.strip() for e in cfg.coordinator.split(",") if e.strip()]
        if len(coordinators) > 1:
            # A coordinator pair (primary, standby): only one listens at a time, so queue only to a connection that
            # is up, and drop one whose peer stopped answering ZeroMQ heartbeats (a VM gone without a reset).
            self.coord.immediate = True
            self.coord.heartbeat_ivl = int(1000 * cfg.timing.heartbeat_s)
            self.coord.heartbeat_timeout = int(1000 * cfg.timing.dead_after_s)
        for endpoint in coordinators:
            self.security.connect(self.coord, endpoint)
        self.incarnation = secrets.token_hex(16)
        # Given to welcomed nodes only: every data message into this instance carries a MAC under it.
        self.route_key = secrets.token_hex(32)
        self.nodes: dict[str, _Node] = {}
        self.requests: dict[str, _Request] = {}
        self._wrr = [WeightedRoundRobin() for _ in self.ranges]
        self._drain = threading.Event()
        self.registered = False
        self.healthy = False
        self.draining_since: float | None = None
        # Requests whose next prefill chunk waits for the budget; prefill tokens in flight.
        self._prefill_queue: list[str] = []
        self._prefill_in_flight = 0
        # When any request last progressed (a token or a prefill chunk), and which did since the last heartbeat.
        self._last_progress = time.monotonic()
        self._progressed: set[str] = set()

    def drain(self) -> None:
        """Ask the scheduler (from any thread) to stop taking requests, finish those in flight and leave."""
        self._drain.set()

    def _to_coord(self, header: dict[str, Any]) -> None:
        wire.send(self.coord, {**header, "instance": self.cfg.instance})

    def _to_node(self, node: str, header: dict[str, Any]) -> bool:
        """Send to a known node's connection; False when that connection is gone."""
        return wire.send(self.engines, header, to=self.nodes[node].ident)

    def _stage_ready(self) -> list[bool]:
        return [any(n.stage == s for n in self.nodes.values()) for s in range(len(self.ranges))]

    def _stages(self) -> list[dict[str, Any]]:
        return [{"start": a, "end": b, "nodes": [{"node": n.node, "share": n.share, "data": n.address}
                                                 for n in self.nodes.values() if n.stage == s]}
                for s, (a, b) in enumerate(self.ranges)]

    def _registration(self) -> dict[str, Any]:
        c = self.cfg
        return {"kind": Kind.REGISTER, "incarnation": self.incarnation, "model": c.model, "phase": c.phase,
                "tokens_per_s": c.tokens_per_s,
                "region": c.region, "weight": c.route_weight or c.tokens_per_s,
                "split": list(c.split), "stages": self._stages(),
                "limits": c.limits.message() if c.limits else None,
                **({"proof": credentials.proof(self.credential, self._nonce, c.instance, self.incarnation)}
                   if self._nonce is not None and self.credential else {})}

    def run(self, stop: threading.Event | None = None) -> str:
        """Serve until drained, stopped, or the coordinator, once heard, is silent for `orphan_after_s`; says why."""
        stop = stop or threading.Event()
        t = self.cfg.timing
        poller = zmq.Poller()
        poller.register(self.coord, zmq.POLLIN)
        poller.register(self.engines, zmq.POLLIN)
        last_beat = 0.0
        last_coord: float | None = None
        try:
            while not stop.is_set():
                events = dict(poller.poll(timeout=int(1000 * t.heartbeat_s / 4)))
                now = time.monotonic()
                if self.engines in events:
                    self._from_engines(now)
                if self.coord in events:
                    last_coord = now
                    self._from_coordinator(now)
                self._check_nodes(now)
                if now - last_beat >= t.heartbeat_s:
                    last_beat = now
                    self._beat()
                self._check_requests(now)
                self._pump_prefill()
                if self._drain.is_set() and self.draining_since is None:
                    self.draining_since = now
                    self._to_coord({"kind": Kind.DRAINING})
                if self.draining_since is not None and self._drained(now, self.draining_since):
                    return "drained"
                if last_coord is not None and now - last_coord > t.orphan_after_s:
                    return f"coordinator silent for {now - last_coord:.0f} s"
            return "stopped"
        finally:
            for n in self.nodes.values():
                self._to_node(n.node, {"kind": Kind.STOP})
            self.close()

    def _beat(self) -> None:
        if not self.registered and all(self._stage_ready()):
            self._to_coord(self._registration())
        now = time.monotonic()
        self._to_coord({"kind": Kind.HEARTBEAT, "incarnation": self.incarnation, "healthy": self.healthy,
                        "in_flight": len(self.requests), "draining": self.draining_since is not None,
                        "stages": self._stages(), "progressed": sorted(self._progressed),
                        "stalled_s": now - self._last_progress if self.requests else 0.0,
                        "progress_timeout_s": self._progress_timeout_s(), **self._kv_usage()})
        self._progressed.clear()
        for n in self.nodes.values():
            self._to_node(n.node, {"kind": Kind.PING})

    def _kv_usage(self) -> dict[str, int]:
        """The instance's KV use for its heartbeat: that of its fullest stage (each stage holds every request's KV
        for its layers, so the first stage to fill bounds the instance), its nodes' tokens summed; {} when no node
        has said."""
        stages = [(sum(n.kv_used_tokens for n in nodes), sum(n.kv_capacity_tokens for n in nodes))
                  for nodes in ([n for n in self.nodes.values() if n.stage == s and n.kv_capacity_tokens]
                                for s in range(len(self.ranges))) if nodes]
        if not stages:
            return {}
        used, capacity = max(stages, key=lambda uc: uc[0] / uc[1])
        return {"kv_used_tokens": used, "kv_capacity_tokens": capacity}

    def _drained(self, now: float, draining_since: float) -> bool:
        if self.requests and now - draining_since < self.cfg.timing.drain_timeout_s:
            return False
        for rid in list(self.requests):
            self._fail(rid, f"instance {self.cfg.instance} left after a {self.cfg.timing.drain_timeout_s:g} s "
                       "drain timeout")
        self._to_coord({"kind": Kind.LEFT})
        return True

    def _set_health(self) -> None:
        ready = self._stage_ready()
        healthy = all(ready)
        if healthy != self.healthy:
            self.healthy = healthy
            missing = [f"stage {s} (layers {a}:{b})" for s, ((a, b), ok) in enumerate(zip(self.ranges, ready))
                       if not ok]
            problem = "" if healthy else f"no live engine node for {', '.join(missing)}"
            if healthy:
                log.info("instance %s healthy", self.cfg.instance)
            else:
                log.warning("instance %s unhealthy: %s", self.cfg.instance, problem)
            if self.registered:
                self._to_coord({"kind": Kind.HEALTH, "healthy": healthy, "problem": problem})

    def _check_nodes(self, now: float) -> None:
        dead = [n for n in self.nodes.values() if now - n.last_seen > self.cfg.timing.dead_after_s]
        for n in dead:
            log.warning("engine node %s (stage %d) missed heartbeats for %.1f s", n.node, n.stage,
                        now - n.last_seen)
        self._lose(dead, "stopped responding")

    def _lose(self, dead: list[_Node], how: str) -> None:
        """Forget `dead` nodes and fail the requests routed through them (health first, so the coordinator sends
        their retries elsewhere)."""
        for n in dead:
            self.nodes.pop(n.node, None)
        self._set_health()
        for n in dead:
            problem = (f"engine node {n.node} (stage {n.stage}, layers {self.ranges[n.stage][0]}:"
                       f"{self.ranges[n.stage][1]}) of instance {self.cfg.instance} {how}")
            for rid, r in list(self.requests.items()):
                if n.address in r.route:
                    self._fail(rid, problem)

    def _progress_timeout_s(self) -> float:
        """How long a request may go without progress: `request_timeout_s` per budget's worth of prefill tokens the
        stages hold (in flight and waiting), so the limit scales with the work ahead of it."""
        held = self._prefill_in_flight + sum(len(self.requests[rid].prompt_left) for rid in self._prefill_queue
                                             if rid in self.requests)
        return self.cfg.timing.request_timeout_s * max(1.0, held / PREFILL_BUDGET_TOKENS)

    def _check_requests(self, now: float) -> None:
        limit = self._progress_timeout_s()
        for rid, r in list(self.requests.items()):
            if now - r.last_progress > limit:
                self._fail(rid, f"no progress on instance {self.cfg.instance} for {limit:g} s")

    def _progress(self, r: _Request, now: float) -> None:
        r.last_progress = self._last_progress = now
        self._progressed.add(r.rid)

    def _fail(self, rid: str, problem: str, status: int | None = None) -> None:
        """Fail one request; `status` 4xx says the request itself is at fault, so it is not retried elsewhere."""
        r = self.requests.pop(rid, None)
        if r is None:
            return
        self._free(r)
        self._to_coord({"kind": Kind.ERROR, "rid": rid, "problem": problem, "status": status})

    def _free(self, r: _Request) -> None:
        self._prefill_in_flight -= r.chunk_tokens
        r.chunk_tokens = 0
        by_address = {n.address: n.node for n in self.nodes.values()}
        for address in r.route:
            if address in by_address:
                self._to_node(by_address[address], {"kind": Kind.FREE, "rid": r.rid})

    def _from_engines(self, now: float) -> None:
        for ident, h, _ in wire.drain(self.engines, routed=True):
            if ident is None:
                raise RuntimeError("the engines' ROUTER socket gave a message without its sender's routing id")
            try:
                self._on_engine(ident, h, now)
            except Exception as exc:  # noqa: BLE001 - a bad message is dropped, never fatal
                log.warning("dropping a %s message from an engine: %r", h["kind"], exc)

    # The handler of each kind an engine node sends; HELLO and PULSE may come from a connection not yet known.
    ENGINE_HANDLERS = {Kind.HELLO: "_hello", Kind.PULSE: "_pulse", Kind.TOKEN: "_node_token",
                       Kind.ERROR: "_node_error"}

    def _on_engine(self, ident: bytes, h: dict[str, Any], now: float) -> None:
        _, kind = check(Link.NODE_TO_SCHEDULER, h)
        if kind in (Kind.HELLO, Kind.PULSE):
            getattr(self, self.ENGINE_HANDLERS[kind])(ident, h, now)
            return
        node = next((n for n in self.nodes.values() if n.ident == ident), None)
        if node is None:
            wire.send(self.engines, {"kind": Kind.REHELLO}, to=ident)
            return
        node.last_seen = now
        getattr(self, self.ENGINE_HANDLERS[kind])(h, now)

    def _pulse(self, ident: bytes, h: dict[str, Any], now: float) -> None:
        """From the node's heartbeat thread, on a connection of its own: the incarnation vouches for it."""
        node = self.nodes.get(h["node"])
        if node is None:
            wire.send(self.engines, {"kind": Kind.REHELLO}, to=ident)
        elif h["incarnation"] == node.incarnation:
            node.last_seen = now
            if h.get("kv_capacity_tokens", 0) > 0 and h.get("kv_used_tokens", -1) >= 0:
                node.kv_used_tokens, node.kv_capacity_tokens = h["kv_used_tokens"], h["kv_capacity_tokens"]

    def _node_token(self, h: dict[str, Any], now: float) -> None:
        r = self.requests.get(h["rid"])
        if r is not None and r.prompt_logprobs is not None:
            r.prompt_logprobs += h.get("prompt_logprobs", [])
        self._token(h["rid"], h["token"], h["pos"], now, h.get("logprobs"), h.get("kv_transfer_params"))

    def _node_error(self, h: dict[str, Any], now: float) -> None:
        self._fail(h["rid"], h["problem"], h.get("status"))

    def _node_proven(self, ident: bytes, h: dict[str, Any]) -> bool:
        """Whether the hello answers its connection's nonce with a proof of the node's slot credential; else
        challenges the connection (no answer yet) or rejects it (a wrong answer)."""
        nonce, answer = self._node_nonces.get(ident), h.get("proof")
        name, stage, incarnation = str(h["node"]), h.get("stage"), str(h.get("incarnation", ""))
        proved = self._node_proved.get(ident)
        if (answer is not None and proved is not None and isinstance(stage, int)
                and credentials.verify_node(self.credential, proved, stage, name, incarnation, answer)):
            return True
        if nonce is None or answer is None:
            if nonce is None:
                self._node_nonces[ident] = nonce = secrets.token_hex(16)
                while len(self._node_nonces) > MAX_NODE_NONCES:
                    self._node_nonces.popitem(last=False)
            wire.send(self.engines, {"kind": Kind.CHALLENGE, "nonce": nonce}, to=ident)
            return False
        del self._node_nonces[ident]
        if isinstance(stage, int) and credentials.verify_node(self.credential, nonce, stage, name, incarnation,
                                                              answer):
            self._node_proved[ident] = nonce
            while len(self._node_proved) > MAX_NODE_NONCES:
                self._node_proved.popitem(last=False)
            return True
        problem = (f"its credential does not prove node {name} of stage {stage} of instance {self.cfg.instance}; set "
                   f"{Env.NODE_CREDENTIAL.value} to `coral serve keys --credential {self.cfg.instance} --node {name} "
                   f"--stage {stage}` run with this deployment's {Env.REGISTRATION_KEY.value}")
        log.warning("rejected a hello: %s", problem)
        wire.send(self.engines, {"kind": Kind.REJECT, "problem": problem}, to=ident)
        return False

    def _hello(self, ident: bytes, h: dict[str, Any], now: float) -> None:
        name, incarnation = str(h["node"]), str(h.get("incarnation", ""))
        if self.credential and not self._node_proven(ident, h):
            return
        old = self.nodes.get(name)
        if old is not None and old.ident != ident:
            if wire.send(self.engines, {"kind": Kind.PING}, to=old.ident):
                problem = f"node {name} is already connected to instance {self.cfg.instance}"
                log.warning("refused a second hello of live node %s", name)
                wire.send(self.engines, {"kind": Kind.REJECT, "problem": problem}, to=ident)
                return
            # The old connection is gone: the process was killed and restarted, its requests are lost.
            self._lose([old], "was restarted (its process was replaced)")
            old = None
        stage = h.get("stage")
        if (not isinstance(stage, int) or not 0 <= stage < len(self.ranges) or h.get("model") != self.cfg.model
                or self.ranges[stage] != (h.get("start"), h.get("end"))):
            problem = (f"node {name} offers {h.get('model')} stage {stage} layers {h.get('start')}:{h.get('end')}, "
                       f"but instance {self.cfg.instance} serves {self.cfg.model} with stages {self.ranges}")
            log.warning(problem)
            wire.send(self.engines, {"kind": Kind.REJECT, "problem": problem}, to=ident)
            return
        if old is not None and old.incarnation != incarnation:
            # The same connection, another process behind it: no request of the old one survives.
            self._lose([old], "was restarted (its process was replaced)")
        self.nodes[name] = _Node(name, stage, float(h.get("share", 1.0)), str(h["data"]), now,
                                 bool(h.get("streams")), ident, incarnation)
        self._to_node(name, {"kind": Kind.WELCOME, "route_key": self.route_key})
        self._set_health()

    def _route(self) -> list[str] | None:
        """One live node per stage, each stage by weighted round-robin over its nodes' shares."""
        route = []
        for s, wrr in enumerate(self._wrr):
            # Keyed by Hashable, the round-robin's key type, so that its pick indexes the stage's nodes directly.
            live: dict[Hashable, _Node] = {n.node: n for n in self.nodes.values() if n.stage == s}
            if not live:
                return None
            route.append(live[wrr.pick({name: n.share for name, n in live.items()})].address)
        return route

    def _forward(self, r: _Request, tokens: list[int], handoff: list | None = None,
                 kv_transfer_params: dict | None = None) -> None:
        """Send `tokens` into the route: a prompt (more than one token) through the prefill queue, in chunks, on a
        per-step route; at once otherwise, and to a streaming engine (vLLM chunks its own prefill)."""
        if len(tokens) > 1 and not r.streamed and kv_transfer_params is None:
            r.prompt_left, r.handoff = list(tokens), handoff
            self._prefill_queue.append(r.rid)
            self._pump_prefill()
            return
        self._send_step(r, tokens, handoff, kv_transfer_params)

    def _pump_prefill(self) -> None:
        """Send waiting prompt chunks while the budget allows (always one when none is in flight), the request with
        the fewest prompt tokens left first, then the earliest."""
        queue = self._prefill_queue
        queue[:] = [rid for rid in queue if rid in self.requests]
        while queue:
            rid = min(queue, key=lambda q: (len(self.requests[q].prompt_left), self.requests[q].arrived))
            r = self.requests[rid]
            chunk = r.prompt_left[:PREFILL_CHUNK_TOKENS]
            if self._prefill_in_flight and self._prefill_in_flight + len(chunk) > PREFILL_BUDGET_TOKENS:
                return
            queue.remove(rid)
            r.prompt_left = r.prompt_left[len(chunk):]
            r.chunk_tokens = len(chunk)
            self._prefill_in_flight += len(chunk)
            # The tokens each position of the chunk predicts: the rest of the chunk and the next chunk's first.
            targets = chunk[1:] + r.prompt_left[:1] if r.prompt_logprobs is not None else None
            self._send_step(r, chunk, None if r.prompt_left else r.handoff, targets=targets)

    def _send_step(self, r: _Request, tokens: list[int], handoff: list | None = None,
                   kv_transfer_params: dict | None = None, targets: list[int] | None = None) -> None:
        header = {"kind": Kind.FORWARD, "rid": r.rid, "pos": r.pos, "stage": 0, "route": r.route, "handoff": handoff,
                  "sampling": r.sampling, "mac": credentials.step_mac(self.route_key, r.rid, r.pos, 0),
                  **({"targets": targets} if targets else {})}
        if r.streamed:
            header["max_tokens"] = r.max_tokens - r.n_out
        if kv_transfer_params is not None:
            header["kv_transfer_params"] = kv_transfer_params
        if not wire.send(self.security.push(r.route[0]), header, [np.asarray(tokens, dtype=np.int64)]):
            self._fail(r.rid, f"first stage at {r.route[0]} is not accepting requests")

    def _from_coordinator(self, now: float) -> None:
        for _, h, _ in wire.drain(self.coord):
            try:
                self._on_coordinator(h, now)
            except Exception as exc:  # noqa: BLE001 - the request fails alone, the instance keeps serving
                log.warning("failed on a %s message from the coordinator: %r", h["kind"], exc)
                rid = h.get("rid")
                if isinstance(rid, str):
                    self.requests.setdefault(rid, _Request(rid, "failed", [], 0, 0, False))
                    request_fault = isinstance(exc, (KeyError, TypeError, ValueError, OverflowError))
                    self._fail(rid, f"instance {self.cfg.instance} could not run the request: {exc!r}",
                               400 if request_fault else None)

    # The handler of each kind the coordinator sends.
    COORDINATOR_HANDLERS = {Kind.REGISTERED: "_registered", Kind.REREGISTER: "_reregister", Kind.ACK: "_ack",
                            Kind.REFUSED: "_refused", Kind.CHALLENGE: "_challenged", Kind.DRAIN: "_drain_ordered",
                            Kind.CANCEL: "_cancel",
                            Kind.GENERATE: "_admit", Kind.PREFILL: "_admit", Kind.DECODE: "_admit",
                            Kind.FIRST_TOKEN: "_first_token"}

    def _on_coordinator(self, h: dict[str, Any], now: float) -> None:
        _, kind = check(Link.COORDINATOR_TO_SCHEDULER, h)
        getattr(self, self.COORDINATOR_HANDLERS[kind])(h, now)

    def _registered(self, h: dict[str, Any], now: float) -> None:
        self.registered, self._nonce = True, None
        self._to_coord({"kind": Kind.HEALTH, "healthy": self.healthy, "problem": ""})

    def _reregister(self, h: dict[str, Any], now: float) -> None:
        self.registered = False

    def _ack(self, h: dict[str, Any], now: float) -> None:
        """The coordinator heard a heartbeat (or probed this connection): hearing it is all that counts."""

    def _refused(self, h: dict[str, Any], now: float) -> None:
        self._nonce = None
        log.warning("the coordinator refused instance %s: %s", self.cfg.instance, h.get("problem"))

    def _challenged(self, h: dict[str, Any], now: float) -> None:
        """Answer at once with a proof of the credential; without one, say what is missing (once per nonce)."""
        if not self.credential:
            if self._nonce != h["nonce"]:
                log.warning("the coordinator asks instance %s to prove its name, and %s is not set",
                            self.cfg.instance, Env.INSTANCE_CREDENTIAL.value)
            self._nonce = h["nonce"]
            return
        self._nonce = h["nonce"]
        if all(self._stage_ready()):
            self._to_coord(self._registration())

    def _drain_ordered(self, h: dict[str, Any], now: float) -> None:
        self._drain.set()

    def _cancel(self, h: dict[str, Any], now: float) -> None:
        r = self.requests.pop(h["rid"], None)
        if r is not None:
            self._free(r)

    def _first_token(self, h: dict[str, Any], now: float) -> None:
        r = self.requests.get(h["rid"])
        if r is not None:
            r.n_out = 1
            self._progress(r, now)
            if "kv_transfer_params" in h:
                # A vLLM decode instance runs the prompt and the first token again from position 0, its connector
                # loading the prompt's KV from the vLLM prefill instance.
                r.pos = 0
                self._forward(r, [int(x) for x in h["tokens"]], kv_transfer_params=h["kv_transfer_params"])
            else:
                self._forward(r, [h["token"]])

    def _admit(self, h: dict[str, Any], now: float) -> None:
        kind, rid = h["kind"], h["rid"]
        if self.draining_since is not None or not self.healthy:
            state = "draining" if self.draining_since is not None else "unhealthy"
            self._to_coord({"kind": Kind.ERROR, "rid": rid, "problem": f"instance {self.cfg.instance} is {state}"})
            return
        route = self._route()
        if route is None:
            raise RuntimeError(f"instance {self.cfg.instance} is healthy, yet some stage has no live engine node to "
                               "route through")
        if not self.requests:
            # Idle until now: silence before this request is not a stall.
            self._last_progress = now
        mode = {"generate": "aggregated"}.get(kind, kind)
        r = _Request(rid, mode, route, 0, int(h.get("max_tokens", 1)), bool(h.get("ignore_eos")), last_progress=now,
                     sampling=h.get("sampling"))
        streaming = {n.address for n in self.nodes.values() if n.streams}
        r.streamed = all(a in streaming for a in route)
        self.requests[rid] = r
        if kind == Kind.DECODE:
            r.pos = int(h["prompt_len"])
            span = [[a, b, address, credentials.kv_mac(self.route_key, rid)]
                    for (a, b), address in zip(self.ranges, route)]
            self._to_coord({"kind": Kind.KV_ROUTE, "rid": rid, "route": span})
        else:
            if r.wants_prompt_logprobs:
                r.prompt_logprobs = []
            self._forward(r, [int(x) for x in h["tokens"]], h.get("handoff") if kind == "prefill" else None)

    def _token(self, rid: str, token: int, pos: int, now: float, logprobs: Any = None,
               kv_transfer_params: dict | None = None) -> None:
        r = self.requests.get(rid)
        if r is None:
            return
        self._progress(r, now)
        r.pos = pos
        if r.chunk_tokens:
            self._prefill_in_flight -= r.chunk_tokens
            r.chunk_tokens = 0
            if r.prompt_left:
                # A chunk of the prompt is in the caches; its sampled token means nothing yet.
                self._prefill_queue.append(rid)
                self._pump_prefill()
                return
        extra = {"logprobs": logprobs} if logprobs is not None else {}
        # The prompt's log-probabilities go with the first output (or, when that is EOS, with the `done`).
        prompt = {"prompt_logprobs": [None, *r.prompt_logprobs]} if r.prompt_logprobs is not None else {}
        r.prompt_logprobs = None
        if r.mode == "prefill":
            del self.requests[rid]
            if kv_transfer_params is not None:
                extra["kv_transfer_params"] = kv_transfer_params
            self._to_coord({"kind": Kind.PREFILLED, "rid": rid, "token": token, **extra, **prompt})
            return
        r.n_out += 1
        reason = finish_reason(token, r.n_out, r.max_tokens, r.ignore_eos)
        if reason != "stop":
            self._to_coord({"kind": Kind.TOKEN, "rid": rid, "token": token, **extra, **prompt})
        if reason:
            del self.requests[rid]
            self._free(r)
            self._to_coord({"kind": Kind.DONE, "rid": rid, "finish_reason": reason,
                            **(prompt if reason == "stop" else {})})
        elif not r.streamed:
            self._forward(r, [token])

    def close(self) -> None:
        # A short linger delivers the last `left` and `stop` messages.
        self.coord.close(linger=500)
        self.engines.close(linger=500)
        self.security.close()
        if self._own_ctx:
            self.ctx.term()
