"""A serving instance's scheduler: admits its engine nodes, routes each request through one node per stage."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from coral_dagster.runtime import wire
from coral_dagster.layer_split import stage_ranges
from coral_dagster.runtime.config import SchedulerConfig
from coral_dagster.runtime.security import CurveKeys, Security
from coral_dagster.runtime.tokenizer import finish_reason
from coral_dagster.routing import WeightedRoundRobin

log = logging.getLogger(__name__)


@dataclass
class _Node:
    node: str
    stage: int
    share: float
    address: str
    last_seen: float
    # The node generates a whole request from one submission (vLLM) instead of one forward per token.
    streams: bool = False


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


class Scheduler:
    """Registers the instance with the coordinator once every stage has a live node, and drives requests.

    From the coordinator: `registered`, `reregister`, `ack`, `generate {rid, tokens, max_tokens, ignore_eos}`,
    `prefill {rid, tokens, handoff}`, `decode {rid, prompt_len, max_tokens, ignore_eos}` (answered with
    `kv_route`), `first_token {rid, token}`, `cancel {rid}`, `drain`. To it: `register`, `heartbeat`, `health`,
    `token`, `done`, `prefilled`, `kv_route`, `error`, `draining`, `left`.
    """

    def __init__(self, cfg: SchedulerConfig, keys: CurveKeys | None = None, insecure: bool = False,
                 ctx: zmq.Context | None = None) -> None:
        self.cfg = cfg
        self.ranges = stage_ranges(cfg.split)
        # An own context is terminated on close, which flushes the last messages before the process exits.
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.Context()
        self.security = Security(self.ctx, keys, insecure)
        self.engines = self.ctx.socket(zmq.ROUTER)
        self.engines.linger = 0
        self.engines.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.address = self.security.bind(self.engines, cfg.listen)
        self.coord = self.ctx.socket(zmq.DEALER)
        self.coord.linger = 0
        self.coord.setsockopt(zmq.IDENTITY, f"scheduler:{cfg.instance}".encode())
        self.security.connect(self.coord, cfg.coordinator)
        self.nodes: dict[str, _Node] = {}
        self.requests: dict[str, _Request] = {}
        self._wrr = [WeightedRoundRobin() for _ in self.ranges]
        self._drain = threading.Event()
        self.registered = False
        self.healthy = False
        self.draining_since: float | None = None

    def drain(self) -> None:
        """Ask the scheduler (from any thread) to stop taking requests, finish those in flight and leave."""
        self._drain.set()

    def _to_coord(self, header: dict[str, Any]) -> None:
        wire.send(self.coord, {**header, "instance": self.cfg.instance})

    def _to_node(self, node: str, header: dict[str, Any]) -> None:
        wire.send(self.engines, header, to=node.encode())

    def _stage_ready(self) -> list[bool]:
        return [any(n.stage == s for n in self.nodes.values()) for s in range(len(self.ranges))]

    def _stages(self) -> list[dict[str, Any]]:
        return [{"start": a, "end": b, "nodes": [{"node": n.node, "share": n.share, "data": n.address}
                                                 for n in self.nodes.values() if n.stage == s]}
                for s, (a, b) in enumerate(self.ranges)]

    def _registration(self) -> dict[str, Any]:
        c = self.cfg
        return {"kind": "register", "model": c.model, "phase": c.phase, "tokens_per_s": c.tokens_per_s,
                "region": c.region, "weight": c.route_weight or c.tokens_per_s,
                "split": list(c.split), "stages": self._stages(),
                "limits": c.limits.message() if c.limits else None}

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
                if self._drain.is_set() and self.draining_since is None:
                    self.draining_since = now
                    self._to_coord({"kind": "draining"})
                if self.draining_since is not None and self._drained(now):
                    return "drained"
                if last_coord is not None and now - last_coord > t.orphan_after_s:
                    return f"coordinator silent for {now - last_coord:.0f} s"
            return "stopped"
        finally:
            for n in self.nodes.values():
                self._to_node(n.node, {"kind": "stop"})
            self.close()

    def _beat(self) -> None:
        if not self.registered and all(self._stage_ready()):
            self._to_coord(self._registration())
        self._to_coord({"kind": "heartbeat", "healthy": self.healthy, "in_flight": len(self.requests),
                        "draining": self.draining_since is not None, "stages": self._stages()})
        for n in self.nodes.values():
            self._to_node(n.node, {"kind": "ping"})

    def _drained(self, now: float) -> bool:
        if self.requests and now - self.draining_since < self.cfg.timing.drain_timeout_s:
            return False
        for rid in list(self.requests):
            self._fail(rid, f"instance {self.cfg.instance} left after a {self.cfg.timing.drain_timeout_s:g} s "
                       "drain timeout")
        self._to_coord({"kind": "left"})
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
                self._to_coord({"kind": "health", "healthy": healthy, "problem": problem})

    def _check_nodes(self, now: float) -> None:
        dead = [n for n in self.nodes.values() if now - n.last_seen > self.cfg.timing.dead_after_s]
        for n in dead:
            del self.nodes[n.node]
            log.warning("engine node %s (stage %d) missed heartbeats for %.1f s", n.node, n.stage,
                        now - n.last_seen)
        # Health first, so the coordinator routes the failed requests' retries elsewhere.
        self._set_health()
        for n in dead:
            problem = (f"engine node {n.node} (stage {n.stage}, layers {self.ranges[n.stage][0]}:"
                       f"{self.ranges[n.stage][1]}) of instance {self.cfg.instance} stopped responding")
            for rid, r in list(self.requests.items()):
                if n.address in r.route:
                    self._fail(rid, problem)

    def _check_requests(self, now: float) -> None:
        limit = self.cfg.timing.request_timeout_s
        for rid, r in list(self.requests.items()):
            if now - r.last_progress > limit:
                self._fail(rid, f"no progress on instance {self.cfg.instance} for {limit:g} s")

    def _fail(self, rid: str, problem: str, status: int | None = None) -> None:
        """Fail one request; `status` 4xx says the request itself is at fault, so it is not retried elsewhere."""
        r = self.requests.pop(rid, None)
        if r is None:
            return
        self._free(r)
        self._to_coord({"kind": "error", "rid": rid, "problem": problem, "status": status})

    def _free(self, r: _Request) -> None:
        by_address = {n.address: n.node for n in self.nodes.values()}
        for address in r.route:
            if address in by_address:
                self._to_node(by_address[address], {"kind": "free", "rid": r.rid})

    def _from_engines(self, now: float) -> None:
        for ident, h, _ in wire.drain(self.engines, routed=True):
            try:
                self._on_engine(ident.decode(errors="replace"), h, now)
            except Exception as exc:  # noqa: BLE001 - a bad message is dropped, never fatal
                log.warning("dropping a %s message from an engine: %r", h["kind"], exc)

    def _on_engine(self, name: str, h: dict[str, Any], now: float) -> None:
        kind = h["kind"]
        if kind == "hello":
            self._hello(name, h, now)
            return
        node = self.nodes.get(name)
        if node is None:
            self._to_node(name, {"kind": "rehello"})
            return
        node.last_seen = now
        if kind == "token":
            self._token(str(h["rid"]), int(h["token"]), int(h["pos"]), now)
        elif kind == "error":
            status = h.get("status")
            self._fail(str(h["rid"]), str(h["problem"]), status if isinstance(status, int) else None)

    def _hello(self, name: str, h: dict[str, Any], now: float) -> None:
        stage = h.get("stage")
        expected = self.ranges[stage] if isinstance(stage, int) and 0 <= stage < len(self.ranges) else None
        if h.get("model") != self.cfg.model or expected != (h.get("start"), h.get("end")):
            problem = (f"node {name} offers {h.get('model')} stage {stage} layers {h.get('start')}:{h.get('end')}, "
                       f"but instance {self.cfg.instance} serves {self.cfg.model} with stages {self.ranges}")
            log.warning(problem)
            self._to_node(name, {"kind": "reject", "problem": problem})
            return
        self.nodes[name] = _Node(name, stage, float(h.get("share", 1.0)), str(h["data"]), now,
                                 bool(h.get("streams")))
        self._to_node(name, {"kind": "welcome"})
        self._set_health()

    def _route(self) -> list[str] | None:
        """One live node per stage, each stage by weighted round-robin over its nodes' shares."""
        route = []
        for s, wrr in enumerate(self._wrr):
            shares = {n.node: n.share for n in self.nodes.values() if n.stage == s}
            if not shares:
                return None
            route.append(self.nodes[wrr.pick(shares)].address)
        return route

    def _forward(self, r: _Request, tokens: list[int], handoff: list | None = None) -> None:
        header = {"kind": "forward", "rid": r.rid, "pos": r.pos, "stage": 0, "route": r.route, "handoff": handoff}
        if r.streamed:
            header["max_tokens"] = r.max_tokens
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

    def _on_coordinator(self, h: dict[str, Any], now: float) -> None:
        kind = h["kind"]
        if kind == "registered":
            self.registered = True
            self._to_coord({"kind": "health", "healthy": self.healthy, "problem": ""})
        elif kind == "reregister":
            self.registered = False
        elif kind == "refused":
            log.warning("the coordinator refused instance %s: %s", self.cfg.instance, h.get("problem"))
        elif kind == "drain":
            self._drain.set()
        elif kind == "cancel":
            r = self.requests.pop(str(h["rid"]), None)
            if r is not None:
                self._free(r)
        elif kind in ("generate", "prefill", "decode"):
            self._admit(kind, h, now)
        elif kind == "first_token":
            r = self.requests.get(str(h["rid"]))
            if r is not None:
                r.n_out, r.last_progress = 1, now
                self._forward(r, [int(h["token"])])

    def _admit(self, kind: str, h: dict[str, Any], now: float) -> None:
        rid = str(h["rid"])
        if self.draining_since is not None or not self.healthy:
            state = "draining" if self.draining_since is not None else "unhealthy"
            self._to_coord({"kind": "error", "rid": rid, "problem": f"instance {self.cfg.instance} is {state}"})
            return
        route = self._route()
        mode = {"generate": "aggregated"}.get(kind, kind)
        r = _Request(rid, mode, route, 0, int(h.get("max_tokens", 1)), bool(h.get("ignore_eos")), last_progress=now)
        streaming = {n.address for n in self.nodes.values() if n.streams}
        r.streamed = mode == "aggregated" and all(a in streaming for a in route)
        self.requests[rid] = r
        if kind == "decode":
            r.pos = int(h["prompt_len"])
            span = [[a, b, address] for (a, b), address in zip(self.ranges, route)]
            self._to_coord({"kind": "kv_route", "rid": rid, "route": span})
        else:
            self._forward(r, [int(x) for x in h["tokens"]], h.get("handoff") if kind == "prefill" else None)

    def _token(self, rid: str, token: int, pos: int, now: float) -> None:
        r = self.requests.get(rid)
        if r is None:
            return
        r.last_progress, r.pos = now, pos
        if r.mode == "prefill":
            del self.requests[rid]
            self._to_coord({"kind": "prefilled", "rid": rid, "token": token})
            return
        r.n_out += 1
        reason = finish_reason(token, r.n_out, r.max_tokens, r.ignore_eos)
        if reason != "stop":
            self._to_coord({"kind": "token", "rid": rid, "token": token})
        if reason:
            del self.requests[rid]
            self._free(r)
            self._to_coord({"kind": "done", "rid": rid, "finish_reason": reason})
        elif not r.streamed:
            self._forward(r, [token])

    def close(self) -> None:
        # A short linger delivers the last `left` and `stop` messages.
        self.coord.close(linger=500)
        self.engines.close(linger=500)
        self.security.close()
        if self._own_ctx:
            self.ctx.term()
