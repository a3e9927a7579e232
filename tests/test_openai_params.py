"""vLLM's request parameters, honoured: penalties, `min_tokens`, `stop_token_ids`, `stop_reason`,
`skip_special_tokens`, `continuous_usage_stats`, `max_completion_tokens`. The oracle is an independent forward pass:
Hugging Face transformers' own `LlamaForCausalLM` on the exported weights, decoded greedily by its `generate` with
its own logits processors (`repetition_penalty`, `min_new_tokens`) and a direct re-computation of vLLM's frequency and
presence penalties; the served stack is real (a coordinator, a scheduler and two torch engine stages)."""

from __future__ import annotations

from contextlib import ExitStack

import openai
import pytest

from coral_dagster.runtime.tokenizer import EOS, ByteTokenizer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from support.openai_stack import MODEL, PROMPT, Served  # noqa: E402 - needs torch

# A prompt whose greedy continuation is EOS at its second token (found with the oracle below: `_hf` on "xxxxx").
EOS_PROMPT = "xxxxx"


@pytest.fixture(scope="module")
def served():
    with ExitStack() as stack:
        yield Served(stack)


class _CountPenalties(transformers.LogitsProcessor):
    """OpenAI's frequency and presence penalties over the generated tokens only (those after `prompt_len`)."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids, scores):
        for row, ids in zip(scores, input_ids):
            for token in set(ids[self.prompt_len:].tolist()):
                count = int((ids[self.prompt_len:] == token).sum())
                row[token] -= self.frequency * count + self.presence
        return scores


def _hf(model, prompt: str, n: int, eos: list[int] | None = None, **kw) -> list[int]:
    """Greedy tokens by transformers' `generate` (stopping at `eos` ids, which are left out)."""
    ids = torch.tensor([ByteTokenizer().encode(prompt)])
    processors = transformers.LogitsProcessorList()
    if "frequency" in kw or "presence" in kw:
        processors.append(_CountPenalties(ids.shape[1], kw.pop("frequency", 0.0), kw.pop("presence", 0.0)))
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=0,
                             logits_processor=processors, **kw)[0, ids.shape[1]:].tolist()
    cut = [i for i, t in enumerate(out) if eos and t in eos]
    return out[:cut[0]] if cut else out


def _served_tokens(served, prompt: str, n: int, **extra) -> tuple[list[int], str, object]:
    choice = served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
                                              extra_body=extra).choices[0]
    return choice.model_extra["token_ids"], choice.finish_reason, choice.model_extra["stop_reason"]


def test_repetition_penalty_matches_transformers_processor(served, hf):
    plain = _hf(hf, PROMPT, 20)
    want = _hf(hf, PROMPT, 20, repetition_penalty=1.8)
    assert want != plain, "the penalty must change this continuation, or the test proves nothing"
    assert _served_tokens(served, PROMPT, 20, ignore_eos=True, repetition_penalty=1.8)[0] == want
    # Chat reaches the same sampler: the prompt is the rendered template.
    from coral_dagster.runtime.tokenizer import apply_chat_template

    messages = [{"role": "user", "content": "reef reef reef"}]
    chat = served.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                                 extra_body={"ignore_eos": True, "repetition_penalty": 1.5})
    assert chat.choices[0].message.content == ByteTokenizer().decode(
        _hf(hf, apply_chat_template(messages), 12, repetition_penalty=1.5))


def test_frequency_and_presence_penalties_match_a_direct_recomputation(served, hf):
    plain = _hf(hf, PROMPT, 20)
    for frequency, presence in ((1.5, 0.0), (0.0, 1.5), (0.8, 0.7), (-0.5, 0.0)):
        want = _hf(hf, PROMPT, 20, frequency=frequency, presence=presence)
        if frequency >= 0:
            assert want != plain, (frequency, presence)
        got = served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0,
                                               frequency_penalty=frequency, presence_penalty=presence,
                                               extra_body={"ignore_eos": True}).choices[0]
        assert choice_tokens(got) == want, (frequency, presence)


def choice_tokens(choice) -> list[int]:
    return choice.model_extra["token_ids"]


def test_penalised_logprobs_stay_the_raw_distribution(served):
    """vLLM's default `raw_logprobs`: log-probabilities are of the model's logits before any penalty."""
    plain = served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=3)
    hit = served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=3,
                                           extra_body={"repetition_penalty": 1.8})
    assert plain.choices[0].logprobs.top_logprobs == hit.choices[0].logprobs.top_logprobs


def test_min_tokens_holds_back_eos_and_stop_token_ids(served, hf):
    assert _hf(hf, EOS_PROMPT, 8, eos=[EOS]) == _served_tokens(served, EOS_PROMPT, 8)[0]
    short, reason, stop_reason = _served_tokens(served, EOS_PROMPT, 8)
    assert len(short) == 1 and reason == "stop" and stop_reason is None
    want = _hf(hf, EOS_PROMPT, 12, eos=[EOS], min_new_tokens=5)
    got, reason, _ = _served_tokens(served, EOS_PROMPT, 12, min_tokens=5)
    assert got == want and len(got) >= 5
    # A stop token id the plain continuation meets at once is held back just as EOS is.
    first = _hf(hf, PROMPT, 1)[0]
    want = _hf(hf, PROMPT, 16, eos=[EOS, first], min_new_tokens=4)
    got, reason, stop_reason = _served_tokens(served, PROMPT, 16, min_tokens=4, stop_token_ids=[first])
    assert got == want and len(got) >= 4
    if len(want) < 16:
        assert (reason, stop_reason) == ("stop", first)


def test_stop_reason_names_what_stopped_the_choice(served, hf):
    text = ByteTokenizer().decode(_hf(hf, PROMPT, 16))
    stop = text[5:7]
    choice = served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop],
                                              extra_body={"ignore_eos": True}).choices[0]
    assert choice.text == text[:text.index(stop)]
    assert (choice.finish_reason, choice.model_extra["stop_reason"]) == ("stop", stop)
    chat = served.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                 max_tokens=3, extra_body={"ignore_eos": True})
    assert (chat.choices[0].finish_reason, chat.choices[0].model_extra["stop_reason"]) == ("length", None)


def test_skip_special_tokens_false_shows_eos_in_the_text(served, hf):
    tokens = _hf(hf, EOS_PROMPT, 6)
    assert EOS in tokens
    skipped = served.client.completions.create(model=MODEL, prompt=EOS_PROMPT, max_tokens=6,
                                               extra_body={"ignore_eos": True}).choices[0]
    shown = served.client.completions.create(model=MODEL, prompt=EOS_PROMPT, max_tokens=6,
                                             extra_body={"ignore_eos": True, "skip_special_tokens": False}).choices[0]
    decode = ByteTokenizer().decode_token
    assert skipped.text == "".join(decode(t) for t in tokens)
    assert shown.text == "".join(f"<|{t}|>" if t == EOS else decode(t) for t in tokens)


def test_continuous_usage_stats_count_every_chunk(served):
    chunks = list(served.client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=10, stream=True, temperature=0,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
    prompt_tokens = len(ByteTokenizer().encode(PROMPT))
    seen = 0
    for c in chunks[:-1]:
        seen += len(c.choices[0].model_extra.get("token_ids") or [])
        assert (c.usage.prompt_tokens, c.usage.completion_tokens) == (prompt_tokens, seen)
        assert c.usage.total_tokens == prompt_tokens + seen
    assert seen == 10 and chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    # guidellm's request: chat, streamed, continuous usage.
    chat = list(served.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=4, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
    assert [c.usage.completion_tokens for c in chat if c.choices][-1] == 4 and chat[-1].usage.completion_tokens == 4


def test_max_completion_tokens_limits_chat(served):
    chat = served.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                 max_completion_tokens=5, extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 5 and chat.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as caught:
        served.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                              max_completion_tokens=5, max_tokens=5)
    assert caught.value.body["param"] == "max_completion_tokens"
