"""A served stack for the OpenAI API tests: a coordinator with its front door, one instance of two real torch
engine stages (counting the steps they run per request), and the official client pointed at it."""

from __future__ import annotations

import threading
import time
from contextlib import ExitStack

import httpx
import openai
import zmq
from prometheus_client.parser import text_string_to_metric_families

from coral_dagster.runtime.config import CoordinatorConfig, NodeSettings, SchedulerConfig, Timing
from coral_dagster.runtime.coordinator import Coordinator
from coral_dagster.runtime.limits import ModelLimits
from coral_dagster.runtime.local import free_port
from coral_dagster.runtime.node import EngineNode
from coral_dagster.runtime.scheduler import Scheduler
from coral_dagster.runtime.security import CurveKeys
from coral_dagster.runtime.tiny import decoder_config
from coral_dagster.runtime.torch_engine import TorchEngine
from support.runtime_fakes import background

MODEL = "tiny-llama"
CFG = decoder_config(MODEL)
TIMING = Timing(heartbeat_s=0.1, dead_after_s=2.0, request_timeout_s=30.0)
KEY = "openai-test-key"
PROMPT = "The coral reef"


def scrape(url: str) -> dict:
    """A front door's /metrics: each sample's value by (name, sorted labels)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


class CountingEngine(TorchEngine):
    """The torch engine, counting the forward steps it runs per request (to see generation stop); while `frozen`,
    steps after a request's first (its prompt) wait as for a KV handoff, so the caches hold just the prompts."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.steps: dict[str, int] = {}
        self.last_step = time.monotonic()
        self.frozen = False

    def cache_length(self, rid):
        have = super().cache_length(rid)
        return None if self.frozen and have else have

    def forward(self, steps):
        for s in steps:
            self.steps[s.rid] = self.steps.get(s.rid, 0) + 1
        self.last_step = time.monotonic()
        return super().forward(steps)


class Served:
    """A coordinator (HTTP on), one instance of two torch stages (with `pd`, a prefill and a decode instance that
    hands its KV over); `last` is the last stage's engine. Each stage's KV capacity is `kv_capacity_tokens`
    (default: from memory)."""

    def __init__(self, stack: ExitStack, read_timeout_s: float = 10.0, kv_capacity_tokens: int | None = None,
                 pd: bool = False) -> None:
        keys = CurveKeys.generate()
        self.port = free_port()
        ctx = zmq.Context()
        stack.callback(ctx.term)
        self.coord = Coordinator(CoordinatorConfig(listen="tcp://127.0.0.1:*", http_port=self.port, api_key=KEY,
                                                   timing=TIMING, models=(MODEL,), http_read_timeout_s=read_timeout_s),
                                 keys, ctx=ctx)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.coord.run, args=(self.stop,), daemon=True)
        self.thread.start()
        stack.callback(lambda: (self.stop.set(), self.thread.join(timeout=20)))
        self.engines: list[CountingEngine] = []
        for name, phase in ((("p0", "prefill"), ("d0", "decode")) if pd else (("i0", "aggregated"),)):
            sched = Scheduler(SchedulerConfig(name, MODEL, phase, (6, 6), CFG.n_layers, self.coord.address,
                                              listen="tcp://127.0.0.1:*", timing=TIMING,
                                              limits=ModelLimits(CFG.vocab, CFG.max_context)), keys, ctx=zmq.Context())
            background(stack, sched.run)
            for stage, (start, end) in enumerate(((0, 6), (6, 12))):
                engine = CountingEngine(CFG, start, end, device="cpu", kv_capacity_tokens=kv_capacity_tokens)
                node = EngineNode(NodeSettings(f"{name}.s{stage}", MODEL, start, end, CFG.n_layers, stage,
                                               sched.address, timing=TIMING), engine, keys, ctx=zmq.Context())
                background(stack, node.run)
                self.engines.append(engine)
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=KEY, max_retries=0, timeout=120)
        deadline = time.monotonic() + 60
        while httpx.get(f"{self.url}/health").status_code != 200:
            assert time.monotonic() < deadline, "the instance never became ready"
            time.sleep(0.1)

    @property
    def last(self) -> CountingEngine:
        return self.engines[-1]
