"""Smooth weighted round-robin: picks in proportion to weights, spreading each key's turns evenly."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Hashable


class WeightedRoundRobin:
    """Each pick adds every weight to its key's credit, takes the key with most credit and charges it the total.

    Over any window of `sum(weights)` picks with integer weights each key is chosen exactly `weight` times. Keys may
    come and go between picks (instances joining, draining); a key's credit is forgotten when it leaves.
    """

    def __init__(self) -> None:
        self._credit: dict[Hashable, float] = {}

    def pick(self, weights: Mapping[Hashable, float]) -> Hashable:
        live = {k: w for k, w in weights.items() if w > 0}
        if not live:
            raise ValueError("no key with positive weight to pick from")
        self._credit = {k: self._credit.get(k, 0.0) + w for k, w in live.items()}
        best = max(sorted(live, key=str), key=lambda k: self._credit[k])
        self._credit[best] -= sum(live.values())
        return best
