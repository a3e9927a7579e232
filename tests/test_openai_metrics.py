"""vLLM's metric families beside Coral's, scraped from a real served stack: names, `model_name` label and buckets as
vLLM's source publishes them (vllm/v1/metrics/loggers.py), values against what the client itself saw (requests it
sent, how they finished, its own wall-clock), and a scrape that does not count itself."""

from __future__ import annotations

import threading
import time
from contextlib import ExitStack

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from coral_dagster.runtime.tokenizer import ByteTokenizer

pytest.importorskip("coral_dagster.runtime.torch_engine")
from support.openai_stack import MODEL, PROMPT, Served  # noqa: E402 - needs torch

# vLLM 0.32's request_latency_buckets, copied from its source (the oracle a Grafana dashboard was built against).
VLLM_E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                    480.0, 960.0, 1920.0, 7680.0]


@pytest.fixture(scope="module")
def served():
    with ExitStack() as stack:
        yield Served(stack)


def scrape(url: str) -> dict:
    text = httpx.get(f"{url}/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_vllm_families_count_what_the_client_saw(served):
    before = scrape(served.url)
    started = time.monotonic()
    served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, extra_body={"ignore_eos": True})
    full = served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                            extra_body={"ignore_eos": True}).choices[0].text
    served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, stop=[full[3:5]],
                                     extra_body={"ignore_eos": True})
    client_s = time.monotonic() - started
    stream = served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3000, stream=True,
                                              extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()
    deadline = time.monotonic() + 30
    while scrape(served.url).get(("vllm:request_success_total",
                                  (("finished_reason", "abort"), ("model_name", MODEL))), 0) < 1:
        assert time.monotonic() < deadline, "the hung-up stream was never counted as aborted"
        time.sleep(0.1)
    after = scrape(served.url)

    def grew(name: str, **labels) -> float:
        key = (name, tuple(sorted({"model_name": MODEL, **labels}.items())))
        return after.get(key, 0) - before.get(key, 0)

    assert grew("vllm:request_success_total", finished_reason="length") == 2
    assert grew("vllm:request_success_total", finished_reason="stop") == 1
    assert grew("vllm:request_success_total", finished_reason="abort") == 1
    assert grew("vllm:e2e_request_latency_seconds_count") == 3
    # Latency the server measured fits inside the wall-clock the client measured around the same three requests.
    assert 0 < grew("vllm:e2e_request_latency_seconds_sum") <= client_s
    buckets = sorted(float(dict(k[1])["le"]) for k in after
                     if k[0] == "vllm:e2e_request_latency_seconds_bucket" and dict(k[1])["le"] != "+Inf")
    assert buckets == VLLM_E2E_BUCKETS
    assert grew("vllm:generation_tokens_total") >= 6 + 12 + 1
    assert grew("vllm:time_to_first_token_seconds_count") == 4
    assert grew("vllm:prompt_tokens_total") == 4 * len(ByteTokenizer().encode(PROMPT))
    assert after[("vllm:num_requests_running", (("model_name", MODEL),))] == 0
    assert after[("vllm:num_requests_waiting", (("model_name", MODEL),))] == 0


def test_running_gauges_see_a_request_in_flight_and_not_the_scrape(served):
    assert scrape(served.url)[("coral_requests_running", ())] == 0
    release = threading.Event()
    got_first = threading.Event()

    def slow_reader():
        stream = served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3000, stream=True,
                                                  extra_body={"ignore_eos": True})
        for _ in stream:
            got_first.set()
            if release.is_set():
                break
        stream.close()

    reader = threading.Thread(target=slow_reader, daemon=True)
    reader.start()
    try:
        assert got_first.wait(30)
        during = scrape(served.url)
    finally:
        release.set()
        reader.join(timeout=30)
    assert during[("coral_requests_running", ())] == 1
    assert during[("vllm:num_requests_running", (("model_name", MODEL),))] == 1
    assert during[("vllm:num_requests_waiting", (("model_name", MODEL),))] == 0
    deadline = time.monotonic() + 30
    while (after := scrape(served.url))[("vllm:num_requests_running", (("model_name", MODEL),))] != 0:
        assert time.monotonic() < deadline, "the cancelled request still counts as running"
        time.sleep(0.1)
    assert after[("coral_requests_running", ())] == 0
