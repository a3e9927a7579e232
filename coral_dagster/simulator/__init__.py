"""Event-driven simulation of a plan serving request traces: latency, SLO attainment, goodput, utilisation."""

from coral_dagster.simulator.engine import Engine, SimConfig
from coral_dagster.simulator.latency import ConstantLatencyModel, LatencyModel, ProfileLatencyModel, StageLatency
from coral_dagster.simulator.result import ModelSlo, SimResult
from coral_dagster.simulator.simulate import goodput_estimator, simulate_plan
from coral_dagster.catalog.traces import load_trace, trace_means
from coral_dagster.simulator.workload import ModelLoad, Workload, make_workload

__all__ = [
    "ConstantLatencyModel", "Engine", "LatencyModel", "ModelLoad", "ModelSlo", "ProfileLatencyModel", "SimConfig",
    "SimResult", "StageLatency", "Workload", "goodput_estimator", "load_trace", "make_workload", "simulate_plan",
    "trace_means",
]
