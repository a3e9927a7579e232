"""Random allocation instances with made-up templates, for tests and solver timing without a template library."""

from __future__ import annotations

import itertools
import random

from coral_dagster.allocation.problem import AllocationProblem
from coral_dagster.catalog.nodes import NodeConfig, NodeMultiset
from coral_dagster.templates.types import Stage, Template

GPU_SPEED = {"H100": 7.0, "A100-80GB": 3.5, "L40S": 2.4, "A10G": 1.1, "L4": 1.0, "T4": 0.4, "V100": 0.9}
GPU_PRICE = {"H100": 7.6, "A100-80GB": 3.5, "L40S": 2.2, "A10G": 1.2, "L4": 1.0, "T4": 0.5, "V100": 0.9}


def synthetic_template(model: str, phase: str, nodes: NodeMultiset, tokens_per_s: float,
                       slo_ms: float = 1000.0, n_layers: int = 40) -> Template:
    """A one-stage template over `nodes` (the placement is irrelevant to allocation)."""
    flat = tuple(nodes.nodes())
    return Template(model=model, phase=phase, slo_ms=slo_ms, nodes=nodes,
                    stages=(Stage(0, n_layers, flat, tuple(1.0 / len(flat) for _ in flat)),),
                    tokens_per_s=tokens_per_s, bound="compute")


def synthetic_templates(rng: random.Random, models: list[str], nodes: list[NodeConfig], n_max: int,
                        phases: tuple[str, ...] = ("prefill", "decode"), min_gpus: dict[str, int] | None = None,
                        noise: float = 0.3) -> list[Template]:
    """Every multiset of at most `n_max` nodes per (model, phase) with a noisy, sub-linear throughput."""
    out = []
    for model in models:
        need = (min_gpus or {}).get(model, 1)
        for phase in phases:
            scale = 1000.0 if phase == "prefill" else 150.0
            for size in range(1, n_max + 1):
                for combo in itertools.combinations_with_replacement(nodes, size):
                    gpus = sum(n.count for n in combo)
                    if gpus < need:
                        continue
                    power = sum(GPU_SPEED.get(n.gpu, 1.0) * n.count for n in combo)
                    tput = scale * power * (0.9 ** (size - 1)) * (1.0 + noise * (rng.random() - 0.5))
                    out.append(synthetic_template(model, phase, NodeMultiset.of(combo), round(tput, 3)))
    return out


def random_problem(seed: int, *, n_models: int = 2, gpus: tuple[str, ...] = ("L4", "A10G", "L40S"),
                   counts: tuple[int, ...] = (1, 2), regions: tuple[str, ...] = ("r1", "r2"), n_max: int = 2,
                   avail_range: tuple[int, int] = (0, 6), demand_range: tuple[float, float] = (500.0, 8000.0),
                   churn_k: float = 0.0, aggregated: bool = False) -> AllocationProblem:
    """A small random instance: prices near the GPU's relative cost, random availability and demand."""
    rng = random.Random(seed)
    nodes = [NodeConfig(g, c) for g in gpus for c in counts]
    models = [f"m{i}" for i in range(n_models)]
    phases = ("prefill", "decode", "aggregated") if aggregated else ("prefill", "decode")
    templates = synthetic_templates(rng, models, nodes, n_max, phases)
    prices, avail = {}, {}
    for r in regions:
        for n in nodes:
            if rng.random() < 0.85:
                prices[(r, n)] = round(GPU_PRICE.get(n.gpu, 1.0) * n.count * rng.uniform(0.8, 1.25), 3)
                avail[(r, n)] = rng.randint(*avail_range)
    demand = {(m, p): round(rng.uniform(*demand_range) * (1.0 if p == "prefill" else 0.15), 2)
              for m in models for p in ("prefill", "decode")}
    return AllocationProblem(scenario=f"random-{seed}", templates=tuple(templates), usd_per_hour=prices,
                             available_nodes=avail, demand_tokens_per_s=demand, churn_k=churn_k,
                             prompt_per_output={m: 5.0 for m in models})
