"""A one-instance aggregated plan with given admission limits, for admission tests."""

from __future__ import annotations

from coral_dagster.allocation.types import AdmissionLimits, Plan, PlannedInstance
from coral_dagster.catalog.nodes import NodeConfig, NodeMultiset
from coral_dagster.templates.types import Stage, Template

L40S = NodeConfig.parse("L40S:1")


def aggregated_plan(admit: dict[str, float], depth: dict[str, float] | None = None, served: float = 0.0,
                     factors: dict[tuple[str, str], float] | None = None) -> Plan:
    t = Template("phi-4", "aggregated", 60.0, NodeMultiset.of([L40S]), (Stage(0, 40, (L40S,), (1.0,)),), 1e6,
                 "compute")
    return Plan("test", "coral", "scaled", 1.0, 1.0, 0.0, 0.0, (PlannedInstance(t, "aws:us-east-2", 1, 1.0),),
                {("phi-4", "prefill"): 1.0, ("phi-4", "decode"): 1.0},
                {("phi-4", "prefill"): served, ("phi-4", "decode"): served} if served else {},
                admission=AdmissionLimits(factors or {}, admit, depth or {}))
