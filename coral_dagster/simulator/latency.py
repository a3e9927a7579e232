"""Execution-time predictors the simulator asks for one node's iteration time (a Vidur-style interface)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from coral_dagster.catalog.nodes import NodeConfig
from coral_dagster.profiles.stage_times import ProfileStage, StageLatency

if TYPE_CHECKING:
    from coral_dagster.profiles.perf import PerfModel


class LatencyModel(Protocol):
    """Makes the predictor of one (model, node, layers) stage."""

    def stage(self, model: str, node: NodeConfig, layers: int) -> StageLatency: ...


@dataclass(frozen=True)
class ConstantStage:
    """Fixed iteration times whatever the batch: the service time of a textbook queue."""

    prefill_iteration_ms: float
    decode_iteration_ms: float
    kv_capacity_tokens: float = float("inf")

    def prefill_ms(self, tokens: int, seq_tokens: int, past_tokens: float = 0.0) -> float:
        return self.prefill_iteration_ms

    def decode_ms(self, batch: int, context_tokens: int) -> float:
        return self.decode_iteration_ms


@dataclass(frozen=True)
class ConstantLatencyModel:
    """Every stage takes the same fixed time per iteration (tests and queueing checks)."""

    prefill_iteration_ms: float
    decode_iteration_ms: float
    kv_capacity_tokens: float = float("inf")

    def stage(self, model: str, node: NodeConfig, layers: int) -> StageLatency:
        return ConstantStage(self.prefill_iteration_ms, self.decode_iteration_ms, self.kv_capacity_tokens)


class ProfileLatencyModel:
    """Stage times from the fitted performance model (`coral_dagster.profiles.default_perf_model()`)."""

    def __init__(self, perf: PerfModel | None = None) -> None:
        if perf is None:
            from coral_dagster.profiles import default_perf_model

            perf = default_perf_model()
        self.perf = perf
        self._stages: dict[tuple[str, NodeConfig, int], ProfileStage] = {}

    def stage(self, model: str, node: NodeConfig, layers: int) -> StageLatency:
        key = (model, node, layers)
        if key not in self._stages:
            from coral_dagster.catalog.models import get_model

            spec = get_model(model)
            kv = self.perf.kv_capacity_tokens(spec, node, layers)
            self._stages[key] = ProfileStage(self.perf, spec, node, layers, float(kv))
        return self._stages[key]
