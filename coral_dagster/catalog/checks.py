"""Sanity checks of a stored price/availability snapshot: fresh, known GPUs, positive prices."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pandas as pd

from coral_dagster.catalog.gpus import gpu_catalog


def snapshot_problems(offers: pd.DataFrame, max_age: timedelta = timedelta(hours=24),
                      now: datetime | None = None) -> list[str]:
    """Every problem of one snapshot's rows, as sentences; empty when it is sane."""
    if offers.empty:
        return ["the snapshot has no offers"]
    problems = []
    now = now or datetime.now(timezone.utc)
    taken = pd.Timestamp(offers["taken_at"].max())
    taken = taken.tz_localize("UTC") if taken.tzinfo is None else taken
    if now - taken.to_pydatetime() > max_age:
        problems.append(f"the snapshot is {now - taken.to_pydatetime()} old (limit {max_age})")
    unknown = sorted(set(offers["gpu"]) - set(gpu_catalog()))
    if unknown:
        problems.append(f"unknown GPUs: {', '.join(unknown)}")
    bad = offers[~(offers["usd_per_hour"] > 0)]
    problems += [f"{r.region} {r.node}: price {r.usd_per_hour}" for r in bad.itertuples()]
    neg = offers[offers["available_nodes"] < 0]
    problems += [f"{r.region} {r.node}: availability {r.available_nodes}" for r in neg.itertuples()]
    return problems
