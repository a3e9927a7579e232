"""A simulated cloud behind the `Launcher` protocol: capacity per (region, node) per window, launch failures,
spot preemptions."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Callable

from coral_dagster.deploy.launcher import LaunchError, LaunchRequest, LaunchResult


@dataclass
class SimCloud:
    """Launches clusters instantly in simulated time; what a launch costs in time is the loop's (`shape.startup_s`).

    `capacity(region, node)` is how many nodes of that configuration the region gives in the current window (set
    by the loop); a launch beyond it raises `LaunchError` and is recorded in `refused`, as a cloud's capacity error
    (e.g. GCP's ZONE_RESOURCE_POOL_EXHAUSTED) does. Otherwise a launch fails at random with `failure_rate`
    (seeded: the same day fails the same launches). Clusters without accelerators (the CPU VMs of the coordinators
    and the endpoint) are never short.

    Nodes for which `spot(region, node)` holds run on spot: `reclaim` takes back those beyond the window's capacity
    (the provider's supply fell), `preempt` takes each at random with `preemptions_per_day` its chance within a day
    (a constant hazard). Both are seeded and recorded in `preempted`."""

    capacity: Callable[[str, str], int]
    failure_rate: float = 0.0
    seed: int = 0
    spot: Callable[[str, str], bool] | None = None
    preemptions_per_day: float = 0.0
    preempted: list[str] = field(default_factory=list)
    up: dict[str, tuple[str, str]] = field(default_factory=dict)
    refused: list[tuple[str, str]] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    launches: int = 0

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def in_use(self, region: str, node: str) -> int:
        return sum(1 for key in self.up.values() if key == (region, node))

    def launch(self, request: LaunchRequest) -> LaunchResult:
        res = request.config.get("resources", {})
        region, node = f"{res.get('cloud')}:{res.get('region')}", str(res.get("accelerators") or "")
        self.launches += 1
        if node:
            if self.in_use(region, node) >= self.capacity(region, node):
                self.refused.append((region, node))
                raise LaunchError(f"{region} has no {node} capacity left for {request.cluster_name} (simulated).",
                                  "fail over: re-plan without this (region, node) for the window.")
            if self.failure_rate > 0 and self._rng.random() < self.failure_rate:
                self.failed.append(request.cluster_name)
                raise LaunchError(f"{request.cluster_name} failed to set up (simulated).", "launch it again.")
        self.up[request.cluster_name] = (region, node)
        n = self.launches
        return LaunchResult(request.cluster_name, f"10.{n // 65536 % 256}.{n // 256 % 256}.{n % 256}")

    def down(self, cluster_name: str) -> None:
        self.up.pop(cluster_name, None)

    def reclaim(self) -> list[str]:
        """Take back, at random, the spot clusters beyond each (region, node)'s capacity now."""
        taken: list[str] = []
        for key in sorted(set(self.up.values())):
            if self.spot is None or not key[1] or not self.spot(*key):
                continue
            held = sorted(name for name, k in self.up.items() if k == key)
            excess = len(held) - self.capacity(*key)
            if excess > 0:
                taken += self._rng.sample(held, excess)
        return self._take(taken)

    def preempt(self, seconds: float) -> list[tuple[str, float]]:
        """The spot clusters preempted within the next `seconds`, each with its offset into them."""
        if self.spot is None or self.preemptions_per_day <= 0:
            return []
        hazard = -math.log1p(-self.preemptions_per_day) / 86_400.0
        hits = []
        for name in sorted(self.up):
            key = self.up[name]
            if key[1] and self.spot(*key):
                offset = self._rng.expovariate(hazard)
                if offset < seconds:
                    hits.append((name, offset))
        self._take([name for name, _ in hits])
        return hits

    def _take(self, names: list[str]) -> list[str]:
        for name in names:
            self.up.pop(name)
            self.preempted.append(name)
        return names


@dataclass
class SimDrainer:
    """The coordinator side of a simulated deployment: every drain finishes (the loop bills its drain time) and
    admission limits are kept as a coordinator keeps them."""

    limits: dict[str, str] = field(default_factory=dict)

    def drain(self, coordinator: str, instance_id: str, timeout_s: float) -> bool:
        return True

    def admit(self, coordinator: str, text: str) -> bool:
        changed = self.limits.get(coordinator, "") != text
        self.limits[coordinator] = text
        return changed
