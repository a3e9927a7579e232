"""Spot capacity in a simulated day: which (region, node) run on spot, and the price table they are billed from."""

from __future__ import annotations

import pandas as pd


def spot_nodes(prices: pd.DataFrame) -> set[tuple[str, str]]:
    """The (region, node) pairs sold on spot (a spot price in the table)."""
    sold = prices[prices.spot_usd_per_hour.notna()]
    return set(zip(sold.region.astype(str), sold.node.astype(str)))


def spot_prices(prices: pd.DataFrame) -> pd.DataFrame:
    """The table with every node sold on spot at its spot price (plans and bills then pay spot); the others keep
    their on-demand price."""
    out = prices.copy()
    out["usd_per_hour"] = out.spot_usd_per_hour.where(out.spot_usd_per_hour.notna(), out.usd_per_hour)
    return out
