"""The DuckDB store as a Dagster resource (dagster-duckdb), handing assets Coral's transactional `Store`."""

from dagster_duckdb import DuckDBResource
from pydantic import Field

from coral_dagster.store import Store


class CoralDuckDB(DuckDBResource):
    """Coral's DuckDB file; `store()` gives the transactional store with bounded lock retries."""

    lock_timeout_s: float = Field(default=120.0, description="How long a write waits for another writer.")

    def store(self) -> Store:
        return Store(self.database, lock_timeout_s=self.lock_timeout_s)
