"""Prompt log-probabilities as vLLM's server returns them: `echo` with `logprobs` on `/v1/completions` (the prompt's
tokens first, the first one's null), vLLM's `prompt_logprobs` field on completions and chat, streamed echo. The oracle
is Hugging Face transformers' own `LlamaForCausalLM` on the exported weights: one forward pass over the whole prompt,
whose row i-1 gives token i's log-probability, its rank and the most likely tokens; the served stack is real (a
coordinator, a scheduler and two torch engine stages, the prompt prefilled in chunks) and the client is `openai`."""

from __future__ import annotations

from contextlib import ExitStack

import openai
import pytest

from coral_dagster.runtime.scheduler import PREFILL_CHUNK_TOKENS
from coral_dagster.runtime.tokenizer import EOS, ByteTokenizer, apply_chat_template

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from support.openai_stack import MODEL, PROMPT, Served  # noqa: E402 - needs torch

TOK = ByteTokenizer()
# Longer than two prefill chunks: the prompt's log-probabilities cross the chunks' edges.
LONG_PROMPT = ("Mixed GPUs, one pipeline: the coral reef grows where warm water meets light. " * 8)[:2 * 256 + 57]


@pytest.fixture(scope="module")
def served():
    with ExitStack() as stack:
        yield Served(stack)


def _oracle(model, ids: list[int], k: int) -> list[tuple[float, int, dict[int, float]] | None]:
    """Per prompt token: None for the first, else (its log-probability, its rank, the k most likely {id: value})
    from transformers' logits at the position before it."""
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    out: list[tuple[float, int, dict[int, float]] | None] = [None]
    for i in range(1, len(ids)):
        row = logp[i - 1]
        values, top = row.topk(k)
        out.append((float(row[ids[i]]), int((row >= row[ids[i]]).sum()), dict(zip(top.tolist(), values.tolist()))))
    return out


def _check_legacy(logprobs, ids: list[int], want) -> None:
    """The legacy `logprobs` object's prompt part against the oracle: null first, each later token's value and its
    `top_logprobs` holding the token itself and the k most likely."""
    assert logprobs.tokens[:len(ids)] == [TOK.decode_token(t) for t in ids]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for i in range(1, len(ids)):
        value, _, top = want[i]
        assert logprobs.token_logprobs[i] == pytest.approx(value, abs=1e-4), i
        expected = {TOK.decode_token(ids[i]): value, **{TOK.decode_token(t): v for t, v in top.items()}}
        assert logprobs.top_logprobs[i] == pytest.approx(expected, abs=1e-4), i


def _check_vllm(prompt_logprobs, ids: list[int], want) -> None:
    """vLLM's `prompt_logprobs` against the oracle: null first, then by token id the token's and the top k's
    logprob and rank."""
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    for i in range(1, len(ids)):
        value, rank, top = want[i]
        entry = prompt_logprobs[i]
        assert entry[str(ids[i])]["logprob"] == pytest.approx(value, abs=1e-4)
        assert entry[str(ids[i])]["rank"] == rank
        assert entry[str(ids[i])]["decoded_token"] == TOK.decode_token(ids[i])
        for r, (t, v) in enumerate(top.items(), 1):
            assert entry[str(t)]["logprob"] == pytest.approx(v, abs=1e-4)
            # A token tied with another may take either rank; only the ids' order is the model's own.
            assert entry[str(t)]["rank"] == r or t == ids[i]
        assert set(entry) == {str(ids[i]), *map(str, top)}


def test_echo_with_logprobs_puts_the_prompts_first(served, hf):
    ids = TOK.encode(LONG_PROMPT)
    assert len(ids) > 2 * PREFILL_CHUNK_TOKENS, "the prompt must span chunks, or the chunk edges go untested"
    want = _oracle(hf, ids, 3)
    done = served.client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=4, echo=True, logprobs=3,
                                            extra_body={"ignore_eos": True}).choices[0]
    assert done.text.startswith(LONG_PROMPT)
    _check_legacy(done.logprobs, ids, want)
    _check_vllm(done.model_extra["prompt_logprobs"], ids, want)
    # The completion's tokens follow, each the greedy choice of transformers over the prompt and those before it.
    generated = done.model_extra["token_ids"]
    assert len(done.logprobs.tokens) == len(ids) + len(generated) == len(ids) + 4
    full = _oracle(hf, ids + generated, 1)
    for j, token in enumerate(generated):
        value, rank, _ = full[len(ids) + j]
        assert rank == 1 and done.logprobs.token_logprobs[len(ids) + j] == pytest.approx(value, abs=1e-4)
    lengths = [len(t) for t in done.logprobs.tokens]
    assert done.logprobs.text_offset == [sum(lengths[:i]) for i in range(len(lengths))]


def test_streamed_echo_with_logprobs_equals_the_whole_answer(served):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=5, echo=True, logprobs=2, extra_body={"ignore_eos": True})
    whole = served.client.completions.create(**kwargs).choices[0]
    chunks = [c.choices[0] for c in served.client.completions.create(stream=True, **kwargs)]
    assert "".join(c.text for c in chunks) == whole.text
    assert chunks[0].text.startswith(PROMPT)
    streamed = [c.logprobs for c in chunks if c.logprobs is not None]
    assert [t for lp in streamed for t in lp.tokens] == whole.logprobs.tokens
    assert [v for lp in streamed for v in lp.token_logprobs] == whole.logprobs.token_logprobs
    assert [v for lp in streamed for v in lp.top_logprobs] == whole.logprobs.top_logprobs
    assert [o for lp in streamed for o in lp.text_offset] == whole.logprobs.text_offset


def test_prompt_logprobs_field_on_completions_and_chat(served, hf):
    prompts = ["Hello, Coral", "mixed GPUs"]
    done = served.client.completions.create(model=MODEL, prompt=prompts, max_tokens=2,
                                            extra_body={"prompt_logprobs": 2})
    for choice, prompt in zip(done.choices, prompts):
        ids = TOK.encode(prompt)
        _check_vllm(choice.model_extra["prompt_logprobs"], ids, _oracle(hf, ids, 2))
        # Without echo the text and the logprobs stay the completion's own.
        assert choice.logprobs is None and not choice.text.startswith(prompt)
    messages = [{"role": "user", "content": "Which reef?"}]
    chat = served.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                                 extra_body={"prompt_logprobs": 1})
    ids = TOK.encode(apply_chat_template(messages))
    _check_vllm(chat.model_extra["prompt_logprobs"], ids, _oracle(hf, ids, 1))


def test_a_prompt_answered_by_eos_alone_still_echoes_its_logprobs(served, hf):
    # A prompt whose greedy first token is EOS (found with the oracle: nothing is generated, the `done` carries
    # the prompt's log-probabilities).
    prompt = "x" * 9
    ids = TOK.encode(prompt)
    with torch.no_grad():
        assert int(hf(torch.tensor([ids])).logits[0, -1].argmax()) == EOS
    done = served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, echo=True, logprobs=1).choices[0]
    assert done.finish_reason == "stop" and done.text == prompt
    _check_legacy(done.logprobs, ids, _oracle(hf, ids, 1))
    assert len(done.logprobs.tokens) == len(ids)
    chunks = [c.choices[0] for c in served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=4,
                                                                      echo=True, logprobs=1, stream=True)]
    assert "".join(c.text for c in chunks) == prompt and chunks[-1].finish_reason == "stop"
    assert [t for c in chunks if c.logprobs for t in c.logprobs.tokens] == done.logprobs.tokens


def test_a_prefill_instance_reports_the_prompts_to_its_decode_pair(hf):
    """Prefill on one instance, decode on another after the KV handoff: the prompt's log-probabilities come back
    from the prefill instance with the first token."""
    ids = TOK.encode(PROMPT)
    with ExitStack() as stack:
        pd = Served(stack, pd=True)
        done = pd.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, echo=True, logprobs=2,
                                            extra_body={"ignore_eos": True}).choices[0]
    _check_legacy(done.logprobs, ids, _oracle(hf, ids, 2))
    assert len(done.logprobs.tokens) == len(ids) + 4


@pytest.mark.parametrize("kwargs, param", [
    ({"stream": True, "extra_body": {"prompt_logprobs": 1}}, "prompt_logprobs"),
    ({"extra_body": {"prompt_logprobs": 21}}, "prompt_logprobs"),
    ({"echo": True, "logprobs": 20, "prompt": "x" * 4000}, "logprobs"),
])
def test_prompt_logprobs_out_of_bounds_are_400s(served, kwargs, param):
    with pytest.raises(openai.BadRequestError) as caught:
        served.client.completions.create(**{"model": MODEL, "prompt": "x", "max_tokens": 2, **kwargs})
    assert caught.value.status_code == 400 and caught.value.body["param"] == param, caught.value.body
