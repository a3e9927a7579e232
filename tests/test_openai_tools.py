"""Chat tools as vLLM's server serves them, called with the official client: `required` and named calls (guaranteed
by the grammar engine, so the tiny model's calls always parse), `auto` read by the model's tool-call parser (vLLM's
`--tool-call-parser`: hermes, llama3_json, pythonic; tiny-llama's is Llama 3.1's llama3_json), streamed call deltas in
OpenAI's shape, and a conversation continued after `role: tool` answers. The oracles: the `jsonschema` validator on
every call's arguments against its tool's parameters, the chat template's text written out by hand, and each parser's
format as vLLM's and Meta's documentation show it (docs/features/tool_calling.md; Llama 3.1's JSON-based tool
calling), the test strings written from those pages."""

from __future__ import annotations

import json
from contextlib import ExitStack

import jsonschema
import openai
import pytest

from coral_dagster.runtime.tokenizer import ByteTokenizer

pytest.importorskip("coral_dagster.runtime.torch_engine")
pytest.importorskip("llguidance")
from support.openai_stack import MODEL, Served  # noqa: E402 - needs torch

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lima"]}},
           "required": ["city"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 9}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
PARAMETERS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def served():
    with ExitStack() as stack:
        yield Served(stack)


def _valid(calls) -> list[str]:
    for c in calls:
        assert c.type == "function" and c.id.startswith("chatcmpl-tool-")
        jsonschema.validate(json.loads(c.function.arguments), PARAMETERS[c.function.name])
    return [c.function.name for c in calls]


def test_required_and_named_calls_always_parse_and_validate(served):
    for seed in range(3):
        done = served.client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                                     max_tokens=120, temperature=1.0, seed=seed)
        assert done.choices[0].finish_reason == "tool_calls" and _valid(done.choices[0].message.tool_calls)
    one = served.client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                                parallel_tool_calls=False, max_tokens=120)
    assert len(one.choices[0].message.tool_calls) == 1
    named = served.client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=60,
                                                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert _valid(named.choices[0].message.tool_calls) == ["get_weather"]
    assert named.choices[0].finish_reason == "stop"
    # Without the grammar (tool_choice none) the same model writes no call at all.
    free = served.client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none",
                                                 max_tokens=20)
    assert free.choices[0].message.tool_calls is None and free.choices[0].message.content


def test_streamed_calls_arrive_as_openai_deltas(served):
    # One call (parallel_tool_calls false): the greedy tiny model would otherwise go on listing calls to max_tokens.
    chunks = list(served.client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=120,
                                                        tool_choice="required", parallel_tool_calls=False,
                                                        stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas and [d.index for d in deltas] == list(range(len(deltas)))
    assert all(d.id and d.type == "function" and d.function.name for d in deltas)
    for d in deltas:
        jsonschema.validate(json.loads(d.function.arguments), PARAMETERS[d.function.name])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_conversation_continues_after_tool_answers(served):
    call = served.client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=60,
                                                 tool_choice={"type": "function", "function": {"name": "add"}}
                                                 ).choices[0].message.tool_calls[0]
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    done = served.client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=4,
                                                 extra_body={"ignore_eos": True})
    # The template's text, written out by hand: the call as tiny-llama's family (Llama 3.1, parser llama3_json)
    # writes one, Meta's JSON-based tool calling.
    block = json.dumps({"name": "add", "parameters": json.loads(call.function.arguments)})
    text = (f"<|user|>\n{ASK[0]['content']}\n<|assistant|>\n{block}\n"
            "<|tool|>\nsunny\n<|assistant|>\n")
    assert done.usage.prompt_tokens == len(ByteTokenizer().encode(text))


def test_auto_reads_hermes_calls_and_leaves_plain_text_as_content(served):
    from coral_dagster.runtime.tools import ToolPlan, calls

    plan = ToolPlan("auto", ("get_weather", "add"), parser="hermes")
    # vLLM's documented Hermes output.
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n</tool_call>\n'
            '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
    found, content = calls(plan, text)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in found] == [
        ("get_weather", {"city": "Lima"}), ("add", {"a": 1, "b": 2})]
    assert calls(plan, '<tool_call>{"name": "rm", "arguments": {}}</tool_call>')[0] == []
    # The tiny model, free to answer, writes text: it comes back as content.
    done = served.client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=8)
    assert done.choices[0].message.tool_calls is None and done.choices[0].message.content


@pytest.mark.parametrize("kwargs, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
])
def test_bad_tools_are_400s_naming_the_field(served, kwargs, param):
    with pytest.raises(openai.BadRequestError) as caught:
        served.client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, **kwargs)
    assert caught.value.body["param"] == param, caught.value.body


def _found(parser: str, text: str) -> tuple[list[tuple[str, dict]], str]:
    from coral_dagster.runtime.tools import ToolPlan, calls

    found, content = calls(ToolPlan("auto", ("get_weather", "add"), parser=parser), text)
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in found], content


@pytest.mark.parametrize("text, want", [
    # Meta's JSON-based tool calling (Llama 3.1 model card): one object, `parameters` holding the arguments.
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', [("get_weather", {"city": "Paris"})]),
    # vLLM's llama3_json: after <|python_tag|>, several separated by ";", `arguments` read as well.
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Lima"}}; {"name": "add", "arguments": {"a": 1, '
     '"b": 2}}', [("get_weather", {"city": "Lima"}), ("add", {"a": 1, "b": 2})]),
    # Braces inside the arguments are part of the call, not calls of their own.
    ('{"name": "add", "parameters": {"a": {"x": {}}, "b": 2}}', [("add", {"a": {"x": {}}, "b": 2})]),
    # An object that is no call (no name) leaves the whole output content, as in vLLM.
    ('{"city": "Paris"}', []),
    ('It is sunny in Paris.', []),
    ('{"name": "get_weather", "parameters": {"city": "Paris"}} {"broken": ', []),
])
def test_llama3_json_parser_reads_metas_json_calls(text, want):
    found, content = _found("llama3_json", text)
    assert found == want
    assert content == ("" if want else text)


@pytest.mark.parametrize("text, want", [
    # vLLM's docs, "Models with Pythonic Tool Calls", verbatim.
    ("[get_weather(city='San Francisco', metric='celsius'), get_weather(city='Seattle', metric='celsius')]",
     [("get_weather", {"city": "San Francisco", "metric": "celsius"}),
      ("get_weather", {"city": "Seattle", "metric": "celsius"})]),
    # Python and JSON literals, signed numbers, containers (tuples as lists), no arguments.
    ("[add(a=-1, b=2.5), get_weather(city=None, ok=true, days=(1, 2), extra={'k': [False]}), add()]",
     [("add", {"a": -1, "b": 2.5}),
      ("get_weather", {"city": None, "ok": True, "days": [1, 2], "extra": {"k": [False]}}), ("add", {})]),
    # Text and calls in one output is not the pythonic format (vLLM's docs: "must not generate both").
    ("Sure: [get_weather(city='Paris')]", []),
    # Positional arguments, expressions and unclosed lists are not calls.
    ("[get_weather('Paris')]", []),
    ("[get_weather(city=open('x'))]", []),
    ("[get_weather(city='Paris')", []),
])
def test_pythonic_parser_reads_a_list_of_keyword_calls(text, want):
    found, content = _found("pythonic", text)
    assert found == want
    assert content == ("" if want else text)


def test_calls_to_functions_not_offered_are_dropped():
    assert _found("llama3_json", '{"name": "rm", "parameters": {}}') == ([], '{"name": "rm", "parameters": {}}')
    assert _found("pythonic", "[rm(path='/'), add(a=1, b=2)]")[0] == [("add", {"a": 1, "b": 2})]


@pytest.mark.parametrize("parser, text, content", [
    # What a stream may send at once: nothing that could begin a call, however the output goes on.
    ("hermes", "Let me check.\n<tool_ca", "Let me check.\n"),
    ("hermes", "Let me check.\n<tool_call>{", "Let me check.\n"),
    ("hermes", "All <b>fine</b>", "All <b>fine</b>"),
    ("llama3_json", "Here: {\"name", "Here: "),
    ("llama3_json", "<|python", ""),
    ("llama3_json", "No calls today.", "No calls today."),
    ("pythonic", "[get_wea", ""),
    ("pythonic", "Paris is [sunny]", "Paris is [sunny]"),
])
def test_streamed_content_stops_where_a_call_may_begin(parser, text, content):
    from coral_dagster.runtime.tools import PARSERS

    assert text[:PARSERS[parser].start(text)] == content


def test_each_model_gets_its_familys_parser():
    from coral_dagster.catalog.models import model_catalog
    from coral_dagster.runtime.tools import DEFAULT_PARSER, PARSERS, parser_for

    # vLLM's tool-calling docs: Llama 3.1 -> llama3_json, Qwen -> hermes; tiny models take their base's.
    assert parser_for("llama-3.1-70b") == parser_for("tiny-llama") == parser_for("tiny-llama-3.1-70b") \
        == "llama3_json"
    assert parser_for("qwen3-32b") == parser_for("Qwen/Qwen3-235B-A22B") == "hermes"
    # No parser listed (Llama 2, phi-4) or a model outside the catalog: Coral's default.
    assert parser_for("tiny-llama-2-70b") == parser_for("tiny-phi-4") == parser_for("my-model") == DEFAULT_PARSER
    assert {m.tool_call_parser for m in model_catalog().values()} - {""} <= set(PARSERS)


def test_auto_calls_are_read_by_the_models_parser_whole_and_streamed(served):
    # A grammar makes the tiny model write one Llama 3.1 JSON call; tiny-llama's parser (llama3_json) reads it.
    schema = {"type": "object", "properties": {"name": {"const": "get_weather"}, "parameters": WEATHER},
              "required": ["name", "parameters"], "additionalProperties": False}
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=80,
                  response_format={"type": "json_schema", "json_schema": {"name": "call", "schema": schema}})
    done = served.client.chat.completions.create(**kwargs).choices[0]
    assert done.finish_reason == "tool_calls" and _valid(done.message.tool_calls) == ["get_weather"]
    assert done.message.content is None
    chunks = list(served.client.chat.completions.create(stream=True, **kwargs))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert [(d.function.name, json.loads(d.function.arguments)) for d in deltas] == [
        (c.function.name, json.loads(c.function.arguments)) for c in done.message.tool_calls]
    # The call's JSON never went out as content.
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_content_streams_as_it_comes(served):
    # A grammar keeps the output to letters, none of which can begin a Llama 3.1 JSON call.
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=24,
                  extra_body={"structured_outputs": {"regex": "[a-z]{12}"}})
    whole = served.client.chat.completions.create(**kwargs).choices[0].message
    assert whole.tool_calls is None and len(whole.content) == 12
    chunks = [c for c in served.client.chat.completions.create(stream=True, **kwargs) if c.choices]
    pieces = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
    assert "".join(pieces) == whole.content
    # Token by token as it came, not in one piece at the end.
    assert len(pieces) == 12 and chunks[-1].choices[0].finish_reason == "stop"
