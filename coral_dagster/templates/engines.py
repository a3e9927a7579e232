"""Which serving templates each engine can execute: Coral's own runtime runs every template, vLLM a subset.

vLLM (multiprocessing executor over separately started nodes, `vllm serve … --nnodes N --node-rank i
--master-addr HEAD`, no Ray) runs a template when:

- V1 one node per stage: vLLM has no data parallelism inside a pipeline stage, so a stage served by several
  nodes that split its load has no vLLM equivalent;
- V2 every node has the same GPU count: vLLM takes one tensor-parallel size for all stages, and its
  multiprocessing executor starts the same number of ranks (= TP) on every node; GPU types may differ;
- V3 the phase is `aggregated`: a prefill instance would have to hand its KV cache to a decode instance
  through a KV connector, which Coral's vLLM deployment does not configure.

Ray would lift V2 (one rank per GPU, placed freely) but not V1, and needs a Ray cluster spanning the
instance's nodes; the multiprocessing executor is what vLLM documents for multi-node serving without it.
"""

from __future__ import annotations

from typing import Sequence

from coral_dagster.errors import CoralError
from coral_dagster.templates.types import Template
from coral_dagster.vocab import SERVING_ENGINES, ServingEngine


def vllm_violations(t: Template) -> tuple[str, ...]:
    """The rules (V1–V3 above) that keep vLLM from running template `t`; empty when it can."""
    out = []
    crowded = [s for s, stage in enumerate(t.stages) if len(stage.nodes) != 1]
    if crowded:
        out.append(f"V1: stages {crowded} are served by several nodes (vLLM has no data parallelism in a stage)")
    counts = sorted({n.count for stage in t.stages for n in stage.nodes})
    if len(counts) > 1:
        out.append(f"V2: nodes hold {counts} GPUs (vLLM takes one tensor-parallel size for every stage)")
    if t.phase != "aggregated":
        out.append(f"V3: phase {t.phase} needs a KV handoff between instances (vLLM runs aggregated instances)")
    return tuple(out)


def check_engine(engine: str) -> ServingEngine:
    """`engine` as a known serving engine, or an error listing them."""
    if engine not in SERVING_ENGINES:
        raise CoralError(f"unknown serving engine {engine!r}.", f"use one of: {', '.join(SERVING_ENGINES)}")
    return engine  # type: ignore[return-value]


def runnable(engine: str, templates: Sequence[Template]) -> tuple[Template, ...]:
    """The templates `engine` can execute, in the given order."""
    if check_engine(engine) == "coral":
        return tuple(templates)
    return tuple(t for t in templates if not vllm_violations(t))
