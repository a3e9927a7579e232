"""The OpenAI-compatible HTTP front door on uvicorn: `/v1/models`, `/v1/completions` and `/v1/chat/completions`
(plain and SSE-streamed), `/health`, `/metrics` (Prometheus) and the admin routes.

Each request reaches the coordinator loop over its own inproc socket. A client that goes away cancels its
request on every instance (the coordinator's `cancel`); a request whose choice meets a stop string or stop token
is cancelled there too. On shutdown (SIGTERM/SIGINT) new requests get 503 with Retry-After while those in flight
finish for up to `DRAIN_S`; those still running then end with a 503 (a JSON error, or an error event mid-stream).
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import logging
import os
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
from coral_dagster.runtime.metrics import CONTENT_TYPE, Metrics
from coral_dagster.runtime.openai_protocol import (ApiError, ApiRequest, Choice, chunk, error_event, parse_request,
                                                   response, response_meta, usage)
from coral_dagster.runtime.sampling import TokenLogprobs

log = logging.getLogger(__name__)

MAX_HEADER_BYTES = 16 << 10
# Seconds in-flight requests may finish in after SIGTERM/SIGINT before they are answered 503.
DRAIN_S = 3.0
# What a 503 during shutdown tells the client to wait before retrying (another replica, or this one restarted).
RETRY_AFTER_S = 5
_RETRY = ((b"retry-after", str(RETRY_AFTER_S).encode()),)

Send = Callable[[dict[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]

__all__ = ["ApiError", "FrontDoor", "error_event"]


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


class _Reply:
    """A response being sent: whether its head went out, so a failure mid-stream ends as an event instead."""

    def __init__(self, send: Send) -> None:
        self._send, self.started = send, False

    async def json(self, status: int, data: Any, headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
        await self.whole(status, b"application/json", json.dumps(data).encode(), headers)

    async def whole(self, status: int, content_type: bytes, payload: bytes,
                    headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
        await self.head(status, [(b"content-type", content_type), (b"content-length", str(len(payload)).encode()),
                                 *headers])
        await self._send({"type": "http.response.body", "body": payload})

    async def head(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.started = True
        await self._send({"type": "http.response.start", "status": status, "headers": headers})

    async def event(self, data: Any) -> None:
        await self._send({"type": "http.response.body", "body": f"data: {json.dumps(data)}\n\n".encode(),
                          "more_body": True})

    async def end_stream(self, done: bool = True) -> None:
        await self._send({"type": "http.response.body", "body": b"data: [DONE]\n\n" if done else b"",
                          "more_body": False})

    async def error(self, err: ApiError) -> None:
        """`err` as the whole answer, or as the last event of a stream already under way."""
        if self.started:
            await self.event(err.body())
            await self.end_stream(done=False)
        else:
            await self.json(err.status, err.body(), err.headers)


class _Run:
    """One request's choices in flight: their tags and coordinator request ids, those still open."""

    def __init__(self, req: ApiRequest, tags: list[str]) -> None:
        self.req, self.tags = req, tags
        self.index = {t: i for i, t in enumerate(tags)}
        self.rids: dict[str, Any] = {}
        self.open = set(tags)
        self.choices = [Choice(i, req.stop, req.stop_token_ids, req.prompt_tokens(i // req.n))
                        for i in range(len(tags))]
        self.started = time.monotonic()
        self.last_token: dict[str, float] = {}


class _App:
    """The ASGI application: routes, API key, bounded body reads, metrics; one `_Link` per request."""

    def __init__(self, ctx: zmq.Context, front: str, timeout_s: float, api_key: str | None,
                 read_timeout_s: float, max_body_bytes: int) -> None:
        self.ctx, self.front, self.timeout_s, self.api_key = ctx, front, timeout_s, api_key
        self.read_timeout_s, self.max_body_bytes = read_timeout_s, max_body_bytes
        self.actx: zmq.asyncio.Context | None = None
        self.metrics = Metrics()
        self.closing = False
        # Set on the server's loop (created there) once the drain time is over: requests still running end 503.
        self.abort: asyncio.Event | None = None
        self.running = 0

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if self.actx is None:
            self.actx = zmq.asyncio.Context.shadow(self.ctx.underlying)
        link = _Link(self.actx, self.front, self.timeout_s)
        reply = _Reply(send)
        route = scope["path"] if scope["path"] in _PATHS else "other"
        status = 200
        self.running += 1
        self.metrics.running.inc()
        try:
            await self._route(scope, receive, reply, link)
        except ApiError as err:
            status = err.status
            await reply.error(err)
        except asyncio.CancelledError:
            # The server is stopping with this request still running: a JSON 503, never uvicorn's plain-text 500.
            status = 503
            await reply.error(_shutting_down())
        except Exception as exc:  # noqa: BLE001 - one request's failure is its own 500, never the server's
            log.exception("HTTP %s %s failed", scope.get("method"), scope.get("path"))
            status = 500
            await reply.error(ApiError(500, f"the front door failed on this request: {exc!r}"))
        finally:
            link.close()
            self.running -= 1
            self.metrics.running.dec()
            self.metrics.answered(route, status)

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
            chunk_ = message.get("body", b"")
            size += len(chunk_)
            if size > self.max_body_bytes:
                raise ApiError(413, f"the body exceeds {self.max_body_bytes} bytes", ((b"connection", b"close"),))
            chunks.append(chunk_)
            if not message.get("more_body"):
                break
        try:
            return json.loads(b"".join(chunks) or b"{}")
        except (ValueError, RecursionError) as exc:
            raise ApiError(400, f"the body is not JSON that can be read: {exc!r}") from None

    async def _route(self, scope: dict[str, Any], receive: Receive, reply: _Reply, link: _Link) -> None:
        method, path = scope["method"], scope["path"]
        if sum(len(k) + len(v) for k, v in scope["headers"]) > MAX_HEADER_BYTES:
            raise ApiError(431, f"the headers exceed {MAX_HEADER_BYTES} bytes", ((b"connection", b"close"),))
        if path not in ("/health", "/metrics"):
            self._authorize(scope, path)
        if (method, path) not in _ROUTES:
            allowed = [m for m, p in _ROUTES if p == path]
            raise ApiError(405 if allowed else 404, f"no route {method} {path}"
                           + (f"; use {', '.join(allowed)}" if allowed else ""))
        if self.closing and path != "/metrics":
            raise _shutting_down()
        if method == "GET":
            await self._get(path, reply, link)
            return
        body = await self._body(scope, receive)
        if path == "/admin/drain":
            answer = await link.call({"kind": "drain", "instance": str(body.get("instance")
                                                                       if isinstance(body, dict) else None)})
            if answer["kind"] == "error":
                raise error_event(answer)
            await reply.json(200, {"instance": answer["instance"], "in_flight": answer["in_flight"]})
            return
        status = await link.call({"kind": "status"})
        req = parse_request(body, "chat" if path == "/v1/chat/completions" else "completion",
                            status["serving"] or status["models"], status.get("context", {}))
        await self._generate(req, receive, reply, link)

    async def _get(self, path: str, reply: _Reply, link: _Link) -> None:
        status = await link.call({"kind": "status"})
        for key in ("kind", "tag"):
            status.pop(key, None)
        if path == "/health":
            ready = bool(status["serving"])
            await reply.json(200 if ready else 503, {"status": "ok" if ready else "unavailable",
                                                     "serving": status["serving"]})
        elif path == "/v1/models":
            if not status["serving"]:
                raise ApiError(503, "no instance is ready to serve yet; GET /health says when one is")
            await reply.json(200, {"object": "list", "data": [
                {"id": m, "object": "model", "created": 0, "owned_by": "coral",
                 "max_model_len": status.get("context", {}).get(m)} for m in status["serving"]]})
        elif path == "/metrics":
            self.metrics.queue_depth.set(status.get("in_flight", 0))
            await reply.whole(200, CONTENT_TYPE.encode(), self.metrics.exposition())
        else:
            await reply.json(200, status)

    async def _generate(self, req: ApiRequest, receive: Receive, reply: _Reply, link: _Link) -> None:
        """Submit every choice, then answer (whole or streamed) while watching for the client leaving and for
        the end of the drain time; either cancels what is still open on the coordinator."""
        tags = [await link.send(h) for h in req.submissions()]
        run = _Run(req, tags)
        # Every submit is answered at once with `accepted` or `error`: fail the whole request before any byte.
        first = {t: await link.next_event({t}) for t in tags}
        run.rids = {t: e.get("rid") for t, e in first.items()}
        failed = [e for e in first.values() if e["kind"] == "error"]
        if failed:
            await _cancel(link, [r for t, r in run.rids.items() if first[t]["kind"] != "error"])
            raise error_event(failed[0])
        for i in range(len(req.prompts)):
            self.metrics.prompt_tokens.labels(req.model).inc(req.prompt_tokens(i))
        work = asyncio.ensure_future(self._answer(run, reply, link))
        gone = asyncio.ensure_future(_disconnected(receive))
        aborted = asyncio.ensure_future(self.abort.wait())
        try:
            await asyncio.wait({work, gone, aborted}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (gone, aborted):
                task.cancel()
            if not work.done():
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
            # Choices still open (the client left, the drain ended, or another choice failed) stop everywhere.
            await _cancel(link, [run.rids[t] for t in run.open])
        if work.done() and not work.cancelled():
            work.result()
        elif gone.done() and not gone.cancelled():
            self.metrics.cancelled.inc()
        else:
            raise _shutting_down()

    async def _answer(self, run: _Run, reply: _Reply, link: _Link) -> None:
        req = run.req
        meta = response_meta(req, str(run.rids[run.tags[0]]), int(time.time()), req.stream)
        if req.stream:
            await reply.head(200, [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")])
            for c in run.choices:
                if req.kind == "chat" or req.echo:
                    await reply.event(chunk(req, meta, c, None, None, first=True))
        async for tag, piece in self._pieces(run, link):
            c = run.choices[run.index[tag]]
            if req.stream:
                if piece.text or piece.tokens:
                    await reply.event(chunk(req, meta, c, piece, None))
                if c.finish:
                    await reply.event(chunk(req, meta, c, None, c.finish))
        if req.stream:
            if req.include_usage:
                await reply.event({**meta, "choices": [], "usage": usage(run.choices, req)})
            await reply.end_stream()
        else:
            await reply.json(200, response(req, meta, run.choices))

    async def _pieces(self, run: _Run, link: _Link) -> AsyncIterator[tuple[str, Any]]:
        """(tag, released piece) as tokens arrive, until every choice has finished; a choice a stop ended is
        cancelled on the coordinator at once."""
        while run.open:
            e = await link.next_event(run.open)
            tag = e["tag"]
            c = run.choices[run.index[tag]]
            if e["kind"] == "error":
                run.open.discard(tag)
                raise error_event(e)
            if e["kind"] == "token":
                self._timed(run, tag)
                piece = c.add(int(e["token"]), e["text"], TokenLogprobs.from_message(e.get("logprobs")))
                if c.finish:
                    run.open.discard(tag)
                    await _cancel(link, [run.rids[tag]])
            elif e["kind"] == "done":
                run.open.discard(tag)
                piece = c.done(e["finish_reason"])
            else:
                continue
            yield tag, piece

    def _timed(self, run: _Run, tag: str) -> None:
        now = time.monotonic()
        model = run.req.model
        last = run.last_token.get(tag)
        if last is None:
            self.metrics.ttft.labels(model).observe(now - run.started)
        else:
            self.metrics.tpot.labels(model).observe(now - last)
        run.last_token[tag] = now
        self.metrics.generation_tokens.labels(model).inc()


_ROUTES = {("GET", "/health"), ("GET", "/v1/models"), ("GET", "/admin/instances"), ("GET", "/metrics"),
           ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/admin/drain")}
_PATHS = {p for _, p in _ROUTES}


def _shutting_down() -> ApiError:
    return ApiError(503, f"the server is shutting down; retry in {RETRY_AFTER_S} s (another replica, or this one "
                         "once restarted)", _RETRY)


async def _disconnected(receive: Receive) -> None:
    """Return once the client has gone away."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _cancel(link: _Link, rids: list[Any]) -> None:
    for rid in rids:
        if rid:
            await link.sock.send_multipart(wire.pack({"kind": "cancel", "rid": rid}))


class _Protocol(H11Protocol):
    """uvicorn's h11 protocol, answering malformed requests with OpenAI-shaped JSON errors, and requests whose line
    and headers are slower than `read_timeout_s` with a 408: the first on a connection, and every later one on
    a kept-alive connection (the timer restarts when a response completes)."""

    read_timeout_s = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm()

    def _arm(self) -> None:
        """Wait `read_timeout_s` for the next request's headers (a request after `self._waiting_after`)."""
        self._disarm()
        self._waiting_after = self.cycle
        self._header_timer = self.loop.call_later(self.read_timeout_s, self._too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.cycle is not self._waiting_after:
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # A pipelined request may have started already (then its headers are in); else wait for the next one's.
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _too_slow(self) -> None:
        self._header_timer = None
        if self.cycle is self._waiting_after and not self.transport.is_closing():
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
                 api_key: str | None, read_timeout_s: float, max_body_bytes: int,
                 tls: tuple[str | None, str | None] = (None, None)) -> None:
        certfile, keyfile = tls
        if bool(certfile) != bool(keyfile):
            raise CoralError("HTTPS needs both a certificate and its private key; one of them is missing.",
                             "pass --tls-certfile and --tls-keyfile together (or neither, for plain HTTP)")
        for path in (certfile, keyfile):
            if path and not os.path.isfile(path):
                raise CoralError(f"TLS file {path} does not exist.", "point --tls-certfile/--tls-keyfile at PEM files")
        self.scheme = "https" if certfile else "http"
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
                                h11_max_incomplete_event_size=MAX_HEADER_BYTES, ssl_certfile=certfile or None,
                                ssl_keyfile=keyfile or None)
        self.server = uvicorn.Server(config)
        self.app = app
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._serve, name="coral-http", daemon=True)

    def _serve(self) -> None:
        async def serve() -> None:
            self._loop = asyncio.get_running_loop()
            self.app.abort = asyncio.Event()
            await self.server.serve(sockets=[self.sock])

        asyncio.run(serve())

    def start(self, timeout_s: float = 10.0) -> None:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self.server.started:
            raise CoralError(f"the HTTP front door did not start within {timeout_s:g} s.", "read the coordinator log")

    def begin_drain(self) -> None:
        """Refuse new requests with 503 and Retry-After; those in flight go on (`in_flight` counts them)."""
        self.app.closing = True

    def in_flight(self) -> int:
        return self.app.running

    def stop(self, timeout_s: float = 2.0) -> None:
        """End requests still running with a 503 (a JSON error, or an error event mid-stream), then stop."""
        self.begin_drain()
        if self._loop is not None and self.app.abort is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.app.abort.set)
            deadline = time.monotonic() + timeout_s
            while self.app.running and time.monotonic() < deadline:
                time.sleep(0.01)
        self.server.should_exit = True
        self._thread.join(timeout=5)
        self.sock.close()
