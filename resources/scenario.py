"""The scenario as a Dagster resource: the one place a run's assets read which scenario they plan for."""

import dagster as dg
from pydantic import Field

from coral_dagster.catalog.scenarios import Scenario, load_scenario


class CoralScenario(dg.ConfigurableResource):
    """The scenario every asset of a run plans for (`coral run --scenario`; `$CORAL_SCENARIO` for the schedules and
    the sensor, default core)."""

    name: str = Field(default="core", description="Bundled scenario name (core, extended, helix) or scenario file.")

    def load(self) -> Scenario:
        return load_scenario(self.name)
