"""The coordinator: keeps the set of ready instances and routes each request by weighted round-robin."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from coral_dagster.runtime import wire
from coral_dagster.runtime.config import CoordinatorConfig, format_admit, parse_admit
from coral_dagster.errors import CoralError
from coral_dagster.runtime.limits import (ModelLimits, RequestError, check_request, finite_positive, max_tokens_of,
                                          token_ids)
from coral_dagster.runtime.sampling import SamplingParams
from coral_dagster.runtime.security import CurveKeys, Security, is_local
from coral_dagster.runtime.tokenizer import ByteTokenizer, finish_reason
from coral_dagster.routing import Admission, Candidate, Router

log = logging.getLogger(__name__)


@dataclass
class _Instance:
    name: str
    ident: bytes
    model: str
    phase: str
    tokens_per_s: float
    stages: list[dict[str, Any]]
    last_seen: float
    region: str = "local"
    weight: float = 0.0
    state: str = "ready"
    problem: str = ""
    requests: set[str] = field(default_factory=set)
    served: int = 0
    limits: ModelLimits | None = None


@dataclass
class _Request:
    """A client's request; `out` keeps every token streamed so far, so a retry resumes where it failed."""

    rid: str
    sock: zmq.Socket
    client: bytes
    tag: Any
    model: str
    prompt: list[int]
    max_tokens: int
    ignore_eos: bool
    out: list[int] = field(default_factory=list)
    attempts: int = 0
    instances: dict[str, str] = field(default_factory=dict)
    history: list[str] = field(default_factory=list)
    last_progress: float = field(default_factory=time.monotonic)
    # Sampling parameters (`runtime/sampling.py`, checked here), sent with every attempt.
    sampling: dict[str, Any] | None = None


class Coordinator:
    """Clients (`submit`, `cancel`, `drain`, `admit`, `status`) and schedulers share one ROUTER socket; the HTTP
    front door reaches the same loop through an inproc socket.

    A request goes to an aggregated instance (`generate`), or when the model has ready prefill and decode
    instances, to a decode instance (`decode`, which answers with its KV route) and then to a prefill instance
    (`prefill` with that route), whose first token starts the decode (`first_token`). Events to the client:
    `accepted`, `token`, `done`, `error`. A failed attempt resumes on another instance from the tokens already
    produced, up to `max_retries` times; then the client gets an `error` that says why.
    """

    def __init__(self, cfg: CoordinatorConfig, keys: CurveKeys | None = None, insecure: bool = False,
                 ctx: zmq.Context | None = None) -> None:
        if cfg.http_port is not None and not (cfg.api_key or insecure
                                              or is_local(f"tcp://{cfg.http_host}:{cfg.http_port}")):
            raise CoralError(f"refusing to serve HTTP on {cfg.http_host} to anyone without an API key.",
                             "set CORAL_API_KEY (clients send it as their OpenAI api_key), serve on 127.0.0.1, "
                             "or pass --insecure")
        self.cfg = cfg
        self.ctx = ctx or zmq.Context.instance()
        self.security = Security(self.ctx, keys, insecure)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.linger = 0
        self.router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.address = self.security.bind(self.router, cfg.listen)
        self.front_address = f"inproc://coral-front-{id(self)}"
        self.front = self.ctx.socket(zmq.ROUTER)
        self.front.linger = 0
        self.front.bind(self.front_address)
        self.instances: dict[str, _Instance] = {}
        self.departed: list[str] = []
        self.requests: dict[str, _Request] = {}
        self.tokenizer = ByteTokenizer()
        self.routing = Router()
        self.admission = Admission(cfg.admit_req_s, cfg.admit_depth_req, cfg.admit_peak)
        self.admit_text = format_admit(cfg.admit_req_s, cfg.admit_depth_req, cfg.admit_peak)
        self._ids = itertools.count()
        self.counts = {"submitted": 0, "completed": 0, "failed": 0, "retried": 0}
        self.http = None
        if cfg.http_port is not None:
            from coral_dagster.runtime.frontdoor import FrontDoor

            self.http = FrontDoor(self.ctx, self.front_address, cfg.http_host, cfg.http_port,
                                  timeout_s=cfg.timing.request_timeout_s * (cfg.max_retries + 1) + 5,
                                  api_key=cfg.api_key, read_timeout_s=cfg.http_read_timeout_s,
                                  max_body_bytes=cfg.http_max_body_bytes,
                                  tls=(cfg.http_tls_certfile, cfg.http_tls_keyfile))

    def run(self, stop: threading.Event | None = None) -> str:
        """Route until `stop` is set, serving the HTTP front door alongside when configured."""
        stop = stop or threading.Event()
        if self.http is not None:
            self.http.start()
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.front, zmq.POLLIN)
        t = self.cfg.timing
        drain_until = None
        try:
            while True:
                if stop.is_set():
                    if self.http is None:
                        break
                    if drain_until is None:
                        # SIGTERM/SIGINT: new HTTP requests get 503 while those in flight finish, up to DRAIN_S.
                        from coral_dagster.runtime.frontdoor import DRAIN_S

                        self.http.begin_drain()
                        drain_until = time.monotonic() + DRAIN_S
                    if not self.http.in_flight() or time.monotonic() >= drain_until:
                        break
                events = dict(poller.poll(timeout=int(1000 * t.heartbeat_s / 4)))
                now = time.monotonic()
                for sock in (self.router, self.front):
                    if sock in events:
                        self._drain_socket(sock, now)
                self._check(now)
            return "stopped"
        finally:
            self.close()

    def _drain_socket(self, sock: zmq.Socket, now: float) -> None:
        """Handle each message on its own: one that cannot be handled is answered with an error, never fatal."""
        for ident, h, _ in wire.drain(sock, routed=True):
            try:
                self._handle(sock, ident, h, now)
            except RequestError as exc:
                self._reply_error(sock, ident, h, exc.problem, exc.fix, exc.status)
            except (KeyError, TypeError, ValueError, OverflowError) as exc:
                log.warning("dropping %s message with bad fields: %s", h.get("kind"), exc)
                self._reply_error(sock, ident, h, f"bad {h.get('kind')} message: {exc}",
                                  "send the fields the protocol names", 400)
            except Exception as exc:  # noqa: BLE001 - one message's failure must not stop the router
                log.exception("failed to handle a %s message", h.get("kind"))
                self._reply_error(sock, ident, h, f"the coordinator failed on this {h.get('kind')} message: {exc!r}",
                                  "report this with the coordinator's log", 500)

    def _reply_error(self, sock: zmq.Socket, ident: bytes, h: dict[str, Any], problem: str, fix: str,
                     status: int) -> None:
        if h.get("kind") in self._CLIENT_KINDS or sock is self.front:
            if h.get("kind") == "submit":
                self.counts["failed"] += 1
            wire.send(sock, {"kind": "error", "tag": h.get("tag"), "problem": problem, "fix": fix, "status": status},
                      to=ident)

    _CLIENT_KINDS = ("submit", "cancel", "drain", "admit", "status")

    def _handle(self, sock: zmq.Socket, ident: bytes, h: dict[str, Any], now: float) -> None:
        kind = h["kind"]
        client = {"submit": self._submit, "cancel": self._cancel, "drain": self._drain_request,
                  "admit": self._admit, "status": self._status}
        if kind in client:
            client[kind](sock, ident, h, now)
            return
        if sock is not self.router:
            return
        name = str(h.get("instance"))
        if kind == "register":
            self._register(ident, name, h, now)
            return
        inst = self.instances.get(name)
        if inst is None or inst.ident != ident:
            # Only the connection that registered an instance speaks for it.
            wire.send(self.router, {"kind": "reregister"}, to=ident)
            return
        inst.last_seen = now
        scheduler = {"heartbeat": self._heartbeat, "health": self._health, "token": self._token, "done": self._done,
                     "prefilled": self._prefilled, "kv_route": self._kv_route, "error": self._attempt_failed,
                     "draining": self._draining, "left": self._left}
        if kind in scheduler:
            scheduler[kind](inst, h, now)

    # Instances

    def _register(self, ident: bytes, name: str, h: dict[str, Any], now: float) -> None:
        old = self.instances.get(name)
        if old is not None and old.ident != ident and old.state != "lost":
            log.warning("refused a second registration of live instance %s", name)
            wire.send(self.router, {"kind": "refused", "problem": f"instance {name} is registered and alive"},
                      to=ident)
            return
        stages = h.get("stages", [])
        if not isinstance(stages, list):
            raise ValueError(f"stages must be a list, got {type(stages).__name__}")
        tokens_per_s = finite_positive(h["tokens_per_s"], "tokens_per_s")
        weight = finite_positive(h["weight"], "weight") if h.get("weight") is not None else tokens_per_s
        inst = _Instance(name, ident, str(h["model"]), str(h["phase"]), tokens_per_s, stages, now,
                         region=str(h.get("region") or "local"), weight=weight,
                         requests=old.requests if old else set(), served=old.served if old else 0,
                         limits=ModelLimits.from_message(h.get("limits")))
        self.instances[name] = inst
        log.info("instance %s (%s %s, %g tok/s) registered", name, inst.model, inst.phase, inst.tokens_per_s)
        wire.send(self.router, {"kind": "registered"}, to=ident)

    def _heartbeat(self, inst: _Instance, h: dict[str, Any], now: float) -> None:
        stages = h.get("stages", inst.stages)
        inst.stages = stages if isinstance(stages, list) else inst.stages
        if inst.state == "lost":
            inst.state = "ready" if h.get("healthy") else "unhealthy"
        wire.send(self.router, {"kind": "ack"}, to=inst.ident)

    def _health(self, inst: _Instance, h: dict[str, Any], now: float) -> None:
        if inst.state != "draining":
            inst.state = "ready" if h["healthy"] else "unhealthy"
        inst.problem = str(h.get("problem", ""))

    def _draining(self, inst: _Instance, h: dict[str, Any], now: float) -> None:
        inst.state = "draining"

    def _left(self, inst: _Instance, h: dict[str, Any], now: float) -> None:
        log.info("instance %s left", inst.name)
        del self.instances[inst.name]
        self.departed.append(inst.name)
        for rid in list(inst.requests):
            self._attempt_failed(inst, {"rid": rid, "problem": f"instance {inst.name} left"}, now)

    def _candidates(self, model: str) -> list[Candidate]:
        """The model's ready instances as the routing policy sees them (weight: the share of demand the plan gave)."""
        return [Candidate(i.name, i.model, i.phase, i.region, i.weight) for i in self.instances.values()
                if i.model == model and i.state == "ready"]

    def _check(self, now: float) -> None:
        t = self.cfg.timing
        for inst in list(self.instances.values()):
            if inst.state != "lost" and now - inst.last_seen > t.dead_after_s:
                inst.state, inst.problem = "lost", f"scheduler silent for {now - inst.last_seen:.1f} s"
                log.warning("instance %s lost: %s", inst.name, inst.problem)
                for rid in list(inst.requests):
                    self._attempt_failed(inst, {"rid": rid, "problem": f"instance {inst.name} {inst.problem}"}, now)
        for r in list(self.requests.values()):
            if now - r.last_progress > t.request_timeout_s:
                names = ", ".join(r.instances.values()) or "none"
                self._retry_or_fail(r, f"no progress for {t.request_timeout_s:g} s on instance(s) {names}", now)

    # Requests

    def _event(self, r: _Request, header: dict[str, Any]) -> None:
        wire.send(r.sock, {**header, "rid": r.rid, "tag": r.tag}, to=r.client)

    def _limits(self, model: str) -> ModelLimits | None:
        """The tightest limits any registered instance of `model` announced."""
        limits = None
        for i in self.instances.values():
            if i.model == model and i.limits is not None:
                limits = i.limits.tighter(limits)
        return limits

    def _submit(self, sock: zmq.Socket, ident: bytes, h: dict[str, Any], now: float) -> None:
        """Check a request where it enters, so that a request no instance can run never reaches one."""
        self.counts["submitted"] += 1
        model = h["model"]
        if not isinstance(model, str):
            raise RequestError(f"model {model!r} is not a name.", f"ask for one of: {', '.join(self._models())}")
        if h.get("prompt_tokens") is not None:
            prompt = token_ids(h["prompt_tokens"])
        elif isinstance(h.get("prompt"), str) and h["prompt"]:
            prompt = self.tokenizer.encode(h["prompt"])
        else:
            raise RequestError("a request needs a non-empty prompt.", "send prompt text or prompt_tokens")
        max_tokens = max_tokens_of(h.get("max_tokens", 16))
        if not isinstance(h.get("ignore_eos", False), bool):
            raise RequestError(f"ignore_eos={h['ignore_eos']!r} is not true or false.", "send a JSON boolean")
        check_request(prompt, max_tokens, self._limits(model), model)
        sampling = SamplingParams.from_message(h.get("sampling")).message() if h.get("sampling") else None
        r = _Request(f"req-{next(self._ids)}", sock, ident, h.get("tag"), model, prompt, max_tokens,
                     h.get("ignore_eos", False), last_progress=now, sampling=sampling)
        self.requests[r.rid] = r
        if not self.admission.admit(model, now):
            wait_s = self.admission.retry_after_s(model, now)
            self._finish_error(r, f"model {model} is at the request rate its plan serves "
                               f"({self.admission.limits(model)}).", f"retry after {wait_s:.1f} s",
                               429, type="rate_limited", retry_after_s=wait_s)
            return
        self._dispatch(r, now)

    def _models(self) -> list[str]:
        return sorted(set(self.cfg.models) | {i.model for i in self.instances.values()})

    def _dispatch(self, r: _Request, now: float) -> None:
        """Start an attempt on the route the routing policy picks among the ready instances: an aggregated
        instance, or a prefill instance and a decode instance of its region."""
        r.attempts += 1
        r.last_progress = now
        prompt = r.prompt + r.out
        left = r.max_tokens - len(r.out)
        route = self.routing.route(r.model, self._candidates(r.model))
        entry, second = route or (None, None)
        if second is not None:
            prefill, decode = self.instances[entry.key], self.instances[second.key]
            r.instances = {"prefill": prefill.name, "decode": decode.name}
            msg = {"kind": "decode", "rid": r.rid, "prompt_len": len(prompt), "max_tokens": left,
                   "ignore_eos": r.ignore_eos, "sampling": r.sampling}
            self._send(decode, r, msg)
            r.history.append(f"{prefill.name}->{decode.name}")
        elif entry is not None and entry.phase == "aggregated":
            aggregated = self.instances[entry.key]
            r.instances = {"aggregated": aggregated.name}
            self._send(aggregated, r, {"kind": "generate", "rid": r.rid, "tokens": prompt, "max_tokens": left,
                                       "ignore_eos": r.ignore_eos, "sampling": r.sampling})
            r.history.append(aggregated.name)
        else:
            known = self._models()
            fix = ("wait for its instances to register or become healthy (GET /admin/instances shows them)"
                   if r.model in known else f"ask for one of: {', '.join(known) or 'none registered yet'}")
            self._finish_error(r, f"no ready instance serves model {r.model!r}", fix, 503 if r.model in known else 404)
            return
        self._event(r, {"kind": "accepted", "instances": dict(r.instances), "attempt": r.attempts})

    def _send(self, inst: _Instance, r: _Request, msg: dict[str, Any]) -> None:
        inst.requests.add(r.rid)
        wire.send(self.router, msg, to=inst.ident)

    def _release(self, r: _Request, cancel: bool) -> None:
        for name in r.instances.values():
            inst = self.instances.get(name)
            if inst is not None:
                inst.requests.discard(r.rid)
                if cancel:
                    wire.send(self.router, {"kind": "cancel", "rid": r.rid}, to=inst.ident)
        r.instances = {}

    def _emit_token(self, r: _Request, token: int, now: float, logprobs: Any = None) -> None:
        r.out.append(token)
        r.last_progress = now
        self._event(r, {"kind": "token", "token": token, "text": self.tokenizer.decode_token(token),
                        "index": len(r.out) - 1, **({"logprobs": logprobs} if logprobs is not None else {})})

    def _finish(self, r: _Request, reason: str) -> None:
        for name in r.instances.values():
            if name in self.instances:
                self.instances[name].served += 1
        self._release(r, cancel=False)
        self.requests.pop(r.rid, None)
        self.counts["completed"] += 1
        self._event(r, {"kind": "done", "finish_reason": reason, "tokens": r.out,
                        "text": self.tokenizer.decode(r.out), "prompt_tokens": len(r.prompt),
                        "instances": r.history, "attempts": r.attempts})

    def _finish_error(self, r: _Request, problem: str, fix: str, status: int, **extra: Any) -> None:
        """Fail `r`; `extra` travels to the client (`type="rate_limited", retry_after_s=…` becomes HTTP 429)."""
        self._release(r, cancel=True)
        self.requests.pop(r.rid, None)
        self.counts["failed"] += 1
        self._event(r, {"kind": "error", "problem": problem, "fix": fix, "status": status, "tokens": r.out,
                        "instances": r.history, **extra})

    def _owned(self, inst: _Instance, h: dict[str, Any]) -> _Request | None:
        r = self.requests.get(str(h["rid"]))
        return r if r is not None and inst.name in r.instances.values() else None

    def _token(self, inst: _Instance, h: dict[str, Any], now: float) -> None:
        r = self._owned(inst, h)
        if r is not None:
            self._emit_token(r, int(h["token"]), now, h.get("logprobs"))

    def _done(self, inst: _Instance, h: dict[str, Any], now: float) -> None:
        r = self._owned(inst, h)
        if r is not None:
            self._finish(r, str(h["finish_reason"]))

    def _kv_route(self, inst: _Instance, h: dict[str, Any], now: float) -> None:
        r = self._owned(inst, h)
        if r is None:
            return
        prefill = self.instances.get(r.instances.get("prefill", ""))
        if prefill is None or prefill.state != "ready":
            self._retry_or_fail(r, f"prefill instance {r.instances.get('prefill')} went away", now)
            return
        r.last_progress = now
        self._send(prefill, r, {"kind": "prefill", "rid": r.rid, "tokens": r.prompt + r.out,
                                "handoff": h["route"], "max_tokens": 1, "sampling": r.sampling})

    def _prefilled(self, inst: _Instance, h: dict[str, Any], now: float) -> None:
        """The prefill instance sampled the first token and handed its KV over; the decode instance continues."""
        r = self._owned(inst, h)
        if r is None:
            return
        inst.requests.discard(r.rid)
        inst.served += 1
        r.instances.pop("prefill", None)
        token = int(h["token"])
        reason = finish_reason(token, len(r.out) + 1, r.max_tokens, r.ignore_eos)
        if reason != "stop":
            self._emit_token(r, token, now, h.get("logprobs"))
        decode = self.instances.get(r.instances.get("decode", ""))
        if reason:
            self._finish(r, reason) if decode is None else self._finish_pd_early(r, decode, reason)
        elif decode is None:
            self._retry_or_fail(r, f"decode instance {r.instances.get('decode')} went away", now)
        else:
            wire.send(self.router, {"kind": "first_token", "rid": r.rid, "token": token}, to=decode.ident)

    def _finish_pd_early(self, r: _Request, decode: _Instance, reason: str) -> None:
        wire.send(self.router, {"kind": "cancel", "rid": r.rid}, to=decode.ident)
        self._finish(r, reason)

    def _attempt_failed(self, inst: _Instance, h: dict[str, Any], now: float) -> None:
        """A request error (4xx) fails the request where it stands; any other failure may resume elsewhere."""
        r = self._owned(inst, h)
        if r is None:
            return
        status = h.get("status")
        if isinstance(status, int) and 400 <= status < 500:
            self._finish_error(r, str(h["problem"]), str(h.get("fix") or "change the request"), status)
        else:
            self._retry_or_fail(r, str(h["problem"]), now)

    def _retry_or_fail(self, r: _Request, problem: str, now: float) -> None:
        log.warning("request %s attempt %d failed: %s", r.rid, r.attempts, problem)
        self._release(r, cancel=True)
        if len(r.out) >= r.max_tokens:
            # Every token arrived and only the `done` was lost: nothing is left to redo.
            self._finish(r, "length")
            return
        if r.attempts <= self.cfg.max_retries and self._routable(r.model):
            self.counts["retried"] += 1
            self._dispatch(r, now)
            return
        tried = f" after {r.attempts} attempt(s)" if r.attempts > 1 else ""
        self._finish_error(r, f"request failed{tried}: {problem}",
                           "retry the request; the failed instance is out of rotation until it is healthy again",
                           503)

    # Client commands

    def _cancel(self, sock: zmq.Socket, ident: bytes, h: dict[str, Any], now: float) -> None:
        r = self.requests.get(str(h["rid"]))
        if r is not None and r.client == ident:
            del self.requests[r.rid]
            self._release(r, cancel=True)

    def _drain_request(self, sock: zmq.Socket, ident: bytes, h: dict[str, Any], now: float) -> None:
        name = str(h["instance"])
        inst = self.instances.get(name)
        if inst is None:
            wire.send(sock, {"kind": "error", "tag": h.get("tag"), "status": 404,
                             "problem": f"no instance {name!r}", "fix": f"use one of: {', '.join(self.instances)}"},
                      to=ident)
            return
        inst.state = "draining"
        wire.send(self.router, {"kind": "drain"}, to=inst.ident)
        wire.send(sock, {"kind": "draining", "tag": h.get("tag"), "instance": name, "in_flight": len(inst.requests)},
                  to=ident)

    def _admit(self, sock: zmq.Socket, ident: bytes, h: dict[str, Any], now: float) -> None:
        """New admission limits (`--admit` text, empty admits everything), so a re-plan reaches a live coordinator
        without a restart; their buckets start full. Text that does not parse changes nothing."""
        try:
            rates, depths, peaks = parse_admit(str(h.get("admit", "")))
        except CoralError as exc:
            wire.send(sock, {"kind": "error", "tag": h.get("tag"), "status": 400, "problem": exc.problem,
                             "fix": exc.fix}, to=ident)
            return
        self.admission = Admission(rates, depths, peaks)
        self.admit_text = format_admit(rates, depths, peaks)
        log.info("admission limits now %s", self.admit_text or "none (every request admitted)")
        wire.send(sock, {"kind": "admitted", "tag": h.get("tag"), "admit": self.admit_text}, to=ident)

    def _routable(self, model: str) -> bool:
        """Whether `_dispatch` would start a request for `model` now: an aggregated instance, or a prefill
        instance with a decode instance to hand over to (a prefill alone cannot finish a request)."""
        candidates = self._candidates(model)
        return self.routing.can_route(model, candidates) and any(c.phase in ("aggregated", "decode")
                                                                 for c in candidates)

    def _serving(self) -> list[str]:
        """Models a request could be dispatched for right now."""
        return sorted(m for m in self._models() if self._routable(m))

    def status(self) -> dict[str, Any]:
        context = {m: (self._limits(m) or ModelLimits(1)).max_context for m in self._models()}
        return {"models": self._models(), "serving": self._serving(), "counts": dict(self.counts),
                "in_flight": len(self.requests), "context": context,
                "departed": list(self.departed), "admit": self.admit_text,
                "instances": [{"instance": i.name, "model": i.model, "phase": i.phase, "state": i.state,
                               "problem": i.problem, "tokens_per_s": i.tokens_per_s, "in_flight": len(i.requests),
                               "served": i.served, "stages": i.stages} for i in self.instances.values()]}

    def _status(self, sock: zmq.Socket, ident: bytes, h: dict[str, Any], now: float) -> None:
        wire.send(sock, {"kind": "status", "tag": h.get("tag"), **self.status()}, to=ident)

    def close(self) -> None:
        if self.http is not None:
            self.http.stop()
        self.router.close(linger=0)
        self.front.close(linger=0)
        self.security.close()
