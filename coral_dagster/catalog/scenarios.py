"""Scenarios: which models, SLOs, regions, node configurations and demand one experiment uses."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path

from coral_dagster import paths
from coral_dagster.catalog._load import field, read_yaml, rows_of, check_unique
from coral_dagster.catalog.gpus import gpu_catalog
from coral_dagster.catalog.market import MarketSnapshot, Offer
from coral_dagster.catalog.nodes import GPUS_PER_NODE, NodeConfig
from coral_dagster.errors import CatalogError, CoralError, UnknownNameError
from coral_dagster.templates.engines import SERVING_ENGINES

TRACES = ("azure-conv", "azure-code")


@dataclass(frozen=True)
class ScenarioModel:
    """One model of a scenario with its SLOs, request-length trace and arrival rate, and the scenario's planning
    margins for its templates (`templates.throughput`: share of each stage's SLO budget a step is planned at,
    busy share of a prefill node at the planned rate)."""

    model: str
    prefill_slo_ms: float
    decode_slo_ms: float
    trace: str
    rate_req_s: float
    slo_margin: float = 1.0
    prefill_utilisation: float = 1.0


@dataclass(frozen=True)
class Scenario:
    """A named experiment: models and SLOs, regions, node configurations, availability and planner settings."""

    name: str
    description: str
    regions: tuple[str, ...]
    node_configs: tuple[NodeConfig, ...]
    models: tuple[ScenarioModel, ...]
    default_nodes: int
    available_nodes: tuple[tuple[str, NodeConfig, int], ...]
    n_max: int
    rho: float
    headroom: float
    replan_interval_min: float
    node_startup_min: float
    link_gbps: float | None
    # What runs the instances: Coral's runtime (every template) or vLLM (templates/engines.py says which).
    engine: str = "coral"

    def model(self, alias: str) -> ScenarioModel:
        """The scenario's entry for one model."""
        for m in self.models:
            if m.model == alias:
                return m
        raise UnknownNameError(f"model in scenario {self.name}", alias, [m.model for m in self.models])

    def availability(self, region: str, node: NodeConfig) -> int:
        """Nodes of `node` the scenario allows in `region` (before any scaling)."""
        for r, n, k in self.available_nodes:
            if r == region and n == node:
                return k
        return self.default_nodes

    def market(self, availability_scale: float = 1.0, prices=None, taken_at: datetime | None = None) -> MarketSnapshot:
        """Price and availability snapshot: the bundled prices of the scenario's regions and node configurations."""
        from coral_dagster.catalog.prices import load_node_prices

        table = load_node_prices() if prices is None else prices
        offers = []
        for row in table.itertuples(index=False):
            node = NodeConfig.parse(row.node)
            if row.region not in self.regions or node not in self.node_configs:
                continue
            available = int(self.availability(row.region, node) * availability_scale)
            spot = None if row.spot_usd_per_hour != row.spot_usd_per_hour else float(row.spot_usd_per_hour)
            offers.append(Offer(row.region, node, row.instance_type, float(row.usd_per_hour), spot, available))
        if not offers:
            raise CoralError(f"scenario {self.name} has no priced node configuration in {', '.join(self.regions)}.",
                             "check its regions and gpus against `coral catalog prices`.")
        taken_at = taken_at or datetime.now(timezone.utc).replace(microsecond=0)
        snapshot_id = f"{self.name}-{taken_at:%Y%m%dT%H%M%S}-x{availability_scale:g}"
        return MarketSnapshot(snapshot_id, taken_at, tuple(sorted(offers, key=lambda o: (o.region, o.node))))


def scenario_names() -> list[str]:
    """Names of the bundled scenarios."""
    return sorted(p.stem for p in paths.SCENARIOS_DIR.glob("*.yaml"))


def load_scenario(name_or_path: str | Path) -> Scenario:
    """Read and validate a scenario by bundled name (`core`) or YAML path."""
    path = Path(name_or_path)
    if path.suffix != ".yaml":
        if str(name_or_path) not in scenario_names():
            raise UnknownNameError("scenario", str(name_or_path), scenario_names())
        path = paths.SCENARIOS_DIR / f"{name_or_path}.yaml"
    return _parse(path)


@lru_cache(maxsize=None)
def _parse(path: Path) -> Scenario:
    from coral_dagster.catalog.models import model_catalog

    doc = read_yaml(path)
    if not isinstance(doc, dict):
        raise CatalogError(path, "-", "-", "expected a mapping at the top level", "see data/scenarios/core.yaml")
    top = {"name": doc.get("name"), **doc}
    name = field(top, "name", str, path, 0)
    gpus = _str_list(doc, "gpus", path)
    for g in gpus:
        if g not in gpu_catalog():
            raise CatalogError(path, "gpus", "gpus", f"unknown GPU {g!r}", f"use one of {', '.join(gpu_catalog())}")
    counts = doc.get("gpus_per_node", list(GPUS_PER_NODE))
    if not isinstance(counts, list) or any(c not in GPUS_PER_NODE for c in counts):
        raise CatalogError(path, "gpus_per_node", "gpus_per_node", f"{counts!r} is not a subset of {GPUS_PER_NODE}",
                           "list GPU counts from 1, 2, 4, 8")
    regions = _str_list(doc, "regions", path)
    for r in regions:
        if r.count(":") != 1 or r.split(":")[0] not in ("aws", "gcp"):
            raise CatalogError(path, "regions", "regions", f"region {r!r} is not cloud:region on aws or gcp",
                               "write regions like aws:us-east-2 or gcp:us-central1")
    catalog = model_catalog()
    tpl = doc.get("templates") or {}
    margins = {k: float(field(tpl, k, (int, float), path, "templates", default=1.0))
               for k in ("slo_margin", "prefill_utilisation")}
    for k, v in margins.items():
        if not 0 < v <= 1:
            raise CatalogError(path, "templates", k, f"{v:g} is not in (0, 1]", f"give {k} between 0 and 1")
    models = []
    rows = rows_of(doc, "models", path)
    for i, r in enumerate(rows):
        alias = field(r, "model", str, path, i)
        if alias not in catalog:
            raise CatalogError(path, i, "model", f"unknown model {alias!r}", f"use one of {', '.join(catalog)}")
        trace = field(r, "trace", str, path, i)
        if trace not in TRACES:
            raise CatalogError(path, i, "trace", f"unknown trace {trace!r}", f"use one of {', '.join(TRACES)}")
        models.append(ScenarioModel(alias, field(r, "prefill_slo_ms", float, path, i, positive=True),
                                    field(r, "decode_slo_ms", float, path, i, positive=True), trace,
                                    field(r, "rate_req_s", float, path, i, positive=True), **margins))
    check_unique([m.model for m in models], path, "model")
    avail = doc.get("availability") or {}
    overrides = []
    for region, nodes in (avail.get("nodes") or {}).items():
        if region not in regions:
            raise CatalogError(path, "availability", region, "region not in the scenario's regions",
                               f"use one of {', '.join(regions)}")
        for node, k in nodes.items():
            if not isinstance(k, int) or k < 0:
                raise CatalogError(path, "availability", f"{region}/{node}", f"{k!r} is not a node count",
                                   "give a non-negative integer")
            overrides.append((region, NodeConfig.parse(node), k))
    alloc = doc.get("allocation") or {}
    link = doc.get("link_gbps")
    engine = doc.get("engine", "coral")
    if engine not in SERVING_ENGINES:
        raise CatalogError(path, "-", "engine", f"unknown serving engine {engine!r}",
                           f"use one of {', '.join(SERVING_ENGINES)}")
    return Scenario(
        name=name,
        description=str(doc.get("description", "")),
        regions=tuple(regions),
        node_configs=tuple(NodeConfig(g, c) for g in gpus for c in counts),
        models=tuple(models),
        default_nodes=int(avail.get("default_nodes", 16)),
        available_nodes=tuple(overrides),
        n_max=int(field(tpl, "n_max", int, path, "templates", default=6)),
        rho=float(field(tpl, "rho", (int, float), path, "templates", default=12)),
        headroom=float(field(alloc, "headroom", (int, float), path, "allocation", default=1.1)),
        replan_interval_min=float(field(alloc, "replan_interval_min", (int, float), path, "allocation", default=6)),
        node_startup_min=float(field(alloc, "node_startup_min", (int, float), path, "allocation", default=10)),
        link_gbps=float(link) if link is not None else None,
        engine=engine,
    )


def _str_list(doc: dict, key: str, path: Path) -> list[str]:
    value = doc.get(key)
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise CatalogError(path, key, key, f"expected a non-empty list of names, got {value!r}", f"add '{key}: [...]'")
    return value
