"""The OpenAI-compatible HTTP front door on uvicorn: `/v1/models`, `/v1/completions` and `/v1/chat/completions`
(plain and SSE-streamed), vLLM's `/tokenize`, `/detokenize`, `/version`, `/ping`, `/openapi.json` and `/docs`,
`/health`, `/metrics` (Prometheus) and the admin routes; CORS as vLLM's `--allowed-origins` configures it.

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
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from http import HTTPStatus
from dataclasses import dataclass
from typing import Any

import pydantic
import uvicorn
import zmq
import zmq.asyncio
from uvicorn.protocols.http.h11_impl import H11Protocol

from coral_dagster.errors import CoralError
from coral_dagster.runtime import wire
from coral_dagster.runtime.client import FINAL
from coral_dagster.runtime.metrics import CONTENT_TYPE, Metrics
from coral_dagster.runtime.openai_protocol import (ApiError, ApiRequest, Choice, chunk, error_event, parse_request,
                                                   response, response_meta, tool_chunks, usage)
from coral_dagster.runtime.openapi_models import (DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest,
                                                  coral_version, openapi_document, swagger_page)
from coral_dagster.runtime.protocol import Kind
from coral_dagster.runtime.sampling import TokenLogprobs
from coral_dagster.runtime.tokenizer import BOS, N_BYTES, ByteTokenizer, apply_chat_template

log = logging.getLogger(__name__)

MAX_HEADER_BYTES = 16 << 10
# Seconds in-flight requests may finish in after SIGTERM/SIGINT before they are answered 503.
DRAIN_S = 3.0
# What a 503 during shutdown tells the client to wait before retrying (another replica, or this one restarted).
RETRY_AFTER_S = 5
_RETRY = ((b"retry-after", str(RETRY_AFTER_S).encode()),)

# The longest X-Request-Id taken from a client (longer, or not printable ASCII: one is generated instead).
MAX_REQUEST_ID = 128

Send = Callable[[dict[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]

__all__ = ["ApiError", "Cors", "FrontDoor", "error_event"]


@dataclass(frozen=True)
class Cors:
    """Cross-origin access as vLLM's `--allowed-origins/--allowed-methods/--allowed-headers` set it; no origin (the
    default) turns CORS off, so browsers on other origins cannot call the API."""

    origins: tuple[str, ...] = ()
    methods: tuple[str, ...] = ("*",)
    headers: tuple[str, ...] = ("*",)

    @staticmethod
    def parse(flag: str, raw: str) -> tuple[str, ...]:
        """One of the flags' values: a JSON list of strings, as vLLM's flags take them."""
        try:
            value = json.loads(raw)
        except ValueError:
            value = None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise CoralError(f"{flag} {raw!r} is not a JSON list of strings.",
                             f"pass it as vLLM's flag takes it, e.g. {flag} '[\"https://app.example.com\"]'")
        return tuple(value)

    def wrap(self, app: Any) -> Any:
        """`app` behind Starlette's CORS middleware (answering preflights), or as it is when no origin is allowed."""
        if not self.origins:
            return app
        from starlette.middleware.cors import CORSMiddleware

        return CORSMiddleware(app, allow_origins=list(self.origins), allow_methods=list(self.methods),
                              allow_headers=list(self.headers))


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

    def __init__(self, send: Send, request_id: str) -> None:
        self._send, self.started, self.request_id = send, False, request_id

    async def json(self, status: int, data: Any, headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
        await self.whole(status, b"application/json", json.dumps(data).encode(), headers)

    async def whole(self, status: int, content_type: bytes, payload: bytes,
                    headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
        await self.head(status, [(b"content-type", content_type), (b"content-length", str(len(payload)).encode()),
                                 *headers])
        await self._send({"type": "http.response.body", "body": payload})

    async def head(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.started = True
        await self._send({"type": "http.response.start", "status": status,
                          "headers": [*headers, (b"x-request-id", self.request_id.encode())]})

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
        self.choices = [Choice(i, req.stop, req.stop_token_ids, req.prompt_tokens(i // req.n),
                               req.sampling.min_tokens, req.skip_special_tokens) for i in range(len(tags))]
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
        # Requests generating now (their open choices are what vLLM's running and waiting gauges count).
        self.runs: set[_Run] = set()

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if self.actx is None:
            self.actx = zmq.asyncio.Context.shadow(self.ctx.underlying)
        link = _Link(self.actx, self.front, self.timeout_s)
        reply = _Reply(send, _request_id(scope))
        route = scope["path"] if scope["path"] in _PATHS else "other"
        status = 200
        self.running += 1
        counted = route != "/metrics"
        if counted:
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
            if counted:
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
            # Bytes that are not UTF-8 become lone surrogates, found below with the field they are in.
            body = json.loads(b"".join(chunks).decode("utf-8", "surrogateescape") or "{}")
        except (ValueError, RecursionError) as exc:
            raise ApiError(400, f"the body is not JSON that can be read: {exc!r}") from None
        _check_text(body)
        return body

    async def _route(self, scope: dict[str, Any], receive: Receive, reply: _Reply, link: _Link) -> None:
        method, path = scope["method"], scope["path"]
        if sum(len(k) + len(v) for k, v in scope["headers"]) > MAX_HEADER_BYTES:
            raise ApiError(431, f"the headers exceed {MAX_HEADER_BYTES} bytes", ((b"connection", b"close"),))
        if path not in _OPEN:
            self._authorize(scope, path)
        if (method, path) not in _ROUTES:
            allowed = sorted(m for m, p in _ROUTES if p == path)
            if allowed:
                raise ApiError(405, f"no route {method} {path}; use {', '.join(allowed)}",
                               ((b"allow", ", ".join(allowed).encode()),))
            raise ApiError(404, f"no route {method} {path}")
        if self.closing and path != "/metrics":
            raise _shutting_down()
        if path in _STATIC:
            await self._static(path, reply)
            return
        if method == "GET" or path == "/ping":
            await self._get(path, reply, link)
            return
        body = await self._body(scope, receive)
        if path in ("/tokenize", "/detokenize"):
            await self._tokens(path, body, reply, link)
            return
        if path == "/admin/drain":
            answer = await link.call({"kind": Kind.DRAIN, "instance": str(body.get("instance")
                                                                       if isinstance(body, dict) else None)})
            if answer["kind"] == Kind.ERROR:
                raise error_event(answer)
            await reply.json(200, {"instance": answer["instance"], "in_flight": answer["in_flight"]})
            return
        status = await link.call({"kind": Kind.STATUS})
        req = parse_request(body, "chat" if path == "/v1/chat/completions" else "completion",
                            status["serving"] or status["models"], status.get("context", {}))
        await self._generate(req, receive, reply, link)

    async def _static(self, path: str, reply: _Reply) -> None:
        if path == "/openapi.json":
            await reply.json(200, openapi_document())
        elif path == "/docs":
            await reply.whole(200, b"text/html; charset=utf-8", swagger_page())
        else:
            await reply.json(200, {"version": coral_version()})

    async def _tokens(self, path: str, body: Any, reply: _Reply, link: _Link) -> None:
        """vLLM's `/tokenize` (a prompt, or messages through the chat template) and `/detokenize`."""
        status = await link.call({"kind": Kind.STATUS})
        models = status["serving"] or status["models"]
        tokenizer = ByteTokenizer()
        if path == "/detokenize":
            detok = _validated(DetokenizeRequest, body)
            _model_of(detok.model, models)
            if any(not 0 <= t < tokenizer.vocab for t in detok.tokens):
                raise ApiError(400, f"tokens must be ids in [0, {tokenizer.vocab})", param="tokens")
            await reply.json(200, {"prompt": _detokenize(tokenizer, detok.tokens)})
            return
        model_type = TokenizeChatRequest if isinstance(body, dict) and "messages" in body \
            else TokenizeCompletionRequest
        tok = _validated(model_type, body)
        model = _model_of(tok.model, models)
        if isinstance(tok, TokenizeChatRequest):
            text = apply_chat_template([{"role": m.role, "content": m.content if isinstance(m.content, str)
                                         else "".join(p.text for p in m.content or [])} for m in tok.messages])
        else:
            text = tok.prompt
        ids = tokenizer.encode(text)
        if not tok.add_special_tokens:
            ids = ids[1:] if ids[:1] == [BOS] else ids
        await reply.json(200, {"count": len(ids), "max_model_len": status.get("context", {}).get(model),
                               "tokens": ids, "token_strs": [tokenizer.decode_token(t) for t in ids]
                               if tok.return_token_strs else None})

    async def _get(self, path: str, reply: _Reply, link: _Link) -> None:
        status = await link.call({"kind": Kind.STATUS})
        for key in ("kind", "tag"):
            status.pop(key, None)
        if path in ("/health", "/ping"):
            ready, degraded = bool(status["serving"]), status.get("degraded", [])
            state = ("degraded" if degraded else "ok") if ready else "unavailable"
            await reply.json(200 if ready else 503, {"status": state, "serving": status["serving"],
                                                     "degraded": degraded})
        elif path == "/v1/models":
            if not status["serving"]:
                raise ApiError(503, "no instance is ready to serve yet; GET /health says when one is")
            await reply.json(200, {"object": "list", "data": [
                {"id": m, "object": "model", "created": 0, "owned_by": "coral",
                 "max_model_len": status.get("context", {}).get(m)} for m in status["serving"]]})
        elif path == "/metrics":
            self.metrics.queue_depth.set(status.get("in_flight", 0))
            self.metrics.queued.set(status.get("queued", 0))
            on_instances: dict[str, int] = {m: 0 for m in status["models"]}
            kv_tokens: dict[str, tuple[int, int]] = {}
            for inst in status.get("instances", []):
                on_instances[inst["model"]] = on_instances.get(inst["model"], 0) + int(inst.get("in_flight", 0))
                if inst.get("state") != "lost":
                    used, capacity = kv_tokens.get(inst["model"], (0, 0))
                    kv_tokens[inst["model"]] = (used + int(inst.get("kv_used_tokens", 0)),
                                                capacity + int(inst.get("kv_capacity_tokens", 0)))
            submitted: dict[str, int] = {}
            for run in self.runs:
                submitted[run.req.model] = submitted.get(run.req.model, 0) + len(run.open)
            self.metrics.vllm.set_load(on_instances, submitted, kv_tokens)
            await reply.whole(200, CONTENT_TYPE.encode(), self.metrics.exposition())
        else:
            await reply.json(200, status)

    async def _generate(self, req: ApiRequest, receive: Receive, reply: _Reply, link: _Link) -> None:
        """Submit every choice, then answer (whole or streamed) while watching for the client leaving and for
        the end of the drain time; either cancels what is still open on the coordinator."""
        abort = self.abort
        if abort is None:
            raise RuntimeError("a request reached the front door before its server loop created the abort event")
        submissions = req.submissions()
        for h in submissions:
            _fits_the_wire(h)
        tags = [await link.send(h) for h in submissions]
        run = _Run(req, tags)
        # Every submit is answered at once with `accepted` or `error`: fail the whole request before any byte.
        first = {t: await link.next_event({t}) for t in tags}
        run.rids = {t: e.get("rid") for t, e in first.items()}
        failed = [e for e in first.values() if e["kind"] == Kind.ERROR]
        if failed:
            await _cancel(link, [r for t, r in run.rids.items() if first[t]["kind"] != "error"])
            raise error_event(failed[0])
        for i in range(len(req.prompts)):
            self.metrics.prompt_tokens.labels(req.model).inc(req.prompt_tokens(i))
            self.metrics.vllm.prompt_tokens.labels(req.model).inc(req.prompt_tokens(i))
        self.runs.add(run)
        work = asyncio.ensure_future(self._answer(run, reply, link))
        gone = asyncio.ensure_future(_disconnected(receive))
        aborted = asyncio.ensure_future(abort.wait())
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
            self.runs.discard(run)
        if work.done() and not work.cancelled():
            work.result()
        elif gone.done() and not gone.cancelled():
            self.metrics.cancelled.inc()
            self.metrics.vllm.success.labels(req.model, "abort").inc(len(run.open))
        else:
            raise _shutting_down()

    async def _answer(self, run: _Run, reply: _Reply, link: _Link) -> None:
        req = run.req
        meta = response_meta(req, reply.request_id, int(time.time()), req.stream)
        if req.stream:
            await reply.head(200, [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")])
            for c in run.choices:
                # Echo with logprobs waits for the prompt's log-probabilities (they come with the first token).
                if req.kind == "chat" or (req.echo and not req.echo_logprobs):
                    await reply.event(chunk(req, meta, c, None, None, first=True))
        echoed: set[int] = set()
        async for tag, piece in self._pieces(run, link):
            c = run.choices[run.index[tag]]
            if req.stream and req.tool_plan is not None:
                # Content no call can begin in goes out at once; the calls, whole, once the choice ends.
                for event in tool_chunks(req, meta, c):
                    await reply.event(event)
            elif req.stream:
                first = req.echo_logprobs and c.index not in echoed
                if piece.text or piece.tokens or first:
                    echoed.add(c.index)
                    await reply.event(chunk(req, meta, c, piece, None, first=first))
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
            if e["kind"] == Kind.ERROR:
                run.open.discard(tag)
                raise error_event(e)
            if e.get("prompt_logprobs") is not None:
                c.prompt_logprobs = [TokenLogprobs.from_message(lp) for lp in e["prompt_logprobs"]]
            if e["kind"] == Kind.TOKEN:
                self._timed(run, tag)
                piece = c.add(int(e["token"]), e["text"], TokenLogprobs.from_message(e.get("logprobs")))
                if c.finish:
                    run.open.discard(tag)
                    await _cancel(link, [run.rids[tag]])
            elif e["kind"] == Kind.DONE:
                run.open.discard(tag)
                piece = c.done(e["finish_reason"])
            else:
                continue
            if c.finish:
                self._finished(run, c.finish)
            yield tag, piece

    def _finished(self, run: _Run, reason: str) -> None:
        vllm = self.metrics.vllm
        vllm.e2e.labels(run.req.model).observe(time.monotonic() - run.started)
        vllm.success.labels(run.req.model, reason).inc()

    def _timed(self, run: _Run, tag: str) -> None:
        now = time.monotonic()
        model = run.req.model
        last = run.last_token.get(tag)
        if last is None:
            self.metrics.ttft.labels(model).observe(now - run.started)
            self.metrics.vllm.ttft.labels(model).observe(now - run.started)
        else:
            self.metrics.tpot.labels(model).observe(now - last)
            self.metrics.vllm.itl.labels(model).observe(now - last)
        run.last_token[tag] = now
        self.metrics.generation_tokens.labels(model).inc()
        self.metrics.vllm.generation_tokens.labels(model).inc()


_ROUTES = {("GET", "/health"), ("GET", "/v1/models"), ("GET", "/admin/instances"), ("GET", "/metrics"),
           ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/admin/drain"),
           ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/version"), ("GET", "/ping"), ("POST", "/ping"),
           ("GET", "/openapi.json"), ("GET", "/docs")}
_PATHS = {p for _, p in _ROUTES}
# Routes anyone may call with or without the API key: they tell nothing about requests or prompts.
_OPEN = {"/health", "/ping", "/metrics", "/version", "/openapi.json", "/docs"}
# Room for the tag `_Link.send` adds to a submission's header.
_TAG_BYTES = 32
# Routes answered without the coordinator.
_STATIC = {"/openapi.json", "/docs", "/version"}


def _request_id(scope: dict[str, Any]) -> str:
    """The client's X-Request-Id when it is a short printable ASCII string (vLLM honours and echoes it), else a
    fresh one."""
    sent = dict(scope["headers"]).get(b"x-request-id", b"")
    if 0 < len(sent) <= MAX_REQUEST_ID and all(0x21 <= b < 0x7F for b in sent):
        return sent.decode()
    return uuid.uuid4().hex


def _check_text(body: Any) -> None:
    """A 400 naming the first field whose text is not valid Unicode: bytes that are not UTF-8, or a lone UTF-16
    surrogate escaped in the JSON (`"\\ud800"`); no model or tokenizer could read either."""
    todo: list[tuple[str, Any]] = [("", body)]
    while todo:
        where, value = todo.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                todo.append((f"{where}.{key}" if where else str(key), key))
                todo.append((f"{where}.{key}" if where else str(key), item))
        elif isinstance(value, list):
            todo.extend((f"{where}[{i}]", item) for i, item in enumerate(value))
        elif isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ApiError(400, f"{where or 'the body'} is not valid UTF-8 text (character {exc.start} is a "
                                    "lone surrogate or a byte that is not UTF-8); send well-formed Unicode",
                               param=where or None) from None


def _fits_the_wire(header: dict[str, Any]) -> None:
    """A 413 at once for a submission the coordinator could not read: its header, with non-ASCII text escaped
    (up to 6 bytes a character), over the wire's limit, which a body under the door's own cap can still reach."""
    size = len(wire.pack(header)[0]) + _TAG_BYTES
    if size > wire.MAX_HEADER_BYTES:
        raise ApiError(413, f"the prompt takes {size} bytes on the way to the coordinator (non-ASCII text escaped), "
                            f"over its {wire.MAX_HEADER_BYTES}-byte limit; send a shorter prompt (a request's tokens "
                            "must fit the model's context anyway)", param="prompt")


def _validated(model: type[pydantic.BaseModel], body: Any) -> Any:
    """`body` read into `model`; the first problem a 400 naming its field."""
    try:
        return model.model_validate(body)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or None
        raise ApiError(400, f"{where or 'the body'}: {first['msg']}", param=where) from None


def _detokenize(tokenizer: ByteTokenizer, tokens: list[int]) -> str:
    """The text of `tokens`: runs of byte tokens read as UTF-8 (an invalid sequence becomes U+FFFD, as Hugging Face
    tokenizers decode), BOS and EOS nothing, other ids `<|id|>`."""
    out, run = [], bytearray()
    for t in tokens:
        if t < N_BYTES:
            run.append(t)
            continue
        out.append(run.decode("utf-8", "replace"))
        run.clear()
        out.append(tokenizer.decode_token(t))
    out.append(run.decode("utf-8", "replace"))
    return "".join(out)


def _model_of(name: str | None, models: list[str]) -> str:
    if name is None and len(models) == 1:
        return models[0]
    if name not in models:
        raise ApiError(404 if name else 400, f"model {name!r} is not served; served: {', '.join(models) or 'none'}",
                       param="model")
    return name


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
            await link.sock.send_multipart(wire.pack({"kind": Kind.CANCEL, "rid": rid}))


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
                 tls: tuple[str | None, str | None] = (None, None), cors: Cors | None = None) -> None:
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
        config = uvicorn.Config((cors or Cors()).wrap(app), http=protocol, ws="none", lifespan="off",
                                log_config=None, access_log=False,
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
