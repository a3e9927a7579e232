"""Run configuration of the market asset (the scenario itself is the `scenario` resource)."""

import dagster as dg
from pydantic import Field


class MarketConfig(dg.Config):
    """How much of the market's availability the snapshot offers."""

    availability_scale: float = Field(default=1.0, description="Multiply every region's node availability.")
