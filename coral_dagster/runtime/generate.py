"""Single-process generation: the reference the distributed runtime must match token for token."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from coral_dagster.errors import CoralError
from coral_dagster.runtime.engine import Engine, Step, make_engine
from coral_dagster.runtime.limits import ModelLimits, check_request, max_tokens_of
from coral_dagster.runtime.sampling import SamplingParams, TokenLogprobs
from coral_dagster.runtime.tokenizer import ByteTokenizer, finish_reason


@dataclass(frozen=True)
class Completion:
    """Generated token ids (EOS excluded), their text, why generation ended ("stop" or "length"), and each
    token's log-probabilities when they were asked for."""

    text: str
    tokens: tuple[int, ...]
    finish_reason: str
    prompt_tokens: int
    logprobs: tuple[TokenLogprobs, ...] = ()


def generate_tokens(engine: Engine, prompt: list[int], max_tokens: int, ignore_eos: bool = False,
                    rid: str = "generate", sampling: SamplingParams | None = None
                    ) -> tuple[list[int], str, list[TokenLogprobs]]:
    """Decoding with one engine holding every layer (greedy unless `sampling` says otherwise): (output tokens,
    finish reason, their log-probabilities when `sampling.logprobs` asks)."""
    if not (engine.is_first and engine.is_last):
        raise CoralError("single-process generation needs an engine holding every layer.",
                         "build the engine with layers 0:n_layers")
    out: list[int] = []
    logprobs: list[TokenLogprobs] = []
    step = Step(rid, 0, tokens=np.asarray(prompt, dtype=np.int64), sampling=sampling)
    try:
        while True:
            result = engine.forward([step])[0]
            token = result.token
            if token is None:
                raise RuntimeError("an engine holding every layer returned no token")
            reason = finish_reason(token, len(out) + 1, max_tokens, ignore_eos)
            if reason != "stop":
                out.append(token)
                if result.logprobs is not None:
                    logprobs.append(result.logprobs)
            if reason:
                return out, reason, logprobs
            step = Step(rid, step.pos + step.n_tokens, tokens=np.asarray([token], dtype=np.int64), sampling=sampling)
    finally:
        engine.free(rid)


def generate(model: str, prompt: str, max_tokens: int, ignore_eos: bool = False,
             sampling: SamplingParams | None = None) -> Completion:
    """Completion of `prompt` computed in this process with the torch engine (greedy unless `sampling`)."""
    from coral_dagster.runtime.tiny import decoder_config

    cfg = decoder_config(model)
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode(prompt)
    check_request(ids, max_tokens_of(max_tokens), ModelLimits(cfg.vocab, cfg.max_context), model)
    tokens, reason, logprobs = generate_tokens(make_engine("torch", model, 0, cfg.n_layers), ids, max_tokens,
                                               ignore_eos, sampling=sampling)
    return Completion(tokenizer.decode(tokens), tuple(tokens), reason, len(ids), tuple(logprobs))
