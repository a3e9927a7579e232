"""Plan JSON files (`--plan FILE` of `coral simulate` and `coral launch`): read through the plan codec."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path

from coral_dagster.allocation.codec import FIX, parse_plan_text, plan_from_doc
from coral_dagster.allocation.types import Plan
from coral_dagster.errors import CatalogError, CoralError


def is_plan_file(ref: str) -> bool:
    """Whether a `--plan` value names a file rather than a stored plan id or `latest`."""
    path = Path(ref)
    return path.suffix == ".json" or path.is_file()


def load_plan_file(path: Path, store) -> Plan:
    """A Plan from a plan file: one whose instances all carry their stages is read as it is (`plan_id` the file's
    own, else `file-<content hash>`); any other names a stored plan by its `plan_id`."""
    if not path.is_file():
        raise CoralError(f"plan file {path} does not exist.", f"{FIX}, or a stored plan id, or 'latest'.")
    raw = path.read_bytes()
    doc = parse_plan_text(raw, path)
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

        return load_plan(store, plan_id)
    return replace(plan_from_doc(doc, path), plan_id=plan_id or f"file-{hashlib.sha1(raw).hexdigest()[:12]}")
