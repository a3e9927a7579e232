"""Value objects of a serving template: its stages, layer split and throughput."""

from __future__ import annotations

from dataclasses import dataclass

from coral_dagster.catalog.nodes import NodeConfig, NodeMultiset
from coral_dagster.vocab import Bound, Phase


@dataclass(frozen=True)
class Stage:
    """A contiguous block of layers `[start, end)` held by every node listed; nodes split its load by `shares`.
    `batches`: per node, the prefill tokens per step its T̂ was planned at (vLLM's `max_num_batched_tokens`; empty
    where no such plan exists, e.g. decode)."""

    start: int
    end: int
    nodes: tuple[NodeConfig, ...]
    shares: tuple[float, ...]
    batches: tuple[int, ...] = ()

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

    @property
    def homogeneous(self) -> bool:
        """All nodes of one configuration."""
        return len(self.nodes.counts) == 1

    def node_count(self, node: NodeConfig) -> int:
        """How many nodes of configuration `node` this template uses (`U_c(τ)`)."""
        return self.nodes.as_dict().get(node, 0)


def stages_doc(stages: tuple[Stage, ...]) -> list[dict]:
    """A template's stages as JSON-ready dicts (start, end, nodes, shares, and batches where planned): the one form
    they are stored in (the library, plan instances) and printed in (`coral plan --json`)."""
    return [{"start": s.start, "end": s.end, "nodes": [str(n) for n in s.nodes], "shares": list(s.shares),
             **({"batches": list(s.batches)} if s.batches else {})} for s in stages]


def stages_from_doc(doc: list[dict], parse=NodeConfig.parse) -> tuple[Stage, ...]:
    """Stages back from `stages_doc` (`parse` turns a node name into its configuration, e.g. memoized)."""
    return tuple(Stage(int(s["start"]), int(s["end"]), tuple(parse(n) for n in s["nodes"]),
                       tuple(float(x) for x in s["shares"]), tuple(int(b) for b in s.get("batches", ())))
                 for s in doc)
