"""The front door's typed API (pydantic models of every request and response body) and the OpenAPI document and
Swagger page FastAPI generates from them, served at `/openapi.json` and `/docs` as vLLM's server serves its own.

The request models are also the front door's list of accepted fields: `openai_protocol` refuses any field a model
here does not declare, so the document and the parser cannot disagree.
"""

from __future__ import annotations

from functools import lru_cache
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

TITLE = "Coral OpenAI-compatible API"


def coral_version() -> str:
    """The installed package's version (what `/version` answers)."""
    try:
        return version("coral-dagster")
    except PackageNotFoundError:
        return "0.0.0+unknown"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool | None = Field(None, description="Send a last chunk with the usage and no choices.")
    continuous_usage_stats: bool | None = Field(None, description="vLLM's: every chunk carries the usage so far.")


class JsonSchemaFormat(_Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs`: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    json_object: bool | None = None


class _Sampling(_Strict):
    model: str | None = Field(None, description="A served model; may be left out when only one is served.")
    max_tokens: int | None = Field(None, ge=1, description="Most tokens to generate.")
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="vLLM's: keep the k most likely tokens (0 or -1: all).")
    seed: int | None = None
    n: int | None = Field(None, ge=1, le=64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, description="vLLM's: token ids that end a choice.")
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = Field(None, description="vLLM's: generate past the end-of-sequence token.")
    user: str | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2, description="Subtracted once per generated token.")
    frequency_penalty: float | None = Field(None, ge=-2, le=2, description="Times each generated token's count.")
    repetition_penalty: float | None = Field(None, gt=0, le=2, description="vLLM's: divides positive (multiplies "
                                             "negative) logits of tokens in the prompt or output.")
    min_tokens: int | None = Field(None, ge=0, description="vLLM's: no EOS, stop token or stop string before.")
    response_format: ResponseFormat | None = Field(None, description="JSON mode or a JSON schema every output "
                                                   "follows (llguidance on the torch engine, vLLM's own on vLLM).")
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = Field(None, description="vLLM's older name of structured_outputs.json.")
    guided_regex: str | None = Field(None, description="vLLM's older name of structured_outputs.regex.")
    guided_choice: list[str] | None = Field(None, description="vLLM's older name of structured_outputs.choice.")
    skip_special_tokens: bool | None = Field(None, description="vLLM's: leave BOS/EOS out of the text (default).")
    prompt_logprobs: int | None = Field(None, ge=0, le=20, description="vLLM's: each prompt token's log-probability, "
                                        "rank and the k most likely there (not with stream: true).")
    # Accepted only at the value that changes nothing (a 400 otherwise).
    logit_bias: dict[str, float] | None = Field(None, description="Only {} is accepted.")


class CompletionRequest(_Sampling):
    """`POST /v1/completions`."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool | None = None
    best_of: int | None = Field(None, description="Only equal to n is accepted.")
    suffix: str | None = Field(None, description="Only '' is accepted.")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="The arguments, a JSON string.")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="An assistant turn's calls.")
    tool_call_id: str | None = Field(None, description="The call a tool turn answers.")


class Function(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: Function


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: dict[str, str]


class ChatCompletionRequest(_Sampling):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    max_completion_tokens: int | None = Field(None, ge=1)
    best_of: int | None = Field(None, description="Only equal to n is accepted.")
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="required and named calls are guaranteed by a grammar; auto calls are read by the Hermes "
                          "parser.")
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call under required.")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None
    decoded_token: str | None


# vLLM's `prompt_logprobs`: per prompt token null (the first) or, by token id, the token's and the k most likely's.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None
    stop_reason: int | str | None = Field(None, description="vLLM's: the stop string or token id that ended it.")
    token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = Field(None, description="vLLM's, with prompt_logprobs (or echo and "
                                                   "logprobs).")


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    """The whole answer; streamed, each `data:` event is a `chat.completion.chunk` of the same shape with `delta`
    in place of `message`."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    prompt_logprobs: PromptLogprobs | None = Field(None, description="vLLM's, with prompt_logprobs.")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeCompletionRequest(_Strict):
    """`POST /tokenize` with a prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = Field(True, description="Begin with the model's BOS token.")
    return_token_strs: bool = False


class TokenizeChatRequest(_Strict):
    """`POST /tokenize` with messages, rendered through the model's chat template first."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = Field(True, description="Begin with the model's BOS token.")
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int | None
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Strict):
    """`POST /detokenize`."""

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class HealthResponse(BaseModel):
    status: Literal["ok", "degraded", "unavailable"]
    serving: list[str]
    degraded: list[str] = Field([], description="Instances holding work without progress.")


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorBody


# The routes the document describes: (method, path, request model, response model, summary).
ROUTES: tuple[tuple[str, str, type[BaseModel] | None, type[BaseModel] | None, str], ...] = (
    ("POST", "/v1/completions", CompletionRequest, CompletionResponse, "Text completion (SSE with stream: true)."),
    ("POST", "/v1/chat/completions", ChatCompletionRequest, ChatCompletionResponse,
     "Chat completion through the model's chat template (SSE with stream: true)."),
    ("GET", "/v1/models", None, ModelList, "The models served now."),
    ("POST", "/tokenize", None, TokenizeResponse, "Token ids of a prompt or of rendered messages."),
    ("POST", "/detokenize", DetokenizeRequest, DetokenizeResponse, "Text of token ids."),
    ("GET", "/version", None, VersionResponse, "Coral's version."),
    ("GET", "/health", None, HealthResponse, "200 once an instance serves, else 503."),
    ("GET", "/ping", None, HealthResponse, "As /health (SageMaker's name)."),
    ("POST", "/ping", None, HealthResponse, "As /health (SageMaker's name)."),
    ("GET", "/metrics", None, None, "Prometheus text: Coral's families and vLLM's."),
)


def _endpoint(request_model: type[BaseModel] | None, path: str) -> Any:
    """A callable whose signature declares the route's body, from which FastAPI derives the document; the front
    door answers the route itself (these are never called)."""
    if path == "/tokenize":
        def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest) -> None:
            raise NotImplementedError
        return tokenize
    if request_model is None:
        def no_body() -> None:
            raise NotImplementedError
        return no_body

    def with_body(body: BaseModel) -> None:
        raise NotImplementedError
    with_body.__annotations__ = {"body": request_model, "return": None}
    return with_body


@lru_cache(maxsize=1)
def openapi_document() -> dict[str, Any]:
    """The OpenAPI 3 document of `ROUTES`, generated by FastAPI from the models above."""
    from fastapi import FastAPI

    app = FastAPI(title=TITLE, version=coral_version(), openapi_url=None, docs_url=None, redoc_url=None,
                  description="vLLM-compatible OpenAI API served by Coral. Send 'Authorization: Bearer <key>' when "
                              "the server has an API key.")
    errors: dict[int | str, dict[str, Any]] = {code: {"model": ErrorResponse} for code in (400, 401, 413, 429, 503)}
    for method, path, request_model, response_model, summary in ROUTES:
        app.add_api_route(path, _endpoint(request_model, path), methods=[method], response_model=response_model,
                          summary=summary, responses=errors, operation_id=f"{method.lower()}{path.replace('/', '_')}")
    return app.openapi()


def swagger_page() -> bytes:
    """The Swagger UI page (`/docs`) reading `/openapi.json`."""
    from fastapi.openapi.docs import get_swagger_ui_html

    return bytes(get_swagger_ui_html(openapi_url="/openapi.json", title=f"{TITLE} - Swagger UI").body)
