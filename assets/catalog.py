"""Catalog assets: GPU types, node configurations, models, prices and scenarios, validated into DuckDB."""

import dagster as dg

from coral_dagster.catalog.frames import models_frame
from coral_dagster.catalog.store import load_catalogs
from resources.market import MarketFeed
from resources.store import CoralDuckDB


@dg.asset(group_name="catalog", kinds={"duckdb", "python"})
def catalogs(duckdb: CoralDuckDB, market: MarketFeed) -> dg.MaterializeResult:
    """Every bundled catalog, validated and written to the `catalog_*` tables in one transaction (prices: the
    market feed's price table)."""
    counts = load_catalogs(duckdb.store(), market.price_table())
    models = models_frame()[["alias", "layers", "params_b", "weights_gib"]].round(2)
    return dg.MaterializeResult(metadata={
        **{f"rows/{table}": dg.MetadataValue.int(n) for table, n in counts.items()},
        "models": dg.MetadataValue.md(models.to_markdown(index=False)),
    })
