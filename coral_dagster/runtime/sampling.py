"""How the last stage picks each token: one set of sampling parameters both engines read (torch and vLLM).

Seeded sampling is stateless: the draw at position `pos` uses a generator seeded by (seed, pos), so a request
retried on another instance, or run in any batch, draws the same tokens. Greedy (temperature 0) is argmax.
Log-probabilities are of the model's raw distribution (before temperature, top-k and top-p), as vLLM's default
`logprobs_mode="raw_logprobs"` reports them.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import asdict, dataclass
from typing import Any

from coral_dagster.runtime.limits import RequestError, is_int

# The most alternatives a request may ask log-probabilities of (OpenAI's `top_logprobs` cap; vLLM's default).
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy; top_k 0 keeps every token; `logprobs` None returns none, k the sampled token's
    and the k most likely; `seed` is always set by the front door (drawn when the client sent none).

    vLLM's penalties apply to the raw logits before temperature, in vLLM's order: `repetition_penalty` over the
    prompt's tokens (`prompt_token_ids`) and the generated ones, then `frequency_penalty` times each generated
    token's count, then `presence_penalty` once per generated token. `min_tokens`: EOS and `stop_token_ids` cannot
    be drawn before that many outputs (outputs counted from position `prompt_len`). `prompt_logprobs` None returns
    none of the prompt's; k each prompt token's log-probability, its rank and the k most likely there (vLLM's)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    prompt_len: int = 0
    stop_token_ids: tuple[int, ...] = ()
    prompt_token_ids: tuple[int, ...] = ()
    prompt_logprobs: int | None = None
    # A grammar every output must follow: (kind, text), kind one of `structured.KINDS` (`runtime/structured.py`).
    structured: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        for name in ("stop_token_ids", "prompt_token_ids", "structured"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        checks = [
            (isinstance(self.temperature, (int, float)) and not isinstance(self.temperature, bool)
             and math.isfinite(self.temperature) and 0 <= self.temperature <= 2, "temperature", "in [0, 2]"),
            (isinstance(self.top_p, (int, float)) and not isinstance(self.top_p, bool)
             and 0 < self.top_p <= 1, "top_p", "in (0, 1]"),
            (is_int(self.top_k) and (self.top_k >= 0 or self.top_k == -1), "top_k", "0 or -1 (all) or more"),
            (is_int(self.seed) and -(1 << 63) <= self.seed < (1 << 64), "seed", "a 64-bit integer"),
            *((getattr(self, name) is None
               or (is_int(getattr(self, name)) and 0 <= getattr(self, name) <= MAX_LOGPROBS),
               name, f"an integer in [0, {MAX_LOGPROBS}]") for name in ("logprobs", "prompt_logprobs")),
            *((isinstance(getattr(self, name), (int, float)) and not isinstance(getattr(self, name), bool)
               and math.isfinite(getattr(self, name)) and -2 <= getattr(self, name) <= 2, name, "in [-2, 2]")
              for name in ("presence_penalty", "frequency_penalty")),
            (isinstance(self.repetition_penalty, (int, float)) and not isinstance(self.repetition_penalty, bool)
             and math.isfinite(self.repetition_penalty) and 0 < self.repetition_penalty <= 2, "repetition_penalty",
             "in (0, 2]"),
            *((is_int(getattr(self, name)) and getattr(self, name) >= 0, name, "a non-negative integer")
              for name in ("min_tokens", "prompt_len")),
            *((isinstance(getattr(self, name), tuple) and all(is_int(t) and t >= 0 for t in getattr(self, name)),
               name, "a list of token ids") for name in ("stop_token_ids", "prompt_token_ids")),
            (self.structured is None or (isinstance(self.structured, tuple) and len(self.structured) == 2
                                         and all(isinstance(x, str) for x in self.structured)), "structured",
             "a [kind, text] pair"),
        ]
        for ok, name, what in checks:
            if not ok:
                raise RequestError(f"{name}={getattr(self, name)!r} must be {what}.", f"send {name} {what}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalised(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def keep_k(self) -> int:
        """Tokens top-k keeps; 0 for all."""
        return max(self.top_k, 0)

    def message(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_message(cls, data: Any) -> SamplingParams:
        """The parameters a message carries (None: greedy, no log-probabilities); bad ones are a RequestError."""
        if data is None:
            return cls()
        if not isinstance(data, dict) or set(data) - set(cls.__dataclass_fields__):
            raise RequestError(f"sampling {data!r} is not a sampling object.",
                               f"send only {', '.join(cls.__dataclass_fields__)}")
        return cls(**data)

    def draw_seed(self, pos: int) -> int:
        """The generator seed of the draw at position `pos` (non-negative, below 2**63)."""
        return zlib.crc32(f"{self.seed}:{pos}".encode()) | ((self.seed & 0x7FFFFFFF) << 32)

    def vllm(self, max_tokens: int):
        """vLLM's own `SamplingParams` for these (EOS and stop strings stay with Coral's stop rule)."""
        from vllm import SamplingParams as VllmSampling
        from vllm.sampling_params import RequestOutputKind

        structured = None
        if self.structured is not None:
            import json

            from vllm.sampling_params import StructuredOutputsParams

            kind, text = self.structured
            structured = StructuredOutputsParams(**{"json_schema": {"json": text}, "regex": {"regex": text},
                                                    "choice": {"choice": json.loads(text)}}[kind])
        return VllmSampling(structured_outputs=structured, temperature=self.temperature, top_p=self.top_p,
                            top_k=self.top_k,
                            seed=self.seed % (1 << 63) if not self.greedy else None, logprobs=self.logprobs,
                            prompt_logprobs=self.prompt_logprobs,
                            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                            repetition_penalty=self.repetition_penalty,
                            max_tokens=max_tokens, ignore_eos=True, detokenize=False,
                            output_kind=RequestOutputKind.DELTA)


@dataclass(frozen=True)
class TokenLogprobs:
    """The sampled (or prompt) token's log-probability and the `k` most likely tokens with theirs, most likely first;
    a prompt token's also its rank in the vocabulary (1: the most likely)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None

    def message(self) -> list[Any]:
        return [self.logprob, [list(t) for t in self.top], *([self.rank] if self.rank is not None else [])]

    @classmethod
    def from_message(cls, data: Any) -> TokenLogprobs | None:
        if data is None:
            return None
        logprob, top, *rank = data
        return cls(float(logprob), tuple((int(t), float(lp)) for t, lp in top), int(rank[0]) if rank else None)
