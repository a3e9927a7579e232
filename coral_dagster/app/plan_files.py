"""Plan JSON files (`--plan FILE` of `coral simulate` and `coral launch`): read through the plan codec, and recorded
under a stored plan's id only when they hold exactly that plan."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from coral_dagster.allocation.codec import FIX, parse_plan_text, plan_from_doc, plan_to_doc
from coral_dagster.allocation.types import Plan
from coral_dagster.errors import CatalogError, CoralError

if TYPE_CHECKING:
    import pandas as pd


def is_plan_file(ref: str) -> bool:
    """Whether a `--plan` value names a file rather than a stored plan id or `latest`."""
    path = Path(ref)
    return path.suffix == ".json" or path.is_file()


def plan_digest(plan: Plan) -> str:
    """The plan's content address: a hash of its codec form without its id (key order aside), so two plans share
    it exactly when every field the codec reads back is equal."""
    doc = json.dumps(plan_to_doc(replace(plan, plan_id=""), derived=False), sort_keys=True, allow_nan=False)
    return hashlib.sha256(doc.encode()).hexdigest()


def load_plan_file(path: Path, store, prices: pd.DataFrame | None = None) -> Plan:
    """A Plan from a plan file, its regions and nodes checked against the price table `prices` (default:
    `load_node_prices()`). One whose instances all carry their stages is read as it is: it keeps its
    `plan_id` only when `store` holds a plan of that id with the same content (`plan_digest`), else it is
    `file-<content hash>`, so results recorded for it never pass for the stored plan's. One whose instances
    lack stages names a stored plan by its `plan_id`, and must list that plan's instances if it lists any."""
    if not path.is_file():
        raise CoralError(f"plan file {path} does not exist.", f"{FIX}, or a stored plan id, or 'latest'.")
    doc = parse_plan_text(path.read_bytes(), path)
    plan_id = doc.get("plan_id")
    if plan_id is not None and (not isinstance(plan_id, str) or not plan_id):
        raise CatalogError(path, "-", "plan_id", f"{plan_id!r} is not a plan id",
                           "give the stored plan's id, or drop it")
    rows = doc.get("instances")
    if rows is not None and (not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows)):
        raise CatalogError(path, "-", "instances", "expected a list of instance objects", FIX)
    if rows is None or not all("stages" in r or "stages_json" in r for r in rows):
        if not plan_id:
            raise CatalogError(path, "-", "plan_id", "lists instances without their stages and has no plan_id",
                               "store the plan (`coral plan` without --no-store) and pass its plan_id or the file")
        from coral_dagster.allocation.storage import load_plan

        stored = load_plan(store, plan_id)
        _check_listed(rows or [], stored, path)
        return stored
    plan = plan_from_doc(doc, path, prices=prices)
    digest = plan_digest(plan)
    if plan_id and store is not None and _stored_digest(store, plan_id) == digest:
        return replace(plan, plan_id=plan_id)
    return replace(plan, plan_id=f"file-{digest[:12]}")


def _stored_digest(store, plan_id: str) -> str | None:
    """The content address of the stored plan `plan_id`; None when the store holds no such plan."""
    from coral_dagster.allocation.storage import load_plan

    if "plans" not in store.tables() or store.query("SELECT 1 FROM plans WHERE plan_id = ?", [plan_id]).empty:
        return None
    return plan_digest(load_plan(store, plan_id))


def _check_listed(rows: list[dict], stored: Plan, path: Path) -> None:
    """A reference file's instances (model, phase, region, nodes, count) must be the stored plan's, when it lists
    any: an edit there would otherwise be ignored silently."""
    if not rows:
        return
    want = Counter((i.template.model, i.template.phase, i.region, str(i.template.nodes), i.count)
                   for i in stored.instances)
    got = Counter((r.get("model"), r.get("phase"), r.get("region"), _nodes(r.get("nodes")), r.get("count"))
                  for r in rows)
    if got != want:
        raise CatalogError(path, "-", "instances", f"the listed instances are not those of stored plan "
                           f"{stored.plan_id!r} (edited?)",
                           "give each instance its stages to run the edited plan as a plan of its own, or drop "
                           "`instances` to run the stored plan")


def _nodes(text: object) -> str | None:
    """A listed `nodes` value as the codec prints it (`2xL40S:1` however it was spelled); None if unreadable."""
    from coral_dagster.catalog.nodes import NodeMultiset

    try:
        return str(NodeMultiset.parse(text)) if isinstance(text, str) else None
    except CoralError:
        return None
