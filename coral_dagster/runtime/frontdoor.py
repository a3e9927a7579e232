"""The OpenAI-compatible HTTP front door on uvicorn (`/v1/models`, `/v1/completions` with SSE, `/health`, admin)."""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from http import HTTPStatus
from typing import Any

import uvicorn
import zmq
import zmq.asyncio
from uvicorn.protocols.http.h11_impl import H11Protocol

from coral_dagster.errors import CoralError
from coral_dagster.runtime import wire
from coral_dagster.runtime.client import FINAL
from coral_dagster.runtime.limits import RequestError, is_int, max_tokens_of

log = logging.getLogger(__name__)

MAX_PROMPTS = 64
MAX_HEADER_BYTES = 16 << 10

# OpenAI's error `type` for each status the front door answers with.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
               413: "invalid_request_error", 431: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
               503: "service_unavailable"}

Send = Callable[[dict[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]


class ApiError(Exception):
    """An HTTP error in OpenAI's shape."""

    def __init__(self, status: int, message: str, headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "invalid_request_error"),
                          "param": None, "code": self.status}}


def error_event(e: dict[str, Any]) -> ApiError:
    """The HTTP error for a coordinator `error` event; `type: rate_limited` becomes 429 with Retry-After."""
    message = f"{e.get('problem')} Fix: {e.get('fix')}"
    if e.get("type") == "rate_limited":
        retry = max(1, round(float(e.get("retry_after_s", 1))))
        return ApiError(429, message, ((b"retry-after", str(retry).encode()),))
    status = e.get("status")
    return ApiError(status if is_int(status) and 400 <= status < 600 else 500, message)


def parse_completion(body: Any, models: list[str]) -> dict[str, Any]:
    """Validate a `/v1/completions` body's shape; returns model, prompts (text or token lists) and options.

    Token ids, vocabulary and context are the coordinator's to check: it knows each model's limits.
    """
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    model = body.get("model") or (models[0] if len(models) == 1 else None)
    if not isinstance(model, str):
        raise ApiError(400, f"name the model; served: {', '.join(models) or 'none yet'}")
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt)):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        prompts = list(prompt)
    else:
        raise ApiError(400, "prompt must be a string, a list of strings, or token id lists")
    if len(prompts) > MAX_PROMPTS:
        raise ApiError(400, f"{len(prompts)} prompts in one request exceed {MAX_PROMPTS}; send several requests")
    temperature = body.get("temperature")
    if temperature not in (None, 0, 0.0) or isinstance(temperature, bool):
        raise ApiError(400, f"temperature={temperature}: only greedy decoding is implemented; send temperature 0")
    if body.get("n", 1) != 1 or body.get("best_of", 1) != 1:
        raise ApiError(400, "only n=1 and best_of=1 are supported")
    for flag in ("stream", "ignore_eos"):
        if not isinstance(body.get(flag, False), bool):
            raise ApiError(400, f"{flag}={body[flag]!r} must be true or false")
    try:
        max_tokens = max_tokens_of(body.get("max_tokens", 16))
    except RequestError as exc:
        raise ApiError(400, str(exc)) from None
    return {"model": model, "prompts": prompts, "max_tokens": max_tokens, "stream": body.get("stream", False),
            "ignore_eos": body.get("ignore_eos", False)}


class _Link:
    """One HTTP request's DEALER socket to the coordinator loop over inproc, awaited without blocking others."""

    def __init__(self, actx: zmq.asyncio.Context, address: str, timeout_s: float) -> None:
        self.sock = actx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.connect(address)
        self.timeout_s = timeout_s
        self._tags = itertools.count()
        self._kept: list[dict[str, Any]] = []

    def close(self) -> None:
        self.sock.close(linger=0)

    async def send(self, header: dict[str, Any]) -> str:
        tag = f"t{next(self._tags)}"
        await self.sock.send_multipart(wire.pack({**header, "tag": tag}))
        return tag

    async def next_event(self, tags: set[str]) -> dict[str, Any]:
        deadline = time.monotonic() + self.timeout_s
        while True:
            for i, event in enumerate(self._kept):
                if event.get("tag") in tags:
                    return self._kept.pop(i)
            left = deadline - time.monotonic()
            try:
                frames = await asyncio.wait_for(self.sock.recv_multipart(), max(0.0, left))
            except TimeoutError:
                raise ApiError(503, f"the coordinator did not answer within {self.timeout_s:g} s") from None
            self._kept.append(wire.unpack(frames)[0])

    async def call(self, header: dict[str, Any]) -> dict[str, Any]:
        return await self.next_event({await self.send(header)})

    async def events(self, tags: list[str]) -> AsyncIterator[dict[str, Any]]:
        """Events of `tags` as they arrive, until each has its `done` or `error`."""
        open_tags = set(tags)
        while open_tags:
            event = await self.next_event(open_tags)
            if event["kind"] in FINAL:
                open_tags.discard(event["tag"])
            yield event


class _App:
    """The ASGI application: routes, API key, bounded body reads; one `_Link` per request."""

    def __init__(self, ctx: zmq.Context, front: str, timeout_s: float, api_key: str | None,
                 read_timeout_s: float, max_body_bytes: int) -> None:
        self.ctx, self.front, self.timeout_s, self.api_key = ctx, front, timeout_s, api_key
        self.read_timeout_s, self.max_body_bytes = read_timeout_s, max_body_bytes
        self.actx: zmq.asyncio.Context | None = None

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if self.actx is None:
            self.actx = zmq.asyncio.Context.shadow(self.ctx.underlying)
        link = _Link(self.actx, self.front, self.timeout_s)
        try:
            await self._route(scope, receive, send, link)
        except ApiError as err:
            await _json(send, err.status, err.body(), err.headers)
        except Exception as exc:  # noqa: BLE001 - one request's failure is its own 500, never the server's
            log.exception("HTTP %s %s failed", scope.get("method"), scope.get("path"))
            await _json(send, 500, ApiError(500, f"the front door failed on this request: {exc!r}").body())
        finally:
            link.close()

    def _authorize(self, scope: dict[str, Any], path: str) -> None:
        if path.startswith("/admin/") and self.api_key is None:
            raise ApiError(403, "admin routes need an API key and none is set: start the coordinator with "
                                "--api-key (or CORAL_API_KEY)")
        if self.api_key is None:
            return
        sent = dict(scope["headers"]).get(b"authorization", b"")
        if not hmac.compare_digest(sent, f"Bearer {self.api_key}".encode()):
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'")

    async def _body(self, scope: dict[str, Any], receive: Receive) -> Any:
        """The JSON body, refused past `max_body_bytes` or `read_timeout_s` before it is all read."""
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and int(length) > self.max_body_bytes:
            raise ApiError(413, f"a body of {int(length)} bytes exceeds {self.max_body_bytes}",
                           ((b"connection", b"close"),))
        chunks, size = [], 0
        deadline = time.monotonic() + self.read_timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise ApiError(408, f"the body did not arrive within {self.read_timeout_s:g} s; send all the bytes "
                                    "Content-Length announces", ((b"connection", b"close"),)) from None
            if message["type"] == "http.disconnect":
                raise ApiError(400, "the client went away before sending its body")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise ApiError(413, f"the body exceeds {self.max_body_bytes} bytes", ((b"connection", b"close"),))
            chunks.append(chunk)
            if not message.get("more_body"):
                break
        try:
            return json.loads(b"".join(chunks) or b"{}")
        except (ValueError, RecursionError) as exc:
            raise ApiError(400, f"the body is not JSON that can be read: {exc!r}") from None

    async def _route(self, scope: dict[str, Any], receive: Receive, send: Send, link: _Link) -> None:
        method, path = scope["method"], scope["path"]
        if sum(len(k) + len(v) for k, v in scope["headers"]) > MAX_HEADER_BYTES:
            raise ApiError(431, f"the headers exceed {MAX_HEADER_BYTES} bytes", ((b"connection", b"close"),))
        if path != "/health":
            self._authorize(scope, path)
        routes = {("GET", "/health"), ("GET", "/v1/models"), ("GET", "/admin/instances"),
                  ("POST", "/v1/completions"), ("POST", "/admin/drain")}
        if (method, path) not in routes:
            allowed = [m for m, p in routes if p == path]
            raise ApiError(405 if allowed else 404, f"no route {method} {path}"
                           + (f"; use {', '.join(allowed)}" if allowed else ""))
        if method == "GET":
            status = await link.call({"kind": "status"})
            for key in ("kind", "tag"):
                status.pop(key, None)
            if path == "/health":
                ready = bool(status["serving"])
                await _json(send, 200 if ready else 503, {"status": "ok" if ready else "unavailable",
                                                          "serving": status["serving"]})
            elif path == "/v1/models":
                if not status["serving"]:
                    raise ApiError(503, "no instance is ready to serve yet; GET /health says when one is")
                await _json(send, 200, {"object": "list", "data": [
                    {"id": m, "object": "model", "created": 0, "owned_by": "coral"} for m in status["serving"]]})
            else:
                await _json(send, 200, status)
            return
        body = await self._body(scope, receive)
        if path == "/admin/drain":
            reply = await link.call({"kind": "drain", "instance": str(body.get("instance")
                                                                      if isinstance(body, dict) else None)})
            if reply["kind"] == "error":
                raise error_event(reply)
            await _json(send, 200, {"instance": reply["instance"], "in_flight": reply["in_flight"]})
            return
        await self._completions(body, receive, send, link)

    async def _completions(self, body: Any, receive: Receive, send: Send, link: _Link) -> None:
        status = await link.call({"kind": "status"})
        req = parse_completion(body, status["serving"] or status["models"])
        tags = [await link.send({"kind": "submit", "model": req["model"], "max_tokens": req["max_tokens"],
                                 "ignore_eos": req["ignore_eos"],
                                 **({"prompt": p} if isinstance(p, str) else {"prompt_tokens": p})})
                for p in req["prompts"]]
        # Every submit is answered at once with `accepted` or `error`: fail the whole request before any byte.
        first = {t: await link.next_event({t}) for t in tags}
        rids = {t: e.get("rid") for t, e in first.items()}
        failed = [e for e in first.values() if e["kind"] == "error"]
        if failed:
            await _cancel(link, [r for t, r in rids.items() if first[t]["kind"] != "error"])
            raise error_event(failed[0])
        meta = {"id": f"cmpl-{rids[tags[0]]}-{time.time_ns()}", "object": "text_completion",
                "created": int(time.time()), "model": req["model"]}
        if req["stream"]:
            await self._stream(receive, send, link, tags, rids, meta)
            return
        final = {e["tag"]: e async for e in link.events(tags) if e["kind"] in FINAL}
        errors = [final[t] for t in tags if final[t]["kind"] == "error"]
        if errors:
            raise error_event(errors[0])
        choices = [{"index": i, "text": final[t]["text"], "logprobs": None, "finish_reason": final[t]["finish_reason"],
                    "token_ids": final[t]["tokens"]} for i, t in enumerate(tags)]
        prompt_tokens = sum(final[t]["prompt_tokens"] for t in tags)
        completion_tokens = sum(len(final[t]["tokens"]) for t in tags)
        await _json(send, 200, {**meta, "choices": choices, "usage": {
            "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}})

    async def _stream(self, receive: Receive, send: Send, link: _Link, tags: list[str], rids: dict[str, Any],
                      meta: dict[str, Any]) -> None:
        """Server-sent events, one chunk per token, then a chunk with the finish reason, then `[DONE]`."""
        gone = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        watcher = asyncio.ensure_future(watch())
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})
        index = {t: i for i, t in enumerate(tags)}
        try:
            async for e in link.events(tags):
                if gone.is_set():
                    await _cancel(link, list(rids.values()))
                    return
                choice = {"index": index[e["tag"]], "text": "", "logprobs": None, "finish_reason": None}
                if e["kind"] == "token":
                    choice.update(text=e["text"], token_ids=[e["token"]])
                elif e["kind"] == "done":
                    choice["finish_reason"] = e["finish_reason"]
                elif e["kind"] == "error":
                    await _event(send, error_event(e).body())
                    continue
                else:
                    continue
                await _event(send, {**meta, "choices": [choice]})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
        except ApiError as err:
            await _event(send, err.body())
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            watcher.cancel()


async def _cancel(link: _Link, rids: list[Any]) -> None:
    for rid in rids:
        if rid:
            await link.sock.send_multipart(wire.pack({"kind": "cancel", "rid": rid}))


async def _json(send: Send, status: int, data: Any, headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    payload = json.dumps(data).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()), *headers]})
    await send({"type": "http.response.body", "body": payload})


async def _event(send: Send, data: Any) -> None:
    await send({"type": "http.response.body", "body": f"data: {json.dumps(data)}\n\n".encode(), "more_body": True})


class _Protocol(H11Protocol):
    """uvicorn's h11 protocol, answering malformed requests and slow headers with OpenAI-shaped JSON errors."""

    read_timeout_s = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = self.loop.call_later(self.read_timeout_s, self._too_slow)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.cycle is not None and self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        super().connection_lost(exc)

    def _too_slow(self) -> None:
        self._header_timer = None
        if self.cycle is None and not self.transport.is_closing():
            self._reply(408, f"the request line and headers did not arrive within {self.read_timeout_s:g} s")

    def send_400_response(self, msg: str) -> None:
        self._reply(400, f"malformed HTTP request ({msg.rstrip('.')}): check Content-Length and the headers")

    def _reply(self, status: int, message: str) -> None:
        payload = json.dumps(ApiError(status, message).body()).encode()
        head = f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n".encode()
        self.transport.write(head + b"content-type: application/json\r\nconnection: close\r\n"
                             + f"content-length: {len(payload)}\r\n\r\n".encode() + payload)
        self.transport.close()


class FrontDoor:
    """Serves HTTP with uvicorn on a background thread; requests reach the coordinator loop over inproc ZeroMQ."""

    def __init__(self, ctx: zmq.Context, front: str, host: str, port: int, timeout_s: float,
                 api_key: str | None, read_timeout_s: float, max_body_bytes: int) -> None:
        try:
            self.sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                             backlog=2048)
        except OSError as exc:
            raise CoralError(f"cannot serve HTTP on {host}:{port} ({exc.strerror}).",
                             "pick a free port with --http-port / --port, or stop what holds it") from None
        self.port = self.sock.getsockname()[1]
        protocol = type("Protocol", (_Protocol,), {"read_timeout_s": read_timeout_s})
        app = _App(ctx, front, timeout_s, api_key, read_timeout_s, max_body_bytes)
        config = uvicorn.Config(app, http=protocol, ws="none", lifespan="off", log_config=None, access_log=False,
                                timeout_keep_alive=5, timeout_graceful_shutdown=1,
                                h11_max_incomplete_event_size=MAX_HEADER_BYTES)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._serve, name="coral-http", daemon=True)

    def _serve(self) -> None:
        asyncio.run(self.server.serve(sockets=[self.sock]))

    def start(self, timeout_s: float = 10.0) -> None:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self.server.started:
            raise CoralError(f"the HTTP front door did not start within {timeout_s:g} s.", "read the coordinator log")

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=5)
        self.sock.close()
