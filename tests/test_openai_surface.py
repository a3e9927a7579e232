"""vLLM's server surface beside the OpenAI routes: /openapi.json and /docs (checked against what the server really
answers), /tokenize and /detokenize (against the byte tokenizer's closed form and the prompt tokens a real completion
counts), /version (against pyproject.toml), /ping, X-Request-Id, CORS, `Allow` on 405s, text that is not Unicode."""

from __future__ import annotations

import http.client
import json
import time
import tomllib
from contextlib import ExitStack
from pathlib import Path

import httpx
import jsonschema
import pytest
import zmq

from coral_dagster.runtime.config import CoordinatorConfig, Timing
from coral_dagster.runtime.coordinator import Coordinator
from coral_dagster.runtime.local import free_port
from coral_dagster.runtime.security import CurveKeys

pytest.importorskip("coral_dagster.runtime.torch_engine")
from support.openai_stack import CFG, KEY, MODEL, PROMPT, Served  # noqa: E402 - needs torch

AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def served():
    with ExitStack() as stack:
        yield Served(stack)


def _schema(doc: dict, name: str) -> dict:
    """Component `name` with the document's components beside it, so `$ref`s resolve."""
    return {**doc["components"]["schemas"][name], "components": doc["components"]}


def test_openapi_describes_what_the_server_really_answers(served):
    doc = httpx.get(f"{served.url}/openapi.json").json()
    assert doc["openapi"].startswith("3.")
    for path, method in (("/v1/completions", "post"), ("/v1/chat/completions", "post"), ("/tokenize", "post"),
                         ("/detokenize", "post"), ("/v1/models", "get"), ("/version", "get"), ("/ping", "get")):
        assert method in doc["paths"][path], path
    # Real answers validate against the document's response schemas.
    done = httpx.post(f"{served.url}/v1/completions", headers=AUTH, timeout=60,
                      json={"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "logprobs": 1}).json()
    jsonschema.validate(done, _schema(doc, "CompletionResponse"))
    echoed = httpx.post(f"{served.url}/v1/completions", headers=AUTH, timeout=60,
                        json={"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "logprobs": 1, "echo": True}).json()
    assert echoed["choices"][0]["prompt_logprobs"][0] is None
    jsonschema.validate(echoed, _schema(doc, "CompletionResponse"))
    chat = httpx.post(f"{served.url}/v1/chat/completions", headers=AUTH, timeout=60,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                            "logprobs": True, "top_logprobs": 2, "prompt_logprobs": 1}).json()
    assert chat["prompt_logprobs"][1]
    jsonschema.validate(chat, _schema(doc, "ChatCompletionResponse"))
    jsonschema.validate(httpx.get(f"{served.url}/v1/models", headers=AUTH).json(), _schema(doc, "ModelList"))
    # Every request field the document declares is accepted by the server (at a value that changes nothing)...
    neutral = {"model": MODEL, "max_tokens": 1, "temperature": 0, "top_p": 1, "top_k": 0, "seed": 1, "n": 1,
               "stop": ["zz"], "stop_token_ids": [], "stream": False, "ignore_eos": False, "user": "u",
               "presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1, "logit_bias": {},
               "logprobs": None, "echo": False, "best_of": 1, "suffix": "", "top_logprobs": None,
               "max_completion_tokens": None, "parallel_tool_calls": False, "tools": [], "min_tokens": 0,
               "skip_special_tokens": True, "response_format": {"type": "text"}, "structured_outputs": None,
               "guided_json": None, "guided_regex": None, "guided_choice": None, "tool_choice": "none",
                   "prompt_logprobs": None}
    for route, name, extra in (("/v1/completions", "CompletionRequest", {"prompt": "x"}),
                               ("/v1/chat/completions", "ChatCompletionRequest",
                                {"messages": [{"role": "user", "content": "x"}]})):
        declared = set(doc["components"]["schemas"][name]["properties"]) - {"stream_options"}
        body = {**{k: neutral[k] for k in declared if k in neutral}, **extra}
        assert set(body) == declared, declared - set(body)
        jsonschema.validate(body, _schema(doc, name))
        r = httpx.post(f"{served.url}{route}", headers=AUTH, json=body, timeout=60)
        assert r.status_code == 200, (route, r.text)
        # ...and a field it does not declare is refused, by the schema and the server alike.
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({**body, "no_such_field": 1}, _schema(doc, name))
        r = httpx.post(f"{served.url}{route}", headers=AUTH, json={**body, "no_such_field": 1}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "no_such_field"
    page = httpx.get(f"{served.url}/docs")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/openapi.json" in page.text and "swagger" in page.text.lower()


def test_tokenize_counts_what_a_completion_counts_and_detokenize_inverts_it(served):
    text = "Récif, 珊瑚"
    r = httpx.post(f"{served.url}/tokenize", headers=AUTH, json={"model": MODEL, "prompt": text,
                                                                   "return_token_strs": True}).json()
    # The byte tokenizer's closed form: BOS, then the UTF-8 bytes.
    assert r["tokens"] == [256, *text.encode()] and r["count"] == len(text.encode()) + 1
    assert r["max_model_len"] == CFG.max_context and len(r["token_strs"]) == r["count"]
    done = served.client.completions.create(model=MODEL, prompt=text, max_tokens=1)
    assert done.usage.prompt_tokens == r["count"]
    bare = httpx.post(f"{served.url}/tokenize", headers=AUTH,
                      json={"prompt": text, "add_special_tokens": False}).json()
    assert bare["tokens"] == list(text.encode())
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Which reef?"}]
    chat = httpx.post(f"{served.url}/tokenize", headers=AUTH, json={"model": MODEL, "messages": messages}).json()
    answered = served.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert chat["count"] == answered.usage.prompt_tokens
    back = httpx.post(f"{served.url}/detokenize", headers=AUTH, json={"model": MODEL, "tokens": bare["tokens"]})
    assert back.json()["prompt"] == text
    specials = httpx.post(f"{served.url}/detokenize", headers=AUTH, json={"tokens": [256, 0xC3, 0xA9, 300, 0xC3]})
    assert specials.json()["prompt"] == "é<|300|>\ufffd"
    for route, body, param in (("/tokenize", {"model": MODEL, "prompt": 3}, "prompt"),
                               ("/tokenize", {"prompt": "x", "extra": 1}, "extra"),
                               ("/detokenize", {"tokens": [-1]}, "tokens"),
                               ("/detokenize", {"tokens": [10 ** 6]}, "tokens"),
                               ("/tokenize", {"model": "other", "prompt": "x"}, "model")):
        r = httpx.post(f"{served.url}{route}", headers=AUTH, json=body)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, (body, r.text)
    assert httpx.post(f"{served.url}/tokenize", json={"prompt": "x"}).status_code == 401


def test_version_ping_and_health(served):
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert httpx.get(f"{served.url}/version").json() == {"version": pyproject["project"]["version"]}
    assert httpx.get(f"{served.url}/ping").status_code == 200
    assert httpx.post(f"{served.url}/ping").status_code == 200
    assert httpx.get(f"{served.url}/health").json()["serving"] == [MODEL]
    doc = httpx.get(f"{served.url}/openapi.json").json()
    for path in ("/health", "/ping"):
        jsonschema.validate(httpx.get(f"{served.url}{path}").json(), _schema(doc, "HealthResponse"))
    jsonschema.validate(httpx.get(f"{served.url}/version").json(), _schema(doc, "VersionResponse"))


def test_x_request_id_is_honoured_and_echoed(served):
    r = httpx.post(f"{served.url}/v1/completions", headers={**AUTH, "X-Request-Id": "trace-42"},
                   json={"model": MODEL, "prompt": "x", "max_tokens": 1}, timeout=60)
    assert r.headers["x-request-id"] == "trace-42" and r.json()["id"] == "cmpl-trace-42"
    with httpx.stream("POST", f"{served.url}/v1/chat/completions", headers={**AUTH, "X-Request-Id": "s-1"},
                      json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                            "stream": True}, timeout=60) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert s.headers["x-request-id"] == "s-1" and {e["id"] for e in events} == {"chatcmpl-s-1"}
    # Errors carry it too; none sent (or one not printable): a fresh one per request.
    assert httpx.get(f"{served.url}/nowhere", headers={**AUTH, "X-Request-Id": "e-1"}).headers["x-request-id"] == "e-1"
    fresh = {httpx.get(f"{served.url}/version", headers={"X-Request-Id": "bad id"}).headers["x-request-id"]
             for _ in range(2)}
    assert len(fresh) == 2 and "bad id" not in fresh


def test_405_names_the_allowed_methods(served):
    r = httpx.get(f"{served.url}/v1/completions", headers=AUTH)
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    r = httpx.delete(f"{served.url}/ping", headers=AUTH)
    assert r.status_code == 405 and r.headers["allow"] == "GET, POST"
    # Without CORS configured, a preflight is a 405 like any other method.
    assert httpx.options(f"{served.url}/v1/completions", headers=AUTH).status_code == 405


def _raw_post(port: int, path: str, payload: bytes) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", path, body=payload, headers={**AUTH, "Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


@pytest.mark.parametrize("path, payload, param", [
    ("/v1/completions", b'{"model": "tiny-llama", "prompt": "a\\ud800b", "max_tokens": 1}', "prompt"),
    ("/v1/completions", b'{"model": "tiny-llama", "prompt": ["ok", "\\udfff"], "max_tokens": 1}', "prompt[1]"),
    ("/v1/completions", b'{"model": "tiny-llama", "prompt": "a\xff\xfeb", "max_tokens": 1}', "prompt"),
    ("/v1/chat/completions", b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "\\ud83d"}]}',
     "messages[0].content"),
    ("/v1/chat/completions", b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], '
                             b'"stop": ["\xc3"]}', "stop[0]"),
    ("/tokenize", b'{"prompt": "\\udc00"}', "prompt"),
])
def test_text_that_is_not_unicode_is_a_400_naming_the_field(served, path, payload, param):
    status, body = _raw_post(served.port, path, payload)
    assert status == 400 and body["error"]["param"] == param, body
    # A well-formed surrogate pair is one character and fine.
    status, body = _raw_post(served.port, "/v1/completions",
                             b'{"model": "tiny-llama", "prompt": "\\ud83d\\ude00", "max_tokens": 1}')
    assert status == 200 and body["usage"]["prompt_tokens"] == 1 + len("😀".encode())


def test_cors_answers_preflights_for_the_allowed_origins_only():
    from coral_dagster.runtime.frontdoor import Cors

    port = free_port()
    with ExitStack() as stack:
        ctx = zmq.Context()
        stack.callback(ctx.term)
        coord = Coordinator(CoordinatorConfig(listen="tcp://127.0.0.1:*", http_port=port, api_key=KEY,
                                              timing=Timing(heartbeat_s=0.1, dead_after_s=1.0),
                                              http_allowed_origins=Cors.parse("--allowed-origins",
                                                                              '["https://app.example"]'),
                                              http_allowed_methods=("GET", "POST")),
                            CurveKeys.generate(), ctx=ctx)
        from support.runtime_fakes import background

        background(stack, coord.run)
        url = f"http://127.0.0.1:{port}"
        pre = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
               "Access-Control-Request-Headers": "authorization, content-type"}
        r = httpx.options(f"{url}/v1/completions", headers=pre)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        assert "POST" in r.headers["access-control-allow-methods"]
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        assert httpx.options(f"{url}/v1/completions", headers={**pre, "Origin": "https://evil.example"}
                             ).status_code == 400
        assert httpx.options(f"{url}/v1/completions", headers={**pre, "Access-Control-Request-Method": "DELETE"}
                             ).status_code == 400
        # A real request from the allowed origin carries the header; the API key is still needed.
        r = httpx.get(f"{url}/version", headers={"Origin": "https://app.example"})
        assert r.headers["access-control-allow-origin"] == "https://app.example"
        assert httpx.get(f"{url}/v1/models", headers={"Origin": "https://app.example"}).status_code == 401


def test_a_malformed_cors_setting_is_a_clear_error():
    from click.testing import CliRunner

    from coral_dagster.cli.main import main

    result = CliRunner().invoke(main, ["serve", "coordinator", "--allowed-origins", "https://app.example"],
                                env={"CORAL_API_KEY": KEY})
    assert result.exit_code != 0 and "JSON list" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("prompt", ["é" * 1_900_000, "a" * 4_194_150])
def test_a_body_under_the_cap_that_cannot_reach_the_coordinator_is_an_immediate_413(served, prompt):
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 1}, ensure_ascii=False).encode()
    assert len(body) < 4 << 20
    started = time.monotonic()
    status, reply = _raw_post(served.port, "/v1/completions", body)
    assert status == 413 and reply["error"]["param"] == "prompt", reply
    assert time.monotonic() - started < 10
    # The door still serves.
    assert served.client.completions.create(model=MODEL, prompt="x", max_tokens=1).choices
