"""Node configurations (`L40S:2`) and node multisets (`3xL40S:1,2xH100:2`): parsing and printing."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Iterator

from coral_dagster.errors import CoralError

_NODE_RE = re.compile(r"^(?P<gpu>[A-Za-z0-9][A-Za-z0-9-]*):(?P<count>\d+)$")
_ITEM_RE = re.compile(r"^(?:(?P<n>\d+)x)?(?P<node>[^,\s]+)$")
GPUS_PER_NODE = (1, 2, 4, 8)
# Most nodes one multiset may hold: a template has at most `scenarios.MAX_N_MAX` (8); room for hand-written lists,
# and a bound that keeps `nodes()` and every search over a multiset finite.
MAX_MULTISET_NODES = 256


@dataclass(frozen=True, order=True)
class NodeConfig:
    """One cloud instance: `count` GPUs of type `gpu` (tensor/expert parallel only inside the node)."""

    gpu: str
    count: int

    def __post_init__(self) -> None:
        if self.count not in GPUS_PER_NODE:
            raise CoralError(
                f"node {self.gpu}:{self.count} has {self.count} GPUs.",
                f"use {', '.join(map(str, GPUS_PER_NODE))} GPUs per node.",
            )

    @classmethod
    def parse(cls, text: str) -> "NodeConfig":
        """Parse `GPU:count`, e.g. `L40S:1`."""
        m = _NODE_RE.match(text.strip())
        if not m or len(m["count"]) > 3:
            raise CoralError(
                f"cannot read node configuration {text[:80]!r}.", "write it as GPU:count, e.g. L40S:1 or H100:8."
            )
        return cls(m["gpu"], int(m["count"]))

    def __str__(self) -> str:
        return f"{self.gpu}:{self.count}"


@dataclass(frozen=True)
class NodeMultiset:
    """A multiset of node configurations; two with the same count per configuration are equal."""

    counts: tuple[tuple[NodeConfig, int], ...]

    @classmethod
    def of(cls, nodes: Iterable[NodeConfig] | dict[NodeConfig, int]) -> "NodeMultiset":
        """Build from an iterable of nodes (repeats count) or a `{node: count}` mapping."""
        c = Counter(nodes) if not isinstance(nodes, dict) else Counter(nodes)
        return cls(tuple(sorted((n, k) for n, k in c.items() if k > 0)))

    @classmethod
    def parse(cls, text: str) -> "NodeMultiset":
        """Parse `3xL40S:1,2xH100:2` (a count of 1 may be omitted: `L4:1,H100:8`)."""
        counts: Counter[NodeConfig] = Counter()
        for item in filter(None, (p.strip() for p in text.split(","))):
            m = _ITEM_RE.match(item)
            if not m:
                raise CoralError(f"cannot read node item {item!r}.", "write nodes as 3xL40S:1,2xH100:2.")
            # Digits are read only up to the bound's length, so a count of a million digits costs nothing.
            n = int(m["n"]) if m["n"] and len(m["n"]) <= 6 else (MAX_MULTISET_NODES + 1 if m["n"] else 1)
            if n < 1:
                raise CoralError(f"node item {item!r} has a count of 0.", "give each node type a count of 1 or more.")
            counts[NodeConfig.parse(m["node"])] += n
            if sum(counts.values()) > MAX_MULTISET_NODES:
                raise CoralError(f"node list {text[:80]!r} holds more than {MAX_MULTISET_NODES} nodes.",
                                 f"list at most {MAX_MULTISET_NODES} nodes (templates hold a handful).")
        if not counts:
            raise CoralError(f"node list {text[:80]!r} is empty.", "name at least one node, e.g. 2xL4:1.")
        return cls.of(counts)

    def nodes(self) -> Iterator[NodeConfig]:
        """Each node, repeated by its count, in sorted order."""
        for node, k in self.counts:
            yield from [node] * k

    def as_dict(self) -> dict[NodeConfig, int]:
        return dict(self.counts)

    @property
    def size(self) -> int:
        return sum(k for _, k in self.counts)

    def __str__(self) -> str:
        return ",".join(f"{k}x{n}" for n, k in self.counts)
