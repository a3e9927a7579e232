"""Availability: how many nodes of each configuration a region gives one account, and how that changes over time.

Two profiles. `uniform`: every configuration the same count (`default_nodes`), the setting Coral used before the
market model. `market`: counts that follow data/scenarios/MARKET.md — top-tier GPUs and large nodes scarcer than
mid-tier GPUs and small nodes: nodes(G:k) = max(1, floor(base_nodes × gpu_factor(G) × size_factor(k))), each
factor cited there. Either profile may pin (region, node) counts (`nodes`) and carry a `series`: per-window
multipliers (all GPUs, or per GPU type) with the window length, replayed window by window by the market feed,
the re-plan sensor and the benches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from datetime import datetime

from coral_dagster.catalog.nodes import NodeConfig

PROFILES = ("uniform", "market")
#: MARKET.md §2: nodes a region gives per GPU type, relative to a mid-tier GPU (L4, A10G, T4): G-family vs
#: P-family quota and capacity statements, GCP zone coverage, capacity blocks for the top tier.
MARKET_GPU_FACTORS = {"L4": 1.0, "A10G": 1.0, "T4": 1.0, "L40S": 0.5, "A40": 0.5, "V100": 0.5,
                      "A100": 0.25, "A100-80GB": 0.25, "H100": 0.125, "H200": 0.0625}
#: MARKET.md §3: nodes per size relative to a 1-GPU node (a 2-GPU node half as many, a 4-GPU node an eighth, an
#: 8-GPU node a thirty-second: the GPUs a region gives in large nodes fall with the node's size).
MARKET_SIZE_FACTORS = {1: 1.0, 2: 0.5, 4: 0.125, 8: 0.03125}
#: MARKET.md §4: 1-GPU mid-tier nodes per region: the mid-tier GPUs of the four sizes (87 × 2.75 ≈ 240) as many as
#: the uniform setting gives (16 nodes × (1 + 2 + 4 + 8) GPUs).
MARKET_BASE_NODES = 87


@dataclass(frozen=True)
class Series:
    """Availability over time: multipliers per window of `window_min` minutes (for every GPU type), and per GPU
    type multipliers that replace them for that type; window i of a day-long replay is i mod len."""

    window_min: float
    multipliers: tuple[float, ...]
    by_gpu: tuple[tuple[str, tuple[float, ...]], ...] = ()

    @property
    def windows(self) -> int:
        return len(self.multipliers)

    def multiplier(self, gpu: str, window: int) -> float:
        """The factor on `gpu`'s counts in `window` (taken modulo the series' length)."""
        for g, values in self.by_gpu:
            if g == gpu:
                return values[window % self.windows]
        return self.multipliers[window % self.windows]

    def window_at(self, when: datetime) -> int:
        """The window a moment falls in: whole windows since the Unix epoch, modulo the series' length."""
        return int(when.timestamp() // (self.window_min * 60)) % self.windows


@dataclass(frozen=True)
class Availability:
    """A scenario's availability model (see the module docstring); `nodes` pins (region, node) counts."""

    profile: str = "uniform"
    default_nodes: int = 16
    base_nodes: int = MARKET_BASE_NODES
    gpu_factors: tuple[tuple[str, float], ...] = tuple(MARKET_GPU_FACTORS.items())
    size_factors: tuple[tuple[int, float], ...] = tuple(MARKET_SIZE_FACTORS.items())
    nodes: tuple[tuple[str, NodeConfig, int], ...] = ()
    series: Series | None = None

    def count(self, region: str, node: NodeConfig, window: int = 0) -> int:
        """Nodes of `node` in `region` during `window` (window 0 when no series)."""
        base = next((k for r, n, k in self.nodes if r == region and n == node), None)
        if base is None:
            base = self.default_nodes if self.profile == "uniform" else self.shaped(node)
        if self.series is None:
            return base
        return int(math.floor(base * self.series.multiplier(node.gpu, window) + 1e-9))

    def shaped(self, node: NodeConfig) -> int:
        """The market profile's count for `node`: base × GPU factor × size factor, at least one node."""
        g, s = dict(self.gpu_factors).get(node.gpu, 1.0), dict(self.size_factors).get(node.count, 1.0)
        return max(1, int(math.floor(self.base_nodes * g * s + 1e-9)))

    def window_at(self, when: datetime | None) -> int:
        """The series window of a moment (0 without a series or a moment)."""
        return 0 if self.series is None or when is None else self.series.window_at(when)

    @property
    def windows(self) -> int:
        return self.series.windows if self.series else 1

    def with_shape(self, gpu_power: float, size_power: float) -> "Availability":
        """The market profile with its GPU and size factors raised to powers: 0 removes that scarcity (every type
        or size as plentiful as the mid-tier 1-GPU node), 1 is MARKET.md's shape, 2 squares it (severe)."""
        return replace(self, profile="market",
                       gpu_factors=tuple((g, f ** gpu_power) for g, f in self.gpu_factors),
                       size_factors=tuple((k, f ** size_power) for k, f in self.size_factors))
