"""Settings of the coordinator, schedulers and engine nodes, and the timing they share."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

from coral_dagster.errors import CoralError
from coral_dagster.runtime.engine import validate_layers
from coral_dagster.runtime.limits import ModelLimits
from coral_dagster.vocab import PHASES


@dataclass(frozen=True)
class Timing:
    """Heartbeat period and the bounds after which silence or slowness becomes an error."""

    heartbeat_s: float = 0.5
    # A peer silent this long is dead: three missed heartbeats.
    dead_after_s: float = 1.5
    # A request with no progress this long fails (or is retried) instead of hanging.
    request_timeout_s: float = 60.0
    # Longest a request may take in all, however it progresses (a client's `timeout_s` may shorten it).
    request_deadline_s: float = 3600.0
    # A decode node waits this long for a prefill instance's KV handoff.
    kv_timeout_s: float = 10.0
    # A scheduler or engine whose upstream has been silent this long exits.
    orphan_after_s: float = 60.0
    # A draining scheduler gives in-flight requests this long before leaving anyway.
    drain_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_s < self.dead_after_s:
            raise CoralError(f"{self.heartbeat_s=} must be positive and below {self.dead_after_s=}.",
                             "let several heartbeats fit before a peer is declared dead")


def parse_layers(text: str) -> tuple[int, int]:
    """`"3:8"` -> (3, 8)."""
    try:
        start, end = (int(x) for x in text.split(":"))
    except ValueError:
        raise CoralError(f"layer range {text!r} is not start:end.", "pass e.g. --layers 3:8") from None
    return start, end


@dataclass(frozen=True)
class CoordinatorConfig:
    """The router: ZeroMQ endpoint for schedulers and clients, HTTP front door, retry policy."""

    listen: str = "tcp://127.0.0.1:5555"
    http_host: str = "127.0.0.1"
    http_port: int | None = 8000
    models: tuple[str, ...] = ()
    max_retries: int = 1
    # Clients must send `Authorization: Bearer <api_key>` when set (OpenAI clients' `api_key`).
    api_key: str | None = None
    timing: Timing = field(default_factory=Timing)
    # Requests/s admitted per model (a plan under scarcity); the rest are shed with 429 (`routing.Admission`).
    admit_req_s: dict[str, float] = field(default_factory=dict)
    # Token-bucket depth (requests) per admitted model, the plan's `admit_depth_req` (10 s of the rate if absent).
    admit_depth_req: dict[str, float] = field(default_factory=dict)
    # The second bucket per admitted model (request rate the plan's capacity carries, depth), the plan's `admit_peak`.
    admit_peak: dict[str, tuple[float, float]] = field(default_factory=dict)
    # The share of the requests it sends each model is admitted (the plan's promise), counted per request by the
    # first bucket instead of refilling it at `admit_req_s`; credit it cannot use is saved up to the depth.
    admit_share: dict[str, float] = field(default_factory=dict)
    # An HTTP request's line, headers and body must arrive within this; bodies are refused past the size.
    http_read_timeout_s: float = 10.0
    http_max_body_bytes: int = 4 << 20
    # PEM certificate chain and private key: the front door serves HTTPS when both are set.
    http_tls_certfile: str | None = None
    http_tls_keyfile: str | None = None
    # CORS as vLLM's --allowed-origins/--allowed-methods/--allowed-headers (no origin: off).
    http_allowed_origins: tuple[str, ...] = ()
    http_allowed_methods: tuple[str, ...] = ("*",)
    http_allowed_headers: tuple[str, ...] = ("*",)


@dataclass(frozen=True)
class SchedulerConfig:
    """One serving instance: its model, phase, layer split and the throughput the router weighs it by."""

    instance: str
    model: str
    phase: str
    split: tuple[int, ...]
    n_layers: int
    coordinator: str
    listen: str = "tcp://127.0.0.1:5600"
    tokens_per_s: float = 1.0
    timing: Timing = field(default_factory=Timing)
    region: str = "local"
    route_weight: float = 0.0  # the plan's routing weight (`coral_dagster.routing.instance_weight`); 0: tokens_per_s
    # What requests may ask of the model; the coordinator rejects others before they reach an engine.
    limits: ModelLimits | None = None

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise CoralError(f"unknown phase {self.phase!r}.", f"use one of: {', '.join(PHASES)}")
        if sum(self.split) != self.n_layers:
            raise CoralError(f"{sum(self.split)=} does not match {self.n_layers=} of {self.model}.",
                             "make the layer split add up to the model's layers")
        if self.tokens_per_s <= 0:
            raise CoralError(f"{self.tokens_per_s=} must be positive.", "pass the template's throughput")


@dataclass(frozen=True)
class NodeSettings:
    """One engine node: the layers it holds, its stage, its share of the stage, where it listens."""

    node: str
    model: str
    start: int
    end: int
    n_layers: int
    stage: int
    scheduler: str
    listen: str = "tcp://127.0.0.1:*"
    advertise: str = ""
    share: float = 1.0
    engine: str = "torch"
    split: tuple[int, ...] = ()
    tp: int = 1
    max_batch: int = 64
    timing: Timing = field(default_factory=Timing)

    def __post_init__(self) -> None:
        validate_layers(self.start, self.end, self.n_layers)
        if self.share <= 0:
            raise CoralError(f"{self.share=} must be positive.", "pass the node's share of its stage's load")


AdmitLimits = tuple[dict[str, float], dict[str, float], dict[str, tuple[float, float]], dict[str, float]]
ADMIT_FORMAT = "model=rate[:depth[:peak_rate:peak_depth]][@share]"


def _admit_entry(part: str) -> tuple[str, list[float], float | None]:
    """One `--admit` entry as its model, numbers (rate, depth, peak rate, peak depth as given) and share."""
    model, sep, value = part.partition("=")
    value, at, share_text = value.partition("@")
    try:
        numbers = [float(x) for x in value.split(":")]
        share = float(share_text) if at else None
    except ValueError:
        numbers, share = [math.nan], None
    if (not sep or not model.strip() or len(numbers) not in (1, 2, 4)
            or not all(math.isfinite(x) and x >= 0 for x in numbers)
            or (share is not None and not 0.0 <= share <= 1.0)):
        raise CoralError(f"admission entry {part!r} is not {ADMIT_FORMAT}.",
                         "write e.g. --admit phi-4=4.5:800:20:9@0.54,qwen3-32b=2 (requests/s and bucket depths in "
                         "requests, finite, >= 0; the share admitted of the requests sent, from 0 to 1)")
    return model.strip(), numbers, share


def parse_admit(text: str) -> AdmitLimits:
    """`model=rate[:depth[:peak_rate:peak_depth]][@share],…` (requests/s admitted per model, its bucket depth in
    requests, the second bucket's rate and depth, the share of the requests it sends that it is admitted) as rates,
    depths, peaks and shares; without `@share` the first bucket refills at the rate; empty text admits everything."""
    rates: dict[str, float] = {}
    depths: dict[str, float] = {}
    peaks: dict[str, tuple[float, float]] = {}
    shares: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, numbers, share = _admit_entry(part)
        rates[name] = numbers[0]
        if len(numbers) > 1:
            depths[name] = numbers[1]
        if len(numbers) > 2:
            peaks[name] = (numbers[2], numbers[3])
        if share is not None:
            shares[name] = share
    return rates, depths, peaks, shares


def format_admit(rates: Mapping[str, float], depths: Mapping[str, float],
                 peaks: Mapping[str, tuple[float, float]], shares: Mapping[str, float] | None = None) -> str:
    """The `--admit` text `parse_admit` reads back, per model sorted (a peak only beside a depth)."""
    def entry(m: str) -> str:
        rest = [depths[m], *peaks.get(m, ())] if m in depths else []
        share = f"@{float(shares[m])!r}" if shares and m in shares else ""
        return f"{m}=" + ":".join(repr(float(x)) for x in [rates[m], *rest]) + share
    return ",".join(entry(m) for m in sorted(rates))
