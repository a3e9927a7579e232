"""Chat tools as vLLM's server serves them, called with the official client: `required` and named calls (guaranteed
by the grammar engine, so the tiny model's calls always parse), `auto` read by the Hermes parser, streamed call
deltas in OpenAI's shape, and a conversation continued after `role: tool` answers. The oracles: the `jsonschema`
validator on every call's arguments against its tool's parameters, the chat template's text written out by hand, and
the Hermes format from vLLM's documentation."""

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
    # The template's text, written out by hand: the call as the Hermes block the model would have said.
    block = json.dumps({"name": "add", "arguments": json.loads(call.function.arguments)})
    text = (f"<|user|>\n{ASK[0]['content']}\n<|assistant|>\n<tool_call>{block}</tool_call>\n"
            "<|tool|>\nsunny\n<|assistant|>\n")
    assert done.usage.prompt_tokens == len(ByteTokenizer().encode(text))


def test_auto_reads_hermes_calls_and_leaves_plain_text_as_content(served):
    from coral_dagster.runtime.tools import ToolPlan, calls

    plan = ToolPlan("auto", ("get_weather", "add"))
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
