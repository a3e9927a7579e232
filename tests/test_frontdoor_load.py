"""Load on `coral serve local` (tiny model, torch engine): 256 concurrent streaming clients, a third of them hanging
up mid-stream. No connection is reset, every stream that stays ends complete, the abandoned generations stop, and
stopping the deployment leaves no process behind. About 10 s here, so it stays in the default tier."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from coral_dagster.runtime.config import Timing
from coral_dagster.runtime.local import LocalDeployment, local_instances
from support.runtime_procs import descendants, gone, kill_all
from support.openai_stack import scrape


MODEL = "tiny-llama"
CLIENTS = 256
TOKENS = 24
# What a client that hangs up asks for: generations not stopped would run for minutes.
ABANDONED_TOKENS = 2000
HANG_UP_AFTER = 3


async def _client(c: httpx.AsyncClient, url: str, key: str, i: int) -> dict:
    leaves = i % 3 == 0
    body = {"model": MODEL, "prompt": f"client {i} asks", "stream": True, "ignore_eos": True,
            "max_tokens": ABANDONED_TOKENS if leaves else TOKENS}
    chunks = []
    async with c.stream("POST", f"{url}/v1/completions", json=body,
                        headers={"Authorization": f"Bearer {key}"}) as r:
        async for line in r.aiter_lines():
            if not line:
                continue
            chunks.append(line)
            if leaves and len(chunks) >= HANG_UP_AFTER:
                break
        return {"status": r.status_code, "left": leaves, "chunks": chunks}


async def _load(url: str, key: str) -> list:
    limits = httpx.Limits(max_connections=CLIENTS + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=60.0), limits=limits) as c:
        return await asyncio.gather(*(_client(c, url, key, i) for i in range(CLIENTS)), return_exceptions=True)


def _generated(url: str) -> float:
    return sum(v for (name, _), v in scrape(url).items() if name == "coral_generation_tokens_total")


def test_256_streaming_clients_a_third_hanging_up():
    dep = LocalDeployment(MODEL, local_instances((12,), 2),
                          timing=Timing(heartbeat_s=0.2, dead_after_s=10.0, request_timeout_s=120.0))
    pids: set[int] = set()
    try:
        dep.start()
        dep.wait_ready(120)
        pids = {p.pid for p in dep.procs.values()} | {d for p in dep.procs.values() for d in descendants(p.pid)}
        started = time.monotonic()
        results = asyncio.run(_load(dep.http_url, dep.api_key))
        wall = time.monotonic() - started
        errors = [r for r in results if isinstance(r, BaseException)]
        assert not errors, errors[:3]
        assert all(r["status"] == 200 for r in results)
        stayed = [r for r in results if not r["left"]]
        for r in stayed:
            events = [line.removeprefix("data: ") for line in r["chunks"]]
            assert events[-1] == "[DONE]", events[-3:]
            chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
            assert sum(len(c.get("token_ids", [])) for c in chunks) == TOKENS
            assert chunks[-1]["finish_reason"] == "length"
        # No generation is left running: the coordinator holds nothing, and the token count stops growing.
        deadline = time.monotonic() + 30
        with dep.client() as c:
            while (status := c.status())["in_flight"]:
                assert time.monotonic() < deadline, f"generations stuck after their clients hung up: {status}"
                time.sleep(0.2)
        first = _generated(dep.http_url)
        time.sleep(2.0)
        assert _generated(dep.http_url) == first
        left = len(results) - len(stayed)
        # Those that stayed generated TOKENS each; those that hung up stopped far short of their budget.
        abandoned = first - len(stayed) * TOKENS
        assert abandoned < left * ABANDONED_TOKENS / 4, (abandoned, left)
        print(f"{CLIENTS} clients ({left} hung up) in {wall:.1f} s; abandoned requests generated "
              f"{abandoned:.0f} tokens of {left * ABANDONED_TOKENS} asked")
    finally:
        dep.stop()
        deadline = time.monotonic() + 10
        while any(not gone(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        leaked = [p for p in pids if not gone(p)]
        kill_all(leaked)
        assert not leaked, f"processes left behind: {leaked}"
