"""The coordinator: keeps the set of ready instances and routes each request by weighted round-robin."""

from __future__ import annotations

import itertools
import json
import logging
import math
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Set
from dataclasses import dataclass, field
from typing import Any

import zmq

from coral_dagster.runtime import credentials, wire
from coral_dagster.runtime.protocol import MESSAGES, Env, Kind, Link, check
from coral_dagster.runtime.config import CoordinatorConfig, format_admit, parse_admit
from coral_dagster.errors import CoralError
from coral_dagster.runtime.limits import (MAX_PROMPT_TOKENS, ModelLimits, RequestError, check_request, finite_positive,
                                          max_tokens_of, token_ids)
from coral_dagster.runtime.sampling import SamplingParams
from coral_dagster.runtime.scheduler import PREFILL_CHUNK_TOKENS
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
    incarnation: str = ""
    # From its heartbeats: how long it has held work without progress, and its progress limit (scaled by that work).
    stalled_s: float = 0.0
    progress_timeout_s: float = 0.0
    # Prompt tokens of the requests dispatched here whose first token has not come back yet (`prefill_fits`).
    prefill_tokens: int = 0
    # Its KV cache as its heartbeats last said (its fullest stage): tokens held and tokens it can hold (0: not said).
    kv_used_tokens: int = 0
    kv_capacity_tokens: int = 0

    def prefill_budget_tokens(self) -> int:
        """One context of prompt tokens: every valid prompt fits alone (none when the context is unknown)."""
        return self.limits.max_context if self.limits and self.limits.max_context else MAX_PROMPT_TOKENS


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
    created: float = 0.0
    # Past this the request fails (504), however it progresses.
    deadline: float = math.inf
    # Instances an attempt failed on: a retry never goes back to one (a restarted process has lost its state).
    failed_on: set[str] = field(default_factory=set)
    # Attempts that ended with their instance dead or restarted; at MAX_DEATHS the request fails alone.
    deaths: int = 0
    # The instance its prompt tokens count against until its first token (`_Instance.prefill_tokens`), and how many.
    prefill_on: str = ""
    prefill_held: int = 0
    # When its client last heard that it waits in the queue (never: -inf).
    told_queued: float = -math.inf


# A request in flight on this many instances that died is not tried on another: it may be what kills them.
MAX_DEATHS = 2
# What peers may make the coordinator hold and repeat in every status reply, which must fit one control frame
# (1024 × 6 KiB < wire.MAX_CONTROL_BYTES); an instance's stages take ~150 bytes per node.
MAX_INSTANCES = 1024
MAX_NAME_CHARS = 256
MAX_STAGES_BYTES = 6 << 10


def prefill_fits(held_tokens: int, tokens: int, budget_tokens: int) -> bool:
    """Whether a prompt of `tokens` may start on an instance whose dispatched requests hold `held_tokens` of prompt
    not yet prefilled: always on one that holds none (a valid prompt fits a context), else within `budget_tokens`;
    a light prompt (one prefill chunk, one forward pass) within one chunk more, so no heavy prompt holds it back."""
    return (held_tokens == 0 or held_tokens + tokens <= budget_tokens
            or (tokens <= PREFILL_CHUNK_TOKENS and held_tokens + tokens <= budget_tokens + PREFILL_CHUNK_TOKENS))


@dataclass
class _Waiting:
    key: str
    group: str
    tokens: int
    # Prompt tokens of later requests of its group that started while it waited.
    passed: int = 0


class WorkQueue:
    """Requests waiting for prefill room, first come first served within a group (a model). A request that cannot
    start lets later ones of its group that can start pass it, until they add up to its own prompt tokens; then
    they wait behind it. A light request never waits for a heavy one to find room, and a heavy one waits for at
    most its own work's worth of lighter ones (as vLLM's scheduler lets a short prefill run beside a long one's
    chunk, and serves its waiting queue first come first served)."""

    def __init__(self) -> None:
        self._waiting: dict[str, _Waiting] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    def __contains__(self, key: object) -> bool:
        return key in self._waiting

    def __iter__(self) -> Iterator[str]:
        """The waiting keys, first to start first."""
        return iter(list(self._waiting))

    def add(self, key: str, group: str, tokens: int, first: bool = False) -> None:
        """Queue `key` last, or first (a retry: it arrived before everything waiting)."""
        entry = _Waiting(key, group, tokens)
        self._waiting = {key: entry, **self._waiting} if first else {**self._waiting, key: entry}

    def discard(self, key: str) -> None:
        self._waiting.pop(key, None)

    def pump(self, start: Callable[[str], bool]) -> list[str]:
        """Offer each waiting request, in order, to `start`, which starts it (or fails it) and says whether it left
        the queue, or says False when no instance has room for it; returns those that left, in order."""
        blocked: dict[str, list[_Waiting]] = {}
        # Per group: the most prompt tokens a later request may have and pass every one blocked before it.
        room: dict[str, float] = {}
        left = []
        for w in list(self._waiting.values()):
            if w.key not in self._waiting:
                continue
            if w.tokens <= room.get(w.group, math.inf) and start(w.key):
                for b in blocked.get(w.group, ()):
                    b.passed += w.tokens
                room[w.group] = room.get(w.group, math.inf) - w.tokens
                self._waiting.pop(w.key, None)
                left.append(w.key)
            else:
                blocked.setdefault(w.group, []).append(w)
                room[w.group] = min(room.get(w.group, math.inf), w.tokens - w.passed)
        return left


def _prompt_logprobs(r: _Request, prompt_logprobs: Any) -> dict[str, Any]:
    """The prompt's log-probabilities for `r`'s client, from an attempt that ran its prompt: only before its first
    token (a retry after one runs the prompt and the tokens out so far, and the client has them already)."""
    return {"prompt_logprobs": prompt_logprobs} if prompt_logprobs is not None and not r.out else {}


def _stages(value: Any) -> list[dict[str, Any]]:
    """An instance's stage description as announced: a list whose JSON stays within MAX_STAGES_BYTES."""
    if not isinstance(value, list):
        raise ValueError(f"stages must be a list, got {type(value).__name__}")
    size = len(json.dumps(value))
    if size > MAX_STAGES_BYTES:
        raise ValueError(f"stages of {size} bytes exceed {MAX_STAGES_BYTES}")
    return value


class Coordinator:
    """Clients (`submit`, `cancel`, `drain`, `admit`, `status`) and schedulers share one ROUTER socket; the HTTP
    front door reaches the same loop through an inproc socket.

    A request goes to an aggregated instance (`generate`), or when the model has ready prefill and decode
    instances, to a decode instance (`decode`, which answers with its KV route) and then to a prefill instance
    (`prefill` with that route), whose first token starts the decode (`first_token`). Events to the client:
    `accepted`, `token`, `done`, `error`. A request starts only where an instance has room for its prompt's prefill
    (`prefill_fits`); until then it waits in `queue` (`WorkQueue`), its client told `accepted` with `queued`. A failed
    attempt resumes on another instance from the tokens already produced, up to `max_retries` times and never on an
    instance it failed on; then the client gets an `error` that says why. An instance is bound to the connection
    that registered it: a registration under a live instance's name from another connection is refused, and once
    taken (the old connection is gone: a restart), the old process's requests resume elsewhere at once. Instances
    whose model metadata (vocabulary, context, layers) disagrees with the deployment's own are refused.

    With a `registration_key`, a registration must also answer a `challenge` with a proof of the instance's
    credential (`credentials`), so a process holding the deployment's CURVE key cannot register, or take over
    once its connection is gone, an instance it has no credential for; and `drain` and `admit` over ZeroMQ must
    prove the registration key itself, so such a process cannot drain instances or change admission either.
    """

    def __init__(self, cfg: CoordinatorConfig, keys: CurveKeys | None = None, insecure: bool = False,
                 ctx: zmq.Context | None = None, registration_key: str = "") -> None:
        if cfg.http_port is not None and not (cfg.api_key or insecure
                                              or is_local(f"tcp://{cfg.http_host}:{cfg.http_port}")):
            raise CoralError(f"refusing to serve HTTP on {cfg.http_host} to anyone without an API key.",
                             "set CORAL_API_KEY (clients send it as their OpenAI api_key), serve on 127.0.0.1, "
                             "or pass --insecure")
        self.cfg = cfg
        self.registration_key = registration_key
        if keys is not None and not registration_key:
            log.warning("no %s: an instance is bound to the connection that registered it, not to a credential",
                        Env.REGISTRATION_KEY.value)
        # The nonce each connection must answer, oldest dropped first.
        self._nonces: OrderedDict[bytes, str] = OrderedDict()
        self.ctx = ctx or zmq.Context.instance()
        self.security = Security(self.ctx, keys, insecure)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.linger = 0
        self.address = self.security.bind(self.router, cfg.listen, router=True)
        self.incarnation = secrets.token_hex(4)
        self.front_address = f"inproc://coral-front-{id(self)}"
        self.front = self.ctx.socket(zmq.ROUTER)
        self.front.linger = 0
        # A send to a front-door request whose link has closed fails (its client went away) instead of vanishing.
        self.front.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.front.bind(self.front_address)
        self.instances: dict[str, _Instance] = {}
        self.departed: list[str] = []
        self.requests: dict[str, _Request] = {}
        # Requests waiting for prefill room on an instance (`prefill_fits`); their progress clocks start at dispatch.
        self.queue = WorkQueue()
        self.tokenizer = ByteTokenizer()
        self.routing = Router()
        self.admission = Admission(cfg.admit_req_s, cfg.admit_depth_req, cfg.admit_peak, shares=cfg.admit_share)
        self.admit_text = format_admit(cfg.admit_req_s, cfg.admit_depth_req, cfg.admit_peak, cfg.admit_share)
        self._ids = itertools.count()
        self.counts = {"submitted": 0, "completed": 0, "failed": 0, "retried": 0, "abandoned": 0}
        self.http = None
        if cfg.http_port is not None:
            from coral_dagster.runtime.frontdoor import Cors, FrontDoor

            self.http = FrontDoor(self.ctx, self.front_address, cfg.http_host, cfg.http_port,
                                  timeout_s=cfg.timing.request_timeout_s * (cfg.max_retries + 1) + 5,
                                  api_key=cfg.api_key, read_timeout_s=cfg.http_read_timeout_s,
                                  max_body_bytes=cfg.http_max_body_bytes,
                                  tls=(cfg.http_tls_certfile, cfg.http_tls_keyfile),
                                  cors=Cors(cfg.http_allowed_origins, cfg.http_allowed_methods,
                                            cfg.http_allowed_headers))

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
            if ident is None:
                raise RuntimeError("a ROUTER socket gave a message without its sender's routing id")
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
        """Answer a client's (or an unknown peer's) failed message, and a registration that cannot be taken; other
        scheduler messages get no answers."""
        if h.get("kind") == Kind.REGISTER and sock is self.router:
            wire.send(sock, {"kind": Kind.REFUSED, "problem": problem}, to=ident)
        elif h.get("kind") not in MESSAGES[Link.SCHEDULER_TO_COORDINATOR] or sock is self.front:
            if h.get("kind") == Kind.SUBMIT:
                self.counts["failed"] += 1
            wire.send(sock, {"kind": Kind.ERROR, "tag": h.get("tag"), "problem": problem, "fix": fix,
                             "status": status}, to=ident)

    # The handler of each kind the coordinator receives, by link; REGISTER comes before an instance exists.
    CLIENT_HANDLERS = {Kind.SUBMIT: "_submit", Kind.CANCEL: "_cancel", Kind.DRAIN: "_drain_request",
                       Kind.ADMIT: "_admit", Kind.STATUS: "_status"}
    SCHEDULER_HANDLERS = {Kind.REGISTER: "_register", Kind.HEARTBEAT: "_heartbeat", Kind.HEALTH: "_health",
                          Kind.TOKEN: "_token", Kind.DONE: "_done", Kind.PREFILLED: "_prefilled",
                          Kind.KV_ROUTE: "_kv_route", Kind.ERROR: "_attempt_failed", Kind.DRAINING: "_draining",
                          Kind.LEFT: "_left"}

    def _handle(self, sock: zmq.Socket, ident: bytes, h: dict[str, Any], now: float) -> None:
        links = (Link.CLIENT_TO_COORDINATOR, Link.SCHEDULER_TO_COORDINATOR) if sock is self.router \
            else (Link.CLIENT_TO_COORDINATOR,)
        link, kind = check(links, h)
        if link is Link.CLIENT_TO_COORDINATOR:
            if kind in (Kind.DRAIN, Kind.ADMIT) and sock is self.router and self.registration_key \
                    and not self._operator_proven(ident, kind, h):
                return
            getattr(self, self.CLIENT_HANDLERS[kind])(sock, ident, h, now)
            return
        name = h["instance"]
        if kind is Kind.REGISTER:
            self._register(ident, name, h, now)
            return
        inst = self.instances.get(name)
        if inst is None or inst.ident != ident:
            # Only the connection that registered an instance speaks for it.
            wire.send(self.router, {"kind": Kind.REREGISTER}, to=ident)
            return
        inst.last_seen = now
        getattr(self, self.SCHEDULER_HANDLERS[kind])(inst, h, now)

    # Instances

    def _refuse(self, ident: bytes, name: str, problem: str) -> None:
        log.warning("refused instance %s: %s", name, problem)
        wire.send(self.router, {"kind": Kind.REFUSED, "problem": problem}, to=ident)

    def _proven(self, ident: bytes, name: str, incarnation: str, answer: str | None) -> bool:
        """Whether the registration answers its connection's nonce with a proof of the instance's credential; else
        challenges the connection (no answer yet) or refuses it (a wrong answer)."""
        nonce = self._nonces.get(ident)
        if nonce is None or answer is None:
            self._challenge(ident)
            return False
        del self._nonces[ident]
        if credentials.verify(self.registration_key, nonce, name, incarnation, answer):
            return True
        self._refuse(ident, name, f"its credential does not prove instance {name}; set "
                     f"{Env.INSTANCE_CREDENTIAL.value} to `coral serve keys --credential {name}` run with this "
                     f"deployment's {Env.REGISTRATION_KEY.value}")
        return False

    def _challenge(self, ident: bytes, tag: Any = None) -> None:
        """Send the connection its nonce (the same one until it is answered)."""
        nonce = self._nonces.get(ident)
        if nonce is None:
            self._nonces[ident] = nonce = secrets.token_hex(16)
            while len(self._nonces) > 4 * MAX_INSTANCES:
                self._nonces.popitem(last=False)
        wire.send(self.router, {"kind": Kind.CHALLENGE, "nonce": nonce, **({"tag": tag} if tag else {})}, to=ident)

    def _operator_proven(self, ident: bytes, kind: Kind, h: dict[str, Any]) -> bool:
        """Whether a drain or admit command over ZeroMQ proves the registration key (the launching machine's); else
        challenges it, or answers 403 to a wrong proof. (The HTTP admin routes are guarded by the API key.)"""
        nonce, answer = self._nonces.get(ident), h.get("proof")
        if nonce is None or answer is None:
            self._challenge(ident, h.get("tag"))
            return False
        del self._nonces[ident]
        if credentials.verify_operator(self.registration_key, nonce, h, answer):
            return True
        log.warning("refused a %s command whose proof of %s is wrong", kind.value, Env.REGISTRATION_KEY.value)
        wire.send(self.router, {"kind": Kind.ERROR, "tag": h.get("tag"), "status": 403,
                                "problem": f"this {kind.value} command does not prove the deployment's "
                                           f"{Env.REGISTRATION_KEY.value}",
                                "fix": f"send it from the machine that launched the deployment, with "
                                       f"{Env.REGISTRATION_KEY.value} exported"}, to=ident)
        return False

    def _register(self, ident: bytes, name: str, h: dict[str, Any], now: float) -> None:
        old = self.instances.get(name)
        incarnation = str(h.get("incarnation", ""))
        if self.registration_key and not self._proven(ident, name, incarnation, h.get("proof")):
            return
        if old is not None and old.ident != ident and wire.send(self.router, {"kind": Kind.ACK}, to=old.ident):
            self._refuse(ident, name, f"instance {name} is registered and its connection is alive")
            return
        if len(name) > MAX_NAME_CHARS or (old is None and len(self.instances) >= MAX_INSTANCES):
            raise ValueError(f"an instance name of at most {MAX_NAME_CHARS} characters, and at most {MAX_INSTANCES} "
                             "instances, are taken")
        stages = _stages(h.get("stages", []))
        tokens_per_s = finite_positive(h["tokens_per_s"], "tokens_per_s")
        weight = finite_positive(h["weight"], "weight") if h.get("weight") is not None else tokens_per_s
        model, limits = str(h["model"]), ModelLimits.from_message(h.get("limits"))
        mismatch = self._metadata_mismatch(model, limits, h.get("split"))
        if mismatch:
            self._refuse(ident, name, mismatch)
            return
        if old is not None and (old.ident != ident or old.incarnation != incarnation):
            # Its process was replaced: what the old one had in flight is lost and resumes elsewhere now.
            self._lose(old, f"instance {name} restarted (its scheduler process was replaced)", now)
            old = None
        inst = _Instance(name, ident, model, str(h["phase"]), tokens_per_s, stages, now,
                         region=str(h.get("region") or "local"), weight=weight,
                         requests=old.requests if old else set(), served=old.served if old else 0,
                         limits=limits, incarnation=incarnation, prefill_tokens=old.prefill_tokens if old else 0)
        self.instances[name] = inst
        log.info("instance %s (%s %s, %g tok/s) registered", name, inst.model, inst.phase, inst.tokens_per_s)
        wire.send(self.router, {"kind": Kind.REGISTERED}, to=ident)

    def _metadata_mismatch(self, model: str, limits: ModelLimits | None, split: Any) -> str:
        """Why an instance's announced vocabulary, context or layers disagree with the model's own (the catalog's,
        else the first registered instance's); empty when they agree."""
        from coral_dagster.runtime.roles import model_layers, model_limits

        expected: ModelLimits | None
        layers: int | None
        try:
            expected, layers = model_limits(model), model_layers(model)
        except CoralError:
            expected = next((i.limits for i in self.instances.values() if i.model == model and i.limits), None)
            layers = None
        if limits is not None and expected is not None and limits != expected:
            return (f"model {model} has vocab {expected.vocab} and context {expected.max_context}, but the instance "
                    f"announced vocab {limits.vocab} and context {limits.max_context}")
        if layers is not None and isinstance(split, list) and sum(int(n) for n in split) != layers:
            return f"model {model} has {layers} layers, but the instance's split {split} covers {sum(split)}"
        return ""

    def _lose(self, inst: _Instance, problem: str, now: float) -> None:
        """Mark `inst` lost and move its requests on, each counting a death."""
        inst.state, inst.problem = "lost", problem
        log.warning("instance %s lost: %s", inst.name, problem)
        for rid in list(inst.requests):
            r = self.requests.get(rid)
            if r is not None and inst.name in r.instances.values():
                r.deaths += 1
                self._retry_or_fail(r, problem, now, {inst.name})
        inst.requests.clear()
        self._unhold_all(inst.name)

    def _heartbeat(self, inst: _Instance, h: dict[str, Any], now: float) -> None:
        inst.stages = _stages(h.get("stages", inst.stages))
        inst.stalled_s = finite_positive(h["stalled_s"], "stalled_s") if h.get("stalled_s") else 0.0
        inst.progress_timeout_s = (finite_positive(h["progress_timeout_s"], "progress_timeout_s")
                                   if h.get("progress_timeout_s") else 0.0)
        if h.get("kv_capacity_tokens", 0) > 0 and h.get("kv_used_tokens", -1) >= 0:
            inst.kv_used_tokens, inst.kv_capacity_tokens = h["kv_used_tokens"], h["kv_capacity_tokens"]
        # Prefill chunks are progress the client does not see as tokens: they keep the request's clock going.
        for rid in h.get("progressed", [])[:len(inst.requests)]:
            r = self.requests.get(str(rid))
            if r is not None and inst.name in r.instances.values():
                r.last_progress = now
        if inst.state == "lost":
            inst.state = "ready" if h.get("healthy") else "unhealthy"
        wire.send(self.router, {"kind": Kind.ACK}, to=inst.ident)

    def _health(self, inst: _Instance, h: dict[str, Any], now: float) -> None:
        if inst.state != "draining":
            inst.state = "ready" if h["healthy"] else "unhealthy"
        inst.problem = str(h.get("problem", ""))

    def _draining(self, inst: _Instance, h: dict[str, Any], now: float) -> None:
        inst.state = "draining"

    def _left(self, inst: _Instance, h: dict[str, Any], now: float) -> None:
        log.info("instance %s left", inst.name)
        self._unhold_all(inst.name)
        del self.instances[inst.name]
        self.departed.append(inst.name)
        for rid in list(inst.requests):
            self._attempt_failed(inst, {"rid": rid, "problem": f"instance {inst.name} left"}, now)

    def _candidates(self, model: str, exclude: Set[str] = frozenset()) -> list[Candidate]:
        """The model's ready instances as the routing policy sees them (weight: the share of demand the plan gave),
        but those in `exclude`."""
        return [Candidate(i.name, i.model, i.phase, i.region, i.weight) for i in self.instances.values()
                if i.model == model and i.state == "ready" and i.name not in exclude]

    def _check(self, now: float) -> None:
        t = self.cfg.timing
        for inst in list(self.instances.values()):
            if inst.state != "lost" and now - inst.last_seen > t.dead_after_s:
                self._lose(inst, f"instance {inst.name} scheduler silent for {now - inst.last_seen:.1f} s", now)
        for r in list(self.requests.values()):
            if self.requests.get(r.rid) is not r:
                continue  # a retry before it started or failed it (`_pump`)
            if now > r.deadline:
                self._finish_error(r, f"request ran past its deadline of {r.deadline - r.created:g} s.",
                                   "send a shorter request, or a longer timeout_s", 504, type="timeout")
            elif r.rid not in self.queue and now - r.last_progress > (limit_s := self._progress_limit_s(r)):
                names = ", ".join(r.instances.values()) or "none"
                self._retry_or_fail(r, f"no progress for {limit_s:g} s on instance(s) {names}", now,
                                    set(r.instances.values()))
        self._pump(now)

    def _progress_limit_s(self, r: _Request) -> float:
        """How long `r` may go without progress: `request_timeout_s`, or longer where its instance holds more work
        (its scheduler's limit, scaled by the prefill tokens its stages hold)."""
        limits = [self.instances[n].progress_timeout_s for n in r.instances.values() if n in self.instances]
        return max([self.cfg.timing.request_timeout_s, *limits])

    def _degraded(self, inst: _Instance) -> bool:
        """Whether `inst` holds work and has made no progress for a quarter of its progress limit."""
        return inst.stalled_s > max(self.cfg.timing.request_timeout_s, inst.progress_timeout_s) / 4

    # Requests

    def _event(self, r: _Request, header: dict[str, Any]) -> None:
        """Tell `r`'s client; a client whose connection has closed will never cancel, so `r` stops here."""
        sent = wire.deliver(r.sock, {**header, "rid": r.rid, "tag": r.tag}, to=r.client)
        if sent == wire.GONE and self.requests.pop(r.rid, None) is not None:
            log.info("request %s stopped: its client went away", r.rid)
            self.counts["abandoned"] += 1
            self._release(r, cancel=True)

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
        timeout_s = self.cfg.timing.request_deadline_s
        if h.get("timeout_s") is not None:
            timeout_s = min(timeout_s, finite_positive(h["timeout_s"], "timeout_s"))
        r = _Request(f"req-{self.incarnation}-{next(self._ids)}", sock, ident, h.get("tag"), model, prompt,
                     max_tokens, h.get("ignore_eos", False), last_progress=now, created=now,
                     deadline=now + timeout_s, sampling=sampling)
        self.requests[r.rid] = r
        if not self.admission.admit(model, now):
            wait_s = self.admission.retry_after_s(model, now)
            self._finish_error(r, f"model {model} is at what its plan admits of it "
                               f"({self.admission.limits(model)}).", f"retry after {wait_s:.1f} s",
                               429, type="rate_limited", retry_after_s=wait_s)
            return
        self.queue.add(r.rid, model, len(prompt))
        self._pump(now)

    def _models(self) -> list[str]:
        return sorted(set(self.cfg.models) | {i.model for i in self.instances.values()})

    def _dispatch(self, r: _Request, now: float) -> None:
        """Start an attempt on the route the routing policy picks among the ready instances: an aggregated
        instance, or a prefill instance and a decode instance of its region."""
        r.attempts += 1
        r.last_progress = now
        prompt = r.prompt + r.out
        left = r.max_tokens - len(r.out)
        route = self.routing.route(r.model, self._candidates(r.model, r.failed_on | self._full(r.model, len(prompt))))
        entry, second = route or (None, None)
        if entry is not None:
            self._hold(r, self._instance_of(entry), len(prompt))
        if entry is not None and second is not None:
            prefill, decode = self._instance_of(entry), self._instance_of(second)
            r.instances = {"prefill": prefill.name, "decode": decode.name}
            msg = {"kind": Kind.DECODE, "rid": r.rid, "prompt_len": len(prompt), "max_tokens": left,
                   "ignore_eos": r.ignore_eos, "sampling": r.sampling}
            self._send(decode, r, msg)
            r.history.append(f"{prefill.name}->{decode.name}")
        elif entry is not None and entry.phase == "aggregated":
            aggregated = self._instance_of(entry)
            r.instances = {"aggregated": aggregated.name}
            self._send(aggregated, r, {"kind": Kind.GENERATE, "rid": r.rid, "tokens": prompt, "max_tokens": left,
                                       "ignore_eos": r.ignore_eos, "sampling": r.sampling})
            r.history.append(aggregated.name)
        else:
            known = self._models()
            fix = ("wait for its instances to register or become healthy (GET /admin/instances shows them)"
                   if r.model in known else f"ask for one of: {', '.join(known) or 'none registered yet'}")
            self._finish_error(r, f"no ready instance serves model {r.model!r}", fix, 503 if r.model in known else 404)
            return
        self._event(r, {"kind": Kind.ACCEPTED, "instances": dict(r.instances), "attempt": r.attempts})

    def _full(self, model: str, tokens: int) -> set[str]:
        """The instances of `model` that prefill (aggregated or prefill ones) with no room for `tokens` more."""
        return {i.name for i in self.instances.values() if i.model == model and i.phase != "decode"
                and not prefill_fits(i.prefill_tokens, tokens, i.prefill_budget_tokens())}

    def _start(self, r: _Request, now: float) -> bool:
        """Dispatch queued `r` where its prompt fits (False: it waits for room); one no instance could ever take
        fails as dispatching it does."""
        if self._routable(r.model, r.failed_on) and not self._routable(
                r.model, r.failed_on | self._full(r.model, len(r.prompt) + len(r.out))):
            return False
        self._dispatch(r, now)
        return True

    def _pump(self, now: float) -> None:
        """Start what the queue lets start; tell a request left waiting so (again each `request_timeout_s`, so a
        client waiting on it knows the coordinator still holds it)."""
        if not len(self.queue):
            return
        self.queue.pump(lambda rid: rid not in self.requests or self._start(self.requests[rid], now))
        for ahead, rid in enumerate(self.queue):
            r = self.requests[rid]
            if now - r.told_queued >= self.cfg.timing.request_timeout_s:
                r.told_queued = now
                self._event(r, {"kind": Kind.ACCEPTED, "instances": {}, "attempt": r.attempts, "queued": ahead})

    def _hold(self, r: _Request, inst: _Instance, tokens: int) -> None:
        r.prefill_on, r.prefill_held = inst.name, tokens
        inst.prefill_tokens += tokens

    def _unhold(self, r: _Request) -> None:
        """`r`'s prompt no longer counts against its instance: its first token came, or its attempt ended."""
        inst = self.instances.get(r.prefill_on)
        if inst is not None:
            inst.prefill_tokens -= r.prefill_held
        r.prefill_on, r.prefill_held = "", 0

    def _unhold_all(self, name: str) -> None:
        """Nothing counts against instance `name` any more (it is lost or left; one registered under its name
        starts from nothing)."""
        for r in self.requests.values():
            if r.prefill_on == name:
                self._unhold(r)

    def _instance_of(self, candidate: Candidate) -> _Instance:
        """The instance a routing candidate stands for (`_candidates` keys each by its instance's name)."""
        name = candidate.key
        if not isinstance(name, str):
            raise TypeError(f"routing candidate key {name!r} is not an instance name")
        return self.instances[name]

    def _send(self, inst: _Instance, r: _Request, msg: dict[str, Any]) -> None:
        inst.requests.add(r.rid)
        wire.send(self.router, msg, to=inst.ident)

    def _release(self, r: _Request, cancel: bool) -> None:
        self.queue.discard(r.rid)
        self._unhold(r)
        for name in r.instances.values():
            inst = self.instances.get(name)
            if inst is not None:
                inst.requests.discard(r.rid)
                if cancel:
                    wire.send(self.router, {"kind": Kind.CANCEL, "rid": r.rid}, to=inst.ident)
        r.instances = {}

    def _emit_token(self, r: _Request, token: int, now: float, logprobs: Any = None, prompt_logprobs: Any = None
                    ) -> None:
        prompt = _prompt_logprobs(r, prompt_logprobs)
        r.out.append(token)
        r.last_progress = now
        self._unhold(r)
        self._event(r, {"kind": Kind.TOKEN, "token": token, "text": self.tokenizer.decode_token(token),
                        "index": len(r.out) - 1, **({"logprobs": logprobs} if logprobs is not None else {}),
                        **prompt})

    def _finish(self, r: _Request, reason: str, prompt_logprobs: Any = None) -> None:
        for name in r.instances.values():
            if name in self.instances:
                self.instances[name].served += 1
        self._release(r, cancel=False)
        self.requests.pop(r.rid, None)
        self.counts["completed"] += 1
        self._event(r, {"kind": Kind.DONE, "finish_reason": reason, "tokens": r.out,
                        "text": self.tokenizer.decode(r.out), "prompt_tokens": len(r.prompt),
                        "instances": r.history, "attempts": r.attempts, **_prompt_logprobs(r, prompt_logprobs)})

    def _finish_error(self, r: _Request, problem: str, fix: str, status: int, **extra: Any) -> None:
        """Fail `r`; `extra` travels to the client (`type="rate_limited", retry_after_s=…` becomes HTTP 429)."""
        self._release(r, cancel=True)
        self.requests.pop(r.rid, None)
        self.counts["failed"] += 1
        self._event(r, {"kind": Kind.ERROR, "problem": problem, "fix": fix, "status": status, "tokens": r.out,
                        "instances": r.history, **extra})

    def _owned(self, inst: _Instance, h: dict[str, Any]) -> _Request | None:
        r = self.requests.get(str(h["rid"]))
        return r if r is not None and inst.name in r.instances.values() else None

    def _token(self, inst: _Instance, h: dict[str, Any], now: float) -> None:
        r = self._owned(inst, h)
        if r is not None:
            self._emit_token(r, int(h["token"]), now, h.get("logprobs"), h.get("prompt_logprobs"))

    def _done(self, inst: _Instance, h: dict[str, Any], now: float) -> None:
        r = self._owned(inst, h)
        if r is not None:
            self._finish(r, str(h["finish_reason"]), h.get("prompt_logprobs"))

    def _kv_route(self, inst: _Instance, h: dict[str, Any], now: float) -> None:
        r = self._owned(inst, h)
        if r is None:
            return
        prefill = self.instances.get(r.instances.get("prefill", ""))
        if prefill is None or prefill.state != "ready":
            self._retry_or_fail(r, f"prefill instance {r.instances.get('prefill')} went away", now)
            return
        r.last_progress = now
        self._send(prefill, r, {"kind": Kind.PREFILL, "rid": r.rid, "tokens": r.prompt + r.out,
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
        prompt_logprobs = h.get("prompt_logprobs")
        if reason != "stop":
            self._emit_token(r, token, now, h.get("logprobs"), prompt_logprobs)
            if r.rid not in self.requests:
                return
            prompt_logprobs = None
        decode = self.instances.get(r.instances.get("decode", ""))
        if reason:
            self._finish(r, reason, prompt_logprobs) if decode is None else self._finish_pd_early(
                r, decode, reason, prompt_logprobs)
        elif decode is None:
            self._retry_or_fail(r, f"decode instance {r.instances.get('decode')} went away", now)
        else:
            msg = {"kind": Kind.FIRST_TOKEN, "rid": r.rid, "token": token}
            if "kv_transfer_params" in h:
                # A vLLM prefill: the vLLM decode runs the prompt and this token, its connector loading the KV.
                msg.update(tokens=r.prompt + r.out, kv_transfer_params=h["kv_transfer_params"])
            wire.send(self.router, msg, to=decode.ident)

    def _finish_pd_early(self, r: _Request, decode: _Instance, reason: str, prompt_logprobs: Any = None) -> None:
        wire.send(self.router, {"kind": Kind.CANCEL, "rid": r.rid}, to=decode.ident)
        self._finish(r, reason, prompt_logprobs)

    def _attempt_failed(self, inst: _Instance, h: dict[str, Any], now: float) -> None:
        """A request error (4xx) fails the request where it stands; any other failure may resume elsewhere."""
        r = self._owned(inst, h)
        if r is None:
            return
        status = h.get("status")
        if isinstance(status, int) and 400 <= status < 500:
            self._finish_error(r, str(h["problem"]), str(h.get("fix") or "change the request"), status)
        else:
            problem = str(h["problem"])
            if "was restarted" in problem or "stopped responding" in problem:
                r.deaths += 1
            self._retry_or_fail(r, problem, now, {inst.name})

    def _retry_or_fail(self, r: _Request, problem: str, now: float, culprits: Set[str] = frozenset()) -> None:
        """Resume `r` on an instance it has not failed on, while retries are left; else fail it alone."""
        log.warning("request %s attempt %d failed: %s", r.rid, r.attempts, problem)
        r.failed_on |= culprits
        self._release(r, cancel=True)
        if len(r.out) >= r.max_tokens:
            # Every token arrived and only the `done` was lost: nothing is left to redo.
            self._finish(r, "length")
            return
        if r.attempts <= self.cfg.max_retries and r.deaths < MAX_DEATHS and self._routable(r.model, r.failed_on):
            self.counts["retried"] += 1
            self.queue.add(r.rid, r.model, len(r.prompt) + len(r.out), first=True)
            self._pump(now)
            return
        tried = f" after {r.attempts} attempt(s) on {', '.join(r.history)}" if r.attempts > 1 else ""
        why = (f"; it was in flight on {r.deaths} instances that died, so it is not tried on another"
               if r.deaths >= MAX_DEATHS else "")
        self._finish_error(r, f"request failed{tried}: {problem}{why}",
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
            wire.send(sock, {"kind": Kind.ERROR, "tag": h.get("tag"), "status": 404,
                             "problem": f"no instance {name!r}", "fix": f"use one of: {', '.join(self.instances)}"},
                      to=ident)
            return
        inst.state = "draining"
        wire.send(self.router, {"kind": Kind.DRAIN}, to=inst.ident)
        wire.send(sock, {"kind": Kind.DRAINING, "tag": h.get("tag"), "instance": name, "in_flight": len(inst.requests)},
                  to=ident)

    def _admit(self, sock: zmq.Socket, ident: bytes, h: dict[str, Any], now: float) -> None:
        """New admission limits (`--admit` text, empty admits everything), so a re-plan reaches a live coordinator
        without a restart; their buckets start as at start-up. Text that does not parse changes nothing."""
        try:
            rates, depths, peaks, shares = parse_admit(str(h.get("admit", "")))
        except CoralError as exc:
            wire.send(sock, {"kind": Kind.ERROR, "tag": h.get("tag"), "status": 400, "problem": exc.problem,
                             "fix": exc.fix}, to=ident)
            return
        self.admission = Admission(rates, depths, peaks, shares=shares)
        self.admit_text = format_admit(rates, depths, peaks, shares)
        log.info("admission limits now %s", self.admit_text or "none (every request admitted)")
        wire.send(sock, {"kind": Kind.ADMITTED, "tag": h.get("tag"), "admit": self.admit_text}, to=ident)

    def _routable(self, model: str, exclude: Set[str] = frozenset()) -> bool:
        """Whether `_dispatch` would start a request for `model` now (on none of `exclude`): an aggregated instance,
        or a prefill instance with a decode instance to hand over to (a prefill alone cannot finish a request)."""
        candidates = self._candidates(model, exclude)
        return self.routing.can_route(model, candidates) and any(c.phase in ("aggregated", "decode")
                                                                 for c in candidates)

    def _serving(self) -> list[str]:
        """Models a request could be dispatched for right now."""
        return sorted(m for m in self._models() if self._routable(m))

    def status(self) -> dict[str, Any]:
        context = {m: (self._limits(m) or ModelLimits(1)).max_context for m in self._models()}
        return {"models": self._models(), "serving": self._serving(), "counts": dict(self.counts),
                "in_flight": len(self.requests), "queued": len(self.queue), "context": context,
                "departed": list(self.departed), "admit": self.admit_text,
                "degraded": sorted(i.name for i in self.instances.values() if self._degraded(i)),
                "instances": [{"instance": i.name, "model": i.model, "phase": i.phase, "state": i.state,
                               "progress": "degraded" if self._degraded(i) else "ok",
                               "problem": i.problem, "tokens_per_s": i.tokens_per_s, "in_flight": len(i.requests),
                               "prefill_tokens": i.prefill_tokens, "kv_used_tokens": i.kv_used_tokens,
                               "kv_capacity_tokens": i.kv_capacity_tokens,
                               "served": i.served, "stages": i.stages} for i in self.instances.values()]}

    def _status(self, sock: zmq.Socket, ident: bytes, h: dict[str, Any], now: float) -> None:
        wire.send(sock, {"kind": Kind.STATUS, "tag": h.get("tag"), **self.status()}, to=ident)

    def close(self) -> None:
        if self.http is not None:
            self.http.stop()
        self.router.close(linger=0)
        self.front.close(linger=0)
        self.security.close()
