"""What one request may ask of a model: integer token ids inside its vocabulary, prompt plus output inside its context."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, TypeGuard

from coral_dagster.errors import CoralError

# Longest prompt a request may carry before the model's own context is known (a front-door bound, not a model's).
MAX_PROMPT_TOKENS = 1 << 17


class RequestError(CoralError):
    """A request that can never succeed as sent (HTTP 4xx): it fails alone and is not retried elsewhere."""

    def __init__(self, problem: str, fix: str, status: int = 400) -> None:
        super().__init__(problem, fix)
        self.status = status


def is_int(value: Any) -> TypeGuard[int]:
    """An integer that JSON sent as a number: `True` is not a token id and not a token count."""
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class ModelLimits:
    """The vocabulary size and context length (None: unknown, the engine checks) of one model."""

    vocab: int
    max_context: int | None = None

    @classmethod
    def from_message(cls, data: Any) -> ModelLimits | None:
        """Limits a scheduler announced, or None when it sent none; malformed ones are a ValueError."""
        if data is None:
            return None
        vocab, context = (data.get("vocab"), data.get("max_context")) if isinstance(data, dict) else (None, None)
        if not (is_int(vocab) and vocab > 0 and (context is None or (is_int(context) and context > 0))):
            raise ValueError(f"limits {data!r} need a positive integer vocab and max_context (or null)")
        return cls(vocab, context)

    def message(self) -> dict[str, int | None]:
        return {"vocab": self.vocab, "max_context": self.max_context}

    def tighter(self, other: ModelLimits | None) -> ModelLimits:
        """The limits that hold on both, so a request accepted here fits every instance."""
        if other is None:
            return self
        contexts = [c for c in (self.max_context, other.max_context) if c is not None]
        return ModelLimits(min(self.vocab, other.vocab), min(contexts) if contexts else None)


def max_tokens_of(value: Any) -> int:
    """`max_tokens` as sent: an integer of 1 or more."""
    if not is_int(value) or value < 1:
        raise RequestError(f"max_tokens={value!r} must be an integer of 1 or more.", "send e.g. \"max_tokens\": 16")
    return value


def token_ids(value: Any) -> list[int]:
    """A prompt sent as token ids: a non-empty list of non-negative integers, checked before any array exists."""
    if not isinstance(value, list) or not value:
        raise RequestError("a token prompt must be a non-empty list of token ids.", "send e.g. [1, 2, 3]")
    bad = next((t for t in value if not is_int(t) or t < 0), None)
    if bad is not None:
        raise RequestError(f"token id {bad!r} is not a non-negative integer.", "send integer token ids only")
    return value


def check_request(prompt: list[int], max_tokens: int, limits: ModelLimits | None, model: str) -> None:
    """Reject a request `model` cannot serve, naming the bound it breaks and how to fix it."""
    if len(prompt) > MAX_PROMPT_TOKENS:
        raise RequestError(f"a prompt of {len(prompt)} tokens exceeds {MAX_PROMPT_TOKENS}.", "shorten the prompt")
    if limits is None:
        return
    bad = next((t for t in prompt if t >= limits.vocab), None)
    if bad is not None:
        raise RequestError(f"token id {bad} is outside {model}'s vocabulary of {limits.vocab}.",
                           f"send token ids in [0, {limits.vocab})")
    if limits.max_context is not None and len(prompt) + max_tokens > limits.max_context:
        raise RequestError(f"{len(prompt)} prompt tokens + max_tokens={max_tokens} exceed {model}'s "
                           f"{limits.max_context}-position context.", "shorten the prompt or lower max_tokens")


def finite_positive(value: Any, name: str) -> float:
    """A weight or rate from a message: a finite number above zero."""
    number = float(value)
    if not (math.isfinite(number) and number > 0):
        raise ValueError(f"{name}={value!r} must be a finite number above zero")
    return number
