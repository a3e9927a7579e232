"""Run configuration shared by the assets: which scenario, how much availability, which demand mix."""

import dagster as dg
from pydantic import Field


class ScenarioConfig(dg.Config):
    """The scenario a run plans for."""

    scenario: str = Field(default="core", description="Bundled scenario: core, extended or helix.")
    availability_scale: float = Field(default=1.0, description="Multiply every region's node availability.")
