"""The OpenAI-compatible HTTP front door (`/v1/models`, `/v1/completions` with SSE streaming, admin routes)."""

from __future__ import annotations

import hmac
import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import zmq

from coral_dagster.errors import CoralError
from coral_dagster.runtime.client import FINAL, Client

log = logging.getLogger(__name__)


class ApiError(Exception):
    """An HTTP error in OpenAI's shape."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def parse_completion(body: Any, models: list[str]) -> dict[str, Any]:
    """Validate a `/v1/completions` body; returns model, prompts (text or token lists) and options."""
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    model = body.get("model") or (models[0] if len(models) == 1 else None)
    if not isinstance(model, str):
        raise ApiError(400, f"name the model; served: {', '.join(models) or 'none yet'}")
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        prompts = list(prompt)
    else:
        raise ApiError(400, "prompt must be a string, a list of strings, or token id lists")
    temperature = body.get("temperature")
    if temperature not in (None, 0, 0.0):
        raise ApiError(400, f"temperature={temperature}: only greedy decoding is implemented; send temperature 0")
    if body.get("n", 1) != 1 or body.get("best_of", 1) != 1:
        raise ApiError(400, "only n=1 and best_of=1 are supported")
    max_tokens = body.get("max_tokens", 16)
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ApiError(400, f"max_tokens={max_tokens!r} must be an integer of 1 or more")
    return {"model": model, "prompts": prompts, "max_tokens": max_tokens, "stream": bool(body.get("stream")),
            "ignore_eos": bool(body.get("ignore_eos", False))}


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt: str, *args: Any) -> None:
        log.info("%s %s", self.address_string(), fmt % args)

    def _client(self) -> Client:
        return Client(self.server.front, ctx=self.server.ctx, timeout_s=self.server.timeout_s)

    def _json(self, status: int, data: Any) -> None:
        payload = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def _error(self, err: ApiError) -> None:
        self._json(err.status, {"error": {"message": err.message, "type": err.kind, "code": err.status}})

    def _body(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        try:
            return json.loads(self.rfile.read(length) or b"{}")
        except ValueError as exc:
            raise ApiError(400, f"the body is not JSON: {exc}") from None

    def _authorize(self) -> None:
        key = self.server.api_key
        if key is None or self.path == "/health":
            return
        sent = self.headers.get("Authorization", "")
        if not hmac.compare_digest(sent.encode(), f"Bearer {key}".encode()):
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", "authentication_error")

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        try:
            self._authorize()
            if self.path == "/health":
                self._json(200, {"status": "ok"})
            elif self.path == "/v1/models":
                with self._client() as c:
                    models = c.status()["models"]
                self._json(200, {"object": "list", "data": [{"id": m, "object": "model", "created": 0,
                                                             "owned_by": "coral"} for m in models]})
            elif self.path == "/admin/instances":
                with self._client() as c:
                    status = c.status()
                status.pop("kind", None)
                status.pop("tag", None)
                self._json(200, status)
            else:
                raise ApiError(404, f"no route GET {self.path}", "not_found")
        except ApiError as err:
            self._error(err)
        except CoralError as exc:
            self._error(ApiError(503, str(exc), "service_unavailable"))

    def do_POST(self) -> None:  # noqa: N802
        try:
            self._authorize()
            body = self._body()
            if self.path == "/v1/completions":
                self._completions(body)
            elif self.path == "/admin/drain":
                with self._client() as c:
                    reply = c.drain(str(body.get("instance")))
                if reply["kind"] == "error":
                    raise ApiError(reply.get("status", 400), f"{reply['problem']} Fix: {reply['fix']}")
                self._json(200, {"instance": reply["instance"], "in_flight": reply["in_flight"]})
            else:
                raise ApiError(404, f"no route POST {self.path}", "not_found")
        except ApiError as err:
            self._error(err)
        except CoralError as exc:
            self._error(ApiError(503, str(exc), "service_unavailable"))

    def _completions(self, body: Any) -> None:
        with self._client() as c:
            req = parse_completion(body, c.status()["models"])
            tags = [c.submit(req["model"], **({"prompt": p} if isinstance(p, str) else {"prompt_tokens": p}),
                             max_tokens=req["max_tokens"], ignore_eos=req["ignore_eos"]) for p in req["prompts"]]
            meta = {"id": f"cmpl-{tags[0]}-{time.time_ns()}", "object": "text_completion",
                    "created": int(time.time()), "model": req["model"]}
            if req["stream"]:
                self._stream(c, tags, meta)
                return
            final = {e["tag"]: e for e in c.events(tags) if e["kind"] in FINAL}
        errors = [final[t] for t in tags if final[t]["kind"] == "error"]
        if errors:
            e = errors[0]
            raise ApiError(e.get("status", 500), f"{e['problem']} Fix: {e['fix']}", "service_unavailable")
        choices = [{"index": i, "text": final[t]["text"], "logprobs": None, "finish_reason": final[t]["finish_reason"],
                    "token_ids": final[t]["tokens"]} for i, t in enumerate(tags)]
        prompt_tokens = sum(final[t]["prompt_tokens"] for t in tags)
        completion_tokens = sum(len(final[t]["tokens"]) for t in tags)
        self._json(200, {**meta, "choices": choices, "usage": {
            "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}})

    def _stream(self, c: Client, tags: list[str], meta: dict[str, Any]) -> None:
        """Server-sent events, one chunk per token, then a chunk with the finish reason, then `[DONE]`."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        index = {t: i for i, t in enumerate(tags)}
        rids: dict[str, str] = {}
        try:
            for e in c.events(tags):
                rids[e["tag"]] = e.get("rid", "")
                choice = {"index": index[e["tag"]], "text": "", "logprobs": None, "finish_reason": None}
                if e["kind"] == "token":
                    choice.update(text=e["text"], token_ids=[e["token"]])
                elif e["kind"] == "done":
                    choice["finish_reason"] = e["finish_reason"]
                elif e["kind"] == "error":
                    self._event({"error": {"message": f"{e['problem']} Fix: {e['fix']}",
                                           "type": "service_unavailable", "code": e.get("status", 500)}})
                    continue
                else:
                    continue
                self._event({**meta, "choices": [choice]})
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            for rid in rids.values():
                c.cancel(rid)
        except CoralError as exc:
            self._event({"error": {"message": str(exc), "type": "service_unavailable", "code": 503}})

    def _event(self, data: Any) -> None:
        self.wfile.write(f"data: {json.dumps(data)}\n\n".encode())
        self.wfile.flush()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    ctx: zmq.Context
    front: str
    timeout_s: float
    api_key: str | None


class FrontDoor:
    """Serves HTTP on a background thread; each request talks to the coordinator loop over inproc ZeroMQ."""

    def __init__(self, ctx: zmq.Context, front: str, host: str, port: int, timeout_s: float,
                 api_key: str | None = None) -> None:
        self.server = _Server((host, port), _Handler)
        self.server.ctx, self.server.front, self.server.timeout_s = ctx, front, timeout_s
        self.server.api_key = api_key
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, name="coral-http", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
