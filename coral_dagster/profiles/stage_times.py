"""One pipeline stage's iteration times from the performance model, cached on grids: what the simulator runs
(`simulator.latency.ProfileLatencyModel`) and what T̂ prices chunked prefill with (`templates.throughput`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from coral_dagster.catalog.nodes import NodeConfig

if TYPE_CHECKING:
    from coral_dagster.catalog.models import ModelSpec
    from coral_dagster.profiles.perf import PerfModel


class StageLatency(Protocol):
    """Iteration times of one node holding `layers` layers of one model."""

    @property
    def kv_capacity_tokens(self) -> float:
        """KV-cache tokens the node holds beside its layers."""

    def prefill_ms(self, tokens: int, seq_tokens: int, past_tokens: float = 0.0) -> float:
        """One forward pass over `tokens` prompt tokens in chunks of `seq_tokens` (token-weighted mean), each
        attending also to the `past_tokens` (token-weighted mean) of its prompt that earlier chunks cached."""

    def decode_ms(self, batch: int, context_tokens: int) -> float:
        """One decode iteration of `batch` sequences whose contexts sum to `context_tokens`."""


def fused_step_ms(lat: StageLatency, batch: int, context_tokens: int, tokens: int, seq_tokens: int,
                  past_tokens: float = 0.0) -> float:
    """One engine step that holds `batch` decode sequences (contexts summing to `context_tokens`) and `tokens`
    prompt tokens of chunked prefill, as vLLM runs it: one forward pass, so the weights are read once. It costs the
    decode iteration plus what the prompt tokens add to a pass over the decode tokens, prefill(batch + tokens) −
    prefill(batch) at the chunks' length and past (their extra matmul work and their own attention); alone, either
    part costs what it costs by itself."""
    if not tokens:
        return lat.decode_ms(batch, context_tokens) if batch else 0.0
    if not batch:
        return lat.prefill_ms(tokens, seq_tokens, past_tokens)
    extra = lat.prefill_ms(batch + tokens, seq_tokens, past_tokens) - lat.prefill_ms(batch, seq_tokens, past_tokens)
    return lat.decode_ms(batch, context_tokens) + max(extra, 0.0)


class _Grid:
    """Points 2**(i / steps) for i = 0 .. steps * doublings; `bracket` finds the cell of x in O(1)."""

    def __init__(self, steps_per_doubling: int, doublings: int = 24) -> None:
        self.steps = steps_per_doubling
        self.points = [2.0 ** (i / steps_per_doubling) for i in range(doublings * steps_per_doubling + 1)]
        self.last = len(self.points) - 2

    def bracket(self, x: float) -> tuple[int, float]:
        """Index i and weight w with x = (1 - w) * points[i] + w * points[i + 1] (clamped to the grid)."""
        i = int(math.log2(x) * self.steps) if x > 1.0 else 0
        i = i if i < self.last else self.last
        lo, hi = self.points[i], self.points[i + 1]
        w = (x - lo) / (hi - lo)
        return i, (0.0 if w < 0.0 else 1.0 if w > 1.0 else w)


# Cache grids: decode context 1/16 doubling apart, prefill tokens 1/32 and prompt length 1/8; linear in between.
_CONTEXT = _Grid(16)
_TOKENS = _Grid(32)
_SEQ = _Grid(8)


@dataclass
class ProfileStage:
    """A stage timed by the profile performance model, cached on grids and interpolated linearly: decode per
    exact batch over mean context; prefill over batch tokens and chunk length.

    A chunk of c tokens whose prompt already has a tokens cached costs its fresh cost plus the attention the
    model charges a whole prompt beyond its parts: A(a + c) − A(a) − A(c), where A(x) = W(x) − M(x) is the model's
    whole-prompt time W of x tokens less its time M for x tokens in one-token prompts (no attention to speak of),
    sliding-window layers included. The chunks c_1..c_k of a prompt of P tokens thus cost Σ M(c_i) + A(P): the
    whole prompt's attention, and the rest of the layer once per pass.
    """

    perf: PerfModel
    spec: ModelSpec | str
    node: NodeConfig
    layers: int
    kv_capacity_tokens: float
    _prefill: dict = field(default_factory=dict)
    _decode: dict = field(default_factory=dict)

    def _prefill_at(self, ti: int, si: int) -> float:
        key = (ti, si)
        ms = self._prefill.get(key)
        if ms is None:
            tokens = max(int(round(_TOKENS.points[ti])), 1)
            seq = max(int(round(_SEQ.points[si])), 1)
            ms = self._prefill[key] = self.perf.prefill_ms_per_layer(self.spec, self.node, tokens, seq) * self.layers
        return ms

    def _fresh_ms(self, tokens: float, seq_tokens: float) -> float:
        ti, tw = _TOKENS.bracket(tokens)
        si, sw = _SEQ.bracket(seq_tokens)
        at = self._prefill_at
        return ((1 - tw) * ((1 - sw) * at(ti, si) + sw * at(ti, si + 1))
                + tw * ((1 - sw) * at(ti + 1, si) + sw * at(ti + 1, si + 1)))

    def _attention_ms(self, prompt_tokens: float) -> float:
        """A(x): what a whole prompt of x tokens costs beyond x tokens of one-token prompts."""
        return self._fresh_ms(prompt_tokens, prompt_tokens) - self._fresh_ms(prompt_tokens, 1)

    def prefill_ms(self, tokens: int, seq_tokens: int, past_tokens: float = 0.0) -> float:
        fresh = self._fresh_ms(tokens, seq_tokens)
        if past_tokens <= 0:
            return fresh
        attention = self._attention_ms
        gain = attention(past_tokens + seq_tokens) - attention(past_tokens) - attention(seq_tokens)
        return fresh + max(gain, 0.0) * tokens / seq_tokens

    def prompt_ms(self, prompt_tokens: int, chunk_tokens: int) -> float:
        """One prompt alone, prefilled in chunks of at most `chunk_tokens` as the engine prices them."""
        total, done = 0.0, 0
        while done < prompt_tokens:
            c = min(chunk_tokens, prompt_tokens - done)
            total += self.prefill_ms(c, c, done)
            done += c
        return total

    def _decode_at(self, batch: int, ci: int) -> float:
        key = (batch, ci)
        ms = self._decode.get(key)
        if ms is None:
            ms = self.perf.decode_ms_per_layer(self.spec, self.node, batch, _CONTEXT.points[ci]) * self.layers
            self._decode[key] = ms
        return ms

    def decode_ms(self, batch: int, context_tokens: int) -> float:
        ci, w = _CONTEXT.bracket(context_tokens / batch)
        return (1.0 - w) * self._decode_at(batch, ci) + w * self._decode_at(batch, ci + 1)
