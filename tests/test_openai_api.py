"""The OpenAI API as vLLM's server answers it, called with the official `openai` client: chat and completions
(plain and streamed), stop strings and token ids, seeded sampling, n, logprobs, usage chunks, echo, refused
fields, cancellation on disconnect, /metrics. The oracle is the single-process engine (`generate`), run on the same
prompts; the served stack is real: a coordinator with its front door, a scheduler and two torch engine stages."""

from __future__ import annotations

import json
import math
import socket
import time
from contextlib import ExitStack

import openai
import pytest

from coral_dagster.runtime.generate import generate
from coral_dagster.runtime.sampling import SamplingParams
from coral_dagster.runtime.tokenizer import ByteTokenizer, apply_chat_template

pytest.importorskip("coral_dagster.runtime.torch_engine")
from support.openai_stack import CFG, KEY, MODEL, PROMPT, Served, scrape  # noqa: E402 - needs torch


@pytest.fixture(scope="module")
def served():
    with ExitStack() as stack:
        yield Served(stack)


def test_models_lists_the_served_model_with_its_context(served):
    models = served.client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["max_model_len"] == CFG.max_context


def test_greedy_completions_match_generate_plain_and_streamed(served):
    expected = generate(MODEL, PROMPT, 12, ignore_eos=True)
    done = served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                            extra_body={"ignore_eos": True})
    assert done.choices[0].text == expected.text and done.choices[0].finish_reason == "length"
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (expected.prompt_tokens, 12)
    stream = served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, stream=True,
                                              stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    # The usage chunk comes last, with no choices, and counts what was generated.
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_uses_the_models_chat_template_plain_and_streamed(served, tmp_path):
    from transformers.utils.chat_template_utils import render_jinja_template

    from coral_dagster.runtime.hf_export import export_tiny

    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a reef."}]
    # The oracle renders the template the exported model directory carries, with transformers' own renderer.
    template = json.loads((export_tiny(MODEL, tmp_path) / "tokenizer_config.json").read_text())["chat_template"]
    prompt = render_jinja_template([messages], chat_template=template, add_generation_prompt=True)[0][0]
    assert prompt == apply_chat_template(messages)
    expected = generate(MODEL, prompt, 10, ignore_eos=True)
    done = served.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10,
                                                 extra_body={"ignore_eos": True})
    assert done.object == "chat.completion" and done.choices[0].message.role == "assistant"
    assert done.choices[0].message.content == expected.text
    assert done.usage.prompt_tokens == expected.prompt_tokens
    chunks = list(served.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, stream=True,
                                                        extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert {c.object for c in chunks} == {"chat.completion.chunk"}


def test_stop_strings_and_token_ids_cut_the_text_and_finish_with_stop(served):
    full = generate(MODEL, PROMPT, 24, ignore_eos=True)
    # A stop string taken from the middle of the greedy text: the answer is the text before its first occurrence.
    stop = full.text[9:11]
    cut = full.text.index(stop)
    for stream in (False, True):
        kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=24, stop=[stop, "\x00never"], stream=stream,
                      extra_body={"ignore_eos": True})
        if stream:
            chunks = list(served.client.completions.create(**kwargs))
            text = "".join(c.choices[0].text for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            choice = served.client.completions.create(**kwargs).choices[0]
            text, reason = choice.text, choice.finish_reason
        assert (text, reason) == (full.text[:cut], "stop"), stream
    token = full.tokens[6]
    first = full.tokens.index(token)
    choice = served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24,
                                              extra_body={"ignore_eos": True, "stop_token_ids": [token]}).choices[0]
    assert (choice.text, choice.finish_reason) == (ByteTokenizer().decode(list(full.tokens[:first])), "stop")


def test_seeded_sampling_is_deterministic_and_matches_the_engine_drawing_alone(served):
    def sample(**kw):
        return served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0.9,
                                                extra_body={"ignore_eos": True, **kw.pop("extra", {})}, **kw)

    a, b = sample(seed=7), sample(seed=7)
    assert a.choices[0].text == b.choices[0].text
    # The draw at each position is seeded by (seed, position): the distributed run equals the single process.
    alone = generate(MODEL, PROMPT, 16, ignore_eos=True, sampling=SamplingParams(temperature=0.9, seed=7))
    assert a.choices[0].text == alone.text
    greedy = generate(MODEL, PROMPT, 16, ignore_eos=True).text
    assert len({sample(seed=s).choices[0].text for s in (1, 2, 3)} | {greedy}) > 1
    # Closed forms: top_k=1 and a vanishing top_p keep only the most likely token, whatever the temperature.
    assert sample(seed=5, extra={"top_k": 1}).choices[0].text == greedy
    assert sample(seed=5, top_p=1e-9).choices[0].text == greedy
    # n choices: choice j draws with seed + j.
    many = served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=40, n=3,
                                            extra_body={"ignore_eos": True})
    assert [c.index for c in many.choices] == [0, 1, 2]
    for c in many.choices:
        ref = generate(MODEL, PROMPT, 8, ignore_eos=True, sampling=SamplingParams(temperature=1.0, seed=40 + c.index))
        assert c.text == ref.text
    assert many.usage.completion_tokens == 24 and many.usage.prompt_tokens == alone.prompt_tokens


def test_logprobs_are_the_models_distribution(served):
    ref = generate(MODEL, PROMPT, 6, ignore_eos=True, sampling=SamplingParams(logprobs=3))
    done = served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, logprobs=3,
                                            extra_body={"ignore_eos": True}).choices[0].logprobs
    assert done.tokens == [ByteTokenizer().decode_token(t) for t in ref.tokens]
    assert done.token_logprobs == pytest.approx([lp.logprob for lp in ref.logprobs], abs=1e-5)
    for lp, top in zip(done.token_logprobs, done.top_logprobs):
        values = list(top.values())
        # Greedy: the chosen token is the most likely; a distribution's top-3 mass is at most 1.
        assert len(top) == 3 and values == sorted(values, reverse=True) and lp == pytest.approx(values[0])
        assert sum(math.exp(v) for v in values) <= 1 + 1e-6
    chat = served.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4, logprobs=True, top_logprobs=2,
                                                 extra_body={"ignore_eos": True}).choices[0]
    entries = chat.logprobs.content
    assert "".join(e.token for e in entries) == chat.message.content
    assert all(len(e.top_logprobs) == 2 and e.logprob == pytest.approx(e.top_logprobs[0].logprob) for e in entries)


def test_echo_puts_the_prompt_first(served):
    expected = generate(MODEL, PROMPT, 5, ignore_eos=True)
    done = served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, echo=True,
                                            extra_body={"ignore_eos": True})
    assert done.choices[0].text == PROMPT + expected.text
    chunks = list(served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, echo=True, stream=True,
                                                   extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == PROMPT + expected.text


@pytest.mark.parametrize("kind, kwargs, param", [
    ("completion", {"extra_body": {"frobnicate": 1}}, "frobnicate"),
    ("completion", {"presence_penalty": -3}, "presence_penalty"),
    ("completion", {"logit_bias": {"65": 5}}, "logit_bias"),
    ("completion", {"suffix": "tail"}, "suffix"),
    ("completion", {"temperature": 3.0}, "temperature"),
    ("completion", {"n": 0}, "n"),
    ("completion", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("chat", {"frequency_penalty": 2.5}, "frequency_penalty"),
    ("completion", {"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
    ("completion", {"extra_body": {"min_tokens": 3}}, "min_tokens"),
    ("chat", {"extra_body": {"skip_special_tokens": "no"}}, "skip_special_tokens"),
    ("chat", {"logit_bias": {"65": 5}}, "logit_bias"),
    ("chat", {"tools": [{"type": "function"}]}, "tools"),
    ("chat", {"tool_choice": "required"}, "tool_choice"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"response_format": {"type": "xml"}}, "response_format"),
    ("chat", {"extra_body": {"guided_regex": "[a-"}}, "guided_regex"),
    ("completion", {"extra_body": {"guided_choice": ["a"], "guided_regex": "a"}}, "guided_choice"),
])
def test_unknown_or_unsupported_fields_are_openai_400s(served, kind, kwargs, param):
    with pytest.raises(openai.BadRequestError) as caught:
        if kind == "chat":
            served.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                  max_tokens=2, **kwargs)
        else:
            served.client.completions.create(model=MODEL, prompt="x", max_tokens=2, **kwargs)
    error = caught.value.body
    assert caught.value.status_code == 400 and error["param"] == param, error
    assert error["type"] == "invalid_request_error" and error["code"] == 400 and param in error["message"]


def test_defaults_that_change_nothing_are_accepted(served):
    done = served.client.completions.create(model=MODEL, prompt="x", max_tokens=2, presence_penalty=0,
                                            frequency_penalty=0.0, best_of=1, user="u1")
    assert done.choices[0].finish_reason in ("length", "stop")


def _tokens_run(served) -> int:
    return sum(served.last.steps.values())


def _quiet(served, settle_s: float = 1.0, timeout_s: float = 30.0) -> int:
    """Wait until the last stage has run no step for `settle_s`; the steps it ran in all."""
    deadline = time.monotonic() + timeout_s
    last, since = _tokens_run(served), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = _tokens_run(served)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= settle_s:
            return now
    raise AssertionError("the engine never went quiet: a generation is stuck running")


def test_a_client_that_disconnects_stops_its_generation_on_every_stage(served):
    _quiet(served)
    before = {e: dict(e.steps) for e in served.engines}
    budget = CFG.max_context - 64
    stream = served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=budget, stream=True,
                                              extra_body={"ignore_eos": True})
    seen = 0
    for _ in stream:
        seen += 1
        if seen == 5:
            break
    stream.close()
    ran = _quiet(served)
    new = [{r: n - b.get(r, 0) for r, n in e.steps.items() if n != b.get(r, 0)} for e, b in zip(served.engines,
                                                                                                  before.values())]
    # One request ran, on both stages, and stopped far short of its budget (it would run ~4,000 steps).
    assert [len(n) for n in new] == [1, 1]
    steps = [next(iter(n.values())) for n in new]
    assert all(s < budget // 4 for s in steps), steps
    assert _tokens_run(served) == ran
    assert served.coord.status()["in_flight"] == 0
    # A non-streamed request whose client times out is cancelled the same way.
    with pytest.raises(openai.APITimeoutError):
        served.client.with_options(timeout=1.0).completions.create(model=MODEL, prompt=PROMPT, max_tokens=budget,
                                                                    extra_body={"ignore_eos": True})
    _quiet(served)
    assert served.coord.status()["in_flight"] == 0


def test_metrics_count_requests_tokens_and_latencies(served):
    before = scrape(served.url)
    served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=7, extra_body={"ignore_eos": True})
    with pytest.raises(openai.BadRequestError):
        served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, extra_body={"nope": 1})
    after = scrape(served.url)

    def grew(name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    assert grew("coral_requests_total", route="/v1/completions", status="200") == 1
    assert grew("coral_requests_total", route="/v1/completions", status="400") == 1
    assert grew("coral_generation_tokens_total", model=MODEL) == 7
    assert grew("coral_prompt_tokens_total", model=MODEL) == len(ByteTokenizer().encode(PROMPT))
    assert grew("coral_time_to_first_token_seconds_count", model=MODEL) == 1
    assert grew("coral_time_per_output_token_seconds_count", model=MODEL) == 6
    assert ("coral_queue_depth", ()) in after and ("coral_requests_running", ()) in after


def test_a_kept_alive_connections_second_request_gets_its_own_header_timeout():
    with ExitStack() as stack:
        served = Served(stack, read_timeout_s=1.0)
        with socket.create_connection(("127.0.0.1", served.port), timeout=15) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            first = b""
            while b"\r\n\r\n" not in first:
                first += s.recv(65536)
            head, _, body = first.partition(b"\r\n\r\n")
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            while len(body) < length:
                body += s.recv(65536)
            assert first.startswith(b"HTTP/1.1 200") and len(body) == length
            # The second request on the same connection sends half its headers and stalls.
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            started = time.monotonic()
            reply = b""
            while chunk := s.recv(65536):
                reply += chunk
            assert reply.startswith(b"HTTP/1.1 408"), reply[:80]
            assert time.monotonic() - started < 5
            assert json.loads(reply.partition(b"\r\n\r\n")[2])["error"]["code"] == 408


def test_the_served_torch_engine_behaves_as_the_reference(served):
    """The engine-parity battery (tests/support/openai_battery.py) on the torch engine; test_vllm_cpu runs it on
    vLLM."""
    from support.openai_battery import assert_same, expected, observe

    assert_same(observe(f"{served.url}/v1", KEY), expected())
