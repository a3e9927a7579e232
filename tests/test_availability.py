"""Availability as data/scenarios/MARKET.md states it: the bundled counts against the document's own table, the
series window by window, and every bad `availability` field named with its file, value and fix."""

from __future__ import annotations

import math
import re
from datetime import datetime, timedelta, timezone

import pytest
import yaml

from coral_dagster import paths
from coral_dagster.catalog.nodes import NodeConfig
from coral_dagster.catalog.scenarios import load_scenario
from coral_dagster.errors import CatalogError

CORE = yaml.safe_load((paths.SCENARIOS_DIR / "core.yaml").read_text())
MARKET = (paths.SCENARIOS_DIR / "MARKET.md").read_text()


def _market_table() -> dict[NodeConfig, int]:
    """MARKET.md §4's table of nodes per region, read from the document: {GPU:k: count}."""
    section = MARKET.split("## 4.")[1].split("## 5.")[0]
    counts = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 5 and cells[1].isdigit():
            for gpu in cells[0].split(", "):
                counts.update({NodeConfig(gpu, k): int(v) for k, v in zip((1, 2, 4, 8), cells[1:])})
    return counts


@pytest.mark.parametrize("name", ["core", "extended"])
def test_bundled_counts_are_the_documents_table(name):
    """Every offer of the bundled market-profile scenarios has the count MARKET.md §4 prints for its node."""
    table = _market_table()
    scn = load_scenario(name)
    offers = scn.market(window=0).offers
    assert offers and {o.node.gpu for o in offers} <= {n.gpu for n in table}
    for o in offers:
        assert o.available_nodes == table[o.node], (o.region, str(o.node))


def test_the_document_orders_tiers_and_sizes():
    """MARKET.md's premise, on its own table: a scarcer tier never has more nodes of a size, and a larger size
    never more GPUs than a smaller one of the same type, except the one node every sold configuration keeps."""
    table = _market_table()
    tiers = [["L4", "A10G", "T4"], ["L40S", "A40", "V100"], ["A100", "A100-80GB"], ["H100"], ["H200"]]
    for upper, lower in zip(tiers, tiers[1:]):
        for k in (1, 2, 4, 8):
            assert min(table[NodeConfig(g, k)] for g in upper) >= max(table[NodeConfig(g, k)] for g in lower)
    for g in {n.gpu for n in table}:
        for small, large in zip((1, 2, 4), (2, 4, 8)):
            n_large = table[NodeConfig(g, large)]
            assert n_large * large <= table[NodeConfig(g, small)] * small or n_large == 1, (g, large)


def _write(tmp_path, availability, name="s.yaml"):
    doc = {**CORE, "availability": availability}
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc))
    return path


def test_series_scales_each_window_and_follows_time(tmp_path):
    """Counts in window i are ⌊base × the window's multiplier⌋, per GPU where the series names the GPU; a moment
    falls in window ⌊minutes since the epoch / window⌋ mod length."""
    mult, l40s = [1.0, 0.5, 0.25], [0.9, 0.0, 2.0]
    path = _write(tmp_path, {"profile": "uniform", "default_nodes": 10,
                             "series": {"window_min": 30, "multipliers": mult, "gpus": {"L40S": l40s}}})
    scn = load_scenario(path)
    for w in range(7):
        snap = scn.market(window=w)
        for o in snap.offers:
            factor = (l40s if o.node.gpu == "L40S" else mult)[w % 3]
            assert o.available_nodes == math.floor(10 * factor)
    start = datetime(2026, 1, 1, tzinfo=timezone.utc)
    for minutes in (0, 29, 30, 61, 95, 24 * 60 + 31):
        when = start + timedelta(minutes=minutes)
        expected = int(when.timestamp() // 1800) % 3
        assert scn.market(taken_at=when).snapshot_id.endswith(f"-w{expected}")
        assert scn.market(taken_at=when).availability("aws:us-east-2", NodeConfig("L4", 1)) == \
            math.floor(10 * mult[expected])


def test_pinned_counts_win_over_the_profile(tmp_path):
    path = _write(tmp_path, {"profile": "market", "base_nodes": 40, "gpu_factors": {"L40S": 0.25},
                             "size_factors": {8: 0.5}, "nodes": {"aws:us-east-2": {"L4:1": 3}}})
    snap = load_scenario(path).market()
    assert snap.availability("aws:us-east-2", NodeConfig("L4", 1)) == 3
    assert snap.availability("aws:ap-northeast-2", NodeConfig("L4", 1)) == 40
    assert snap.availability("aws:us-east-2", NodeConfig("L40S", 1)) == 10
    assert snap.availability("aws:us-east-2", NodeConfig("L4", 8)) == 20
    assert snap.availability("aws:us-east-2", NodeConfig("L40S", 4)) == 1  # ⌊40 × 0.25 × 0.125⌋ = 1


GOOD_SERIES = {"window_min": 60, "multipliers": [1, 0.5]}
BAD = [
    ({"profile": "scarce"}, "profile"),
    ({"profile": "market", "default_nodes": 4}, "default_nodes"),
    ({"profile": "uniform", "base_nodes": 4}, "base_nodes"),
    ({"profile": "market", "gpu_factors": {"H100": 0.5}}, "gpu_factors/H100"),
    ({"profile": "market", "gpu_factors": {"L4": -1}}, "L4"),
    ({"profile": "market", "gpu_factors": [1, 2]}, "gpu_factors"),
    ({"profile": "market", "size_factors": {3: 0.5}}, "size_factors/3"),
    ({"profile": "market", "size_factors": {8: float("nan")}}, 8),
    ({"profile": "market", "base_nodes": 1.5}, "base_nodes"),
    ({"quota": 3}, "quota"),
    ({"series": [1, 0.5]}, "series"),
    ({"series": {"multipliers": [1]}}, "window_min"),
    ({"series": {**GOOD_SERIES, "window_min": 0}}, "window_min"),
    ({"series": {**GOOD_SERIES, "multipliers": []}}, "multipliers"),
    ({"series": {**GOOD_SERIES, "multipliers": [1, -0.5]}}, "multipliers"),
    ({"series": {**GOOD_SERIES, "multipliers": [1, float("inf")]}}, "multipliers"),
    ({"series": {**GOOD_SERIES, "multipliers": [1, True]}}, "multipliers"),
    ({"series": {**GOOD_SERIES, "multipliers": "1, 0.5"}}, "multipliers"),
    ({"series": {**GOOD_SERIES, "gpus": {"L40S": [1]}}}, "gpus/L40S"),
    ({"series": {**GOOD_SERIES, "gpus": {"H100": [1, 1]}}}, "gpus/H100"),
    ({"series": {**GOOD_SERIES, "window": 60}}, "window"),
]


@pytest.mark.parametrize("availability,field", BAD, ids=[str(a) for a, _ in BAD])
def test_bad_availability_names_file_field_and_fix(tmp_path, availability, field):
    path = _write(tmp_path, availability)
    with pytest.raises(CatalogError) as err:
        load_scenario(path)
    text = str(err.value)
    assert str(field) in str(err.value.field) and str(path) in text and "Fix:" in text


def test_every_number_in_the_bundled_availability_points_to_the_document():
    """The bundled scenarios' availability sections say where their numbers come from."""
    for name in ("core", "extended", "core-uniform", "mega"):
        text = (paths.SCENARIOS_DIR / f"{name}.yaml").read_text()
        block = re.search(r"^availability:\n((?:  .*\n)+)", text, re.M).group(1)
        assert "MARKET.md" in block, name


def _document_factors() -> tuple[dict[str, float], dict[int, float], int]:
    """MARKET.md's GPU factors (§2), size factors (§3) and base_nodes (§4), read from the document."""
    gpu, size = {}, {}
    for line in MARKET.split("## 2.")[1].split("## 3.")[0].splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 3 and re.fullmatch(r"[\d.]+", cells[1]):
            gpu.update({g: float(cells[1]) for g in cells[0].split(", ")})
    section = MARKET.split("## 3.")[1].split("## 4.")[0]
    sizes = next(line for line in section.splitlines() if line.startswith("| GPUs per node"))
    factors = next(line for line in section.splitlines() if line.startswith("| factor (nodes)"))
    for k, f in zip(sizes.strip("|").split("|")[1:], factors.strip("|").split("|")[1:]):
        size[int(k)] = float(f)
    base = int(re.search(r"`base_nodes` = (\d+)", MARKET).group(1))
    return gpu, size, base


@pytest.mark.parametrize("gpu_power,size_power", [(0, 0), (1, 1), (2, 1), (1, 2), (0.5, 0)])
def test_map_shapes_are_the_documents_factors_raised_to_powers(gpu_power, size_power):
    """The map's shapes (bench.heterogeneity) against MARKET.md's numbers: power 0 removes that scarcity,
    1 is the document's shape, 2 squares each factor."""
    from coral_dagster.catalog.availability import Availability

    gpu, size, base = _document_factors()
    shaped = Availability(profile="market", base_nodes=base).with_shape(gpu_power, size_power)
    for g, f in gpu.items():
        for k, s in size.items():
            expected = max(1, math.floor(base * f ** gpu_power * s ** size_power + 1e-9))
            assert shaped.count("aws:us-east-2", NodeConfig(g, k)) == expected, (g, k)
