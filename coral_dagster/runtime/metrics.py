"""The front door's Prometheus metrics (`GET /metrics`): Coral's own `coral_*` families (requests, tokens, TTFT and
TPOT, queue depth, shed requests) and, beside them, vLLM's `vllm:*` families under vLLM's names, `model_name` label
and buckets, so a vLLM dashboard or autoscaler reads a Coral endpoint unchanged.

Each front door has a registry of its own, so several in one process (tests) do not share counts.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# vLLM's TTFT and per-output-token buckets (vllm/v1/metrics/loggers.py), in seconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
# vLLM's end-to-end request latency buckets (vllm/v1/metrics/loggers.py `request_latency_buckets`), in seconds.
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class VllmMetrics:
    """vLLM's families (`vllm:`), labelled `model_name`. Running: requests the model's instances hold now (the
    coordinator's count); waiting: those this front door has submitted that no instance holds yet (queued or being
    retried at the coordinator). Finished reasons are vLLM's: stop, length, abort (the client went away). KV-cache
    usage: the tokens of KV the model's instances hold over those they can hold (each instance's fullest stage, as
    its engine nodes report them), 0..1 as vLLM reports it."""

    def __init__(self, r: CollectorRegistry) -> None:
        m = ["model_name"]
        self.running = Gauge("vllm:num_requests_running", "Requests on the model's instances now", m, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests submitted and held before any instance", m,
                             registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Time from arrival to a choice's last token", m,
                             buckets=E2E_BUCKETS, registry=r)
        self.success = Counter("vllm:request_success", "Choices finished, by reason", [*m, "finished_reason"],
                               registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time from arrival to a choice's first token", m,
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between consecutive tokens of a choice", m,
                             buckets=TPOT_BUCKETS, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of admitted requests", m, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated", m, registry=r)
        self.kv_cache_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", m,
                                    registry=r)

    def set_load(self, on_instances: dict[str, int], submitted: dict[str, int],
                 kv_tokens: dict[str, tuple[int, int]]) -> None:
        """At a scrape: requests per model on its instances, those this door has open (on an instance or not), and
        the KV tokens its instances hold and can hold."""
        for model in set(on_instances) | set(submitted):
            # Every series a dashboard reads exists from the first scrape, at 0, as vLLM registers them.
            for reason in ("stop", "length", "abort"):
                self.success.labels(model, reason)
            for family in (self.e2e, self.ttft, self.itl, self.prompt_tokens, self.generation_tokens):
                family.labels(model)
            running = on_instances.get(model, 0)
            self.running.labels(model).set(running)
            self.waiting.labels(model).set(max(0, submitted.get(model, 0) - running))
            used, capacity = kv_tokens.get(model, (0, 0))
            self.kv_cache_usage.labels(model).set(used / capacity if capacity else 0.0)


class Metrics:
    """Counters and histograms the front door updates per request; `queue_depth` and `queued` are set from the
    coordinator's status at each scrape."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("coral_requests", "HTTP requests answered, by route and status", ["route", "status"],
                                registry=r)
        self.prompt_tokens = Counter("coral_prompt_tokens", "Prompt tokens of admitted requests", ["model"],
                                     registry=r)
        self.generation_tokens = Counter("coral_generation_tokens", "Tokens generated", ["model"], registry=r)
        self.ttft = Histogram("coral_time_to_first_token_seconds", "Time from a request's arrival to its first token",
                              ["model"], buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("coral_time_per_output_token_seconds", "Time between consecutive tokens of a choice",
                              ["model"], buckets=TPOT_BUCKETS, registry=r)
        self.running = Gauge("coral_requests_running", "Requests this front door is answering now (scrapes of "
                             "/metrics not counted)", registry=r)
        self.shed = Counter("coral_requests_shed", "Requests refused for capacity (429 rate limit, 503 unavailable "
                            "or shutting down)", ["status"], registry=r)
        self.cancelled = Counter("coral_requests_cancelled", "Requests whose client went away before the end",
                                 registry=r)
        self.queue_depth = Gauge("coral_queue_depth", "Requests the coordinator holds, in flight on its instances",
                                 registry=r)
        self.queued = Gauge("coral_requests_queued", "Requests the coordinator holds until an instance has room for "
                            "their prompts' prefill (counted in coral_queue_depth too)", registry=r)
        self.vllm = VllmMetrics(r)

    def answered(self, route: str, status: int) -> None:
        self.requests.labels(route, str(status)).inc()
        if status in (429, 503):
            self.shed.labels(str(status)).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
