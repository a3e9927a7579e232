"""The uvicorn front door: many concurrent clients, malformed and slow requests, readiness, keys, OpenAI errors."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from contextlib import ExitStack

import pytest
import zmq
from hypothesis import strategies as st

from coral_dagster.errors import CoralError
from coral_dagster.runtime.config import CoordinatorConfig, Timing
from coral_dagster.runtime.coordinator import Coordinator
from coral_dagster.runtime.frontdoor import FrontDoor, error_event
from coral_dagster.runtime.local import free_port
from coral_dagster.runtime.security import CurveKeys
from support.runtime_fakes import FakeScheduler, background

TIMING = Timing(heartbeat_s=0.1, dead_after_s=1.0, request_timeout_s=10.0)
KEY = "k3y"
READ_TIMEOUT_S = 0.5
MAX_BODY = 1 << 16



@pytest.fixture
def door():
    """A coordinator with its HTTP front door (API key set) and, once started, one fake instance."""
    keys = CurveKeys.generate()
    port = free_port()
    with ExitStack() as stack:
        ctx = zmq.Context()
        stack.callback(ctx.term)
        coord = Coordinator(CoordinatorConfig(listen="tcp://127.0.0.1:*", http_port=port, api_key=KEY, timing=TIMING,
                                              http_read_timeout_s=READ_TIMEOUT_S, http_max_body_bytes=MAX_BODY),
                            keys, ctx=ctx)
        background(stack, coord.run)
        sched = FakeScheduler(coord.address, "i0", keys, limits={"vocab": 300, "max_context": 64})
        yield port, sched, lambda: background(stack, sched.run)


def request(port: int, method: str, path: str, body: object = None, key: str | None = KEY,
            timeout_s: float = 30.0) -> tuple[int, dict, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        conn.request(method, path, body=None if body is None else json.dumps(body), headers=headers)
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), json.loads(resp.read())
    finally:
        conn.close()


def raw(port: int, data: bytes, wait_s: float = 10.0) -> tuple[int, dict]:
    """Send bytes as they are; the status and JSON body of the answer (the server must close the connection)."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as s:
        s.sendall(data)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def _is_openai_error(body: dict, status: int) -> bool:
    e = body.get("error", {})
    return e.get("code") == status and isinstance(e.get("message"), str) and isinstance(e.get("type"), str)


def test_ready_only_when_an_instance_can_serve(door):
    port, sched, start = door
    assert request(port, "GET", "/health", key=None)[0] == 503
    status, _, body = request(port, "GET", "/v1/models")
    assert status == 503 and _is_openai_error(body, 503)
    start()
    deadline = time.monotonic() + 10
    while request(port, "GET", "/health", key=None)[0] != 200:
        assert time.monotonic() < deadline, "never became ready"
        time.sleep(0.05)
    assert [m["id"] for m in request(port, "GET", "/v1/models")[2]["data"]] == ["m"]
    assert request(port, "POST", "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 1})[0] == 200
    sched.healthy.clear()
    deadline = time.monotonic() + 10
    while request(port, "GET", "/health", key=None)[0] != 503:
        assert time.monotonic() < deadline, "still ready with its only instance unhealthy"
        time.sleep(0.05)
    assert request(port, "GET", "/v1/models")[0] == 503
    status, _, body = request(port, "POST", "/v1/completions", {"model": "m", "prompt": "hi"})
    assert status == 503 and _is_openai_error(body, 503)


def test_256_concurrent_clients_all_get_answers(door):
    port, _, start = door
    start()
    deadline = time.monotonic() + 10
    while request(port, "GET", "/health", key=None)[0] != 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    n = 256
    barrier = threading.Barrier(n)
    results: list[object] = [None] * n

    def client(i: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        try:
            # All start together; none connects early, as the door drops a connection that sends no headers within
            # its read timeout (10 s), which 256 threads starting on loaded cores can exceed.
            barrier.wait(timeout=60)
            conn.request("POST", "/v1/completions", body=json.dumps({"model": "m", "prompt": f"p{i}",
                                                                      "max_tokens": 1}),
                         headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
            resp = conn.getresponse()
            results[i] = (resp.status, json.loads(resp.read()))
        except Exception as exc:  # noqa: BLE001 - recorded and asserted on below
            results[i] = exc
        finally:
            conn.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    failures = [r for r in results if not (isinstance(r, tuple) and r[0] == 200)]
    assert not failures, failures[:3]
    assert all(r[1]["choices"][0]["text"] == "A" for r in results)


def test_malformed_slow_and_oversized_requests_get_openai_errors(door):
    port, _, start = door
    start()
    auth = f"Authorization: Bearer {KEY}\r\n".encode()
    cases = [
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + auth + b"Content-Length: abc\r\n\r\n{}", 400),
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + auth + b"Content-Length: 100\r\n\r\n{\"a\"", 408),
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + auth
         + f"Content-Length: {MAX_BODY + 1}\r\n\r\n".encode(), 413),
        # Chunked, so no Content-Length warns: the limit is found while reading, on the body's last byte.
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + auth + b"Transfer-Encoding: chunked\r\n\r\n"
         + f"{MAX_BODY + 1:x}\r\n".encode() + b" " * (MAX_BODY + 1), 413),
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", 408),
        (b"GARBAGE\r\n\r\n", 400),
        (b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + b"X-Long: " + b"a" * 70000 + b"\r\n\r\n", (400, 431)),
    ]
    for data, expected in cases:
        # Oversized headers are refused by h11 (400) when they arrive in pieces, else by the app (431).
        status, body = raw(port, data)
        assert status in (expected if isinstance(expected, tuple) else (expected,)), (data[:80], status, body)
        assert _is_openai_error(body, status), (data[:80], body)
    for method, path, body, key, expected in (
            ("POST", "/v1/completions", None, None, 401),
            ("POST", "/v1/completions", None, "wrong", 401),
            ("GET", "/admin/instances", None, None, 401),
            ("GET", "/nowhere", None, KEY, 404),
            ("GET", "/v1/completions", None, KEY, 405),
            ("POST", "/v1/completions", {"model": "m", "prompt": [True]}, KEY, 400),
            ("POST", "/v1/completions", {"model": "m", "prompt": "x", "max_tokens": True}, KEY, 400),
            ("POST", "/v1/completions", {"model": "m", "prompt": "x", "stream": "yes"}, KEY, 400),
            ("POST", "/v1/completions", {"model": "m", "prompt": [[10 ** 30]]}, KEY, 400),
            ("POST", "/v1/completions", {"model": "m", "prompt": [[300]]}, KEY, 400),
            ("POST", "/v1/completions", {"model": "m", "prompt": "x" * 64}, KEY, 400),
            ("POST", "/v1/completions", {"model": "m", "prompt": ["x"] * 65}, KEY, 400),
            ("POST", "/v1/completions", [1, 2], KEY, 400),
            ("POST", "/v1/completions", {"model": "m", "prompt": "x", "max_tokens": float("nan")}, KEY, 400)):
        status, _, reply = request(port, method, path, body, key=key)
        assert status == expected and _is_openai_error(reply, expected), (path, body, status, reply)
    deep = ("[" * 30_000 + "]" * 30_000).encode()
    assert len(deep) < MAX_BODY
    status, body = raw(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + auth
                       + f"Content-Length: {len(deep)}\r\nConnection: close\r\n\r\n".encode() + deep)
    assert status == 400 and _is_openai_error(body, 400)
    # After all that, the server still answers.
    assert request(port, "POST", "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 1})[0] == 200


def test_admin_routes_need_a_key_even_when_none_is_set():
    port = free_port()
    with ExitStack() as stack:
        ctx = zmq.Context()
        stack.callback(ctx.term)
        coord = Coordinator(CoordinatorConfig(listen="inproc://no-key", http_port=port, timing=TIMING), ctx=ctx)
        background(stack, coord.run)
        for method, path in (("GET", "/admin/instances"), ("POST", "/admin/drain")):
            status, _, body = request(port, method, path, {"instance": "x"} if method == "POST" else None, key=None)
            assert status == 403 and "--api-key" in body["error"]["message"]


def test_rate_limited_errors_become_429_with_retry_after():
    err = error_event({"kind": "error", "type": "rate_limited", "retry_after_s": 2.4, "status": 429,
                       "problem": "too many requests for m", "fix": "retry later"})
    assert err.status == 429 and dict(err.headers) == {b"retry-after": b"2"}
    assert err.body()["error"]["type"] == "rate_limit_error"
    assert error_event({"kind": "error", "status": 404, "problem": "p", "fix": "f"}).status == 404
    assert error_event({"kind": "error", "status": True, "problem": "p", "fix": "f"}).status == 500


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-10**30, 10**30) | st.floats(allow_nan=False) |
                     st.text(max_size=20), lambda kids: st.lists(kids, max_size=4) |
                     st.dictionaries(st.text(max_size=10), kids, max_size=4), max_leaves=12)
_FIELDS = st.fixed_dictionaries({}, optional={"model": _JSON | st.just("m"), "prompt": _JSON,
                                              "max_tokens": _JSON, "stream": _JSON, "temperature": _JSON,
                                              "ignore_eos": _JSON})


def test_generated_bodies_get_a_json_answer_and_never_take_the_door_down(door):
    """Hypothesis throws completion bodies of every shape at the running front door (with an instance serving):
    each gets a JSON answer — 200 for a valid request, else an OpenAI-style 4xx error — never a 500, a reset or a
    NaN; and the door still serves a valid request afterwards."""
    from hypothesis import HealthCheck, given, settings

    port, _, start = door
    start()
    for _ in range(100):
        if request(port, "GET", "/health")[0] == 200:
            break
        time.sleep(0.1)

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(_FIELDS | _JSON)
    def check(body):
        status, _, doc = request(port, "POST", "/v1/completions", body)
        assert status == 200 or 400 <= status < 500, (status, doc)
        if status != 200:
            assert set(doc["error"]) >= {"message", "type"}, doc
        assert "NaN" not in json.dumps(doc)

    check()
    status, _, doc = request(port, "POST", "/v1/completions", {"model": "m", "prompt": [1, 2, 3], "max_tokens": 2})
    assert status == 200, doc


def test_the_front_door_serves_https_with_a_certificate(tmp_path):
    """With --tls-certfile/--tls-keyfile the same API is served over HTTPS: the official client trusting the
    certificate gets answers, plain HTTP on that port gets none, and a half-given pair is refused at start."""
    import ssl
    import subprocess

    import httpx
    import openai

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    keys = CurveKeys.generate()
    port = free_port()
    with ExitStack() as stack:
        ctx = zmq.Context()
        stack.callback(ctx.term)
        coord = Coordinator(CoordinatorConfig(listen="tcp://127.0.0.1:*", http_port=port, api_key=KEY, timing=TIMING,
                                              http_tls_certfile=str(cert), http_tls_keyfile=str(key)), keys, ctx=ctx)
        background(stack, coord.run)
        background(stack, FakeScheduler(coord.address, "i0", keys).run)
        client = openai.OpenAI(base_url=f"https://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0,
                               http_client=httpx.Client(verify=ssl.create_default_context(cafile=str(cert))))
        deadline = time.monotonic() + 10
        while True:
            try:
                assert [m.id for m in client.models.list().data] == ["m"]
                break
            except openai.APIStatusError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert client.completions.create(model="m", prompt="hi", max_tokens=1).choices[0].text == "A"
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
    with pytest.raises(CoralError, match="both a certificate and its private key"):
        FrontDoor(zmq.Context.instance(), "inproc://unused", "127.0.0.1", 0, 1.0, KEY, 1.0, MAX_BODY,
                  tls=(str(cert), None))
