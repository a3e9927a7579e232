"""One battery of OpenAI API calls (official client) whose observable behaviour must be the same whichever engine
serves: the torch engine, vLLM's, and the single-process reference (`expected`)."""

from __future__ import annotations

import numpy as np
import openai

from coral_dagster.runtime.generate import generate
from coral_dagster.runtime.sampling import SamplingParams
from coral_dagster.runtime.tokenizer import ByteTokenizer, apply_chat_template

MODEL = "tiny-llama"
PROMPTS = ("Hello, Coral", "mixed GPUs, one pipeline")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Which reef?"}]
N_TOKENS = 12


def observe(base_url: str, api_key: str) -> dict:
    """What a client sees: texts, finish reasons, usage, logprobs, stop handling, refusals and seeded repeats."""
    c = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=300)
    greedy = dict(max_tokens=N_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    out: dict = {}
    done = c.completions.create(model=MODEL, prompt=list(PROMPTS), **greedy)
    out["completions"] = [(ch.text, ch.finish_reason) for ch in done.choices]
    out["usage"] = (done.usage.prompt_tokens, done.usage.completion_tokens)
    chunks = list(c.completions.create(model=MODEL, prompt=PROMPTS[0], stream=True,
                                       stream_options={"include_usage": True}, **greedy))
    out["streamed"] = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    out["usage_chunk"] = chunks[-1].usage.completion_tokens if not chunks[-1].choices else None
    chat = c.chat.completions.create(model=MODEL, messages=MESSAGES, **greedy)
    out["chat"] = (chat.choices[0].message.content, chat.choices[0].finish_reason, chat.usage.prompt_tokens)
    streamed_chat = c.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, **greedy)
    out["chat_streamed"] = "".join(ch.choices[0].delta.content or "" for ch in streamed_chat if ch.choices)
    stop = out["completions"][0][0][4:6]
    cut = c.completions.create(model=MODEL, prompt=PROMPTS[0], stop=[stop], **greedy).choices[0]
    out["stop"] = (cut.text, cut.finish_reason, cut.model_extra["stop_reason"])
    out["penalised"] = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=N_TOKENS, temperature=0,
                                            frequency_penalty=0.5, presence_penalty=0.3,
                                            extra_body={"ignore_eos": True, "repetition_penalty": 1.4}).choices[0].text
    out["echo"] = c.completions.create(model=MODEL, prompt=PROMPTS[0], echo=True, **greedy).choices[0].text
    two = c.completions.create(model=MODEL, prompt=PROMPTS[0], n=2, **greedy)
    out["n"] = [ch.text for ch in two.choices]
    lp = c.completions.create(model=MODEL, prompt=PROMPTS[0], logprobs=2, **greedy).choices[0].logprobs
    out["logprobs"] = _entries(lp)
    # Echo with logprobs: the prompt's tokens first (the first without a log-probability), then the completion's.
    echoed = c.completions.create(model=MODEL, prompt=PROMPTS[0], echo=True, logprobs=2, **greedy).choices[0]
    out["echo_logprobs"] = _entries(echoed.logprobs)
    # vLLM's prompt_logprobs on chat: per prompt token, (id, log-probability, rank) of it and of the most likely.
    ranked = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                       extra_body={"prompt_logprobs": 1}).model_extra["prompt_logprobs"]
    out["prompt_ranks"] = [None if e is None else sorted((int(t), v["logprob"], v["rank"]) for t, v in e.items())
                           for e in ranked]
    seeded = [c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=N_TOKENS, temperature=0.8, seed=11,
                                   extra_body={"ignore_eos": True}).choices[0].text for _ in range(2)]
    out["seeded_repeats"] = seeded[0] == seeded[1]
    try:
        c.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body={"no_such_field": 1})
        out["refused"] = None
    except openai.BadRequestError as exc:
        out["refused"] = (exc.status_code, exc.body["param"])
    return out


def _entries(lp) -> list:
    """A legacy `logprobs` object as (token, log-probability, alternatives most likely first) per token."""
    return [(t, v, None if top is None else sorted(top.items(), key=lambda kv: -kv[1]))
            for t, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs)]


def _prompt_logprobs(ids: list[int], k: int) -> list:
    """Each prompt token's log-probabilities from one forward over the whole prompt on the single-process torch
    engine (None for the first token)."""
    from coral_dagster.runtime.engine import Step
    from coral_dagster.runtime.tiny import decoder_config
    from coral_dagster.runtime.torch_engine import TorchEngine

    cfg = decoder_config(MODEL)
    engine = TorchEngine(cfg, 0, cfg.n_layers, device="cpu")
    step = Step("ref", 0, tokens=np.asarray(ids, dtype=np.int64), sampling=SamplingParams(prompt_logprobs=k),
                targets=tuple(ids[1:]))
    return [None, *(engine.forward([step])[0].prompt_logprobs or [])]


def _ranked(token: int, lp) -> list:
    """(id, log-probability, rank) of a prompt token and of the k most likely there, by id."""
    entry = {token: (lp.logprob, lp.rank)}
    for rank, (t, v) in enumerate(lp.top, 1):
        entry.setdefault(t, (v, rank))
    return sorted((t, v, r) for t, (v, r) in entry.items())


def expected() -> dict:
    """The battery's answers from the single-process engine and closed forms."""
    ref = [generate(MODEL, p, N_TOKENS, ignore_eos=True) for p in PROMPTS]
    chat_prompt = apply_chat_template(MESSAGES)
    chat = generate(MODEL, chat_prompt, N_TOKENS, ignore_eos=True)
    stop = ref[0].text[4:6]
    with_lp = generate(MODEL, PROMPTS[0], N_TOKENS, ignore_eos=True, sampling=SamplingParams(logprobs=2))
    decode = ByteTokenizer().decode_token
    prompt_ids = ByteTokenizer().encode(PROMPTS[0])
    tops = [None if lp is None else sorted({decode(t): lp.logprob, **{decode(a): v for a, v in lp.top}}.items(),
                                           key=lambda kv: -kv[1]) for t, lp in
            zip(prompt_ids + list(with_lp.tokens), _prompt_logprobs(prompt_ids, 2) + list(with_lp.logprobs))]
    values = [None, *(lp.logprob for lp in _prompt_logprobs(prompt_ids, 2)[1:]),
              *(lp.logprob for lp in with_lp.logprobs)]
    chat_ids = ByteTokenizer().encode(chat_prompt)
    return {
        "completions": [(r.text, "length") for r in ref],
        "usage": (sum(r.prompt_tokens for r in ref), N_TOKENS * len(PROMPTS)),
        "streamed": ref[0].text, "usage_chunk": N_TOKENS,
        "chat": (chat.text, "length", chat.prompt_tokens), "chat_streamed": chat.text,
        "stop": (ref[0].text[:ref[0].text.index(stop)], "stop", stop),
        "penalised": generate(MODEL, PROMPTS[0], N_TOKENS, ignore_eos=True, sampling=SamplingParams(
            frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.4, prompt_len=len(prompt_ids),
            prompt_token_ids=tuple(prompt_ids))).text,
        "echo": PROMPTS[0] + ref[0].text,
        "n": [ref[0].text] * 2,
        "logprobs": [(decode(t), lp.logprob, [(decode(a), v) for a, v in lp.top])
                     for t, lp in zip(with_lp.tokens, with_lp.logprobs)],
        "echo_logprobs": [(decode(t), v, top)
                          for t, v, top in zip(prompt_ids + list(with_lp.tokens), values, tops)],
        "prompt_ranks": [None if lp is None else _ranked(t, lp)
                         for t, lp in zip(chat_ids, _prompt_logprobs(chat_ids, 1))],
        "seeded_repeats": True,
        "refused": (400, "no_such_field"),
    }


def assert_same(got: dict, want: dict, tolerance: float = 1e-4) -> None:
    """Equal, log-probabilities within `tolerance` (two engines' float32 kernels differ in the last bits)."""
    assert set(got) == set(want)
    for key in want:
        if key not in ("logprobs", "echo_logprobs", "prompt_ranks"):
            assert got[key] == want[key], key
    for key in ("logprobs", "echo_logprobs"):
        for (t, v, top), (t2, v2, top2) in zip(got[key], want[key], strict=True):
            assert t == t2 and (v is None) == (v2 is None) and (top is None) == (top2 is None), key
            assert v is None or abs(v - v2) <= tolerance, key
            assert [a for a, _ in top or []] == [a for a, _ in top2 or []], key
            assert all(abs(x - y) <= tolerance for (_, x), (_, y) in zip(top or [], top2 or [])), key
    for mine, theirs in zip(got["prompt_ranks"], want["prompt_ranks"], strict=True):
        assert (mine is None) == (theirs is None)
        assert [(t, r) for t, _, r in mine or []] == [(t, r) for t, _, r in theirs or []]
        assert all(abs(v - v2) <= tolerance for (_, v, _), (_, v2, _) in zip(mine or [], theirs or []))
