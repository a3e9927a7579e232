"""A price and availability snapshot: what each region sells, at what price, and how many nodes it has."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime

import pandas as pd

from coral_dagster.catalog.nodes import NodeConfig
from coral_dagster.errors import CoralError, UnknownNameError

#: A region Coral prices: `cloud:region` on AWS or GCP.
REGION_RE = re.compile(r"^(aws|gcp):[a-z0-9-]+$")


@dataclass(frozen=True)
class Offer:
    """One node configuration on sale in one region."""

    region: str
    node: NodeConfig
    instance_type: str
    usd_per_hour: float
    spot_usd_per_hour: float | None
    available_nodes: int


@dataclass(frozen=True)
class MarketSnapshot:
    """Prices and availability per (region, node configuration) at one moment."""

    snapshot_id: str
    taken_at: datetime
    offers: tuple[Offer, ...]
    # The scenario whose regions and availability it holds (`Scenario.scenario_key`); "" when made in code.
    scenario_key: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "_index", {(o.region, o.node): o for o in self.offers})

    def offer(self, region: str, node: NodeConfig) -> Offer | None:
        """The offer for `node` in `region`, or None when the region does not sell it."""
        return self._index.get((region, node))  # type: ignore[attr-defined]

    def price(self, region: str, node: NodeConfig) -> float:
        """On-demand $/node-hour; raises when the region does not sell the node."""
        o = self.offer(region, node)
        if o is None:
            raise UnknownNameError(f"node configuration in {region}", str(node),
                                   [str(x.node) for x in self.offers if x.region == region])
        return o.usd_per_hour

    def availability(self, region: str, node: NodeConfig) -> int:
        """Nodes of `node` that `region` can give us now (0 when not sold there)."""
        o = self.offer(region, node)
        return o.available_nodes if o else 0

    @property
    def regions(self) -> tuple[str, ...]:
        return tuple(sorted({o.region for o in self.offers}))

    @property
    def nodes(self) -> tuple[NodeConfig, ...]:
        return tuple(sorted({o.node for o in self.offers}))

    def to_frame(self) -> pd.DataFrame:
        """One row per offer, with the snapshot id and time."""
        return pd.DataFrame([
            {"snapshot_id": self.snapshot_id, "taken_at": self.taken_at, "region": o.region, "node": str(o.node),
             "gpu": o.node.gpu, "gpus": o.node.count, "instance_type": o.instance_type,
             "usd_per_hour": o.usd_per_hour, "spot_usd_per_hour": o.spot_usd_per_hour,
             "available_nodes": o.available_nodes, "scenario_key": self.scenario_key}
            for o in self.offers
        ])


def market_from_frame(df: pd.DataFrame) -> MarketSnapshot:
    """Rebuild one snapshot from its `to_frame()` rows (e.g. read back from the `market_snapshots` table)."""
    ids = df["snapshot_id"].unique()
    if len(ids) != 1:
        raise CoralError(f"expected the rows of one snapshot, got {len(ids)} snapshot ids.",
                         "filter the rows by snapshot_id first.")
    offers = sorted((
        Offer(r.region, NodeConfig.parse(r.node), r.instance_type, float(r.usd_per_hour),
              None if pd.isna(r.spot_usd_per_hour) else float(r.spot_usd_per_hour), int(r.available_nodes))
        for r in df.itertuples(index=False)), key=lambda o: (o.region, o.node))
    taken = pd.Timestamp(df["taken_at"].iloc[0])
    taken = taken.tz_localize("UTC") if taken.tzinfo is None else taken.tz_convert("UTC")
    key = df["scenario_key"].iloc[0] if "scenario_key" in df.columns else None
    return MarketSnapshot(str(ids[0]), taken.to_pydatetime(), tuple(offers), "" if pd.isna(key) else str(key))
