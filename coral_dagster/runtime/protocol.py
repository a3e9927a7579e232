"""The runtime's protocol in one place: every message kind, the link it travels on, the fields it carries (checked
where it arrives, before any handler reads it), and the table of `CORAL_*` environment variables runtime processes
read.

Links: a client (or the HTTP front door) and the coordinator; the coordinator and each instance's scheduler; a
scheduler and its engine nodes (control); engine nodes among themselves (data: activations and KV caches).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from coral_dagster.runtime.wire import WireError


class Kind(StrEnum):
    """Every message kind of the runtime."""

    # Client -> coordinator.
    SUBMIT = "submit"
    CANCEL = "cancel"
    DRAIN = "drain"
    ADMIT = "admit"
    STATUS = "status"
    # Coordinator -> client (with STATUS and ERROR, TOKEN, DONE).
    ACCEPTED = "accepted"
    ADMITTED = "admitted"
    DRAINING = "draining"
    # Scheduler -> coordinator (with TOKEN, DONE, ERROR, DRAINING).
    REGISTER = "register"
    HEARTBEAT = "heartbeat"
    HEALTH = "health"
    PREFILLED = "prefilled"
    KV_ROUTE = "kv_route"
    LEFT = "left"
    # Coordinator -> scheduler (with CANCEL, DRAIN).
    REGISTERED = "registered"
    REREGISTER = "reregister"
    REFUSED = "refused"
    CHALLENGE = "challenge"
    ACK = "ack"
    GENERATE = "generate"
    PREFILL = "prefill"
    DECODE = "decode"
    FIRST_TOKEN = "first_token"
    # Engine node -> scheduler (with TOKEN, ERROR).
    HELLO = "hello"
    PULSE = "pulse"
    # Scheduler -> engine node (with CHALLENGE).
    WELCOME = "welcome"
    REJECT = "reject"
    REHELLO = "rehello"
    PING = "ping"
    FREE = "free"
    STOP = "stop"
    # Engine node -> engine node (data).
    FORWARD = "forward"
    KV = "kv"
    # On several links.
    TOKEN = "token"
    DONE = "done"
    ERROR = "error"


class Link(StrEnum):
    """Who talks to whom."""

    CLIENT_TO_COORDINATOR = "client->coordinator"
    COORDINATOR_TO_CLIENT = "coordinator->client"
    SCHEDULER_TO_COORDINATOR = "scheduler->coordinator"
    COORDINATOR_TO_SCHEDULER = "coordinator->scheduler"
    NODE_TO_SCHEDULER = "node->scheduler"
    SCHEDULER_TO_NODE = "scheduler->node"
    DATA = "node->node"


class ProtocolError(WireError, ValueError):
    """A message whose kind its link does not carry, or whose fields are missing or of the wrong type."""


class _Int:
    """An integer that JSON sent as a number (`true` is not one)."""


class _Number:
    """A finite or infinite JSON number, not a boolean (finiteness is the handler's to check)."""


INT, NUMBER = _Int, _Number
_NAMES = {str: "a string", bool: "true or false", list: "a list", dict: "an object", type(None): "null",
          _Int: "an integer", _Number: "a number"}


def _is(value: Any, kind: type) -> bool:
    if kind is _Int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is _Number:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, kind)


@dataclass(frozen=True)
class Shape:
    """The fields of one kind on one link: each required or optional field and the JSON types it may take."""

    required: Mapping[str, tuple[type, ...]] = field(default_factory=dict)
    optional: Mapping[str, tuple[type, ...]] = field(default_factory=dict)

    def check(self, kind: str, header: Mapping[str, Any]) -> None:
        for name, types in (*self.required.items(), *self.optional.items()):
            if name not in header:
                if name in self.required:
                    raise ProtocolError(f"a {kind} message lacks its {name!r} field.",
                                        f"send {name} as {' or '.join(_NAMES[t] for t in types)}")
                continue
            if not any(_is(header[name], t) for t in types):
                raise ProtocolError(f"field {name!r} of a {kind} message is {type(header[name]).__name__}, not "
                                    f"{' or '.join(_NAMES[t] for t in types)}.", "send the type the protocol names")


S, I, N, B, L, D, NONE = (str,), (INT,), (NUMBER,), (bool,), (list,), (dict,), (type(None),)  # noqa: E741 - one-letter JSON types keep the shape table legible
_RID = {"rid": S}
_INSTANCE = {"instance": S}
_NODE = {"node": S}

MESSAGES: dict[Link, dict[Kind, Shape]] = {
    # The coordinator checks a request's own fields (prompt, max_tokens, …) and answers with sentences.
    Link.CLIENT_TO_COORDINATOR: {
        Kind.SUBMIT: Shape(), Kind.CANCEL: Shape(_RID), Kind.DRAIN: Shape({"instance": S}, {"proof": S}),
        Kind.ADMIT: Shape(optional={"admit": S, "proof": S}), Kind.STATUS: Shape(),
    },
    Link.COORDINATOR_TO_CLIENT: {
        Kind.ACCEPTED: Shape(_RID, {"instances": D, "attempt": I}),
        Kind.TOKEN: Shape(_RID, {"token": I, "index": I, "logprobs": L + NONE, "prompt_logprobs": L}),
        Kind.DONE: Shape(_RID, {"tokens": L, "prompt_logprobs": L}), Kind.ERROR: Shape({"problem": S}, {"status": I}),
        Kind.DRAINING: Shape({"instance": S}), Kind.ADMITTED: Shape({"admit": S}), Kind.STATUS: Shape({"models": L}),
        Kind.CHALLENGE: Shape({"nonce": S}),
    },
    Link.SCHEDULER_TO_COORDINATOR: {
        Kind.REGISTER: Shape({**_INSTANCE, "model": S, "phase": S, "tokens_per_s": N},
                             {"incarnation": S, "weight": N + NONE, "region": S + NONE, "split": L, "stages": L,
                              "limits": D + NONE, "proof": S}),
        Kind.HEARTBEAT: Shape(_INSTANCE, {"incarnation": S, "healthy": B, "in_flight": I, "draining": B,
                                          "stages": L, "progressed": L, "stalled_s": N, "progress_timeout_s": N,
                                          "kv_used_tokens": I, "kv_capacity_tokens": I}),
        Kind.HEALTH: Shape({**_INSTANCE, "healthy": B}, {"problem": S}),
        Kind.TOKEN: Shape({**_INSTANCE, **_RID, "token": I}, {"logprobs": L + NONE, "prompt_logprobs": L}),
        Kind.DONE: Shape({**_INSTANCE, **_RID, "finish_reason": S}, {"prompt_logprobs": L}),
        Kind.PREFILLED: Shape({**_INSTANCE, **_RID, "token": I}, {"kv_transfer_params": D, "prompt_logprobs": L}),
        Kind.KV_ROUTE: Shape({**_INSTANCE, **_RID, "route": L}),
        Kind.ERROR: Shape({**_INSTANCE, **_RID, "problem": S}, {"status": I + NONE, "fix": S + NONE}),
        Kind.DRAINING: Shape(_INSTANCE), Kind.LEFT: Shape(_INSTANCE),
    },
    Link.COORDINATOR_TO_SCHEDULER: {
        Kind.REGISTERED: Shape(), Kind.REREGISTER: Shape(), Kind.ACK: Shape(),
        Kind.REFUSED: Shape(optional={"problem": S}), Kind.CHALLENGE: Shape({"nonce": S}),
        Kind.GENERATE: Shape({**_RID, "tokens": L, "max_tokens": I}, {"ignore_eos": B, "sampling": D + NONE}),
        Kind.PREFILL: Shape({**_RID, "tokens": L, "handoff": L}, {"max_tokens": I, "sampling": D + NONE}),
        Kind.DECODE: Shape({**_RID, "prompt_len": I, "max_tokens": I}, {"ignore_eos": B, "sampling": D + NONE}),
        Kind.FIRST_TOKEN: Shape({**_RID, "token": I}, {"tokens": L, "kv_transfer_params": D}),
        Kind.CANCEL: Shape(_RID), Kind.DRAIN: Shape(),
    },
    Link.NODE_TO_SCHEDULER: {
        Kind.HELLO: Shape({**_NODE, "stage": I, "start": I, "end": I, "data": S, "model": S},
                          {"share": N, "engine": S, "streams": B, "incarnation": S, "proof": S}),
        Kind.PULSE: Shape({**_NODE, "incarnation": S}, {"kv_used_tokens": I, "kv_capacity_tokens": I}),
        Kind.TOKEN: Shape({**_NODE, **_RID, "token": I, "pos": I}, {"logprobs": L + NONE, "kv_transfer_params": D,
                                                                 "prompt_logprobs": L}),
        Kind.ERROR: Shape({**_NODE, **_RID, "problem": S}, {"status": I + NONE}),
    },
    Link.SCHEDULER_TO_NODE: {
        Kind.WELCOME: Shape(optional={"route_key": S}), Kind.REHELLO: Shape(), Kind.PING: Shape(), Kind.STOP: Shape(),
        Kind.REJECT: Shape(optional={"problem": S}), Kind.FREE: Shape(_RID), Kind.CHALLENGE: Shape({"nonce": S}),
    },
    Link.DATA: {
        Kind.FORWARD: Shape({**_RID, "pos": I, "stage": I, "route": L},
                            {"handoff": L + NONE, "max_tokens": I, "kv_transfer_params": D, "mac": S, "targets": L}),
        Kind.KV: Shape({**_RID, "start": I, "end": I}, {"mac": S}),
    },
}


def check(links: Link | Iterable[Link], header: Mapping[str, Any]) -> tuple[Link, Kind]:
    """The link (of `links`) and kind of a received message whose fields have the shape the protocol gives them;
    raises ProtocolError naming the kind or field that does not."""
    links = (links,) if isinstance(links, Link) else tuple(links)
    kind: Any = header.get("kind")
    first: ProtocolError | None = None
    for link in links:
        shape = MESSAGES[link].get(kind)
        if shape is None:
            continue
        try:
            shape.check(str(kind), header)
        except ProtocolError as exc:
            first = first or exc
            continue
        return link, Kind(kind)
    if first is not None:
        raise first
    carried = sorted({k.value for link in links for k in MESSAGES[link]})
    raise ProtocolError(f"message kind {kind!r} does not travel on {', '.join(links)}.",
                        f"send one of: {', '.join(carried)}")


class Env(StrEnum):
    """Every `CORAL_*` variable a runtime process reads (SkyPilot passes settings this way); `coral serve`'s options
    take their values from these, and deployments set them by these names."""

    # Every role.
    INSECURE = "CORAL_INSECURE"
    HEARTBEAT_S = "CORAL_HEARTBEAT_S"
    DEAD_AFTER_S = "CORAL_DEAD_AFTER_S"
    REQUEST_TIMEOUT_S = "CORAL_REQUEST_TIMEOUT_S"
    REQUEST_DEADLINE_S = "CORAL_REQUEST_DEADLINE_S"
    KV_TIMEOUT_S = "CORAL_KV_TIMEOUT_S"
    ORPHAN_AFTER_S = "CORAL_ORPHAN_AFTER_S"
    CURVE_SECRET_KEY = "CORAL_CURVE_SECRET_KEY"
    CURVE_PUBLIC_KEYS = "CORAL_CURVE_PUBLIC_KEYS"
    LISTEN = "CORAL_LISTEN"
    MODEL = "CORAL_MODEL"
    # Coordinator.
    HTTP_HOST = "CORAL_HTTP_HOST"
    HTTP_PORT = "CORAL_HTTP_PORT"
    MAX_RETRIES = "CORAL_MAX_RETRIES"
    API_KEY = "CORAL_API_KEY"
    TLS_CERTFILE = "CORAL_TLS_CERTFILE"
    TLS_KEYFILE = "CORAL_TLS_KEYFILE"
    ADMIT = "CORAL_ADMIT"
    ALLOWED_ORIGINS = "CORAL_ALLOWED_ORIGINS"
    ALLOWED_METHODS = "CORAL_ALLOWED_METHODS"
    ALLOWED_HEADERS = "CORAL_ALLOWED_HEADERS"
    # A launched coordinator's task: plain HTTP instead of its default HTTPS, and (for the standby) the primary it
    # watches and takes over from (sky_tasks/coordinator.yaml reads both).
    PLAIN_HTTP = "CORAL_PLAIN_HTTP"
    PRIMARY = "CORAL_PRIMARY"
    # The endpoint's task (sky_tasks/endpoint.yaml): its certificate and key in one PEM, and the port of the
    # coordinators' front doors it sends requests to (it is given their addresses in CORAL_COORDINATOR).
    TLS_PEMFILE = "CORAL_TLS_PEMFILE"
    COORDINATOR_HTTP_PORT = "CORAL_COORDINATOR_HTTP_PORT"
    # Coordinator and the launching machine: the key every instance credential derives from.
    REGISTRATION_KEY = "CORAL_REGISTRATION_KEY"
    # Scheduler.
    INSTANCE = "CORAL_INSTANCE"
    PHASE = "CORAL_PHASE"
    SPLIT = "CORAL_SPLIT"
    COORDINATOR = "CORAL_COORDINATOR"
    REGION = "CORAL_REGION"
    ROUTE_WEIGHT = "CORAL_ROUTE_WEIGHT"
    TOKENS_PER_S = "CORAL_TOKENS_PER_S"
    # Its instance's credential (`coral serve keys --credential NAME`), proving its name to the coordinator.
    INSTANCE_CREDENTIAL = "CORAL_INSTANCE_CREDENTIAL"
    # Engine node.
    NODE = "CORAL_NODE"
    # Its slot's credential (`coral serve keys --credential INSTANCE --node NODE --stage S`), proving to its scheduler
    # that it may join stage S under name NODE.
    NODE_CREDENTIAL = "CORAL_NODE_CREDENTIAL"
    LAYERS = "CORAL_LAYERS"
    STAGE_RANK = "CORAL_STAGE_RANK"
    SCHEDULER = "CORAL_SCHEDULER"
    ADVERTISE = "CORAL_ADVERTISE"
    SHARE = "CORAL_SHARE"
    ENGINE = "CORAL_ENGINE"
    DEVICE = "CORAL_DEVICE"
    NODE_RANK = "CORAL_NODE_RANK"
    VLLM_HEAD = "CORAL_VLLM_HEAD"
    VLLM_PORT = "CORAL_VLLM_PORT"
    RESTART = "CORAL_RESTART"
    TP = "CORAL_TP"
    MAX_MODEL_LEN = "CORAL_MAX_MODEL_LEN"
    GPU_MEMORY_UTILIZATION = "CORAL_GPU_MEMORY_UTILIZATION"
    ENFORCE_EAGER = "CORAL_ENFORCE_EAGER"
    KV_TRANSFER_CONFIG = "CORAL_KV_TRANSFER_CONFIG"
    # Read by SkyPilot task scripts on GPU nodes or by libraries, not by an option: whether this node also runs its
    # scheduler (sky_tasks/engine.yaml), the vLLM build to install (sky_tasks/setup_node.sh), what `coral profile run`
    # measures (sky_tasks/profile.yaml).
    HEAD = "CORAL_HEAD"
    # Where `runtime/hf_export.py` keeps the tiny models it exports for vLLM.
    MODELS_DIR = "CORAL_MODELS_DIR"
    VLLM_SPEC = "CORAL_VLLM_SPEC"
    PROFILE_NODE = "CORAL_PROFILE_NODE"
    PROFILE_LAYERS = "CORAL_PROFILE_LAYERS"
