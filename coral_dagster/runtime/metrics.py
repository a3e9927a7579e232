"""The front door's Prometheus metrics (`GET /metrics`): requests, tokens, TTFT and TPOT, queue depth, shed requests.

Names follow vLLM's (`vllm:time_to_first_token_seconds` …) under the `coral_` prefix; each front door has a
registry of its own, so several in one process (tests) do not share counts.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# vLLM's TTFT and per-output-token buckets (vllm/v1/metrics/loggers.py), in seconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    """Counters and histograms the front door updates per request; `queue_depth` is set from the coordinator's
    status at each scrape."""

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
        self.running = Gauge("coral_requests_running", "Requests this front door is answering now", registry=r)
        self.shed = Counter("coral_requests_shed", "Requests refused for capacity (429 rate limit, 503 unavailable "
                            "or shutting down)", ["status"], registry=r)
        self.cancelled = Counter("coral_requests_cancelled", "Requests whose client went away before the end",
                                 registry=r)
        self.queue_depth = Gauge("coral_queue_depth", "Requests the coordinator holds, in flight on its instances",
                                 registry=r)

    def answered(self, route: str, status: int) -> None:
        self.requests.labels(route, str(status)).inc()
        if status in (429, 503):
            self.shed.labels(str(status)).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
