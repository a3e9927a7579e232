"""Market feeds: where price and availability snapshots come from (bundled snapshot here, SkyPilot's live catalog).
Both take availability from the scenario in the window of its series that now falls in (data/scenarios/MARKET.md)."""

from abc import ABC, abstractmethod
from datetime import datetime, timezone
from pathlib import Path

import dagster as dg
import pandas as pd
from pydantic import Field

from coral_dagster.catalog.market import MarketSnapshot
from coral_dagster.catalog.prices import build_node_prices, read_price_file
from coral_dagster.catalog.scenarios import Scenario


class MarketFeed(dg.ConfigurableResource, ABC):
    """Gives a price and availability snapshot for a scenario's regions and node configurations."""

    @abstractmethod
    def snapshot(self, scenario: Scenario, availability_scale: float = 1.0) -> MarketSnapshot:
        """The market as of now."""

    def price_table(self) -> pd.DataFrame | None:
        """The price rows the `catalogs` asset lists; None: the default table (`load_node_prices`)."""
        return None


class BundledMarketFeed(MarketFeed):
    """The price snapshot shipped under `data/prices/` (SkyPilot catalog v8 rows, read 2026-11-29), or the user's
    price file that replaces it (`coral run --prices`)."""

    prices_file: str = Field(default="", description="Price CSV replacing the bundled rows (`coral run --prices`); "
                                                     "empty: the bundled rows.")

    def price_table(self) -> pd.DataFrame | None:
        return read_price_file(Path(self.prices_file)) if self.prices_file else None

    def snapshot(self, scenario: Scenario, availability_scale: float = 1.0) -> MarketSnapshot:
        return scenario.market(availability_scale, prices=self.price_table(), taken_at=_now())


class SkyPilotCatalogFeed(MarketFeed):
    """SkyPilot's own catalog files, which SkyPilot refreshes from the public catalog (`~/.sky/catalogs/v8`)."""

    catalog_dir: str = Field(default="~/.sky/catalogs/v8", description="Folder holding aws/vms.csv and gcp/vms.csv.")

    def snapshot(self, scenario: Scenario, availability_scale: float = 1.0) -> MarketSnapshot:
        root = Path(self.catalog_dir).expanduser()
        build = build_node_prices(root / "aws" / "vms.csv", root / "gcp" / "vms.csv")
        return scenario.market(availability_scale, prices=build.prices, taken_at=_now())


def _now() -> datetime:
    return datetime.now(timezone.utc).replace(microsecond=0)
