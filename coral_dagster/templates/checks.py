"""Re-check stored templates: each layer split is valid for vLLM and sums to the model's layers."""

from __future__ import annotations

from coral_dagster.catalog.models import get_model
from coral_dagster.errors import CoralError
from coral_dagster.store import Store
from coral_dagster.layer_split import parse_split


def layer_split_problems(store: Store) -> tuple[list[str], int]:
    """(problems, templates checked) over the `templates` table."""
    if "templates" not in store.tables():
        return [], 0
    df = store.query("SELECT template_id, model, n_stages, pp_partition FROM templates")
    problems = []
    for r in df.itertuples(index=False):
        try:
            parse_split(r.pp_partition, get_model(r.model).n_layers, int(r.n_stages))
        except CoralError as exc:
            problems.append(f"{r.template_id}: {exc}")
    return problems, len(df)
