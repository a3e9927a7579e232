"""Dagster resources: the scenario, the DuckDB store, the market feed, the SkyPilot launcher and solver settings."""

from resources.market import BundledMarketFeed, MarketFeed, SkyPilotCatalogFeed
from resources.scenario import CoralScenario
from resources.launcher import SkyPilotLauncher
from resources.solver import SolverSettings
from resources.store import CoralDuckDB

__all__ = ["BundledMarketFeed", "CoralDuckDB", "CoralScenario", "MarketFeed", "SkyPilotCatalogFeed", "SkyPilotLauncher",
           "SolverSettings"]
