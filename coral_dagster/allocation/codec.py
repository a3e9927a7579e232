"""The one JSON form of a Plan: what `coral plan --json` prints, a plan file holds and the store keeps.

`plan_to_doc` writes it; `plan_from_doc` reads it back field by field, naming the field and the fix of anything
wrong; `parse_plan_text` bounds a document's size and nesting before it is parsed at all. A plan round-trips
unchanged (`tests/test_plan_codec.py`). A bound that is not finite (NaN: none proven) is written null.

Instances carry their template whole: `template_tokens_per_s` and `instance_usd_per_hour` are one instance's,
`tokens_per_s` and `usd_per_hour` all `count` instances' (read back only to check they agree, so a hand-written
file may give either); `nodes` must be the multiset of the stages' nodes; `template_id`, `pp_partition`,
`routing_shares` and `mip_gap` are derived and ignored when read.
"""

from __future__ import annotations

import json
import math
import re
from typing import TYPE_CHECKING, Any, Mapping, cast

import numpy as np

from coral_dagster.allocation.types import AdmissionLimits, Bottleneck, Plan, PlannedInstance
from coral_dagster.catalog.nodes import NodeConfig, NodeMultiset
from coral_dagster.errors import CatalogError, CoralError
from coral_dagster.templates.types import Stage, Template, stages_doc
from coral_dagster.vocab import BOUNDS, PHASES, Phase

if TYPE_CHECKING:
    import pandas as pd

FIX = "give the JSON `coral plan --json` printed, unchanged"
#: Largest plan document read (bytes): a plan of thousands of instances with their stages is a few MiB.
MAX_PLAN_BYTES = 32 * 2**20
#: Deepest nesting read: a plan nests 6 deep (instances → stages → nodes); the rest is room for `pruning`.
MAX_DEPTH = 32
#: Most instances one row may count: far beyond any cloud's quota, small enough to simulate and deploy.
MAX_COUNT = 100_000
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)


def plan_to_doc(plan: Plan, *, derived: bool = True) -> dict:
    """The plan as a JSON-ready dict (no NaN or infinity anywhere: a bound that is not finite is null); without
    `derived`, only what is read back (no `routing_shares`, which costs a search over every instance)."""
    keys = sorted(set(plan.demand_tokens_per_s) | set(plan.served_tokens_per_s))
    served = {_key(k): {**({"demand_tokens_per_s": plan.demand_tokens_per_s[k]} if k in plan.demand_tokens_per_s
                           else {}),
                        **({"served_tokens_per_s": plan.served_tokens_per_s[k]} if k in plan.served_tokens_per_s
                           else {})} for k in keys}
    adm = plan.admission
    return {
        "plan_id": plan.plan_id or None,
        "scenario": plan.scenario, "scenario_key": plan.scenario_key or None, "method": plan.method,
        "status": plan.status,
        "cost_usd_per_hour": plan.cost_usd_per_hour, "churn_usd_per_hour": plan.churn_usd_per_hour,
        "lp_bound_usd_per_hour": finite_json(plan.lp_bound_usd_per_hour),
        "mip_bound_usd_per_hour": finite_json(plan.mip_bound_usd_per_hour),
        "gap": finite_json(plan.gap), "mip_gap": finite_json(plan.mip_gap), "solve_s": plan.solve_s,
        "work_nodes": plan.work_nodes, "demand_scale": plan.demand_scale,
        "snapshot_id": plan.snapshot_id,
        "instances": [
            {"model": i.template.model, "phase": i.template.phase, "region": i.region,
             "nodes": str(i.template.nodes), "count": i.count, "tokens_per_s": i.tokens_per_s,
             "usd_per_hour": i.usd_per_hour * i.count, "template_tokens_per_s": i.template.tokens_per_s,
             "instance_usd_per_hour": i.usd_per_hour, "template_id": i.template.template_id,
             "slo_ms": i.template.slo_ms, "bound": i.template.bound, "pp_partition": i.template.pp_partition,
             "stages": stages_doc(i.template.stages)}
            for i in plan.instances],
        "served": served,
        **({"routing_shares": finite_json(plan.routing_shares)} if derived else {}),
        "admission": {"capacity_factors": {_key(k): f for k, f in sorted(adm.capacity_factors.items())},
                      "admit_req_s": dict(adm.admit_req_s), "admit_depth_req": dict(adm.admit_depth_req),
                      "admit_peak": {m: list(v) for m, v in adm.admit_peak.items()}},
        "expected_attainment": finite_json(dict(plan.expected_attainment)), "expected_from": plan.expected_from or None,
        "bottlenecks": [finite_json(b.as_dict()) for b in plan.bottlenecks],
        "pruning": finite_json(dict(plan.pruning)) if plan.pruning is not None else None,
        "timings_s": finite_json(dict(plan.timings_s)),
        "notes": list(plan.notes),
    }


def plan_to_json(plan: Plan, indent: int | None = None) -> str:
    """`plan_to_doc` as JSON text."""
    return json.dumps(plan_to_doc(plan), indent=indent, allow_nan=False)


def parse_plan_text(raw: bytes | str, where: object = "<plan>") -> dict:
    """A plan document's JSON object, refused before parsing when larger than `MAX_PLAN_BYTES` or nested deeper
    than `MAX_DEPTH`, and refused for NaN, infinities and numbers too large to be finite."""
    data = raw.encode() if isinstance(raw, str) else raw
    if len(data) > MAX_PLAN_BYTES:
        raise CoralError(f"plan file {where} holds {len(data):,} bytes, more than the {MAX_PLAN_BYTES:,} a plan may.",
                         FIX + ".")
    depth = _depth(data)
    if depth > MAX_DEPTH:
        raise CoralError(f"plan file {where} nests {depth} deep, deeper than the {MAX_DEPTH} a plan may.", FIX + ".")
    try:
        doc = json.loads(data, parse_constant=_reject_constant, parse_float=_finite_float)
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as exc:
        raise CoralError(f"plan file {where} is not valid JSON ({exc}).", FIX + ".") from None
    if not isinstance(doc, dict):
        raise CatalogError(where, "-", "-", f"expected a JSON object, got {type(doc).__name__}", FIX)
    return doc


def _depth(data: bytes) -> int:
    """How deep brackets nest in a JSON text (strings skipped), counted without parsing it."""
    bare = np.frombuffer(_STRING.sub(b'""', data), dtype=np.uint8)
    step = np.isin(bare, (ord("["), ord("{"))).astype(np.int64) - np.isin(bare, (ord("]"), ord("}")))
    return int(np.cumsum(step).max(initial=0))


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number a plan may hold")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is too large for a number a plan may hold")
    return value


def plan_from_doc(doc: Mapping, where: object = "<plan>", *, catalog: bool = True,
                  prices: pd.DataFrame | None = None) -> Plan:
    """A Plan from `plan_to_doc`'s form, checked field by field (CatalogError naming `where`, the row and field).
    With `catalog`, models must be the catalog's (stages covering their layers), regions those of the price table
    `prices` (default: `load_node_prices()`), and every node one its GPU catalog has and its region sells; the store
    reads without (it holds plans of any problem, synthetic ones included, checked when they were made)."""
    rows = doc.get("instances")
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise CatalogError(where, "-", "instances", "expected a list of instance objects", FIX)
    offers = _offers(prices) if catalog else None
    instances = tuple(_instance(row, where, f"instances[{i}]", offers) for i, row in enumerate(rows))
    text = {k: _text(doc, k, where, default) for k, default in (
        ("scenario", ""), ("method", "coral"), ("status", "optimal"), ("snapshot_id", ""), ("scenario_key", ""),
        ("expected_from", ""), ("plan_id", ""))}
    served = _mapping(doc, "served", where, "{model/phase: {demand_tokens_per_s, served_tokens_per_s}}")
    demand, supplied = {}, {}
    for k, row in served.items():
        at = f"served.{k}"
        if not isinstance(row, dict):
            raise CatalogError(where, at, "served", "expected {demand_tokens_per_s, served_tokens_per_s}", FIX)
        key = _demand_key(k, where, at)
        if "demand_tokens_per_s" in row:
            demand[key] = _number(row, "demand_tokens_per_s", where, at)
        if "served_tokens_per_s" in row:
            supplied[key] = _number(row, "served_tokens_per_s", where, at)
    notes = doc.get("notes") or []
    if not isinstance(notes, list) or not all(isinstance(n, str) for n in notes):
        raise CatalogError(where, "-", "notes", "expected a list of sentences", FIX)
    pruning = doc.get("pruning")
    if pruning is not None and not isinstance(pruning, dict):
        raise CatalogError(where, "-", "pruning", "expected an object or null", FIX)
    bottlenecks = doc.get("bottlenecks") or []
    if not isinstance(bottlenecks, list):
        raise CatalogError(where, "-", "bottlenecks", "expected a list of bottleneck objects", FIX)
    return Plan(
        scenario=text["scenario"], method=text["method"], status=text["status"],  # type: ignore[arg-type]
        cost_usd_per_hour=_number(doc, "cost_usd_per_hour", where, "-", default=0.0),
        lp_bound_usd_per_hour=_bound(doc, "lp_bound_usd_per_hour", where),
        gap=_bound(doc, "gap", where), solve_s=_number(doc, "solve_s", where, "-", default=0.0),
        work_nodes=_count(doc, "work_nodes", where), instances=instances, demand_tokens_per_s=demand,
        served_tokens_per_s=supplied,
        demand_scale=_number(doc, "demand_scale", where, "-", default=1.0), notes=tuple(notes),
        churn_usd_per_hour=_number(doc, "churn_usd_per_hour", where, "-", default=0.0),
        mip_bound_usd_per_hour=_bound(doc, "mip_bound_usd_per_hour", where),
        bottlenecks=tuple(_bottleneck(b, where, f"bottlenecks[{j}]") for j, b in enumerate(bottlenecks)),
        pruning=pruning, snapshot_id=text["snapshot_id"], plan_id=text["plan_id"],
        timings_s=_numbers(doc, "timings_s", where), admission=_admission(doc, where),
        expected_attainment=_numbers(doc, "expected_attainment", where),
        expected_from=text["expected_from"], scenario_key=text["scenario_key"])


def _offers(prices: pd.DataFrame | None) -> dict[str, set[str]]:
    """The node configurations each region of the price table `prices` (default: `load_node_prices()`) sells."""
    from coral_dagster.catalog.prices import load_node_prices

    table = load_node_prices() if prices is None else prices
    offers: dict[str, set[str]] = {}
    for region, node in table[["region", "node"]].itertuples(index=False):
        offers.setdefault(str(region), set()).add(str(node))
    return offers


def _instance(row: dict, where: object, at: str, offers: dict[str, set[str]] | None) -> PlannedInstance:
    catalog = offers is not None
    model = _model(row, where, at, catalog)
    phase = cast(Phase, _choice(row, "phase", PHASES, where, at))
    region = _region(row, where, at, offers)
    stages = _stages(row, model, where, at, catalog)
    if offers is not None:
        _sold(stages, region, offers[region], where, at)
    count = row.get("count")
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_COUNT:
        raise CatalogError(where, at, "count", f"{count!r} is not a whole number of instances from 1 to "
                           f"{MAX_COUNT:,}", FIX)
    tokens = _per_instance(row, "template_tokens_per_s", "tokens_per_s", count, where, at, positive=True)
    usd = _per_instance(row, "instance_usd_per_hour", "usd_per_hour", count, where, at, positive=False)
    nodes = NodeMultiset.of([n for s in stages for n in s.nodes])
    if "nodes" in row:
        try:
            listed = NodeMultiset.parse(row["nodes"]) if isinstance(row["nodes"], str) else None
        except CoralError:
            listed = None
        if listed != nodes:
            raise CatalogError(where, at, "nodes", f"{row['nodes']!r} is not the stages' nodes ({nodes})", FIX)
    template = Template(model, phase, _number(row, "slo_ms", where, at, default=0.0), nodes, stages, tokens,
                        _choice(row, "bound", BOUNDS, where, at, default="compute"))  # type: ignore[arg-type]
    return PlannedInstance(template, region, count, usd)


def _per_instance(row: dict, one: str, total: str, count: int, where: object, at: str, *, positive: bool) -> float:
    """One instance's figure: `one` as given, else `total` / count; where both are given they must agree."""
    if one not in row and total not in row:
        raise CatalogError(where, at, one, f"is missing (give it, or {total} for all {count} instances)", FIX)
    each = _number(row, one, where, at, positive=positive) if one in row else None
    whole = _number(row, total, where, at, positive=positive) if total in row else None
    if each is None:
        return whole / count  # type: ignore[operator]
    if whole is not None and not math.isclose(whole, each * count, rel_tol=1e-9, abs_tol=1e-12):
        raise CatalogError(where, at, total, f"{whole!r} is not count × {one} ({count} × {each!r})",
                           f"edit {one} (one instance's figure); {total} follows from it")
    return each


def _admission(doc: Mapping, where: object) -> AdmissionLimits:
    adm = doc.get("admission") or {}
    if not isinstance(adm, dict):
        raise CatalogError(where, "-", "admission", "expected {capacity_factors, admit_req_s, admit_depth_req, "
                           "admit_peak}", FIX)
    factors = _numbers(adm, "capacity_factors", where, "admission")
    peaks = _mapping(adm, "admit_peak", where, "{model: [request rate, depth]}", "admission")
    for m, v in peaks.items():
        if not isinstance(v, list) or len(v) != 2:
            raise CatalogError(where, "admission.admit_peak", m, f"{v!r} is not [request rate, depth]", FIX)
    return AdmissionLimits(
        capacity_factors={_demand_key(k, where, "admission.capacity_factors"): f for k, f in factors.items()},
        admit_req_s=_numbers(adm, "admit_req_s", where, "admission"),
        admit_depth_req=_numbers(adm, "admit_depth_req", where, "admission"),
        admit_peak={m: (_number({"rate": v[0]}, "rate", where, f"admission.admit_peak.{m}"),
                        _number({"depth": v[1]}, "depth", where, f"admission.admit_peak.{m}"))
                    for m, v in peaks.items()})


def _bottleneck(b: object, where: object, at: str) -> Bottleneck:
    if not isinstance(b, dict) or b.get("kind") not in ("demand", "node"):
        raise CatalogError(where, at, "kind", "expected a bottleneck of kind demand or node", FIX)
    return Bottleneck(b["kind"], _text(b, "name", where, "", at), _text(b, "region", where, "", at),
                      _number(b, "needed", where, at, nan=True), _number(b, "available", where, at, nan=True))


def _key(k: tuple[str, str]) -> str:
    return f"{k[0]}/{k[1]}"


def _demand_key(text: str, where: object, at: str) -> tuple[str, str]:
    model, _, phase = text.rpartition("/")
    if not model or phase not in PHASES:
        raise CatalogError(where, at, text, f"{text!r} is not model/phase (phase one of {', '.join(PHASES)})", FIX)
    return model, phase


def finite_json(data: Any) -> Any:
    """`data` with every float that is not finite as None (JSON has no such numbers)."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {k: finite_json(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [finite_json(v) for v in data]
    return data


def _text(row: Mapping, key: str, where: object, default: str, at: str = "-") -> str:
    value = row.get(key)
    if value is None:
        return default
    if not isinstance(value, str):
        raise CatalogError(where, at, key, f"{value!r} is not text", FIX)
    return value


def _mapping(row: Mapping, key: str, where: object, shape: str, at: str = "-") -> dict:
    value = row.get(key) or {}
    if not isinstance(value, dict):
        raise CatalogError(where, at, key, f"expected {shape}", FIX)
    return value


def _numbers(row: Mapping, key: str, where: object, at: str = "-") -> dict[str, float]:
    """A {name: number} object (null values read as NaN)."""
    values = _mapping(row, key, where, "{name: number}", at)
    return {k: _number(values, k, where, f"{at}.{key}" if at != "-" else key, nan=True) for k in values}


def _number(row: Mapping, key: str, where: object, at: str, *, positive: bool = False, default: float | None = None,
            nan: bool = False) -> float:
    """A finite number at least 0 (above 0 when `positive`); missing takes `default` where there is one, null
    reads as NaN where `nan`."""
    value = row.get(key)
    if value is None and nan:
        return math.nan
    if value is None and default is not None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < 0 or (positive and value == 0):
        least = "above" if positive else "of at least"
        raise CatalogError(where, at, key, f"{value!r} is not a finite number {least} 0", FIX)
    return float(value)


def _count(doc: Mapping, key: str, where: object) -> int:
    """A whole number of at least 0 (0 when absent)."""
    value = doc.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CatalogError(where, "-", key, f"{value!r} is not a whole number of at least 0", FIX)
    return value


def _bound(doc: Mapping, key: str, where: object) -> float:
    """A bound or gap: a finite number, or null (NaN: none)."""
    value = doc.get(key)
    if value is None:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CatalogError(where, "-", key, f"{value!r} is not a number or null", FIX)
    return float(value)


def _choice(row: Mapping, key: str, valid: tuple[str, ...], where: object, at: str, default: str | None = None) -> str:
    value = row.get(key, default)
    if value not in valid:
        raise CatalogError(where, at, key, f"{value!r} is not one of {', '.join(valid)}", FIX)
    return value  # type: ignore[return-value]


def _model(row: Mapping, where: object, at: str, catalog: bool) -> str:
    from coral_dagster.catalog.models import model_catalog, served_names

    value = row.get("model")
    if not isinstance(value, str) or not value:
        raise CatalogError(where, at, "model", f"{value!r} is not a model name", FIX)
    known = [*model_catalog(), *served_names()]
    if catalog and value not in known:
        raise CatalogError(where, at, "model", f"unknown model {value!r}", f"use one of {', '.join(known)}")
    return value


def _region(row: Mapping, where: object, at: str, offers: dict[str, set[str]] | None) -> str:
    """The instance's region; with the catalog, one the price table in use sells nodes in."""
    from coral_dagster.catalog.market import REGION_RE

    value = row.get("region")
    if not isinstance(value, str) or not value or offers is not None and not REGION_RE.match(value):
        raise CatalogError(where, at, "region", f"{value!r} is not cloud:region on aws or gcp", FIX)
    if offers is not None and value not in offers:
        raise CatalogError(where, at, "region", f"{value!r} is not a region of the price table in use",
                           f"use one of {', '.join(sorted(offers))}, or pass the --prices file the plan was made with")
    return value


def _sold(stages: tuple[Stage, ...], region: str, sold: set[str], where: object, at: str) -> None:
    """Refuse a node whose GPU the catalog lacks, or that `region` does not sell (nothing could launch it)."""
    from coral_dagster.catalog.gpus import gpu_catalog

    gpus = gpu_catalog()
    for j, stage in enumerate(stages):
        for node in stage.nodes:
            if node.gpu not in gpus:
                raise CatalogError(where, f"{at}.stages[{j}]", "nodes", f"{node} names GPU {node.gpu!r}, which the "
                                   "GPU catalog does not have", f"use one of {', '.join(sorted(gpus))}")
            if str(node) not in sold:
                raise CatalogError(where, f"{at}.stages[{j}]", "nodes", f"{region} sells no {node} node in the "
                                   "price table in use", f"use one of {', '.join(sorted(sold))}, another region, or "
                                   "the --prices file the plan was made with")


def _stages(row: Mapping, model: str, where: object, at: str, catalog: bool) -> tuple[Stage, ...]:
    """The instance's stages: contiguous layer blocks covering the model, each with its nodes, load shares and
    (where planned) prefill batch per node."""
    from coral_dagster.catalog.models import get_model

    raw = row.get("stages", row.get("stages_json"))
    if isinstance(raw, str):  # a `plan_instances.stages_json` cell
        raw = parse_plan_text('{"stages": ' + raw + "}", f"{where} {at}.stages_json").get("stages")
    if not isinstance(raw, list) or not raw or not all(isinstance(s, dict) for s in raw):
        raise CatalogError(where, at, "stages", "expected a non-empty list of stage objects", FIX)
    stages, expect = [], 0
    for j, s in enumerate(raw):
        here = f"{at}.stages[{j}]"
        start, end = s.get("start"), s.get("end")
        if any(isinstance(v, bool) or not isinstance(v, int) for v in (start, end)) or start != expect or end <= start:
            raise CatalogError(where, here, "start/end", f"[{start!r}, {end!r}) does not continue the layers "
                               f"from {expect}", "stages must cover the layers in order, without gaps")
        nodes, shares, batches = s.get("nodes"), s.get("shares"), s.get("batches", [])
        if not isinstance(nodes, list) or not nodes or not all(isinstance(n, str) for n in nodes):
            raise CatalogError(where, here, "nodes", f"{nodes!r} is not a list of node configurations", FIX)
        try:
            configs = tuple(NodeConfig.parse(n) for n in nodes)
        except CoralError as exc:
            raise CatalogError(where, here, "nodes", exc.problem.rstrip("."), exc.fix) from None
        if (not isinstance(shares, list) or len(shares) != len(nodes)
                or any(isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 <= x <= 1 for x in shares)):
            raise CatalogError(where, here, "shares", f"{shares!r} is not one share in [0, 1] per node", FIX)
        if not isinstance(batches, list) or (batches and len(batches) != len(nodes)) or any(
                isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in batches):
            raise CatalogError(where, here, "batches", f"{batches!r} is not one whole prefill batch per node", FIX)
        stages.append(Stage(start, end, configs, tuple(float(x) for x in shares), tuple(batches)))
        expect = end
    layers = get_model(model).n_layers if catalog else expect
    if expect != layers:
        raise CatalogError(where, at, "stages", f"the stages hold {expect} layers, {model} has {layers}", FIX)
    return tuple(stages)

