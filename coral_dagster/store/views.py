"""Create the documented SQL views over plan history (`plan_history`, `plan_diff`, `cost_by_model`,
`plan_expectations`)."""

from __future__ import annotations

from pathlib import Path

from coral_dagster.store.duck import Store

VIEWS_SQL = Path(__file__).with_name("views.sql")


def create_views(store: Store) -> list[str]:
    """(Re)create the views; the plan tables must exist. Returns the view names."""
    sql = VIEWS_SQL.read_text()
    with store.transaction() as con:
        con.execute(sql)
    return ["plan_history", "plan_diff", "cost_by_model", "plan_expectations"]
