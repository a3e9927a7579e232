"""A per-layer latency curve over batch size: piecewise-linear, non-decreasing, fast to evaluate and to search."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np

#: Batch returned when nothing bounds it (a curve that stays flat past its last point); memory caps it later.
UNBOUNDED = 1 << 40


@dataclass(frozen=True)
class Curve:
    """Milliseconds per layer `ys` at integer batch sizes `xs` (ascending); linear in between and beyond the ends.

    `best_ratio[i]` / `best_at[i]` hold the lowest milliseconds per batch unit among `xs[:i+1]` and where it is, so a
    throughput search needs no scan.
    """

    xs: tuple[float, ...]
    ys: tuple[float, ...]
    source: str
    best_ratio: tuple[float, ...] = field(repr=False, default=())
    best_at: tuple[int, ...] = field(repr=False, default=())

    @classmethod
    def build(cls, xs: np.ndarray, ys: np.ndarray, source: str) -> "Curve":
        """From points; running max makes it non-decreasing (measured tables carry jitter)."""
        xs = np.asarray(xs, dtype=float)
        ys = np.maximum.accumulate(np.maximum(np.asarray(ys, dtype=float), 1e-9))
        ratio = ys / xs
        best_at = np.zeros(len(xs), dtype=int)
        for i in range(1, len(xs)):
            best_at[i] = i if ratio[i] < ratio[best_at[i - 1]] else best_at[i - 1]
        return cls(tuple(xs.tolist()), tuple(ys.tolist()), source, tuple(ratio[best_at].tolist()),
                   tuple(best_at.tolist()))

    def _segment(self, x: float) -> int:
        """Index i of the segment [xs[i], xs[i+1]] used for x (the first or last one outside the grid)."""
        i = bisect.bisect_right(self.xs, x) - 1
        return min(max(i, 0), len(self.xs) - 2)

    def __call__(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        i = self._segment(x)
        x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
        return max(y0 + (y1 - y0) * (x - x0) / (x1 - x0), 1e-9)

    def largest_within(self, layers: int, per_unit_ms: float, budget_ms: float) -> int:
        """Largest integer batch x >= 0 with `layers * curve(x) + per_unit_ms * x <= budget_ms` (0 if none)."""
        xs, ys = self.xs, self.ys
        stage = lambda i: layers * ys[i] + per_unit_ms * xs[i]  # noqa: E731
        if stage(0) > budget_ms:
            if xs[0] <= 1:
                return 0
            i = 0
        else:
            lo, hi = 0, len(xs) - 1
            if stage(hi) <= budget_ms:
                i = hi - 1
            else:
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    if stage(mid) <= budget_ms:
                        lo = mid
                    else:
                        hi = mid
                i = lo
        x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
        slope = layers * (y1 - y0) / (x1 - x0) + per_unit_ms
        base = layers * y0 + per_unit_ms * x0
        if slope <= 0:
            return UNBOUNDED if base <= budget_ms else 0
        x = int(x0 + (budget_ms - base) / slope + 1e-9)
        while x >= 1 and layers * self(x) + per_unit_ms * x > budget_ms:
            x -= 1
        return max(x, 0)

    def best_batch(self, upto: int) -> int:
        """The batch in [1, upto] with the lowest milliseconds per batch unit (the highest throughput at any
        number of layers and any per-unit transfer cost): a grid point, or `upto` itself."""
        i = bisect.bisect_right(self.xs, upto) - 1
        if i < 0:
            return upto
        at_upto = self(upto) / upto
        return upto if at_upto <= self.best_ratio[i] else int(self.xs[self.best_at[i]])
