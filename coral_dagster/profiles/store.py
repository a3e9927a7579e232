"""Write profile tables into the DuckDB store."""

from __future__ import annotations

import pandas as pd

from coral_dagster.profiles.perf import PerfModel
from coral_dagster.profiles.table import scenario_profile_table
from coral_dagster.store.duck import Store, write_frame

PROFILES_TABLE = "profiles"


def store_scenario_profiles(store: Store, scenario: str, perf: PerfModel | None = None) -> pd.DataFrame:
    """Replace the scenario's rows of the `profiles` table (other scenarios' rows stay) in one transaction; returns
    the rows written (the profile table plus a `scenario` column)."""
    table = scenario_profile_table(scenario, perf).assign(scenario=scenario)
    with store.transaction() as con:
        exists = con.execute("SELECT count(*) FROM information_schema.tables WHERE table_name = ?",
                             [PROFILES_TABLE]).fetchall()[0][0]
        if exists:
            con.execute(f"DELETE FROM {PROFILES_TABLE} WHERE scenario = ?", [scenario])
        write_frame(con, PROFILES_TABLE, table)
    return table
