"""The DuckDB store: one file holding catalogs, snapshots, profiles, templates, plans and their history."""

from coral_dagster.store.duck import Store

__all__ = ["Store"]
