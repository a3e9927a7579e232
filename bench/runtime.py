"""Runtime benchmark: per-hop latency and bandwidth of the activation path, copy ceilings, router requests/s."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import statistics
import threading
import time
from pathlib import Path

import numpy as np
import zmq
from rich.console import Console
from rich.table import Table

from coral_dagster.catalog.models import model_catalog
from coral_dagster.runtime import wire
from coral_dagster.runtime.client import Client
from coral_dagster.runtime.config import CoordinatorConfig, Timing
from coral_dagster.runtime.coordinator import Coordinator
from coral_dagster.runtime.security import CurveKeys, Security

RESULTS = Path(__file__).parent / "results" / "runtime.json"
TOKENS = (1, 32, 512)  # one decode token, a decode batch, a prefill chunk
MIN_TIME_S, MAX_ROUNDS = 0.6, 1000
# The machine is shared: ceilings and router rate are the best of a few repeats, hops the median of many.
REPEATS = 3
ROUTER_REQUESTS, ROUTER_WINDOW = 3000, 64
LOOPBACK_BYTES, LOOPBACK_CHUNK = 256 << 20, 1 << 20


def _echo(conn, secret: str | None) -> None:
    """Peer process: receive each activation message, parse it as an engine node would, send it straight back."""
    ctx = zmq.Context()
    sec = Security(ctx, CurveKeys.from_secret(secret) if secret else None)
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    conn.send(sec.bind(pull, "tcp://127.0.0.1:*"))
    sec.connect(push, conn.recv())
    while True:
        pull.poll()
        for _, header, arrays in wire.drain(pull):
            if header["kind"] == "stop":
                conn.send("stopped")
                return
            wire.send(push, header, arrays, block=True)


def _recv_one(sock: zmq.Socket) -> tuple:
    """Block for one message (a poll can wake for CURVE handshake traffic with nothing to read)."""
    while True:
        sock.poll()
        for msg in wire.drain(sock, limit=1):
            return msg


def _hops(secret: str | None, cases: list[tuple[int, int]]) -> list[dict]:
    """Round trips of bf16 activations `[tokens, hidden]` to a peer process; one hop is half a round trip."""
    ctx = zmq.Context()
    sec = Security(ctx, CurveKeys.from_secret(secret) if secret else None)
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    parent, child = mp.Pipe()
    peer = mp.get_context("spawn").Process(target=_echo, args=(child, secret), daemon=True)
    peer.start()
    try:
        sec.connect(push, parent.recv())
        parent.send(sec.bind(pull, "tcp://127.0.0.1:*"))
        rows = []
        for hidden, tokens in cases:
            act = np.random.default_rng(0).integers(0, 1 << 16, size=(tokens, hidden), dtype=np.uint16)
            header = {"kind": "forward", "rid": "bench", "pos": 0, "stage": 1, "route": ["a", "b"], "handoff": None}
            times = []
            start = time.perf_counter()
            while len(times) < MAX_ROUNDS and (len(times) < 5 or time.perf_counter() - start < MIN_TIME_S):
                t0 = time.perf_counter()
                wire.send(push, header, [act], block=True)
                _, _, (back,) = _recv_one(pull)
                times.append(time.perf_counter() - t0)
            assert back.shape == act.shape
            hop_s = statistics.median(times[2:]) / 2
            rows.append({"hidden": hidden, "tokens": tokens, "bytes": act.nbytes, "curve": secret is not None,
                         "hop_ms": hop_s * 1e3, "gb_s": act.nbytes / hop_s / 1e9, "rounds": len(times)})
        wire.send(push, {"kind": "stop"}, block=True)
        parent.recv()
        return rows
    finally:
        peer.join(timeout=5)
        if peer.is_alive():
            peer.kill()
        push.close(linger=0)
        pull.close(linger=0)
        sec.close()
        ctx.term()


def _copy_gb_s(nbytes: int) -> float:
    """In-process copy of an activation buffer (what handing a tensor to the next layer locally costs)."""
    src = np.ones(nbytes // 2, dtype=np.uint16)
    dst = np.empty_like(src)
    reps = max(3, min(2000, (64 << 20) // nbytes))
    best = float("inf")
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        for _ in range(reps):
            np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return nbytes * reps / best / 1e9


def _sink(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as s:
        buf = bytearray(LOOPBACK_CHUNK)
        got = 0
        while got < LOOPBACK_BYTES:
            got += s.recv_into(buf)
        s.sendall(b"k")


def _loopback_gb_s() -> float:
    """Raw TCP throughput between two processes over loopback: the ceiling for any framing on top."""
    server = socket.create_server(("127.0.0.1", 0))
    peer = mp.get_context("spawn").Process(target=_sink, args=(server.getsockname()[1],), daemon=True)
    peer.start()
    conn, _ = server.accept()
    chunk = b"\x01" * LOOPBACK_CHUNK
    t0 = time.perf_counter()
    for _ in range(LOOPBACK_BYTES // LOOPBACK_CHUNK):
        conn.sendall(chunk)
    conn.recv(1)
    elapsed = time.perf_counter() - t0
    conn.close()
    server.close()
    peer.join(timeout=5)
    return LOOPBACK_BYTES / elapsed / 1e9


def _coordinator(conn) -> None:
    coord = Coordinator(CoordinatorConfig(listen="tcp://127.0.0.1:*", http_port=None,
                                          timing=Timing(heartbeat_s=0.5, dead_after_s=5.0)))
    conn.send(coord.address)
    stop = threading.Event()
    threading.Thread(target=lambda: conn.recv() and stop.set(), daemon=True).start()
    coord.run(stop)


def _instant_instances(address: str, names: list[str], stop: threading.Event) -> None:
    """Schedulers whose instances answer every request with one token at once: only routing costs time."""
    ctx = zmq.Context()
    socks = {}
    for name in names:
        s = ctx.socket(zmq.DEALER)
        s.linger = 0
        s.connect(address)
        wire.send(s, {"kind": "register", "instance": name, "model": "m", "phase": "aggregated",
                      "tokens_per_s": 1.0, "stages": []}, block=True)
        socks[s] = name
    poller = zmq.Poller()
    for s in socks:
        poller.register(s, zmq.POLLIN)
    beat = 0.0
    while not stop.is_set():
        if time.monotonic() - beat > 0.2:
            beat = time.monotonic()
            for s, name in socks.items():
                wire.send(s, {"kind": "heartbeat", "instance": name, "healthy": True})
        for s, _ in poller.poll(50):
            for _, h, _ in wire.drain(s):
                if h["kind"] == "generate":
                    wire.send(s, {"kind": "token", "instance": socks[s], "rid": h["rid"], "token": 65}, block=True)
                    wire.send(s, {"kind": "done", "instance": socks[s], "rid": h["rid"], "finish_reason": "length"},
                              block=True)
    for s in socks:
        s.close()
    ctx.term()


def _router() -> dict:
    """Requests per second through the coordinator (own process) with a window of requests outstanding."""
    parent, child = mp.Pipe()
    proc = mp.get_context("spawn").Process(target=_coordinator, args=(child,), daemon=True)
    proc.start()
    address = parent.recv()
    stop = threading.Event()
    names = ["i0", "i1", "i2", "i3"]
    instances = threading.Thread(target=_instant_instances, args=(address, names, stop), daemon=True)
    instances.start()
    try:
        with Client(address, timeout_s=30) as c:
            c.wait_ready(len(names), timeout_s=30)
            sent = finished = 0
            t0 = time.perf_counter()
            while finished < ROUTER_REQUESTS:
                while sent < ROUTER_REQUESTS and sent - finished < ROUTER_WINDOW:
                    c.submit("m", prompt_tokens=[1, 2, 3], max_tokens=1)
                    sent += 1
                if c.next_event()["kind"] in ("done", "error"):
                    finished += 1
            elapsed = time.perf_counter() - t0
            counts = c.status()["counts"]
    finally:
        stop.set()
        parent.send("stop")
        instances.join(timeout=5)
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
    return {"requests": ROUTER_REQUESTS, "window": ROUTER_WINDOW, "instances": len(names),
            "requests_per_s": ROUTER_REQUESTS / elapsed, "completed": counts["completed"]}


def main() -> dict:
    by_hidden: dict[int, list[str]] = {}
    for m in model_catalog().values():
        by_hidden.setdefault(m.hidden, []).append(m.alias)
    cases = [(h, t) for h in sorted(by_hidden) for t in TOKENS]
    biggest = max(by_hidden)
    console = Console(width=160)
    with console.status("activation hops (plain)"):
        hops = _hops(None, cases)
    with console.status("activation hops (CURVE)"):
        hops += _hops(CurveKeys.generate().secret.decode(), [(biggest, t) for t in TOKENS])
    with console.status("copy ceilings"):
        copy = {row["bytes"]: _copy_gb_s(row["bytes"]) for row in hops}
        loopback = max(_loopback_gb_s() for _ in range(REPEATS))
    with console.status("router"):
        router = max((_router() for _ in range(REPEATS)), key=lambda r: r["requests_per_s"])
    for row in hops:
        row["models"] = by_hidden[row["hidden"]]
        row["inprocess_copy_gb_s"] = copy[row["bytes"]]
    result = {"cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0], "dtype": "bfloat16 (2 bytes)",
              "activation_hops": hops, "loopback_tcp_gb_s": loopback, "router": router}

    table = Table(title="Activation path: one hop between engine processes over ZeroMQ on loopback")
    for col in ("hidden", "models", "tokens", "KiB", "CURVE", "hop ms", "GB/s", "in-process copy GB/s"):
        table.add_column(col, justify="left" if col == "models" else "right")
    for r in hops:
        table.add_row(str(r["hidden"]), ", ".join(r["models"]), str(r["tokens"]), f"{r['bytes'] / 1024:,.0f}",
                      "yes" if r["curve"] else "no", f"{r['hop_ms']:.3f}", f"{r['gb_s']:.2f}",
                      f"{r['inprocess_copy_gb_s']:.1f}")
    console.print(table)
    console.print(f"raw TCP loopback between processes: {loopback:.2f} GB/s")
    console.print(f"router: {router['requests_per_s']:,.0f} requests/s ({router['requests']} requests, "
                  f"{router['window']} outstanding, {router['instances']} instant instances)")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2))
    console.print(f"wrote {RESULTS}")
    return result


if __name__ == "__main__":
    main()
