"""The OpenAI API's request bodies (`/v1/completions`, `/v1/chat/completions`) read into one request, and the
response objects and stream chunks built from what each choice generated, in the shapes vLLM's server answers.

Every field is either honoured or refused with a 400 naming it (`param`); none is silently ignored. Fields
that change nothing at their default (`logit_bias` empty, `best_of` equal to `n`, no `suffix`, no tools) are
accepted at that default only. vLLM's own extensions are honoured as vLLM honours them: `min_tokens`, penalties,
`stop_token_ids`, `skip_special_tokens`, `stream_options.continuous_usage_stats`, `stop_reason` in choices,
`prompt_logprobs` (and, as vLLM, `echo` with `logprobs` asks for the prompt's too and puts them first).
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field
from typing import Any, overload

from pydantic import BaseModel

from coral_dagster.runtime import structured, tools
from coral_dagster.runtime.limits import RequestError, is_int, max_tokens_of
from coral_dagster.runtime.openapi_models import ChatCompletionRequest, CompletionRequest
from coral_dagster.runtime.protocol import Kind
from coral_dagster.runtime.sampling import MAX_LOGPROBS, SamplingParams, TokenLogprobs
from coral_dagster.runtime.tokenizer import BOS, EOS, ByteTokenizer, apply_chat_template

# Choices one request may ask for (prompts × n), and stop strings and stop token ids per request.
MAX_CHOICES = 64
MAX_STOP = 16
# Prompt log-probability entries (prompt tokens × (alternatives + 1)) one prompt may ask for: they travel back in one
# message (`wire.MAX_HEADER_BYTES`).
MAX_PROMPT_LOGPROB_ENTRIES = 1 << 16
# Completions' default `max_tokens` (OpenAI's); chat's default is what the model's context leaves.
DEFAULT_MAX_TOKENS = 16

# OpenAI's error `type` for each status the front door answers with.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
               413: "invalid_request_error", 431: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
               503: "service_unavailable"}

# Fields accepted only where they change nothing: at these values (`best_of` also when it equals `n`).
NO_OP = {"logit_bias": ({},), "best_of": (1,), "suffix": ("",)}
# The fields each route honours: those its typed model (`/openapi.json`) declares, less the no-op ones.
MODELS: dict[str, type[BaseModel]] = {"completion": CompletionRequest, "chat": ChatCompletionRequest}
FIELDS = {kind: set(model.model_fields) - set(NO_OP) for kind, model in MODELS.items()}
ROLES = ("system", "developer", "user", "assistant", "tool")


class ApiError(Exception):
    """An HTTP error in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, headers: tuple[tuple[bytes, bytes], ...] = (),
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.headers, self.param = status, message, headers, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.status}}


def error_event(e: dict[str, Any]) -> ApiError:
    """The HTTP error for a coordinator `error` event; `type: rate_limited` becomes 429 with Retry-After."""
    message = f"{e.get('problem')} Fix: {e.get('fix')}"
    if e.get("type") == "rate_limited":
        retry = max(1, round(float(e.get("retry_after_s", 1))))
        return ApiError(429, message, ((b"retry-after", str(retry).encode()),))
    status = e.get("status")
    return ApiError(status if is_int(status) and 400 <= status < 600 else 500, message)


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param)


@dataclass(frozen=True)
class ApiRequest:
    """One completions or chat request as the front door runs it: each prompt (text or token ids) is generated
    `n` times, choice `i * n + j` with seed `seed + j`."""

    kind: str
    model: str
    prompts: tuple[str | tuple[int, ...], ...]
    max_tokens: int | None
    sampling: SamplingParams
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    ignore_eos: bool = False
    # vLLM's: every stream chunk carries the usage so far (with include_usage).
    continuous_usage: bool = False
    skip_special_tokens: bool = True
    # Chat tools (`runtime/tools.py`): how the output becomes tool calls; None without tools.
    tool_plan: tools.ToolPlan | None = None

    @property
    def echo_logprobs(self) -> bool:
        """Echo with logprobs: the prompt's tokens and log-probabilities come first (vLLM's)."""
        return self.echo and self.sampling.logprobs is not None

    def prompt_ids(self, i: int) -> list[int]:
        prompt = self.prompts[i]
        return list(prompt) if isinstance(prompt, tuple) else ByteTokenizer().encode(prompt)

    def prompt_tokens(self, i: int) -> int:
        return len(self.prompt_ids(i))

    def submissions(self) -> list[dict[str, Any]]:
        """The coordinator `submit` headers, one per choice in choice order."""
        out = []
        for i, prompt in enumerate(self.prompts):
            text = {"prompt": prompt} if isinstance(prompt, str) else {"prompt_tokens": list(prompt)}
            # What the engine needs of the prompt: where outputs start (min_tokens) and, for the repetition
            # penalty only, its tokens.
            known: dict[str, int | tuple[int, ...]] = {"prompt_len": self.prompt_tokens(i)}
            if self.sampling.repetition_penalty != 1:
                ids = ByteTokenizer().encode(prompt) if isinstance(prompt, str) else list(prompt)
                known["prompt_token_ids"] = tuple(sorted(set(ids)))
            for j in range(self.n):
                sampling = SamplingParams(**{**self.sampling.message(), **known,
                                             "seed": (self.sampling.seed + j) % (1 << 63)})
                out.append({"kind": Kind.SUBMIT, "model": self.model, "max_tokens": self.max_tokens,
                            "ignore_eos": self.ignore_eos, "sampling": sampling.message(), **text})
        return out


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not low <= value <= high:
        raise _bad(name, f"{name}={value!r} must be a number in [{low:g}, {high:g}]")
    return float(value)


@overload
def _int(body: dict[str, Any], name: str, default: int, low: int, high: int) -> int: ...


@overload
def _int(body: dict[str, Any], name: str, default: None, low: int, high: int) -> int | None: ...


def _int(body: dict[str, Any], name: str, default: int | None, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if not is_int(value) or not low <= value <= high:
        raise _bad(name, f"{name}={value!r} must be an integer in [{low}, {high}]")
    return value


def _bool(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad(name, f"{name}={value!r} must be true or false")
    return value


def _check_fields(body: dict[str, Any], kind: str) -> None:
    for name, value in body.items():
        if name in FIELDS[kind]:
            continue
        if name in NO_OP and name in MODELS[kind].model_fields:
            if value is None or value in NO_OP[name] or (name == "best_of" and value == body.get("n", 1)):
                continue
            raise _bad(name, f"{name}={value!r} is not supported; leave it out (Coral serves "
                             f"{', '.join(sorted(FIELDS[kind]))})")
        route = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        raise _bad(name, f"unknown or unsupported field {name!r} for {route}; "
                         f"supported: {', '.join(sorted(FIELDS[kind]))}")


def _prompts(body: dict[str, Any]) -> list[str | tuple[int, ...]]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        return [tuple(prompt)]
    if isinstance(prompt, list) and prompt and all(
            isinstance(p, str) or (isinstance(p, list) and p and all(is_int(t) for t in p)) for p in prompt):
        return [p if isinstance(p, str) else tuple(p) for p in prompt]
    raise _bad("prompt", "prompt must be a string, a list of strings, a list of token ids, or a list of those")


def _content(message: Any, i: int, parser: str) -> dict[str, str]:
    """One chat message as the template reads it: a role and text (text parts joined; an assistant's tool calls
    written back as it would have said them, in the model's tool-call `parser`'s format)."""
    if not isinstance(message, dict) or set(message) - {"role", "content", "name", "tool_calls", "tool_call_id"}:
        raise _bad("messages", f"messages[{i}] must be an object with role and content (and optionally name, "
                               "tool_calls, tool_call_id)")
    role, content = message.get("role"), message.get("content")
    if role == "assistant" and message.get("tool_calls"):
        if not isinstance(message["tool_calls"], list):
            raise _bad("messages", f"messages[{i}].tool_calls must be a list of calls")
        return {"role": role, "content": tools.rendered(message, content if isinstance(content, str) else "",
                                                        parser)}
    if role not in ROLES:
        raise _bad("messages", f"messages[{i}].role={role!r}: use one of {', '.join(ROLES)}")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise _bad("messages", f"messages[{i}].content: only text parts ({{\"type\": \"text\", \"text\": …}}) "
                                   "are supported")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise _bad("messages", f"messages[{i}].content must be a string or a list of text parts")
    return {"role": role, "content": content}


def _stop(body: dict[str, Any]) -> tuple[tuple[str, ...], frozenset[int]]:
    stop = body.get("stop")
    strings = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(strings, list) or len(strings) > MAX_STOP or not all(isinstance(s, str) and s for s in strings):
        raise _bad("stop", f"stop must be a non-empty string or a list of at most {MAX_STOP} of them")
    ids = body.get("stop_token_ids") or []
    if not isinstance(ids, list) or len(ids) > MAX_STOP or not all(is_int(t) and t >= 0 for t in ids):
        raise _bad("stop_token_ids", f"stop_token_ids must be a list of at most {MAX_STOP} token ids")
    return tuple(strings), frozenset(ids)


def parse_request(body: Any, kind: str, models: list[str], context: dict[str, int | None]) -> ApiRequest:
    """Read a `/v1/completions` (`kind="completion"`) or `/v1/chat/completions` (`"chat"`) body, refusing every
    field it cannot honour. Token ids, vocabulary and context are the coordinator's to check."""
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    _check_fields(body, kind)
    model = body.get("model") or (models[0] if len(models) == 1 else None)
    if not isinstance(model, str):
        raise _bad("model", f"name the model; served: {', '.join(models) or 'none yet'}")
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _bad("messages", "messages must be a non-empty list of {role, content} objects")
        parser = tools.parser_for(model)
        prompts: list[str | tuple[int, ...]] = [apply_chat_template([_content(m, i, parser)
                                                                     for i, m in enumerate(messages)])]
        if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
            raise _bad("max_completion_tokens", "send max_completion_tokens or max_tokens, not both")
        if body.get("top_logprobs") is not None and body.get("logprobs") is not True:
            raise _bad("top_logprobs", "top_logprobs needs logprobs: true")
        logprobs = _int(body, "top_logprobs", 0, 0, MAX_LOGPROBS) if _bool(body, "logprobs") else None
        limit_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    else:
        prompts = _prompts(body)
        logprobs = _int(body, "logprobs", None, 0, MAX_LOGPROBS)
        limit_name = "max_tokens"
    n = _int(body, "n", 1, 1, MAX_CHOICES)
    if n * len(prompts) > MAX_CHOICES:
        raise _bad("n", f"{len(prompts)} prompts × n={n} choices exceed {MAX_CHOICES}; send several requests")
    limit = body.get(limit_name)
    try:
        max_tokens = max_tokens_of(limit) if limit is not None else None
    except RequestError as exc:
        raise _bad(limit_name, str(exc)) from None
    if max_tokens is None:
        room = context.get(model)
        if kind == "completion" or room is None:
            max_tokens = DEFAULT_MAX_TOKENS
        else:
            max_tokens = max(1, room - max(len(ByteTokenizer().encode(p)) if isinstance(p, str) else len(p)
                                           for p in prompts))
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise _bad("stream_options", "stream_options needs stream: true")
        if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
            raise _bad("stream_options", "stream_options supports include_usage and continuous_usage_stats")
    include_usage = bool(options and _bool(options, "include_usage"))
    # As vLLM: continuous usage needs include_usage.
    continuous = include_usage and bool(options and _bool(options, "continuous_usage_stats"))
    prompt_logprobs = _prompt_logprobs(body, kind, logprobs, stream, prompts)
    temperature = _number(body, "temperature", 0.0, 0.0, 2.0)
    seed = _int(body, "seed", None, -(1 << 63), (1 << 64) - 1)
    stop, stop_ids = _stop(body)
    min_tokens = _int(body, "min_tokens", 0, 0, max_tokens or 0)
    try:
        grammar = structured.read(body)
        tool_plan = tools.plan(body, tools.parser_for(model)) if kind == "chat" else None
        if tool_plan is not None and tool_plan.grammar is not None:
            if grammar is not None:
                raise structured.StructuredError("tool_choice", "a required or named tool_choice is a structured "
                                                                "output already; leave the other one out")
            structured.check(tool_plan.grammar, "tools")
            grammar = tool_plan.grammar
    except structured.StructuredError as exc:
        raise _bad(exc.param, exc.problem) from None
    try:
        sampling = SamplingParams(temperature=temperature, top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
                                  top_k=_int(body, "top_k", 0, -1, 1 << 31),
                                  seed=(secrets.randbits(63) if seed is None else seed % (1 << 63)),
                                  logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                                  presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
                                  frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
                                  repetition_penalty=_penalty(body), min_tokens=min_tokens or 0,
                                  stop_token_ids=tuple(sorted(stop_ids)), structured=grammar)
    except RequestError as exc:
        raise ApiError(400, str(exc)) from None
    skip = body.get("skip_special_tokens", True)
    if not isinstance(skip, bool):
        raise _bad("skip_special_tokens", f"skip_special_tokens={skip!r} must be true or false")
    return ApiRequest(kind, model, tuple(prompts), max_tokens, sampling, n, stop, stop_ids, stream, include_usage,
                      kind == "completion" and _bool(body, "echo"), _bool(body, "ignore_eos"), continuous, skip,
                      tool_plan)


def _prompt_logprobs(body: dict[str, Any], kind: str, logprobs: int | None, stream: bool,
                     prompts: list[str | tuple[int, ...]]) -> int | None:
    """vLLM's `prompt_logprobs`, or on completions with `echo` the request's `logprobs` (vLLM's rule)."""
    k = _int(body, "prompt_logprobs", None, 0, MAX_LOGPROBS)
    param = "prompt_logprobs"
    if k is not None and k > 0 and stream:
        raise _bad(param, "prompt_logprobs are not available with stream: true (as in vLLM); stream echo with "
                          "logprobs on /v1/completions, or leave stream out")
    if k is None and kind == "completion" and _bool(body, "echo"):
        k, param = logprobs, "logprobs"
    if k is None:
        return None
    longest = max(len(p) if isinstance(p, tuple) else len(ByteTokenizer().encode(p)) for p in prompts)
    if longest * (k + 1) > MAX_PROMPT_LOGPROB_ENTRIES:
        raise _bad(param, f"{param}={k} for a prompt of {longest} tokens asks for {longest * (k + 1)} "
                          f"log-probabilities, more than {MAX_PROMPT_LOGPROB_ENTRIES}; ask for fewer alternatives or "
                          "send a shorter prompt")
    return k


def _penalty(body: dict[str, Any]) -> float:
    value = _number(body, "repetition_penalty", 1.0, 0.0, 2.0)
    if value == 0:
        raise _bad("repetition_penalty", "repetition_penalty must be in (0, 2]; 1 changes nothing")
    return value


@dataclass
class Piece:
    """Output a choice releases at once: text, the tokens it came from, their log-probabilities."""

    text: str = ""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)


class Choice:
    """One choice's output as it streams in: stop strings end it (the text cut before the stop string, as vLLM
    does), stop token ids end it (the token left out, like EOS), and text that may yet begin a stop string is held
    back until it cannot."""

    def __init__(self, index: int, stop: tuple[str, ...], stop_ids: frozenset[int], prompt_tokens: int,
                 min_tokens: int = 0, skip_special_tokens: bool = True) -> None:
        self.index, self.stop, self.stop_ids, self.prompt_tokens = index, stop, stop_ids, prompt_tokens
        self.min_tokens, self.skip_special_tokens = min_tokens, skip_special_tokens
        # vLLM's `stop_reason`: the stop string or token id that ended the choice (None: EOS or length).
        self.stop_reason: str | int | None = None
        self.text = ""
        self.spans: list[tuple[int, int, int, TokenLogprobs | None]] = []  # token, text start, end, logprobs
        self.released = self.released_tokens = self.generated = 0
        self.finish: str | None = None
        self.out = Piece()
        # The prompt's log-probabilities (None for the first token), when the request asked for them.
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None
        # Characters of `out.text` a streamed tool-using choice has sent as content (`tool_chunks`).
        self.content_sent = 0

    def add(self, token: int, text: str, logprobs: TokenLogprobs | None) -> Piece:
        """Take one generated token; what can be released now (`finish` is set once a stop ended the choice)."""
        self.generated += 1
        # As vLLM: neither stop token ids nor stop strings end a choice before `min_tokens` outputs.
        stopping = self.generated > self.min_tokens
        if stopping and token in self.stop_ids:
            self.finish, self.stop_reason = "stop", token
            return self._release(len(self.text))
        if not self.skip_special_tokens and token in (BOS, EOS):
            text = f"<|{token}|>"
        self.spans.append((token, len(self.text), len(self.text) + len(text), logprobs))
        self.text += text
        hold = max((len(s) for s in self.stop), default=1) - 1
        if not stopping:
            return self._release(len(self.text) - hold)
        hits = [(i, s) for i, s in ((self.text.find(s, max(0, self.released - len(s) + 1)), s) for s in self.stop)
                if i >= 0]
        if hits:
            at, self.stop_reason = min(hits)
            self.finish = "stop"
            self.text = self.text[:at]
            return self._release(len(self.text))
        return self._release(len(self.text) - hold)

    def done(self, reason: str) -> Piece:
        """The engine finished the choice: release the rest."""
        self.finish = self.finish or reason
        return self._release(len(self.text))

    def _release(self, upto: int) -> Piece:
        upto = max(upto, self.released)
        piece = Piece(self.text[self.released:upto])
        while self.released_tokens < len(self.spans) and self.spans[self.released_tokens][2] <= upto:
            token, _, _, lp = self.spans[self.released_tokens]
            piece.tokens.append(token)
            piece.logprobs.append(lp)
            self.released_tokens += 1
        self.released = upto
        self.out.text += piece.text
        self.out.tokens += piece.tokens
        self.out.logprobs += piece.logprobs
        return piece


def _token_text(token: int) -> str:
    return ByteTokenizer().decode_token(token)


def _logprobs(piece: Piece) -> list[TokenLogprobs] | None:
    """The log-probabilities of `piece`'s tokens, or None where the request asked for none (a choice's tokens
    carry them all or none)."""
    if not piece.logprobs or piece.logprobs[0] is None:
        return None
    present = [lp for lp in piece.logprobs if lp is not None]
    if len(present) != len(piece.logprobs):
        raise RuntimeError("log-probabilities arrived for only some of a choice's tokens")
    return present


def echoed(req: ApiRequest, c: Choice) -> tuple[list[int], list[TokenLogprobs | None]]:
    """Choice `c`'s prompt tokens and their log-probabilities (None for the first), which echo with logprobs puts
    first."""
    ids = req.prompt_ids(c.index // req.n)
    if c.prompt_logprobs is None or len(c.prompt_logprobs) != len(ids):
        raise RuntimeError(f"choice {c.index}: the prompt's log-probabilities did not arrive whole")
    return ids, c.prompt_logprobs


def completion_logprobs(piece: Piece, offset: int,
                        prompt: tuple[list[int], list[TokenLogprobs | None]] | None = None) -> dict[str, Any] | None:
    """The legacy completions `logprobs` object of `piece`, text offsets from `offset`; with `prompt` (echo), the
    prompt's tokens and log-probabilities first. Each `top_logprobs` entry holds the token itself and the k most
    likely (vLLM's), and is null where the token has no log-probability (the prompt's first)."""
    logprobs = _logprobs(piece)
    if prompt is None and logprobs is None:
        return None
    tokens = [*(prompt[0] if prompt else []), *piece.tokens]
    values = [*(prompt[1] if prompt else []), *(logprobs or [])]
    texts = [_token_text(t) for t in tokens]
    offsets, at = [], offset
    for text in texts:
        offsets.append(at)
        at += len(text)
    return {"tokens": texts, "token_logprobs": [lp.logprob if lp else None for lp in values],
            "top_logprobs": [{_token_text(t): lp.logprob, **{_token_text(a): v for a, v in lp.top}} if lp else None
                             for t, lp in zip(tokens, values)],
            "text_offset": offsets}


def vllm_prompt_logprobs(req: ApiRequest, c: Choice) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt token null (the first) or, by token id, the token's and the k most
    likely's `{logprob, rank, decoded_token}`."""
    ids, values = echoed(req, c)
    out: list[dict[str, Any] | None] = []
    for token, lp in zip(ids, values):
        if lp is None:
            out.append(None)
            continue
        entry = {str(token): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": _token_text(token)}}
        for rank, (t, v) in enumerate(lp.top, 1):
            entry.setdefault(str(t), {"logprob": v, "rank": rank, "decoded_token": _token_text(t)})
        out.append(entry)
    return out


def _entry(token: int, logprob: float) -> dict[str, Any]:
    text = _token_text(token)
    return {"token": text, "logprob": logprob,
            "bytes": [token] if token < 256 else list(text.encode())}


def chat_logprobs(piece: Piece) -> dict[str, Any] | None:
    """The chat `logprobs` object of `piece` (`{"content": [...]}`)."""
    logprobs = _logprobs(piece)
    if logprobs is None:
        return None
    return {"content": [{**_entry(t, lp.logprob), "top_logprobs": [_entry(a, v) for a, v in lp.top]}
                        for t, lp in zip(piece.tokens, logprobs)]}


def usage(choices: list[Choice], req: ApiRequest) -> dict[str, int]:
    """Prompt tokens once per prompt (as OpenAI counts them with n > 1) and every generated token."""
    prompt = sum(req.prompt_tokens(i) for i in range(len(req.prompts)))
    completion = sum(c.generated for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def prompt_text(req: ApiRequest, index: int) -> str:
    prompt = req.prompts[index // req.n]
    return prompt if isinstance(prompt, str) else ByteTokenizer().decode(list(prompt))


def response(req: ApiRequest, meta: dict[str, Any], choices: list[Choice]) -> dict[str, Any]:
    """The whole (non-streamed) response object."""
    out = []
    asked = req.sampling.prompt_logprobs is not None
    for c in choices:
        if req.kind == "chat":
            message, finish = assistant(req, c)
            out.append({"index": c.index, "message": message, "logprobs": chat_logprobs(c.out),
                        "finish_reason": finish, "stop_reason": c.stop_reason})
        else:
            echo = prompt_text(req, c.index) if req.echo else ""
            logprobs = completion_logprobs(c.out, 0, echoed(req, c) if req.echo_logprobs else None)
            out.append({"index": c.index, "text": echo + c.out.text, "logprobs": logprobs,
                        "finish_reason": c.finish, "stop_reason": c.stop_reason, "token_ids": c.out.tokens,
                        **({"prompt_logprobs": vllm_prompt_logprobs(req, c)} if asked else {})})
    # vLLM's chat answer carries the (one) prompt's log-probabilities beside its choices.
    whole = {"prompt_logprobs": vllm_prompt_logprobs(req, choices[0])} if asked and req.kind == "chat" else {}
    return {**meta, "choices": out, "usage": usage(choices, req), **whole}


def assistant(req: ApiRequest, c: Choice) -> tuple[dict[str, Any], str | None]:
    """A finished chat choice's message and finish reason: its text, or the tool calls in it (finish reason
    `tool_calls` for `required` and `auto`, as vLLM answers; a named call keeps `stop`)."""
    if req.tool_plan is None:
        return {"role": "assistant", "content": c.out.text}, c.finish
    # Byte tokens show as one Latin-1 character each; the calls are read from the UTF-8 they spell.
    text = c.out.text.encode("latin-1", "replace").decode("utf-8", "replace")
    found, content = tools.calls(req.tool_plan, text)
    if not found:
        return {"role": "assistant", "content": c.out.text}, c.finish
    finish = c.finish if req.tool_plan.mode == "named" or c.finish != "stop" else "tool_calls"
    return {"role": "assistant", "content": content or None, "tool_calls": found}, finish


def tool_chunks(req: ApiRequest, meta: dict[str, Any], c: Choice) -> list[dict[str, Any]]:
    """A streamed tool-using choice's chunks for what it released so far: under `auto`, the content in which the
    model's parser says no call can begin goes out as it comes; at the choice's end, the rest of its content or its
    calls (OpenAI's delta shape, each call whole in one delta), then its finish. `c.content_sent` counts what went."""
    tp = req.tool_plan
    if tp is None:
        raise RuntimeError("tool chunks of a request without tools")
    text = c.out.text
    upto = tools.PARSERS[tp.parser].start(text) if tp.mode == "auto" else 0
    message, finish = assistant(req, c) if c.finish else ({}, None)
    if c.finish and "tool_calls" not in message:
        upto = len(text)
    delta: dict[str, Any] = {"content": text[c.content_sent:upto]} if upto > c.content_sent else {}
    c.content_sent = max(c.content_sent, upto)
    if "tool_calls" in message:
        delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
    out = [{**meta, "choices": [{"index": c.index, "delta": delta, "logprobs": None, "finish_reason": None}]}
           ] if delta else []
    if c.finish:
        out.append({**meta, "choices": [{"index": c.index, "delta": {}, "logprobs": None, "finish_reason": finish,
                                         "stop_reason": c.stop_reason}]})
    return out


def chunk(req: ApiRequest, meta: dict[str, Any], c: Choice, piece: Piece | None, finish: str | None,
          first: bool = False) -> dict[str, Any]:
    """One stream chunk of choice `c`: its released `piece` (chat's first chunk names the role), or its finish."""
    piece = piece or Piece()
    if req.kind == "chat":
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else (
            {"content": piece.text} if piece.text else {})
        body = {"index": c.index, "delta": delta, "logprobs": chat_logprobs(piece), "finish_reason": finish}
    else:
        # Echo with logprobs: offsets run over the prompt's tokens first, as the first chunk reports them.
        echo = echoed(req, c) if req.echo_logprobs else None
        base = len(ByteTokenizer().decode(echo[0])) if echo else 0
        offset = 0 if first and echo else base + len(c.out.text) - len(piece.text)
        text = (prompt_text(req, c.index) if first and req.echo else "") + piece.text
        body = {"index": c.index, "text": text, "logprobs": completion_logprobs(piece, offset,
                                                                                echo if first else None),
                "finish_reason": finish, **({"token_ids": piece.tokens} if piece.tokens else {})}
    if finish:
        body["stop_reason"] = c.stop_reason
    out = {**meta, "choices": [body]}
    if req.continuous_usage:
        # vLLM's continuous usage: this choice's prompt and what it generated so far.
        out["usage"] = {"prompt_tokens": c.prompt_tokens, "completion_tokens": c.generated,
                        "total_tokens": c.prompt_tokens + c.generated}
    return out


def response_meta(req: ApiRequest, rid: str, created: int, stream: bool) -> dict[str, Any]:
    """The id, object, created and model every response or chunk of a request carries."""
    obj = {"chat": "chat.completion", "completion": "text_completion"}[req.kind]
    prefix = "chatcmpl" if req.kind == "chat" else "cmpl"
    return {"id": f"{prefix}-{rid}", "object": f"{obj}.chunk" if stream and req.kind == "chat" else obj,
            "created": created, "model": req.model}
