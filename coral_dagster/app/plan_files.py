"""Plan JSON files (`--plan FILE` of `coral simulate` and `coral launch`): read and checked field by field."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

from coral_dagster.errors import CatalogError, CoralError

FIX = "give the JSON `coral plan --json` printed, unchanged"


def is_plan_file(ref: str) -> bool:
    """Whether a `--plan` value names a file rather than a stored plan id or `latest`."""
    path = Path(ref)
    return path.suffix == ".json" or path.is_file()


def load_plan_file(path: Path, store):
    """A Plan from a plan file: instances with stages are read as they are (`plan_id` the file's own, else
    `file-<content hash>`); otherwise its `plan_id` is looked up in the store."""
    if not path.is_file():
        raise CoralError(f"plan file {path} does not exist.", f"{FIX}, or a stored plan id, or 'latest'.")
    raw = path.read_bytes()
    try:
        doc = json.loads(raw, parse_constant=_reject_constant)
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as exc:
        raise CoralError(f"plan file {path} is not valid JSON ({exc}).", FIX + ".") from None
    if not isinstance(doc, dict):
        raise CatalogError(path, "-", "-", f"expected a JSON object, got {type(doc).__name__}", FIX)
    rows = doc.get("instances")
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise CatalogError(path, "-", "instances", "expected a list of instance objects", FIX)
    plan_id = doc.get("plan_id")
    if plan_id is not None and (not isinstance(plan_id, str) or not plan_id):
        raise CatalogError(path, "-", "plan_id", f"{plan_id!r} is not a plan id",
                           "give the stored plan's id, or drop it")
    if rows and all("stages" in r or "stages_json" in r for r in rows):
        from dataclasses import replace

        return replace(plan_from_json(doc, path), plan_id=plan_id or f"file-{hashlib.sha1(raw).hexdigest()[:12]}")
    if not plan_id:
        raise CatalogError(path, "-", "plan_id", "lists instances without their stages and has no plan_id",
                           "store the plan (`coral plan` without --no-store) and pass its plan_id or the file")
    from coral_dagster.allocation.storage import load_plan

    return load_plan(store, plan_id)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number a plan may hold")


def plan_from_json(doc: dict, path: Path | str = "<plan>"):
    """A Plan from a JSON document whose instances carry their stages (`stages` or `stages_json`); demand and served
    tokens/s come from its `served` table, so the routing weights are the plan's own."""
    from coral_dagster.allocation.types import Plan, PlannedInstance
    from coral_dagster.catalog.nodes import NodeMultiset
    from coral_dagster.templates.types import Template

    instances = []
    for i, row in enumerate(doc.get("instances", [])):
        at = f"instances[{i}]"
        model = _model(row, path, at)
        phase = _choice(row, "phase", ("prefill", "decode", "aggregated"), path, at)
        region = _region(row, path, at)
        stages = _stages(row, model, path, at)
        count = row.get("count")
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise CatalogError(path, at, "count", f"{count!r} is not a positive whole number of instances", FIX)
        # `coral plan --json` prints tokens/s and $/h of all `count` instances together.
        tokens = _number(row, "tokens_per_s", path, at, positive=True)
        usd = _number(row, "usd_per_hour", path, at)
        slo_ms = _number(row, "slo_ms", path, at, positive=True, default=0.0)
        bound = _choice(row, "bound", ("compute", "memory", "slo", "network"), path, at, default="compute")
        template = Template(model, phase, slo_ms, NodeMultiset.of([n for s in stages for n in s.nodes]),
                            stages, tokens / count, bound)
        instances.append(PlannedInstance(template, region, count, usd / count))
    scenario = doc.get("scenario", "")
    method = doc.get("method", "coral")
    status = doc.get("status", "optimal")
    for key, value in (("scenario", scenario), ("method", method), ("status", status)):
        if not isinstance(value, str):
            raise CatalogError(path, "-", key, f"{value!r} is not text", FIX)
    top = {k: _number(doc, k, path, "-", default=0.0)
           for k in ("cost_usd_per_hour", "lp_bound_usd_per_hour", "gap", "solve_s")}
    served = doc.get("served") or {}
    if not isinstance(served, dict) or not all(isinstance(v, dict) and "/" in k for k, v in served.items()):
        raise CatalogError(path, "-", "served", "expected {model/phase: {demand_tokens_per_s, served_tokens_per_s}}",
                           FIX)
    demand = {tuple(k.rsplit("/", 1)): _number(v, "demand_tokens_per_s", path, f"served.{k}", default=0.0)
              for k, v in served.items()}
    supplied = {tuple(k.rsplit("/", 1)): _number(v, "served_tokens_per_s", path, f"served.{k}", default=0.0)
                for k, v in served.items()}
    snapshot, key = doc.get("snapshot_id") or "", doc.get("scenario_key") or ""
    for name, value in (("snapshot_id", snapshot), ("scenario_key", key)):
        if not isinstance(value, str):
            raise CatalogError(path, "-", name, f"{value!r} is not text", FIX)
    return Plan(scenario, method, status, top["cost_usd_per_hour"], top["lp_bound_usd_per_hour"], top["gap"],
                top["solve_s"], tuple(instances), demand, supplied, snapshot_id=snapshot, scenario_key=key)


def _number(row: dict, key: str, path, at: str, *, positive: bool = False, default: float | None = None) -> float:
    """A finite number at least 0 (above 0 when `positive`); null or missing takes `default` where there is one."""
    value = row.get(key)
    if value is None and default is not None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < 0 or (positive and value == 0):
        least = "above" if positive else "of at least"
        raise CatalogError(path, at, key, f"{value!r} is not a finite number {least} 0", FIX)
    return float(value)


def _choice(row: dict, key: str, valid: tuple[str, ...], path, at: str, default: str | None = None) -> str:
    value = row.get(key, default)
    if value not in valid:
        raise CatalogError(path, at, key, f"{value!r} is not one of {', '.join(valid)}", FIX)
    return value


def _model(row: dict, path, at: str) -> str:
    from coral_dagster.catalog.models import model_catalog, served_names

    value, known = row.get("model"), [*model_catalog(), *served_names()]
    if not isinstance(value, str) or value not in known:
        raise CatalogError(path, at, "model", f"unknown model {value!r}", f"use one of {', '.join(known)}")
    return value


def _region(row: dict, path, at: str) -> str:
    from coral_dagster.catalog.market import REGION_RE

    value = row.get("region")
    if not isinstance(value, str) or not REGION_RE.match(value):
        raise CatalogError(path, at, "region", f"{value!r} is not cloud:region on aws or gcp", FIX)
    return value


def _stages(row: dict, model: str, path, at: str):
    """The instance's stages: contiguous layer blocks covering the model, each with its nodes and load shares."""
    from coral_dagster.catalog.models import get_model
    from coral_dagster.catalog.nodes import NodeConfig
    from coral_dagster.templates.types import Stage

    raw = row.get("stages", row.get("stages_json"))
    if isinstance(raw, str):
        try:
            raw = json.loads(raw, parse_constant=_reject_constant)
        except ValueError as exc:
            raise CatalogError(path, at, "stages_json", f"not valid JSON ({exc})", FIX) from None
    if not isinstance(raw, list) or not raw or not all(isinstance(s, dict) for s in raw):
        raise CatalogError(path, at, "stages", "expected a non-empty list of stage objects", FIX)
    stages, expect = [], 0
    for j, s in enumerate(raw):
        where = f"{at}.stages[{j}]"
        start, end = s.get("start"), s.get("end")
        if any(isinstance(v, bool) or not isinstance(v, int) for v in (start, end)) or start != expect or end <= start:
            raise CatalogError(path, where, "start/end", f"[{start!r}, {end!r}) does not continue the layers "
                               f"from {expect}", "stages must cover the layers in order, without gaps")
        nodes, shares = s.get("nodes"), s.get("shares")
        if not isinstance(nodes, list) or not nodes or not all(isinstance(n, str) for n in nodes):
            raise CatalogError(path, where, "nodes", f"{nodes!r} is not a list of node configurations", FIX)
        try:
            configs = tuple(NodeConfig.parse(n) for n in nodes)
        except CoralError as exc:
            raise CatalogError(path, where, "nodes", exc.problem.rstrip("."), exc.fix) from None
        if (not isinstance(shares, list) or len(shares) != len(nodes)
                or any(isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 <= x <= 1 for x in shares)):
            raise CatalogError(path, where, "shares", f"{shares!r} is not one share in [0, 1] per node", FIX)
        stages.append(Stage(start, end, configs, tuple(float(x) for x in shares)))
        expect = end
    layers = get_model(model).n_layers
    if expect != layers:
        raise CatalogError(path, at, "stages", f"the stages hold {expect} layers, {model} has {layers}", FIX)
    return tuple(stages)
