"""Scenarios: which models, SLOs, regions, node configurations and demand one experiment uses."""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import asdict, dataclass, field as dataclass_field, replace
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path
from types import EllipsisType

from coral_dagster import paths
from coral_dagster.catalog._load import field, read_yaml, rows_of, check_unique
from coral_dagster.catalog.availability import PROFILES, Availability, Series
from coral_dagster.catalog.gpus import gpu_catalog
from coral_dagster.catalog.market import REGION_RE, MarketSnapshot, Offer
from coral_dagster.catalog.nodes import GPUS_PER_NODE, NodeConfig
from coral_dagster.errors import CatalogError, CoralError, UnknownNameError
from coral_dagster.vocab import SERVING_ENGINES, T_HAT_RULE_NAMES, T_HAT_RULE_VERSIONS

TRACES = ("azure-conv", "azure-code")
SCENARIO_SUFFIXES = (".yaml", ".yml")
TOP_KEYS = frozenset({"name", "description", "regions", "gpus", "gpus_per_node", "nodes", "link_gbps", "models", "engine",
                      "availability", "templates", "allocation", "day"})
MODEL_KEYS = frozenset({"model", "base", "prefill_slo_ms", "decode_slo_ms", "trace", "rate_req_s", "attainment_target"})
TEMPLATE_KEYS = frozenset({"n_max", "rho", "slo_margin", "t_hat_rule"})
AVAILABILITY_KEYS = frozenset({"profile", "default_nodes", "base_nodes", "gpu_factors", "size_factors", "nodes",
                               "series"})
SERIES_KEYS = frozenset({"window_min", "multipliers", "gpus"})
ALLOCATION_KEYS = frozenset({"headroom", "replan_interval_min", "node_startup_min"})
DAY_KEYS = frozenset({"peak_hour", "peak_to_trough", "hourly", "bursts", "boot_min", "setup_min",
                      "weight_gbytes_per_s", "spot", "preemptions_per_day"})
# Bounds of the scenario format: wide enough for any real setting, tight enough that a typo cannot make a plan
# silently meaningless (an SLO of a day, a billion requests per second) or a library build that never ends.
MAX_SLO_MS = 600_000.0
MAX_RATE_REQ_S = 1e6
MAX_NODES = 100_000
MAX_N_MAX = 8
MAX_RHO = 100.0
MAX_HEADROOM = 10.0
MAX_MINUTES = 1440.0
MAX_LINK_GBPS = 10_000.0
MAX_FACTOR = 100.0  # an availability factor or multiplier: 100× the mid-tier 1-GPU count is already no constraint
MAX_WINDOWS = 10_080  # a week of 1-minute windows
# A mapping of the scenario document as YAML gives it: each value is checked (and so narrowed) where it is read.
Section = dict[str, object]
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


@dataclass(frozen=True)
class ScenarioModel:
    """One model of a scenario with its SLOs, request-length trace and arrival rate, and the scenario's planning
    margins for its templates (`templates.throughput`: share of each stage's SLO budget a step is planned at,
    busy share of a prefill node at the planned rate). `base`: the catalog model whose architecture and profiles
    it is served with; the model itself, or for a served model (a fine-tune under its own name) its base."""

    model: str
    prefill_slo_ms: float
    decode_slo_ms: float
    trace: str
    rate_req_s: float
    slo_margin: float = 1.0
    attainment_target: float = 0.95  # share of requests meeting both SLOs the plan is sized for
    base: str = ""

    def __post_init__(self) -> None:
        if not self.base:
            object.__setattr__(self, "base", self.model)

    @property
    def template_key(self) -> tuple:
        """What its templates depend on besides the scenario's nodes: models sharing it share their templates."""
        return (self.base, self.prefill_slo_ms, self.decode_slo_ms, self.trace, self.slo_margin,
                self.attainment_target)


@dataclass(frozen=True)
class DaySpec:
    """A day of demand and cloud behaviour (data/scenarios/DAY.md): the diurnal shape of every model's rate
    (a cosine peaking at `peak_hour` UTC, `peak_to_trough` times its lowest, or 24 explicit `hourly` factors of the
    peak), whether each window also follows its trace's bursts, and a node's start-up: boot, setup and loading
    its share of the weights at `weight_gbytes_per_s`. With `spot`, every node sold on spot runs there at its spot
    price and can be taken back: when a window's supply falls below the spot nodes held, and at random, a node's
    chance of being preempted within a day being `preemptions_per_day`."""

    peak_hour: float = 15.0
    peak_to_trough: float = 2.0
    hourly: tuple[float, ...] = ()
    bursts: bool = True
    boot_min: float = 2.0
    setup_min: float = 3.0
    weight_gbytes_per_s: float = 0.5
    spot: bool = False
    preemptions_per_day: float = 0.0074


@dataclass(frozen=True)
class Scenario:
    """A named experiment: models and SLOs, regions, node configurations, availability and planner settings."""

    name: str
    description: str
    regions: tuple[str, ...]
    node_configs: tuple[NodeConfig, ...]
    models: tuple[ScenarioModel, ...]
    availability_model: Availability
    n_max: int
    rho: float
    headroom: float
    replan_interval_min: float
    node_startup_min: float
    link_gbps: float | None
    path: str = dataclass_field(default="", compare=False)
    # What runs the instances: Coral's runtime (every template) or vLLM (templates/engines.py says which).
    engine: str = "coral"
    # The rule T̂ is computed by (`vocab.T_HAT_RULE_NAMES`): `slo` (ours) or `paper`.
    t_hat_rule: str = "slo"
    # The day `coral day` replays (None: DaySpec's documented default); it changes no plan, so no key has it.
    day: DaySpec | None = None

    @property
    def library_key(self) -> str:
        """What the template library depends on, as a digest: the models with their SLOs, traces and margins, the
        node configurations, n_max, ρ, the link, the data files templates are computed from and the version of
        the T̂ rule in use (`vocab.T_HAT_RULE_VERSIONS`: the `slo` rule's key is what it was before rules could be
        chosen). Libraries are
        stored under it, so a scenario file named like a bundled one never overwrites or reuses its library."""
        settings = {
            "models": sorted([m.model, m.prefill_slo_ms, m.decode_slo_ms, m.trace, m.slo_margin,
                              m.attainment_target, *([m.base] if m.base != m.model else [])] for m in self.models),
            "node_configs": sorted(map(str, self.node_configs)), "n_max": self.n_max, "rho": self.rho,
            "link_gbps": self.link_gbps, "sources": _sources_digest(tuple(sorted({m.trace for m in self.models}))),
            "rules": T_HAT_RULE_VERSIONS[self.t_hat_rule],
        }
        return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def scenario_key(self) -> str:
        """What a plan of this scenario depends on besides the market, as a digest: its name, every field but the
        description, the file path and the engine (chosen per plan, recorded in its inputs), and the library key.
        Plans and demand and market snapshots are stored under it, so "latest" never crosses two scenario files."""
        settings = {k: v for k, v in asdict(self).items()
                    if k not in ("description", "path", "engine", "t_hat_rule", "day")}  # the library key has the rule
        # A model served as itself keeps the key it had before served models existed (stored plans stay found).
        settings["models"] = [{k: v for k, v in m.items() if k != "base" or v != m["model"]}
                              for m in settings["models"]]
        settings["library_key"] = self.library_key
        return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]

    @property
    def ref(self) -> str:
        """How to name it on the command line: the bundled name, else the file's path."""
        bundled = _bundled_files().get(self.name)
        return self.name if not self.path or (bundled and bundled.resolve() == Path(self.path).resolve()) \
            else self.path

    def model(self, alias: str) -> ScenarioModel:
        """The scenario's entry for one model."""
        for m in self.models:
            if m.model == alias:
                return m
        raise UnknownNameError(f"model in scenario {self.name}", alias, [m.model for m in self.models])

    @property
    def default_nodes(self) -> int:
        """Nodes of every configuration under the uniform profile."""
        return self.availability_model.default_nodes

    @property
    def available_nodes(self) -> tuple[tuple[str, NodeConfig, int], ...]:
        """(region, node, count) the scenario pins, whatever its profile."""
        return self.availability_model.nodes

    def availability(self, region: str, node: NodeConfig, window: int = 0) -> int:
        """Nodes of `node` the scenario allows in `region` in one window of its series (before any scaling)."""
        return self.availability_model.count(region, node, window)

    def market(self, availability_scale: float = 1.0, prices=None, taken_at: datetime | None = None,
               window: int | None = None) -> MarketSnapshot:
        """Price and availability snapshot: the bundled prices of the scenario's regions and node configurations,
        availability in `window` of the scenario's series (default: the window `taken_at` falls in, window 0 when
        no moment is given, so a plan made now without a feed plans at the series' first window)."""
        from coral_dagster.catalog.prices import load_node_prices

        if not (isinstance(availability_scale, (int, float)) and math.isfinite(availability_scale)
                and availability_scale >= 0):
            raise CoralError(f"availability scale {availability_scale!r} is not a finite number of at least 0.",
                             "give a factor such as 1 (as listed) or 0.5 (half the nodes).")
        table = load_node_prices() if prices is None else prices
        window = self.availability_model.window_at(taken_at) if window is None else window
        offers = []
        for row in table.itertuples(index=False):
            node = NodeConfig.parse(row.node)
            if row.region not in self.regions or node not in self.node_configs:
                continue
            available = int(self.availability(row.region, node, window) * availability_scale)
            spot = None if row.spot_usd_per_hour != row.spot_usd_per_hour else float(row.spot_usd_per_hour)
            offers.append(Offer(row.region, node, row.instance_type, float(row.usd_per_hour), spot, available))
        unpriced = [r for r in self.regions if not any(o.region == r for o in offers)]
        if unpriced:
            raise CoralError(f"scenario {self.name} ({self.path or 'in code'}): region(s) {', '.join(unpriced)} sell "
                             "none of its node configurations in the price table.",
                             "use regions and gpus listed by `coral catalog prices` (or give a --prices file "
                             "that prices them).")
        taken_at = taken_at or datetime.now(timezone.utc).replace(microsecond=0)
        key = self.scenario_key
        series = f"-w{window}" if self.availability_model.series else ""
        snapshot_id = f"{self.name}-{key[:8]}-{taken_at:%Y%m%dT%H%M%S}-x{availability_scale:g}{series}"
        return MarketSnapshot(snapshot_id, taken_at, tuple(sorted(offers, key=lambda o: (o.region, o.node))), key)


def scenario_names() -> list[str]:
    """Names of the bundled scenarios."""
    return sorted(_bundled_files())


def _bundled_files() -> dict[str, Path]:
    """Bundled scenario files by name (`core.yaml` before `core.yml`)."""
    files: dict[str, Path] = {}
    for p in sorted(paths.SCENARIOS_DIR.iterdir()):
        if p.suffix in SCENARIO_SUFFIXES and p.is_file():
            files.setdefault(p.stem, p)
    return files


def load_scenario(name_or_path: str | Path) -> Scenario:
    """Read and validate a scenario by bundled name (`core`) or by the path of a YAML file (any name; `.yaml`
    and `.yml` paths are always taken as files)."""
    text, path = str(name_or_path), Path(name_or_path)
    bundled = _bundled_files()
    if text in bundled and path.suffix not in SCENARIO_SUFFIXES and len(path.parts) == 1:
        path = bundled[text]
    elif path.suffix not in SCENARIO_SUFFIXES and not path.is_file():
        raise UnknownNameError("scenario (give a bundled name or the path of a .yaml/.yml file)", text, sorted(bundled))
    if not path.is_file():
        raise CatalogError(path, "-", "-", "scenario file not found", "check the path, or use a bundled scenario")
    stat = path.stat()
    return _parse(path.resolve(), stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=64)
def _parse(path: Path, _mtime_ns: int, _size: int) -> Scenario:
    """The scenario in `path` (cached per file version), every field checked where it enters."""
    from coral_dagster.catalog.models import model_catalog

    doc = read_yaml(path)
    if not isinstance(doc, dict):
        raise CatalogError(path, "-", "-", "expected a mapping at the top level", "see data/scenarios/core.yaml")
    _known_keys(doc, TOP_KEYS, path, "-")
    name: str = field(doc, "name", str, path, "-")
    if not _NAME.match(name):
        raise CatalogError(path, "-", "name", f"{name!r} is not a scenario name",
                           "use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit")
    description: str = field(doc, "description", str, path, "-", default="")
    node_configs = _node_configs(doc, path)
    regions = _str_list(doc, "regions", path)
    for region in regions:
        if not REGION_RE.match(region):
            raise CatalogError(path, "regions", "regions", f"region {region!r} is not cloud:region on aws or gcp",
                               "write regions like aws:us-east-2 or gcp:us-central1")
    catalog = model_catalog()
    tpl = _section(doc, "templates", TEMPLATE_KEYS, path)
    margins = {"slo_margin": _number(tpl, "slo_margin", path, "templates", 1.0, 0.0, 1.0, low_open=True)}
    t_hat_rule = tpl.get("t_hat_rule", "slo")
    if not isinstance(t_hat_rule, str) or t_hat_rule not in T_HAT_RULE_NAMES:
        raise CatalogError(path, "templates", "t_hat_rule", f"unknown T̂ rule {t_hat_rule!r}",
                           f"use one of {', '.join(T_HAT_RULE_NAMES)} (paper: the paper's per-stage rule; slo: ours)")
    rows = rows_of(doc, "models", path)
    if not rows:
        raise CatalogError(path, "-", "models", "the list is empty", "list at least one model (see core.yaml)")
    models = []
    for n, r in enumerate(rows):
        i = f"models[{n}]"
        _known_keys(r, MODEL_KEYS, path, i)
        alias: str = field(r, "model", str, path, i)
        base: str = field(r, "base", str, path, i, default=alias)
        if "base" in r:
            _served_model(alias, base, path, i)
        elif alias not in catalog:
            raise CatalogError(path, i, "model", f"unknown model {alias!r}",
                               f"use one of {', '.join(catalog)}, or serve it under its own name with "
                               "`base: <catalog model>`")
        trace: str = field(r, "trace", str, path, i)
        if trace not in TRACES:
            raise CatalogError(path, i, "trace", f"unknown trace {trace!r}", f"use one of {', '.join(TRACES)}")
        models.append(ScenarioModel(alias, _number(r, "prefill_slo_ms", path, i, ..., 0.0, MAX_SLO_MS, low_open=True),
                                    _number(r, "decode_slo_ms", path, i, ..., 0.0, MAX_SLO_MS, low_open=True), trace,
                                    _number(r, "rate_req_s", path, i, ..., 0.0, MAX_RATE_REQ_S, low_open=True),
                                    **margins, attainment_target=_attainment_target(r, path, i), base=base))
    check_unique([m.model for m in models], path, "model")
    check_unique(regions, path, "regions")
    supply = _availability(doc, path, regions, node_configs)
    alloc = _section(doc, "allocation", ALLOCATION_KEYS, path)
    link = doc.get("link_gbps")
    engine = doc.get("engine", "coral")
    if not isinstance(engine, str) or engine not in SERVING_ENGINES:
        raise CatalogError(path, "-", "engine", f"unknown serving engine {engine!r}",
                           f"use one of {', '.join(SERVING_ENGINES)}")
    return Scenario(
        name=name,
        description=description,
        regions=tuple(regions),
        node_configs=node_configs,
        models=tuple(models),
        availability_model=supply,
        n_max=int(_number(tpl, "n_max", path, "templates", 6, 1, MAX_N_MAX, integer=True)),
        rho=_number(tpl, "rho", path, "templates", 12.0, 1.0, MAX_RHO),
        headroom=_number(alloc, "headroom", path, "allocation", 1.1, 1.0, MAX_HEADROOM),
        replan_interval_min=_number(alloc, "replan_interval_min", path, "allocation", 6.0, 0.0, MAX_MINUTES,
                                    low_open=True),
        node_startup_min=_number(alloc, "node_startup_min", path, "allocation", 10.0, 0.0, MAX_MINUTES),
        link_gbps=None if link is None else _number(doc, "link_gbps", path, "-", ..., 0.0, MAX_LINK_GBPS,
                                                    low_open=True),
        path=str(path),
        engine=engine,
        t_hat_rule=t_hat_rule,
        day=_day(doc, path),
    )


def _day(doc: Section, path: Path) -> DaySpec | None:
    """The optional `day` section (data/scenarios/DAY.md), every field checked; None when absent."""
    if doc.get("day") is None:
        return None
    day = _section(doc, "day", DAY_KEYS, path)
    base = DaySpec()
    hourly = day.get("hourly", [])
    if not (isinstance(hourly, list) and len(hourly) in (0, 24)
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and 0 <= v <= 1
                    for v in hourly) and (not hourly or max(hourly) == 1)):
        raise CatalogError(path, "day", "hourly", f"{hourly!r} is not 24 factors in [0, 1] with a largest of 1",
                           "give one factor of the peak rate per hour of the day, 0:00 UTC first, the peak hour 1")
    if hourly and ("peak_hour" in day or "peak_to_trough" in day):
        raise CatalogError(path, "day", "hourly", "given together with peak_hour/peak_to_trough",
                           "describe the day either by hourly factors or by peak_hour and peak_to_trough, not both")
    bursts, spot = day.get("bursts", base.bursts), day.get("spot", base.spot)
    if not isinstance(bursts, bool):
        raise CatalogError(path, "day", "bursts", f"{bursts!r} is not true or false",
                           "write bursts: true (each window follows its trace's bursts) or false")
    if not isinstance(spot, bool):
        raise CatalogError(path, "day", "spot", f"{spot!r} is not true or false",
                           "write spot: true (nodes sold on spot run there and can be preempted) or false")
    return DaySpec(peak_hour=_number(day, "peak_hour", path, "day", base.peak_hour, 0.0, 24.0),
                   peak_to_trough=_number(day, "peak_to_trough", path, "day", base.peak_to_trough, 1.0, 1000.0),
                   hourly=tuple(float(v) for v in hourly), bursts=bursts,
                   boot_min=_number(day, "boot_min", path, "day", base.boot_min, 0.0, MAX_MINUTES),
                   setup_min=_number(day, "setup_min", path, "day", base.setup_min, 0.0, MAX_MINUTES),
                   weight_gbytes_per_s=_number(day, "weight_gbytes_per_s", path, "day", base.weight_gbytes_per_s,
                                               0.0, 1000.0, low_open=True), spot=spot,
                   preemptions_per_day=_number(day, "preemptions_per_day", path, "day", base.preemptions_per_day,
                                               0.0, 0.99))


def _served_model(name: str, base: str, path: Path, where: str) -> None:
    """A served model's entry: a name of its own (a scenario name, not a catalog model's) over a catalog base."""
    from coral_dagster.catalog.models import declare_served

    if not _NAME.match(name):
        raise CatalogError(path, where, "model", f"{name!r} is not a served model name",
                           "use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit")
    try:
        declare_served(name, base, str(path))
    except CoralError as exc:
        raise CatalogError(path, where, "base", exc.problem.rstrip("."), exc.fix) from None


def _availability(doc: Section, path: Path, regions: list[str], node_configs: tuple[NodeConfig, ...]) -> Availability:
    """The `availability` section: a profile (data/scenarios/MARKET.md), pinned counts and a series, each checked."""
    avail = _section(doc, "availability", AVAILABILITY_KEYS, path)
    profile = avail.get("profile", "uniform")
    if not isinstance(profile, str) or profile not in PROFILES:
        raise CatalogError(path, "availability", "profile", f"unknown availability profile {profile!r}",
                           f"use one of {', '.join(PROFILES)} (data/scenarios/MARKET.md)")
    for key in ("base_nodes", "gpu_factors", "size_factors") if profile == "uniform" else ("default_nodes",):
        if key in avail:
            raise CatalogError(path, "availability", key, f"does not apply to profile {profile!r}",
                               "give default_nodes with profile uniform; base_nodes, gpu_factors and size_factors "
                               "with profile market")
    gpus = sorted({n.gpu for n in node_configs})
    model = Availability(profile=profile, default_nodes=int(_number(avail, "default_nodes", path, "availability", 16,
                                                                    0, MAX_NODES, integer=True)))
    if profile == "market":
        gpu_factors = dict(model.gpu_factors)
        for gpu, f in _factors(avail, "gpu_factors", path).items():
            if gpu not in gpus:
                raise CatalogError(path, "availability", f"gpu_factors/{gpu}", "not a GPU of the scenario",
                                   f"use one of {', '.join(gpus)}")
            gpu_factors[gpu] = f
        size_factors = dict(model.size_factors)
        for size, f in _factors(avail, "size_factors", path).items():
            if size not in {str(k) for k in GPUS_PER_NODE}:
                raise CatalogError(path, "availability", f"size_factors/{size}", "not a node size",
                                   f"use GPU counts from {', '.join(map(str, GPUS_PER_NODE))}")
            size_factors[int(size)] = f
        model = replace(model, base_nodes=int(_number(avail, "base_nodes", path, "availability", model.base_nodes, 0,
                                                      MAX_NODES, integer=True)),
                        gpu_factors=tuple(sorted(gpu_factors.items())), size_factors=tuple(sorted(size_factors.items())))
    nodes_by_region = avail.get("nodes") or {}
    if not isinstance(nodes_by_region, dict):
        raise CatalogError(path, "availability", "nodes", f"{nodes_by_region!r} is not a mapping",
                           "write nodes: {REGION: {GPU:count: N, ...}}")
    overrides = []
    for region, nodes in nodes_by_region.items():
        if region not in regions:
            raise CatalogError(path, "availability", str(region), "region not in the scenario's regions",
                               f"use one of {', '.join(regions)}")
        if not isinstance(nodes, dict):
            raise CatalogError(path, "availability", str(region), f"{nodes!r} is not a mapping",
                               "write {GPU:count: N, ...} for the region")
        for node, k in nodes.items():
            config = _node_config(node, path, "availability", f"{region}/{node}")
            if config not in node_configs:
                raise CatalogError(path, "availability", f"{region}/{node}",
                                   "not one of the scenario's node configurations (nodes, or gpus x gpus_per_node)",
                                   f"use one of {', '.join(map(str, node_configs))}")
            overrides.append((region, config, int(_number(nodes, node, path, "availability", ..., 0, MAX_NODES,
                                                          integer=True))))
    return replace(model, nodes=tuple(overrides), series=_series(avail, path, gpus))


def _factors(avail: Section, key: str, path: Path) -> dict[str, float]:
    """A mapping of names (GPU types or node sizes) to factors in [0, MAX_FACTOR]."""
    value = avail.get(key) or {}
    if not isinstance(value, dict):
        raise CatalogError(path, "availability", key, f"{value!r} is not a mapping",
                           f"write {key}: {{NAME: factor, ...}} (data/scenarios/MARKET.md)")
    return {str(name): _number(value, name, path, f"availability/{key}", ..., 0.0, MAX_FACTOR) for name in value}


def _series(avail: Section, path: Path, gpus: list[str]) -> Series | None:
    """The optional availability series: window length in minutes and per-window multipliers (all GPUs, and per
    GPU type), every list as long as `multipliers`."""
    if "series" not in avail:
        return None
    doc = avail["series"]
    where = "availability/series"
    if not isinstance(doc, dict):
        raise CatalogError(path, where, "series", f"{doc!r} is not a mapping",
                           "write series: {window_min: 60, multipliers: [1, 0.5, ...]}")
    _known_keys(doc, SERIES_KEYS, path, where)
    window = _number(doc, "window_min", path, where, ..., 0.0, MAX_MINUTES, low_open=True)
    multipliers = _multipliers(doc.get("multipliers"), path, where, "multipliers")
    by_gpu = doc.get("gpus") or {}
    if not isinstance(by_gpu, dict):
        raise CatalogError(path, where, "gpus", f"{by_gpu!r} is not a mapping",
                           "write gpus: {GPU: [multiplier per window, ...]}")
    per_gpu = []
    for gpu, values in by_gpu.items():
        if gpu not in gpus:
            raise CatalogError(path, where, f"gpus/{gpu}", "not a GPU of the scenario", f"use one of {', '.join(gpus)}")
        row = _multipliers(values, path, where, f"gpus/{gpu}")
        if len(row) != len(multipliers):
            raise CatalogError(path, where, f"gpus/{gpu}", f"{len(row)} windows where multipliers has "
                               f"{len(multipliers)}", "give one multiplier per window, as many as in multipliers")
        per_gpu.append((str(gpu), row))
    return Series(window, multipliers, tuple(per_gpu))


def _multipliers(values: object, path: Path, where: str, key: str) -> tuple[float, ...]:
    """A non-empty list of at most MAX_WINDOWS finite factors in [0, MAX_FACTOR]."""
    if not (isinstance(values, list) and 0 < len(values) <= MAX_WINDOWS
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and
                    0 <= v <= MAX_FACTOR for v in values)):
        raise CatalogError(path, where, key, f"{values!r} is not a list of 1 to {MAX_WINDOWS:,} multipliers in "
                           f"[0, {MAX_FACTOR:g}]", "give one number per window, e.g. [1, 0.75, 0.5, 0.75]")
    return tuple(float(v) for v in values)


def _section(doc: Section, key: str, known: frozenset[str], path: Path) -> Section:
    """An optional mapping under `key` whose keys are all known."""
    value = doc.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise CatalogError(path, key, key, f"{value!r} is not a mapping", f"write {key}: {{...}} (see core.yaml)")
    _known_keys(value, known, path, key)
    return value


def _known_keys(doc: Section, known: frozenset[str], path: Path, row: object) -> None:
    """A misspelt key would be ignored silently, so every key must be one the scenario format has."""
    for key in doc:
        if key not in known:
            raise CatalogError(path, row, str(key), "unknown key", f"use one of {', '.join(sorted(known))}")


def _number(doc: Section, key: str, path: Path, row: object, default: float | EllipsisType, low: float, high: float,
            *, low_open: bool = False, integer: bool = False) -> float:
    """A finite number (an integer when `integer`) in [low, high] ((low, high] when `low_open`)."""
    value = field(doc, key, int if integer else (int, float), path, row, default=default)
    inside = (value > low if low_open else value >= low) and value <= high
    if not inside:
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise CatalogError(path, row, key, f"{value!r} is outside {interval}",
                           f"give {key} a{'n integer' if integer else ' number'} in {interval}")
    return value if integer else float(value)


def _attainment_target(row: Section, path: Path, where: str) -> float:
    """The share of a model's requests that must meet both SLOs (default 0.95), in (0, 1)."""
    value = _number(row, "attainment_target", path, where, 0.95, 0.0, 1.0, low_open=True)
    if value >= 1.0:
        raise CatalogError(path, where, "attainment_target", f"{value:g} is not below 1",
                           "give the share of requests that must meet their SLOs, e.g. 0.95 (1 needs unbounded capacity)")
    return value


def _node_configs(doc: dict, path: Path) -> tuple[NodeConfig, ...]:
    """The scenario's node configurations: `nodes` as listed (e.g. only those its regions sell), else every
    configuration of `gpus` × `gpus_per_node`."""
    if "nodes" in doc:
        if "gpus" in doc or "gpus_per_node" in doc:
            raise CatalogError(path, "-", "nodes", "given together with gpus/gpus_per_node",
                               "list the node configurations either as nodes: [GPU:count, ...] or as gpus and "
                               "gpus_per_node, not both")
        names = _str_list(doc, "nodes", path)
        check_unique(names, path, "nodes")
        configs = tuple(_node_config(n, path, "nodes", n) for n in names)
        for n in configs:
            if n.gpu not in gpu_catalog():
                raise CatalogError(path, "nodes", str(n), f"unknown GPU {n.gpu!r}",
                                   f"use one of {', '.join(gpu_catalog())}")
        return configs
    gpus = _str_list(doc, "gpus", path)
    for g in gpus:
        if g not in gpu_catalog():
            raise CatalogError(path, "gpus", "gpus", f"unknown GPU {g!r}", f"use one of {', '.join(gpu_catalog())}")
    check_unique(gpus, path, "gpus")
    counts = doc.get("gpus_per_node", list(GPUS_PER_NODE))
    if (not isinstance(counts, list) or not counts or len(set(map(repr, counts))) != len(counts)
            or any(isinstance(c, bool) or c not in GPUS_PER_NODE for c in counts)):
        raise CatalogError(path, "gpus_per_node", "gpus_per_node",
                           f"{counts!r} is not a non-empty subset of {list(GPUS_PER_NODE)}",
                           "list GPU counts from 1, 2, 4, 8, each once")
    return tuple(NodeConfig(g, c) for g in gpus for c in counts)


def _node_config(text: object, path: Path, section: str, where: str) -> NodeConfig:
    try:
        return NodeConfig.parse(str(text))
    except CoralError as exc:
        raise CatalogError(path, section, where, f"{text!r} is not a node configuration ({exc.problem})",
                           f"write GPU:count, e.g. L4:2 ({exc.fix})") from None


def _str_list(doc: dict, key: str, path: Path) -> list[str]:
    value = doc.get(key)
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise CatalogError(path, key, key, f"expected a non-empty list of names, got {value!r}", f"add '{key}: [...]'")
    return value


@lru_cache(maxsize=64)
def _file_digest(path: Path, _mtime_ns: int, _size: int) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _sources_digest(traces: tuple[str, ...]) -> str:
    """A digest of the data files templates are computed from: GPU and model catalogs, the performance model's
    fit and measured tables, and the traces whose request lengths shape the workloads."""
    from coral_dagster.catalog.traces import TRACE_FILES
    from coral_dagster.paths import FIT_FILE, MEASURED_FILES

    files = [paths.CATALOG_DIR / "gpus.yaml", paths.CATALOG_DIR / "models.yaml", paths.PROFILES_DIR / FIT_FILE,
             *(paths.PROFILES_DIR / f for f in MEASURED_FILES), *(paths.TRACES_DIR / TRACE_FILES[t] for t in traces)]
    parts = []
    for f in files:
        stat = f.stat() if f.is_file() else None
        parts.append(f"{f.name}:{_file_digest(f, stat.st_mtime_ns, stat.st_size) if stat else 'missing'}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()
