"""The engine interface every stage node drives: a batch forward over a layer range with per-request KV caches."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal

import numpy as np

from coral_dagster.errors import CoralError
from coral_dagster.runtime.sampling import SamplingParams, TokenLogprobs

EngineKind = Literal["torch", "vllm"]
ENGINE_KINDS: tuple[EngineKind, ...] = ("torch", "vllm")


@dataclass(frozen=True)
class Step:
    """New positions `[pos, pos + n)` of one request: token ids on the first stage, else the previous hidden states.

    Arrays are in wire form (numpy; bfloat16 travels as uint16 bits).
    """

    rid: str
    pos: int
    tokens: np.ndarray | None = None
    hidden: np.ndarray | None = None
    # How the last stage picks the token (None: greedy, no log-probabilities).
    sampling: SamplingParams | None = None
    # The prompt's tokens at positions `pos + 1 ..` (at most n), whose log-probabilities the last stage reports when
    # `sampling.prompt_logprobs` asks; None on decode steps.
    targets: tuple[int, ...] | None = None

    @property
    def n_tokens(self) -> int:
        data = self.tokens if self.tokens is not None else self.hidden
        if data is None:
            raise RuntimeError(f"step {self.rid!r} carries neither token ids nor hidden states")
        return int(data.shape[0])


@dataclass(frozen=True)
class StepOutput:
    """A stage's result for one step: hidden states for the next stage, or the sampled token on the last stage
    (with its log-probabilities, and its prompt tokens', when the step asked for them)."""

    rid: str
    hidden: np.ndarray | None = None
    token: int | None = None
    logprobs: TokenLogprobs | None = None
    # Log-probabilities of the step's `targets`, in order.
    prompt_logprobs: list[TokenLogprobs] | None = None


class Engine(ABC):
    """Layers `[start, end)` of an `n_layers` model; the first stage embeds tokens and the last one samples."""

    start: int
    end: int
    n_layers: int
    vocab: int
    # Positions a request may reach; None where the engine does not say (vLLM checks its own).
    max_context: int | None = None

    @property
    def is_first(self) -> bool:
        return self.start == 0

    @property
    def is_last(self) -> bool:
        return self.end == self.n_layers

    @abstractmethod
    def forward(self, steps: list[Step]) -> list[StepOutput]:
        """Run every step as one batch, appending to each request's KV cache; one output per step, same order."""

    @abstractmethod
    def cache_length(self, rid: str) -> int | None:
        """Positions cached for `rid` in all local layers; 0 for an unknown request, None while a handoff is partial."""

    @abstractmethod
    def export_kv(self, rid: str, start: int, end: int) -> list[np.ndarray]:
        """K and V (wire form, `[kv_heads, length, head_dim]`) of global layers `[start, end)`, K then V per layer."""

    @abstractmethod
    def import_kv(self, rid: str, start: int, end: int, arrays: list[np.ndarray]) -> None:
        """Install K and V of global layers `[start, end)` for `rid`, as `export_kv` laid them out."""

    @abstractmethod
    def free(self, rid: str) -> None:
        """Drop `rid`'s KV cache; unknown requests are ignored."""

    def kv_usage(self) -> tuple[int, int] | None:
        """(tokens of KV cache held now, tokens the cache can hold) on this node; None where the engine does not
        say (what `vllm:kv_cache_usage_perc` is made of)."""
        return None

    def check_step(self, step: Step) -> None:
        """Raise ValueError when `step` itself cannot run (token ids outside the vocabulary, context exceeded)."""
        if step.tokens is not None and step.tokens.size and not (
                0 <= int(step.tokens.min()) and int(step.tokens.max()) < self.vocab):
            raise ValueError(f"request {step.rid}: token ids must lie in [0, {self.vocab})")
        if self.max_context is not None and step.pos + step.n_tokens > self.max_context:
            raise ValueError(f"request {step.rid}: {step.pos + step.n_tokens} positions exceed "
                             f"max_context={self.max_context}")

    def check_range(self, start: int, end: int) -> None:
        if not self.start <= start < end <= self.end:
            raise CoralError(f"layers [{start}, {end}) are not inside this node's [{self.start}, {self.end}).",
                             "send KV only to the node whose layer range holds it")


def validate_layers(start: int, end: int, n_layers: int) -> None:
    """Layers `[start, end)` must be a non-empty slice of the model."""
    if not 0 <= start < end <= n_layers:
        raise CoralError(f"layer range [{start}, {end}) does not fit a {n_layers}-layer model.",
                         f"pass --layers start:end with 0 <= start < end <= {n_layers}")


def make_engine(kind: str, model: str, start: int, end: int, device: str | None = None) -> Engine:
    """Build the per-step engine `kind` for layers `[start, end)`; torch is imported only here.

    vLLM is not a per-step engine: its head (`runtime/vllm_engine.py`) streams whole requests.
    """
    if kind == "torch":
        from coral_dagster.runtime.tiny import decoder_config
        from coral_dagster.runtime.torch_engine import TorchEngine

        return TorchEngine(decoder_config(model), start, end, device=device)
    if kind == "vllm":
        raise CoralError("the vLLM engine holds a whole instance and streams whole requests, not layer steps.",
                         "start it with `coral serve engine --engine vllm` (runtime/vllm_engine.py)")
    raise CoralError(f"unknown engine {kind!r}.", f"use one of: {', '.join(ENGINE_KINDS)}")
