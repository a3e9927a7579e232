"""vLLM's metric families beside Coral's, scraped from a real served stack: names, `model_name` label and buckets as
vLLM's source publishes them (vllm/v1/metrics/loggers.py), values against what the client itself saw (requests it
sent, how they finished, its own wall-clock), a scrape that does not count itself, and the KV-cache gauge against
the prompts the client sent (their tokens over the capacity the stages were given)."""

from __future__ import annotations

import threading
import time
from contextlib import ExitStack

import pytest

from coral_dagster.runtime.tokenizer import ByteTokenizer

pytest.importorskip("coral_dagster.runtime.torch_engine")
from support.openai_stack import MODEL, PROMPT, Served, scrape  # noqa: E402 - needs torch

# vLLM 0.32's request_latency_buckets, copied from its source (the oracle a Grafana dashboard was built against).
VLLM_E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                    480.0, 960.0, 1920.0, 7680.0]


@pytest.fixture(scope="module")
def served():
    with ExitStack() as stack:
        yield Served(stack)


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


# Each stage's KV capacity in the KV-gauge test: positions it may cache (as vLLM's --num-gpu-blocks-override sets it).
KV_CAPACITY_TOKENS = 1000


def _kv_gauge(url: str) -> float:
    return scrape(url)[("vllm:kv_cache_usage_perc", (("model_name", MODEL),))]


def _settles_at(url: str, want: float, what: str) -> None:
    deadline = time.monotonic() + 30
    while (got := _kv_gauge(url)) != pytest.approx(want, abs=1e-12):
        assert time.monotonic() < deadline, f"{what}: vllm:kv_cache_usage_perc is {got}, not {want}"
        time.sleep(0.05)


def test_kv_cache_usage_is_the_held_prompts_over_the_capacity():
    prompts = ["a" * 10, "reef " * 9, "b" * 101]
    with ExitStack() as stack:
        held = Served(stack, kv_capacity_tokens=KV_CAPACITY_TOKENS)
        _settles_at(held.url, 0.0, "idle")
        for engine in held.engines:
            engine.frozen = True
        firsts = [threading.Event() for _ in prompts]
        done = [threading.Event() for _ in prompts]

        def read(i: int) -> None:
            stream = held.client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=3, stream=True,
                                                    extra_body={"ignore_eos": True})
            for _ in stream:
                firsts[i].set()
            done[i].set()

        readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(len(prompts))]
        for r in readers:
            r.start()
        assert all(f.wait(30) for f in firsts), "a prompt was never prefilled"
        # Every prompt is cached on both stages (with BOS), no generated token yet: the fullest stage holds them all.
        tokens = sum(len(ByteTokenizer().encode(p)) for p in prompts)
        _settles_at(held.url, tokens / KV_CAPACITY_TOKENS, "three prompts held")
        for engine in held.engines:
            engine.frozen = False
        assert all(d.wait(30) for d in done), "a request never finished after the release"
        for r in readers:
            r.join(timeout=10)
        _settles_at(held.url, 0.0, "every request finished")


def test_the_torch_engines_kv_capacity_is_its_free_memory_over_the_memory_models_token_bytes():
    """Without a given capacity, a torch stage's is 90% of the RAM free at start over its layers' KV bytes per
    token, those bytes as the catalog's memory model counts them for the same architecture."""
    import os
    from dataclasses import replace

    from coral_dagster.catalog.models import get_model
    from coral_dagster.runtime.tiny import decoder_config
    from coral_dagster.runtime.torch_engine import TorchEngine

    cfg = decoder_config(MODEL)
    free_before = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    engine = TorchEngine(cfg, 0, 6, device="cpu")
    free_after = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    spec = replace(get_model(cfg.base), n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, dtype=cfg.dtype)
    per_token = 6 * spec.kv_bytes_per_token_per_layer
    assert engine.kv_bytes_per_token() == per_token
    # Free memory moves with the machine's other work: the capacity lies between what it was around the build.
    low, high = sorted((free_before, free_after))
    assert 0.9 * low // per_token * 0.95 <= engine.kv_usage()[1] <= 0.9 * high // per_token * 1.05
    assert engine.kv_usage()[0] == 0
