"""A T̂ point as the perf model reports it, for tests that build their own."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Pt:
    tokens_per_s: float
    batch: int
    stage_ms: float
    bound: str
