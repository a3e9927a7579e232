"""An engine node: holds one stage's layers, runs batched forwards, passes activations on and hands KV over."""

from __future__ import annotations

import hmac
import logging
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np
import zmq

from coral_dagster.runtime import credentials, wire
from coral_dagster.runtime.protocol import Env, Kind, Link, ProtocolError, check
from coral_dagster.runtime.config import NodeSettings
from coral_dagster.runtime.engine import Engine, Step, StepOutput
from coral_dagster.runtime.limits import RequestError, is_int
from coral_dagster.runtime.sampling import SamplingParams
from coral_dagster.runtime.security import CurveKeys, Security

log = logging.getLogger(__name__)
# The engine a node drives: a per-step engine, or a vLLM instance's head (`VllmNode`).
E = TypeVar("E", bound=Engine)


@dataclass
class _Pending:
    """A forward step that arrived before its KV cache (a PD handoff still in flight)."""

    header: dict[str, Any]
    step: Step
    deadline: float


class EngineNode(Generic[E]):
    """Receives `forward` and `kv` messages on its data socket and talks to its scheduler on a control socket.

    Data messages: `forward {rid, pos, stage, route: [data address per stage], handoff: [[start, end, address]]
    or null, targets: the prompt's tokens after these positions, when its log-probabilities are asked}` with the
    token ids (first stage) or hidden states; `kv {rid, start, end}` with K and V per layer.
    Control to the scheduler: `hello`, `token {rid, token}`, `error {rid, problem}`; from it: `challenge {nonce}`
    (answered by a hello with a proof of `credential`, this node's slot credential), `welcome`, `reject`, `rehello`,
    `ping`, `free {rid}`, `stop`. Heartbeats (`pulse`) come from a thread of their own
    (`_Pulse`), so that a forward pass that holds this loop for seconds does not make the node look dead; every
    hello and pulse carries the process's `incarnation`, so a node killed and restarted under the same name is
    told apart from the one it replaces.
    """

    # Whether the engine generates whole requests from one submission (the scheduler then sends one forward).
    streams = False

    def __init__(self, settings: NodeSettings, engine: E, keys: CurveKeys | None = None,
                 insecure: bool = False, ctx: zmq.Context | None = None, credential: str = "") -> None:
        self.s, self.engine = settings, engine
        self.credential = credential
        self._challenged: str | None = None
        # An own context is terminated on close, which flushes the last messages before the process exits.
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.Context()
        self.security = Security(self.ctx, keys, insecure)
        self.data = self.ctx.socket(zmq.PULL)
        self.data.linger = 0
        bound = self.security.bind(self.data, settings.listen, max_bytes=wire.MAX_DATA_BYTES)
        self.address = settings.advertise or bound
        self.ctl = self.ctx.socket(zmq.DEALER)
        self.ctl.linger = 0
        self.security.connect(self.ctl, settings.scheduler)
        self.incarnation = secrets.token_hex(16)
        self._pulse = _Pulse(self)
        self._pending: dict[str, _Pending] = {}
        self._touched: dict[str, float] = {}
        # Requests the scheduler freed: a step of one still on its way from the previous stage is dropped.
        self._freed: dict[str, float] = {}
        self.welcomed = False
        # The scheduler's route key (from its welcome): data messages without its MAC are dropped.
        self.route_key: str | None = None
        self.rejected: str | None = None
        self.steps_run = 0
        # The engine's KV use as the loop last read it; the pulse thread sends it (the engine is the loop's alone).
        self.kv: tuple[int, int] | None = engine.kv_usage()

    def _to_scheduler(self, header: dict[str, Any]) -> None:
        wire.send(self.ctl, {**header, "node": self.s.node})

    def _hello(self, nonce: str | None = None) -> None:
        s = self.s
        proof = ({"proof": credentials.node_proof(self.credential, nonce, s.stage, s.node, self.incarnation)}
                 if nonce is not None and self.credential else {})
        self._to_scheduler({"kind": Kind.HELLO, "stage": s.stage, "start": s.start, "end": s.end, "share": s.share,
                            "data": self.address, "model": s.model, "engine": s.engine, "streams": self.streams,
                            "incarnation": self.incarnation, **proof})

    def _challenge(self, nonce: str) -> None:
        """Answer the scheduler's challenge with a proof of this node's credential; without one, say (once) what is
        missing: the scheduler welcomes no node that cannot prove its slot."""
        if self.credential:
            self._hello(nonce)
        elif self._challenged != nonce:
            log.warning("the scheduler asks node %s to prove its slot, and %s is not set", self.s.node,
                        Env.NODE_CREDENTIAL.value)
        self._challenged = nonce

    def _error(self, rid: str, problem: str, status: int | None = None) -> None:
        """Fail one request on this node; `status` 400 says the request itself is at fault (not retried)."""
        log.warning("node %s request %s: %s", self.s.node, rid, problem)
        self.engine.free(rid)
        self._pending.pop(rid, None)
        self._touched.pop(rid, None)
        self._to_scheduler({"kind": Kind.ERROR, "rid": rid, "status": status, "problem": f"node {self.s.node} "
                            f"(stage {self.s.stage}, layers {self.s.start}:{self.s.end}): {problem}"})

    def run(self, stop: threading.Event | None = None) -> str:
        """Serve until told to stop, the scheduler is gone for `orphan_after_s`, or `stop` is set; says why."""
        stop = stop or threading.Event()
        t = self.s.timing
        poller = zmq.Poller()
        poller.register(self.ctl, zmq.POLLIN)
        poller.register(self.data, zmq.POLLIN)
        last_hello = last_upstream = 0.0
        started = time.monotonic()
        busy = False
        self._pulse.start()
        try:
            while not stop.is_set():
                now = time.monotonic()
                if self._pulse.unknown.is_set():
                    # A scheduler that does not know this node (it restarted) heard a pulse: say hello again.
                    self._pulse.unknown.clear()
                    self.welcomed = False
                if not self.welcomed and now - last_hello >= t.heartbeat_s:
                    self._hello()
                    last_hello = now
                events = dict(poller.poll(timeout=0 if busy else int(1000 * t.heartbeat_s / 2)))
                now = time.monotonic()
                if self.ctl in events:
                    last_upstream = now
                    reason = self._drain_control()
                    if reason:
                        return reason
                batch = self._drain_data(now) if self.data in events else []
                batch += self._unparked(now)
                if batch:
                    self._run_batch(batch)
                busy = self._advance()
                self._expire(now)
                self.kv = self.engine.kv_usage()
                upstream = last_upstream or started
                if self.welcomed and now - upstream > t.orphan_after_s:
                    return f"scheduler silent for {now - upstream:.0f} s"
            return "stopped"
        finally:
            self.close()

    # What each kind the scheduler sends does (PING only proves the scheduler is there).
    CONTROL_KINDS = frozenset({Kind.WELCOME, Kind.REHELLO, Kind.REJECT, Kind.FREE, Kind.STOP, Kind.PING,
                               Kind.CHALLENGE})

    def _drain_control(self) -> str | None:
        for _, h, _ in wire.drain(self.ctl):
            try:
                _, kind = check(Link.SCHEDULER_TO_NODE, h)
            except ProtocolError as exc:
                log.warning("dropping a control message: %s", exc)
                continue
            if kind is Kind.WELCOME:
                self.welcomed = True
                self.route_key = h.get("route_key")
            elif kind is Kind.CHALLENGE:
                self._challenge(str(h["nonce"]))
            elif kind is Kind.REHELLO:
                self.welcomed = False
                self._hello()
            elif kind is Kind.REJECT:
                self.rejected = str(h.get("problem"))
                return f"rejected by scheduler: {self.rejected}"
            elif kind is Kind.FREE:
                rid = h["rid"]
                self.engine.free(rid)
                self._pending.pop(rid, None)
                self._touched.pop(rid, None)
                self._freed[rid] = time.monotonic()
            elif kind is Kind.STOP:
                return "stopped by scheduler"
        return None

    def _drain_data(self, now: float) -> list[tuple[dict[str, Any], Step]]:
        batch: list[tuple[dict[str, Any], Step]] = []
        seen: set[str] = set()
        for _, h, arrays in wire.drain(self.data, limit=self.s.max_batch, tensors=True):
            try:
                _, kind = check(Link.DATA, h)
            except ProtocolError as exc:
                log.warning("dropping a data message: %s", exc)
                if isinstance(h.get("rid"), str) and h["rid"] not in self._freed:
                    self._error(h["rid"], f"bad data message: {exc}", 400)
                continue
            rid = h["rid"]
            if rid in self._freed:
                continue
            if not self._vouched(kind, h):
                log.warning("dropping a %s message for %s without its scheduler's MAC", kind.value, rid)
                continue
            self._touched[rid] = now
            if kind is Kind.KV:
                self._import_kv(rid, h, arrays)
                continue
            if len(arrays) != 1:
                log.warning("dropping a forward with %d arrays", len(arrays))
                continue
            try:
                step = self._step(rid, h, arrays[0])
                self.engine.check_step(step)
            except (KeyError, TypeError, ValueError) as exc:
                self._error(rid, f"request cannot run: {exc}", 400)
                continue
            if rid in seen or rid in self._pending:
                self._error(rid, "two steps of one request in flight at once")
                continue
            seen.add(rid)
            have = self.engine.cache_length(rid)
            if have == step.pos:
                batch.append((h, step))
            elif have is None or have < step.pos:
                self._pending[rid] = _Pending(h, step, now + self.s.timing.kv_timeout_s)
            else:
                self._error(rid, f"step at position {step.pos} but {have} positions are already cached")
        return batch

    def _vouched(self, kind: Kind, h: dict[str, Any]) -> bool:
        """Whether a data message comes from this instance's scheduler or a node it welcomed (or, for KV, a prefill
        instance it gave the KV route to): its MAC under the route key (any message before a route key is known)."""
        if self.route_key is None:
            return True
        expected = (credentials.kv_mac(self.route_key, h["rid"]) if kind is Kind.KV
                    else credentials.step_mac(self.route_key, h["rid"], h["pos"], h["stage"]))
        return hmac.compare_digest(expected, str(h.get("mac", "")))

    def _step(self, rid: str, h: dict[str, Any], array: np.ndarray) -> Step:
        pos, stage, route = int(h["pos"]), int(h["stage"]), h["route"]
        if pos < 0 or not isinstance(route, list) or not 0 <= stage < len(route):
            raise ValueError(f"position {pos}, stage {stage} of a {len(route)}-stage route")
        try:
            sampling = SamplingParams.from_message(h.get("sampling")) if self.engine.is_last else None
        except RequestError as exc:
            raise ValueError(exc.problem) from None
        targets = h.get("targets")
        if targets is not None and not (len(targets) <= len(array)
                                        and all(is_int(t) and 0 <= t < self.engine.vocab for t in targets)):
            raise ValueError(f"targets must be at most {len(array)} token ids in [0, {self.engine.vocab})")
        targets = tuple(targets) if targets is not None and self.engine.is_last else None
        if self.engine.is_first:
            if array.ndim != 1 or array.dtype.kind not in "iu":
                raise ValueError(f"the first stage takes a 1-D integer token array, got {array.dtype} {array.shape}")
            return Step(rid, pos, tokens=array, sampling=sampling, targets=targets)
        if array.ndim != 2 or array.shape[0] == 0:
            raise ValueError(f"hidden states must be [tokens, hidden], got {array.shape}")
        return Step(rid, pos, hidden=array, sampling=sampling, targets=targets)

    def _import_kv(self, rid: str, h: dict[str, Any], arrays: list[np.ndarray]) -> None:
        try:
            self.engine.import_kv(rid, int(h["start"]), int(h["end"]), arrays)
        except Exception as exc:  # noqa: BLE001 - a bad handoff fails its request, never the node
            self._error(rid, f"KV handoff rejected: {exc}")

    def _unparked(self, now: float) -> list[tuple[dict[str, Any], Step]]:
        ready = []
        for rid, p in list(self._pending.items()):
            if self.engine.cache_length(rid) == p.step.pos:
                ready.append((p.header, p.step))
                del self._pending[rid]
        return ready

    def _expire(self, now: float) -> None:
        for rid, p in list(self._pending.items()):
            if now > p.deadline:
                self._error(rid, f"KV cache for position {p.step.pos} did not arrive within "
                            f"{self.s.timing.kv_timeout_s:g} s")
        stale = now - 2 * self.s.timing.request_timeout_s
        for rid, freed in list(self._freed.items()):
            if freed < stale:
                del self._freed[rid]
        for rid, seen in list(self._touched.items()):
            if seen < stale:
                # The scheduler forgot this request (it died or restarted): reclaim the cache.
                self.engine.free(rid)
                del self._touched[rid]

    def _run_batch(self, batch: list[tuple[dict[str, Any], Step]]) -> None:
        try:
            outputs = self.engine.forward([step for _, step in batch])
        except Exception as exc:  # noqa: BLE001 - report, free and keep serving the other requests
            log.exception("forward failed")
            for _, step in batch:
                self._error(step.rid, f"forward failed: {exc}")
            return
        self.steps_run += 1
        for (h, step), out in zip(batch, outputs):
            try:
                self._deliver(h, step, out)
            except Exception as exc:  # noqa: BLE001 - one request's bad route or handoff fails only that request
                self._error(step.rid, f"could not pass the step on: {exc!r}", 400)

    def _deliver(self, h: dict[str, Any], step: Step, out: StepOutput) -> None:
        """Send one step's result on: its token to the scheduler, or its activations to the next stage."""
        handoff = h.get("handoff")
        if handoff:
            self._hand_over(step.rid, handoff)
        if out.token is not None:
            self._to_scheduler({"kind": Kind.TOKEN, "rid": step.rid, "token": out.token,
                                "pos": step.pos + step.n_tokens,
                                **({"logprobs": out.logprobs.message()} if out.logprobs else {}),
                                **({"prompt_logprobs": [lp.message() for lp in out.prompt_logprobs]}
                                   if out.prompt_logprobs else {})})
        elif out.hidden is not None:
            self._pass_on(h, step, out.hidden)
        else:
            raise RuntimeError(f"stage gave step {step.rid!r} neither a token nor hidden states")
        if handoff:
            self.engine.free(step.rid)
            self._touched.pop(step.rid, None)

    def _advance(self) -> bool:
        """Progress a streaming engine makes between messages; whether work is left (none for per-step engines)."""
        return False

    def _pass_on(self, h: dict[str, Any], step: Step, hidden: np.ndarray) -> None:
        route, stage = h["route"], int(h["stage"]) + 1
        if stage >= len(route):
            self._error(step.rid, f"route has {len(route)} stages but stage {stage} was asked for")
            return
        header = {"kind": Kind.FORWARD, "rid": step.rid, "pos": step.pos, "stage": stage, "route": route,
                  "handoff": h.get("handoff"), "sampling": h.get("sampling"),
                  **({"targets": h["targets"]} if "targets" in h else {})}
        if self.route_key:
            header["mac"] = credentials.step_mac(self.route_key, step.rid, step.pos, stage)
        if not wire.send(self.security.push(route[stage]), header, [hidden]):
            self._error(step.rid, f"next stage at {route[stage]} is not accepting activations")

    def _hand_over(self, rid: str, handoff: list[list[Any]]) -> None:
        """Send K and V of this node's layers to every decode node whose layer range overlaps them."""
        for start, end, address, *mac in handoff:
            lo, hi = max(int(start), self.s.start), min(int(end), self.s.end)
            if lo >= hi:
                continue
            arrays = self.engine.export_kv(rid, lo, hi)
            header = {"kind": Kind.KV, "rid": rid, "start": lo, "end": hi, **({"mac": str(mac[0])} if mac else {})}
            if not wire.send(self.security.push(address), header, arrays):
                self._error(rid, f"decode node at {address} is not accepting the KV handoff")

    def close(self) -> None:
        self._pulse.stop()
        for sock in (self.ctl, self.data):
            sock.close(linger=0)
        self.security.close()
        if self._own_ctx:
            self.ctx.term()


class _Pulse:
    """The node's heartbeat: a thread with a DEALER socket of its own that says every `heartbeat_s` that the process
    lives, whatever its main loop is doing (a forward pass of seconds, which releases the GIL in its kernels)."""

    def __init__(self, node: EngineNode) -> None:
        self.node = node
        # Set when the scheduler answers a pulse with `rehello`: it does not know this node.
        self.unknown = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"coral-pulse-{node.s.node}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        n = self.node
        sock = n.ctx.socket(zmq.DEALER)
        sock.linger = 0
        try:
            n.security.connect(sock, n.s.scheduler)
            beat = {"kind": Kind.PULSE, "node": n.s.node, "incarnation": n.incarnation}
            while True:
                kv = n.kv
                wire.send(sock, {**beat, **({"kv_used_tokens": kv[0], "kv_capacity_tokens": kv[1]} if kv else {})})
                if self._stop.wait(n.s.timing.heartbeat_s):
                    return
                if any(h["kind"] == Kind.REHELLO for _, h, _ in wire.drain(sock)):
                    self.unknown.set()
        finally:
            sock.close(linger=0)
