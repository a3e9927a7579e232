"""Performance profiles: per-layer latency and memory of every (model, node), measured or calibrated, and T̂."""

from coral_dagster.profiles.perf import PerfModel, ThroughputPoint, default_perf_model
from coral_dagster.profiles.table import profile_table

__all__ = ["PerfModel", "ThroughputPoint", "default_perf_model", "profile_table"]
