"""Value objects of a serving template: its stages, layer split and throughput."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from coral_dagster.catalog.nodes import NodeConfig, NodeMultiset

Phase = Literal["prefill", "decode", "aggregated"]
PHASES: tuple[Phase, ...] = ("prefill", "decode", "aggregated")
Bound = Literal["compute", "memory", "slo", "network"]


@dataclass(frozen=True)
class Stage:
    """A contiguous block of layers `[start, end)` held by every node listed; nodes split its load by `shares`."""

    start: int
    end: int
    nodes: tuple[NodeConfig, ...]
    shares: tuple[float, ...]

    @property
    def layers(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Template:
    """Region-free serving template: a node multiset, its optimal placement and throughput for one SLO."""

    model: str
    phase: Phase
    slo_ms: float
    nodes: NodeMultiset
    stages: tuple[Stage, ...]
    tokens_per_s: float
    bound: Bound

    @property
    def template_id(self) -> str:
        """Stable key: model, phase, SLO and node multiset."""
        return f"{self.model}|{self.phase}|{self.slo_ms:g}|{self.nodes}"

    @property
    def pp_partition(self) -> str:
        """The layer split as vLLM's `VLLM_PP_LAYER_PARTITION` takes it."""
        return ",".join(str(s.layers) for s in self.stages)

    def node_count(self, node: NodeConfig) -> int:
        """How many nodes of configuration `node` this template uses (`U_c(τ)`)."""
        return self.nodes.as_dict().get(node, 0)
