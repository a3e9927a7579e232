"""Structured outputs through llguidance on the torch engine, called as vLLM's server is: `response_format`
(`json_object`, `json_schema`), `structured_outputs` and `guided_choice`/`guided_regex`. The oracles are independent:
the `jsonschema` validator, Python's `re`, and the same request without the grammar (which must differ)."""

from __future__ import annotations

import json
import re
from contextlib import ExitStack

import httpx
import jsonschema
import openai
import pytest

pytest.importorskip("coral_dagster.runtime.torch_engine")
pytest.importorskip("llguidance")
from support.openai_stack import KEY, MODEL, Served  # noqa: E402 - needs torch

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "n", "tag"],
          "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tag": {"type": "string", "enum": ["reef", "atoll"]}}}
# A prompt after which the tiny model's greedy JSON object closes within a few tokens ("{}"), found by trying a few.
JSON_OBJECT_PROMPT = "x"


@pytest.fixture(scope="module")
def served():
    with ExitStack() as stack:
        yield Served(stack)


def _text(raw: str) -> str:
    """Generated text as UTF-8 (the byte tokenizer shows each byte token as one Latin-1 character)."""
    return raw.encode("latin-1").decode("utf-8")


def test_json_schema_output_parses_and_validates_plain_and_streamed(served):
    messages = [{"role": "user", "content": "Describe a reef as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "reef", "schema": SCHEMA, "strict": True}}
    done = served.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=120,
                                                 response_format=fmt)
    assert done.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(_text(done.choices[0].message.content)), SCHEMA)
    free = served.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40)
    assert free.choices[0].message.content != done.choices[0].message.content
    chunks = served.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=120,
                                                   response_format=fmt, stream=True, temperature=0.9, seed=5)
    jsonschema.validate(json.loads(_text("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))),
                        SCHEMA)
    # vLLM's own field, on completions.
    done = served.client.completions.create(model=MODEL, prompt="reef:", max_tokens=120,
                                            extra_body={"structured_outputs": {"json": SCHEMA}})
    jsonschema.validate(json.loads(_text(done.choices[0].text)), SCHEMA)


def test_json_object_mode_gives_an_object(served):
    done = served.client.completions.create(model=MODEL, prompt=JSON_OBJECT_PROMPT, max_tokens=60,
                                            extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(_text(done.choices[0].text)), dict) and done.choices[0].finish_reason == "stop"


def test_guided_choice_and_regex_hold_for_every_draw(served):
    choices = ["alpha", "beta", "gamma"]
    pattern = r"[0-9]{3}-[a-z]{2}"
    for seed in range(4):
        picked = served.client.completions.create(model=MODEL, prompt="pick", max_tokens=20, temperature=1.0,
                                                  seed=seed, extra_body={"guided_choice": choices}).choices[0]
        assert picked.text in choices and picked.finish_reason == "stop"
        matched = served.client.completions.create(model=MODEL, prompt="code", max_tokens=20, temperature=1.0,
                                                   seed=seed, extra_body={"guided_regex": pattern}).choices[0]
        assert re.fullmatch(pattern, matched.text), matched.text
    chat = served.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "y/n?"}],
                                                 max_tokens=10,
                                                 extra_body={"structured_outputs": {"choice": ["y", "n"]}})
    assert chat.choices[0].message.content in ("y", "n")


def test_a_grammar_that_cannot_compile_is_a_400_and_never_reaches_an_instance(served):
    for extra, param in (({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                                      "schema": {"type": "nope"}}}},
                          "response_format"),
                         ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
                         ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
                         ({"guided_choice": []}, "guided_choice")):
        with pytest.raises(openai.BadRequestError) as caught:
            served.client.completions.create(model=MODEL, prompt="x", max_tokens=5, extra_body=extra)
        assert caught.value.body["param"] == param, caught.value.body
    status = httpx.get(f"{served.url}/admin/instances", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert [i["progress"] for i in status["instances"]] == ["ok"]
    assert served.client.completions.create(model=MODEL, prompt="x", max_tokens=2,
                                            extra_body={"response_format": {"type": "text"}}).choices
