"""A deployment's full cost: GPU nodes and CPU VMs priced from the plan's own price rows, disks stated, not priced."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pandas as pd

from coral_dagster.allocation.types import Plan
from coral_dagster.deploy import tasks
from coral_dagster.deploy.spec import GPU_ROLES, deployment_nodes


@dataclass(frozen=True)
class DeploymentCost:
    """$/h of every priced cluster by kind, and a sentence for each part the price rows leave unpriced.

    `disk_gb` is each cluster's disk (its task's `disk_size`); the price rows hold no disk prices, so disks are
    always listed in `unpriced`. `total_usd_per_hour` is the priced parts only.
    """

    gpu_usd_per_hour: float
    cpu_usd_per_hour: float
    gpu_nodes: int
    cpu_nodes: int
    unpriced: tuple[str, ...]
    disk_gb: tuple[tuple[str, int], ...]

    @property
    def total_usd_per_hour(self) -> float:
        return self.gpu_usd_per_hour + self.cpu_usd_per_hour

    @property
    def clusters(self) -> int:
        return self.gpu_nodes + self.cpu_nodes

    def as_dict(self) -> dict:
        return {"gpu_usd_per_hour": round(self.gpu_usd_per_hour, 4),
                "cpu_usd_per_hour": round(self.cpu_usd_per_hour, 4),
                "total_usd_per_hour": round(self.total_usd_per_hour, 4), "clusters": self.clusters,
                "gpu_nodes": self.gpu_nodes, "cpu_nodes": self.cpu_nodes, "unpriced": list(self.unpriced),
                "disk_gb": dict(self.disk_gb)}


def deployment_cost(plan: Plan, plan_id: str, prices: pd.DataFrame, source: str) -> DeploymentCost:
    """The full cost of running `plan`: every cluster it needs, the coordinator included, priced from `prices`
    (whose origin `source` names); a cluster without a price is listed as unpriced, never given one."""
    nodes = deployment_nodes(plan, plan_id, prices)
    gpu = [n for n in nodes if n.role in GPU_ROLES]
    cpu = [n for n in nodes if n.role not in GPU_ROLES]
    unpriced = [f"{n.role} {n.cluster_name}: unpriced: no CPU VM price in {source} for {n.region}"
                for n in cpu if n.usd_per_hour is None]
    disks = tuple((n.cluster_name, tasks.disk_gb(n.role)) for n in nodes)
    by_size = Counter(gb for _, gb in disks)
    if disks:
        sizes = " + ".join(f"{k} × {gb} GB" for gb, k in sorted(by_size.items(), reverse=True))
        unpriced.append(f"disks: {sizes} = {sum(gb for _, gb in disks):,} GB: not priced (no disk prices in "
                        f"{source})")
    gpu_usd_per_hour = 0.0
    for n in gpu:
        if n.usd_per_hour is None:
            raise RuntimeError(f"{n.role} {n.cluster_name} has no price: the deployment spec prices every GPU node")
        gpu_usd_per_hour += n.usd_per_hour
    return DeploymentCost(gpu_usd_per_hour, sum(n.usd_per_hour or 0.0 for n in cpu), len(gpu), len(cpu),
                          tuple(unpriced), disks)

