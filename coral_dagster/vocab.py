"""Coral's vocabulary: the names every layer shares (phases, template bounds, serving engines, allocation methods,
solve statuses, T̂ rule versions). It imports nothing from the project, so any module may import it, the GPU-node
runtime included."""

from __future__ import annotations

from typing import Literal

Phase = Literal["prefill", "decode", "aggregated"]
#: What an instance serves: one phase of disaggregated serving, or both on the same nodes.
PHASES: tuple[Phase, ...] = ("prefill", "decode", "aggregated")
DemandPhase = Literal["prefill", "decode"]
#: The phases demand and SLOs are stated in (an aggregated instance serves both).
DEMAND_PHASES: tuple[DemandPhase, ...] = ("prefill", "decode")

Bound = Literal["compute", "memory", "slo", "network"]
#: What limits a template's throughput T̂ (`templates.throughput`).
BOUNDS: tuple[Bound, ...] = ("compute", "memory", "slo", "network")

ServingEngine = Literal["coral", "vllm", "vllm-aggregated"]
#: What runs a plan's instances (`templates.engines`).
SERVING_ENGINES: tuple[ServingEngine, ...] = ("coral", "vllm", "vllm-aggregated")

Method = Literal["coral", "homo", "homo-ilp", "cauchy", "helix"]
#: Coral's ILP and the baselines planned on the same inputs (`allocation.methods`).
METHODS: tuple[Method, ...] = ("coral", "homo", "homo-ilp", "cauchy", "helix")

# "heuristic": a greedy baseline's plan (no optimality claim); "feasible-work-limit": stopped by the solver's work
# limit (reproducible), "feasible-time-limit": by its wall-clock safety net (not reproducible).
SolveStatus = Literal["optimal", "feasible-work-limit", "feasible-time-limit", "infeasible", "scaled", "fair-share",
                      "heuristic"]
SOLVE_STATUSES: tuple[SolveStatus, ...] = ("optimal", "feasible-work-limit", "feasible-time-limit", "infeasible",
                                           "scaled", "fair-share", "heuristic")

THatRule = Literal["paper", "slo"]
#: The rules T̂ may be computed by (`templates.throughput`): `paper`, the paper's plain per-stage rule, and `slo`,
#: ours that holds the SLOs under load (the default).
T_HAT_RULE_NAMES: tuple[THatRule, ...] = ("paper", "slo")
#: The version of each rule (`templates.throughput`, `templates.queueing`); part of every library key, so a
#: library built under other rules is rebuilt, never reused. Change a rule's with any change of what it answers.
T_HAT_RULE_VERSIONS: dict[str, str] = {
    "slo": "2026-12-05 aggregated step fuses chunked prefill into decode; TPOT misses counted as compound Poisson",
    "paper": "paper 2026-12-05 per-stage l/S, one batch of KV, mean fused aggregated step"}
